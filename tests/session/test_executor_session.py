"""The resident executor drives the Session (CPU executor): epochs as EPOCH
tasks, recoveries as RECOVER tasks, per-kind handlers hot-swapped in, the
commit by the consumer or by the host committer as the tier asks, and device-
side triggers that checkpoint with no call from the caller's thread.

On the CPU the consumer is a Python thread: the stall tests here stall the
caller in ways that release the GIL (time.sleep, a numpy operation); a stall
holding the GIL is the H200's check (scripts/gpu/executor_session.sh)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from concordia import Session
from concordia.errors import ExecutorError, SessionError
from concordia.executor import Op
from concordia.policy import Policy
from concordia.executor.resident import (AUTO_HOST_WHY, AUTO_WHY, LaunchCounter, PauseGate, StepCounter, commit_by,
                                         decide_auto, wait_for_epochs)

from .state import LOG_SIZE, SEGMENT, assert_same, copy, make_state, mutate, register_all


def new_session(log, **kw):
    return Session(log, size=LOG_SIZE, segment_size=SEGMENT, **kw)


def test_the_default_is_the_host_path_and_says_why(file_log):
    with new_session(file_log) as s:
        assert s.resident is None
        assert s.executor_info == {"executor": "host", "asked": "auto", "why": AUTO_WHY, "decided": False}
        s.register("a", np.zeros(4096, np.uint8))
        assert s.checkpoint().executor == "host"
        # decided once the first epoch is in: a numpy session on a file keeps the caller's thread, for good
        info = s.executor_info
        assert info["decided"] is True and info["decided_at"] == 1 and info["executor"] == "host"
        assert info["why"].endswith(AUTO_HOST_WHY) and s.resident is None
        assert s.checkpoint().executor == "host" and s.resident is None
    with new_session(file_log, create=False, executor="host") as s:
        assert s.executor_info["why"] is None and s.resident is None and s.executor_info["decided"] is True


def test_auto_keeps_a_host_sessions_epochs_on_the_callers_thread_and_names_why(shm_log):
    """On a tier the resident path could write (shm), a numpy session's
    epochs would be its consumer thread's, which loses: auto says so after
    the first epoch; a session that never checkpoints never decides."""
    with new_session(shm_log) as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow")
        s.checkpoint()
        why = s.executor_info["why"]
        assert s.executor_info["executor"] == "host" and s.resident is None
        assert why.startswith("region 'a' is in host memory") and why.endswith(AUTO_HOST_WHY), why
        a[5] = 1
        st = s.checkpoint()
        assert st.executor == "host" and st.pages["a"] == 1
    with new_session(shm_log, create=False) as s:
        s.register("a", np.zeros(1 << 16, np.uint8))
        assert int(s.recover()["a"][5]) == 1
        assert s.executor_info["decided"] is False and s.resident is None


def test_an_auto_decision_that_fails_leaves_the_callers_thread_and_says_why(shm_log):
    """The first epoch is committed when auto decides: an error while
    deciding leaves the session on the caller's thread, naming it."""
    with new_session(shm_log) as s:
        s.register("a", np.zeros(4096, np.uint8))
        s.checkpoint()

        def broken(session):
            raise RuntimeError("no device\nmore")

        resident, info = decide_auto(s, s.region_set, None, broken, 1)
        assert resident is None and info["executor"] == "host" and info["decided_at"] == 1
        assert info["why"].startswith("the resident path did not start (RuntimeError: no device); ")


def test_an_unknown_executor_is_one_line_and_opens_nothing(tmp_path):
    log = tmp_path / "never.log"
    with pytest.raises(SessionError, match="unknown executor 'gpu' \\(use auto, resident, host\\)"):
        new_session(f"file:{log}", executor="gpu")
    assert not log.exists()


