#!/usr/bin/env bash
# The resident executor driving a Session on the GPU machine: the gpu-marked
# tests of tests/session/test_executor_session.py (a CuPy session through the
# resident executor, the instrumented-launch and device step counters of the
# triggers), then `bench executor-session` into $OUT/executor-session.json (to
# be copied to docs/results/executor-session.json): the stall (300 decode steps
# queued on the device and counted there while the caller's thread spins 200 ms
# in pure Python; epochs committed by the trigger, each recovered and compared),
# checkpoint latency host vs resident for 1 and 1024 regions of CuPy arrays, and
# fp16 GEMM / GEMV / streaming slowdown with a persistent kernel resident and
# idle beside the Session.
# Run from the repo root with $OUT set; under four minutes, every step bounded.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
# Modules load at cuModuleLoad time, never lazily beside a resident kernel.
export CUDA_MODULE_LOADING=EAGER
status=0
timeout -k 5 60 python3 -m pytest tests/session/test_executor_session.py -m gpu -q -p no:cacheprovider -o addopts= -rs \
  --junitxml="$OUT/executor-session-pytest.xml" 2>&1 | tee "$OUT/executor-session-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 "${EXECUTOR_SESSION_BENCH_S:-170}" python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench executor-session \
  --out "$OUT/executor-session.json" --force 2> "$OUT/executor-session-bench.err" | tee "$OUT/executor-session-bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$OUT/executor-session-bench.err"
exit $status
