#!/usr/bin/env bash
# The device's epochs on the H200 (issue 31): the persistent kernel's EPOCH
# handler into an arena (tests/executor/test_device_epoch.py), a pending
# epoch committed by its own pass (table.cu's table_commit,
# tests/session/test_pending_epoch.py), the resident route, the step trigger
# at the producer's gate (tests/session/test_step_trigger.py) and a static
# cache's positions from length words (table_positions,
# tests/checkpoint/test_positions_detector.py).  Run only when named; the
# whole GPU suite (house part) runs them too.  Writes $OUT/device-epoch.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
python3 -m pytest -m gpu -v -p no:cacheprovider tests/executor/test_device_epoch.py \
  tests/session/test_pending_epoch.py tests/session/test_arena_route.py tests/session/test_executor_session.py \
  tests/session/test_step_trigger.py tests/checkpoint/test_positions_detector.py \
  > "$OUT/device-epoch.txt" 2>&1
rc=$?
tail -n 60 "$OUT/device-epoch.txt"
exit $rc
