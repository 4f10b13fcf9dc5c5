#!/usr/bin/env bash
# Downloads, into .whl/ (ignored by git), the wheels the GPU machine lacks for
# Python 3.12 on x86-64: crc32c, cffi (+ pycparser), lmdb, ml_dtypes (bfloat16 and
# float8 on the host), and the crcmod source
# (pure Python fallback when its C extension cannot be built there).
# scripts/gpu_suite.sh installs them there with --target and PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  plat+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl crc32c==2.9.post0 cffi==2.1.1 lmdb==3.0.0 pycparser==3.12 ml_dtypes==0.5.4
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl crcmod==1.7
ls -1 .whl
