"""What retention costs a decoder's every-step checkpoints (issue 32), without
the model's forward: the Qwen3-0.6B shape in bf16 (28 layers, B=8), a
StaticCache and a PEFT LoRA protected as `protect()` does, a prompt of 64
positions, then STEPS steps that each write one position of every layer's
keys and values, update the LoRA B matrices (`lora_update`, as `bench model`
does) and run `CheckpointEvery`'s hook.  Prints retention's host ms per step
(its hook after each commit, and the host copies a job of a pending epoch
takes at the next launch), its counts, each job's regions by kind and the
hooks by what they did (`Retention.last`).  A component figure: `bench model --parts decode` is the
product's.  Runs on the CPU (numpy twins) or, with CUDA, on the GPU.
Usage: python3 scripts/retention_probe.py [STEPS] [cpu|cuda]"""

from __future__ import annotations

import collections
import os
import sys
import time

import torch
from transformers import StaticCache

import concordia
from concordia.demo.model import build, lora_update, prompt
from concordia.integrations.transformers import CheckpointEvery, protect

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 64
device = sys.argv[2] if len(sys.argv) > 2 else ("cuda" if torch.cuda.is_available() else "cpu")
batch, prompt_len, seg = 8, 64, 64 << 20
cfg, model = build("0.6b", device)
model = model.to(torch.bfloat16)
max_len = prompt_len + steps + 1
cache = StaticCache(config=cfg, max_cache_len=max_len)
kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
# the log `bench model`'s decode part makes: three images of the KV and eight segments
size = (kv_per_token * batch * max_len * 3 // seg + 8) * seg
log = f"shm:/dev/shm/retention-probe-{os.getpid()}"
g = torch.Generator().manual_seed(0)


def fill(t, at):
    t[:, :, at] = torch.randn(t[:, :, at].shape, generator=g).to(device=t.device, dtype=t.dtype)


try:
    with concordia.Session(log, size=size, segment_size=seg) as s:
        guard = protect(s, cache, model, batch_size=batch, max_tokens=max_len)
        state = sum(r.array.nbytes for r in s.regions.values())
        for layer in cache.layers:
            for p in range(prompt_len - 1):
                fill(layer.keys, p)
                fill(layer.values, p)
        ids = prompt(batch, prompt_len, cfg.vocab_size, device)
        guard._known_length = prompt_len - 1
        ret = s.retention
        after, start = ret.after_commit, ret._start
        hooks, jobs = [], []

        def timed(stats, moved=False):
            t = time.perf_counter()
            after(stats, moved)
            hooks.append((time.perf_counter() - t, ret.last))

        def job(epoch, names, live, pressure):
            jobs.append((epoch, dict(collections.Counter(n.split(".")[1] for n in names)), pressure))
            return start(epoch, names, live, pressure)

        launched = ret.launched

        def timed_launch(epoch):   # a pending epoch's job takes its host copies here, at the next launch
            t = time.perf_counter()
            launched(epoch)
            hooks.append((time.perf_counter() - t, "copies at launch"))

        ret.after_commit, ret._start, ret.launched = timed, job, timed_launch
        s.checkpoint()   # the prompt's: the first write of every region
        first, hooks[:] = sum(x for x, _ in hooks), []
        hook = CheckpointEvery(guard, 1, on_step=lora_update(model))
        t0 = time.perf_counter()
        for k in range(steps):
            for layer in cache.layers:
                fill(layer.keys, prompt_len - 1 + k)
                fill(layer.values, prompt_len - 1 + k)
            ids = torch.cat([ids, ids[:, -1:]], dim=1)
            hook(ids, None)
        s.settle()
        wall = time.perf_counter() - t0
        print(f"{device}: {len(s.regions)} regions, {state / 1e6:.1f} MB, log {size >> 20} MiB, {steps} steps in "
              f"{wall:.2f} s; retention {sum(x for x, _ in hooks) / steps * 1e3:.3f} ms a step (after the prompt's "
              f"checkpoint, whose hook took {first * 1e3:.1f} ms); {dict(ret.counts)}")
        for epoch, kinds, pressure in jobs:
            print(f"  job at epoch {epoch}: {kinds}{' (pressure)' if pressure else ''}")
        by = collections.defaultdict(list)
        for x, last in hooks:
            by[last].append(x * 1e3)
        for last, xs in by.items():
            xs.sort()
            print(f"  hooks that did {last}: {len(xs)}, median {xs[len(xs) // 2]:.3f} ms, {sum(xs):.1f} ms in all")
finally:
    path = log.split(":", 1)[1]
    if os.path.exists(path):
        os.unlink(path)
