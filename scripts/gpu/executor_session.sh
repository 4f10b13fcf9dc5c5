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
# Another selection (scripts/gpu/executor_recover.sh is one): EXECUTOR_SESSION_TESTS,
# the pytest arguments; EXECUTOR_SESSION_PARTS, the bench's --parts; EXECUTOR_SESSION_NAME,
# the name of its outputs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
# Modules load at cuModuleLoad time, never lazily beside a resident kernel.
export CUDA_MODULE_LOADING=EAGER
name=${EXECUTOR_SESSION_NAME:-executor-session}
parts=()
[ -n "${EXECUTOR_SESSION_PARTS:-}" ] && parts=(--parts "$EXECUTOR_SESSION_PARTS")
status=0
# (the test arguments are split into words)
timeout -k 5 "${EXECUTOR_SESSION_TESTS_S:-60}" python3 -m pytest ${EXECUTOR_SESSION_TESTS:-tests/session/test_executor_session.py -m gpu} \
  -q -p no:cacheprovider -o addopts= -rs --junitxml="$OUT/$name-pytest.xml" 2>&1 | tee "$OUT/$name-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 "${EXECUTOR_SESSION_BENCH_S:-170}" python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench executor-session \
  "${parts[@]}" --out "$OUT/$name.json" --force 2> "$OUT/$name-bench.err" | tee "$OUT/$name-bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$OUT/$name-bench.err"
exit $status
