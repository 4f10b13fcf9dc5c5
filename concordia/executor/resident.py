"""The resident executor behind a Session: `Session(..., executor="resident")`.

    s = Session("shm:agent-7", executor="resident")
    s.register("kv", kv)
    s.checkpoint()                  # one EPOCH task on the ring; the consumer runs the epoch
    steps = StepCounter(); gate = PauseGate()
    s.resident.trigger(every=8, counter=steps, gate=gate)
    ...                             # the producer: `with gate.step(): ...; steps.add()`
    s.recover()                     # one RECOVER task (of the consumer; on the device, of a persistent kernel)

What runs where.  `checkpoint()` on the caller's thread publishes one EPOCH
task for the epoch on the task ring (`ring.py`, through `host.Submitter`) and
waits for its completion; the consumer (`cpu.CpuExecutor`, a thread of its
own) runs the epoch: the session's detection and staging over its regions (the
region table pass of `concordia.checkpoint` where it applies) and then the
commit.  Where the regions and the tier allow, an epoch after the first is
an arena epoch instead (`route`: `checkpoint.arena_route.ArenaRoute`, which
the session hands in; this layer does not import the checkpoint layer): the
table pass writes it, records and commit, into the session's arena, taken on
at the session's next call.  A CuPy session's is one EPOCH task of the
persistent kernel, submitted from the caller's thread; a host session's is
the pass's numpy twin on the consumer thread.  Otherwise the commit record
is written by the consumer itself on tiers it can write without a persist
call (memory, shm, hugetlb, pinned: `persist_path` is "none"), so an epoch
commits without any host thread; on file, pmem and
device-DAX tiers the consumer hands the commit (the persist call and the
commit record) to a host committer thread and waits for it, since a GPU
consumer can neither msync nor call libpmem.  `recover()` on a host session is
one RECOVER task, so a recovery never interleaves with an epoch; a recovery
onto the device is planned on the caller's thread and its pages are one
RECOVER task of a persistent kernel (`restore.ring`, kept here as
`device_recovery`), read from the log mapping and checked on the device.

Handlers per region kind.  The operator table of the consumer holds EPOCH,
RECOVER and one handler per region kind present (`kind_op`); an epoch whose
regions include a kind without a handler fails with UNSUPPORTED_OP.  When a
region of a new kind is registered, a consumer whose table has that kind's
handler is swapped in (`Submitter.swap`: QUIESCE, hand-over at a slot
boundary, nothing lost or run twice).  On the CPU a kind's handler counts that
kind's regions in each epoch (`info()["kinds"]`); the detection itself is the
session's pass.  On the GPU a kind's handler is its detection kernel,
specialised by -D inside the persistent kernel's module (the device's EPOCH
handler, `checkpoint.device_epoch.DeviceEpochs`, executor.cu built with
CX_EPOCH), through which `route` runs a CuPy session's epochs; a session it
cannot take (`info()["route"]["why"]`) has the consumer thread drive the
device passes.

Device-side triggers (`Trigger`, armed by `ResidentExecutor.trigger`).  A trigger checkpoints every N counts of a
counter the consumer polls between tasks: the launches of instrumented kernels
(`LaunchCounter`, the exit-hook counters `__concordia_epochs` of
`concordia.instrument`) or decode steps (`StepCounter`, a word the producer
bumps once per step; `DeviceStepCounter`, the same counted on the device in
the producer's stream order).  The consumer closes the pause gate (a
`PauseGate`: `close()` returns once no step is in progress) so that the epoch
is taken between two steps, runs the epoch, opens the gate: no call from the
caller's thread.  Any gate with `close()` and `open()` is taken; an
`instrument.Gate` holds instrumented launches at their exit while the epoch
runs, but its `close()` does not wait for a launch to arrive.  With a gate, a
CuPy session's epoch runs in the stream order of the thread that armed the
trigger.  Without one, the caller goes on queueing steps while the consumer
queues the epoch, and launches from two threads on one stream interleave (an
epoch read one region before a step and the next after it), so the caller's
streams (CuPy's and PyTorch's current streams where it armed the trigger, and
the streams given at `register`) are held at one point by a one-thread kernel
each (`regions.streams.Holds`) while the epoch runs on Concordia's own stream,
and go on when all its work is queued: an epoch holds what the device had
done at that point; register the counter (`DeviceStepCounter.word`) beside
the state and each epoch records the step it holds.  That point is one of the
caller's stream, not of its steps: it can fall between two launches of one
step (a step boundary needs a gate).

Where a trigger's epochs go.  On a tier whose writes need no persist call,
with every region in one table pass whose detectors run without the host
(shadow copies, fingerprints), the consumer writes each epoch, records and
commit, into the session's arena (`checkpoint/arena.py`): an extent reserved
ahead, no appender, no commit call, no retention, durable when written; the
session's next call takes the epochs on (`Session.settle`).  That is the
protocol of the device's EPOCH handler, which a GPU consumer cannot run
otherwise; the CPU consumer also does the host's part (opening an arena,
taking on a full one).  Otherwise (`info()["trigger"]["arena_why"]` says why)
the epoch is the session's checkpoint run on the consumer.

The limit on the CPU: the consumer is a Python thread, so it runs only while
the caller's thread does not hold the GIL.  A caller stalled in `time.sleep`,
in a numpy operation that releases the GIL, or in another process leaves
epochs committing at the trigger rate; a caller stalled in a pure-Python busy
loop holds the GIL and stops this consumer too.  The GIL-holding stall is the
H200's check, for a persistent kernel that needs no host thread.

What "auto" takes, and when it decides: `AUTO_WHY` (`decide_auto`).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import sys
import threading
import time

import numpy as np

from concordia.regions.errors import SessionError
from concordia.regions.region import KINDS

from .cpu import CpuExecutor, OperatorTable
from .errors import ExecutorError
from .host import Submitter
from .persistent import require_cupy
from .ring import Op, Result, Ring, Status
from .step_trigger import SNAPSHOT_MAX_BYTES

EXECUTORS = ("auto", "resident", "host")

#: what executor="auto" decides by, and when: the resident path wins where the device's EPOCH handler takes the
#: session's epochs, which depends on the regions, registered after the session is made; so "auto" runs its
#: first epoch on the caller's thread and decides once it has committed (`decide_auto`)
AUTO_WHY = ("auto: the caller's thread until the session's first epoch has committed; then the resident path if "
            "the device's EPOCH handler takes the session's epochs (a CuPy session on shm, hugetlb or memory whose "
            "regions are found dirty on the device), else the caller's thread for good")

#: why "auto" took the resident path (bench executor-session on the H200 at c14b186, docs/results/executor-session.md)
AUTO_RESIDENT_WHY = ("the device's EPOCH handler takes this session's epochs, where the resident path wins: on the "
                     "H200, 0.247 ms a checkpoint against the host's 0.282 at one region, 0.647 against 0.721 at "
                     "1,024 (bench executor-session, c14b186)")

#: why "auto" kept the caller's thread, after the handler's own reason: where the resident path's epochs are its
#: consumer thread's, they cost more than the caller's own
AUTO_HOST_WHY = ("the resident path would run the epochs on its consumer thread, which loses to the caller's: "
                 "0.73 against 0.43 ms a checkpoint for a numpy session on the CPU, 1.51 against 0.84 ms for a "
                 "CuPy table larger than half a segment (docs/results/executor-session.md)")

#: op codes of the per-kind handlers: KIND_OP_BASE + the kind's index in regions.KINDS
KIND_OP_BASE = 0x100

#: longest wait between two polls of the ring by an idle consumer: with a
#: trigger armed (its counter is polled as often), and without one (a submit
#: wakes the consumer at once)
TRIGGER_POLL_S = 1e-3
IDLE_WAIT_S = 0.05

#: how long a wait on the consumer may see no task complete (a base of many GiB
#: is one task): the watchdog's deadline
STALL_DEADLINE_S = 600.0


def choose(executor: str) -> tuple[str, str | None]:
    """(path taken now, why) for Session(executor=...): "auto" takes "host"
    until the session's first epoch (AUTO_WHY; `decide_auto` then)."""
    if executor not in EXECUTORS:
        raise SessionError(f"unknown executor {executor!r} (use {', '.join(EXECUTORS)})")
    if executor == "auto":
        return "host", AUTO_WHY
    return executor, None


