"""The device restore pipeline on a GPU: bit-identical to the host applier on
every read path (preadv into pinned buffers, memory copies, the copy engine
reading a registered mapping), with chunks wrapping the staging ring, and a
damaged page named exactly."""

from __future__ import annotations

import gc

import pytest

from concordia.restore.device import apply_plan_cupy
from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.errors import CorruptionError, PlanError
from concordia.wal.planner import plan

from .test_restore_transfer import _history, flip_byte

pytestmark = pytest.mark.gpu


def _same(got, want):
    assert set(got) == set(want)
    for name in want:
        g = got[name].get()
        assert g.dtype == want[name].dtype and g.shape == want[name].shape
        assert g.tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("read", ["auto", "pin", "copy"])
@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 10, 32 << 20])
def test_device_restore_equals_host_restore(persistent_log, chunk_bytes, read):
    import concordia.restore.device as rd

    _history(persistent_log)
    log = Log.open(persistent_log, writable=False, check_pages=False)
    try:
        p = plan(log)
        st = {}
        got = apply_plan_cupy(log, p, chunk_bytes=chunk_bytes, stats=st, read=read)
        _same(got, apply_plan_numpy(log, p))
    finally:
        log.close()
    small = st["bytes_copied"] <= rd.PIN_SMALL_BYTES   # "auto" pins a small restore's pieces of shm
    pinned = persistent_log.startswith("shm:") and (read == "pin" or (read == "auto" and small))
    assert ("pinned ahead" in st["via"]) if pinned else ("preadv" in st["via"]), st
    assert st["chunks"] >= 1
    if chunk_bytes == 4096:
        assert st["chunks"] > 6  # more chunks than host buffers and device slots: the ring wraps


def test_pieces_pinned_ahead_span_many_pieces_and_stay_pinned_with_the_log(shm_log, monkeypatch):
    import concordia.restore.device as rd
    from concordia.devmem import cuda_host

    _history(shm_log)
    monkeypatch.setattr(rd, "REGISTER_PIECE", 64 << 10)  # every chunk reads several pieces
    log = Log.open(shm_log, writable=True, check_pages=False)   # writable: registered whole below
    try:
        p = plan(log)
        st = {}
        got = apply_plan_cupy(log, p, chunk_bytes=256 << 10, stats=st, read="pin")
        _same(got, apply_plan_numpy(log, p))
        assert "pinned ahead" in st["via"] and st["pins_kept"] == 0
        pieces = cuda_host.kept_pins(log.backend)   # kept pinned with the mapping
        assert len(pieces) > 1 and all(n == 64 << 10 for n in pieces.values()), pieces
        st = {}
        _same(apply_plan_cupy(log, p, chunk_bytes=256 << 10, stats=st, read="pin"), got)
        assert st["pins_kept"] == len(pieces), st   # a second restore finds them pinned
        # the log registered whole (a writer's staging) gives the pieces back first
        reg = cuda_host.register(log.backend)
        assert cuda_host.kept_pins(log.backend) == {}
        reg.unregister()
        _same(apply_plan_cupy(log, p, chunk_bytes=256 << 10, stats=st, read="pin"), got)
        assert cuda_host.kept_pins(log.backend)
    finally:
        log.close()
    assert cuda_host.kept_pins(log.backend) == {}   # given back as the log closed


@pytest.mark.parametrize("how", ["register", "alloc", "refused"])
def test_the_host_buffers_registered_or_allocated_restore_alike(shm_log, monkeypatch, how):
    """The copy path's pinned buffers: anonymous memory registered with CUDA,
    or CUDA's own allocation (asked for, or where the driver refuses to
    register host memory)."""
    import concordia.restore.device as rd
    from concordia.devmem import cuda_host
    from concordia.devmem.errors import HostRegisterRefusedError

    _history(shm_log)
    monkeypatch.setattr(rd, "_HOSTS", {})
    monkeypatch.setattr(rd, "HOST_BUFFER_HOW", "alloc" if how == "alloc" else "register")
    if how == "refused":
        def refuse(*_a, **_k):
            raise HostRegisterRefusedError("cudaHostRegister refused (this test)", where="host memory")
        monkeypatch.setattr(cuda_host, "pin", refuse)
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        p = plan(log)
        st = {}
        _same(apply_plan_cupy(log, p, chunk_bytes=64 << 10, stats=st, read="copy"), apply_plan_numpy(log, p))
    finally:
        log.close()
    assert "preadv" in st["via"], st
    kinds = {type(holder).__name__ for _, holder in next(iter(rd._HOSTS.values()))}
    assert kinds == {"_RegisteredBuffer"} if how == "register" else "_RegisteredBuffer" not in kinds, kinds


