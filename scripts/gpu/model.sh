#!/usr/bin/env bash
# The transformers integration on the H200, as a user runs it (transformers'
# defaults: sdpa attention, generate()'s decode step compiled on CUDA with a
# StaticCache, no determinism switches): the Qwen3 0.6B shape, bf16, batch 8,
# a StaticCache and a PEFT LoRA updated online, checkpointed from inside
# generate() through concordia.integrations.transformers.
#   bench model --parts MODEL_PARTS (default decode,longrun,kills):
#     decode    tokens/s with no checkpoint, every step, every 8 steps (pending
#               epochs, CheckpointEvery's default), every step waiting, and
#               every step and every 8 on a resident session (the persistent
#               kernel's step trigger)
#     longrun   10,000 every-step checkpoints into a log of 4x the state
#     kills     6 SIGKILLs at random moments of generate(), greedy and sampled
#               in turn, each restored and finished in a fresh process
#     recovery  restore at each --contexts length, in process and in a fresh
#               process, against re-prefilling (issue 30's hf_restore_vs_reprefill:
#               MODEL_ARGS="--contexts 512,32768"; on the H200 ctx 512 takes about
#               60 s and 32k about 200 s, so give both MODEL_BENCH_S=330 or more)
#   bench checkpoint --parts decode (the decode-shaped checkpoint, LoRA updated),
#     unless MODEL_SKIP_CHECKPOINT is set.
# Run from the repository root with $OUT set (through scripts/gpu_suite.sh);
# writes $OUT/model-<parts>.json and $OUT/checkpoint-decode.json.
# MODEL_ARGS adds options to bench model (e.g. --longrun-steps 2000).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
unset CUBLAS_WORKSPACE_CONFIG
status=0
wal=(python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()")
if [ -z "${MODEL_SKIP_CHECKPOINT:-}" ]; then
  timeout -k 5 "${MODEL_CHECKPOINT_S:-120}" "${wal[@]}" bench checkpoint --parts decode --reps 20 --json \
    --out "$OUT/checkpoint-decode.json" --force > /dev/null || status=1
  python3 - "$OUT/checkpoint-decode.json" <<'PY' || status=1
import json, sys
d = json.load(open(sys.argv[1]))["decode_shaped"]
print("decode-shaped checkpoint:", {k: v for k, v in d.items() if "ms" in k or k in ("dirty_bytes", "log_bytes", "via")})
PY
fi
parts=${MODEL_PARTS:-decode,longrun,kills}
tag=${parts//,/-}
timeout -k 5 "${MODEL_BENCH_S:-480}" "${wal[@]}" bench model --parts "$parts" ${MODEL_ARGS:-} --json \
  --out "$OUT/model-$tag.json" --force > /dev/null || status=1
python3 - "$OUT/model-$tag.json" <<'PY' || status=1
import json, sys
d = json.load(open(sys.argv[1]))
print("compile", d["compile"], "attn", d["attn"])
for r in d.get("decode", []):
    print("every", r["every"], "wait", r.get("wait"), "pending", r.get("pending"), "tok/s", round(r["tokens_per_s"], 1), "s/step", [round(x, 5) for x in r["s_per_step_runs"]],
          "overhead", round(r["overhead"], 4), "ckpt ms", r["ckpt_ms_median"], "hook ms", r.get("hook_ms_median"), "phases", r.get("host_phases_ms"), "per step", r.get("host_phases_ms_per_step"), "retention", r.get("retention"), "log bytes/ckpt", r["log_bytes_per_ckpt"])
if "longrun" in d:
    lr = dict(d["longrun"]); lr.pop("retention", None)
    print("longrun", json.dumps(lr)[:1500])
for k in d.get("kills", []):
    print("kill", json.dumps(k))
if "kills_run" in d:
    print("kills identical", d["kills_run"]["identical"], "wall", round(d["kills_run"]["wall_s"], 1))
for r in d.get("recovery", []):
    print("recovery ctx", r["context"], "in process", round(r["recovery_s"], 4), "s, fresh process", r["fresh"],
          "re-prefill", round(r["reprefill_s"], 4), "s, identical", r["identical"])
    ra = {k: v for k, v in r.get("fresh_read_ahead", {}).items() if k not in ("phases", "imported", "digest")}
    print("recovery ctx", r["context"], "fresh process, read ahead", ra, "identical to the plain one",
          r.get("read_ahead_identical"))
for k in ("hf_restore_vs_reprefill", "hf_restore_vs_reprefill_read_ahead"):
    if k in d:
        print(k, d[k])
PY
exit $status