@pytest.mark.parametrize("tier, by", [("memory", "executor"), ("shm", "executor"), ("file", "host")])
def test_resident_epochs_recover_bit_identical_and_match_the_host_path(tier, by, tmp_path, shm_log):
    logs = {"memory": ("memory:", "memory:"), "shm": (shm_log, shm_log + "-h"),
            "file": (f"file:{tmp_path / 'r.log'}", f"file:{tmp_path / 'h.log'}")}[tier]
    res_state, host_state = make_state(), make_state()
    res = new_session(logs[0], executor="resident")
    host = new_session(logs[1], executor="host")
    try:
        assert res.executor_info["commit_by"] == by == commit_by(res.log.backend)
        register_all(res, res_state)
        register_all(host, host_state)
        snaps = {}
        for e in range(1, 6):
            a, b = res.checkpoint(), host.checkpoint()
            assert a.executor == "resident" and b.executor == "host"
            assert (a.epoch, a.pages, a.bytes, a.base) == (b.epoch, b.pages, b.bytes, b.base)
            snaps[a.epoch] = copy(res_state)
            mutate(res_state, e)
            mutate(host_state, e)
        # the same records: every epoch of both logs restores the same state, the committed one
        for epoch, want in snaps.items():
            got = res.recover(epoch)
            assert res.last_recovery.epoch == epoch
            assert_same(got, want)
            assert_same(got, host.recover(epoch))
        st = res.checkpoint()
        assert_same(res.recover(), res_state)
        assert st.epoch == 6
        info = res.resident.info()
        assert info["epochs"] == 6 and info["commit_by"] == by
        assert info["kinds"] == {"kv": 6, "adapter": 6, "scheduler": 6, "opaque": 6}
        assert res.resident.submitter.completed >= 6 + 4  # EPOCH and RECOVER tasks went through the ring
    finally:
        res.close()
        host.close()


def test_a_recovery_into_the_registered_arrays_runs_on_the_consumer(file_log):
    state = make_state()
    with new_session(file_log, executor="resident") as s:
        register_all(s, state)
        s.checkpoint()
        want = copy(state)
        mutate(state, 1)
        done = s.resident.submitter.completed
        s.recover(into="registered")
        assert s.resident.submitter.completed == done + 1
        assert_same(state, want)
        state["kv"][0, 0, 0, 0] = 5.0  # one page of kv
        st = s.checkpoint()
        assert st.pages["kv"] == 1 and sum(st.pages.values()) == 1  # a delta from the recovered state
    with new_session(file_log, create=False, executor="resident") as s:
        assert (s.recover()["kv"][0, 0, 0, 0] == 5.0).all()


def test_a_new_kind_swaps_its_handler_in_and_a_known_kind_does_not(file_log):
    with new_session(file_log, executor="resident") as s:
        ex = s.resident
        s.register("a", np.zeros(8192, np.uint8))
        first = ex.consumer.executor_id
        assert len(ex.swaps) == 1 and ex.kinds == ("opaque",)
        s.register("b", np.ones(8192, np.uint8))            # same kind: no swap
        assert len(ex.swaps) == 1 and ex.consumer.executor_id == first
        s.checkpoint()
        s.register("kv", np.full(4096, 3, np.uint8), kind="kv")
        assert len(ex.swaps) == 2 and ex.consumer.executor_id != first and ex.kinds == ("kv", "opaque")
        swap = ex.swaps[-1]
        assert swap.old_executor == first and swap.new_executor == ex.consumer.executor_id
        assert ex.consumer.table.get(0x100) is not None  # the kv handler (KINDS[0])
        st = s.checkpoint()
        assert st.executor == "resident" and st.base == ["kv"]
        assert (s.recover()["kv"] == 3).all()