def test_memory_copy_path(persistent_log, monkeypatch):
    import concordia.restore.device as rd

    _history(persistent_log)
    monkeypatch.setattr(rd, "_source_of", lambda log: (None, log.backend.array, False))
    log = Log.open(persistent_log, writable=False, check_pages=False)
    try:
        p = plan(log)
        st = {}
        _same(apply_plan_cupy(log, p, chunk_bytes=64 << 10, stats=st, read="copy"), apply_plan_numpy(log, p))
    finally:
        log.close()
    assert "memory copies" in st["via"]


@pytest.mark.parametrize("pinned_in", [None, 64 << 10])
def test_registered_mapping_read_by_the_copy_engine(shm_log, pinned_in):
    # pinned_in: the mapping registered in pieces of that many bytes, as a log
    # larger than cuda_host.CHUNK is, so that copies cross the pieces' ends
    from concordia.devmem import cuda_host

    _history(shm_log)
    log = Log.open(shm_log, writable=True, check_pages=False)
    try:
        p = plan(log)
        with cuda_host.register(log.backend, **({"chunk_bytes": pinned_in} if pinned_in else {})) as reg:
            assert reg.piece == pinned_in
            st = {}
            got = apply_plan_cupy(log, p, chunk_bytes=64 << 10, stats=st, registration=reg)
            assert reg.registered  # a caller's registration stays
        _same(got, apply_plan_numpy(log, p))
    finally:
        log.close()
    assert st["via"].startswith("copy engine")


def test_damaged_page_is_named_and_nothing_is_returned(file_log):
    _history(file_log, epochs=1)
    log = Log.open(file_log, writable=False, check_pages=False)
    p = plan(log)
    src = p.regions["adapter"].sources[0]
    from concordia.gpu_kernels import reference as ref

    off = int(ref.record_payload_offsets(src.batch.offset, int(src.batch.page_ids.size), 4096, src.rows[2:3])[0])
    page = int(src.page_ids[2])
    log.close()
    flip_byte(file_log, off + 100, 1)
    log = Log.open(file_log, writable=False, check_pages=False)
    try:
        # planning checks every page it would restore (FORMAT.md R-D5): the only
        # epoch is refused before anything is read
        with pytest.raises(PlanError, match="no committed epoch"):
            plan(log)
        # a plan made without that check meets the damage where the page lands,
        # on the device, and names it as the host applier does: the same words
        # at the same offset (wal.apply.bad_page)
        unchecked = plan(log, check_pages=False)
        with pytest.raises(CorruptionError) as e:
            apply_plan_cupy(log, unchecked, chunk_bytes=64 << 10)
        with pytest.raises(CorruptionError) as host:
            apply_plan_numpy(log, unchecked)
    finally:
        log.close()
    assert f"page CRC mismatch for page {page} of region 'adapter'" in str(e.value)
    assert str(e.value) == str(host.value)
    assert str(e.value).split(": ", 1)[0].endswith(f"@ {off:#x}")


def test_a_restore_into_device_targets_writes_none_of_them_when_one_region_is_damaged(file_log):
    """`restore(into=)` with CuPy targets (behind `Session.recover(into=)`):
    the device pipeline restores into new arrays and the targets get one copy
    each once every region checked out; damage leaves every target as it was."""
    import cupy as cp

    from concordia.restore.run import restore

    from .test_restore_transfer import damage_leaves_targets_as_they_were

    damage_leaves_targets_as_they_were(file_log, lambda log, p, into: restore(
        log, plan=p, device=True, into={n: (v, cp) for n, v in into.items()}).arrays, xp=cp)


