#!/usr/bin/env bash
# Where a protected Qwen3's in-place recovery spends its time on the H200
# (issue 30): scripts/recovery_probe.py at RECOVERY_PROBE_CTX tokens (default
# 8192) x 8, the restore under cProfile.  Writes $OUT/recovery-probe.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
python3 scripts/recovery_probe.py "$OUT/recovery-probe.txt" "${RECOVERY_PROBE_CTX:-8192}" 8