def test_a_new_kind_is_in_the_table_before_an_epoch_can_see_its_region(file_log):
    """A trigger's epoch may run between any two steps of `register`: the swap
    comes before the session lists the region, never after."""
    with new_session(file_log, executor="resident") as s:
        ex = s.resident
        s.register("a", np.zeros(8192, np.uint8))
        seen = []
        swap = ex.regions_added

        def watched(regions):
            swap(regions)
            seen.append([(r.name in s.region_set, ex.consumer.table.get(0x100) is not None) for r in regions])

        ex.regions_added = watched
        s.register("kv", np.full(4096, 3, np.uint8), kind="kv")
        assert seen == [[(False, True)]]   # the kv handler (KINDS[0]) first, then the region
        assert s.checkpoint().executor == "resident"


def test_regions_of_new_kinds_registered_together_get_every_handler_in_one_swap(file_log):
    """`register_all` of regions of two kinds the table lacks: one swap brings both handlers, before either is
    listed, and an epoch over them runs on the resident executor."""
    with new_session(file_log, executor="resident") as s:
        ex = s.resident
        s.register("a", np.zeros(8192, np.uint8))
        swaps = len(ex.swaps)
        s.register_all([dict(name="kv", array=np.full(4096, 3, np.uint8), kind="kv"),
                        dict(name="lora", array=np.full(4096, 5, np.uint8), kind="adapter")])
        assert len(ex.swaps) == swaps + 1
        assert {"kv", "adapter"} <= set(ex.kinds)
        st = s.checkpoint()
        assert st.executor == "resident" and sorted(st.base) == ["a", "kv", "lora"]
        got = s.recover()
        assert (got["kv"] == 3).all() and (got["lora"] == 5).all()


def test_an_epoch_of_a_kind_without_a_handler_is_refused_naming_it(file_log):
    with new_session(file_log, executor="resident") as s:
        s.register("a", np.zeros(4096, np.uint8), kind="adapter")
        s.checkpoint()
        ex = s.resident
        ex.submitter.swap(ex._consumer(()))  # a consumer whose table lacks the adapter handler
        with pytest.raises(ExecutorError, match="no handler for region kind 'adapter' in the operator table"):
            s.checkpoint()
        assert s.epoch == 1
        ex.submitter.swap(ex._consumer(("adapter",)))
        assert s.checkpoint().epoch == 2


def test_errors_of_the_epoch_are_raised_on_the_callers_thread(file_log):
    with new_session(file_log, executor="resident") as s:
        with pytest.raises(SessionError, match="nothing to checkpoint: no region is registered"):
            s.checkpoint()
        s.register("a", np.zeros(4096, np.uint8))
        assert s.checkpoint().epoch == 1  # the consumer lives on
        assert s.resident.consumer.errors == []


def test_the_host_committer_writes_the_commit_on_a_file_tier(file_log):
    seen = []
    with new_session(file_log, executor="resident") as s:
        s.register("a", np.zeros(4096, np.uint8))
        real = s.log.appender.commit

        def commit(*a, **k):
            seen.append(threading.current_thread().name)
            return real(*a, **k)

        s.log.appender.commit = commit
        s.checkpoint()
    with new_session("memory:", executor="resident") as m:
        m.register("a", np.zeros(4096, np.uint8))
        real = m.log.appender.commit
        m.log.appender.commit = lambda *a, **k: (seen.append(threading.current_thread().name), real(*a, **k))
        m.checkpoint()
    assert seen[0] == "session-committer" and seen[1].startswith("cpu-executor-")


def test_the_pause_gate_waits_for_the_step_in_progress():
    gate = PauseGate()
    inside, leave, order = threading.Event(), threading.Event(), []

    def producer():
        with gate.step():
            inside.set()
            leave.wait(10)
            order.append("step done")

    t = threading.Thread(target=producer)
    t.start()
    inside.wait(10)
    closer = threading.Thread(target=lambda: (gate.close(), order.append("closed")))
    closer.start()
    leave.set()
    closer.join(10)
    t.join(10)
    assert order == ["step done", "closed"] and gate.closed
    gate.open()
    with gate.step():
        pass
    assert gate.closes == 1


def _step_state(count: int) -> np.ndarray:
    """The producer's state after `count` steps (deterministic)."""
    a = np.zeros((32, 1024), np.uint32)
    for k in range(1, count + 1):
        a[(k * 7) % 32, k % 1024] = k
    return a


