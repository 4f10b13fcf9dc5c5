#!/usr/bin/env bash
# The persistent executor on the GPU machine: the gpu-marked executor tests
# (protocol with a million tasks, back-pressure, idle release and relaunch,
# STOP while busy, hot swap across modules under load, watchdog, handlers
# against their numpy twins, the cuBLAS SM target held while resident), then
# `bench executor` into $OUT/executor.json (with the SM-target rows, a carve-out
# sweep and PyTorch's GEMM beside a resident block).
# Run from the repo root with $OUT set; under three minutes, every step bounded
# by `timeout` as well as by the executor's own deadlines.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
# Modules load at cuModuleLoad time, never lazily beside a resident kernel.
export CUDA_MODULE_LOADING=EAGER
status=0
timeout -k 5 100 python3 -m pytest tests/executor -m gpu -q -p no:cacheprovider -o addopts= -rs \
  --junitxml="$OUT/executor-pytest.xml" 2>&1 | tee "$OUT/executor-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "${EXECUTOR_BENCH:-1}" != 0 ]; then  # EXECUTOR_BENCH=0: the tests alone
  timeout -k 5 120 python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench executor \
    --out "$OUT/executor.json" --force 2> "$OUT/executor-bench.err" | tee "$OUT/executor-bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  cat "$OUT/executor-bench.err"
fi
exit $status
