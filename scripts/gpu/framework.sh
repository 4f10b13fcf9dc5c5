#!/usr/bin/env bash
# Framework tensors on the GPU: the gpu-marked framework tests (stream order,
# the CuPy view of a torch stream through Stream.from_external, recovery into
# bf16 / fp8 CUDA tensors on the device pipeline, device-side bad input), then
# scripts/framework_check.py, which writes
# $OUT/framework.json: stream_order (FRAMEWORK_TRIALS, default 24, trials of a
# write queued behind GEMMs on a non-default torch stream and checkpoint() in
# `with torch.cuda.stream(side):`, no synchronise) and recover_into
# (FRAMEWORK_GIB, default 10, GiB of bf16 KV tensors recovered straight into
# CUDA tensors on a shm log, beside pinned H2D and bench recover's pipeline).
# Run from the repository root.
set -uo pipefail
out="${OUT:?OUT must name the results folder}"
mkdir -p "$out"
status=0
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/session/test_framework_gpu.py \
  tests/session/test_stream_view_gpu.py \
  --junitxml="$out/framework-tests.xml" 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 200 python3 scripts/framework_check.py --out "$out" --trials "${FRAMEWORK_TRIALS:-24}" \
  --gib "${FRAMEWORK_GIB:-10}" || status=1
exit $status