def _producer(a, steps, gate, counter, n, stop, epochs=None, every=0):
    """The 'device': decode steps, each inside the gate, each counted.  With
    `epochs` (how many the trigger has fired so far), the producer waits after
    each multiple of `every` until its epoch has fired (as a device step waits
    at its gate), however late the consumer comes to it."""
    for k in range(1, n + 1):
        if stop.is_set():
            return
        with gate.step():
            a[(k * 7) % 32, k % 1024] = k
            np.dot(np.ones((64, 64)), np.ones((64, 64)))  # a numpy step (releases the GIL)
            steps[0] = k
            counter.add(1)
        deadline = time.monotonic() + 60
        while epochs is not None and k % every == 0 and epochs() < k // every and time.monotonic() < deadline:
            time.sleep(1e-4)
        time.sleep(5e-4)


@pytest.mark.parametrize("stall", ["time.sleep", "numpy"])
def test_gil_releasing_stall_epochs_commit_at_the_trigger_rate_and_recover_identical(shm_log, stall):
    """The caller's thread is stalled (sleep or a long numpy operation: both release
    the GIL, see the module docstring) while the producer runs 60 steps,
    waiting after every sixth for its epoch; the trigger commits each of
    them from the consumer alone, at its step."""
    with new_session(shm_log, executor="resident", policy=None) as s:
        a = np.zeros((32, 1024), np.uint32)
        s.register("a", a)
        s.checkpoint()                      # the base, from the caller
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=6, counter=counter, gate=gate)
        steps, stop = [0], threading.Event()
        dev = threading.Thread(target=_producer, args=(a, steps, gate, counter, 60, stop, lambda: len(tr.fired), 6))
        calls = s.resident.submitter.completed
        dev.start()
        deadline = time.monotonic() + 60
        while dev.is_alive() and time.monotonic() < deadline:   # the stall: no call into the session
            if stall == "time.sleep":
                time.sleep(0.2)
            else:
                m = np.ones((400, 400))
                for _ in range(8):
                    m = m @ m / 400.0
        stop.set()
        dev.join(60)
        wait_for_epochs(s.resident, 60 // 6, 60.0)
        s.resident.disarm()
        fired = len(tr.fired)
        assert not tr.errors, tr.errors
        assert s.resident.submitter.completed == calls       # no task came from the caller
        assert [c for _, c in tr.fired] == [6 * (i + 1) for i in range(10)], tr.fired  # each at its step
        for epoch, count in tr.fired:
            np.testing.assert_array_equal(s.recover(epoch)["a"], _step_state(count), err_msg=f"epoch {epoch}")
        assert [c.reason for c in list(s.checkpoints)[1:]] == ["trigger:steps"] * fired
        assert all(c.executor == "resident" for c in s.checkpoints)
        # on shm, each epoch went into the session's arena: the device's protocol (checkpoint/arena.py)
        # and each let the producer go once it had read the regions (the twin of the device's snapshot)
        assert s.resident.info()["trigger"] == {"every": 6, "counter": "steps", "fired": fired, "armed": False,
                                                "in_arena": fired, "arena_why": None, "snapshot_epochs": fired}


def test_a_trigger_on_a_file_tier_commits_through_the_host_committer(file_log):
    with new_session(file_log, executor="resident") as s:
        a = np.zeros((32, 1024), np.uint32)
        s.register("a", a)
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=4, counter=counter, gate=gate)
        steps, stop = [0], threading.Event()
        _producer(a, steps, gate, counter, 12, stop)   # the producer on this thread; the epochs on the consumer
        wait_for_epochs(s.resident, 3, 60.0)
        assert not tr.errors and len(tr.fired) >= 1
        assert s.resident._committer is not None
        assert tr.in_arena == 0 and "tier needs a persist call (msync)" in s.resident.info()["trigger"]["arena_why"]
        epoch, count = tr.fired[-1]
    with new_session(file_log, create=False) as r:
        np.testing.assert_array_equal(r.recover(epoch)["a"], _step_state(count))


