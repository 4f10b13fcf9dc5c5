#!/usr/bin/env bash
# What the pause gate may assume about %gridid order across streams and about
# L1 lines shared by grids running at once.  Run from the repo root with $OUT
# set; writes $OUT/gridid_probe.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
# grid B must not wait for a lazily loaded function while grid A spins
export CUDA_MODULE_LOADING=EAGER
timeout -k 5 60 python3 scripts/gridid_probe.py "$OUT/gridid_probe.json"
