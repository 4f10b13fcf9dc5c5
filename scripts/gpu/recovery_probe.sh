#!/usr/bin/env bash
# Where a protected Qwen3's in-place recovery spends its time on the H200
# (issue 30): scripts/recovery_probe.py at RECOVERY_PROBE_CTX tokens (default
# 8192) x 8, the restore under cProfile.  Writes $OUT/recovery-probe.txt.
# RECOVERY_PROBE_TESTS names GPU test files to run first (within
# RECOVERY_PROBE_TESTS_S seconds, default 90), into $OUT/recovery-probe-tests.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
rc=0
if [ -n "${RECOVERY_PROBE_TESTS:-}" ]; then
  timeout -k 5 "${RECOVERY_PROBE_TESTS_S:-90}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    $RECOVERY_PROBE_TESTS > "$OUT/recovery-probe-tests.txt" 2>&1 || rc=1
  tail -n 5 "$OUT/recovery-probe-tests.txt"
fi
python3 scripts/recovery_probe.py "$OUT/recovery-probe.txt" "${RECOVERY_PROBE_CTX:-8192}" 8 || rc=1
grep -E '^(ctx|round|  phase)' "$OUT/recovery-probe.txt"
exit $rc
