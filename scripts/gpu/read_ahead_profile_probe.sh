#!/usr/bin/env bash
# Where the host time of a read-ahead recovery goes (issue 30's ctx-512 figure,
# `concordia.prefetch`): the Qwen3 0.6B shape, batch 8, a StaticCache of
# READ_AHEAD_CTX tokens and its LoRA, checkpointed into an shm log; then, in
# the same process, a prefetch of that log onto the GPU, a fresh cache,
# protect() and restore() under cProfile, REPS times (the first is the
# process's first use of each path).  Diagnostic only: the figures a claim rests
# on come from `bench model --parts recovery` (its fresh_read_ahead child).
# Run from the repo root with $OUT set; writes $OUT/read_ahead_profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
timeout -k 5 "${READ_AHEAD_PROFILE_S:-200}" python3 - "$OUT/read_ahead_profile.txt" <<'PY'
import cProfile, io, os, pstats, signal, sys, time
import torch
from transformers import StaticCache
import concordia
from concordia.demo.model import build, prompt
from concordia.integrations.transformers import protect, restore
from concordia.tools.bench.files import Scratch

# `timeout` sends SIGTERM: unwind, so that the scratch log (gigabytes in /dev/shm) is removed
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
ctx, reps = int(os.environ.get("READ_AHEAD_CTX", "512")), int(os.environ.get("REPS", "3"))
cfg, model = build("0.6b", "cuda")
with Scratch("read-ahead-probe") as scratch, open(sys.argv[1], "w") as out:
    log = scratch.log("probe", "shm")
    cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
    with concordia.Session(log, size=8 << 30, segment_size=64 << 20) as s:
        g = protect(s, cache, model, batch_size=8, max_tokens=ctx + 8)
        model(prompt(8, ctx, cfg.vocab_size, "cuda"), past_key_values=cache)
        torch.cuda.synchronize()
        s.checkpoint()
    del g, cache
    for rep in range(reps):
        p = concordia.prefetch(log, device="cupy", readonly=True)
        fresh = StaticCache(config=cfg, max_cache_len=ctx + 8)
        p.wait()
        s = p.session()
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pr.enable()
        g = protect(s, fresh, model, batch_size=8, max_tokens=ctx + 8)
        t1 = time.perf_counter()
        restore(s, g)
        torch.cuda.synchronize()
        pr.disable()
        t2 = time.perf_counter()
        line = f"rep {rep}: protect {t1 - t0:.4f} s, restore {t2 - t1:.4f} s (under cProfile), regions {len(s.regions)}, " \
               f"read ahead used {s.last_recovery.phases['read_ahead']['used']}"
        print(line, flush=True)
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
        out.write(line + "\n" + text.getvalue() + "\n")
        s.close()
        del g, fresh
        torch.cuda.empty_cache()
PY
