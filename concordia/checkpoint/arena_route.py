"""`Session(executor="resident")`'s checkpoints as arena epochs: each one is
written, records and commit, into the session's arena (`arena.py`) by the
resident executor, with no appender and no commit call; durable when
`checkpoint()` returns, taken on at the session's next call.

    s = Session("shm:agent-7", executor="resident")
    s.register("kv", kv)                # shadow, fingerprint, or positions from int64 words beside it
    s.checkpoint()                      # the first epoch (the bases): the session's own path, on the consumer
    st = s.checkpoint()                 # an arena epoch: st.via["kv"] is "device-epoch" or "consumer-arena"
    s.epoch == st.epoch                 # durable now, and s.checkpoints[-1] is st

Who writes it (the engine).  A CuPy session whose regions take one device
table pass: the persistent kernel, one EPOCH task of the device's handler
(`device_epoch.DeviceEpochs`), submitted from the caller's thread after the
caller's producer streams (its current CuPy and PyTorch streams, the streams
given at `register`) are waited for, so that the epoch holds every region
as of the call in stream order.  A host session whose regions take one host
table pass: the consumer thread, the table pass's numpy twin writing the
epoch into the arena (`ConsumerEpochs`, the CPU twin of the device's
handler: the same arena, words, statistics and taking-on).  The statistics
come from the pass's per-row counts (the device's mailbox, the twin's plan)
and the record bytes it wrote; `Session.checkpoints` lists them at once, and
`Session.epoch` names the epoch (the open arena's last).  The session's next
call that settles takes the arena's epochs on (`Session.settle`): the
appender adopts them, retention and `checkpoint_totals` count them.

When it does not apply, the epoch is the session's checkpoint run on the
consumer thread, as before, and `why` says why: the session's first epoch
(the regions have no base and no single table pass), regions the arena
cannot take (`arena.why_not`, `device_epoch.why_not`: host-listed pages, a
tier that needs a persist call, more page sizes than a device module takes), a stream
named at the call, a pending epoch, a trigger armed on the consumer (its
epochs use the arena), a region whose array changed, an arena the log has
no room for now, or a failed task (every region's next checkpoint is then
whole, on the consumer; the route stays off for those regions).  An epoch
whose records did not fit what its arena had left is lost (`arena.py`):
that call's own path writes every region whole, and the route goes on with
the next (`lost`, `lost_why`).  After the
regions change, the next checkpoint builds the engine again (the device's
module is compiled once).

CuPy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import numpy as np

from concordia.checkpoint import arena as arena_mod
from concordia.checkpoint import device_epoch
from concordia.checkpoint.host import HostTablePass
from concordia.checkpoint.stats import CheckpointStats
from concordia.executor.errors import ExecutorError
from concordia.regions.errors import SessionError
from concordia.wal.errors import LogFullError

#: the statistics' `via` of an epoch the persistent kernel wrote
VIA = "device-epoch"
#: ... and of one the consumer thread wrote (the CPU twin)
VIA_CONSUMER = "consumer-arena"

#: how long the persistent kernel stays after an epoch without another (the
#: next checkpoint launches it again): a module the caller's framework loads
#: meanwhile waits at most this long for the kernel to leave
IDLE_S = 2e-3


class ConsumerEpochs:
    """The CPU twin of `device_epoch.DeviceEpochs` behind the route: the host
    table pass writes each epoch into the session's arena (`Arena.take`), run
    on the resident executor's consumer thread."""

    via = VIA_CONSUMER
    where = "consumer"

    def __init__(self, session, tpass):
        self.session, self.tpass = session, tpass

    def ensure_arena(self) -> None:
        s = self.session
        why = s.runner.arena_for(s.log, "checkpoint", s.settle)
        if why is not None:
            raise ValueError(why)

    def take(self) -> int | None:
        """One epoch into the arena; the record bytes it wrote, or None when
        the arena lost it (its records did not fit what was left)."""
        runner = self.session.runner
        if runner.arena_take() is None:
            if runner.arena is not None and runner.arena.lost:
                return None
            raise SessionError("the arena had no room for the epoch", where="arena")
        return int(self.tpass.table.last_bytes)

    def counts(self) -> np.ndarray:
        return self.tpass.last_counts.astype(np.int64)

    def close(self) -> None:
        self.session.settle()


def handler_why_not(session) -> str | None:
    """Why the device's EPOCH handler would not take `session`'s epochs with
    its regions as they are now (None: it would), from the runner's table
    pass (the one its next epoch takes, built if it was not) without starting
    the handler: what
    `Session(executor="auto")` asks once its first epoch has committed
    (`executor.resident.decide_auto`)."""
    s = session
    host = [r.name for r in s.region_set if not r.on_gpu]
    if host:
        return f"region {host[0]!r} is in host memory (the device's EPOCH handler takes regions on the device)"
    tpass = s.runner.table_pass(s.log)
    if tpass is None or isinstance(tpass, HostTablePass):
        return "the regions take no single device table pass (a region without its first epoch, or several paths)"
    why = device_epoch.why_not(tpass, s.log.backend)
    if why is not None:
        return why
    # an epoch of every page that does not fit half a segment is tried by the last epoch's size and may be lost
    t, half = tpass.table, s.log.appender.segment_capacity // 2
    need = arena_mod.full_bound(t) + t.commit_length
    if need > half:
        return f"an epoch of every page ({need} bytes with its commit) needs more than half a segment ({half} bytes)"
    return None