def start_executor(session, regions, executor: str, route=None):
    """(ResidentExecutor or None, executor_info) for Session(executor=...), over
    the session's `RegionSet` `regions`.  route: makes, from the session,
    what writes the executor's epochs into the session's arena
    (`checkpoint.arena_route.ArenaRoute`; this layer does not import it).
    executor_info["decided"]: False while "auto" waits for its first epoch."""
    path, why = choose(executor)
    resident = ResidentExecutor(session, regions, route=route) if path == "resident" else None
    info = {"executor": path, "asked": executor, "why": why, "decided": executor != "auto"}
    if resident is not None:
        info["commit_by"] = resident.commit_by
    return resident, info


def decide_auto(session, regions, route, why_not, epoch: int):
    """(ResidentExecutor or None, executor_info) for an "auto" session whose
    first epoch, `epoch`, has committed: the resident path where the device's
    EPOCH handler takes its epochs (`why_not(session)` None: the route's
    `handler_why_not`, asked for its regions as they are now, and the
    handler then built), else the caller's thread, for good.  Regions
    registered later do not change it; a resident path that does not start
    leaves the caller's, saying why."""
    base = {"asked": "auto", "decided": True, "decided_at": int(epoch)}
    resident = None
    try:
        why = why_not(session)
        if why is None:
            resident = ResidentExecutor(session, regions, route=route)
            # the handler built now, not at the next epoch: one that does not start leaves the caller's thread
            if resident.route is not None and resident.route.device_engine() is None:
                why = resident.route.why
            else:
                return resident, dict(base, executor="resident", why=AUTO_RESIDENT_WHY, commit_by=resident.commit_by)
    except Exception as exc:  # the epoch is committed: the session goes on on the caller's thread
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = f"the resident path did not start ({type(exc).__name__}: {first})"
    if resident is not None:
        try:
            resident.close()
        except Exception:  # the reason above is the one to give
            pass
    return None, dict(base, executor="host", why=f"{why}; {AUTO_HOST_WHY}")


