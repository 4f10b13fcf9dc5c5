"""Host microseconds of what CheckpointEvery writes at each checkpointed step
besides the tensors (issue 32): `Guard._sync_counters` (the layers' positions
into the counters), `Guard.record_tokens` and `Guard.capture` (counters and
the generator), for the Qwen3-0.6B shape's 28 layers, B=8, as `protect()`
registers them.  A component figure of the host's share of a step: on a GPU
each call also queues its launches.  Runs on the CPU or, with CUDA, the GPU.
Usage: python3 scripts/capture_probe.py [cpu|cuda] [REPS]"""

from __future__ import annotations

import sys
import time

import torch
from transformers import StaticCache

import concordia
from concordia.demo.model import build
from concordia.integrations.transformers import protect

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
cfg, model = build("0.6b", device)
cache = StaticCache(config=cfg, max_cache_len=80)
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
with concordia.Session("memory:", size=1 << 30, segment_size=64 << 20) as s:
    guard = protect(s, cache, model, batch_size=8, max_tokens=80)
    ids = torch.zeros((8, 40), dtype=torch.long, device=device)
    for name, call in (("sync_counters", guard._sync_counters), ("record_tokens", lambda: guard.record_tokens(ids)),
                       ("capture", guard.capture)):
        for _ in range(50):
            call()
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            call()
        host = (time.perf_counter() - t) / reps
        sync()
        print(f"{device}: {name} {host * 1e6:.1f} us a call (host), {len(cache.layers)} layers")