class ArenaRoute:
    """The resident executor's epochs into the session's arena (module doc)."""

    def __init__(self, session):
        self.session = session
        self.engine = None        # DeviceEpochs or ConsumerEpochs, for the regions as they were at `version`
        self.version = None
        self.failed = None        # the RegionSet version the engine failed for, and why
        self.failed_why: str | None = None
        #: why the last checkpoint was not an arena epoch (None: it was)
        self.why: str | None = "no checkpoint yet"
        self.epochs = 0
        #: epochs the arena lost (their records did not fit what it had left), and what the last one said
        self.lost = 0
        self.lost_why: str | None = None

    @property
    def via(self) -> str | None:
        return None if self.engine is None else self.engine.via

    def checkpoint(self, reason: str, stream=None, *, armed: bool = False,
                   where: str = "caller") -> CheckpointStats | None:
        """One arena epoch written from `where` ("caller": the device's
        engine; "consumer": the twin's), or None (`why` says why) for the
        caller to take its own path.  The caller holds the regions' lock."""
        if self.engine is not None and self.version != self.session.region_set.version:
            self.close()  # before any path of this call loads the new regions' kernels
        why = self._why_not(stream, armed)
        if why is None:
            why = self._ready()
        if why is None and self.engine.where != where:
            return None  # the engine runs from the other side, which tries (and says why) itself
        self.why = why
        if why is not None:
            return None
        engine, t = self.engine, self.engine.tpass.table
        try:
            engine.ensure_arena()
        except (LogFullError, ValueError) as exc:  # nothing written: this epoch takes the session's path
            self.why = f"no arena for the epoch now: {str(exc).strip().splitlines()[0]}"
            return None
        except ExecutorError as exc:
            if _faulted(engine):  # the kernel faulted (a timed-out epoch): the route off, every region whole next
                self.fail(exc)
                self.why = self.failed_why
                return None
            # a trigger's epoch the arena lost: taken on, every region whole next
            self.lost += 1
            self.lost_why = self.why = f"{str(exc).strip().splitlines()[0]}: written whole on the session's path"
            self.close()
            return None
        # `before_checkpoint`, as the session's own path runs them: once an arena takes the epoch (a
        # call that returns None above leaves them to that path)
        for fn in self.session.checkpoint_hooks:
            fn()
        if engine.where == "caller":
            _wait_for_producers(self.session.region_set)
        try:
            log_bytes = engine.take()
        except BaseException as exc:
            self.fail(exc)
            raise
        if log_bytes is None:
            self._lost()
            return None
        t.last_bytes = int(log_bytes)  # what the next arena is sized by (the twin's pass keeps it itself)
        arena = self.session.runner.arena
        epoch = arena.word("last_epoch")
        counts = engine.counts()
        st = CheckpointStats.of_table(epoch, reason, t.names, counts, engine.via, int(counts @ t.page_bytes),
                                      log_bytes, 0.0, 0.0, 0.0, 0)
        st.executor = "resident"
        arena.given[epoch] = st  # filled (log_at) when the session takes the arena's epochs on
        self.session.checkpoints.append(st)
        st.listed = True
        # the arrays hold this epoch until the caller's next step: retention takes the copies
        # a job decided at the last commit taken on needs now, as at a pending launch
        self.session.retention.launched(epoch)
        self.epochs += 1
        return st

    def _why_not(self, stream, armed: bool) -> str | None:
        s = self.session
        if stream is not None:
            return "a stream was named at the call (an arena epoch orders against the producer streams only)"
        if armed:
            return "a trigger is armed on the consumer: its epochs take the arena"
        if s.runner.pending is not None:
            return "an epoch of checkpoint(wait=False) is pending"
        return None

    def _ready(self) -> str | None:
        """Build (or keep) the engine for the regions as they are; why not."""
        s = self.session
        version = s.region_set.version
        if self.engine is not None:
            return None if self.engine.tpass.table.unchanged() else "a region's array changed since it was registered"
        if self.failed == version:
            return self.failed_why
        tpass = s.runner.table_pass(s.log)
        if tpass is None:  # a region's first epoch (its base) is still to come, or the paths differ
            return "the regions take no single table pass (a region without its first epoch, or several paths)"
        if not tpass.table.unchanged():  # the session's own path names the region (Region.check_unchanged)
            return "a region's array changed since it was registered"
        if isinstance(tpass, HostTablePass):
            why = arena_mod.why_not(tpass.table, s.log.backend) or arena_mod.too_large(tpass.table, s.log.appender)
            if why is None:
                self.engine, self.version = ConsumerEpochs(s, tpass), version
            return why
        why = device_epoch.why_not(tpass, s.log.backend) or arena_mod.too_large(tpass.table, s.log.appender)
        if why is not None:
            return why
        try:
            self.engine = device_epoch.DeviceEpochs(s, idle_s=IDLE_S)
        except Exception as exc:  # the consumer thread takes the epochs; info() says why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.failed = version
            self.failed_why = f"the device's EPOCH handler did not start: {type(exc).__name__}: {first}"
            return self.failed_why
        self.version = version
        return None

    def fail(self, exc: BaseException) -> None:
        """After a failed epoch: detection may have moved on past pages no
        commit holds, so every region's next checkpoint writes it whole (on
        the consumer thread: this route is off for these regions)."""
        s = self.session
        s.runner.lose()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failed = s.region_set.version
        self.failed_why = f"the last arena epoch failed: {type(exc).__name__}: {first}"
        engine, self.engine, self.version = self.engine, None, None
        try:
            engine.close()  # what the arena committed before is taken on; the failed epoch's bytes are padded over
        except Exception:  # the epoch's own error is the one raised
            pass

    def _lost(self) -> None:
        """The arena lost the epoch (arena.py): its records did not fit what
        was left, after detection moved on.  Taking the arena on makes every
        region's next checkpoint whole, which this call's own path then
        writes; the engine is built again after it (the route stays on)."""
        ar = self.session.runner.arena
        left = ar.ext.length - ar.word("used")
        self.lost += 1
        self.lost_why = (f"epoch {ar.lost} wrote more than the {left} bytes its arena had left: every region's "
                         "next checkpoint is whole, on the session's path")
        self.why = self.lost_why
        self.close()

    # -- a device trigger on the engine (executor.step_trigger) ------------------------
    def device_engine(self):
        """The device's EPOCH handler for the regions as they are (built when
        needed), or None (`why` says why): what a device trigger arms."""
        if self.engine is not None and self.version != self.session.region_set.version:
            self.close()
        why = self._ready()
        if why is None and self.engine.where != "caller":
            why = "the regions are not on the device: the consumer thread takes a trigger's epochs"
        self.why = why
        return None if why is not None else self.engine

    def rotate(self, *, ahead: int = 1) -> bool:
        """An armed device trigger's arena, once the session took it on, it
        has no room for the `ahead` epochs the kernel may take before the
        host's next call (`Arena.holds`: each twice the last; one while the
        arena has none yet), an epoch was missed or lost, or the trigger's
        log is half full, swapped for another (`DeviceEpochs.rotate`);
        whether it was.  With no room for another now the trigger stays
        paused (False; tried again at the next call).  A lost epoch leaves
        the trigger off (ExecutorError)."""
        engine = self.engine
        if engine is None or engine.armed is None:
            return False
        ar = self.session.runner.arena
        # an arena with no epoch yet is swapped only when it holds none (not again before its first epoch)
        if (ar is not None and ar is engine.arena and ar.holds(ahead if ar.word("epochs") else 1)
                and not ar.word("missed") and engine.fired_logged <= device_epoch.FIRED_CAP // 2):
            return False
        try:  # taken on (any call of the session settles), too full, missed, lost, or its log half full
            engine.rotate()
        except (LogFullError, ValueError) as exc:  # no room for an arena now: the trigger stays paused, tried again
            self.why = f"no arena for the trigger now: {str(exc).strip().splitlines()[0]}"
            return False
        except ExecutorError as exc:
            if _faulted(engine):  # a timed-out epoch: its detection may have moved past pages no commit holds
                self.fail(exc)
            else:  # an epoch lost for room: taken on (every region whole next), the route stays
                self.close()
            raise
        except BaseException:
            self.close()
            raise
        return True

    @property
    def active(self) -> bool:
        return self.engine is not None

    def close(self) -> None:
        """Stop the engine (the persistent kernel); the arena's epochs are taken on.
        An engine whose trigger stopped on a fault (a timed-out epoch, whose
        detection may have moved past pages no commit holds) makes every
        region's next checkpoint whole, as `fail` does."""
        engine, self.engine, self.version = self.engine, None, None
        if engine is None:
            return
        try:
            engine.close()
        finally:
            if _faulted(engine):
                self.session.runner.lose()


def _faulted(engine) -> bool:
    """Whether a device engine's kernel stopped on a fault (`DeviceEpochs.faulted`;
    the consumer's twin has none)."""
    return bool(getattr(engine, "faulted", False))


def _wait_for_producers(regions) -> None:
    """The host waits for the work queued so far on the caller's current
    streams and the regions' registered streams: the persistent kernel reads
    the regions outside any stream order."""
    from concordia.executor.resident import caller_stream_views, registered_streams

    for st in caller_stream_views() + registered_streams(regions):
        st.synchronize()
