#!/usr/bin/env bash
# Set up everything on a fresh machine, then run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
python scripts/typecheck.py   # mypy over the package (pyproject.toml [tool.mypy]); fails the run
python -m pytest -q -p no:cacheprovider "$@"