def kind_op(kind: str) -> int:
    """The op code of the handler of region kind `kind`."""
    return KIND_OP_BASE + KINDS.index(kind)


def commit_by(backend) -> str:
    """Who writes an epoch's commit record: "executor" on a tier whose bytes
    need no persist call (the consumer can write it, a GPU through its
    mapping), else "host" (msync, libpmem)."""
    return "executor" if getattr(backend, "gpu_mappable", False) and backend.persist_path == "none" else "host"


class PauseGate:
    """A consistent point between the producer's steps (the CPU twin of
    `instrument.Gate`): the producer runs each step inside `with gate.step():`,
    which waits while the gate is closed; `close()` returns once no step is in
    progress, so that what is read until `open()` is the state between two
    steps.  Every wait is bounded."""

    def __init__(self):
        self._cv = threading.Condition()
        self._closed = False
        self._inside = 0
        self.closes = 0

    @contextlib.contextmanager
    def step(self, timeout: float = 60.0):
        with self._cv:
            if not self._cv.wait_for(lambda: not self._closed, timeout):
                raise ExecutorError(f"the pause gate stayed closed for {timeout} s", where="pause gate")
            self._inside += 1
        try:
            yield
        finally:
            with self._cv:
                self._inside -= 1
                self._cv.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        with self._cv:
            self._closed = True
            self.closes += 1
            if not self._cv.wait_for(lambda: self._inside == 0, timeout):
                self._closed = False
                self._cv.notify_all()
                raise ExecutorError(f"a step did not reach the gate within {timeout} s", where="pause gate")

    def open(self) -> None:
        with self._cv:
            self._closed = False
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


class StepCounter:
    """Decode steps as one u64 word with one writer (the producer: on the GPU a
    kernel, or a stream write, after each step; on the CPU the step's thread),
    read by the consumer."""

    kind = "steps"

    def __init__(self):
        self.word = np.zeros(1, np.uint64)

    def add(self, n: int = 1) -> None:
        self.word[0] += np.uint64(n)

    def read(self) -> int:
        return int(self.word[0])


class DeviceStepCounter:
    """Decode steps counted on the device: a u64 device array that `add()`
    raises on the caller's current stream (so it counts in the producer's
    stream order, when the step has run, not when it was queued), read by the
    consumer on a non-blocking stream of its own (the value the device holds
    now, queued work not waited for).  Register `word` as a region (e.g.
    `session.register("steps", counter.word, page_bytes=64)`) and every epoch
    records the step it captured.  Needs CuPy and a device."""

    kind = "device-steps"

    def __init__(self):
        cp = require_cupy()
        self._cp = cp
        self.word = cp.zeros(1, cp.uint64)
        self._stream = cp.cuda.Stream(non_blocking=True)
        # zeroed before `read` looks on its own stream (no stream waits for the caller's null stream)
        cp.cuda.get_current_stream().synchronize()

    def add(self, n: int = 1) -> None:
        self.word += self._cp.uint64(n)

    def read(self) -> int:
        out = self.word.get(stream=self._stream)
        self._stream.synchronize()
        return int(out[0])


class LaunchCounter:
    """Launches of instrumented kernels: the sum of the exit-hook counters
    (`__concordia_epochs`) of loaded instrumented modules, read on a
    non-blocking stream so that a launch held at the gate does not block the
    read.  `modules`: [(module, RewriteResult)], as `instrument.epochs` takes
    them.  Needs CuPy and a device (`gpu`-marked tests)."""

    kind = "launches"

    def __init__(self, modules):
        from concordia.instrument import runtime

        self._runtime = runtime
        self.modules = list(modules)
        self._stream = require_cupy().cuda.Stream(non_blocking=True)

    def read(self) -> int:
        return sum(sum(self._runtime.epochs(m, r, stream=self._stream).values()) for m, r in self.modules)


