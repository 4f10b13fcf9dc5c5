#!/usr/bin/env bash
# Each kernel of a decode step's table pass timed on the device as the cache
# grows (issue 32's positions detector): scripts/gpu/table_plan_probe.py with
# TABLE_PLAN_CTXS (default 641,4096,8192) and TABLE_PLAN_STEPS (40).
# Writes $OUT/table-plan.json and $OUT/table-plan.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
python3 scripts/gpu/table_plan_probe.py "${TABLE_PLAN_CTXS:-641,4096,8192}" "${TABLE_PLAN_STEPS:-40}" \
  "$OUT/table-plan.json" > "$OUT/table-plan.txt" 2>&1
rc=$?
cat "$OUT/table-plan.txt"
exit $rc
