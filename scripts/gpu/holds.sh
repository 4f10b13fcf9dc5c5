#!/usr/bin/env bash
# Issue 31's device-counted trigger on the H200, repeated: the epochs a trigger
# takes while the caller queues steps (no gate) hold one point of the caller's
# stream (regions.streams.Holds), and a hold that times out refuses its epoch;
# the holds' kernels against their numpy twin.  The race this mends showed in
# about one run of the suite in two, so the trigger's test (3 trials a run)
# runs in HOLDS_ROUNDS processes (default 4).
# Run through scripts/gpu_suite.sh (wheels and this tree installed, $OUT set):
#   bash scripts/gpu_suite.sh holds
# Writes $OUT/holds.txt (pytest's output and summary line of each round).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
status=0
for round in $(seq "${HOLDS_ROUNDS:-4}"); do
  echo "--- round $round" >> "$OUT/holds.txt"
  python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -k "hold" \
    tests/gpu_kernels/test_gpu.py tests/session/test_executor_session.py >> "$OUT/holds.txt" 2>&1 || status=1
  tail -n 1 "$OUT/holds.txt"
done
exit $status
