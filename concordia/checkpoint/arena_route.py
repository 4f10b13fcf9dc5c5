"""`Session(executor="resident")`'s checkpoints on the persistent kernel: a
CuPy session's epoch is one EPOCH task of the device's handler
(`device_epoch.DeviceEpochs`), not a CPU thread's run of the table pass.

    s = Session("shm:agent-7", executor="resident")
    s.register("kv", kv)                # CuPy arrays, shadow or fingerprint detectors
    s.checkpoint()                      # the first epoch (the bases): the consumer thread, as before
    st = s.checkpoint()                 # one EPOCH task: detection, staging, commit on the device
    st.executor, st.via["kv"]           # "resident", "device-epoch"

What a checkpoint here is.  The caller's producer streams (its current CuPy
and PyTorch streams, the streams given at `register`) are waited for, so that
the epoch holds every region as of the call in stream order; then one EPOCH
task runs the table pass and writes the commit into the session's arena
(`arena.py`).  When the task completes the epoch is durable: its commit is
in the log, on a tier whose writes need no persist call.  The statistics
come from the pass's mailbox (each row's pages) and the completion (record
bytes).  The session's next call that settles takes the arena's epochs on
(`Session.settle`): the appender adopts them, retention counts them, and the
statistics this returned are the ones `Session.checkpoints` lists.  Until
then `Session.epoch` already names the epoch (the open arena's last).

When it does not apply, the checkpoint takes the consumer thread, as before,
and `why` says why: the session's first epoch (the regions have no base and
no table pass), regions the device's handler cannot take
(`device_epoch.why_not`: host arrays, host-listed pages, a tier that needs a
persist call, several page sizes), a stream named at the call, a pending
epoch, a trigger armed on the consumer (its epochs use the arena), or a
region whose array changed.  After the regions change, the next checkpoint
builds the handler's descriptor again (its module is compiled once).

CuPy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import numpy as np

from concordia.checkpoint import device_epoch
from concordia.checkpoint.stats import CheckpointStats
from concordia.executor.errors import ExecutorError
from concordia.executor.ring import Status
from concordia.wal.errors import LogFullError

#: the statistics' `via` of an epoch the persistent kernel ran
VIA = "device-epoch"

#: how long the persistent kernel stays after an epoch without another (the
#: next checkpoint launches it again): a module the caller's framework loads
#: meanwhile waits at most this long for the kernel to leave
IDLE_S = 2e-3


class DeviceRoute:
    """The device's EPOCH handler behind a resident executor (module doc)."""

    def __init__(self, session):
        self.session = session
        self.dev: device_epoch.DeviceEpochs | None = None
        self.version = None       # the RegionSet version `dev` was built for
        self.failed = None        # the RegionSet version the handler failed to start for, and why
        self.failed_why: str | None = None
        #: why the last checkpoint did not take the device (None: it did)
        self.why: str | None = "no checkpoint yet"
        self.epochs = 0

    def checkpoint(self, reason: str, stream=None, *, armed: bool = False) -> CheckpointStats | None:
        """One epoch on the device, or None (`why` says why) for the caller to
        take its own path.  The caller holds the regions' lock.  A failed
        task makes every region's next checkpoint whole and leaves the
        regions as they are to the consumer thread."""
        if self.dev is not None and self.version != self.session.region_set.version:
            self.close()  # before any path of this call loads the new regions' kernels
        why = self._why_not(stream, armed)
        if why is None:
            why = self._ready()
        self.why = why
        if why is not None:
            return None
        dev, t = self.dev, self.dev.tpass.table
        try:
            dev.ensure_arena()
        except (LogFullError, ValueError) as exc:  # nothing written: this epoch takes the consumer's path
            self.why = f"no arena for the epoch now: {str(exc).strip().splitlines()[0]}"
            return None
        _wait_for_producers(self.session.region_set)
        try:
            c = dev.epoch()
            if c.status != Status.OK:
                raise ExecutorError(f"the device's EPOCH task failed with status {c.status.name}",
                                    where="device epoch")
        except BaseException as exc:
            self._failed(exc)
            raise
        arena = self.session.runner.arena
        epoch = arena.word("last_epoch")
        counts = dev.tpass.mail_counts.astype(np.int64)
        st = CheckpointStats.of_table(epoch, reason, t.names, counts, VIA, int(counts @ t.page_bytes), int(c.bytes),
                                      0.0, 0.0, 0.0, 0)
        st.executor = "resident"
        arena.given[epoch] = st  # filled and listed when the session takes the arena's epochs on
        # the arrays hold this epoch until the caller's next step: retention takes the copies
        # a job decided at the last commit taken on needs now, as at a pending launch
        self.session.retention.launched(epoch)
        self.epochs += 1
        return st

    def _why_not(self, stream, armed: bool) -> str | None:
        s = self.session
        if stream is not None:
            return "a stream was named at the call (the device's epoch orders against the producer streams only)"
        if armed:
            return "a trigger is armed on the consumer: its epochs take the arena"
        if s.runner.pending is not None:
            return "an epoch of checkpoint(wait=False) is pending"
        return None

    def _ready(self) -> str | None:
        """Build (or keep) the handler for the regions as they are; why not."""
        s = self.session
        version = s.region_set.version
        if self.dev is not None:
            if self.version == version:
                return None if self.dev.tpass.table.unchanged() else "a region's array changed since it was registered"
            self.close()
        if self.failed == version:
            return self.failed_why
        tpass = s.runner.table_pass(s.log)
        if tpass is None:  # a region's first epoch (its base) is still to come, or the paths differ
            return "the regions take no single table pass (a region without its first epoch, or several paths)"
        why = device_epoch.why_not(tpass, s.log.backend)
        if why is not None:
            return why
        try:
            self.dev = device_epoch.DeviceEpochs(s, idle_s=IDLE_S)
        except Exception as exc:  # the consumer thread takes the epochs; info() says why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.failed = version
            self.failed_why = f"the device's EPOCH handler did not start: {type(exc).__name__}: {first}"
            return self.failed_why
        self.version = version
        return None

    def _failed(self, exc: BaseException) -> None:
        """After a failed EPOCH task: detection may have moved on past pages
        no commit holds, so every region's next checkpoint writes it whole
        (on the consumer thread: this route is off for these regions)."""
        s = self.session
        s.runner.lose()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failed = s.region_set.version
        self.failed_why = f"the device's last EPOCH task failed: {type(exc).__name__}: {first}"
        dev, self.dev, self.version = self.dev, None, None
        try:
            dev.close()  # what the arena committed before is taken on; the failed task's bytes are padded over
        except Exception:  # the task's own error is the one raised
            pass

    @property
    def active(self) -> bool:
        return self.dev is not None

    def close(self) -> None:
        """Stop the persistent kernel; the arena's epochs are taken on."""
        dev, self.dev, self.version = self.dev, None, None
        if dev is not None:
            dev.close()


def _wait_for_producers(regions) -> None:
    """The host waits for the work queued so far on the caller's current
    streams and the regions' registered streams: the persistent kernel reads
    the regions outside any stream order."""
    from concordia.executor.resident import caller_stream_views, registered_streams

    for st in caller_stream_views() + registered_streams(regions):
        st.synchronize()
