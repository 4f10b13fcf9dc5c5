"""The persistent kernel as a ring consumer, on a GPU: the protocol tests of the
CPU executor again, plus the handlers checked against their numpy twins.

Every wait is bounded (timeouts on each call, the watchdog, pytest-timeout),
every executor is stopped or quiesced before its test ends, and every module
is loaded once, before the first launch."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from concordia.executor.cpu import checkpoint_handler  # noqa: E402
from concordia.executor.errors import ExecutorError, ExecutorStalledError, RingFullError  # noqa: E402
from concordia.executor.host import Submitter  # noqa: E402
from concordia.executor.ring import ConsumerState, Op, Status, TaskView  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def g():
    """CuPy, and every module loaded before any executor runs."""
    import cupy

    from concordia.executor import persistent as gpu
    from concordia.tools.bench import kernels

    mods = {
        "child": gpu.ExecutorModule(child=True).load(),
        "inline": gpu.ExecutorModule(child=False).load(),
        "ckpt_only": gpu.ExecutorModule(child=True, ops=(Op.CHECKPOINT,)).load(),
        "bench": kernels.load_bench_kernels(),
    }
    # CuPy's own kernels used below, loaded now as well.
    with cupy.cuda.Stream(non_blocking=True) as s:
        x = cupy.arange(1 << 16, dtype=cupy.uint8)
        (x ^ 1).sum()
        bool((x == x).all())
        cupy.copyto(x, x)
        cupy.random.randint(0, 255, 16, dtype=cupy.uint8)
        cupy.zeros((4, 4), cupy.uint8)
        s.synchronize()

    class G:
        pass

    ns = G()
    ns.cupy, ns.gpu, ns.mods = cupy, gpu, mods
    return ns


@pytest.fixture
def rig(g):
    """Make (gring, submitter) pairs; stop what is still running at the end."""
    made = []

    def make(capacity=256, module="child", **kw):
        gring = g.gpu.GpuRing(capacity)
        ex = g.gpu.GpuExecutor(gring, g.mods[module], **kw)
        sub = Submitter(gring.ring, ex, stall_deadline_s=10.0)
        made.append((gring, sub))
        return gring, sub

    yield make
    for gring, sub in made:
        try:
            if sub.consumer is not None and sub.consumer.is_resident() and not gring.ring.stop_sent:
                sub.quiesce(timeout=10)
        finally:
            assert sub.consumer is None or sub.consumer.join(10), "executor still resident after teardown"
            gring.close()


def test_ping_round_trip_and_a_million_tasks_wrapping(rig):
    gring, sub = rig(256)
    c = sub.call(Op.PING, tag=42, timeout=10)
    assert c.ok and c.tag == 42 and c.executor_id == sub.consumer.executor_id
    lat = [sub.ping(timeout=5) for _ in range(2000)]
    assert np.median(lat) < 1e-3
    parts = []
    sub.on_reap = lambda comps: parts.append(comps[["seq", "tag", "status"]].copy())
    n = 1_000_000
    first, _ = sub.submit_batch(np.full(n, Op.PING), tags=np.arange(n, dtype=np.uint64), timeout=60)
    sub.drain(90)
    got = np.concatenate(parts)
    got = got[got["seq"] >= first]
    assert np.array_equal(got["tag"], np.arange(n, dtype=np.uint64))
    assert not got["status"].any()
    assert sub.stop(timeout=10).ok
    assert gring.ring.state == ConsumerState.STOPPED


def test_back_pressure_then_consumer(rig, g):
    gring, sub = rig(8)
    ex, sub.consumer = sub.consumer, None
    seqs = [sub.try_submit(Op.PING) for _ in range(8)]
    assert sub.try_submit(Op.PING) is None
    with pytest.raises(RingFullError):
        sub.submit(Op.PING, timeout=0.05)
    sub.consumer = ex
    sub.launch()
    assert [sub.wait(s, 10).seq for s in seqs] == seqs
    sub.stop(timeout=10)


def test_idle_release_and_lazy_relaunch(rig):
    gring, sub = rig(64, idle_s=0.001)
    assert sub.call(Op.PING, timeout=10).ok
    assert sub.consumer.join(5)                      # released residency on its own
    assert gring.ring.state == ConsumerState.IDLE_EXIT
    rng = np.random.default_rng(5)
    for i in range(200):
        time.sleep(float(rng.uniform(0, 0.002)))
        assert sub.call(Op.PING, tag=i, timeout=10).tag == i
    assert sub.launches >= 2
    sub.stop(timeout=10)


def test_stop_while_busy(rig, g):
    cp = g.cupy
    gring, sub = rig(64)
    n = 64 << 20
    src = cp.random.randint(0, 255, n, dtype=cp.uint8)
    dst = cp.zeros(n, dtype=cp.uint8)
    cp.cuda.Stream.null.synchronize()
    for t in range(40):
        sub.submit(Op.APPEND_LOG, tag=t, args=(dst.data.ptr, src.data.ptr, n, t * n), keep=False, timeout=10)
    c = sub.stop(timeout=30)
    assert c.ok and c.seq == 41 and sub.completed == 41 and sub.failed == 0
    assert bool((dst == src).all())
    with pytest.raises(ExecutorError):
        sub.submit(Op.PING)


def test_handlers_match_their_numpy_twins(rig, g):
    cp = g.cupy
    rng = np.random.default_rng(11)
    for module in ("child", "inline"):
        gring, sub = rig(16, module=module)
        pb, npages = 4096, 2048 if module == "child" else 64
        nbytes = pb * npages - 1024               # partial last page
        host = rng.integers(0, 256, nbytes, dtype=np.uint8)
        shadow_h = host.copy()
        dirty = np.sort(rng.choice(npages, npages // 10, replace=False))
        for p in dirty:
            host[p * pb + int(rng.integers(0, min(pb, nbytes - p * pb)))] ^= 0xA5
        src, shadow = cp.asarray(host), cp.asarray(shadow_h)
        out = cp.zeros((npages, pb), cp.uint8)
        ids = cp.zeros(npages, cp.uint32)
        cp.cuda.Stream.null.synchronize()
        c = sub.call(Op.CHECKPOINT, region=2, args=(src.data.ptr, shadow.data.ptr, out.data.ptr, ids.data.ptr,
                                                    nbytes, pb, 4096), timeout=30)
        # the numpy twin on host copies
        ref_out = np.zeros((npages, pb), np.uint8)
        ref_ids = np.zeros(npages, np.uint32)
        a = lambda x: x.ctypes.data  # noqa: E731
        ref = checkpoint_handler(TaskView(1, Op.CHECKPOINT, 0, 2, 0,
                                          (a(host), a(shadow_h), a(ref_out), a(ref_ids), nbytes, pb, 4096)))
        assert c.ok, c
        # scratch: [pages, bytes, done_blocks | errors << 32, ...] as the handler left it
        assert (c.pages, c.bytes, c.lsn_first, c.lsn_last) == (ref.pages, ref.bytes, ref.lsn_first, ref.lsn_last), \
            f"{module}: completion {c}; scratch {gring.scratch.get().tolist()}; twin {ref}"
        got_ids = ids[: c.pages].get()
        order = np.argsort(got_ids)
        assert np.array_equal(got_ids[order], ref_ids[: ref.pages])
        assert np.array_equal(out[: c.pages].get()[order], ref_out[: ref.pages])
        assert np.array_equal(shadow.get(), host)
        assert sub.call(Op.CHECKPOINT, args=(src.data.ptr, shadow.data.ptr, out.data.ptr, ids.data.ptr,
                                             nbytes, pb, 0), timeout=30).pages == 0
        # SCATTER the found pages into a stale copy
        stale = cp.asarray(np.where(np.arange(nbytes) % 7 == 0, 0, host).astype(np.uint8))
        cp.cuda.Stream.null.synchronize()
        r = sub.call(Op.SCATTER, args=(stale.data.ptr, out.data.ptr, ids.data.ptr, c.pages, pb, nbytes, 9),
                     timeout=30)
        assert r.ok and r.pages == c.pages and r.lsn_first == 9
        expect = np.where(np.arange(nbytes) % 7 == 0, 0, host).astype(np.uint8)
        for p in dirty:
            expect[p * pb: (p + 1) * pb] = host[p * pb: (p + 1) * pb]
        assert np.array_equal(stale.get(), expect)
        # APPEND_LOG straight into mapped host memory (a log-like target)
        logbuf = g.gpu.MappedHostBuffer(nbytes)
        try:
            a_ = sub.call(Op.APPEND_LOG, args=(logbuf.ptr, src.data.ptr, nbytes, 128), timeout=30)
            assert a_.ok and (a_.bytes, a_.lsn_first, a_.lsn_last) == (nbytes, 128, 128 + nbytes)
            assert np.array_equal(logbuf.array, host)
            # bad arguments and unknown ops are statuses
            assert sub.call(Op.CHECKPOINT, args=(src.data.ptr, shadow.data.ptr, out.data.ptr, ids.data.ptr,
                                                 nbytes, 100, 0), timeout=10).status == Status.BAD_ARGS
            assert sub.call(99, timeout=10).status == Status.UNSUPPORTED_OP
            sub.stop(timeout=10)
        finally:
            sub.consumer.join(10)
            logbuf.close()


def test_swap_under_load_between_modules(rig, g):
    cp = g.cupy
    gring, sub = rig(128, module="child")
    # The producer keeps publishing until all 9 swaps are done (at least n_min
    # tasks; n_max and 30 s bound it), so that every swap happens under load
    # however fast the executors are.  Each swap must start and finish
    # promptly beside it (a producer that never blocks once starved the swap
    # thread of the GIL until it had finished).
    n_min, n_max, pb = 12_000, 400_000, 256
    src = cp.asarray(np.random.default_rng(2).integers(1, 256, n_max * pb, dtype=np.uint8))
    shadow = cp.zeros(n_max * pb, cp.uint8)
    out = cp.zeros(n_max * pb, cp.uint8)
    ids = cp.zeros(n_max, cp.uint32)
    cp.cuda.Stream.null.synchronize()
    parts = []
    sub.on_reap = lambda comps: parts.append(comps[["tag", "op", "status", "pages", "executor_id"]].copy())
    done, swapped = threading.Event(), threading.Event()
    errors, produced = [], []

    def produce():
        t, until = 0, time.monotonic() + 30
        try:
            while t < n_max and (t < n_min or not swapped.is_set()) and time.monotonic() < until:
                o = t * pb
                sub.submit(Op.CHECKPOINT, tag=t, args=(src.data.ptr + o, shadow.data.ptr + o, out.data.ptr + o,
                                                       ids.data.ptr + 4 * t, pb, pb, o), keep=False, timeout=30)
                t += 1
        except Exception as exc:  # reported below
            errors.append(exc)
        produced.append(t)
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    order = [sub.consumer.executor_id]
    reports, took = [], []
    cycle = ["inline", "ckpt_only", "child"]
    try:
        while not done.is_set() and len(reports) < 9:
            t0 = time.perf_counter()
            time.sleep(0.005)
            ex = g.gpu.GpuExecutor(gring, g.mods[cycle[len(reports) % 3]])
            reports.append(sub.swap(ex, timeout=30))
            took.append(time.perf_counter() - t0 - 0.005)
            order.append(ex.executor_id)
    finally:
        swapped.set()
        th.join(60)
    assert not errors, errors
    n = produced[0]
    sub.drain(60)
    got = np.concatenate(parts)
    work = got[got["op"] == Op.CHECKPOINT]
    assert np.array_equal(np.sort(work["tag"]), np.arange(n, dtype=np.uint64)), "a task was lost or repeated"
    bad = work[(work["status"] != 0) | (work["pages"] != 1)]
    assert bad.size == 0, (f"{bad.size} of {work.size} CHECKPOINT completions did not find exactly one page "
                           f"(a task ran twice finds nothing the 2nd time); first: {bad[:5].tolist()}; "
                           f"by executor: {np.unique(bad['executor_id'], return_counts=True)}; order {order}")
    assert bool((shadow[: n * pb] == src[: n * pb]).all()) and not bool(shadow[n * pb:].any())
    ids_seen = got["executor_id"]
    runs = [int(ids_seen[0])] + [int(b) for a, b in zip(ids_seen[:-1], ids_seen[1:]) if a != b]
    assert runs == order[: len(runs)]
    assert len(reports) == 9, (f"the producer ended after {n} tasks, before the 9th swap; "
                               f"swaps {[(r.first_seq, round(r.quiesce_s, 4)) for r in reports]}; "
                               f"each took {[round(x, 4) for x in took]} s")
    assert max(took) < 1.0 and all(r.gap_s < 0.5 for r in reports), \
        (f"swaps took {[round(x, 4) for x in took]} s, gaps {[round(r.gap_s, 4) for r in reports]} s "
         f"beside a producer that published {n} tasks")
    assert n < n_max
    sub.stop(timeout=10)


def test_watchdog_catches_a_consumer_that_never_starts(rig, g):
    gring, sub = rig(16)
    sub.watchdog.deadline_s = 0.3
    flag = g.gpu.MappedHostBuffer(8)
    flag.array[:] = 0
    try:
        # A kernel ahead of the executor on its stream holds it back (bounded: 20 s).
        with gring.stream:
            g.mods["bench"]["cx_naive_spin"]((1,), (32,), (np.uint64(flag.ptr), np.uint64(20_000_000_000)))
        seq = sub.submit(Op.PING)
        t0 = time.monotonic()
        with pytest.raises(ExecutorStalledError, match="no task completed"):
            sub.wait(seq, timeout=10)
        assert time.monotonic() - t0 < 5
        flag.array.view(np.uint64)[0] = 1
        sub.watchdog.deadline_s = 10.0
        assert sub.wait(seq, timeout=10).ok
        sub.stop(timeout=10)
    finally:
        flag.array.view(np.uint64)[0] = 1
        sub.consumer.join(30)
        flag.close()


def test_module_load_is_refused_while_resident(rig, g):
    gring, sub = rig(16, idle_s=5.0)
    sub.call(Op.PING, timeout=10)
    assert sub.consumer.is_resident()
    with pytest.raises(ExecutorError, match="while a persistent executor is resident"):
        g.gpu.ExecutorModule(child=True, ops=(Op.SCATTER,)).load()
    sub.stop(timeout=10)


def test_sm_carveout_lowers_cublas_target_while_resident(rig, g):
    """The executor's sm_carveout lowers this thread's CuPy cuBLAS handle while it
    is resident and puts the original back once it is seen gone (the GEMMs
    planned under it are timed by `bench executor`)."""
    from concordia.executor.smtarget import SmTarget, cublas_library, device_sm_count

    cp = g.cupy
    lib = cublas_library()
    handle = int(cp.cuda.device.get_cublas_handle())
    before = lib.get(handle)
    n_sm = device_sm_count()
    gring, sub = rig(16, idle_s=30.0, sm_carveout=1)
    assert sub.call(Op.PING, timeout=10).ok
    assert lib.get(handle) == n_sm - 1
    with SmTarget(1, torch=False):           # a second holder of the same handle
        pass
    assert lib.get(handle) == n_sm - 1       # still held by the executor
    sub.quiesce(timeout=10)
    assert not sub.consumer.is_resident()
    assert lib.get(handle) == before
    sub.launch()
    assert sub.call(Op.PING, timeout=10).ok and lib.get(handle) == n_sm - 1
    sub.stop(timeout=10)
    assert lib.get(handle) == before
