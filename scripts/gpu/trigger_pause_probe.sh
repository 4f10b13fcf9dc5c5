#!/usr/bin/env bash
# Why a resident session's device trigger stops taking epochs on the H200
# (issue 32): scripts/trigger_pause_probe.py on TRIGGER_ROWS (default
# every_8_resident) for TRIGGER_STEPS steps (default 128).  Writes $OUT/trigger-pause.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
python3 scripts/trigger_pause_probe.py "${TRIGGER_ROWS:-every_8_resident}" "${TRIGGER_STEPS:-128}" \
  > "$OUT/trigger-pause.txt" 2>&1
rc=$?
cat "$OUT/trigger-pause.txt"
exit $rc