def test_a_failing_trigger_epoch_stops_the_trigger_and_says_why(file_log):
    with new_session(file_log, executor="resident") as s:
        a = np.zeros(4096, np.uint8)
        s.register("a", a)
        counter = StepCounter()
        tr = s.resident.trigger(every=1, counter=counter, gate=PauseGate())
        real = s.log.appender.commit

        def broken(*_a, **_k):
            raise OSError(5, "Input/output error")

        s.log.appender.commit = broken
        counter.add(1)
        deadline = time.monotonic() + 60
        while tr.armed and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert not tr.armed and tr.errors and "Input/output error" in tr.errors[0]
        s.log.appender.commit = real
        assert s.checkpoint().executor == "resident"  # the session goes on from the caller


def test_trigger_arguments_are_checked(file_log):
    with new_session(file_log, executor="resident") as s:
        with pytest.raises(SessionError, match="a trigger needs a registered region"):
            s.resident.trigger(every=2)
        s.register("a", np.zeros(64, np.uint8), page_bytes=64)
        for bad in (0, -1, 1.5, True):
            with pytest.raises(SessionError, match="a trigger's every must be a whole number > 0"):
                s.resident.trigger(every=bad)
        with pytest.raises(SessionError, match="a trigger counts with an object that has read"):
            s.resident.trigger(every=2, counter=object())


def test_a_trigger_without_a_gate_refuses_host_regions(file_log):
    """Without a gate the consumer's epoch would read a host array while the
    caller's thread writes it (a torn epoch): refused at `trigger`, in one
    line; with a gate the same trigger takes its epochs."""
    with new_session(file_log, executor="resident") as s:
        s.register("a", np.zeros(4096, np.uint8))
        with pytest.raises(SessionError, match="trigger without a gate would read host region 'a'") as e:
            s.resident.trigger(every=1, counter=StepCounter())
        assert "\n" not in str(e.value) and s.resident.trigger_ is None
        counter = StepCounter()
        tr = s.resident.trigger(every=1, counter=counter, gate=PauseGate())   # with a gate: taken
        counter.add(1)
        wait_for_epochs(s.resident, 1, 60.0)
        assert tr.fired and not tr.errors
        s.resident.disarm()


def test_close_stops_the_consumer(file_log):
    s = new_session(file_log, executor="resident")
    s.register("a", np.zeros(64, np.uint8), page_bytes=64)
    s.resident.trigger(every=2, gate=PauseGate())
    c = s.resident.consumer
    assert c.is_resident()
    s.close()
    assert not c.is_resident() and s.resident.ring.stop_sent
    assert s.resident.ring.state.name == "STOPPED"


def test_the_epoch_and_recover_op_codes_are_in_the_ring_and_the_cuda_source():
    assert (int(Op.EPOCH), int(Op.RECOVER)) == (7, 8)


@pytest.mark.gpu
def test_launch_counter_sums_the_exit_hook_counters():
    """Instrumented kernels count their launches; the trigger's counter sums them."""
    import cupy as cp
    from concordia import instrument

    rep = instrument.enable()
    try:
        src = r'extern "C" __global__ void bump(float* x) { x[threadIdx.x] += 1.0f; }'
        k = cp.RawModule(code=src).get_function("bump")
        x = cp.zeros(32, cp.float32)
        k((1,), (32,), (x,))
        cp.cuda.Device().synchronize()
        rec = rep.find("bump")
        counter = LaunchCounter([(rec.handle, rec.result)])
        assert counter.read() == 1
        for _ in range(5):
            k((1,), (32,), (x,))
        cp.cuda.Device().synchronize()
        assert counter.read() == 6
    finally:
        instrument.disable()


