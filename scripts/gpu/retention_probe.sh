#!/usr/bin/env bash
# Retention's host work at every-step checkpoints of the Qwen3-0.6B shape on
# the H200, without the model's forward (issue 32): scripts/retention_probe.py
# for RETENTION_PROBE_STEPS steps (default 128).  Writes $OUT/retention-probe.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
python3 scripts/retention_probe.py "${RETENTION_PROBE_STEPS:-128}" cuda > "$OUT/retention-probe.txt" 2>&1
rc=$?
cat "$OUT/retention-probe.txt"
exit $rc
