"""`concordia-wal bench executor`: the persistent executor against what it
replaces, every ceiling measured in the same run.

On a GPU (one run):
  round trip   PING through the ring (median, p99) / empty kernel launch +
               stream synchronise (goal: at most 0.5)
  residency    slowdown of an fp16 GEMM, a decode-shaped GEMV and a streaming
               add while the executor is resident and idle, after it released
               residency, and beside a naive resident block spinning on host
               memory (goal: at most 2 %)
  checkpoint   region scan + copy of changed pages through the executor (child
               grids, or the resident warp itself) / the same kernel launched
               from the host (goal: at least 0.8)
  hot swap     QUIESCE -> first task of the new executor, module preloaded, and
               with the new module compiled and loaded inside the gap
With `--cpu`: the CPU executor's round trip against a queue hand-off between two
threads, PING throughput against the ring protocol without threads, and a
numpy checkpoint through the executor against calling the handler directly.
Without a GPU (and no `--cpu`): one line, exit 2.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import click
import numpy as np

from concordia.executor.cpu import CpuExecutor, checkpoint_handler, numpy_operators
from concordia.executor.errors import ExecutorError
from concordia.executor.host import Submitter
from concordia.executor.ring import N_ARGS, ConsumerState, Op, Ring, TaskView

from ..common import check_outputs, guarded, report, require_cupy
from . import kernels
from .files import force_option


def _stats(samples) -> dict:
    a = np.asarray(samples, dtype=np.float64) * 1e6
    return {"median_us": round(float(np.median(a)), 3), "p99_us": round(float(np.percentile(a, 99)), 3),
            "n": int(a.size)}


# -- CPU -----------------------------------------------------------------------------

def run_cpu(quick: bool) -> dict:
    n_rt = 300 if quick else 3000
    n_tp = 100_000 if quick else 1_000_000
    ring = Ring.allocate(1024)
    sub = Submitter(ring, CpuExecutor(ring, numpy_operators()))
    sub.call(Op.PING)
    rt = []
    for _ in range(n_rt):
        rt.append(sub.ping(timeout=5))
    # ceiling: a round trip through two queue.Queue between two threads
    q_in, q_out = queue.Queue(), queue.Queue()

    def echo():
        while (x := q_in.get()) is not None:
            q_out.put(x)

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    qt = []
    for i in range(n_rt):
        t0 = time.perf_counter()
        q_in.put(i)
        q_out.get(timeout=5)
        qt.append(time.perf_counter() - t0)
    q_in.put(None)
    th.join(5)
    # throughput: batched PINGs through the thread vs the same protocol steps in one thread
    t0 = time.perf_counter()
    sub.submit_batch(np.full(n_tp, Op.PING), timeout=120)
    sub.drain(120)
    thread_s = time.perf_counter() - t0
    r2 = Ring.allocate(1024)
    z = np.zeros(1024, np.uint64)
    t0 = time.perf_counter()
    done = 0
    while done < n_tp:
        k = min(1024, n_tp - done)
        r2.publish_batch(np.full(k, Op.PING))
        idx, ops, regions, tags, _ = r2.take(done, k)
        r2.complete(done, idx, 1, ops, regions, tags, 0, z[:k], z[:k], z[:k], z[:k])
        r2.completions(done, done + k)
        r2.reaped = done = done + k
    inline_s = time.perf_counter() - t0
    # checkpoint: numpy handler through the executor vs called directly
    size, pb = (8 << 20, 4096) if quick else (64 << 20, 4096)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    npages = size // pb
    dirty = rng.choice(npages, npages // 10, replace=False)
    out = np.zeros(size, np.uint8)
    ids = np.zeros(npages, np.uint32)
    shadows = [src.copy(), src.copy()]
    reps = 3 if quick else 5
    t_ex, t_direct = [], []
    for _ in range(reps):
        src[dirty * pb] += 1
        for which, sink in ((0, t_ex), (1, t_direct)):
            args = (src.ctypes.data, shadows[which].ctypes.data, out.ctypes.data, ids.ctypes.data, size, pb, 0)
            t0 = time.perf_counter()
            if which == 0:
                c = sub.call(Op.CHECKPOINT, args=args, timeout=60)
                pages = c.pages
            else:
                pages = checkpoint_handler(TaskView(0, Op.CHECKPOINT, 0, 0, 0, args + (0,) * (N_ARGS - 7))).pages
            sink.append(time.perf_counter() - t0)
            assert pages == dirty.size
    # hot swap between two CPU executors
    gaps = [sub.swap(CpuExecutor(ring, numpy_operators()), timeout=10).gap_s for _ in range(5 if quick else 20)]
    sub.stop()
    rts, qts = _stats(rt), _stats(qt)
    ex_gbs, d_gbs = size / np.median(t_ex) / 1e9, size / np.median(t_direct) / 1e9
    return {
        "benchmark": "executor", "device": "cpu", "quick": quick,
        "round_trip": {"executor": rts, "ceiling_queue_handoff": qts,
                       "ratio_median": round(rts["median_us"] / qts["median_us"], 3)},
        "throughput": {"tasks": n_tp, "thread_tasks_per_s": round(n_tp / thread_s),
                       "ceiling_no_thread_tasks_per_s": round(n_tp / inline_s),
                       "ratio": round(inline_s / thread_s, 3)},
        "checkpoint": {"region_bytes": size, "page_bytes": pb, "dirty_pages": int(dirty.size),
                       "executor_gb_per_s": round(ex_gbs, 3), "direct_gb_per_s": round(d_gbs, 3),
                       "ratio": round(ex_gbs / d_gbs, 3)},
        "hot_swap": {"gap_median_us": round(float(np.median(gaps)) * 1e6, 1),
                     "gap_max_us": round(float(np.max(gaps)) * 1e6, 1), "swaps": len(gaps)},
    }


# -- GPU -----------------------------------------------------------------------------

def run_gpu(quick: bool) -> dict:
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    from concordia.executor import persistent as gpu

    cp = require_cupy(ExecutorError, where="gpu executor", hint="use --cpu for the CPU executor")  # exit 2
    doc = {"benchmark": "executor", "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "quick": quick}
    # 1. Every module and every CuPy kernel is loaded before any executor runs.
    t0 = time.perf_counter()
    child = gpu.ExecutorModule(child=True).load()
    inline = gpu.ExecutorModule(child=False).load()
    swap_b = gpu.ExecutorModule(child=True, ops=(Op.CHECKPOINT, Op.SCATTER)).load()
    bench = kernels.load_bench_kernels()
    doc["compile_s"] = {"child": round(child.load_s, 3), "inline": round(inline.load_s, 3),
                        "total": round(time.perf_counter() - t0, 3)}
    ws = cp.cuda.Stream(non_blocking=True)
    workloads = _workloads(cp, ws, quick)
    for w in workloads.values():
        w()
        w()
    ws.synchronize()
    ckpt = _checkpoint_setup(cp, quick)

    gring = gpu.GpuRing(1024)
    flag = gpu.MappedHostBuffer(8)
    ex = gpu.GpuExecutor(gring, child, idle_s=30.0, lifetime_s=120.0, sm_carveout=0)
    sub = Submitter(gring.ring, ex, stall_deadline_s=30.0)
    stages = {
        "round_trip": lambda: _round_trip(cp, bench, sub, quick),
        "checkpoint": lambda: _checkpoint(cp, gpu, gring, sub, child, inline, quick, ckpt),
        "residency": lambda: _residency(cp, gpu, bench, ws, workloads, gring, sub, flag, quick),
        "sm_target_sweep": lambda: _sm_target_sweep(cp, bench, ws, next(iter(workloads.values())), sub, flag, quick),
        "torch_gemm": lambda: _torch_gemm(cp, bench, sub, flag, quick),
        "hot_swap": lambda: _hot_swap(gpu, gring, sub, child, swap_b, quick),
    }
    errors = {}
    try:
        # A stage that fails is recorded and the rest still run (while the ring
        # is usable), so that one run reports every figure it can.
        for name, stage in stages.items():
            if gring.ring.state in (ConsumerState.FAULT, ConsumerState.STOPPED):
                errors[name] = f"not run: consumer {gring.ring.state.name.lower()}"
                continue
            try:
                doc[name] = stage()
            except ExecutorError as exc:
                errors[name] = exc.one_line()
            except Exception as exc:  # a CUDA or CuPy failure: recorded, the run goes on
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                errors[name] = f"{type(exc).__name__}: {first}"[:300]
        if not gring.ring.stop_sent and gring.ring.state != ConsumerState.FAULT:
            sub.stop(timeout=30)
    finally:
        flag.array.view(np.uint64)[0] = 1
        if sub.consumer.is_resident() and not gring.ring.stop_sent:
            sub.stop(timeout=30)
        sub.consumer.join(30)
        gring.close()
        flag.close()
    goals = {}
    if "round_trip" in doc:
        goals["round_trip_ratio<=0.5"] = doc["round_trip"]["ratio_median"] <= 0.5
    if "residency" in doc:
        goals["resident_idle_slowdown<=2%"] = all(v["executor_resident_idle_pct"] <= 2.0
                                                  for v in doc["residency"]["workloads"].values())
        goals["resident_idle_slowdown_with_sm_target<=2%"] = all(
            v["executor_resident_idle_sm_target_pct"] <= 2.0 for v in doc["residency"]["workloads"].values())
    if "checkpoint" in doc:
        goals["checkpoint_ratio>=0.8"] = doc["checkpoint"]["chosen_ratio"] >= 0.8
    doc["goals"] = goals
    if errors:
        doc["errors"] = errors
    return doc


def _workloads(cp, ws, quick):
    n = 4096 if quick else 8192
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    x = cp.random.standard_normal((n,), dtype=cp.float32).astype(cp.float16)
    m = (16 if quick else 64) << 20
    s1 = cp.random.standard_normal(m, dtype=cp.float32)
    s2 = cp.random.standard_normal(m, dtype=cp.float32)
    s3 = cp.empty_like(s1)
    reps = {"gemm": 4 if quick else 10, "gemv": 50 if quick else 200, "stream": 20 if quick else 50}

    def gemm():
        with ws:
            for _ in range(reps["gemm"]):
                cp.matmul(a, b)

    def gemv():
        with ws:
            for _ in range(reps["gemv"]):
                cp.matmul(a, x)

    def stream():
        with ws:
            for _ in range(reps["stream"]):
                cp.add(s1, s2, out=s3)

    return {f"gemm_fp16_{n}^3": gemm, f"gemv_fp16_{n}x{n}": gemv, f"stream_add_fp32_{m >> 20}M": stream}


def _round_trip(cp, bench, sub, quick):
    n = 2000 if quick else 20000
    s = cp.cuda.Stream(non_blocking=True)
    noop = bench["cx_noop"]
    launch = []
    for i in range(n + 200):
        t0 = time.perf_counter()
        with s:
            noop((1,), (1,), (np.uint64(0),))
        s.synchronize()
        if i >= 200:
            launch.append(time.perf_counter() - t0)
    sub.launch()
    for _ in range(200):
        sub.ping(timeout=10)
    rt = [sub.ping(timeout=10) for _ in range(n)]
    r, l_ = _stats(rt), _stats(launch)
    return {"executor_ping": r, "ceiling_launch_sync": l_, "ratio_median": round(r["median_us"] / l_["median_us"], 3),
            "ratio_p99": round(r["p99_us"] / l_["p99_us"], 3)}


def _checkpoint_setup(cp, quick):
    """Buffers and warmed kernels of the checkpoint comparison (before any executor runs)."""
    size = (64 << 20) if quick else (1 << 30)
    pb = 4096
    npages = size // pb
    src = cp.random.randint(0, 255, size, dtype=cp.uint8)
    shadow = src.copy()
    out = cp.empty(size, cp.uint8)
    ids = cp.empty(npages, cp.uint32)
    scratch = cp.zeros(8, cp.uint64)
    dirty = cp.asarray(np.random.default_rng(0).choice(npages, npages // 10, replace=False).astype(np.int64) * pb)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        src[dirty] += 1          # loads the scatter kernels now
        cp.copyto(shadow, src)
    s.synchronize()
    return dict(size=size, pb=pb, npages=npages, src=src, shadow=shadow, out=out, ids=ids, scratch=scratch,
                dirty=dirty, s=s)


def _checkpoint(cp, gpu, gring, sub, child, inline, quick, b):
    size, pb, npages, src, shadow, out, ids, scratch, dirty, s = (
        b[k] for k in ("size", "pb", "npages", "src", "shadow", "out", "ids", "scratch", "dirty", "s"))
    args = (src.data.ptr, shadow.data.ptr, out.data.ptr, ids.data.ptr, size, pb, 0)

    def dirty_again():
        with s:
            src[dirty] += 1
        s.synchronize()

    reps = 5 if quick else 15
    times = {"executor_child": [], "direct": []}
    for _ in range(reps):
        for mode in times:
            dirty_again()
            t0 = time.perf_counter()
            c = None
            if mode == "direct":
                pages = kernels.direct_checkpoint(child, scratch, s, gring.n_sm, src, shadow, out, ids, size, pb)
            else:
                c = sub.call(Op.CHECKPOINT, args=args, timeout=60)
                pages = c.pages
            times[mode].append(time.perf_counter() - t0)
            if pages != npages // 10:
                seen = f"completion {c}, executor scratch {gring.scratch.get().tolist()}" if c else "direct launch"
                raise gpu.ExecutorError(f"{mode} checkpoint found {pages} pages, expected {npages // 10} ({seen})",
                                        where="bench executor")
    # The resident warp doing the work itself (no child grids), measured on a smaller slice.
    sub.swap(gpu.GpuExecutor(gring, inline, idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=60)
    small = min(size, 64 << 20)
    t_inline = []
    for _ in range(2):
        dirty_again()
        t0 = time.perf_counter()
        sub.call(Op.CHECKPOINT, args=(src.data.ptr, shadow.data.ptr, out.data.ptr, ids.data.ptr, small, pb, 0),
                 timeout=60)
        t_inline.append(time.perf_counter() - t0)
    sub.swap(gpu.GpuExecutor(gring, child, idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=60)
    gbs = {m: size / float(np.median(t)) / 1e9 for m, t in times.items()}
    gbs["executor_inline"] = small / float(np.median(t_inline)) / 1e9
    chosen = max(("executor_child", "executor_inline"), key=lambda m: gbs[m])
    return {"region_bytes": size, "page_bytes": pb, "dirty_fraction": 0.1, "reps": reps,
            "gb_per_s_scanned": {m: round(v, 2) for m, v in gbs.items()},
            "median_ms": {m: round(float(np.median(t)) * 1e3, 3) for m, t in times.items()},
            "chosen": chosen, "chosen_ratio": round(gbs[chosen] / gbs["direct"], 3),
            "why": "handlers need the whole GPU: child grids keep the resident footprint at one warp "
                   "while the handler runs at full width; the resident warp alone scans far slower"}


def _naive_block(cp, bench, flag, spin_stream):
    """A context: the naive resident block (32 threads spinning on host memory)
    is on the GPU inside it and has left after it."""
    import contextlib

    @contextlib.contextmanager
    def held():
        flag.array.view(np.uint64)[0] = 0
        with spin_stream:
            bench["cx_naive_spin"]((1,), (32,), (np.uint64(flag.ptr), np.uint64(60_000_000_000)))
        time.sleep(1e-3)
        try:
            yield
        finally:
            flag.array.view(np.uint64)[0] = 1
            t0 = time.monotonic()
            while not spin_stream.done:
                if time.monotonic() - t0 > 30:
                    raise ExecutorError("naive spinner did not leave", where="bench executor")
                time.sleep(1e-4)

    return held


def _timer(cp, ws):
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def timed(w):
        w()                      # once untimed in the condition just set up (clocks, caches)
        start.record(ws)
        w()
        end.record(ws)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    return timed


def _residency(cp, gpu, bench, ws, workloads, gring, sub, flag, quick):
    """Slowdown of each workload (on its own stream) against no executor, per
    condition.  `*_sm_target` conditions lower cuBLAS's SM-count target by one
    (smtarget.py): with the executor's `sm_carveout=1`, or around the naive
    block, or with nothing resident (what the target alone costs)."""
    from concordia.executor.smtarget import SmTarget

    reps = 3 if quick else 15
    timed = _timer(cp, ws)
    spin_stream = cp.cuda.Stream(non_blocking=True)
    naive = _naive_block(cp, bench, flag, spin_stream)
    idle_exec = gpu.GpuExecutor(gring, sub.consumer.module, idle_s=30.0, lifetime_s=120.0, sm_carveout=0)
    release_exec = gpu.GpuExecutor(gring, sub.consumer.module, idle_s=0.002, lifetime_s=120.0, sm_carveout=0)
    target = SmTarget(1, torch=False)     # this thread's CuPy cuBLAS handle: the workloads' handle
    target_exec = gpu.GpuExecutor(gring, sub.consumer.module, idle_s=30.0, lifetime_s=120.0, sm_target=target)

    def measure(cond, w):
        if cond in ("none", "none_sm_target", "naive_resident_block", "naive_resident_block_sm_target"):
            sub.quiesce(timeout=30)          # no executor resident
            if sub.consumer is not None:
                sub.consumer.is_resident()   # an executor's SM target is put back once it is seen gone
        if cond == "none":
            return timed(w)
        if cond == "none_sm_target":
            with target:
                return timed(w)
        if cond.startswith("executor_"):
            ex = {"executor_resident_idle": idle_exec, "executor_released": release_exec,
                  "executor_resident_idle_sm_target": target_exec}[cond]
            sub.swap(ex, timeout=30)
            sub.ping(timeout=10)
            if cond == "executor_released" and not sub.consumer.join(5):
                raise gpu.ExecutorError("executor did not release residency", where="bench executor")
            if cond == "executor_resident_idle_sm_target" and not target.active:
                raise gpu.ExecutorError("resident executor's SM target is not applied", where="bench executor")
            return timed(w)
        with naive():
            if cond == "naive_resident_block_sm_target":
                with target:
                    return timed(w)
            return timed(w)

    conds = ["none", "executor_resident_idle", "executor_released", "naive_resident_block",
             "executor_resident_idle_sm_target", "none_sm_target", "naive_resident_block_sm_target"]
    result = {}
    for name, w in workloads.items():
        samples = {c: [] for c in conds}
        for r in range(reps):
            for c in conds[r % len(conds):] + conds[: r % len(conds)]:
                samples[c].append(measure(c, w))
        med = {c: float(np.median(v)) for c, v in samples.items()}
        base = med["none"]
        spread = float(np.max(samples["none"]) / np.min(samples["none"]) - 1) * 100
        row = {"median_ms": {c: round(v * 1e3, 4) for c, v in med.items()},
               "baseline_spread_pct": round(spread, 2)}
        for c in conds[1:]:
            row[f"{c}_pct"] = round((med[c] / base - 1) * 100, 2)
        result[name] = row
    sub.quiesce(timeout=30)
    sub.consumer.is_resident()
    if target.active:
        raise gpu.ExecutorError("SM target still applied after the executor left", where="bench executor")
    return {"reps": reps, "workloads": result,
            "sm_target": target.describe(),
            "executor": {"threads": 32, "shared_bytes": 0, "poll_max_ns": idle_exec.poll_max_ns,
                         "registers_per_thread": getattr(idle_exec.module.functions["cx_executor"], "num_regs", None),
                         "released_after_idle_s": release_exec.idle_ns / 1e9}}


def _sm_target_sweep(cp, bench, ws, gemm, sub, flag, quick):
    """The GEMM alone and beside the naive block, for several SM carve-outs:
    which carve-out removes the resident block's cost, and what each costs alone."""
    from concordia.executor.smtarget import SmTarget

    sub.quiesce(timeout=30)
    sub.consumer.is_resident()
    reps = 2 if quick else 5
    timed = _timer(cp, ws)
    naive = _naive_block(cp, bench, flag, cp.cuda.Stream(non_blocking=True))
    ks = (0, 1, 2, 4, 8)
    samples = {(k, beside): [] for k in ks for beside in (False, True)}
    for r in range(reps):
        for k in ks:
            for beside in ((False, True) if r % 2 == 0 else (True, False)):
                with SmTarget(k, torch=False):
                    if beside:
                        with naive():
                            samples[(k, beside)].append(timed(gemm))
                    else:
                        samples[(k, beside)].append(timed(gemm))
    base = float(np.median(samples[(0, False)]))
    return {"reps": reps, "baseline_ms": round(base * 1e3, 4),
            "carveouts": {str(k): {"alone_pct": round((float(np.median(samples[(k, False)])) / base - 1) * 100, 2),
                                   "beside_naive_block_pct":
                                       round((float(np.median(samples[(k, True)])) / base - 1) * 100, 2)}
                          for k in ks}}


