"""What the LoRA weights' layout costs a CPU model's registration and
checkpoints (`protect(lora_layout=)`): the Qwen3-0.6B shape (fp32 on the CPU,
B=8, a StaticCache of 72 positions, a PEFT LoRA of 112 weights), two logs
written once each, "flat" (one region `hf.lora@<digest>`) and "tensors" (a region a
weight).  Then REPS rounds, the layouts alternated:
  protect   protect() of a fresh cache and the model into the log that holds
            it (`Session(create=False)`, as a recovering process), each weight
            first given storage of its own outside the clock, so that the flat
            layout pays its move into one tensor as a fresh process does;
  epoch     one checkpoint after a LoRA update and one new position, in the
            writable session of each layout (the host path: detectors,
            records, commit).
Prints each figure's median, least and most.  A component figure (this
machine's CPU): the product's figures are `bench model`'s on the GPU.
Usage: python3 scripts/lora_layout_probe.py [REPS]"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

import concordia
from concordia.demo.model import allocated_cache, build, lora_update
from concordia.integrations import transformers as transformers_integration
from concordia.integrations.transformers import protect

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
ctx, batch = 64, 8
cfg, model = build("0.6b", "cpu")
lora = [p for n, p in model.named_parameters() if ".lora_" in n]
update = lora_update(model)
where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
logs = {way: os.path.join(where, f"lora-layout-probe-{way}-{os.getpid()}.wal") for way in ("flat", "tensors")}


def own_storage():   # each weight in storage of its own and held by no registration, as a fresh process's
    for p in lora:
        p.data = p.data.clone()
    transformers_integration._HELD.clear()


took = {(way, what): [] for way in logs for what in ("protect", "epoch")}
writers = []
try:
    for way, log in logs.items():   # each log written once, in its layout
        own_storage()
        with concordia.Session(log, size=1 << 30) as s:
            protect(s, allocated_cache(cfg, model, batch, ctx + 8), model, batch_size=batch, max_tokens=ctx + 8,
                    lora_layout=way)
            s.checkpoint()
    fresh = allocated_cache(cfg, model, batch, ctx + 8)
    for rep in range(2 * reps):   # protect() as a recovering process calls it
        way = ("flat", "tensors")[rep % 2]
        own_storage()
        with concordia.Session(logs[way], create=False, readonly=True) as r:
            t = time.perf_counter()
            protect(r, fresh, model, batch_size=batch, max_tokens=ctx + 8, lora_layout=way)
            took[(way, "protect")].append(time.perf_counter() - t)
    own_storage()
    caches = {}
    for way, log in logs.items():   # both writers on the same model: the flat one's tensor holds the weights
        s = concordia.Session(log, create=False)
        writers.append(s)
        caches[way] = (s, allocated_cache(cfg, model, batch, ctx + 8))
        protect(s, caches[way][1], model, batch_size=batch, max_tokens=ctx + 8, lora_layout=way)
        s.checkpoint()
    for rep in range(2 * reps):   # an epoch of a LoRA update and a new position
        way = ("flat", "tensors")[rep % 2]
        s, cache = caches[way]
        update(rep + 1, None)
        with torch.no_grad():
            for layer in cache.layers:
                layer.keys[:, :, rep % ctx].add_(1.0)
        t = time.perf_counter()
        s.checkpoint()
        took[(way, "epoch")].append(time.perf_counter() - t)
    for (way, what), ts in took.items():
        ts.sort()
        print(f"{way:7s} {what:7s}: median {ts[len(ts) // 2] * 1e3:.2f} ms, least {ts[0] * 1e3:.2f}, "
              f"most {ts[-1] * 1e3:.2f} ({len(ts)} calls)")
finally:
    for s in writers:
        s.close()
    for log in logs.values():
        if os.path.exists(log):
            os.remove(log)
