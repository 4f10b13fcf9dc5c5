#!/usr/bin/env bash
# What the staging kernel's GF(2) arithmetic costs on the device (issue 32):
# scripts/gf2_cost_probe.py with GF2_ARGS (default: 3,584 pages of 1 KiB in
# regions of 10,256 pages, 50 launches).  Writes $OUT/gf2-cost.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
python3 scripts/gf2_cost_probe.py ${GF2_ARGS:-} > "$OUT/gf2-cost.txt" 2>&1
rc=$?
cat "$OUT/gf2-cost.txt"
exit $rc
