#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: `concordia demo` with its
# defaults (a file log in ./concordia-data, the GPU when one is present, else the CPU).
# Extra arguments go to `concordia demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/concordia demo "$@"
