"""What a CPU model's registration costs with each way of seeing a CPU tensor
(`regions.arrays.adapt`): `protect()` of the Qwen3-0.6B shape (fp32 on the CPU,
B=8, a StaticCache of 72 positions and a PEFT LoRA: 173 tensors) into a log
that holds them already, as a recovering process does, alternated between
each tensor seen by its address (`_HostBytes`, the default) and a DLPack
export (`_HOST_VIEWS` off).  Prints each way's median, least and most
of REPS calls.  A component figure: the product's recovery is `bench model
--parts recovery`, and on the GPU a tensor is seen by its address.
Usage: python3 scripts/protect_views_probe.py [REPS]"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import concordia
from concordia.demo.model import allocated_cache, build
from concordia.integrations.transformers import protect
from concordia.regions import arrays

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 24
ctx, batch = 64, 8
cfg, model = build("0.6b", "cpu")
where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
log = os.path.join(where, f"protect-views-probe-{os.getpid()}.wal")
try:
    with concordia.Session(log, size=1 << 30) as s:
        protect(s, allocated_cache(cfg, model, batch, ctx + 8), model, batch_size=batch, max_tokens=ctx + 8)
        s.checkpoint()
    took = {"address": [], "dlpack": []}
    fresh = allocated_cache(cfg, model, batch, ctx + 8)
    for rep in range(reps):
        way = "address" if rep % 2 else "dlpack"
        arrays._HOST_VIEWS = way == "address"
        with concordia.Session(log, create=False, readonly=True) as s:
            t = time.perf_counter()
            protect(s, fresh, model, batch_size=batch, max_tokens=ctx + 8)
            took[way].append(time.perf_counter() - t)
    arrays._HOST_VIEWS = True
    for way, ts in took.items():
        ts.sort()
        print(f"{way:7s} protect: median {ts[len(ts) // 2] * 1e3:.2f} ms, least {ts[0] * 1e3:.2f}, "
              f"most {ts[-1] * 1e3:.2f} ({len(ts)} calls)")
finally:
    if os.path.exists(log):
        os.remove(log)
