"""A trigger for a producer that marks its steps with one call: `generate()`'s
stopping criterion (`integrations.transformers.CheckpointEvery`) on a
resident session.

    tr = s.resident.step_trigger(every=1)   # after the session's first epoch
    for step in ...:
        ...                                 # the step's work, queued or done
        tr.step()                           # the step ends here: counted, held while its epoch is taken
    s.settle()                              # the epochs taken on; tr.fired: [(epoch, count)]

Where the device's EPOCH handler takes the session's epochs (a CuPy or CUDA
tensor session on shm or huge pages, every region found dirty on the device:
`checkpoint.arena_route`), `step()` queues executor.cu's `cx_step_gate` on
the producer's stream (PyTorch's current stream where it is in use, else
CuPy's): the step is counted in stream order, and at each multiple of
`every` the persistent kernel holds the stream there, writes the epoch into
the session's arena and lets go.  The host queues one launch a step and
waits for nothing; `step()` also swaps the arena for a new one once it has
no room for the epochs the kernel may take before the next `step()`
(`ArenaRoute.rotate`: a few host milliseconds every arena).  A
due step that finds no arena for it (the log full, or none holds its epoch
now) is taken by the session's own path instead, and said once
(`DeviceStepTrigger.uncovered`, a TriggerWarning); only a log too full for
that epoch too coalesces it (`coalesced`: its pages wait for the next commit).

Elsewhere the CPU consumer takes the epochs, with the same protocol on the
host (`StepGate`, the twin of `cx_step_gate`): `step()` counts the step and,
at each multiple of `every`, holds the calling thread until the consumer has
read the epoch (into the arena where the tier and the regions allow it, else
by the session's own path), so that the epoch holds the state between two
steps.  An arena epoch of at most SNAPSHOT_MAX_BYTES is written into a host
snapshot first, and the step goes once it is (every region read), while the
consumer copies it into the arena, its commit last: the twin of the device's
snapshot (`Arena.take`; `snapshot_epochs` counts them).  Such an epoch is in
`fired` once its step goes, and durable once its commit is in (the session's
settle waits for that).  A larger one, or
`ResidentExecutor.snapshot_max = 0`, holds the step until its commit is in
the arena.

Either way a crash loses at most the epochs not yet written when it came:
each is durable once its commit is in the log, with no call of the caller's.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

import numpy as np

from concordia.root_error import ConcordiaError

from .errors import ExecutorError, TriggerWarning
from .persistent import require_cupy
from .ring import Status

#: u32 words of a device trigger's gate (executor.cu's cx_step_gate): [0] the steps that gave up waiting (no
#: epoch); [1] 0 none, 1 a step holds, 2 its epoch runs; [2] the armed every (0: none); [3] the steps held;
#: [4..5] the ns they held (a u64); [6..7] the count of the step that holds (a u64, what the log names)
GATE_WORDS = 8

#: what a trigger's log says (`DeviceEpochs.trigger_status`) when the executor left with it armed (idle,
#: its lifetime): not a ring status; it is armed again (executor.cu: CX_TRIGGER_LEFT)
TRIGGER_LEFT = 0x100

#: longest a producer holds at its gate for one epoch before it is an error
HOLD_S = 60.0

#: most epochs an arena is kept room for ahead of the host (`DeviceStepTrigger._ahead`): a producer
#: whose stream runs far behind its host would otherwise have its arena swapped at every step
AHEAD_MAX = 2

#: the most memory an epoch is staged through before a trigger's gate goes (the device's snapshot, in device
#: memory, executor.cu: via_snapshot; its CPU twin's, in host memory, `Arena.take`): an epoch of at most this
#: many bytes (and, on the device, at most its arena's `bound`) is staged there, and the gate goes once it is
#: (every region read), before the records reach the arena; a larger one holds the gate until it is in the arena
SNAPSHOT_MAX_BYTES = 64 << 20


def is_fault(status: int) -> bool:
    """Whether a trigger's status (`DeviceEpochs.trigger_status`) is a fault:
    not none, not the kernel leaving (TRIGGER_LEFT: armed again) and not an
    epoch lost for room (LOST: mended by a whole checkpoint)."""
    return status not in (0, TRIGGER_LEFT, int(Status.LOST))


class StepGate:
    """The CPU twin of executor.cu's `cx_step_gate`, for a producer that calls
    `step()` once per step: the step is counted (`read()`, the trigger's
    counter) and, at each multiple of `every`, the producer holds there until
    the consumer lets it go.  The consumer's `close()` returns once the
    producer holds (the state between two steps), `open()` lets it go.
    `release()` stops every hold (the trigger is disarmed)."""

    kind = "steps"
    #: the producer marks its steps from its own thread, so a recovery it asks
    #: for comes between two of them: the executor's RECOVER does not close it
    marks_steps = True

    def __init__(self, every: int, wake=None, hold_s: float = HOLD_S):
        self.every = int(every)
        self.word = np.zeros(1, np.uint64)
        self._cv = threading.Condition()
        self._held = False
        self._off = False
        self._wake = wake
        self.hold_s = hold_s
        #: steps held, and the seconds they held the producer (cx_step_gate's gate[3..5])
        self.held_steps = 0
        self.held_s = 0.0

    def read(self) -> int:
        return int(self.word[0])

    def step(self) -> None:
        with self._cv:
            self.word[0] += np.uint64(1)
            if self._off or int(self.word[0]) % self.every:
                return
            self._held = True
            self._cv.notify_all()
        t0 = time.perf_counter()
        if self._wake is not None:
            self._wake()
        with self._cv:
            taken = self._cv.wait_for(lambda: not self._held or self._off, self.hold_s)
            self.held_steps += 1
            self.held_s += time.perf_counter() - t0
            if not taken:
                self._held = False
                raise ExecutorError(f"the epoch at step {self.read()} was not taken within {self.hold_s:.0f} s",
                                    where="step gate")

    def close(self, timeout: float = HOLD_S) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._held or self._off, timeout):
                raise ExecutorError(f"the producer did not reach its gate within {timeout:.0f} s", where="step gate")

    def open(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def release(self) -> None:
        with self._cv:
            self._off = True
            self._held = False
            self._cv.notify_all()


class CpuStepTrigger:
    """`step()` for the CPU consumer's trigger (`ResidentExecutor.trigger`)
    counting on a `StepGate`."""

    on_device = False
    #: as DeviceStepTrigger's: none here (the consumer takes every due step's epoch, by the
    #: session's own path where there is no arena, and lists it in `fired`)
    uncovered = coalesced = mended = 0

    def __init__(self, executor, every: int):
        self.gate = StepGate(every, wake=executor.wake)
        self.trigger = executor.trigger(every, counter=self.gate, gate=self.gate)
        self._executor = executor

    def step(self) -> None:
        if self.trigger.errors:  # stopped: say why rather than go on with no epochs
            raise ExecutorError(f"the trigger stopped: {self.trigger.errors[-1]}", where="step trigger")
        self.gate.step()

    @property
    def fired(self) -> list:
        """[(epoch, count)] of the trigger's epochs, each listed when its step
        goes (through the snapshot: before its commit is in, which the
        session's next call waits for)."""
        return list(self.trigger.fired)

    @property
    def snapshot_epochs(self) -> int:
        """The epochs whose gate went once they were read, before they reached
        the arena (the twin of the device engine's `snapshot_epochs`)."""
        return self.trigger.snapshot_epochs

    def held(self) -> tuple[int, float, int]:
        """As DeviceStepTrigger.held(): (steps held at the gate, seconds they
        held the producer, steps that gave up waiting: none here, a step that
        waits too long raises)."""
        return self.gate.held_steps, self.gate.held_s, 0

    @property
    def errors(self) -> list:
        return list(self.trigger.errors)

    @property
    def armed(self) -> bool:
        return self.trigger.armed

    def disarm(self) -> None:
        self._executor.disarm()
        self.gate.release()


class DeviceStepTrigger:
    """`step()` for the persistent kernel's trigger (module doc): a counter
    and a gate in device memory, `cx_step_gate` queued on the producer's
    stream, the arena swapped by the host before it runs out of room."""

    on_device = True


    def __init__(self, route, engine, every: int):
        cp = require_cupy()
        self.cp, self.route, self.engine, self.every = cp, route, engine, int(every)
        self.counter = cp.zeros(1, cp.uint64)
        self.gate = cp.zeros(GATE_WORDS, cp.uint32)
        cp.cuda.get_current_stream().synchronize()
        engine.mark_queued(0)  # a trigger before on this engine counted its own steps: none of this one's queued
        engine.trigger(self.every, self.counter, self.gate)
        self._skip = 0                  # held steps up to this count are the host's own epochs (a mend)
        #: what stopped the kernel's trigger and was mended (an epoch lost, the regions changed), one line each
        self.errors: list[str] = []
        self.rotations = 0
        self.rearmed = 0
        #: due steps whose epoch the session's own path took, the trigger having no arena then (`_uncover`),
        #: and those it coalesced (the log too full: no epoch; the next that commits carries their pages)
        self.uncovered = 0
        self.coalesced = 0
        #: due steps whose epoch the session's own path took to mend the trigger (`_again`)
        self.mended = 0
        self._uncovering = False
        self.steps = 0                  # step() calls: the counter's value once the device has run them
        self._mend: str | None = None   # why the trigger waits for a due step to be armed again
        self._disarmed = False
        self._fired_before: list = []   # the epochs of engines replaced since
        self._stream = None             # (the producer's stream pointer, its CuPy view)

    def step(self) -> None:
        """The step ends here.  First, on the host, the trigger kept armed
        (this step's gate then holds for an epoch, not for an arena swap);
        then the gate, queued on the producer's stream whatever happened.
        The step is counted in the engine's `queued` before the kernel's
        status is read (executor.cu: trigger_stays): a kernel about to leave
        either sees it coming and stays, or is seen leaving and armed again
        before the gate is queued."""
        due = (self.steps + 1) % self.every == 0
        try:
            if not self._disarmed:
                engine = self.engine
                # not another trigger's engine, nor one closed (its mapped words unpinned: `_again`)
                if engine.armed is not None and engine.armed[1] is self.counter and engine.closed_status is None:
                    engine.mark_queued(self.steps + 1)  # fenced before the log is read (the handshake)
                self._keep_armed(due)
        finally:
            ptr, stream = producer_stream(self.cp, self._stream)
            self._stream = (ptr, stream)
            with stream:
                self.engine.step_gate(self.counter, self.gate)
            self.steps += 1

    def _keep_armed(self, due: bool) -> None:
        """Between two steps, on the host: the kernel's trigger armed on an
        arena with room, on the engine that takes the session's regions as
        they are now; what stopped it mended at a due step (the caller has
        written that step's tokens and counters), or raised in one line."""
        route, engine = self.route, self.engine
        if self._mend is None:
            if route.engine is not engine or route.version != route.session.region_set.version:
                self._mend = "the regions or the engine changed"
            else:
                status = engine.trigger_status
                if status == Status.LOST:
                    self._mend = f"an epoch did not fit its arena (status {status})"
                elif status == TRIGGER_LEFT:  # the kernel left (idle, its lifetime): armed again, which relaunches it
                    self.rearmed += 1
                    try:
                        engine.trigger(self.every, self.counter, self.gate, skip=self._skip)
                    except (ConcordiaError, ValueError) as exc:  # no arena to arm on (the log full, an epoch
                        # larger than any arena holds: ValueError): mended at a due step
                        self._mend = f"arming the trigger again failed: {exc}"
                elif is_fault(status):  # every region's next checkpoint whole, the route off for these regions
                    exc = ExecutorError(f"the device trigger stopped with status {status}", where="device trigger")
                    route.fail(exc)
                    raise exc
        if self._mend is not None:
            if due:  # no epoch until then: the gates pass (the kernel's trigger is gone or paused)
                self._again(self._mend)
            return
        try:
            if route.rotate(ahead=self._ahead()):
                self.rotations += 1
        except ExecutorError as exc:  # an epoch its arena lost: mended at the next due step
            self._mend = str(exc)
            if due:
                self._again(self._mend)
            return
        if self.engine.kernel_armed:
            self._uncovering = False
        elif due and self.engine.armed is not None:  # paused with no arena to go on into (route.why)
            self._uncover(route.why)

    def _ahead(self) -> int:
        """The epochs the kernel may take before the host's next step():
        those of the due gates queued since its last epoch (or since the
        last step whose epoch the host took: `_skip`), this step's included,
        at least 1 and at most AHEAD_MAX (a producer whose stream runs
        further behind has its next epoch missed at worst: the arena is
        swapped at the next step)."""
        since = max(self.engine.last_count, self._skip)
        return min(max((self.steps + 1) // self.every - since // self.every, 1), AHEAD_MAX)

    def _uncover(self, why: str | None) -> None:
        """A due step while the kernel's trigger waits for an arena (the log
        full, or none holds its epochs now: `why`, tried again at each step):
        the session's own path takes this step's epoch (`uncovered`), or,
        with the log too full for it, coalesces it (`coalesced`: nothing
        written, its pages carried by the next epoch that commits; retention
        warns of that itself).  A run of such steps says so once (`errors`, a
        TriggerWarning).  Were the trigger armed again on the way, this
        step's gate goes with no epoch (the one above is its)."""
        self._skip = self.steps + 1
        self.engine.skip_through(self._skip)
        if self._own_epoch():
            self.uncovered += 1
        self._say_once(f"step {self._skip}: {why or 'no arena for the trigger'}; due steps take the session's path")

    def _own_epoch(self) -> bool:
        """The session's own checkpoint of this due step (coalesced under log
        pressure: counted in `coalesced`); whether it wrote an epoch."""
        st = self.route.session.checkpoint(reason="trigger", on_full="coalesce")
        if st is not None and st.coalesced:
            self.coalesced += 1
            return False
        return True

    def _say_once(self, line: str) -> None:
        """A line in `errors` and a TriggerWarning, once per run of due steps
        the kernel's trigger did not take (the run ends once it is armed again)."""
        if self._uncovering:
            return
        self._uncovering = True
        self.errors.append(line)
        warnings.warn(TriggerWarning(line, where="device trigger",
                                     hint="a larger log or larger segments (an arena holds a segment)"),
                      stacklevel=5)  # the caller of step(): step, _keep_armed, _uncover or _again, here

    def _again(self, why: str) -> None:
        """The session's own checkpoint (every region whole after a lost
        epoch; a new region's base) of this due step, then the trigger armed
        again on the engine for the regions as they are.  With no engine for
        them now (the log full, an epoch no arena holds: `route.why`) the
        trigger stays unarmed, its gates passing (the kernel's trigger went
        with its engine), and each due step's epoch is the session's own,
        the engine tried again there; said once."""
        route = self.route
        if self._own_epoch():
            self.mended += 1
        engine = route.device_engine()
        if engine is None:
            self._say_once(f"step {self.steps + 1}: no engine for the trigger ({route.why}); due steps take "
                           "the session's path")
            return
        if engine is not self.engine:
            self._fired_before += self.engine.fired()
            self.engine = engine
        # this step's gate, queued next, is due: the kernel lets it go (the checkpoint above is its epoch)
        self._skip = self.steps + 1
        engine.mark_queued(self.steps + 1)
        try:
            engine.trigger(self.every, self.counter, self.gate, skip=self._skip)
        except (ConcordiaError, ValueError) as exc:  # no arena to arm on (the log full, an epoch none holds):
            # the kernel's trigger is gone (its gates pass); mended again at the next due step
            self._mend = f"arming the trigger again failed: {str(exc).strip().splitlines()[0]}"
            self._say_once(f"step {self._skip}: {self._mend}; due steps take the session's path")
            return
        self.errors.append(why)
        self._mend = None

    @property
    def fired(self) -> list:
        return self._fired_before + self.engine.fired()

    def held(self) -> tuple[int, float, int]:
        """(steps held at the gate, seconds they held the producer's stream in
        all, steps among them that gave up waiting: no epoch), as the device
        counted them up to the work queued so far on the producer's stream (a
        copy from the device, ordered after it)."""
        _, stream = producer_stream(self.cp, self._stream)
        words = self.gate.get(stream=stream)
        stream.synchronize()
        return int(words[3]), int(words[4:6].view(np.uint64)[0]) / 1e9, int(words[0])

    @property
    def armed(self) -> bool:
        return (not self._disarmed and self._mend is None and self.route.engine is self.engine
                and self.engine.armed is not None and self.engine.trigger_status in (0, TRIGGER_LEFT))

    def disarm(self) -> None:
        """No more epochs from this trigger (its steps still count)."""
        self._disarmed = True
        if self.route.engine is self.engine and self.engine.armed is not None:
            self.engine.disarm()


def producer_stream(cp, last=None):
    """(pointer, CuPy stream) of the producer's stream: PyTorch's current
    stream where PyTorch uses CUDA (the producer's steps run there), else
    CuPy's current stream; `last` (the pair returned before) is reused while
    the stream is the same."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        ts = torch.cuda.current_stream()
        ptr = int(ts.cuda_stream)
        if last is not None and last[0] == ptr:
            return last
        from concordia.regions.streams import foreign_stream

        return ptr, foreign_stream(cp, ptr, int(ts.device.index), ts)
    st = cp.cuda.get_current_stream()
    return st.ptr, st
