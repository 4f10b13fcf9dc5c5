#!/usr/bin/env bash
# devmem on the GPU machine: host registration and pinned-memory tests, then the
# devmem benchmark.  Run from the repository root; results go under $OUT/devmem/.
set -uo pipefail
out="${OUT:?OUT must name the results folder}/devmem"
mkdir -p "$out"
status=0
python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu \
  tests/devmem/test_cuda_host.py "tests/devmem/test_conformance.py::TestPinned" \
  --junitxml="$out/pytest-gpu.xml" 2>&1 | tee "$out/pytest-gpu.txt" || status=1
python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench devmem --json --out "$out/bench-devmem.json" --force \
  > "$out/bench-devmem.stdout.json" 2> "$out/bench-devmem.stderr.txt" || status=1
exit $status
