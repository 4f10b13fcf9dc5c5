#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite. GPU tests skip, with
# their reason, on a machine without a CUDA device. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 -q "$@"
