"""A warm standby: a second process that holds a log ready to recover, watches
the process writing it (the primary), and takes over when it dies.

A cold recovery pays for a fresh process: start, import, map the log, pin it
for the GPU, compile kernels, load the model.  A `Standby` pays all of that up
front and then waits; the recovery left when the primary dies is the restore
itself.  Its timeline has the four phases of a recovery:

  detect       the primary is seen gone: the log's writer lock came free (the
               kernel drops a dead process's flock the moment its last
               descriptor closes; the standby tries it every millisecond), or,
               with a lease, its heartbeat stopped for longer than the lease;
  isolate      the primary is kept from writing again: a primary whose lease
               expired but which still holds the lock (hung, not dead) is
               SIGKILLed; a dying primary is waited for until it is a zombie
               (its GPU context, which could still write into the mapping, is
               gone with its last descriptor); then the standby, holding the
               writer lock, opens the log for writing, which cuts what the
               primary left after its last commit;
  restore      plan and apply the last committed epoch (on the GPU straight
               from the mapping registered while waiting);
  reintegrate  the caller's `resume(takeover)` carries on from the restored
               state, up to its first step (`takeover.resumed()`) or its return.

A hot standby (`follow=True`) takes over early by default: once every
thread of the primary is seen exiting, none of them writes again, so the
mirror read to the end holds the last epoch the log will decide; it is handed
to `resume` at once, and the lock (held through a GPU process's teardown, a
tenth of a second or more), the open and the check that the log decides that
epoch follow beside the caller (`Takeover.confirm`, before anything is
written).  Should the log decide otherwise, the decided epoch is restored and
`resume` called again (`TakeoverRevoked`).  A `resume` that goes on serving
without checkpointing (no `session()`, no `log`) calls `takeover.confirm()`
after its first step, so that a revoked takeover stops it there.

Who watches whom rests on the writer lock alone (`Backend.lock`): exactly one
process holds it.  Two standbys racing for one log both wait on it and the
kernel gives it to one; the other keeps waiting, now behind the new primary.
A primary that comes back finds the lock held and is refused (`LockedError`);
started as a standby instead, it waits like any other.  A standby started on
a log no process holds takes it over at once and says so.

The lease is optional (`lease_s=`): the primary keeps a `Heartbeat` (a thread
stamping CLOCK_MONOTONIC into a small file in /dev/shm named after the log
file's device and inode; nothing of it is in the log), and a standby treats a
stamp older than `lease_s` as a hung primary.  It needs both on one host.

The standby maps the log writable but writes nothing and takes no lock until
it takes over, so that the one mapping it registered with CUDA while waiting
serves the restore and the writer that follows; everything it reads before
then goes through `open_for_watching`, the one place to switch to a
read-only, lock-free recovery open.
"""

from __future__ import annotations

import gc
import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from concordia.devmem import Backend, open_backend, parse_spec
from concordia.devmem.backend import lock_holder
from concordia.devmem.errors import ConcordiaError, LockedError
from concordia.regions.errors import StandbyError, TakeoverRevoked

__all__ = ["Standby", "Takeover", "TakeoverRevoked", "Heartbeat", "StandbyError", "open_for_watching", "lease_path",
           "read_lease"]

#: lease file: magic, pid, period_ns, beat_ns (CLOCK_MONOTONIC), beats; little-endian
LEASE = struct.Struct("<8sQQQQ")
LEASE_MAGIC = b"CCLEASE1"
LEASE_DIR = "/dev/shm"
FILE_TIERS = ("shm", "hugetlb", "file", "pmem", "devdax")
#: how long a standby tries the lock before it looks again at who holds it
WATCH_SLICE_S = 0.25
#: the same for a following standby, which polls its mirror between tries
FOLLOW_SLICE_S = 0.01
#: how long an early takeover waits, after its primary's first thread is seen
#: exiting, for the others to follow it before it takes the lock-first path
EARLY_THREADS_S = 0.05
#: how long an early takeover's confirmation waits for the writer lock
CONFIRM_LOCK_S = 30.0


def _now() -> float:
    return time.monotonic()   # CLOCK_MONOTONIC: one clock for every process of the host


# ------------------------------------------------------------------ the lease
def lease_path(backend, directory: str = LEASE_DIR) -> str:
    """The lease file of the log under `backend`: named by the log file's
    device and inode, so every name of one log finds the same lease."""
    if backend.path is None:
        raise StandbyError(f"a {backend.kind} log has no file to keep a lease for", where=backend.where)
    st = os.stat(backend.path)
    return os.path.join(directory, f"concordia-lease-{st.st_dev:x}-{st.st_ino:x}")


@dataclass(frozen=True)
class LeaseState:
    pid: int
    period_s: float
    beat_at: float   # CLOCK_MONOTONIC seconds of the last beat
    beats: int

    def age(self, now: float | None = None) -> float:
        return (_now() if now is None else now) - self.beat_at


