"""Session(executor="resident") runs a CuPy session's checkpoints as EPOCH tasks
of the persistent kernel (checkpoint/device_route.py); where the regions do
not allow it, the consumer thread runs them and the executor says why."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint.device_route import VIA, DeviceRoute
from concordia.policy import Policy

from .state import LOG_SIZE, SEGMENT


def test_a_host_session_takes_the_consumer_thread_and_says_why(shm_log):
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow")
        first = s.checkpoint()
        assert s.resident.info()["device_why"].startswith("the regions take no single table pass")
        a[7] = 1
        st = s.checkpoint()
        assert first.executor == st.executor == "resident" and st.pages["a"] == 1
        info = s.resident.info()
        assert info["device_epoch_handler"] is False and info["device_epochs"] == 0
        assert info["device_why"] == "the regions take no device table pass (CuPy regions, one mapped staging path)"
        assert VIA not in set(st.via.values())


def test_the_session_hands_the_route_to_its_resident_executor_only(shm_log):
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        assert isinstance(s.resident.device, DeviceRoute) and s.resident.device.session is s
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        assert s.resident is None


@pytest.mark.gpu
def test_a_cupy_sessions_checkpoints_run_on_the_persistent_kernel(shm_log):
    """The first checkpoint (the bases) takes the consumer thread; the next
    ones are EPOCH tasks: durable when they return (the session's epoch names
    them), listed when the session takes them on, each recovered exactly; a
    region registered midway builds the handler again; a named stream takes
    the consumer's path."""
    import cupy as cp

    rng = np.random.default_rng(5)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        kv = cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))
        lora = cp.asarray(rng.standard_normal(8192).astype(np.float32))
        s.register("kv", kv, detect="shadow", page_bytes=4096)
        s.register("lora", lora, kind="adapter", detect="fingerprint", page_bytes=4096)
        first = s.checkpoint()
        assert VIA not in set(first.via.values())
        states, given = {first.epoch: (kv.get(), lora.get())}, []
        for t in range(1, 7):
            kv[t, : 16 * t] += 1  # queued on the current stream: the epoch waits for it
            if t % 2:
                lora *= np.float32(0.5)
            st = s.checkpoint()
            assert st.executor == "resident" and set(st.via.values()) == {VIA}, (st.via, s.resident.info())
            assert st.pages["kv"] == 1 and st.pages["lora"] == (8 if t % 2 else 0)  # lora: 8 pages, all changed
            assert s.epoch == st.epoch  # durable: committed in the arena, before the session takes it on
            states[st.epoch] = (kv.get(), lora.get())
            given.append(st)
        info = s.resident.info()
        assert info["device_epoch_handler"] is True and info["device_epochs"] == 6 and info["device_why"] is None
        s.settle()
        assert all(any(st is c for c in s.checkpoints) for st in given)  # the objects returned, listed once
        assert len({id(c) for c in s.checkpoints}) == len(s.checkpoints)

        extra = cp.arange(4096, dtype=cp.float32)
        s.register("extra", extra, detect="shadow", page_bytes=4096)
        st = s.checkpoint()  # the new region's base: the consumer thread
        states[st.epoch] = (kv.get(), lora.get(), extra.get())
        extra[5] = -1
        st = s.checkpoint()
        assert set(st.via.values()) == {VIA} and st.pages["extra"] == 1
        states[st.epoch] = (kv.get(), lora.get(), extra.get())

        kv[9, 0] = 3
        st = s.checkpoint(stream=cp.cuda.get_current_stream())
        assert VIA not in set(st.via.values()) and s.resident.info()["device_why"].startswith("a stream was named")
        states[st.epoch] = (kv.get(), lora.get(), extra.get())

        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            got = s.recover(epoch)
            for name, w in zip(("kv", "lora", "extra"), want):
                g = got[name]
                assert np.asarray(g.get() if hasattr(g, "get") else g).tobytes() == w.tobytes(), (epoch, name)


def test_a_failed_device_epoch_makes_the_next_checkpoint_whole_on_the_consumer(shm_log, monkeypatch):
    """The route's own protocol on the CPU, the device's handler stood in for
    by one whose task fails after detection could have moved on: the error
    reaches the caller, every region's next checkpoint is whole, and the
    route stays off for these regions, saying why."""
    from concordia.checkpoint import device_epoch
    from concordia.errors import ExecutorError

    class FailingEpochs:
        def __init__(self, session, **kw):
            self.tpass = session.runner.table_pass(session.log)
            self.closed = False

        def ensure_arena(self):
            pass

        def epoch(self):
            raise ExecutorError("the EPOCH task timed out", where="device epoch")

        def close(self):
            self.closed = True

    monkeypatch.setattr(device_epoch, "why_not", lambda tpass, backend: None)
    monkeypatch.setattr(device_epoch, "DeviceEpochs", FailingEpochs)
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        a[7] = 1
        with pytest.raises(ExecutorError, match="timed out"):
            s.checkpoint()
        route = s.resident.device
        assert not route.active and route.failed == s.region_set.version
        a[4096 * 3] = 2
        st = s.checkpoint()
        assert VIA not in set(st.via.values()) and st.pages["a"] == 16  # whole: 16 pages of 4 KiB
        why = s.resident.info()["device_why"]
        assert why.startswith("the device's last EPOCH task failed: ExecutorError") and why.endswith("timed out"), why
        got = s.recover()["a"]
        assert int(got[7]) == 1 and int(got[4096 * 3]) == 2
