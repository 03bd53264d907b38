#!/usr/bin/env bash
# Create .venv (if missing) and install gpu-trace with its dev extras into it. Idempotent.
# Sourced by test.sh and demo.sh; safe to run by hand.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip "setuptools>=69" wheel
# torch is pinned in the extras: an unpinned torch would pull several GB of CUDA packages.
python -m pip install -q -e ".[dev,torch,tf]"
# CUDA 13 build headers (no libraries) for the tests that compile the CUPTI injection library.
bash scripts/cuda_headers.sh
# The dashboard's browser tests (tests/browser) drive Debian's Chromium; install it where we can
# (root, apt-get) and it is missing. Elsewhere those tests skip and say why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
fi
