#!/usr/bin/env bash
# Why a read ahead beside a model's build runs slower than the same read alone
# (issue 30, ctx 32k on an H100: the prefetch thread's open took 9.2 s beside
# the build against 0.8 s alone, its read 6.3 s against about 3 s, and the
# recovery waited 3.9 s for it).  The Qwen3 0.6B shape, batch 8, a StaticCache
# of CONTENTION_CTX tokens (default 32768) and its LoRA are prefilled and
# checkpointed into an shm log; then fresh processes recover it as
# `bench model`'s children do (`python -m concordia.demo.kills recover`):
# without a read ahead, with one, and with one under a shorter GIL switch
# interval (CONTENTION_INTERVALS, seconds; CPython's default is 0.005), each
# printing its JSON line (build_s, recovery_s, and the read ahead's own
# phases under read_ahead.read).  Diagnostic only: the figures a claim rests
# on come from `bench model --parts recovery`.
# Run from the repo root with $OUT set; writes $OUT/read_ahead_contention.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
timeout -k 5 "${CONTENTION_S:-280}" python3 - "$OUT/read_ahead_contention.txt" <<'PY'
import gc, json, os, signal, subprocess, sys, time
import torch
from transformers import StaticCache
import concordia
from concordia.demo.model import build, prompt
from concordia.integrations.transformers import protect
from concordia.tools.bench.files import Scratch

# `timeout` sends SIGTERM: unwind, so that the scratch log (tens of gigabytes in /dev/shm) is removed
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
ctx = int(os.environ.get("CONTENTION_CTX", "32768"))
intervals = [float(x) for x in os.environ.get("CONTENTION_INTERVALS", "0.001,0.0002").split(",") if x]
batch, chunk = 8, 8192
WRAP = ("import runpy, sys; sys.setswitchinterval(float(sys.argv[1])); sys.argv = ['kills'] + sys.argv[2:]; "
        "runpy.run_module('concordia.demo.kills', run_name='__main__', alter_sys=True)")
with Scratch("contention-probe") as scratch, open(sys.argv[1], "w") as out:
    def say(line):
        print(line, flush=True)
        out.write(line + "\n")

    log = scratch.log("probe", "shm")
    cfg, model = build("0.6b", "cuda")
    cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * batch * ctx
    with concordia.Session(log, size=kv + kv // 4 + (2 << 30)) as s:
        g = protect(s, cache, model, batch_size=batch, max_tokens=ctx + 8)
        ids = prompt(batch, ctx, cfg.vocab_size, "cuda")
        t = time.perf_counter()
        with torch.no_grad():
            for a in range(0, ctx, chunk):
                part = ids[:, a:a + chunk]
                model(input_ids=part, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(a, a + part.shape[1], device="cuda"))
        torch.cuda.synchronize()
        say(f"ctx {ctx} x {batch}: prefill {time.perf_counter() - t:.3f} s, "
            f"checkpoint {s.checkpoint().total_ms:.0f} ms, {kv / 1e9:.1f} GB of KV")
    del g, cache, model, ids
    gc.collect()
    torch.cuda.empty_cache()
    args = ["recover", "--log", log, "--plan", "[]", "--shape", "0.6b", "--device", "cuda", "--batch", str(batch),
            "--max-len", str(ctx + 8)]
    runs = [("plain", [sys.executable, "-m", "concordia.demo.kills", *args]),
            ("read ahead, interval 0.005", [sys.executable, "-m", "concordia.demo.kills", *args, "--prefetch"])]
    runs += [(f"read ahead, interval {i}", [sys.executable, "-c", WRAP, str(i), *args, "--prefetch"])
             for i in intervals]
    for name, cmd in runs:
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not lines:
            say(f"{name}: failed (exit {r.returncode}): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        d = json.loads(lines[-1])
        d.pop("imported", None)
        say(f"{name}: process {time.perf_counter() - t:.1f} s, build {d['build_s']:.3f} s, "
            f"recovery {d['recovery_s']:.3f} s, build + recovery {d['build_s'] + d['recovery_s']:.3f} s")
        say("  " + json.dumps(d.get("read_ahead") or d.get("phases")))
PY
