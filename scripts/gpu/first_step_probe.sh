#!/usr/bin/env bash
# Where a fresh process's first model step goes (the GPU demo's reintegrate
# phase), under eager and lazy module loading.  Run from the repo root with
# $OUT set; writes $OUT/first_step_probe.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
timeout -k 5 200 python3 scripts/first_step_probe.py "$OUT/first_step_probe.json"