def test_a_large_restore_into_device_targets_gives_its_staged_copies_back(shm_log):
    """The device pipeline restores into new arrays, then copies them into the
    targets: staged copies of at least RELEASE_STAGED_BYTES go back to the
    driver afterwards, not to CuPy's pool, where a framework owning the
    targets (PyTorch) could not use them."""
    import cupy as cp
    import numpy as np

    from concordia import Session
    from concordia.policy import Policy
    from concordia.restore.device import DEFAULT_CHUNK_BYTES, _staging
    from concordia.restore.run import RELEASE_STAGED_BYTES

    n = RELEASE_STAGED_BYTES + (64 << 20)
    a = cp.asarray(np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8))
    # no retention: its jobs would free device buffers of their own at moments of their own
    with Session(shm_log, size=4 * n + (256 << 20), segment_size=n + (64 << 20), policy=Policy(retain=False),
                 executor="host") as s:  # the caller's pipeline and its staged copies
        s.register("a", a, page_bytes=1 << 20)
        s.checkpoint()
        s.settle()
        target = cp.zeros_like(a)
        pool = cp.get_default_memory_pool()
        # the pipeline's chunk slots, kept between restores, made before the measure whatever ran before
        _staging(cp, DEFAULT_CHUNK_BYTES)
        gc.collect()
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        held = pool.total_bytes()
        s.recover(into={"a": target})
        cp.cuda.get_current_stream().synchronize()
        # what the restore took from the pool (its chunk buffers), not what the pool gave back meanwhile
        # (earlier tests' arrays a collection frees at a moment of its own): the staged copy of n bytes
        # is not there
        grew = pool.total_bytes() - held
        assert grew < n // 4, (grew, pool.used_bytes(), pool.total_bytes())
        assert bool((target == a).all())


def test_memory_the_driver_refuses_is_cupys_out_of_memory_error():
    """Staged copies of memory of their own (`_zeroed_arrays`, own_memory) that the driver
    cannot give: the pool's free blocks go back and the driver is asked again,
    then CuPy's OutOfMemoryError, as `cupy.zeros` says it (it was an
    AttributeError: CuPy's runtime module names no errorMemoryAllocation)."""
    import cupy as cp

    from concordia.gpu_kernels import gpu
    from concordia.restore.device import _zeroed_arrays

    too_much = 2 * cp.cuda.runtime.memGetInfo()[1]
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):
        _zeroed_arrays(cp, gpu, [too_much // 2, too_much // 2], [True, True])
    assert [a.nbytes for a in _zeroed_arrays(cp, gpu, [4096], [True])] == [4096]   # and the next one is given


def test_arrays_of_memory_of_their_own_are_one_zeroed_block_each_aligned():
    """`_zeroed_arrays`: the arrays of memory of their own are carved from one
    block from the driver (one free once all are dropped, not one an array),
    each zeroed, apart and 512-byte aligned (the page kernels read 16 bytes
    at a time); the others come from CuPy's pool."""
    import cupy as cp

    from concordia.gpu_kernels import gpu
    from concordia.restore.device import OWN_ALIGN, _zeroed_arrays

    junk = cp.full(64 << 20, 7, cp.uint8)   # memory that held something before, given back to the driver
    cp.cuda.get_current_stream().synchronize()
    del junk
    cp.get_default_memory_pool().free_all_blocks()
    sizes, own = [64, 4096, 0, 100_000, 256], [True, False, True, True, True]
    got = _zeroed_arrays(cp, gpu, sizes, own)
    cp.cuda.get_current_stream().synchronize()
    assert [a.nbytes for a in got] == sizes
    assert all(int(a.sum()) == 0 for a in got)
    mine = [a for a, n, o in zip(got, sizes, own) if o and n]
    assert all(a.data.ptr % OWN_ALIGN == 0 for a in mine)
    assert len({id(a.data.mem._owner) for a in mine}) == 1   # one block holds them all
    spans = sorted((a.data.ptr, a.data.ptr + a.nbytes) for a in mine)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))   # apart
    got[3][:] = 9
    assert int(got[0].sum()) == 0 and int(got[4].sum()) == 0 and int(got[3].sum()) == 9 * 100_000
    assert not isinstance(got[1].data.mem, cp.cuda.UnownedMemory)   # the pool's