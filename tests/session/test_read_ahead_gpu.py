"""The read ahead on the GPU (`concordia.prefetch(device="cupy")`): the epoch
restored on the device pipeline into memory of its own, then one
device-to-device copy into each target, CuPy arrays and CUDA tensors alike;
damage met by the read is decided by the recovery from the log, and the
targets stay as they were."""

from __future__ import annotations

import numpy as np
import pytest

import concordia
from concordia import Session
from concordia.root_error import ConcordiaError

from .test_restore_deferred import _flip, _page_offset

pytestmark = pytest.mark.gpu

N = 1 << 20


def _log(spec) -> dict:
    """Two CuPy regions, a base and two deltas; the host copy of the last epoch."""
    import cupy as cp

    rng = np.random.default_rng(11)
    a = cp.asarray(rng.integers(0, 255, N, dtype=np.uint8))
    b = cp.asarray(rng.standard_normal(N // 4, dtype=np.float32))
    with Session(spec, size=64 << 20, segment_size=8 << 20, overwrite=True) as s:
        s.register("a", a, page_bytes=4096)
        s.register("b", b, page_bytes=4096)
        s.checkpoint()
        for e in range(2):
            a[e * 5000] = e + 1
            b[e * 7000] = -e
            s.checkpoint()
        return {"a": a.get(), "b": b.get()}


def test_cupy_targets_get_the_read_aheads_copies_and_the_session_goes_on(shm_log):
    import cupy as cp

    want = _log(shm_log)
    p = concordia.prefetch(shm_log, device="cupy")
    a, b = cp.full(N, 3, cp.uint8), cp.zeros(N // 4, cp.float32)
    with p.session() as s:
        s.register("a", a, page_bytes=4096)
        s.register("b", b, page_bytes=4096)
        s.recover(into="registered")
        assert np.array_equal(a.get(), want["a"]) and np.array_equal(b.get(), want["b"])
        ph = s.last_recovery.phases
        assert ph["read_ahead"]["used"] is True and ph["read_ahead"]["device"] is True
        assert ph["copy"]["bytes"] == a.nbytes + b.nbytes
        # where the copy's time goes: queueing the copies, the wait for them, the pool's blocks, the read's block
        assert set(ph["copy"]["parts"]) == {"queue_s", "wait_s", "pool_free_s", "release_s"}
        assert s.last_recovery.via == {"a": "device pipeline", "b": "device pipeline"}
        a[123] = 9
        st = s.checkpoint()   # a delta from the recovered state: one page
        assert st.epoch == 4 and sum(st.pages.values()) == 1


def test_cuda_tensors_and_new_arrays(shm_log):
    torch = pytest.importorskip("torch")
    import cupy as cp

    want = _log(shm_log)
    a = torch.zeros(N, dtype=torch.uint8, device="cuda")
    with concordia.prefetch(shm_log, device="cupy", readonly=True).session() as s:
        s.recover(into={"a": a}, regions=["a"])
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert np.array_equal(a.cpu().numpy(), want["a"])
    with concordia.prefetch(shm_log, device="cupy", readonly=True).session() as s:
        got = s.recover(device="cupy")
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert isinstance(got["b"], cp.ndarray) and np.array_equal(got["b"].get(), want["b"])
    with concordia.prefetch(shm_log, device="cupy", readonly=True).session() as s:
        host = s.recover()   # host arrays asked for: the device read ahead is passed over, the log read
        assert "asks for the other side" in s.last_recovery.phases["read_ahead"]["why_not"]
        assert np.array_equal(host["a"], want["a"])
    a2 = cp.zeros(N, cp.uint8)
    with concordia.prefetch(shm_log, device="cupy", readonly=True).session() as s:
        # a device target, and "b" as a new array on the host: passed over too, as "b" would be on the device
        got = s.recover(into={"a": a2}, regions=["a", "b"])
        assert "asks for the other side" in s.last_recovery.phases["read_ahead"]["why_not"]
        assert isinstance(got["b"], np.ndarray) and np.array_equal(got["b"], want["b"])
        assert np.array_equal(a2.get(), want["a"])


def test_damage_the_log_refuses_leaves_the_device_targets(file_log):
    import cupy as cp

    _log(file_log)
    _flip(file_log, _page_offset(file_log, "b", 1, 0) + 5)   # the base's page, no later epoch has it
    with Session(file_log, create=False, readonly=True) as plain:
        with pytest.raises(ConcordiaError) as refused:
            plain.recover(device="cupy")
    a, b = cp.full(N, 7, cp.uint8), cp.full(N // 4, 7, cp.float32)
    with concordia.prefetch(file_log, device="cupy").session() as s:
        with pytest.raises(type(refused.value)) as again:
            s.recover(into={"a": a, "b": b})
        assert str(again.value) == str(refused.value)
        assert s.ahead.used is False and s.ahead.why_not.startswith("the read ahead failed (")
    assert (a.get() == 7).all() and (b.get() == 7).all()


def test_the_detectors_start_from_tables_the_read_ahead_made_on_the_device(shm_log, monkeypatch):
    # restore.ahead.Seeds: CRC tables and fingerprints of its arrays, made on its stream; the caller hashes none
    import cupy as cp

    from concordia.checkpoint import detect, staging

    want = _log(shm_log)
    p = concordia.prefetch(shm_log, device="cupy")
    a, b = cp.zeros(N, cp.uint8), cp.zeros(N // 4, cp.float32)
    with p.session() as s:
        s.register("a", a, page_bytes=4096, detect="fingerprint")
        s.register("b", b, page_bytes=4096, detect="fingerprint")
        hashed = []
        real_crcs, real_fps = staging.page_crcs, detect.fingerprints
        monkeypatch.setattr(concordia.session, "page_crcs", lambda r: hashed.append(r.name) or real_crcs(r))
        monkeypatch.setattr(detect, "fingerprints", lambda r: hashed.append(r.name) or real_fps(r))
        s.recover(into="registered")
        monkeypatch.undo()
        assert hashed == [] and s.last_recovery.phases["read_ahead"]["used"] is True
        assert np.array_equal(a.get(), want["a"]) and np.array_equal(b.get(), want["b"])
        for r in s.region_set:
            assert isinstance(r.crcs, cp.ndarray) and cp.array_equal(r.crcs, staging.page_crcs(r)), r.name
            assert cp.array_equal(r.fps, detect.fingerprints(r)), r.name
        b[5] = 1.5
        st = s.checkpoint()
        assert st.pages == {"a": 0, "b": 1}


def test_many_targets_take_the_read_aheads_arrays_in_one_batched_copy(shm_log, monkeypatch):
    """A read ahead's arrays into as many targets as a model has tensors (BATCHED_COPIES or more): one launch
    copies them all (its kernel loaded on the read's thread), every target equals its epoch, and the next
    checkpoint goes on as a delta."""
    import cupy as cp

    from concordia.restore.run import BATCHED_COPIES

    rng = np.random.default_rng(3)
    sizes = [64 * (k + 1) + (k % 3) * 4096 for k in range(BATCHED_COPIES + 5)]
    src = [cp.asarray(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, overwrite=True) as s:
        s.register_all([dict(name=f"r{i}", array=a, page_bytes=64) for i, a in enumerate(src)])
        s.checkpoint()
    from concordia.gpu_kernels import gpu

    launches = []
    real = gpu.copy_checked_spans
    monkeypatch.setattr(gpu, "copy_checked_spans",
                        lambda pairs, **kw: launches.append(len(pairs)) or real(pairs, **kw))
    p = concordia.prefetch(shm_log, device="cupy")
    targets = [cp.full(n, 7, cp.uint8) for n in sizes]
    with p.session() as s:
        s.register_all([dict(name=f"r{i}", array=t, page_bytes=64) for i, t in enumerate(targets)])
        s.recover(into="registered")
        assert launches == [len(sizes)]   # one launch for every target
        ph = s.last_recovery.phases
        assert ph["read_ahead"]["used"] is True and ph["read_ahead"]["copy_kernel_s"] >= 0
        assert ph["copy"]["bytes"] == sum(sizes)
        assert all(bool((t == a).all()) for t, a in zip(targets, src))
        targets[4][10] ^= 1
        st = s.checkpoint()
        assert st.epoch == 2 and st.pages.get("r4") == 1 and sum(st.pages.values()) == 1


def test_arrays_handed_over_beside_targets_written_do_not_hold_the_reads_block(shm_log):
    """A recovery that writes one target and hands another region over as a new array: the new array is a
    copy in CuPy's pool, so the read's one block of memory goes back with the array copied from (a small
    array handed over kept a model-sized block alive)."""
    import cupy as cp

    want = _log(shm_log)
    p = concordia.prefetch(shm_log, device="cupy")
    a = cp.zeros(N, cp.uint8)
    with p.session() as s:
        out = s.recover(into={"a": a}, regions=["a", "b"], device="cupy")
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert out["a"] is a and np.array_equal(a.get(), want["a"])
        assert np.array_equal(cp.asnumpy(out["b"]), want["b"])
        assert not isinstance(out["b"].data.mem, cp.cuda.UnownedMemory)   # the pool's, not a view of the block


def test_the_reads_block_is_freed_behind_the_copies_and_goes_back_to_the_driver(shm_log, monkeypatch):
    """The read's one block of memory (`restore.device.OwnBlock`, allocated in stream order) is freed on the
    stream of the copies into the targets, behind them, with no host wait for them; every target gets its
    epoch, the block's memory goes back to the driver once the device is synchronised, and the next
    checkpoint is a delta."""
    import cupy as cp

    from concordia.restore import device

    n = 128 << 20
    rng = np.random.default_rng(5)
    src = cp.asarray(rng.integers(0, 255, n, dtype=np.uint8))
    with Session(shm_log, size=4 * n, segment_size=n + (8 << 20), overwrite=True) as s:
        s.register("a", src, page_bytes=4096)
        s.checkpoint()
    streams = []
    real = device.OwnBlock.free_after

    def seen(block, stream):
        streams.append((stream.ptr, real(block, stream)))
        return streams[-1][1]

    monkeypatch.setattr(device.OwnBlock, "free_after", seen)
    target = cp.full(n, 7, cp.uint8)
    pool = cp.get_default_memory_pool()
    for round_ in range(2):   # the first loads the kernels and makes the pipeline's slots, kept after
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        free_before = cp.cuda.runtime.memGetInfo()[0]
        p = concordia.prefetch(shm_log, device="cupy")
        with p.session() as s:
            s.register("a", target, page_bytes=4096)
            s.recover(into="registered")
            assert set(s.last_recovery.phases["copy"]["parts"]) == {"queue_s", "wait_s", "pool_free_s", "release_s"}
            # the block is freed behind the copies, on their stream, in stream order (True: no host wait)
            assert streams == [(cp.cuda.get_current_stream().ptr, True)] * (round_ + 1)
            cp.cuda.Device().synchronize()
            assert bool((target == src).all())
            pool.free_all_blocks()
            if round_:   # the block (n bytes) is back with the driver; the shadow detector's copy of the
                # region (n bytes, in use in CuPy's pool) is not, nor should it be; slack for the driver's granularity
                assert cp.cuda.runtime.memGetInfo()[0] >= free_before - n - n // 2
            target[12345 + round_] ^= 1
            st = s.checkpoint()
            assert st.pages == {"a": 1}
        src[12345 + round_] ^= 1


def _many(shm_log, count: int) -> list:
    """A log of `count` CuPy regions of mixed sizes (odd ones among them), one epoch; their arrays."""
    import cupy as cp

    rng = np.random.default_rng(count)
    sizes = [64 * (k + 1) + (k % 3) * 4096 for k in range(count)]
    src = [cp.asarray(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, overwrite=True) as s:
        s.register_all([dict(name=f"r{i}", array=a, page_bytes=64) for i, a in enumerate(src)])
        s.checkpoint()
    return src


@pytest.mark.parametrize("batched", [False, True], ids=["one-copy-a-target", "batched"])
def test_a_recovery_queues_its_copies_behind_the_targets_work_and_the_host_does_not_wait(shm_log, batched):
    """Work queued on the targets' stream before the recovery (a hold, released from another stream only
    once the call has returned) keeps the copies behind it on the device, not the host: recover() returns
    while the hold still holds, and once it is released every target equals its epoch.  Had the call waited
    for the device, it would have returned only at the hold's timeout, which the hold counts.  A first
    round without the hold loads every kernel the recovery launches (a lazily loaded module may wait for
    the device).  CuPy's pool holds free blocks the recovery did not leave there, from before the read
    and from the caller's work beside it (a long-running process's): they are not the recovery's to give
    back, and giving them back (cudaFree) would wait for the device."""
    import cupy as cp

    from concordia.gpu_kernels import gpu
    from concordia.restore import device
    from concordia.restore.run import BATCHED_COPIES, RELEASE_POOL_BYTES

    if not device._frees_in_order(cp.cuda.runtime, cp.cuda.Device().id):
        pytest.skip("this device's memory pool does not free in stream order (no pools, or a release "
                    "threshold above 0): the read's block is freed after the host waits, as documented")
    src = _many(shm_log, BATCHED_COPIES + 3 if batched else 2)
    held, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    spare = cp.empty(2 * RELEASE_POOL_BYTES, cp.uint8)
    del spare
    assert cp.get_default_memory_pool().free_bytes() >= 2 * RELEASE_POOL_BYTES
    for hold in (False, True):
        p = concordia.prefetch(shm_log, device="cupy")
        beside = cp.empty(2 * RELEASE_POOL_BYTES, cp.uint8)   # the caller's own work while the read runs
        p.wait()   # the read is whole, on its own stream
        del beside   # freed after the read began: still not the recovery's
        with held:
            targets = [cp.full(a.size, 7, cp.uint8) for a in src]
            words = cp.zeros(3, cp.uint64)
            gpu.launch_release_holds(words, 0)   # (its module loaded before any hold)
            with p.session() as s:
                s.register_all([dict(name=f"r{i}", array=t, page_bytes=64) for i, t in enumerate(targets)])
                held.synchronize()   # the targets and the words are written; from here the hold holds the stream
                if hold:
                    gpu.launch_hold(words, 1, 60 * 10**9)   # (released at once: the bound only ends a defect's wait)
                s.recover(into="registered")
                behind = held.record()
                assert s.last_recovery.phases["read_ahead"]["used"] is True
                if hold:
                    assert not behind.done   # the hold still holds: the call queued the copies behind it and left
                    with other:
                        gpu.launch_release_holds(words, 1)
                held.synchronize()
                assert cp.asnumpy(words).tolist() == ([1, 1, 0] if hold else [0, 0, 0])   # released, not timed out
                assert all(bool((t == a).all()) for t, a in zip(targets, src))
                targets[1][3] ^= 1
                st = s.checkpoint()
                assert st.pages.get("r1") == 1 and sum(st.pages.values()) == 1
        src[1][3] ^= 1   # what the log's latest epoch now holds


def test_a_batched_copy_whose_kernel_cannot_be_built_copies_with_the_copy_engine(shm_log, monkeypatch):
    """Where the batched copy's kernel cannot be built (KernelCompileError, nothing queued), every target
    is copied by the copy engine instead, and equals its epoch."""
    import cupy as cp

    from concordia.gpu_kernels import gpu, jit
    from concordia.gpu_kernels.errors import KernelCompileError
    from concordia.restore.run import BATCHED_COPIES

    src = _many(shm_log, BATCHED_COPIES + 3)
    real, tried = jit.function, []

    def function(name, kernel, *args, **kw):
        if (name, kernel) == ("copy", "copy_spans"):
            tried.append(kernel)
            raise KernelCompileError("no compiler here", where="copy")
        return real(name, kernel, *args, **kw)

    monkeypatch.setattr(jit, "function", function)
    engine = []
    real_engine = gpu.copy_engine
    monkeypatch.setattr(gpu, "copy_engine", lambda pairs: engine.append(len(pairs)) or real_engine(pairs))
    p = concordia.prefetch(shm_log, device="cupy")
    targets = [cp.full(a.size, 7, cp.uint8) for a in src]
    p.wait()
    tried.clear()   # (the read's thread asked for the kernel too, to load it ahead)
    with p.session() as s:
        s.register_all([dict(name=f"r{i}", array=t, page_bytes=64) for i, t in enumerate(targets)])
        s.recover(into="registered")
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert tried == ["copy_spans"]   # the kernel was asked for ...
        assert engine == [len(src)]      # ... then every pair went to the copy engine
        assert all(bool((t == a).all()) for t, a in zip(targets, src))
