#!/usr/bin/env bash
# Tensor-parallel recovery on 2 GPUs (needs the two-GPU machine): the decode of
# concordia.demo.tp over NCCL, one rank SIGKILLed mid-step and replaced from its
# rank's log while the other keeps its state, against an uninterrupted run
# (identical) and a restart (new processes, NCCL init, weights rebuilt, steps
# re-decoded) measured in the same run.  Writes $OUT/multigpu.json with
# "kill_to_decoding_s" and "identical".  Shape: one Qwen3-8B-wide block
# (hidden 4096, ffn 12288) split over 2 ranks, MULTIGPU_LAYERS layers (default 8).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
# a collective whose peer died must raise in the caller (to recover), not have
# the NCCL watchdog end the survivor: blocking wait, no async error handling
export TORCH_NCCL_BLOCKING_WAIT=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=0
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 2 ]; then
  echo "multigpu: skipped, $gpus GPU(s) here and the run needs 2 (the nvidia-h200-x2 machine)"
  exit 0
fi
timeout 220 python3 -m concordia.demo.tp --world 2 --backend nccl --device cuda \
  --hidden 4096 --ffn 12288 --layers "${MULTIGPU_LAYERS:-8}" --steps "${MULTIGPU_STEPS:-32}" --kill-step 16 --timeout-s "${MULTIGPU_TIMEOUT_S:-5}" \
  --log-bytes $((4 << 30)) --workdir "${MULTIGPU_WORKDIR:-/dev/shm}" --json "$OUT/multigpu.json"