class Trigger:
    """Checkpoint every `every` counts of `counter` (a StepCounter, a
    LaunchCounter or anything with `read()`), at the pause gate `gate` when
    given.  `fired`: (epoch, count) of every epoch it took, listed when its
    step goes (an arena epoch through the snapshot: before its commit is in,
    which the session's next call waits for); `errors`: why it stopped, one
    line each."""

    def __init__(self, every: int, counter, gate=None):
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every <= 0:
            raise SessionError(f"a trigger's every must be a whole number > 0, not {every!r}", where="trigger")
        if not callable(getattr(counter, "read", None)):
            raise SessionError(f"a trigger counts with an object that has read(), not {counter!r}", where="trigger")
        self.every = int(every)
        self.counter = counter
        self.gate = gate
        self.next_at = (counter.read() // self.every + 1) * self.every
        self.fired: list[tuple[int, int]] = []
        self.errors: list[str] = []
        self.armed = True
        self.streams: list = []   # the arming thread's device and streams (resident.caller_streams)
        self.producers: list = []  # with no gate: those streams, held for each epoch (regions.streams.Holds)
        self.holds = None
        self.in_arena = 0  # epochs it took into the session's arena (ResidentExecutor._arena_epoch)
        #: of those, the epochs whose gate went before they reached the arena (through the snapshot)
        self.snapshot_epochs = 0

    @property
    def label(self) -> str:
        return f"trigger:{getattr(self.counter, 'kind', 'count')}"


class ResidentExecutor:
    """The consumer, ring and submitter behind one Session (module docstring).

    idle_exit_s: the consumer thread leaves after this long without work (the
    next submit relaunches it), except while a trigger is armed.  Idle, it
    waits on an event the submit sets, so a checkpoint is taken up at once."""

    def __init__(self, session, regions, *, capacity: int = 64, idle_exit_s: float = 2.0, route=None):
        self.session = session
        #: what writes epochs into the session's arena, on the device or the consumer (None: the
        #: session's own path on the consumer writes them all)
        self.route = route(session) if route is not None else None
        self.regions = regions             # the session's RegionSet
        self.commit_by = commit_by(session.log.backend)
        self.idle_exit_s = idle_exit_s
        # held by the consumer while it runs an epoch or a recovery, and by the
        # session while the regions change: the RegionSet's lock
        self.lock = regions.lock
        self._local = threading.local()
        self._tags = itertools.count(1)
        self._calls: dict[int, tuple] = {}
        self._results: dict[int, object] = {}
        self.kinds_seen: dict[str, int] = {}
        self.kinds: tuple[str, ...] = ()
        self.swaps: list = []
        self.epochs = 0
        self.trigger_: Trigger | None = None
        self._committer: threading.Thread | None = None
        self._commits: queue.Queue | None = None
        self._wake = threading.Event()
        self._by_kind: tuple | None = None   # (RegionSet version, regions per kind)
        #: the persistent kernel of the session's device recoveries (`restore.ring.OwnKernel`, made by
        #: the restore layer at the first one; this layer only closes it)
        self.device_recovery = None
        self._gateless_ok = None   # the RegionSet version found all on the device (`_check_gateless`)
        #: why a trigger's epochs go through the session, not into an arena (None: they did, or none was tried)
        self.arena_why: str | None = None
        #: the most host memory a trigger's arena epochs are written through before its gate goes (the twin of
        #: the device's snapshot, `Arena.take`); 0: none, the gate holds until the epoch is in the arena
        self.snapshot_max = SNAPSHOT_MAX_BYTES
        self._snap = np.empty(0, np.uint8)
        self.ring = Ring.allocate(capacity, where="session ring")
        self.submitter = _WakingSubmitter(self.ring, self._consumer(self._kinds_of(regions)),
                                          stall_deadline_s=STALL_DEADLINE_S, wake=self._wake)
        # the caller blocks on its task's event right after publishing, so it never
        # holds the GIL long enough to need the Submitter's periodic sleep
        self.submitter.fair_every_s = float("inf")
        self.kinds = self._kinds_of(regions)
        self._closed = False

    # -- the operator table ------------------------------------------------------

    @staticmethod
    def _kinds_of(regions) -> tuple[str, ...]:
        return tuple(sorted(regions.kinds()))

    def _consumer(self, kinds) -> CpuExecutor:
        table = OperatorTable({Op.EPOCH: self._epoch_handler, Op.RECOVER: self._recover_handler})
        for k in kinds:
            table.register(kind_op(k), self._kind_handler(k))
        tr = self.trigger_
        armed = tr is not None and tr.armed
        c = CpuExecutor(self.ring, table, idle_exit_s=None if armed else self.idle_exit_s)
        c.on_idle = self.poll
        c.wake = self._wake
        c.idle_spins = 0   # the caller waits for the GIL to read its result: yield it at once
        # idle, the consumer waits on `wake` between polls: briefly while a trigger
        # needs its counter polled, else long (the host's submit wakes it)
        c.idle_wait_max_s = TRIGGER_POLL_S if armed else IDLE_WAIT_S
        return c

    def _kind_handler(self, kind: str):
        def handler(task):
            n = int(task.args[0])
            self.kinds_seen[kind] = self.kinds_seen.get(kind, 0) + n
            return Result(Status.OK, n)
        return handler

    def regions_added(self, regions) -> None:
        """Regions are being registered (together): a kind without a handler in
        the consumer's table gets one by one hot swap, before the session lists
        them (so that no epoch meets a kind its table lacks)."""
        kinds = tuple(sorted(set(self._kinds_of(self.regions)) | {r.kind for r in regions}))
        if set(kinds) <= set(self.kinds):
            return
        self.swaps.append(self.submitter.swap(self._consumer(kinds), timeout=60.0))
        self.kinds = kinds

    @property
    def consumer(self) -> CpuExecutor:
        return self.submitter.consumer

    def inside(self) -> bool:
        """Whether the calling thread is the consumer running a session task."""
        return getattr(self._local, "inside", False)

    # -- host side ---------------------------------------------------------------

    def _call(self, op: int, fn, *args, **kw):
        """Publish one task running `fn(*args, **kw)` on the consumer and wait for it;
        the function's exception is raised here, on the caller's thread."""
        self._check_open()
        tag = next(self._tags)
        done = threading.Event()
        self._calls[tag] = (fn, args, kw, done, caller_streams())
        try:
            seq = self.submitter.submit(op, tag=tag, args=(tag,), timeout=60.0)
            # blocked off the GIL until the handler has run (the consumer is a Python
            # thread: a polling waiter would take the GIL from it), then the completion
            while not done.wait(1.0):
                self.submitter._check_progress(None, f"task {seq}")
            c = self.submitter.wait(seq, timeout=None)
        except BaseException:
            self._calls.pop(tag, None)
            self._results.pop(tag, None)
            raise
        got = self._results.pop(tag, None)
        if isinstance(got, BaseException):
            raise got
        if c.status != Status.OK:
            errors = self.consumer.errors
            raise ExecutorError(f"{Op(op).name} failed with status {c.status.name}"
                                + (f": {errors[-1]}" if errors else ""), where=self.ring.slot_where(c.seq - 1))
        return got

    def checkpoint(self, *, reason: str, stream=None):
        """One epoch: an EPOCH task of the device's handler where the session's
        regions allow it (`route`, from this thread), else one EPOCH task of
        the consumer thread (`_epoch`)."""
        if self.route is not None:
            self._check_open()
            with self.lock:
                stats = self.route.checkpoint(reason, stream, armed=self._armed(), where="caller")
            if stats is not None:
                self.epochs += 1
                return stats
        return self._call(Op.EPOCH, self._epoch, reason, stream)

    def _armed(self) -> bool:
        tr = self.trigger_
        return tr is not None and tr.armed

    def recover(self, *args, **kw):
        """One recovery through the consumer (the RECOVER task)."""
        return self._call(Op.RECOVER, self.session.recover, *args, **kw)

    def epoch_kernel(self):
        """The device epoch engine whose persistent kernel runs this session's
        epochs now (the route's, on the caller's side), or None: its module
        carries the RECOVER handler too, so a device recovery is a task of
        that kernel, between its epochs (`restore.ring`)."""
        engine = getattr(self.route, "engine", None) if self.route is not None else None
        if getattr(engine, "where", None) != "caller" or not hasattr(engine, "recover_task"):
            return None
        if engine.faulted or engine.closed_status is not None:   # (its kernel takes no task)
            return None
        return engine

    def routes_recover(self, device, into) -> bool:
        """Whether recover() goes through the consumer: on host sessions.  A
        recovery onto the device orders itself against the caller's current
        stream, which is the caller thread's own: the caller plans it and its
        pages are one RECOVER task of a persistent kernel
        (`restore.ring`, `device_recovery`), not a task of this consumer."""
        if device in ("cupy", "cuda"):
            return False
        if self.regions.any_on_gpu:
            return False
        if isinstance(into, dict):
            from concordia.regions.arrays import adapt

            for name, arr in into.items():
                try:
                    if adapt(arr, f"region {name!r}")[1] is not np:
                        return False
                except Exception:  # recover() names what is wrong with it
                    return False
        return True

    # -- the consumer's side -----------------------------------------------------

    def _run_task(self, task, inner):
        tag = int(task.args[0])
        call = self._calls.pop(tag, None)
        if call is None:
            return Result(Status.BAD_ARGS)
        fn, args, kw, done, streams = call
        self._local.inside = True
        try:
            with self.lock, as_caller(streams):
                self._results[tag] = inner(fn, args, kw)
        except BaseException as exc:  # raised again on the caller's thread
            self._results[tag] = exc
            return Result(Status.OK)
        finally:
            self._local.inside = False
            done.set()
        return Result(Status.OK, *self._completion(self._results[tag]))

    @staticmethod
    def _completion(got) -> tuple:
        """(pages, record bytes) of an epoch's statistics for its completion;
        a table pass's counts are summed as they are (its per-region dict is
        built only when someone reads it)."""
        if not hasattr(got, "log_bytes"):
            return ()
        counts = got.page_counts()
        pages = int(counts[1].sum()) if counts is not None else sum(got.pages.values())
        return pages, int(got.log_bytes)

    def _epoch_handler(self, task) -> Result:
        return self._run_task(task, lambda fn, args, kw: fn(*args, **kw))

    def _recover_handler(self, task) -> Result:
        return self._run_task(task, lambda fn, args, kw: self._gated(fn, *args, **kw))

    def _gated(self, fn, *args, **kw):
        tr = self.trigger_
        gate = tr.gate if tr is not None and tr.armed else None
        if getattr(gate, "marks_steps", False):  # its producer calls recover() itself, between two steps
            gate = None
        if gate is not None:
            gate.close()
        try:
            return fn(*args, **kw)
        finally:
            if gate is not None:
                gate.open()

    def _epoch(self, reason: str, stream=None):
        """The epoch, on the consumer: every kind's handler from the table, then
        the twin's arena epoch (`route`) where the regions allow it, else the
        session's pass and commit (`Session.checkpoint` run here)."""
        self._run_kinds()
        if self.route is not None:
            stats = self.route.checkpoint(reason, stream, armed=self._armed(), where="consumer")
            if stats is not None:
                self.epochs += 1
                return stats
        stats = self.session.checkpoint(reason=reason, stream=stream)
        stats.executor = "resident"
        self.epochs += 1
        return stats

    def _arena_epoch(self, reason: str, release=None) -> int | None:
        """A trigger's epoch into the session's arena (checkpoint/arena.py), the
        twin of the device's EPOCH handler: the table pass writes the records
        and the commit, with no appender, commit call or retention; the
        session's next call takes it on.  An arena is opened when none is
        (the host's part: a GPU consumer has it opened ahead), and one with no
        room left is taken on and replaced here (also the host's part; a CPU
        consumer is a host thread).  release(epoch): the trigger's gate let
        go once every region is read (through the snapshot, as the device
        does: `Arena.take`); not called when the epoch is not written here,
        nor when it is too large for the snapshot (the caller lets go after).
        Returns the epoch, or None when the session's epochs cannot go into an
        arena (`arena_why` says why)."""
        runner = self.session.runner
        self.arena_why = runner.arena_for(self.session.log, reason, self.session.settle)
        if self.arena_why is not None:
            return None
        self._run_kinds()

        went = []

        def let_go(epoch: int) -> None:
            # the arrays hold this epoch until the gate opens: retention takes the copies
            # a job decided at the last commit taken on needs now, as at a pending launch
            self.session.retention.launched(epoch)
            went.append(epoch)
            release(epoch)

        # the arena had room for it: None only when its records did not fit
        epoch = (runner.arena_take(snapshot=self._snapshot, release=let_go) if release is not None
                 else runner.arena_take())
        if epoch is None:
            self.arena_why = f"epoch {runner.arena.lost} did not fit what its arena had left: written whole instead"
            self.session.settle()   # the arena taken on: every region's next checkpoint is whole
            return None
        self.epochs += 1
        if not went:   # written straight into the arena, the gate still closed: as above
            self.session.retention.launched(epoch)
        return epoch

    def _snapshot(self, nbytes: int):
        """A host buffer of `nbytes` for one arena epoch (its records and
        commit), kept from epoch to epoch while a trigger is armed; None above
        `snapshot_max`."""
        if nbytes > self.snapshot_max:
            return None
        if self._snap.size < nbytes:
            self._snap = np.empty(min(max(nbytes, 2 * self._snap.size), self.snapshot_max), np.uint8)
        return self._snap[:nbytes]

    def _run_kinds(self) -> None:
        """Every kind's handler from the operator table, once per epoch."""
        cached = self._by_kind
        if cached is None or cached[0] != self.regions.version:  # counted again only when the regions changed
            cached = self._by_kind = (self.regions.version, self.regions.kinds())
        by_kind = cached[1]
        table = self.consumer.table
        for kind, n in by_kind.items():
            fn = table.get(kind_op(kind))
            if fn is None:
                raise ExecutorError(f"no handler for region kind {kind!r} in the operator table",
                                    where=f"executor {self.consumer.executor_id}",
                                    hint="register regions through the Session, which swaps one in")
            fn(_KindTask(n))

    def commit(self, app, epoch: int, digests) -> None:
        """The commit of an epoch (the session's commit callable): by the consumer where it can
        write the record itself, else by the host committer thread."""
        if self.commit_by == "executor" or not self.inside():
            app.commit(epoch, digests=digests)
            return
        done = threading.Event()
        box: list = []
        self._committer_queue().put((app, epoch, digests, done, box))
        while not done.wait(1.0):
            if self._committer is None or not self._committer.is_alive():
                raise ExecutorError("the host committer thread is gone", where=f"epoch {epoch}")
        if box:
            raise box[0]

    def _committer_queue(self) -> queue.Queue:
        if self._committer is None:
            self._commits = queue.Queue()
            self._committer = threading.Thread(target=self._commit_loop, name="session-committer", daemon=True)
            self._committer.start()
        return self._commits

    def _commit_loop(self) -> None:
        q = self._commits
        while True:
            item = q.get()
            if item is None:
                return
            app, epoch, digests, done, box = item
            try:
                app.commit(epoch, digests=digests)
            except BaseException as exc:
                box.append(exc)
            done.set()

    # -- triggers ----------------------------------------------------------------

    def trigger(self, every: int, counter=None, gate=None) -> Trigger:
        """Checkpoint every `every` counts of `counter` (a new StepCounter when
        None), taken by the consumer with no call from the caller's thread; at
        `gate` (a PauseGate, or an instrument.Gate) when given.  Replaces any
        trigger armed before; `disarm()` stops it."""
        self._check_open()
        if not len(self.regions):
            raise SessionError("a trigger needs a registered region", where="trigger")
        if self.route is not None:
            with self.lock:
                self.route.close()   # the trigger's epochs take the session's arena
        tr = Trigger(every, StepCounter() if counter is None else counter, gate)
        tr.streams = caller_streams()   # the epochs order against the streams current here
        if gate is None:  # nothing stops the caller queueing: its streams are held for each epoch
            self._check_gateless()
            tr.producers = caller_stream_views()
            if tr.producers:
                from concordia.regions.streams import Holds

                tr.holds = Holds()
        with self.lock:
            self.trigger_ = tr
        c = self.consumer
        c.idle_exit_s = None               # stays resident to watch the counter
        c.idle_wait_max_s = TRIGGER_POLL_S
        self.submitter.call(Op.PING)       # and is running now
        return tr

    def step_trigger(self, every: int):
        """A trigger for a producer that calls `step()` once per step
        (`step_trigger.py`): the persistent kernel's, queued on the
        producer's stream, where the device's EPOCH handler takes the
        session's epochs; else the consumer thread's, holding the producer
        at each epoch (`StepGate`).  Call it after the session's first epoch."""
        from .step_trigger import CpuStepTrigger, DeviceStepTrigger

        self._check_open()
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every <= 0:
            raise SessionError(f"a trigger's every must be a whole number > 0, not {every!r}", where="trigger")
        if self.route is not None and self.regions.any_on_gpu:
            with self.lock:
                engine = self.route.device_engine()
            if engine is not None:
                return DeviceStepTrigger(self.route, engine, int(every))
        return CpuStepTrigger(self, int(every))

    def wake(self) -> None:
        """Wake the idle consumer now (it polls a trigger's counter)."""
        self._wake.set()

    def _check_gateless(self) -> None:
        """Without a gate, only device regions can be taken at one point of the
        caller's work (their streams are held); a host region is read while the
        caller's thread may be writing it: refused."""
        if self._gateless_ok == self.regions.version:
            return
        host = next((r.name for r in self.regions if not r.on_gpu), None)
        if host is None:
            self._gateless_ok = self.regions.version   # looked at again only when the regions change
        else:
            raise SessionError(f"a trigger without a gate would read host region {host!r} while the caller may "
                               "write it; give a gate (PauseGate, each step inside `with gate.step():`)",
                               where="trigger")

    def disarm(self) -> None:
        """Stop the trigger (it stays in `trigger_`, with what it fired)."""
        tr = self.trigger_
        if tr is not None:
            with self.lock:   # not in the middle of one of its epochs
                tr.armed = False
                self._snap = np.empty(0, np.uint8)   # the snapshot's memory back
            _release(tr.gate)
        self._relax()

    def _relax(self) -> None:
        """No trigger to watch: the consumer idles and leaves as without one."""
        c = self.consumer
        if c is not None:
            c.idle_exit_s = self.idle_exit_s
            c.idle_wait_max_s = IDLE_WAIT_S

    def poll(self) -> bool:
        """On the consumer, between tasks: take the epoch a trigger is due for."""
        tr = self.trigger_
        if tr is None or not tr.armed:
            return False
        released = []   # the epoch whose arena write let the gate go once it had read every region

        def release(epoch: int) -> None:
            # listed before the producer goes on, as the device logs its epoch before its gate goes
            tr.fired.append((int(epoch), count))
            tr.in_arena += 1
            tr.snapshot_epochs += 1
            released.append(epoch)
            gate.open()

        try:
            if tr.counter.read() < tr.next_at:
                return False
            gate = tr.gate
            if gate is None:
                self._check_gateless()   # a host region registered since the trigger was armed
            else:
                gate.close()

            try:
                count = tr.counter.read()    # the gate is closed: no step moves it now
                self._local.inside = True
                try:
                    with self.lock:
                        if not tr.armed:   # disarmed while this poll waited for the lock
                            return False
                        epoch = (self._arena_epoch(tr.label, release if gate is not None else None)
                                 if tr.holds is None else None)
                        if epoch is None and tr.holds is None:
                            with as_caller(tr.streams):
                                epoch = self._epoch(tr.label).epoch
                        elif epoch is None:
                            epoch = self._held_epoch(tr).epoch
                        elif not released:
                            tr.in_arena += 1
                finally:
                    self._local.inside = False
            finally:
                if gate is not None and not released:   # once: an open after the producer's next hold lets it go
                    gate.open()
            if not released:
                tr.fired.append((int(epoch), count))
            tr.next_at = (count // tr.every + 1) * tr.every
        except Exception as exc:  # the trigger stops and says why; the consumer goes on
            if released and (int(released[0]), count) in tr.fired:   # listed at its release, never committed
                tr.fired.remove((int(released[0]), count))
                tr.in_arena -= 1
                tr.snapshot_epochs -= 1
                self.session.retention.not_committed(int(released[0]))
            tr.errors.append(f"{type(exc).__name__}: {exc}")
            tr.armed = False
            _release(tr.gate)
            self._relax()
        return True

    def _held_epoch(self, tr):
        """A trigger's epoch while the caller queues on: its streams held at
        one point (`Holds`), the epoch on Concordia's stream, then let go."""
        # the table pass made (its kernels loaded) before any stream is held: with
        # CUDA's lazy loading, a module loaded during a hold can wait for the hold
        self.session.runner.table_pass(self.session.log)
        order = tr.holds.order(tr.producers + registered_streams(self.regions))
        try:
            with require_cupy().cuda.Device(tr.holds.device_id), as_current(order.stream):
                return self._epoch(tr.label, stream=order)
        finally:
            order.release()

    # -- lifecycle ---------------------------------------------------------------

    def info(self) -> dict:
        c = self.consumer
        tr = self.trigger_
        return {"executor": "resident", "consumer": "cpu-thread", "executor_id": c.executor_id,
                "commit_by": self.commit_by, "epochs": self.epochs, "kinds": dict(self.kinds_seen),
                "handlers": sorted(self.kinds), "swaps": len(self.swaps),
                "trigger": None if tr is None else {"every": tr.every, "counter": getattr(tr.counter, "kind", "?"),
                                                    "fired": len(tr.fired), "armed": tr.armed,
                                                    "in_arena": tr.in_arena, "arena_why": self.arena_why,
                                                    "snapshot_epochs": tr.snapshot_epochs},
                "device_epoch_handler": self.route is not None and self.route.via == "device-epoch",
                "route": None if self.route is None else {"via": self.route.via, "epochs": self.route.epochs,
                                                          "why": self.route.why, "lost": self.route.lost}}

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorError("the session's executor is stopped", where=self.ring.where)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the consumer (after any task in flight) and the committer."""
        if self._closed:
            return
        self.disarm()
        if self.device_recovery is not None:
            self.device_recovery.close()
        if self.route is not None:
            with self.lock:
                self.route.close()   # the persistent kernel stops; the arena's epochs are taken on
        try:
            self.submitter.stop(timeout)
        except ExecutorError:   # a consumer that does not stop is made to leave
            self.consumer.abort(timeout)
        finally:
            # an epoch still in flight (a large base may take STALL_DEADLINE_S) ends
            # before the session goes on to close the log under it
            if not self.lock.acquire(timeout=STALL_DEADLINE_S):
                raise ExecutorError(f"an epoch still runs on the consumer after {STALL_DEADLINE_S:.0f} s; "
                                    "the log is left open", where=self.ring.where)
            try:
                self._closed = True
            finally:
                self.lock.release()
            if self._committer is not None:
                self._commits.put(None)
                self._committer.join(timeout)


def _release(gate) -> None:
    """A gate whose producer holds at its steps (`step_trigger.StepGate`) lets
    it go for good: no epoch comes for a trigger that stopped."""
    release = getattr(gate, "release", None)
    if release is not None:
        release()


def caller_streams() -> list:
    """What a checkpoint on the host path would order against, as the calling
    thread sees it: CuPy's current device and stream, PyTorch's current stream
    (each thread has its own).  Factories of context managers that make them
    current on the consumer's thread (`as_caller`); empty where neither is in use."""
    out = []
    cp = sys.modules.get("cupy")
    if cp is not None:
        try:
            dev, stream = cp.cuda.Device().id, cp.cuda.get_current_stream()
            out += [lambda: cp.cuda.Device(dev), lambda: stream]
        except Exception:  # CuPy without a device: host regions only
            out = []
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        ts = torch.cuda.current_stream()
        out.append(lambda: torch.cuda.stream(ts))
    return out


def caller_stream_views() -> list:
    """The calling thread's current CuPy stream and PyTorch stream (of the
    current device), as CuPy streams; empty where neither is in use."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return []
    try:
        out = [cp.cuda.get_current_stream()]
    except Exception:  # CuPy without a device: host regions only
        return []
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        from concordia.regions.streams import foreign_stream

        ts = torch.cuda.current_stream()
        out.append(foreign_stream(cp, int(ts.cuda_stream), int(ts.device.index), ts))
    return out


def registered_streams(regions) -> list:
    """The streams given at `register` to the device regions, as CuPy streams."""
    from concordia.regions.streams import producer_stream

    return [producer_stream(r.owner, r.stream) for r in regions if r.on_gpu and r.stream is not None]


@contextlib.contextmanager
def as_current(stream):
    """`stream` (a CuPy stream) current on this thread for CuPy and, where it
    is in use, for PyTorch."""
    torch = sys.modules.get("torch")
    with contextlib.ExitStack() as stack:
        stack.enter_context(stream)
        if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
            stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)))
        yield


def as_caller(streams):
    """Enter the caller's device and streams (`caller_streams`) on this thread."""
    if not streams:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for make in streams:
        stack.enter_context(make())
    return stack


class _WakingSubmitter(Submitter):
    """A Submitter that wakes the idle consumer after every publish (tasks,
    QUIESCE of a swap, STOP): the consumer waits on `wake` between polls."""

    def __init__(self, *args, wake: threading.Event, **kw):
        self._wake_event = wake
        super().__init__(*args, **kw)

    def _after_publish(self) -> None:
        super()._after_publish()
        self._wake_event.set()


class _KindTask:
    """The task a kind's handler is called with from inside an epoch: args[0]
    is how many regions of that kind the epoch holds."""

    __slots__ = ("args",)

    def __init__(self, n: int):
        self.args = (n,)


def wait_for_epochs(executor: ResidentExecutor, n: int, timeout: float) -> int:
    """Wait (sleeping, off the GIL) until the trigger has fired `n` epochs, or
    `timeout`; returns how many it fired.  For tests and benchmarks."""
    tr = executor.trigger_
    deadline = time.monotonic() + timeout
    while tr is not None and len(tr.fired) < n and tr.armed and time.monotonic() < deadline:
        time.sleep(1e-3)
    return 0 if tr is None else len(tr.fired)