def _torch_gemm(cp, bench, sub, flag, quick):
    """PyTorch's fp16 GEMM beside the naive block, with each of PyTorch's knobs:
    its experimental SM carve-out (cuBLASLt paths) and its cuBLAS handle's
    SM-count target.  Not run where PyTorch is missing."""
    try:
        import torch
    except Exception as exc:
        return {"skipped": f"torch not importable ({type(exc).__name__})"}
    from concordia.executor.smtarget import SmTarget, torch_knobs

    sub.quiesce(timeout=30)
    sub.consumer.is_resident()
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    reps_inner = 4 if quick else 10

    def w():
        with torch.cuda.stream(s):
            for _ in range(reps_inner):
                torch.mm(a, b)

    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed():
        w()
        ev0.record(s)
        w()
        ev1.record(s)
        ev1.synchronize()
        return ev0.elapsed_time(ev1) / 1e3

    timed()
    knobs, skipped = torch_knobs(1)
    by = {"carveout": [k for k in knobs if k.key == ("torch", "carveout")],
          "handle": [k for k in knobs if k.key[0] == "cublas"]}
    naive = _naive_block(cp, bench, flag, cp.cuda.Stream(non_blocking=True))
    conds = ["none", "naive_resident_block"] + [f"naive_resident_block_{m}" for m in by if by[m]] + \
        [f"none_{m}" for m in by if by[m]]
    samples = {c: [] for c in conds}
    for r in range(3 if quick else 7):
        for c in conds[r % len(conds):] + conds[: r % len(conds)]:
            m = c.rsplit("_", 1)[1] if c.endswith(("_carveout", "_handle")) else None
            with SmTarget(1, knobs=by[m]) if m else SmTarget(0):
                if c.startswith("naive"):
                    with naive():
                        samples[c].append(timed())
                else:
                    samples[c].append(timed())
    med = {c: float(np.median(v)) for c, v in samples.items()}
    return {"torch": torch.__version__, "shape": f"fp16 {n}^3 x{reps_inner}", "skipped_knobs": skipped,
            "median_ms": {c: round(v * 1e3, 4) for c, v in med.items()},
            "pct": {c: round((med[c] / med["none"] - 1) * 100, 2) for c in conds[1:]}}