@pytest.mark.gpu
def test_a_cupy_session_checkpoints_through_the_resident_executor(shm_log):
    import cupy as cp

    with new_session(shm_log, executor="resident") as s:
        a = cp.zeros(1 << 20, cp.uint8)
        s.register("a", a)
        s.checkpoint()
        a[12345] = 7
        st = s.checkpoint()
        assert st.executor == "resident" and st.pages["a"] == 1
        assert int(s.recover()["a"][12345]) == 7


def test_torch_cpu_tensors_go_through_the_resident_executor(file_log):
    torch = pytest.importorskip("torch")
    t = torch.zeros(8192, dtype=torch.bfloat16)
    with new_session(file_log, executor="resident") as s:
        s.register("t", t)
        s.checkpoint()
        t[5000] = 2.5
        st = s.checkpoint()
        assert st.executor == "resident" and st.pages == {"t": 1}
        got = s.recover()["t"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, t)


@pytest.mark.gpu
@pytest.mark.parametrize("trial", range(3))  # a race between two threads queueing: more than one chance to show
def test_device_counted_steps_trigger_epochs_that_each_hold_the_step_they_record(shm_log, trial):
    """Steps queued on the device and counted there (DeviceStepCounter); the
    caller spins in pure Python meanwhile.  With no gate, the caller's stream
    is held at one point for each of the consumer's epochs (`Holds`), though
    the caller goes on queueing steps while the epoch queues: each epoch is
    one prefix of the caller's queued work.  A step writes `a`, then counts
    itself, so the point may fall between a step's write and its count (a
    step boundary needs a gate): `a` holds the steps counted, and perhaps
    the next one's write; before the holds, an epoch could miss a counted
    step's write, or hold a write two steps past its count."""
    import cupy as cp
    from concordia.executor.resident import DeviceStepCounter

    counter = DeviceStepCounter()
    a = cp.zeros((32, 1024), cp.uint32)
    x = cp.ones((4096, 4096), cp.float16)
    with new_session(shm_log, executor="resident") as s:
        s.register("a", a)
        s.register("steps", counter.word, page_bytes=64)
        s.checkpoint()
        tr = s.resident.trigger(every=8, counter=counter)
        for k in range(1, 201):                 # queued: the device runs them while the caller spins
            a[(k * 7) % 32, k % 1024] = k
            x @ x                               # the step's device time
            counter.add()
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:        # pure Python
            pass
        cp.cuda.get_current_stream().synchronize()
        wait_for_epochs(s.resident, 1, 60.0)
        s.resident.disarm()
        assert not tr.errors, tr.errors
        assert tr.fired
        for epoch, _ in tr.fired:
            got = s.recover(epoch)
            k = int(np.asarray(got["steps"])[0])
            a_got = np.asarray(got["a"])
            if not np.array_equal(a_got, _step_state(k)):   # the point fell inside step k + 1
                np.testing.assert_array_equal(a_got, _step_state(k + 1), err_msg=f"epoch {epoch}, {k} steps")


def test_the_epoch_completion_carries_the_pages_and_record_bytes(file_log):
    with new_session(file_log, executor="resident", staging="mapped") as s:
        a = np.zeros(64 * 4096, np.uint8)
        for i in range(64):
            s.register(f"r{i:02d}", a[i * 4096:(i + 1) * 4096])
        s.checkpoint()
        a[5] = a[4096 * 7] = a[4096 * 63 + 9] = 1
        st = s.checkpoint()
        ring = s.resident.ring
        c = ring.read_completion(ring.tail - 1)
        assert st.table_pass and c.op == Op.EPOCH and c.ok
        assert (c.pages, c.bytes) == (3, st.log_bytes) and sum(st.pages.values()) == 3


