#!/usr/bin/env bash
# Where the device trigger's hold of a decode step goes (issue 32):
# scripts/trigger_phases_probe.py on TRIGGER_ROWS (default every_step_resident)
# for TRIGGER_STEPS steps (default 128), each epoch's phases stamped on the
# device.  Writes $OUT/trigger-phases.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
python3 scripts/trigger_phases_probe.py "${TRIGGER_ROWS:-every_step_resident}" "${TRIGGER_STEPS:-128}" \
  > "$OUT/trigger-phases.txt" 2>&1
rc=$?
cat "$OUT/trigger-phases.txt"
exit $rc
