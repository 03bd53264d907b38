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
say() { echo "setup: $*" >&2; }
say "installing gpu-trace into .venv with its dev extras (torch, tensorflow-cpu, chDB: minutes the first time, seconds after)"
python -m pip install -q --upgrade pip "setuptools>=69" wheel
# torch is pinned in the extras: an unpinned torch would pull several GB of CUDA packages.
# setuptools warns at every editable install that folders named like the package may shadow it:
# the package-dir mapping is deliberate (pyproject.toml), so that warning is left out.
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[dev,torch,tf]"
say "fetching CUDA 13 build headers for the CUPTI library's tests (once)"
bash scripts/cuda_headers.sh  # headers only, no libraries
# The dashboard's browser tests (tests/browser) drive Debian's Chromium; install it where we can
# (root, apt-get) and it is missing. Elsewhere those tests skip and say why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
fi
