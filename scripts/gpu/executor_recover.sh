#!/usr/bin/env bash
# Issue 31's RECOVER on the device, on the GPU machine: the gpu-marked tests of
# the ring recovery (tests/session/test_restore_ring_gpu.py, and the CPU twin's
# tests beside them), then `bench executor-session --parts recover` into
# $OUT/executor-recover.json: a resident session's recovery onto the device
# (one RECOVER task of a persistent kernel) against the host path's pipeline,
# both through Session.recover(into=) of CuPy targets, at 64 MiB and 1 GiB.
# Run from the repo root with $OUT set:
#   PART_LIMIT_S_executor_recover=200 bash scripts/gpu_suite.sh executor_recover
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
export CUDA_MODULE_LOADING=EAGER
status=0
timeout -k 5 "${EXECUTOR_RECOVER_TESTS_S:-90}" python3 -m pytest tests/session/test_restore_ring_gpu.py \
  tests/session/test_restore_ring.py -q -p no:cacheprovider -o addopts= -rs \
  2>&1 | tee "$OUT/executor-recover-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 "${EXECUTOR_RECOVER_BENCH_S:-100}" python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench executor-session \
  --parts recover --out "$OUT/executor-recover.json" --force 2> "$OUT/executor-recover-bench.err" \
  | tee "$OUT/executor-recover-bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$OUT/executor-recover-bench.err"
exit $status
