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
# Another selection: EXECUTOR_SESSION_TESTS, the pytest arguments; EXECUTOR_SESSION_PARTS,
# the bench's --parts; EXECUTOR_SESSION_NAME, the name of its outputs under $OUT;
# EXECUTOR_SESSION_TESTS_S and _BENCH_S, their limits.  Or a preset as the first
# argument (its part is a one-line script: executor_auto.sh, executor_recover.sh):
#   auto     the default session deciding its path (`--parts device`, the arena route's tests)
#   recover  RECOVER on the device (`--parts recover`, the ring recovery's tests)
# whose settings EXECUTOR_<PRESET>_TESTS, _TESTS_S and _BENCH_S (e.g. EXECUTOR_AUTO_BENCH_S) change.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
# Modules load at cuModuleLoad time, never lazily beside a resident kernel.
export CUDA_MODULE_LOADING=EAGER
preset=${1:-}
case "$preset" in
  "") d_name=executor-session d_parts="" d_tests="tests/session/test_executor_session.py -m gpu" d_tests_s=60 d_bench_s=170 ;;
  auto) d_name=executor-auto d_parts=device d_tests="tests/session/test_arena_route.py -m gpu" d_tests_s=60 d_bench_s=150 ;;
  recover) d_name=executor-recover d_parts=recover d_tests_s=90 d_bench_s=100
    d_tests="tests/session/test_restore_ring_gpu.py tests/session/test_restore_ring.py" ;;
  *) echo "executor_session.sh: no preset '$preset' (auto, recover)"; exit 2 ;;
esac
P=EXECUTOR_${preset^^}_   # a preset's own settings, e.g. EXECUTOR_AUTO_BENCH_S
own() { local v="$P$1"; [ -n "$preset" ] && [ -n "${!v:-}" ] && echo "${!v}" || echo "$2"; }
name=${EXECUTOR_SESSION_NAME:-$d_name}
tests=${EXECUTOR_SESSION_TESTS:-$(own TESTS "$d_tests")}
tests_s=${EXECUTOR_SESSION_TESTS_S:-$(own TESTS_S "$d_tests_s")}
bench_s=${EXECUTOR_SESSION_BENCH_S:-$(own BENCH_S "$d_bench_s")}
part=${EXECUTOR_SESSION_PARTS:-$d_parts}
parts=()
[ -n "$part" ] && parts=(--parts "$part")
status=0
# (the test arguments are split into words)
timeout -k 5 "$tests_s" python3 -m pytest $tests \
  -q -p no:cacheprovider -o addopts= -rs --junitxml="$OUT/$name-pytest.xml" 2>&1 | tee "$OUT/$name-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 "$bench_s" python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench executor-session \
  "${parts[@]}" --out "$OUT/$name.json" --force 2> "$OUT/$name-bench.err" | tee "$OUT/$name-bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$OUT/$name-bench.err"
exit $status