def _hot_swap(gpu, gring, sub, child, swap_b, quick):
    n = 10 if quick else 40
    warm, loaded = [], []
    mods = [swap_b, child]
    for i in range(n):
        r = sub.swap(gpu.GpuExecutor(gring, mods[i % 2], idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=30)
        warm.append(r.gap_s)
    # with tasks queued behind QUIESCE
    for i in range(n // 2):
        for _ in range(32):
            sub.submit(Op.PING, keep=False)
        r = sub.swap(gpu.GpuExecutor(gring, mods[i % 2], idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=30)
        loaded.append(r.gap_s)
    # the new module compiled and loaded inside the gap (a variant no cache holds)
    cold = []
    for i in range(2):
        m = gpu.ExecutorModule(child=True, extra_options=(f"-DCX_BUILD_NONCE={time.time_ns()}{i}",))
        cold.append(sub.swap(gpu.GpuExecutor(gring, m, idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=60).gap_s)
    sub.swap(gpu.GpuExecutor(gring, child, idle_s=30.0, lifetime_s=120.0, sm_carveout=0), timeout=30)
    return {"preloaded": _stats(warm), "preloaded_with_32_queued": _stats(loaded),
            "compile_in_gap": _stats(cold)}


def _table(doc: dict) -> str:
    lines = [f"executor on {doc['device']}" + (" (quick)" if doc.get("quick") else "")]
    rt = doc.get("round_trip")
    if doc["device"] == "cpu":
        lines.append(f"round trip  median {rt['executor']['median_us']:.1f} us  p99 {rt['executor']['p99_us']:.1f} us"
                     f"  vs queue hand-off {rt['ceiling_queue_handoff']['median_us']:.1f} us"
                     f"  ratio {rt['ratio_median']:.2f}")
        tp = doc["throughput"]
        lines.append(f"throughput  {tp['thread_tasks_per_s']:,} tasks/s  vs no thread "
                     f"{tp['ceiling_no_thread_tasks_per_s']:,}  ratio {tp['ratio']:.2f}")
        ck = doc["checkpoint"]
        lines.append(f"checkpoint  {ck['executor_gb_per_s']:.2f} GB/s  vs direct {ck['direct_gb_per_s']:.2f}"
                     f"  ratio {ck['ratio']:.2f}")
        lines.append(f"hot swap    gap median {doc['hot_swap']['gap_median_us']:.0f} us")
        return "\n".join(lines)
    if rt is not None:
        lines.append(f"round trip  median {rt['executor_ping']['median_us']:.2f} us  "
                     f"p99 {rt['executor_ping']['p99_us']:.2f} us  vs launch+sync "
                     f"{rt['ceiling_launch_sync']['median_us']:.2f} us  ratio {rt['ratio_median']:.2f}")
    ck = doc.get("checkpoint")
    if ck is not None:
        lines.append("checkpoint  " + "  ".join(f"{m} {v:.1f} GB/s" for m, v in ck["gb_per_s_scanned"].items())
                     + f"  chosen {ck['chosen']} ratio {ck['chosen_ratio']:.2f}")
    if "residency" in doc:
        lines.append(f"{'residency slowdown %':<28}{'resident idle':>14}{'+sm target':>11}{'released':>10}"
                     f"{'naive':>8}{'+sm target':>11}{'target only':>12}{'spread':>8}")
        for name, v in doc["residency"]["workloads"].items():
            lines.append(f"{name:<28}{v['executor_resident_idle_pct']:>14.2f}"
                         f"{v['executor_resident_idle_sm_target_pct']:>11.2f}{v['executor_released_pct']:>10.2f}"
                         f"{v['naive_resident_block_pct']:>8.2f}{v['naive_resident_block_sm_target_pct']:>11.2f}"
                         f"{v['none_sm_target_pct']:>12.2f}{v['baseline_spread_pct']:>8.2f}")
    sw = doc.get("sm_target_sweep")
    if sw is not None:
        lines.append("gemm by SM carve-out  " + "  ".join(
            f"{k}: alone {v['alone_pct']:+.2f}% beside naive {v['beside_naive_block_pct']:+.2f}%"
            for k, v in sw["carveouts"].items()))
    tg = doc.get("torch_gemm")
    if tg is not None:
        lines.append("torch gemm  " + (tg["skipped"] if "skipped" in tg else
                                       "  ".join(f"{c} {p:+.2f}%" for c, p in tg["pct"].items())))
    hs = doc.get("hot_swap")
    if hs is not None:
        lines.append(f"hot swap    preloaded {hs['preloaded']['median_us']:.0f} us  with queue "
                     f"{hs['preloaded_with_32_queued']['median_us']:.0f} us  compile in gap "
                     f"{hs['compile_in_gap']['median_us'] / 1e3:.0f} ms")
    lines.append("goals       " + "  ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in doc["goals"].items()))
    for name, err in doc.get("errors", {}).items():
        lines.append(f"FAILED      {name}: {err}")
    return "\n".join(lines)


@click.command("executor")
@click.option("--cpu", "on_cpu", is_flag=True, help="benchmark the CPU executor (runs without a GPU)")
@click.option("--quick", is_flag=True, help="small sizes, few repetitions (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(on_cpu, quick, as_json, out, force):
    """Task round trip, residency cost, checkpoint throughput and hot-swap gap
    of the persistent executor, beside the launches it replaces.

    Example:

    \b
        concordia-wal bench executor --json --out executor.json
        concordia-wal bench executor --cpu --quick
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    doc = run_cpu(quick) if on_cpu else run_gpu(quick)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
    if doc.get("errors"):
        name, first = next(iter(doc["errors"].items()))
        raise ExecutorError(f"{len(doc['errors'])} stage(s) failed, first {name}: {first}", where="bench executor")


# The idle-residency measurement, shared with `bench executor-session` (which
# runs it beside an open Session).
workloads = _workloads
residency = _residency
