"""`ResidentExecutor.step_trigger` (concordia/executor/step_trigger.py): a
producer marks each step's end with `step()` and the executor takes an epoch
at every `every`-th, with no other call: on the CPU the consumer thread while
the step holds (`StepGate`), on the GPU the persistent kernel at the step's
gate in stream order.  Every epoch holds the state of the step it was taken
at; an epoch its arena loses is written whole and the trigger goes on."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from concordia import Session
from concordia.errors import ExecutorError
from concordia.executor.step_trigger import StepGate
from concordia.policy import Policy


def _write(a, k: int, pages: int = 1) -> None:
    """Step `k`'s writes: one byte in each of `pages` pages (a quarter of the rows apart)."""
    for j in range(pages):
        a[(k * 97 + j * a.shape[0] // 4) % a.shape[0], (k * 13) % a.shape[1]] = k % 251


def _run(s, a, steps: int, every: int, *, whole_at=(), host=np.asarray, pages: int = 1):
    """`steps` steps of the producer, step() after each; {count: state} of every step."""
    tr = s.resident.step_trigger(every)
    states = {}
    for k in range(1, steps + 1):
        if k in whole_at:
            a[...] = k % 251
        else:
            _write(a, k, pages)
        tr.step()
        states[k] = np.array(host(a))
    return tr, states


def test_the_consumer_takes_an_epoch_at_every_nth_step_while_it_holds(shm_log):
    with Session(shm_log, size=32 << 20, segment_size=4 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros((64, 1024), np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        tr, states = _run(s, a, 40, 3)
        assert not tr.on_device and not tr.errors
        assert [c for _, c in tr.fired] == list(range(3, 41, 3))   # each at its multiple, none missed
        assert s.resident.info()["trigger"]["in_arena"] == 13
        tr.disarm()
        s.settle()
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in tr.fired:
            np.testing.assert_array_equal(s.recover(epoch)["a"], states[count], err_msg=f"epoch {epoch}")


def test_an_epoch_its_arena_loses_is_written_whole_in_the_same_step(shm_log):
    """A 2 MiB region against 1 MiB segments: every step's few pages go into
    arenas; the step that rewrites it whole is lost there and written whole
    by the session's path, and the steps after it go into the arena again
    (one loss is not taken as the epochs' size: `arena.last_epoch_bytes`)."""
    with Session(shm_log, size=32 << 20, segment_size=1 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros((2048, 1024), np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        tr, states = _run(s, a, 12, 1, whole_at=(5,))
        assert [c for _, c in tr.fired] == list(range(1, 13)) and not tr.errors
        assert s.runner.arenas_lost == 1 and s.resident.info()["trigger"]["in_arena"] == 11
        s.settle()
        for epoch, count in tr.fired:
            np.testing.assert_array_equal(s.recover(epoch)["a"], states[count], err_msg=f"epoch {epoch}")


def test_the_producer_may_recover_between_its_steps_with_the_trigger_armed(shm_log):
    """recover() from the producer's own thread comes between two of its
    steps: the RECOVER task does not wait for a gate the producer would have
    to reach."""
    with Session(shm_log, size=32 << 20, segment_size=4 << 20, executor="resident") as s:
        a = np.zeros((64, 1024), np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        tr, states = _run(s, a, 4, 1)
        epoch, count = tr.fired[-1]
        np.testing.assert_array_equal(s.recover(epoch)["a"], states[count])
        _write(a, 5)
        tr.step()
        assert [c for _, c in tr.fired] == [1, 2, 3, 4, 5]


def test_a_trigger_that_stops_lets_the_held_step_go_and_the_next_step_says_why(shm_log, monkeypatch):
    """An epoch that fails on the consumer stops the trigger: the step held
    for it goes on at once (not after the gate's 60 s), and the producer's
    next step raises the trigger's error in one line rather than going on
    with no epochs."""
    from concordia.executor.resident import ResidentExecutor

    with Session(shm_log, size=32 << 20, segment_size=4 << 20, executor="resident") as s:
        a = np.zeros((64, 1024), np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        tr = s.resident.step_trigger(1)

        def broken(self, reason, release=None):
            raise RuntimeError("the arena could not be written")

        monkeypatch.setattr(ResidentExecutor, "_arena_epoch", broken)
        _write(a, 1)
        tr.step()  # held, and let go when the epoch fails (kept holding, it would raise "not taken within")
        assert not tr.armed and "could not be written" in tr.errors[-1]
        with pytest.raises(ExecutorError, match="the trigger stopped: RuntimeError: the arena could not be written"):
            tr.step()


def test_a_step_gate_holds_only_at_its_multiples_and_lets_go_when_released():
    gate = StepGate(2)
    gate.step()   # 1: no hold
    assert gate.read() == 1
    held = threading.Event()

    def consumer():
        gate.close()   # returns once the producer holds at 2
        held.set()
        gate.open()

    t = threading.Thread(target=consumer)
    t.start()
    gate.step()   # 2: holds until the consumer opens
    t.join()
    assert held.is_set() and gate.read() == 2
    assert gate.held_steps == 1 and gate.held_s > 0   # counted as cx_step_gate counts its holds
    gate.release()
    gate.step()
    gate.step()   # 4: released, no hold
    assert gate.read() == 4 and gate.held_steps == 1
    with pytest.raises(ExecutorError, match="did not reach its gate"):
        StepGate(2).close(timeout=0.01)


@pytest.mark.gpu
def test_the_persistent_kernel_takes_the_epochs_at_the_steps_gate(shm_log):
    """A CuPy session: step() queues the gate on the producer's stream and
    waits for nothing; the kernel takes each epoch there; the host swaps the
    arena as it fills (small segments: several swaps); a whole rewrite is
    lost in its arena and written whole; every epoch recovers its step."""
    import cupy as cp

    with Session(shm_log, size=64 << 20, segment_size=1 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = cp.zeros((2048, 1024), cp.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        _write(a, 0, pages=4)  # CuPy's kernels loaded before the executor is resident
        cp.cuda.get_current_stream().synchronize()
        # four pages a step into arenas of a 1 MiB segment, each tried with room for ARENA_MIN_BYTES
        # (256 KiB), swapped once they have no room for the epochs the kernel may take next: several
        # swaps over 260 steps (how many depends on how far the device runs behind the host, so only
        # "at least two" is asserted)
        tr, states = _run(s, a, 260, 1, whole_at=(130,), host=lambda x: x.get(), pages=4)
        cp.cuda.get_current_stream().synchronize()
        assert tr.on_device
        held, held_s, gave_up = tr.held()  # the due steps the gate held (not those passed during a swap)
        tr.disarm()
        s.settle()
        fired = tr.fired  # once settled: the last epoch's commit may follow its step's gate (the snapshot)
        assert len(fired) <= held <= 260 and held_s > 0 and gave_up == 0, (held, held_s, gave_up, len(fired))
        assert tr.rotations >= 2 and len(tr.errors) == 1 and "did not fit" in tr.errors[0], (tr.rotations, tr.errors)
        # the descriptors of arenas swapped out are given back (a swap each few steps of a long run)
        assert len(tr.engine.descs) <= 2, len(tr.engine.descs)
        counts = [c for _, c in fired]
        # steps pass with no epoch only while the host swaps an arena or mends the lost one
        assert counts == sorted(set(counts)) and len(counts) >= 200, counts
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in fired:
            got = s.recover(epoch)["a"]
            assert np.asarray(got.get() if hasattr(got, "get") else got).tobytes() == states[count].tobytes(), epoch


class _Stream:
    ptr = 1

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeCupy:
    """numpy arrays in CuPy's place, for the host's side of DeviceStepTrigger."""

    uint64, uint32 = np.uint64, np.uint32
    zeros = staticmethod(np.zeros)

    class cuda:
        @staticmethod
        def get_current_stream():
            return _Stream()


class _Engine:
    """A stand-in for `DeviceEpochs` as the step trigger drives it: it takes
    an epoch at each armed multiple when its gate is queued (none up to the
    count it was told to skip), and can be told to report a status as the
    kernel's log would."""

    def __init__(self, name):
        self.name, self.armed, self.status, self.log, self.arms, self.queued = name, None, 0, [], 0, 0
        self.kernel_armed = False  # whether the kernel's trigger writes an arena (paused at a swap with none)
        self.closed_status = None  # once closed: its mapped words are gone (no mark_queued then)

    def trigger(self, every, counter, gate, skip=0):
        self.armed, self.status, self.kernel_armed = (every, counter, gate, skip), 0, True
        self.arms += 1

    def skip_through(self, count):
        if self.armed is not None:
            self.armed = self.armed[:3] + (count,)

    def step_gate(self, counter, gate):
        counter[0] += 1
        count = int(counter[0])
        if (self.armed is not None and self.kernel_armed and self.status == 0 and count % self.armed[0] == 0
                and count > self.armed[3]):
            self.log.append((100 + len(self.log), count))

    def mark_queued(self, steps):
        assert self.closed_status is None, "a closed engine's queued word is gone"
        self.queued = steps

    def close(self):
        self.closed_status, self.kernel_armed = 0, False

    def fired(self):
        return list(self.log)

    @property
    def last_count(self):
        return self.log[-1][1] if self.log else 0

    @property
    def trigger_status(self):
        return self.status

    def disarm(self):
        self.armed = None


class _Route:
    """A stand-in for ArenaRoute: the engine, the regions' version, the
    session's own checkpoints (recorded), a new engine when asked after one
    was dropped."""

    def __init__(self):
        self.engine, self.version, self.made = _Engine("first"), 1, 1
        self.checkpoints, self.rotations, self.failed = [], 0, None
        self.no_arena, self.why, self.coalesce, self.no_engine = None, None, False, None
        outer = self

        class Session:
            class region_set:
                version = 1

            @staticmethod
            def checkpoint(reason, on_full):
                outer.checkpoints.append((reason, on_full))
                return types.SimpleNamespace(coalesced=outer.coalesce)

        self.session = Session

    def rotate(self, ahead=1):
        """As ArenaRoute.rotate: with `no_arena` set, the swap finds none (the
        kernel's trigger stays paused, `why` says why); once it is cleared, a
        paused trigger is armed on a new arena."""
        if self.no_arena is not None:
            self.engine.kernel_armed, self.why = False, self.no_arena
            return False
        if self.engine.armed is not None and not self.engine.kernel_armed:
            self.engine.kernel_armed = True
            return True
        return False

    def device_engine(self):
        """The engine, a new one after it was dropped or the regions changed;
        with `no_engine` set, none (the old one closed, `why` says why)."""
        if self.no_engine is not None:
            if self.engine is not None:
                self.engine.close()
            self.engine, self.why = None, self.no_engine
            return None
        if self.engine is None or self.version != self.session.region_set.version:
            self.made += 1
            self.engine, self.version = _Engine(f"engine {self.made}"), self.session.region_set.version
        return self.engine

    def fail(self, exc):
        self.failed, self.engine = exc, None


def _host_side(monkeypatch, route=None):
    """The host's side of DeviceStepTrigger with no GPU: CuPy and the
    producer's stream stood in for.  Returns (the module, the route (a
    `_Route` unless given), a trigger every 4 steps on the route's engine)."""
    import concordia.executor.step_trigger as st

    monkeypatch.setattr(st, "require_cupy", lambda: _FakeCupy)
    monkeypatch.setattr(st, "producer_stream", lambda cp, last=None: (1, _Stream()))
    route = _Route() if route is None else route
    return st, route, st.DeviceStepTrigger(route, route.engine, 4)


def test_the_device_triggers_host_side_mends_what_stopped_it_at_a_due_step(monkeypatch):
    """The host's side of DeviceStepTrigger (no GPU here: a stand-in for the
    device engine; the H200 test runs the kernel): the gate is queued at
    every step whatever happens; a LOST status, a changed region set or an
    engine the route dropped are mended only at a due step (the caller has
    written that step's tokens), by the session's own checkpoint and the
    trigger armed on the route's engine, once, its kernel told to let that
    step's gate go (the checkpoint is its epoch); the kernel leaving (idle,
    its lifetime) is armed again at once; the engine knows the steps queued; a fault fails the route and raises;
    `fired` keeps the replaced engines' epochs; disarm sticks."""
    route = _Route()
    route.engine.queued = 99                             # a trigger before on this engine: its count is not ours
    st, route, tr = _host_side(monkeypatch, route)
    assert route.engine.queued == 0
    for _ in range(8):
        tr.step()
    assert [c for _, c in tr.fired] == [4, 8] and tr.armed and not tr.errors and route.engine.queued == 8
    route.engine.status = int(st.Status.LOST)      # the kernel's trigger stopped: an epoch lost
    tr.step()                                            # step 9: not due, the gate passes, nothing mended yet
    assert route.checkpoints == [] and not tr.armed and tr.steps == 9
    for _ in range(3):
        tr.step()                                        # step 12 is due: mended there, and its gate holds
    assert route.checkpoints == [("trigger", "coalesce")] and tr.errors == [
        "an epoch did not fit its arena (status 7)"] and tr.armed
    assert [c for _, c in tr.fired] == [4, 8], tr.fired  # step 12's epoch is the checkpoint, not a second one
    route.session.region_set.version = 2                 # a region registered: a new engine at the next due step
    for _ in range(8):
        tr.step()
    assert tr.engine.name == "engine 2" and len(route.checkpoints) == 2 and tr.engine.queued == 20
    assert [c for _, c in tr.fired] == [4, 8, 20], tr.fired  # the first engine's epochs kept
    tr.engine.status = st.TRIGGER_LEFT         # the kernel left at its lifetime: armed again at once
    arms = tr.engine.arms
    tr.step()
    assert tr.engine.arms == arms + 1 and tr.rearmed == 1 and len(route.checkpoints) == 2
    tr.engine.status = 4                                  # a timed-out epoch: the route fails, the step says so
    with pytest.raises(ExecutorError, match="stopped with status 4"):
        tr.step()
    assert route.failed is not None and tr.steps == 22    # the gate was queued all the same
    tr.disarm()
    for _ in range(6):
        tr.step()                                         # disarmed: no mending, no epochs, the steps count
    assert len(route.checkpoints) == 2 and tr.steps == 28 and not tr.armed


def _left_with_the_log_full(monkeypatch):
    """`_host_side` five steps in, the kernel having left (idle): returns
    (the module, the route, the trigger, its engine, an arming that finds
    the log full, for the test to put in the engine's place)."""
    from concordia.errors import LogFullError

    st, route, tr = _host_side(monkeypatch)
    for _ in range(5):
        tr.step()
    route.engine.status = st.TRIGGER_LEFT

    def full(*args, **kw):
        raise LogFullError("all 3 segments are live", where="log")

    return st, route, tr, route.engine, full


def test_a_kernel_that_left_and_cannot_be_armed_again_is_mended_at_the_next_due_step(monkeypatch):
    """The kernel left (idle) and arming it again finds no room (the log
    full): the step does not raise out of the caller's loop; the trigger is
    mended at the next due step by the session's own checkpoint."""
    st, route, tr, engine, full = _left_with_the_log_full(monkeypatch)
    monkeypatch.setattr(engine, "trigger", full)
    tr.step()                                      # step 6: the re-arm fails, nothing raised
    assert not tr.armed and route.checkpoints == [] and tr.steps == 6
    monkeypatch.undo()
    monkeypatch.setattr(st, "producer_stream", lambda cp, last=None: (1, _Stream()))
    tr.step()
    tr.step()                                      # step 8 is due: the session's checkpoint, armed again
    assert route.checkpoints == [("trigger", "coalesce")] and tr.armed
    assert len(tr.errors) == 1 and "arming the trigger again failed" in tr.errors[0], tr.errors
    assert engine.armed[3] == 8                    # step 8's gate let go: the checkpoint is its epoch


def test_a_due_step_with_no_arena_for_the_trigger_takes_the_sessions_path(monkeypatch):
    """The arena swap finds no arena (the log full, or none holds the epochs
    now): the kernel's trigger stays paused and passes the gates, and each due
    step's epoch is the session's own checkpoint (coalesced under log
    pressure), none skipped, said once (one line in `errors`, one
    TriggerWarning) however many steps it lasts; once an arena is there again
    the kernel takes the epochs."""
    from concordia.errors import TriggerWarning

    st, route, tr = _host_side(monkeypatch)
    for _ in range(4):
        tr.step()
    assert [c for _, c in tr.fired] == [4] and tr.uncovered == 0
    route.no_arena = "no arena for the trigger now: all 40 segments are live"
    with pytest.warns(TriggerWarning, match="no arena for the trigger") as caught:
        for _ in range(8):
            tr.step()                                    # steps 8 and 12 are due
    assert len(caught) == 1 and tr.uncovered == 2 and route.checkpoints == [("trigger", "coalesce")] * 2
    assert len(tr.errors) == 1 and tr.errors[0].startswith("step 8: no arena for the trigger"), tr.errors
    assert [c for _, c in tr.fired] == [4] and route.engine.armed[3] == 12  # the gates passed, no epoch twice
    route.no_arena = None
    for _ in range(4):
        tr.step()                                        # armed again at step 13: step 16 is the kernel's
    assert [c for _, c in tr.fired] == [4, 16] and len(route.checkpoints) == 2 and tr.uncovered == 2
    # a second run of such steps, the log too full for the session's epoch as well: coalesced, said again
    route.no_arena, route.coalesce = "no arena for the trigger now: all 40 segments are live", True
    with pytest.warns(TriggerWarning, match="step 20: no arena for the trigger now") as caught:
        for _ in range(4):
            tr.step()
    assert len(caught) == 1 and tr.coalesced == 1 and tr.uncovered == 2 and len(tr.errors) == 2
    assert caught[0].filename == __file__  # it points at the caller of step()


def test_a_trigger_with_no_engine_to_mend_onto_goes_on_with_the_sessions_epochs(monkeypatch):
    """An epoch lost, and at the due step that mends it no engine can be
    made (the log full: `route.why`): the step does not raise out of the
    caller's loop; the kernel's trigger went with its engine (no queued
    word written to it), each due step's epoch is the session's own, said
    once; once an engine can be made again the kernel takes the epochs."""
    from concordia.errors import TriggerWarning

    st, route, tr = _host_side(monkeypatch)
    for _ in range(4):
        tr.step()
    route.engine.status = int(st.Status.LOST)             # step 8's epoch lost
    route.no_engine = "the device's EPOCH handler did not start: LogFullError: all 40 segments are live"
    with pytest.warns(TriggerWarning, match="step 8: no engine for the trigger") as caught:
        for _ in range(8):
            tr.step()                                     # steps 8 and 12: the session's epochs, no raise
    assert len(caught) == 1 and tr.mended == 2 and route.checkpoints == [("trigger", "coalesce")] * 2
    assert tr.steps == 12 and not tr.armed and [c for _, c in tr.fired] == [4]
    route.no_engine = None
    for _ in range(8):
        tr.step()                                         # step 16 mends onto a new engine; 20 is the kernel's
    assert tr.engine.name == "engine 2" and tr.mended == 3 and [c for _, c in tr.fired] == [4, 20], tr.fired
    assert len(tr.errors) == 2 and tr.armed  # the engineless run's line, then the mend's reason


def test_a_mend_whose_arming_fails_goes_on_with_the_sessions_epochs(monkeypatch):
    """The kernel left and arming it again finds the log full, at the due
    step's mend as well (the route kept its engine): the step does not raise;
    the due step's epoch is the session's own, said once, and the next due
    step mends again, onto the same engine, once arming works."""
    from concordia.errors import TriggerWarning

    st, route, tr, engine, full = _left_with_the_log_full(monkeypatch)
    arm = engine.trigger
    engine.trigger = full
    with pytest.warns(TriggerWarning, match="step 8: arming the trigger again failed") as caught:
        for _ in range(3):
            tr.step()                              # steps 6 to 8: the re-arm and step 8's mend fail, no raise
    assert len(caught) == 1 and tr.mended == 1 and route.checkpoints == [("trigger", "coalesce")]
    assert tr.engine is engine and not tr.armed
    engine.trigger = arm
    for _ in range(4):
        tr.step()                                  # step 12 mends onto the same engine, armed again
    assert tr.mended == 2 and tr.armed and engine.armed[3] == 12 and [c for _, c in tr.fired] == [4]


def test_the_arena_is_kept_room_for_the_epochs_the_kernel_may_take_before_the_next_step(monkeypatch):
    """The host asks the route to swap the arena when it has no room for the
    epochs of the due gates queued since the kernel's last epoch, this
    step's included (`_ahead`): one while the stream keeps up; more while it
    runs behind, at most AHEAD_MAX; none before a step whose epoch the host
    took (`_skip`) counts."""
    st, route, tr = _host_side(monkeypatch)
    asked = []
    monkeypatch.setattr(route, "rotate", lambda ahead=1: asked.append(ahead) or False)
    for _ in range(8):
        tr.step()                                   # every 4: each due gate's epoch logged as it is queued
    assert asked == [1] * 8 and [c for _, c in tr.fired] == [4, 8]
    monkeypatch.setattr(route.engine, "step_gate", lambda counter, gate: None)  # the stream runs behind
    asked.clear()
    for _ in range(12):
        tr.step()
    # steps 9 to 15: the gate of 12 at most; from step 16 those of 12 and 16, then of 20 too (capped)
    assert asked == [1] * 7 + [2] * 5 and st.AHEAD_MAX == 2, asked
    tr._skip = 20                                   # as a mend leaves it: step 20's epoch was the host's
    asked.clear()
    tr.step()
    assert asked == [1]
