"""RECOVER on the device (executor.cu built with CX_RECOVER, restore/ring.py):
a resident session's recovery onto the device is one RECOVER task of a
persistent kernel, which copies each page from the log mapping and checks
it there; what it restores is byte for byte what the host applier and the
CPU executor's twin restore, through a fresh session's pinned pieces and a
live session's own registration; a damaged page is named as the host
applier names it and leaves every target as it was."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.restore.ring import VIA, OwnKernel, RingRecovery, apply_plan_ring_host
from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import plan

from .test_restore_ring import REFUSED, damage_is_named_as_the_host_names_it, refused_runs
from .test_restore_transfer import _history, _sentinels

pytestmark = pytest.mark.gpu


def _device_state(seed: int) -> dict:
    import cupy as cp

    rng = np.random.default_rng(seed)
    return {"kv": cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32)),
            "lora": cp.asarray(rng.integers(0, 255, 70_001, dtype=np.uint8)),
            "sched": cp.asarray(rng.integers(0, 1 << 30, 4096, dtype=np.int64))}


def _write(spec: str, seed: int = 1, epochs: int = 3) -> dict:
    """A resident CuPy session's log: a base and deltas; returns the last epoch's state (host copies)."""
    import cupy as cp

    state = _device_state(seed)
    with Session(spec, size=64 << 20, segment_size=8 << 20, executor="resident", overwrite=True) as s:
        s.register("kv", state["kv"], kind="kv")
        s.register("lora", state["lora"], kind="adapter", page_bytes=8192)
        s.register("sched", state["sched"], page_bytes=1024)
        for e in range(epochs):
            if e:
                state["kv"][e] += 1
                state["lora"][e * 997] ^= 0xFF
                state["sched"][-1] = e
            s.checkpoint()
        cp.cuda.Device().synchronize()
    return {k: cp.asnumpy(v) for k, v in state.items()}


def test_a_resident_sessions_device_recovery_is_one_recover_task_of_a_persistent_kernel(shm_log):
    import cupy as cp

    want = _write(shm_log)
    with Session(shm_log, create=False, executor="resident") as s:
        targets = {n: cp.zeros(a.shape, a.dtype) for n, a in want.items()}
        s.recover(into=targets)
        st = s.last_recovery
        assert set(st.via.values()) == {"persistent kernel"}, st.via
        assert st.phases["transfer_check_scatter"]["via"] == VIA
        for name, a in want.items():
            assert cp.asnumpy(targets[name]).tobytes() == a.tobytes(), name
        kernel = s.resident.device_recovery
        assert isinstance(kernel, OwnKernel) and kernel.executor.launches == 1
        assert not kernel.executor.is_resident()   # it left once its task completed
        s.recover(into=targets)   # launched again for the next
        assert kernel.executor.launches == 2 and set(s.last_recovery.via.values()) == {"persistent kernel"}
        assert s.resident.device_recovery is kernel


def test_the_kernel_restores_byte_for_byte_what_the_twin_and_the_host_applier_restore(shm_log):
    """The same plan through the kernel, the CPU executor's twin and the host
    applier, on every page size of `_history` (a short last page included)."""
    _history(shm_log)
    log = Log.open(shm_log, writable=False, check_pages=False)
    engine = None
    try:
        p = plan(log)
        host = apply_plan_numpy(log, p)
        twin = apply_plan_ring_host(log, p)
        engine = RingRecovery()
        st = {}
        got = engine.apply(log, p, stats=st)
        assert st["via"] == VIA
        for name in host:
            g = got[name].get()
            assert g.tobytes() == twin[name].tobytes() == host[name].tobytes(), name
    finally:
        if engine is not None:
            engine.close()
        log.close()


def test_a_live_session_recovers_through_its_own_registration(shm_log):
    import cupy as cp

    state = _device_state(4)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, executor="resident", overwrite=True) as s:
        for name, a in state.items():
            s.register(name, a)
        s.checkpoint()
        state["kv"][3] = 9
        s.checkpoint()
        want = {k: cp.asnumpy(v) for k, v in state.items()}
        registered = s.runner.registration is not None
        # the session's device epochs run on a persistent kernel: the recovery is a task of that kernel
        assert s.resident.epoch_kernel() is not None
        targets = {n: cp.zeros_like(a) for n, a in state.items()}
        s.recover(into=targets)
        assert set(s.last_recovery.via.values()) == {"persistent kernel"}
        assert s.resident.device_recovery is None   # no kernel of its own was made
        assert ("register" in s.last_recovery.phases) != registered   # pinned ahead only without one
        for name, a in want.items():
            assert cp.asnumpy(targets[name]).tobytes() == a.tobytes(), name


def test_a_damaged_page_is_named_and_leaves_every_target_as_it_was(shm_log):
    import cupy as cp

    def on_the_kernel(log, p):
        engine = RingRecovery()
        try:
            return engine.apply(log, p)
        finally:
            engine.close()

    damage_is_named_as_the_host_names_it(shm_log, on_the_kernel)
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        sent = _sentinels(log)
    finally:
        log.close()
    with Session(shm_log, create=False, executor="resident") as s:   # through the session: no target written
        into = {n: cp.asarray(a) for n, a in sent.items()}
        with pytest.raises(CorruptionError, match="page CRC mismatch"):
            s.recover(into=into)
        for name, v in into.items():
            assert cp.asnumpy(v).tobytes() == sent[name].tobytes(), name


def test_a_recovery_the_ring_cannot_take_takes_the_pipeline_and_says_why(shm_log, monkeypatch):
    import cupy as cp

    from concordia.executor.errors import ExecutorError
    from concordia.restore import ring

    def refused(self, **kw):
        raise ExecutorError("module load while a persistent executor is resident", where="module child")

    want = _write(shm_log, seed=6)
    monkeypatch.setattr(ring.RingRecovery, "__init__", refused)
    with Session(shm_log, create=False, executor="resident") as s:
        targets = {n: cp.zeros(a.shape, a.dtype) for n, a in want.items()}
        s.recover(into=targets)
        st = s.last_recovery
        assert set(st.via.values()) == {"device pipeline"}
        assert "module load while a persistent executor is resident" in st.phases["transfer_check_scatter"]["ring_why"]
        for name, a in want.items():
            assert cp.asnumpy(targets[name]).tobytes() == a.tobytes(), name


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_kernel_refuses_a_descriptor_reaching_outside_the_log_or_a_region(case):
    """The twin's refusal cases on the kernel: BAD_ARGS, and no byte written
    outside the region (guard bytes on both sides of it stay as they were)."""
    import cupy as cp

    from concordia.executor.ring import Status
    from concordia.restore.ring import describe

    engine = RingRecovery()
    try:
        log = cp.arange(8192, dtype=cp.uint8)
        space = cp.full(3 * 4096, 0xA5, cp.uint8)   # the region is the middle 4 KiB, guards on both sides
        base = space.data.ptr + 4096
        runs = cp.asarray(refused_runs(case).view(np.uint8))
        table = cp.asarray(np.array([[base, 4096]], np.uint64))
        crcs, bad = cp.zeros(2, cp.uint32), cp.zeros(2, cp.uint8)
        desc = cp.asarray(describe(log=log.data.ptr, log_bytes=log.size, runs=runs.data.ptr, n_runs=1, pages=2,
                                   crc_table=crcs.data.ptr, n_crcs=crcs.size, regions=table.data.ptr, n_regions=1,
                                   bad=bad.data.ptr).view(np.uint8))
        cp.cuda.Device().synchronize()
        c = engine.run(desc.data.ptr)
        assert c.status == Status.BAD_ARGS
        got = cp.asnumpy(space)
        assert (got[:4096] == 0xA5).all() and (got[8192:] == 0xA5).all()
        assert not engine.faulted
    finally:
        engine.close()
