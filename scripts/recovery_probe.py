"""Where a protected Qwen3's recovery spends its time on the GPU (issue 30):
a StaticCache of CTX tokens x B, prefilled, checkpointed into a shm log, then
opened afresh (Session(create=False)), protected and restored under cProfile.
Prints the recovery's phases (RecoveryStats.phases), the time of each region
set's page CRC table after the restore, and the profile's top functions.
Usage: python3 scripts/recovery_probe.py OUT.txt [CTX] [B]"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
from transformers import StaticCache

import concordia
from concordia.checkpoint.staging import page_crcs
from concordia.demo.model import build, prompt
from concordia.integrations.transformers import protect, restore

out_path = sys.argv[1]
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
log = f"/dev/shm/recovery-probe-{os.getpid()}.wal"
lines = []


def say(s):
    print(s, flush=True)
    lines.append(s)


cfg, model = build("0.6b", "cuda")
cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
ids = prompt(batch, ctx, cfg.vocab_size, "cuda")
kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * batch * (ctx + 8)
try:
    with concordia.Session(log, size=int(kv * 2.5) + (512 << 20)) as s:
        protect(s, cache, model, batch_size=batch, max_tokens=ctx + 8)
        with torch.no_grad():
            for lo in range(0, ctx, 2048):
                part = ids[:, lo:lo + 2048]
                model(input_ids=part, past_key_values=cache, cache_position=torch.arange(lo, lo + part.shape[1],
                      device="cuda"), use_cache=True)
        torch.cuda.synchronize()
        st = s.checkpoint()
        say(f"ctx {ctx} x {batch}: {kv / 1e9:.2f} GB of KV, base checkpoint {st.total_ms:.0f} ms")
    del cache
    torch.cuda.empty_cache()
    for round_ in range(2):
        fresh = StaticCache(config=cfg, max_cache_len=ctx + 8)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        with concordia.Session(log, create=False) as s:
            guard = protect(s, fresh, model, batch_size=batch, max_tokens=ctx + 8)
            t1 = time.perf_counter()
            prof.enable()
            restore(s, guard)
            torch.cuda.synchronize()
            prof.disable()
            t2 = time.perf_counter()
            say(f"round {round_}: open+protect {t1 - t0:.3f} s, restore {t2 - t1:.3f} s")
            for k, v in s.last_recovery.phases.items():
                say(f"  phase {k}: {v}")
            say(f"  via {set(s.last_recovery.via.values())}")
            regs = list(s.region_set)
            t3 = time.perf_counter()
            for r in regs:
                page_crcs(r)
            torch.cuda.synchronize()
            say(f"  page_crcs of {len(regs)} regions: {time.perf_counter() - t3:.3f} s; "
                f"device_aligned {sum(bool(r.device_aligned) for r in regs)}, on_gpu {sum(bool(r.on_gpu) for r in regs)}")
        buf = io.StringIO()
        ps = pstats.Stats(prof, stream=buf)
        ps.sort_stats("cumulative").print_stats(40)
        ps.sort_stats("tottime").print_stats(25)
        say(buf.getvalue())
        del fresh
        torch.cuda.empty_cache()
finally:
    if os.path.exists(log):
        os.unlink(log)
    open(out_path, "w").write("\n".join(lines) + "\n")
