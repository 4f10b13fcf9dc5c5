"""What a pause gate may assume about `%gridid` and about L1 on the GPU it runs on.

Two questions, each answered by measurement, written as JSON to argv[1]:

1. Is `%gridid` increasing in submission order across streams of one context
   (CuPy blocking and non-blocking streams, the legacy default stream, and
   PyTorch launches on its own stream when torch is importable)?  A gate that
   records the grid id of a launch submitted after its mirror write can then
   tell launches that started before the write from those that started after.
2. Can a launch read a stale L1 line cached by another grid still running on
   the same SMs?  Grid A (one block per SM) reads a flag word through L1 and
   keeps running; the flag is then set by a synchronous copy and grid B,
   launched on another stream while A still runs, reads it through L1 on every
   SM.  Any B block that reads the old value saw A's line.
"""

from __future__ import annotations

import json
import sys
import time

import cupy as cp
import numpy as np

SRC = r"""
extern "C" __global__ void gid(unsigned long long* out, int i) {
  unsigned long long g;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
  if (threadIdx.x == 0 && blockIdx.x == 0) out[i] = g;
}
extern "C" __global__ void hold_l1(const unsigned* flag, volatile unsigned* stop, unsigned* seen) {
  unsigned v;
  asm volatile("ld.global.ca.u32 %0, [%1];" : "=r"(v) : "l"(flag));
  if (threadIdx.x == 0) seen[blockIdx.x] = v + 1;
  while (*stop == 0) { __nanosleep(1000); }
  asm volatile("ld.global.ca.u32 %0, [%1];" : "=r"(v) : "l"(flag));
  if (threadIdx.x == 0) seen[gridDim.x + blockIdx.x] = v + 1;
}
extern "C" __global__ void read_l1(const unsigned* flag, unsigned* seen, unsigned* smid) {
  unsigned v, s;
  asm volatile("ld.global.ca.u32 %0, [%1];" : "=r"(v) : "l"(flag));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  if (threadIdx.x == 0) { seen[blockIdx.x] = v + 1; smid[blockIdx.x] = s; }
}
"""


def gridid_order(mod, rounds: int = 400) -> dict:
    fn = mod.get_function("gid")
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)] + [cp.cuda.Stream(), cp.cuda.Stream.null]
    names = ["nonblocking0", "nonblocking1", "nonblocking2", "blocking", "legacy"]
    out = cp.zeros(rounds + 64, dtype=cp.uint64)
    order = []
    torch_stream = None
    try:
        import torch

        torch_stream = torch.cuda.Stream()
        tout = torch.zeros(rounds, dtype=torch.int64, device="cuda")
    except Exception:
        torch = None
    for i in range(rounds):
        k = i % (len(streams) + (1 if torch_stream is not None else 0))
        if k < len(streams):
            with streams[k]:
                fn((1,), (32,), (out, np.int32(i)))
            order.append(names[k])
        else:
            with torch.cuda.stream(torch_stream):
                tout[i:i + 1].add_(1)          # a PyTorch kernel between ours
            order.append("torch")
    cp.cuda.Device().synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    ids = [int(v) for v, who in zip(out.get()[:rounds], order) if who != "torch"]
    steps = np.diff(np.array(ids, dtype=np.int64))
    return {"launches": len(ids), "streams": sorted(set(order)), "first": ids[:8],
            "increasing": bool((steps > 0).all()), "min_step": int(steps.min()), "max_step": int(steps.max()),
            "torch_between": torch_stream is not None}


def l1_across_grids(mod) -> dict:
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    flag = cp.zeros(32, dtype=cp.uint32)
    stop = cp.zeros(1, dtype=cp.uint32)
    seen_a = cp.zeros(2 * sms, dtype=cp.uint32)
    nb = 8 * sms
    seen_b = cp.zeros(nb, dtype=cp.uint32)
    smid = cp.zeros(nb, dtype=cp.uint32)
    sa, sb = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    hold, read = mod.get_function("hold_l1"), mod.get_function("read_l1")   # loaded before A spins
    with sa:
        hold((sms,), (32,), (flag, stop, seen_a))
    time.sleep(0.05)                                       # A has read the flag (0) on every SM
    one = np.ones(32, dtype=np.uint32)
    cp.cuda.runtime.memcpy(flag.data.ptr, one.ctypes.data, one.nbytes, cp.cuda.runtime.memcpyHostToDevice)
    with sb:
        read((nb,), (32,), (flag, seen_b, smid))
    sb.synchronize()
    b = seen_b.get() - 1
    one_word = np.ones(1, dtype=np.uint32)
    cp.cuda.runtime.memcpy(stop.data.ptr, one_word.ctypes.data, 4, cp.cuda.runtime.memcpyHostToDevice)
    sa.synchronize()
    a = seen_a.get() - 1
    return {"sms": sms, "a_first_read": {int(v): int((a[:sms] == v).sum()) for v in np.unique(a[:sms])},
            "a_second_read": {int(v): int((a[sms:] == v).sum()) for v in np.unique(a[sms:])},
            "b_blocks": nb, "b_stale_blocks": int((b == 0).sum()),
            "b_sms": int(len(np.unique(smid.get())))}


def main(path: str) -> None:
    mod = cp.RawModule(code=SRC)
    res = {"gridid": gridid_order(mod)}
    print(json.dumps(res), flush=True)
    res["l1"] = l1_across_grids(mod)
    print(json.dumps(res, indent=1))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