def read_lease(path: str) -> LeaseState | None:
    """The lease as last stamped, or None where there is none (no file, too
    short, not a lease)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(LEASE.size)
    except OSError:
        return None
    if len(raw) < LEASE.size:
        return None
    magic, pid, period_ns, beat_ns, beats = LEASE.unpack(raw)
    if magic != LEASE_MAGIC:
        return None
    return LeaseState(int(pid), period_ns / 1e9, beat_ns / 1e9, int(beats))


def _drop_stale_lease(backend) -> None:
    """Remove the lease file a dead primary left (SIGKILL gives its Heartbeat
    no chance to); a live process's is left alone."""
    try:
        path = lease_path(backend)
    except (StandbyError, OSError):
        return
    lease = read_lease(path)
    if lease is None or lease.pid == os.getpid():
        return
    try:
        os.kill(lease.pid, 0)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Heartbeat:
    """The primary's side of a lease: a daemon thread stamping the time every
    `period_s` into the log's lease file.  Start it once the log is open for
    writing (the lock held); `stop()` (or leaving the `with`) removes the file.

        with Session("hugetlb:kv") as s, Heartbeat(s.log, period_s=0.05):
            ...
    """

    def __init__(self, log, period_s: float = 0.05, directory: str = LEASE_DIR):
        backend = getattr(log, "backend", log)
        if period_s <= 0:
            raise StandbyError(f"a heartbeat period must be positive, not {period_s}")
        self.path = lease_path(backend, directory)
        self.period_s = float(period_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            self._mm = mmap.mmap(fd, mmap.PAGESIZE)
        finally:
            os.close(fd)
        self._words = np.frombuffer(self._mm, np.uint64, 4, offset=8)   # pid, period, beat, beats
        self._words[0] = os.getpid()
        self._words[1] = int(self.period_s * 1e9)
        self._words[3] = 0
        self.beat()
        self._mm[:8] = LEASE_MAGIC

    def beat(self) -> None:
        """Stamp now (one aligned 8-byte store: a reader sees the old or the new time)."""
        self._words[2] = time.monotonic_ns()
        self._words[3] += 1

    def start(self) -> "Heartbeat":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="concordia-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._mm is not None:
            self._words = None
            self._mm.close()
            self._mm = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ------------------------------------------------------------------ fencing
#: /proc/PID/stat flags bit of a task in do_exit
PF_EXITING = 0x4


def _stat(pid: int, path: str | None = None) -> tuple[str, int] | None:
    """(state letter, flags) of a process (or of the task at `path`, a
    /proc/PID/task/TID/stat), None when there is no such process."""
    try:
        with open(path or f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()   # the name may hold spaces and parentheses
    try:
        return rest[0], int(rest[6])
    except (IndexError, ValueError):
        return None


def _exiting(pid: int) -> bool:
    """Whether `pid` has begun to exit (in do_exit, a zombie, or gone)."""
    st = _stat(pid)
    return st is None or st[0] in "ZX" or bool(st[1] & PF_EXITING)


def _all_exiting(pid: int) -> bool:
    """Whether every thread of `pid` has begun to exit: none of them runs a
    line of the primary's code again (a SIGKILL reaches each thread on its
    own; a thread inside a write finishes that write first, then exits)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True   # gone
    for tid in tids:
        st = _stat(pid, f"/proc/{pid}/task/{tid}/stat")
        if st is not None and not (st[0] in "ZX" or st[1] & PF_EXITING):
            return False   # (None: that thread is gone)
    return True


def _lock_after_exit(backend, pid: int) -> None:
    """Take the writer lock of a primary seen exiting (its teardown holds it
    a while), or say in one line that it is still held CONFIRM_LOCK_S later."""
    try:
        backend.lock(wait=CONFIRM_LOCK_S)
    except LockedError:
        raise StandbyError(f"the primary (pid {pid}) began exiting and its log is still locked "
                           f"{CONFIRM_LOCK_S:g} s later", where=backend.where,
                           hint="another process may share its descriptor") from None


def wait_exited(pid: int, within: float) -> float:
    """Wait while `pid` is exiting (SIGKILLed, its descriptors still closing)
    until it is a zombie or gone; a process that is not exiting (it closed the
    log and lives on) is not waited for.  Returns the seconds waited; raises
    StandbyError when it is still exiting after `within` seconds."""
    t0 = _now()
    while True:
        st = _stat(pid)
        if st is None or st[0] in "ZX" or not st[1] & PF_EXITING:
            return _now() - t0
        if _now() - t0 > within:
            raise StandbyError(f"the primary (pid {pid}) is still exiting after {within} s",
                               hint="a device may be hung in its release; see dmesg")
        time.sleep(0.0005)


# ------------------------------------------------------------------ takeover
@dataclass
class Phase:
    phase: str
    ms: float | None
    what: str

    def to_json(self) -> dict:
        return {"phase": self.phase, "ms": self.ms, "what": self.what}


@dataclass
class Takeover:
    """What a standby hands its caller: the log open for writing (the lock
    held), the restored arrays, and how it got there.  `resumed()` marks the
    first step the caller made from the restored state (the end of
    reintegrate); `session()` opens a `Session` on the log to carry on.

    An early takeover (a hot standby whose primary is seen exiting) is
    handed over before the writer lock comes free: its arrays are the
    mirror's, at the last epoch the primary committed, and the lock, the
    open that cuts the primary's tail and the check that the log decides
    that same epoch run beside the caller (`confirm`).  `log`, `session()`
    and `close()` wait for them; nothing is written to the log before."""

    _log: Any
    arrays: dict
    epoch: int
    cause: str
    primary_pid: int | None
    stamps: dict                      # CLOCK_MONOTONIC seconds: detected, isolated, restored, resumed
    timeline: list = field(default_factory=list)
    restore_stats: dict = field(default_factory=dict)
    registration: Any = None
    heartbeat: Heartbeat | None = None
    result: Any = None                # what `resume` returned
    collector_held: bool = False      # Python's cyclic collector held off since the detection (`take_over`)
    pending: Any = None               # an early takeover's confirmation (`_Confirmation`) not yet taken
    _unopened: Any = None             # the backend of a confirmation that failed before its open

    @property
    def log(self):
        """The log, open for writing with the writer lock held (an early
        takeover's confirmation is waited for first)."""
        self.confirm()
        return self._log

    @log.setter
    def log(self, value) -> None:
        self._log = value

    def confirm(self, timeout: float | None = None) -> None:
        """Wait for an early takeover's confirmation: the writer lock, the
        primary's exit, the open that cuts its tail, and the log deciding the
        epoch handed over.  Raises TakeoverRevoked when the log decided
        another epoch (its `log` holds the lock then), and what the lock or
        the open raised.  Adds the "confirm" phase; nothing to do otherwise."""
        c = self.pending
        if c is None:
            return
        if not c.done.wait(timeout):
            raise StandbyError(f"the takeover of epoch {self.epoch} is not confirmed after {timeout} s",
                               hint="the primary's lock is still held")
        self.pending = None
        self.stamps.update(c.stamps)
        self.restore_stats["open"] = c.open_stats
        self.timeline.append(Phase("confirm", (c.stamps.get("confirmed", _now()) - self.stamps["detected"]) * 1e3,
                                   c.what()))
        self.heartbeat = c.heartbeat
        if c.error is not None:
            if c.log is None:
                self._unopened = c.backend   # closed by `close`, after the registration
            else:
                self._log = c.log
            raise c.error
        if int(c.log.last_committed_epoch or 0) != self.epoch:
            got = int(c.log.last_committed_epoch or 0)
            raise TakeoverRevoked(f"the takeover resumed epoch {self.epoch}, the mirror's, and the log decided "
                                  f"epoch {got} once its writer lock was held", log=c.log, epoch=self.epoch,
                                  decided=got, where=str(c.backend.where))
        self._log = c.log

    def resumed(self) -> float:
        """Mark the first step made from the restored state; returns the stamp.
        Python's cyclic collector runs again from here."""
        if "resumed" not in self.stamps:
            self.stamps["resumed"] = _now()
        self.release_collector()
        return self.stamps["resumed"]

    def release_collector(self) -> None:
        """Let Python's cyclic collector run again, when the takeover held it
        off (`resumed`, `session`, `close` and `Standby.run` do this)."""
        if self.collector_held:
            self.collector_held = False
            gc.enable()

    def session(self, **kw):
        """A `Session` on the log to carry on checkpointing.  The session
        registers the mapping for its own device staging, so the standby's
        registration is given back first.  Register `arrays` in it and call
        `session.adopt(takeover.epoch)`: the next checkpoint then writes what
        changed since the takeover's epoch, not every region whole."""
        from concordia.session import Session

        self.release_collector()
        log = self.log
        if self.registration is not None:
            self.registration.unregister()
            self.registration = None
        return Session(log, create=False, **kw)

    def close(self) -> None:
        """Give back the registration, the heartbeat and the log (the lock)."""
        self.release_collector()
        c, self.pending = self.pending, None
        if c is not None:   # an early takeover: its confirmation owns the log until it ends
            c.done.wait()
            self.heartbeat = self.heartbeat or c.heartbeat
            if c.log is not None:
                self._log = c.log
            else:
                self._unopened = c.backend
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.registration is not None:
            self.registration.unregister()
            self.registration = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._unopened is not None:
            self._unopened.close()
            self._unopened = None

    def to_json(self) -> dict:
        total = [p.ms for p in self.timeline if p.ms is not None and p.phase != "confirm"]
        return {"epoch": self.epoch, "cause": self.cause, "primary_pid": self.primary_pid,
                "regions": {n: int(a.nbytes) for n, a in self.arrays.items()},
                "timeline": [p.to_json() for p in self.timeline],
                "total_ms": sum(total) if total else None,
                "monotonic_s": dict(self.stamps), "restore": dict(self.restore_stats)}


class _Confirmation:
    """An early takeover's second half, on a thread of its own while the
    caller resumes: the decision of the log made while the primary's
    teardown holds its lock (`Log.decide`), the lock, the wait for the
    primary's GPU context (`wait_exited`), then the open for writing (the
    decision taken when the mirror finds nothing new, `Mirror.settled`).
    Touches no array and no device."""

    def __init__(self, backend, mirror, pid: int, heartbeat_s: float | None, t0: float):
        self.backend, self.mirror, self.pid, self.heartbeat_s = backend, mirror, pid, heartbeat_s
        self.t0 = t0   # when the primary was seen exiting
        self.done = threading.Event()
        self.stamps: dict = {}
        self.open_stats: dict = {}
        self.log = self.heartbeat = self.error = None
        self.thread = threading.Thread(target=self._run, name="concordia-standby-confirm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from concordia.wal import Log

        b, m = self.backend, self.mirror
        try:
            try:
                decided = Log.decide(b, holds=m.settled, check_pages="last", walked=m.walked)
            except ConcordiaError:
                decided = None   # left for the open to make (and raise)
            self.stamps["decided"] = _now()
            _lock_after_exit(b, self.pid)
            self.stamps["locked"] = _now()
            exit_wait = wait_exited(self.pid, within=10.0)
            log = Log.open(b, writable=True, check_pages="last", walked=m.walked, decided=decided)
            self.stamps["confirmed"] = _now()
            self.open_stats = dict(log.open_stats, exit_wait_s=exit_wait)
            self.log = log
            if self.heartbeat_s:
                self.heartbeat = Heartbeat(log, period_s=self.heartbeat_s).start()
            else:
                _drop_stale_lease(b)
        except BaseException as exc:   # handed to the caller by `Takeover.confirm`
            self.error = exc
        finally:
            self.done.set()

    def what(self) -> str:
        st, o = self.stamps, self.open_stats
        if self.error is not None:
            return f"not confirmed: {self.error}"
        return (f"beside the caller: the log decided ({(st['decided'] - self.t0) * 1e3:.1f} ms), the writer lock "
                f"came free ({(st['locked'] - self.t0) * 1e3:.1f} ms), pid {self.pid} gone "
                f"({o.get('exit_wait_s', 0) * 1e3:.1f} ms more), the log opened for writing at epoch "
                f"{int(self.log.last_committed_epoch or 0)}"
                + (" (the decision kept)" if "decided_before_s" in o else
                   f" (decided again: walk {o.get('walk_s', 0) * 1e3:.1f} ms)")
                + f", cut {o.get('cut_s', 0) * 1e3:.1f} ms")


def open_for_watching(spec):
    """The standby's open of a log it does not own: (backend, Log) with the
    log read at the state it is in now, no lock taken and nothing written.
    The mapping is writable so that the same one (and its CUDA registration)
    serves the writer after a takeover; the Log over it is read-only.  The
    one place to switch to a read-only, lock-free recovery open."""
    from concordia.wal import Log

    backend = open_backend(spec)
    try:
        # live: the primary may be writing an epoch now, and a walk that passed a
        # reservation it had not yet filled reads as damage before a commit
        log = Log.open(backend, writable=False, check_pages=False, live=True)
    except BaseException:
        backend.close()
        raise
    return backend, log


class Standby:
    """A warm standby for the log `spec` (see the module doc).

    device: "auto" (the GPU when CuPy finds one), "gpu" or "cpu".  gpu: the
    device number to stand by on (a spare GPU; default: CuPy's current one).
    load_model: called as `load_model(standby)` while warming; its result is
    `standby.model` (for `resume` to use).  lease_s: also watch the primary's
    `Heartbeat`, and treat a stamp older than this as a hung primary (SIGKILLed
    to isolate it); None watches the writer lock alone.  progress: a callable
    taking one line of text.  follow: a hot standby: keep a `mirror.Mirror` of
    the log while waiting, each committed epoch applied as it is written, and
    take over from it (only the epochs since its last poll are applied then),
    on the standby's device.  early (with follow): take over as soon as
    every thread of the primary is seen exiting, from the mirror, and let the
    lock and the open follow beside the caller (`Takeover.confirm`); False
    waits for the lock first.
    """

    def __init__(self, spec, *, device: str = "auto", gpu: int | None = None, load_model: Callable | None = None,
                 lease_s: float | None = None, heartbeat_s: float | None = None,
                 rehearse: bool = True, progress: Callable[[str], None] | None = None, follow: bool = False,
                 early: bool = True):
        if device not in ("auto", "gpu", "cpu"):
            raise StandbyError(f"unknown device {device!r} (use auto, gpu or cpu)")
        if lease_s is not None and lease_s <= 0:
            raise StandbyError(f"a lease must be positive, not {lease_s}")
        if gpu is not None and device == "cpu":
            raise StandbyError(f"GPU {gpu} was asked for with device 'cpu' (drop one of them)", where=str(spec))
        # a volatile tier (memory:, pinned:) is refused by its name, before
        # anything is opened: there is no file for a second process to map
        kind = spec.kind if isinstance(spec, Backend) else parse_spec(spec).kind
        if kind not in FILE_TIERS:
            raise StandbyError("a volatile log lives in its writer's own memory: no other process "
                               "can follow it", where=str(spec),
                               hint="put the log on shm:, hugetlb:, file:, pmem: or dax:")
        self.spec = spec
        self.device = device
        self.follow = follow
        self.early = early
        self.mirror = None
        self.mirror_error: str | None = None
        self.gpu = gpu
        self.load_model = load_model
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else (lease_s / 4 if lease_s else None)
        self.rehearse = rehearse
        self.progress = progress or (lambda msg: None)
        self.backend = None
        self.registration = None
        self.model = None
        self.on_gpu = False
        self.warm_report: dict | None = None
        #: the log's regions as the warm-up read them ({name: RegionInfo})
        self.regions: dict = {}
        self._watch_log = None
        #: (start, end) CLOCK_MONOTONIC of the mirror's last poll while watching
        self.last_follow: tuple | None = None
        #: where the time of that poll went (`Mirror.poll`'s phases)
        self.last_poll: dict | None = None
        #: the takeover's decision, made while the primary exited (`_predecide`)
        self._decided = None

    # -------------------------------------------------------------- warming
    def warm(self) -> dict:
        """Open and map the log, register it with CUDA, compile the kernels its
        regions use, rehearse one restore, load the model.  Returns seconds per
        step; idempotent."""
        if self.warm_report is not None:
            return self.warm_report
        rep: dict = {}
        t0 = _now()
        self.backend, self._watch_log = open_for_watching(self.spec)
        rep["open_s"] = _now() - t0
        rep["tier"] = self.backend.kind
        regions = self.regions = dict(self._watch_log.regions)
        rep["regions"] = {n: int(r.nbytes) for n, r in regions.items()}
        rep["epoch_seen"] = int(self._watch_log.last_committed_epoch or 0)
        self.on_gpu = self._pick_device()
        rep["device"] = "gpu" if self.on_gpu else "cpu"
        if self.on_gpu:
            t1 = _now()
            if self.backend.gpu_mappable:
                from concordia.devmem import cuda_host

                self.registration = cuda_host.register(self.backend)
            rep["register_s"] = _now() - t1
            t2 = _now()
            from concordia.gpu_kernels import jit

            specs = [("crc32c", {})]
            for pb in sorted({int(r.page_bytes) for r in regions.values()}):
                specs += jit.page_specs(pb)
            jit.precompile(specs)
            rep["compile_s"] = _now() - t2
            rep["kernels"] = len(specs)
        if self.follow:
            from concordia.mirror import Mirror

            t3 = _now()
            # its first restore is the rehearsal, and kept
            self.mirror = Mirror(self.backend, device=self.on_gpu, registration=self.registration)
            rep["mirror_epoch"] = self.mirror.epoch
            rep["mirror_s"] = _now() - t3
        elif self.rehearse and rep["epoch_seen"]:
            t3 = _now()
            try:
                out = self._restore(self._watch_log, {})
                rep["rehearsal_bytes"] = int(sum(a.nbytes for a in out.values()))
                del out
                if self.on_gpu:
                    import cupy

                    cupy.cuda.get_current_stream().synchronize()
            except ConcordiaError as exc:   # the primary moved on under the read: no harm
                rep["rehearsal_skipped"] = exc.one_line()
            rep["rehearse_s"] = _now() - t3
        if self.load_model is not None:
            t4 = _now()
            self.model = self.load_model(self)
            rep["model_s"] = _now() - t4
        rep["warm_s"] = _now() - t0
        self.warm_report = rep
        self.progress(f"warm in {rep['warm_s']:.3f} s: {rep['tier']} log, {len(regions)} regions, "
                      f"epoch {rep['epoch_seen']} seen, on the {rep['device'].upper()}")
        return rep

    def _pick_device(self) -> bool:
        if self.device == "cpu":
            return False
        from concordia.gpu_kernels import jit

        try:
            cp = jit.require_cupy()
        except ConcordiaError:
            if self.device == "gpu" or self.gpu is not None:  # a GPU named by number is a GPU asked for
                raise
            return False
        if self.gpu is not None:
            n = cp.cuda.runtime.getDeviceCount()
            if not 0 <= self.gpu < n:
                raise StandbyError(f"no GPU {self.gpu}: this machine has {n}", where=str(self.spec))
            cp.cuda.Device(self.gpu).use()
        return True

    # -------------------------------------------------------------- watching
    def primary(self) -> int | None:
        """The pid holding the log's writer lock now (None: no one, or unknown)."""
        fd = self.backend._file_fd
        return lock_holder(fd) if fd >= 0 else None

    def wait(self, timeout: float | None = None) -> dict:
        """Block until this standby holds the writer lock: at once when no
        process holds it, else when the primary dies (or, with a lease, when
        its lease expired and it was killed).  Returns how: {"cause",
        "primary_pid", "detected", "lease_age_s"}.  Raises StandbyError when
        `timeout` seconds pass first (the log is left untouched)."""
        self.warm()
        b = self.backend
        try:
            b.lock()
            self.progress("no process holds the log: taking over at once")
            return {"cause": "no primary held the log", "primary_pid": None, "detected": _now(),
                    "lease_age_s": 0.0}
        except LockedError:
            pass
        pid = self.primary()
        self.progress(f"watching the primary (pid {pid if pid else 'unknown'})"
                      + (f", lease {self.lease_s} s" if self.lease_s else ""))
        deadline = None if timeout is None else _now() + timeout
        lease_file = lease_path(b) if self.lease_s is not None else None
        # the lock is tried every millisecond (Backend.lock's wait) in slices, between
        # which the holder is looked up again (another standby may have become it)
        # and the lease read
        slice_s = WATCH_SLICE_S if lease_file is None else min(WATCH_SLICE_S, self.lease_s / 4)
        if self.mirror is not None:   # the mirror is kept within a slice of the primary
            slice_s = min(slice_s, FOLLOW_SLICE_S)
        exit_seen = None   # when the primary was first seen exiting (its lock not yet free)
        while True:
            try:
                left = slice_s if deadline is None else max(0.0, min(slice_s, deadline - _now()))
                # a hot standby also looks each millisecond whether the primary began exiting
                # (an early takeover starts there, not at the end of the slice)
                b.lock(wait=max(left, 0.001), stop=(lambda: _exiting(pid)) if exit_seen is None and pid and
                       self.mirror is not None else None)
                now = _now()
                if exit_seen is None:
                    return {"cause": "the primary's writer lock came free", "primary_pid": pid, "detected": now}
                return {"cause": "the primary began exiting, then its writer lock came free",
                        "primary_pid": pid, "detected": exit_seen, "locked": now}
            except LockedError:
                pass
            if exit_seen is None and pid and self.mirror is not None and _exiting(pid):
                # a SIGKILLed primary holds the lock until its teardown (its GPU memory, its
                # mappings) is done: a tenth of a second or more.  Once none of its threads
                # runs, what it committed is final: an early takeover starts from the mirror
                # now.  Otherwise the decision the takeover's open makes is made meanwhile,
                # and kept if the log stays as it was
                exit_seen = _now()
                if self.early and self._threads_exit(pid):
                    return {"cause": "the primary began exiting (every thread of it)", "primary_pid": pid,
                            "detected": exit_seen, "early": True}
                self._predecide()
                continue
            self._follow(watching=exit_seen is None)
            holder = self.primary()
            if holder and holder != pid:
                self.progress(f"the log is now held by pid {holder}: watching it")
                pid, exit_seen, self._decided = holder, None, None
            now = _now()
            lease = read_lease(lease_file) if lease_file is not None else None
            if lease is not None and lease.age(now) > self.lease_s:
                holder = self.primary()
                if holder is not None and holder != lease.pid:
                    pid = holder   # a new primary that keeps no lease: watch its lock
                else:
                    return self._isolate(lease, now)
            if deadline is not None and now >= deadline:
                raise StandbyError(f"the primary (pid {pid}) still holds the log after {timeout} s",
                                   where=b.where)

    @staticmethod
    def _threads_exit(pid: int) -> bool:
        """Whether every thread of `pid` is exiting within EARLY_THREADS_S of
        its first one (a SIGKILL reaches them one by one)."""
        end = _now() + EARLY_THREADS_S
        while not _all_exiting(pid):
            if _now() > end:
                return False
            time.sleep(0.0002)
        return True

    def _predecide(self) -> None:
        """With the primary exiting: read what it wrote until it died, then make
        the decision of the takeover's open (`Log.decide`), which the open
        takes once the lock is held if the follower then finds nothing new and
        nothing cut.  A decision that raises is left for the open to make."""
        from concordia.wal import Log

        self._follow(watching=False)
        if self.mirror is None:
            return
        f = self.mirror.follower
        at = (f.lsn, f.cuts)

        def holds() -> bool:
            self._follow(watching=False)
            return self.mirror is not None and (self.mirror.follower.lsn, self.mirror.follower.cuts) == at

        try:
            self._decided = Log.decide(self.backend, holds=holds, check_pages="last", walked=self.mirror.walked)
        except ConcordiaError:
            self._decided = None

    def _follow(self, watching: bool = True) -> None:
        """Apply to the mirror what the primary committed since the last look.
        Damage stops the following (said in `mirror_error`): the takeover
        restores from the log instead, which decides what the damage costs.
        watching: a poll of the watch, which a death waits on (its stamps are
        kept); the polls after the death was seen are not."""
        if self.mirror is None:
            return
        t0 = _now()
        try:
            self.mirror.poll()
            if watching:
                self.last_follow = (t0, _now())   # when the watch's last poll ran: a death meanwhile waits on it
                self.last_poll = self.mirror.last_poll
        except ConcordiaError as exc:
            self.mirror_error = exc.one_line()
            self.mirror = None
            self.progress(f"following stopped: {self.mirror_error}")

    def _isolate(self, lease: LeaseState, detected: float) -> dict:
        """A primary whose lease expired and which still holds the lock: kill
        it, then take the lock the kernel drops with it."""
        age = lease.age(detected)
        self.progress(f"lease expired ({age:.3f} s since the last beat): killing pid {lease.pid}")
        try:
            os.kill(lease.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise StandbyError(f"cannot kill the hung primary (pid {lease.pid}): not permitted",
                               where=self.backend.where) from None
        try:
            self.backend.lock(wait=10.0)
        except LockedError:
            raise StandbyError(f"the primary (pid {lease.pid}) still holds the log 10 s after SIGKILL",
                               where=self.backend.where) from None
        return {"cause": f"lease expired ({age * 1e3:.0f} ms without a beat): pid {lease.pid} killed",
                "primary_pid": lease.pid, "detected": detected, "lease_age_s": age}

    # -------------------------------------------------------------- taking over
    def take_over(self, detection: dict) -> Takeover:
        """With the lock held (after `wait`): open the log for writing (cutting
        what the primary left after its last commit), restore the last
        committed epoch, and return the Takeover.

        Python's cyclic collector is held off from here until the caller
        resumes (`Takeover.resumed`, `session` or `close`; `run` does it
        after `resume`): the open makes an object for every live record, and the
        collector's passes over them cost tens of milliseconds of the
        takeover (measured on the host: 36 ms of 87 at 16,000 records)."""
        held = gc.isenabled()
        gc.disable()
        try:
            tk = self._take_over_early(detection) if detection.get("early") else self._take_over(detection)
        except BaseException:
            if held:
                gc.enable()
            raise
        tk.collector_held = held
        return tk

    def _take_over_early(self, detection: dict) -> Takeover:
        """The takeover of a primary none of whose threads runs any more: the
        mirror read to the end holds the last epoch it committed, handed over
        now; the lock, the wait for its teardown and the open are confirmed
        beside the caller (`_Confirmation`).  Without a mirror holding an
        epoch (following stopped, nothing committed): the lock first."""
        stamps = {"detected": detection["detected"]}
        if self.last_follow is not None:
            stamps["last_poll_started"], stamps["last_poll_ended"] = self.last_follow
        before = self.mirror.epochs_applied if self.mirror is not None else 0
        self._follow(watching=False)   # all it wrote: it writes no more
        m, pid = self.mirror, detection["primary_pid"]
        if m is None or not m.epoch:
            _lock_after_exit(self.backend, pid)
            return self._take_over(dict(detection, early=False, locked=_now(),
                                        cause=detection["cause"] + ", then its writer lock came free"))
        stamps["isolated"] = _now()
        st = {"via": f"the mirror, {m.epochs_applied - before} epoch(s) applied at takeover, "
                     f"{m.epochs_applied} while following", "mirror": m.to_json(),
              "early": "handed over before the writer lock came free; confirmed beside the caller"}
        if self.last_poll is not None:   # the watch's last poll, which a death waited on
            st["last_poll"] = dict(self.last_poll)
        stamps["restored"] = _now()
        tk = Takeover(_log=None, arrays=m.arrays, epoch=int(m.epoch), cause=detection["cause"], primary_pid=pid,
                      stamps=stamps, restore_stats=st, registration=self.registration)
        tk.pending = _Confirmation(self.backend, m, pid, self.heartbeat_s, stamps["detected"])
        self.registration = self.backend = self._watch_log = None   # the takeover owns them now
        nbytes = sum(int(a.nbytes) for a in tk.arrays.values())
        tk.timeline = [
            Phase("detect", None, detection["cause"] + " (looked for every millisecond between the mirror's "
                  "polls: not timed here)"),
            Phase("isolate", (stamps["isolated"] - stamps["detected"]) * 1e3,
                  f"none of pid {pid}'s threads runs: the mirror read to the end, at epoch {tk.epoch} (the log, its "
                  f"lock and the primary's device teardown are confirmed beside the caller)"),
            Phase("restore", (stamps["restored"] - stamps["isolated"]) * 1e3,
                  f"epoch {tk.epoch} held by the mirror: {nbytes / (1 << 20):.2f} MiB in {len(tk.arrays)} regions "
                  f"on the {'GPU' if self.on_gpu else 'CPU'} ({st['via']})"),
        ]
        return tk

    def _take_over(self, detection: dict) -> Takeover:
        from concordia.wal import Log

        stamps = {"detected": detection["detected"]}
        if "locked" in detection:
            stamps["locked"] = detection["locked"]
        if self.last_follow is not None:
            stamps["last_poll_started"], stamps["last_poll_ended"] = self.last_follow
        pid = detection.get("primary_pid")
        if pid and pid != os.getpid():
            # the lock goes with the log's descriptor, which may close before the
            # primary's GPU context does: its kernels could still be writing into
            # the mapping.  A dying process has let go of every device once it is
            # a zombie (or reaped).
            detection["exit_wait_s"] = wait_exited(pid, within=10.0)
        before = self.mirror.epochs_applied if self.mirror is not None else 0
        # a mirror reads what the primary wrote until it died, the tail after its last
        # commit included, and hands the open its walk of every segment wholly read
        self._follow()
        decided, self._decided = self._decided, None
        log = Log.open(self.backend, writable=True, check_pages="last",
                       walked=None if self.mirror is None else self.mirror.walked, decided=decided)
        self._watch_log = None   # superseded; it shares the backend, which `log` now owns
        stamps["isolated"] = _now()
        arrays, st = {}, {"open": dict(log.open_stats)}
        if "exit_wait_s" in detection:
            st["open"]["exit_wait_s"] = detection["exit_wait_s"]
        if self.last_poll is not None:   # the watch's last poll, which a death waited on
            st["last_poll"] = dict(self.last_poll)
        epoch = int(log.last_committed_epoch or 0)
        if epoch and self.mirror is not None:
            self._follow()   # the cut seen: nothing after the last commit is applied
            if self.mirror is not None and self.mirror.epoch == epoch:
                arrays = self.mirror.arrays
                st["via"] = (f"the mirror, {self.mirror.epochs_applied - before} epoch(s) applied at takeover, "
                             f"{self.mirror.epochs_applied} while following")
                st["mirror"] = self.mirror.to_json()
            else:
                held = None if self.mirror is None else self.mirror.epoch
                st["mirror_missed"] = f"the mirror held epoch {held}" if self.mirror_error is None else \
                    self.mirror_error
        if epoch and not arrays:
            arrays = self._restore(log, st)
        stamps["restored"] = _now()
        hb = None
        if self.heartbeat_s:
            hb = Heartbeat(log, period_s=self.heartbeat_s).start()   # the next standby watches us
        else:
            _drop_stale_lease(self.backend)
        tk = Takeover(_log=log, arrays=arrays, epoch=epoch, cause=detection["cause"],
                      primary_pid=detection.get("primary_pid"), stamps=stamps, restore_stats=st,
                      registration=self.registration, heartbeat=hb)
        self.registration = None   # the takeover owns it now
        self.backend = None
        nbytes = sum(int(a.nbytes) for a in arrays.values())
        age = detection.get("lease_age_s")
        tk.timeline = [
            Phase("detect", None if age is None else age * 1e3,
                  detection["cause"] + ("" if age is not None else
                                        " (the kernel drops the lock as the primary's last descriptor "
                                        "closes; tried every millisecond: not timed here)")),
            Phase("isolate", (stamps["isolated"] - stamps["detected"]) * 1e3,
                  f"writer lock held, {'the mirror read to the end, ' if self.mirror is not None else ''}"
                  f"log opened for writing at epoch {epoch} (the primary's "
                  f"uncommitted tail cut: walk {st['open'].get('walk_s', 0) * 1e3:.1f} ms, cut "
                  f"{st['open'].get('cut_s', 0) * 1e3:.1f} ms)"
                  + (f"; the lock came free {(stamps['locked'] - stamps['detected']) * 1e3:.1f} ms after the "
                     f"exit was seen" if "locked" in stamps else "")
                  + (f"; the log decided meanwhile ({st['open']['decided_before_s'] * 1e3:.1f} ms), before the "
                     f"lock" if "decided_before_s" in st["open"] else "")
                  + (f"; waited {detection['exit_wait_s'] * 1e3:.1f} ms for "
                     f"pid {pid} to finish exiting" if detection.get("exit_wait_s") else "")),
            Phase("restore", (stamps["restored"] - stamps["isolated"]) * 1e3,
                  f"epoch {epoch} {'held by the mirror' if 'mirror' in st else 'planned and restored'}: "
                  f"{nbytes / (1 << 20):.2f} MiB into "
                  f"{len(arrays)} regions on the {'GPU' if self.on_gpu else 'CPU'}, digests checked"
                  + (f" ({st.get('via')})" if st.get("via") else "")),
        ]
        return tk

    def _restore(self, log, st: dict) -> dict:
        """The last committed epoch of `log`, restored by the one recover entry
        (`restore.run.restore`) on the standby's device; `st` gets its figures
        (plan_s, and the device pipeline's stages)."""
        from concordia.restore.run import restore

        got = restore(log, device=self.on_gpu, registration=self.registration, stats=st)
        st["plan_s"] = got.plan_s
        return got.arrays

    def run(self, resume: Callable[[Takeover], Any] | None = None, *, timeout: float | None = None) -> Takeover:
        """Warm, wait, take over, then `resume(takeover)` (its result in
        `takeover.result`); the reintegrate phase lasts until the caller's
        `takeover.resumed()` or, without it, until `resume` returns.  When
        `resume` raises, the takeover is closed (the log and its lock given
        back, cut after its last commit) before the error goes on."""
        self.warm()
        detection = self.wait(timeout)
        tk = self.take_over(detection)
        try:
            self.progress(f"took over: {tk.cause}; epoch {tk.epoch} restored")
            try:
                if resume is not None:
                    tk.result = resume(tk)
                tk.confirm()
            except TakeoverRevoked as rev:
                tk = self._revoked(tk, rev)
                if resume is not None:
                    tk.result = resume(tk)
        except BaseException:
            tk.close()   # the log (its lock) is given back: the caller never got the takeover to close
            raise
        finally:
            tk.release_collector()
        end = tk.stamps.get("resumed", _now())
        tk.stamps.setdefault("resumed", end)
        tk.timeline.append(Phase("reintegrate", (end - tk.stamps["restored"]) * 1e3,
                                 "the caller resumed from the restored state" if resume is not None
                                 else "state handed over (no resume hook)"))
        return tk

    def _revoked(self, tk: Takeover, rev: TakeoverRevoked) -> Takeover:
        """An early takeover the log did not confirm: the epoch it decided,
        restored from the log the confirmation opened, as a takeover of its
        own (the caller resumes again from it)."""
        self.progress(f"{rev.one_line()}: restoring epoch {rev.decided} from the log")
        from concordia.restore.run import restore

        log, st = rev.log, {"open": dict(tk.restore_stats.get("open", {})), "revoked": rev.one_line()}
        stamps = {k: v for k, v in tk.stamps.items() if k not in ("resumed", "isolated", "restored")}
        stamps["isolated"] = tk.stamps.get("confirmed", _now())
        try:
            got = restore(log, device=self.on_gpu, registration=tk.registration, stats=st)
        except BaseException:
            log.close()
            tk.close()
            raise
        st["plan_s"] = got.plan_s
        stamps["restored"] = _now()
        new = Takeover(_log=log, arrays=got.arrays, epoch=rev.decided, cause=tk.cause, primary_pid=tk.primary_pid,
                       stamps=stamps, restore_stats=st, registration=tk.registration, heartbeat=tk.heartbeat,
                       collector_held=tk.collector_held)
        tk.registration = tk.heartbeat = None
        tk.collector_held = False
        new.timeline = tk.timeline + [Phase("restore", (stamps["restored"] - stamps["isolated"]) * 1e3,
                                            f"epoch {rev.decided} planned and restored from the log")]
        return new

    def close(self) -> None:
        """Stop standing by: give back the registration and the mapping."""
        if self.registration is not None:
            self.registration.unregister()
            self.registration = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        self._watch_log = None


def format_timeline(tk: Takeover) -> str:
    lines = [f"took over   {tk.cause}", f"epoch       {tk.epoch} "
             f"({sum(int(a.nbytes) for a in tk.arrays.values()) / (1 << 20):.2f} MiB in {len(tk.arrays)} regions)",
             "timeline"]
    for p in tk.timeline:
        if p.phase != "confirm":
            ms = "        -" if p.ms is None else f"{p.ms:9.1f}"
            lines.append(f"  {p.phase:<12}{ms} ms  {p.what}")
    total = [p.ms for p in tk.timeline if p.ms is not None and p.phase != "confirm"]
    lines.append(f"  {'total':<12}{sum(total):9.1f} ms")
    for p in tk.timeline:   # an early takeover's, measured from the detection, beside the caller
        if p.phase == "confirm":
            lines.append(f"  {p.phase:<12}{p.ms:9.1f} ms  {p.what}")
    return "\n".join(lines)
