#!/usr/bin/env bash
# Each kernel of a decode step's table pass timed on the device as the cache
# grows (issue 32's positions detector): scripts/gpu/table_plan_probe.py with
# TABLE_PLAN_CTXS (default 641,4096,8192) and TABLE_PLAN_STEPS (40).  With
# TABLE_PLAN_BEFORE (a folder holding an earlier tree, `git archive` of its
# commit, carried along, never committed) the same probe runs on that tree
# first, installed beside this one in /tmp/site-before.
# Writes $OUT/table-plan[-before].json and .txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
ctxs=${TABLE_PLAN_CTXS:-641,4096,8192}
steps=${TABLE_PLAN_STEPS:-40}
rc=0
if [ -n "${TABLE_PLAN_BEFORE:-}" ]; then
  rm -rf /tmp/site-before
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-before \
    "$TABLE_PLAN_BEFORE" || { echo "table_plan_probe: installing $TABLE_PLAN_BEFORE failed"; exit 2; }
  echo "--- before ($TABLE_PLAN_BEFORE)"
  PYTHONPATH=/tmp/site-before:$PYTHONPATH python3 scripts/gpu/table_plan_probe.py "$ctxs" "$steps" \
    "$OUT/table-plan-before.json" > "$OUT/table-plan-before.txt" 2>&1 || rc=$?
  cat "$OUT/table-plan-before.txt"
  echo "--- this tree"
fi
python3 scripts/gpu/table_plan_probe.py "$ctxs" "$steps" "$OUT/table-plan.json" > "$OUT/table-plan.txt" 2>&1 || rc=$?
cat "$OUT/table-plan.txt"
exit $rc
