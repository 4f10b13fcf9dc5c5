#!/usr/bin/env bash
# The transformers integration on the H200: the model demo (Qwen3 0.6B shape,
# bf16, batch 8, StaticCache, online LoRA, checkpointed from inside generate())
# SIGKILLed at several steps and resumed bit-identically in fresh processes,
# then bench model (decode overhead of checkpointing, recovery against
# re-prefill and a cold restart at 1k, 8k and 32k tokens).
# Run from the repository root with $OUT set; writes $OUT/model-demo.json and
# $OUT/model.json.  MODEL_CONTEXTS overrides the contexts.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 HF_HUB_OFFLINE=1
status=0
timeout -k 5 200 python3 - "$OUT/model-demo.json" <<'PY' || status=1
import json, sys
from concordia.demo.model import run_demo
rep = run_demo("shm:concordia-model-demo", shape="0.6b", device="cuda", steps=32, every=4,
               kill_at=[7, 14, 27], batch=8, prompt_len=64, size=4 << 30, segment=64 << 20)
json.dump(rep, open(sys.argv[1], "w"), indent=2)
for r in rep["runs"]:
    print("kill at", r["kill_at"], "resumed at", r["resumed_at_step"], "identical", r["identical"],
          "restore ms", round(r["restore_s"] * 1e3, 1), "kill->resumed s", round(r["kill_to_resumed_s"], 2),
          "differs", r["differs"])
sys.exit(0 if rep["identical"] else 1)
PY
rm -f /dev/shm/concordia-model-demo /dev/shm/concordia-model-demo.ref
timeout -k 5 330 python3 -c "from concordia.tools.wal_cli import main; main()" bench model \
  --contexts "${MODEL_CONTEXTS:-1024,8192,32768}" --out "$OUT/model.json" --force || status=1
exit $status
