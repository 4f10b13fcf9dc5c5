#!/usr/bin/env bash
# PTX instrumentation on the GPU machine: the gpu-marked tests (identical
# results, epoch counts, store-tracked dirty pages = shadow diff, pause gate on
# CuPy and PyTorch stream work, the LD_PRELOAD shim under CuPy, PyTorch and
# Triton), then the overhead benchmark.  Run from the repo root with $OUT set;
# writes $OUT/instrument-probe.txt (and CuPy's compiler sources under
# $OUT/probe/), $OUT/instrument-tests.txt, $OUT/instrument-pytest.xml and
# $OUT/instrument.json.  About three minutes at most.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
mkdir -p "$OUT"
export CUPY_CACHE_IN_MEMORY=1
# Every module loads when it is loaded, never lazily while a launch is held at the gate.
export CUDA_MODULE_LOADING=EAGER
status=0
# What this CuPy does with the hook in place (compile path, driver linkage,
# a shim child's report): the log's first section, for when a test fails.
timeout -k 5 35 python3 tests/instrument/gpu_probe.py 2>&1 | tee "$OUT/instrument-probe.txt"
timeout -k 5 100 python3 -m pytest tests/instrument -m gpu -q -p no:cacheprovider -o addopts= -rs \
  --junitxml="$OUT/instrument-pytest.xml" 2>&1 | tee "$OUT/instrument-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 90 python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench instrument --json \
  --out "$OUT/instrument.json" --force > /dev/null 2> "$OUT/instrument-bench.err" || status=1
cat "$OUT/instrument-bench.err"
exit $status
