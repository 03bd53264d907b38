#!/usr/bin/env bash
# Set up everything on a fresh machine, then record the built-in demo into the embedded store,
# summarize it and export a Chrome trace.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
gpu-trace demo "$@"
