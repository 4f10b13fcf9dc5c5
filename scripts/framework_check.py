"""Framework tensors on a GPU, through the public entry points: writes
framework.json with

* stream_order: trials of a write queued on a non-default PyTorch stream
  behind a few large GEMMs, then `Session.checkpoint()` called inside
  `with torch.cuda.stream(side):` without any synchronise, the epoch recovered
  and compared with what the stream wrote (held: the trials whose epoch holds
  the write, whole).  control_unordered: the same, with checkpoint() called
  outside the `with` (the producer stream is then not the one that wrote), to
  show the trial can fail;
* recover_into: bf16 KV tensors of an HF-style static cache (layers x K/V,
  [batch, kv_heads, tokens, head_dim], registered as they are) checkpointed
  into a shm log, then `Session(log, create=False).recover(into=...)` straight
  into zeroed CUDA tensors of the same dtype, beside pinned host-to-device
  bandwidth and `concordia-wal bench recover`'s device pipeline at the same
  size and tier, both measured in this run.

Usage: python3 scripts/framework_check.py --out DIR [--trials 24] [--gib 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

GIB = 1 << 30


def _h2d(cp, nbytes: int = 2 * GIB) -> dict:
    """Pinned host-to-device copy bandwidth, best of 5."""
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, np.uint8, nbytes)
    host[:] = 1
    dev = cp.empty(nbytes, cp.uint8)
    best = None
    for _ in range(6):
        t0 = time.perf_counter()
        dev.set(host)
        cp.cuda.get_current_stream().synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    del dev, host, mem
    return {"what": "pinned host-to-device copy (cupy)", "bytes": nbytes, "GBps": nbytes / best / 1e9}


def _shm_log() -> str:
    return f"shm:concordia-framework-{uuid.uuid4().hex[:10]}"


def _rm(spec: str) -> None:
    try:
        os.unlink("/dev/shm/" + spec.split(":", 1)[1])
    except FileNotFoundError:
        pass


def stream_order(torch, trials: int, ordered: bool, gemms: int = 4, dim: int = 8192) -> dict:
    from concordia import Session

    spec = _shm_log()
    x = torch.zeros(32 << 20, dtype=torch.bfloat16, device="cuda")  # 64 MiB
    written = 1 << 19  # elements each trial writes behind the GEMMs
    side = torch.cuda.Stream()
    held, lost = 0, []
    try:
        with Session(spec, size=2 << 30, segment_size=64 << 20) as s:
            s.register("x", x, kind="kv", page_bytes=65536)
            s.checkpoint()
            for trial in range(1, trials + 1):
                a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
                torch.cuda.synchronize()  # setup only: nothing below waits for the side stream
                with torch.cuda.stream(side):
                    for _ in range(gemms):
                        a = a @ a
                        a = a / a.abs().amax().clamp(min=1)
                    x[:written].fill_(float(trial))  # 1 MiB: 16 pages a checkpoint, so the log holds every trial
                    if ordered:
                        s.checkpoint()
                if not ordered:
                    s.checkpoint()
                got = s.recover()["x"]
                if bool((got[:written] == float(trial)).all()):
                    held += 1
                else:
                    lost.append(trial)
                side.synchronize()
                del a
    finally:
        _rm(spec)
    return {"trials": trials, "held": held, "lost_trials": lost, "gemms": gemms, "gemm_dim": dim,
            "region_bytes": int(x.numel() * x.element_size())}


def recover_into(torch, cp, gib: int, page_bytes: int = 65536) -> dict:
    from concordia import Session

    batch, heads, head_dim = 8, 8, 128
    per = 256 << 20  # bytes per tensor
    tokens = per // (batch * heads * head_dim * 2)
    n = gib * GIB // per
    layers = n // 2
    spec = _shm_log()
    g = torch.Generator(device="cuda").manual_seed(15)
    kv = {}
    for layer in range(layers):
        for which in ("k", "v"):
            kv[f"layer{layer}.{which}"] = torch.randn(batch, heads, tokens, head_dim, device="cuda", generator=g,
                                                      dtype=torch.float32).to(torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in kv.values())
    seg = 1 << 30
    size = -(-(nbytes + nbytes // 16 + 4 * seg) // seg) * seg
    out = {"GiB": nbytes / GIB, "tensors": len(kv), "dtype": str(next(iter(kv.values())).dtype),
           "shape": [batch, heads, tokens, head_dim], "page_bytes": page_bytes, "tier": "shm"}
    try:
        t0 = time.perf_counter()
        with Session(spec, overwrite=True, size=size, segment_size=seg) as s:
            for name, t in kv.items():
                s.register(name, t, kind="kv", page_bytes=page_bytes)  # bf16, as it is
            s.checkpoint()
            first = next(iter(kv.values()))
            first[0, 0, :16].fill_(1.0)  # a small delta: the last commit, as between decode steps
            s.checkpoint()
            out["checkpoint_paths"] = sorted(set(s.checkpoints[-1].via.values()))
        out["write_s"] = time.perf_counter() - t0
        targets = {name: torch.zeros_like(t) for name, t in kv.items()}
        runs = []
        for _ in range(3):
            for t in targets.values():
                t.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s = Session(spec, create=False)
            t1 = time.perf_counter()
            got = s.recover(into=targets)
            torch.cuda.current_stream().synchronize()
            t2 = time.perf_counter()
            via = sorted(set(s.last_recovery.via.values()))
            s.close()
            runs.append({"seconds": t2 - t0, "open_s": t1 - t0, "recover_s": t2 - t1, "via": via})
            assert all(got[k] is targets[k] for k in kv)
        out["identical"] = all(torch.equal(targets[k].view(torch.int16), kv[k].view(torch.int16)) for k in kv)
        med = sorted(runs, key=lambda r: r["seconds"])[1]
        out.update(med)
        out["runs"] = runs
        out["bytes"] = nbytes
    finally:
        _rm(spec)
        del kv
        torch.cuda.empty_cache()
    return out


def bench_pipeline(gib: int) -> dict:
    """`concordia-wal bench recover` at the same size on shm (its public entry point)."""
    path = os.path.join(tempfile.mkdtemp(prefix="concordia-framework-"), "recover.json")
    cmd = [sys.executable, "-c", "import sys; from concordia.tools.entry import concordia_wal; "
           "sys.argv[0] = 'concordia-wal'; concordia_wal()", "bench", "recover", "--sizes", str(gib), "--tiers", "shm",
           "--no-torch", "--registered-max-gib", "0", "--json", "--out", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        raise RuntimeError(f"bench recover failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    d = json.load(open(path))
    (row,) = [r for r in d["rows"] if r["tier"] == "shm"]
    return {"command": "concordia-wal bench recover --sizes %d --tiers shm --no-torch --registered-max-gib 0" % gib,
            "total_s": row["total_s"], "restore_s": row["restore_s"], "plan_s": row["plan_s"],
            "open_s": row["open_s"], "GBps": row["GBps"], "via": row["via"],
            "session_total_s": row.get("session_total_s"), "ceiling_GBps": d["ceiling"]["GBps"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--control-trials", type=int, default=6)
    ap.add_argument("--gib", type=int, default=10)
    args = ap.parse_args()
    import cupy as cp
    import torch

    res = {"torch": torch.__version__, "cupy": cp.__version__, "device": torch.cuda.get_device_name()}
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip() or None
    except OSError:
        res["commit"] = None
    os.makedirs(args.out, exist_ok=True)

    def save():  # after every part, so a run cut short keeps what it measured
        with open(os.path.join(args.out, "framework.json"), "w") as f:
            json.dump(res, f, indent=2)

    t0 = time.perf_counter()
    res["stream_order"] = stream_order(torch, args.trials, ordered=True)
    res["control_unordered"] = stream_order(torch, args.control_trials, ordered=False)
    res["stream_order_s"] = time.perf_counter() - t0
    save()
    torch.cuda.empty_cache()
    try:
        pipe = bench_pipeline(args.gib)  # first: its log is gone before ours is written
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        res["pipeline_error"] = str(exc)
        save()
        print(res["pipeline_error"], file=sys.stderr)
        return 1
    res["pipeline"] = pipe
    save()
    h2d = _h2d(cp)
    ri = recover_into(torch, cp, args.gib)
    gbps = ri["bytes"] / ri["seconds"] / 1e9
    ri.update({"GBps": gbps, "h2d_GBps": h2d["GBps"], "pipeline": pipe,
               "ratio_to_h2d": gbps / h2d["GBps"],
               "ratio_to_pipeline": pipe["total_s"] / ri["seconds"],
               "recover_ratio_to_pipeline": (pipe["plan_s"] + pipe["restore_s"]) / ri["recover_s"]})
    res["recover_into"] = ri
    res["bf16_kv"] = {"tensors": ri["tensors"], "dtype": ri["dtype"], "registered_as_is": True,
                      "identical": ri["identical"]}
    save()
    so, ctl = res["stream_order"], res["control_unordered"]
    print(f"stream order: {so['held']}/{so['trials']} held (control, unordered: {ctl['held']}/{ctl['trials']})")
    print(f"recover into {ri['GiB']:.1f} GiB of {ri['tensors']} {ri['dtype']} tensors: {ri['seconds']:.3f} s "
          f"(open {ri['open_s']:.3f}, recover {ri['recover_s']:.3f}; {gbps:.1f} GB/s, via {ri['via']}), "
          f"{ri['ratio_to_h2d']:.2f} of H2D {h2d['GBps']:.1f} GB/s, {ri['ratio_to_pipeline']:.2f} of the pipeline "
          f"({pipe['total_s']:.3f} s; recover alone {ri['recover_ratio_to_pipeline']:.2f}); identical: {ri['identical']}")
    ok = so["held"] == so["trials"] and ri["identical"] and ri["via"] == ["device pipeline"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
