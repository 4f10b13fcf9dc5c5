"""Where a decode step's epoch spends its device time, kernel by kernel, as
the cache grows (a component figure; diagnostic only: the product's figures
are `bench model`'s).  A session on shm (executor "host": the table pass's
kernels launched from the host, the same device code the persistent kernel's
driver launches) registers a Qwen3-0.6B-shaped cache by positions (28 layers,
keys and values, [8, 8, CTX, 128] bf16 as uint16, a length word each) and an
adapter-sized region by fingerprints (8.8 MB).  Each step moves every length
word on by one position and rewrites the adapter, then checkpoints; each of
the pass's launches is timed by CUDA events on its stream.  Prints a line a
context length: the median microseconds of each kernel over the steps.

    python3 scripts/gpu/table_plan_probe.py [CTXS] [STEPS] [OUT.json]
    (defaults: 641,4096,8192; 40 steps, the first 5 unmeasured; the log is three times the
    state, on /dev/shm)
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys

import cupy as cp
import numpy as np

import concordia
from concordia.checkpoint import device as device_mod
from concordia.regions.region import position_page_bytes

LAYERS, BATCH, HEADS, DIM = 28, 8, 8, 128
ADAPTER_BYTES = 8_800_000


class Timed:
    """A kernel launch timed by events on the current stream."""

    def __init__(self, fn, name, sink):
        self.fn, self.name, self.sink = fn, name, sink

    def __call__(self, *args, **kwargs):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        self.fn(*args, **kwargs)
        b.record()
        self.sink.append((self.name, a, b))


def instrument(sink) -> None:
    inner = device_mod.DeviceTablePass.__init__

    def init(self, *a, **kw):
        inner(self, *a, **kw)
        dets = getattr(self, "group_detectors", [])
        self.groups = [(Timed(fn, f"detect_{int(det)}", sink),) + tuple(rest)
                       for (fn, *rest), det in zip(self.groups, dets)]
        self.fn = {name: Timed(fn, name, sink) for name, fn in self.fn.items()}

    device_mod.DeviceTablePass.__init__ = init


def run(ctx: int, steps: int, sink: list) -> dict:
    cp.random.seed(0)
    kv = [cp.random.randint(0, 1 << 16, (BATCH, HEADS, ctx, DIM), dtype=cp.uint16) for _ in range(2 * LAYERS)]
    lengths = cp.zeros((2 * LAYERS, 1), cp.int64)
    adapter = cp.random.randint(0, 1 << 31, ADAPTER_BYTES // 4, dtype=cp.int32)
    state = sum(a.nbytes for a in kv) + adapter.nbytes
    size = max(1 << 30, -(-3 * state // (64 << 20)) * (64 << 20))
    # named as the benches' scratch, which gpu_suite.sh removes when a cut run left it
    log = f"/dev/shm/concordia-bench-table-plan-probe-{os.getpid()}"
    pb = position_page_bytes(DIM * 2)
    got: dict = {}
    try:
        with concordia.Session(f"shm:{log}", size=size, executor="host") as s:
            for i, a in enumerate(kv):
                s.register(f"kv{i}", a, kind="kv", detect="positions", page_bytes=pb, length=lengths[i])
            s.register("adapter", adapter, detect="fingerprint", page_bytes=4096)
            lengths[:] = ctx - steps - 1
            cp.cuda.get_current_stream().synchronize()
            s.checkpoint()
            for step in range(steps):
                lengths += 1
                adapter += 1
                del sink[:]
                st = s.checkpoint()
                cp.cuda.Device().synchronize()
                if step < 5:
                    continue
                for name, a, b in sink:
                    got.setdefault(name, []).append(cp.cuda.get_elapsed_time(a, b) * 1e3)
                got.setdefault("log_bytes", []).append(int(st.log_bytes))
                got.setdefault("table_pass", []).append(bool(st.table_pass))
            pages = sum(int(r.pages) for r in s.region_set)
    finally:
        if os.path.exists(log):
            os.unlink(log)
    del kv, adapter
    cp.get_default_memory_pool().free_all_blocks()
    out = {"ctx": ctx, "page_bytes": pb, "pages": pages, "steps": len(got.get("log_bytes", []))}
    for name, v in got.items():
        if name == "table_pass":
            out[name] = all(v)
        elif name == "log_bytes":
            out["log_bytes_median"] = statistics.median(v)
        else:
            out[f"{name}_us"] = round(statistics.median(v), 2)
            out[f"{name}_us_max"] = round(max(v), 2)
    return out


def main() -> None:
    ctxs = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "641,4096,8192").split(",")]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    out = sys.argv[3] if len(sys.argv) > 3 else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a cut run unwinds: its log removed
    sink: list = []
    instrument(sink)
    rows = []
    for ctx in ctxs:
        try:
            row = run(ctx, steps, sink)
        except Exception as exc:  # a probe: say what failed and go on to the next size
            row = {"ctx": ctx, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:  # whole or not at all
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        try:
            with open(out + ".tmp", "w") as f:
                f.write(json.dumps({"probe": "table_plan", "device": device, "rows": rows}, indent=1) + "\n")
            os.replace(out + ".tmp", out)
        finally:
            if os.path.exists(out + ".tmp"):
                os.unlink(out + ".tmp")
    if any("error" in row for row in rows):  # a size that failed fails the part (its line says why)
        sys.exit(1)


if __name__ == "__main__":
    main()
