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