def test_dirty_bytes_waits_for_an_epoch_the_consumer_is_running(shm_log):
    """A bytes policy measures the detectors on the caller's thread; a trigger's
    epoch advances them on the consumer's: the measure waits for the epoch's
    lock instead of reading a detector half advanced."""
    with new_session(shm_log, executor="resident") as s:
        a = np.zeros(64 << 10, np.uint8)
        s.register("a", a, page_bytes=4096)
        s.checkpoint()
        a[:5000] = 1
        got, held, release = [], threading.Event(), threading.Event()

        def epoch_in_progress():
            with s.resident.lock:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=epoch_in_progress)
        holder.start()
        held.wait(10)
        measure = threading.Thread(target=lambda: got.append(s.dirty_bytes()))
        measure.start()
        measure.join(0.2)
        assert measure.is_alive() and got == []   # waiting for the lock
        release.set()
        holder.join(10)
        measure.join(10)
        assert got == [2 * 4096]


@pytest.mark.gpu
def test_a_trigger_epoch_whose_hold_timed_out_is_refused_not_committed(shm_log, monkeypatch):
    """A hold that keeps the caller's stream longer than HOLD_TIMEOUT_S lets
    it go: that epoch's reads may overlap later steps, so it is not committed,
    and the trigger stops and says why in one line."""
    import cupy as cp

    from concordia.executor.resident import DeviceStepCounter
    from concordia.regions import streams

    monkeypatch.setattr(streams, "HOLD_TIMEOUT_S", 0.05)
    counter = DeviceStepCounter()
    a = cp.zeros((32, 1024), cp.uint32)
    with new_session(shm_log, executor="resident") as s:
        s.register("a", a)
        s.register("steps", counter.word, page_bytes=64)
        first = s.checkpoint().epoch
        s.before_checkpoint(lambda: time.sleep(0.5))   # the epoch outlasts the hold
        tr = s.resident.trigger(every=1, counter=counter)
        a[0, 0] = 1
        counter.add()
        deadline = time.monotonic() + 20
        while tr.armed and time.monotonic() < deadline:
            time.sleep(0.01)
        s.resident.disarm()
        assert not tr.fired
        assert len(tr.errors) == 1 and "timed out" in tr.errors[0] and "\n" not in tr.errors[0]
        assert s.resident.trigger_.holds.broken() >= 1
        a[0, 0] = 2
        st = s.checkpoint()                             # the session goes on: a whole epoch after the refused one
        assert st.epoch > first and st.pages["a"] == a.nbytes // 4096
        got = s.recover()
        assert s.last_recovery.epoch == st.epoch and int(got["a"][0, 0]) == 2


def test_a_triggers_epochs_are_committed_in_an_arena_with_no_host_step(shm_log, tmp_path):
    """On shm the consumer writes each trigger epoch's records and its commit
    into an arena reserved ahead (checkpoint/arena.py: the protocol of the
    device's EPOCH handler, no appender, no commit call): a crash image taken
    after the stall, before any call of the caller's, holds every epoch fired;
    the caller's next call takes them on, and an arena that filled was taken
    on and replaced by the consumer on the way."""
    import os
    import shutil

    from tests.conftest import SHM_DIR

    with new_session(shm_log, executor="resident", policy=Policy(retain=False)) as s:  # every epoch kept
        a = np.zeros((32, 1024), np.uint32)
        s.register("a", a)
        base = s.checkpoint().epoch
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=1, counter=counter, gate=gate)

        def producer():  # each step waits for its epoch (bounded), so that every step is one: no timing
            for k in range(1, 401):
                with gate.step():
                    a[(k * 7) % 32, k % 1024] = k
                    counter.add(1)
                deadline = time.monotonic() + 30
                while len(tr.fired) < k and not tr.errors and time.monotonic() < deadline:
                    time.sleep(1e-4)

        dev = threading.Thread(target=producer)
        dev.start()
        dev.join(120)
        assert not dev.is_alive()
        s.resident.disarm()
        assert not tr.errors, tr.errors
        last, count = tr.fired[-1]
        assert [c for _, c in tr.fired] == list(range(1, 401))
        # 400 epochs of one page each fill an arena (it keeps room for a whole-table epoch): another is opened
        assert tr.in_arena == 400 and s.runner.arenas >= 2, s.runner.arenas
        image = tmp_path / "image"
        shutil.copyfile(os.path.join(SHM_DIR, shm_log.split(":", 1)[1]), image)
        assert s.log.last_committed_epoch < last  # the open arena's epochs are not taken on yet
        with Session(f"file:{image}", create=False) as r:  # ... but are committed in the log
            assert r.epoch == last
            np.testing.assert_array_equal(r.recover()["a"], _step_state(count))
        s.settle()
        assert s.epoch == last and s.runner.arena is None
        kept = [c.epoch for c in s.checkpoints]  # the newest CHECKPOINTS_KEPT
        assert kept == ([base] + [e for e, _ in tr.fired])[-len(kept):]
        for epoch, count in tr.fired[::37]:
            np.testing.assert_array_equal(s.recover(epoch)["a"], _step_state(count), err_msg=f"epoch {epoch}")
        assert s.checkpoint().epoch == last + 1  # the caller's own epochs follow


def test_a_trigger_epoch_its_arena_loses_is_written_whole_and_the_trigger_goes_on(shm_log):
    """A 2 MiB region with 1 MiB segments: the trigger's epochs go into
    arenas sized by the last epoch; a step that rewrites the region whole is
    lost there (detected, nothing written), taken on by the consumer, and
    written whole on the session's path in the same trigger epoch; the next
    steps go into a new arena (one loss is not taken as the epochs' size:
    `arena.last_epoch_bytes`).  Every fired epoch recovers its step's state."""
    with Session(shm_log, size=24 << 20, segment_size=1 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros(2 << 20, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=1, counter=counter, gate=gate)
        states = {}
        for k in range(1, 9):
            with gate.step():
                if k == 4:
                    a[:] = k
                else:
                    a[4096 * k + k] = k
                counter.add(1)
                states[k] = a.copy()
            deadline = time.monotonic() + 30
            while len(tr.fired) < k and not tr.errors and time.monotonic() < deadline:
                time.sleep(1e-4)
            assert not tr.errors, (k, tr.errors)
        s.resident.disarm()
        assert [c for _, c in tr.fired] == list(range(1, 9))
        assert tr.in_arena == 7 and s.runner.arenas_lost == 1, (tr.in_arena, s.runner.arenas_lost)
        s.settle()
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in tr.fired:
            np.testing.assert_array_equal(s.recover(epoch)["a"], states[count], err_msg=f"epoch {epoch}")


@pytest.mark.slow
def test_a_trigger_at_every_step_with_retention_never_fills_a_small_shm_log(shm_log):
    """2,000 trigger epochs, one per step, into arenas on a shm log of four
    segments with the default retention: retention runs as each arena is
    taken on (its epochs' commits one after another), the log never fills,
    and the last epoch recovers the state of its step."""
    with Session(shm_log, size=5 << 20, segment_size=1 << 20, executor="resident") as s:
        kv = np.zeros((64, 4096), np.uint8)
        lora = np.zeros(4096, np.float32)
        s.register("kv", kv)
        s.register("lora", lora, kind="adapter")
        s.checkpoint()
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=1, counter=counter, gate=gate)
        for k in range(1, 2001):
            with gate.step():
                kv[k % 64, (k * 13) % 4096] = k % 251
                lora[:] = np.float32(k)
                counter.add(1)
            deadline = time.monotonic() + 30
            while len(tr.fired) < k and not tr.errors and time.monotonic() < deadline:
                time.sleep(1e-4)
            assert not tr.errors, (k, tr.errors)
        s.resident.disarm()
        assert tr.in_arena == 2000 and s.runner.arenas > 10, s.runner.arenas
        s.settle()
        assert s.retention.error is None, s.retention.error
        assert s.retention.counts["switches"] > 0, dict(s.retention.counts)
        got = s.recover()
        np.testing.assert_array_equal(got["kv"], kv)
        np.testing.assert_array_equal(got["lora"], lora)
