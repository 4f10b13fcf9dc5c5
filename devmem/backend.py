"""The `Backend` interface every memory tier implements and what a tier
survives; the errno map and the writer-lock probe the interface uses.

The tiers live in `tiers.py` (file, shm, pmem, memory), `devdax.py`,
`hugetlb.py` and `pinned.py`; naming a log's home and opening it (`parse_spec`, `open_backend`)
in `opener.py`.  This module imports no tier: the tiers import it.
"""

from __future__ import annotations

import abc
import enum
import errno
import fcntl
import os
from typing import Callable

import numpy as np

from concordia.root_error import Hint

from .errors import (
    BackendClosedError,
    BadSpecError,
    DevmemError,
    LockedError,
    OutOfRangeError,
    PathNotFoundError,
    PermissionDeniedError,
    ReadOnlyError,
)

__all__ = ["Survives", "Backend", "os_error"]


class Survives(enum.IntEnum):
    """The worst failure a tier's contents outlive (ordered: a larger value
    survives everything a smaller one does)."""

    GPU_LOSS = 1        # host memory of this process: lost with the process
    PROCESS_CRASH = 2   # shared memory: outlives the writer, not a reboot
    HOST_CRASH = 3      # page cache after msync: outlives a kernel crash / reboot
    POWER_LOSS = 4      # persistent memory after flush + drain


class Backend(abc.ABC):
    """One mapped, byte-addressable home for a log.

    Contract:
      * `view` is a writable memoryview of all `size` bytes (read-only when opened
        `readonly`); `array` is a numpy uint8 view of the same bytes, no copy.
      * Bytes written into the view are durable to the level `survives` names only
        after `persist(offset, length)` returned, or after `flush` of the range
        followed by `drain()`.  Until then a failure may keep or lose each of them.
      * `persist_path` says how persistence is done: "libpmem" (user-space cache
        flushes), "msync", or "none" (volatile tiers: persist orders nothing).
      * `address` is the virtual address of byte 0 (for GPU host registration).
      * `close()` unmaps once no view taken from this backend is still alive;
        using the backend afterwards raises `BackendClosedError`.

      * `lock()` takes the advisory writer lock of the file or device under the
        mapping; `close()` gives it back.
      * `at_close(fn)`: fn() runs first at `close()` (pins of the mapping given back
        before it is unmapped).

    Subclasses set the capability attributes and implement `_persist`, `_flush`,
    `_drain` and `_release`; range checking and the closed state live here.
    Tiers over a file or device keep a descriptor of it in `_file_fd` (opened
    for writing; -1 otherwise): that is what `lock` locks.
    """

    kind: str = "?"
    survives: Survives = Survives.GPU_LOSS
    gpu_mappable: bool = False
    _file_fd: int = -1
    _locked: bool = False
    _closers: tuple = ()

    def __init__(self, *, path: str | None, size: int, alignment: int, view: memoryview,
                 address: int, is_pmem: bool = False, persist_path: str = "none",
                 readonly: bool = False):
        self.path = path
        self.size = int(size)
        self.alignment = int(alignment)
        self.is_pmem = bool(is_pmem)
        self.persist_path = persist_path
        self.readonly = readonly
        self.address = int(address)
        self._view: memoryview | None = view
        self._array: np.ndarray | None = None

    # -- capabilities -------------------------------------------------------------
    @property
    def durable(self) -> bool:
        """True when persisted bytes outlive a host crash."""
        return self.survives >= Survives.HOST_CRASH

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def where(self) -> str:
        return f"{self.kind}:{self.path}" if self.path else f"{self.kind}:"

    def info(self) -> dict:
        """What a person (or `concordia-wal info`) wants to know about this tier."""
        return {
            "kind": self.kind, "path": self.path, "size": self.size, "alignment": self.alignment,
            "survives": self.survives.name.lower(), "durable": self.durable,
            "gpu_mappable": self.gpu_mappable, "is_pmem": self.is_pmem,
            "persist_path": self.persist_path, "readonly": self.readonly,
        }

    # -- the bytes ----------------------------------------------------------------
    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise BackendClosedError("backend is closed", where=self.where)
        return self._view

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self.view, dtype=np.uint8)
        return self._array

    # -- persistence --------------------------------------------------------------
    def persist(self, offset: int, length: int) -> None:
        """Make bytes [offset, offset+length) durable (to the level `survives`
        names) before returning."""
        if self._check(offset, length):
            try:
                self._persist(offset, length)
            except OSError as exc:
                raise os_error(exc, f"{self.where} @ {offset:#x}", "persist failed") from None

    def flush(self, offset: int, length: int) -> None:
        """Start making [offset, offset+length) durable; durable only once a
        later `drain()` returns."""
        if self._check(offset, length):
            try:
                self._flush(offset, length)
            except OSError as exc:
                raise os_error(exc, f"{self.where} @ {offset:#x}", "flush failed") from None

    def drain(self) -> None:
        """Wait until every range flushed so far is durable."""
        self.view  # raises when closed
        try:
            self._drain()
        except OSError as exc:
            raise os_error(exc, self.where, "drain failed") from None

    def at_close(self, fn: Callable[[], None]) -> None:
        """Run fn() at `close()`, before the mapping goes (once; it must not raise)."""
        self._closers = (*self._closers, fn)

    def close(self) -> None:
        """Unmap (deferred while views taken from this backend are alive) and
        give back the writer lock.  Calling it twice is harmless."""
        if self._view is None:
            return
        closers, self._closers = self._closers, ()
        try:
            for fn in closers:
                fn()
        finally:
            self._array = None
            view, self._view = self._view, None
            try:
                view.release()
            except BufferError:
                pass  # a caller still holds a view: the mapping goes when it does
            self._release()
            self._close_file()

    # -- the writer lock ----------------------------------------------------------
    def lock(self, wait: bool | float = False, stop: Callable[[], bool] | None = None) -> None:
        """Take the log's advisory writer lock: flock(LOCK_EX | LOCK_NB) on the
        file or device under the mapping, held until `close()`.  A writer takes
        it before changing a byte, so a second writer (another process, or a
        second open in this one) is refused with LockedError instead of writing
        over the first.  Readers take no lock.  Tiers with no file (memory,
        pinned) and backends opened read-only have nothing to lock: a no-op.
        Taking it twice on one backend is harmless.
        wait: True blocks until the holder gives the lock back (or dies: the
        kernel drops a dead process's locks), a number waits at most that many
        seconds; either way a holder still there raises LockedError.
        stop (with a number): asked between two tries; True ends the wait
        there, as its end would (a standby that sees its primary exiting)."""
        self.view  # raises when closed
        if self._locked or self._file_fd < 0:
            return
        try:
            if wait is True:
                fcntl.flock(self._file_fd, fcntl.LOCK_EX)
            elif wait:
                _flock_within(self._file_fd, float(wait), stop)
            else:
                fcntl.flock(self._file_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = lock_holder(self._file_fd)
            if pid == os.getpid():
                who = f"another open of this log in this process (pid {pid})"
            else:
                who = "another process" + (f" (pid {pid})" if pid else "")
            raise LockedError(f"log is open for writing by {who}", where=self.where,
                              hint=LOCKED_HINT) from None
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                return  # a file system without flock: writers are not kept apart there
            raise os_error(exc, self.where, "cannot lock") from None
        self._locked = True

    @property
    def locked(self) -> bool:
        """True while this backend holds the writer lock."""
        return self._locked

    def _close_file(self) -> None:
        if self._file_fd >= 0:
            if self._locked:
                # unlock explicitly: the mapping may hold the same open file past close
                try:
                    fcntl.flock(self._file_fd, fcntl.LOCK_UN)
                except OSError:
                    pass
            os.close(self._file_fd)
            self._file_fd = -1
        self._locked = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.size} bytes"
        return f"<{type(self).__name__} {self.where} {state} persist={self.persist_path}>"

    def _check(self, offset: int, length: int) -> bool:
        self.view
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfRangeError(f"range [{offset:#x}, {offset + length:#x}) outside a "
                                  f"mapping of {self.size:#x} bytes", where=self.where)
        if self.readonly and length:
            raise ReadOnlyError("persist on a backend opened read-only", where=self.where)
        return length > 0

    # -- what a tier provides -----------------------------------------------------
    @abc.abstractmethod
    def _persist(self, offset: int, length: int) -> None: ...

    def _flush(self, offset: int, length: int) -> None:
        self._persist(offset, length)   # tiers without a split flush/drain: persist now

    def _drain(self) -> None:
        pass

    @abc.abstractmethod
    def _release(self) -> None:
        """Drop the mapping (the view is already released or still exported)."""


def _flock_within(fd: int, seconds: float, stop: Callable[[], bool] | None = None) -> None:
    """flock(LOCK_EX) on fd, tried every millisecond for at most `seconds`, or
    until `stop()` says so; BlockingIOError when still held then."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline or (stop is not None and stop()):
                raise
            time.sleep(0.001)


def mount_of(path: str) -> tuple[str, list[str]] | None:
    """(fstype, options) of the mount holding `path` (deepest mount point wins):
    how the opener detects a tier and a tier tells how its file system maps holes."""
    probe = os.path.realpath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    best = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 6 or len(rfields) < 3:
                    continue
                point = fields[4].replace("\\040", " ")
                if probe == point or probe.startswith(point.rstrip("/") + "/"):
                    if best is None or len(point) >= len(best[0]):
                        opts = fields[5].split(",") + rfields[2].split(",")
                        best = (point, rfields[0], opts)
    except OSError:
        return None
    return None if best is None else (best[1], best[2])


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file of `fd`, from /proc/locks (None when
    it cannot be told: no procfs, or a holder in another pid namespace)."""
    try:
        st = os.fstat(fd)
        ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF" ("->" marks a waiter)
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == ident:
                    pid = int(parts[4])
                    return pid if pid > 0 else None
    except (OSError, ValueError):
        pass
    return None


# -- errno -> DevmemError -----------------------------------------------------------

#: what to do about a log another writer holds, in each interface's words
LOCKED_HINT = Hint(api="stop that writer first; a read-only open (Log.open(..., writable=False), "
                       "Session(..., readonly=True)) takes no lock",
                   cli="stop that writer first; info, dump and verify without --repair only read "
                       "and take no lock")

_HINTS = {
    errno.ENOENT: (PathNotFoundError, "check the path, or create the log first"),
    errno.EACCES: (PermissionDeniedError, "run as the log's owner or fix its permissions"),
    errno.EPERM: (PermissionDeniedError, "run as the log's owner or fix its permissions"),
    errno.EROFS: (ReadOnlyError, Hint(api="the file system is mounted read-only; open the log read-only "
                                         "(readonly=True)",
                                     cli="the file system is mounted read-only; info, dump and verify "
                                         "only read")),
    errno.ENOSPC: (DevmemError, "free space on the device or choose a smaller size"),
    errno.ENOMEM: (DevmemError, "not enough memory for the mapping; choose a smaller size"),
    errno.ENODEV: (DevmemError, "this file system does not support shared mappings"),
    errno.EISDIR: (BadSpecError, "name a file, not a directory"),
    errno.ENOTDIR: (PathNotFoundError, "a component of the path is not a directory"),
}


#: the hints of `_HINTS` that speak of a log, as they read for an output file (`outfile.output_error`)
OUTPUT_HINTS = {errno.EACCES: "write the output where you may, or fix the permissions of its folder",
                errno.EPERM: "write the output where you may, or fix the permissions of its folder",
                errno.ENOENT: "check the path of the output",
                errno.EROFS: "the file system is mounted read-only: write the output elsewhere"}


def os_error(exc: OSError, where: str, doing: str, *, hints: dict | None = None) -> DevmemError:
    """Map an OSError to the DevmemError subclass for its errno, with a remedy
    hint (`hints`: {errno: hint} taking the place of the log's)."""
    cls, hint = _HINTS.get(exc.errno, (DevmemError, None))
    hint = (hints or {}).get(exc.errno, hint)
    reason = exc.strerror or str(exc)
    return cls(f"{doing}: {reason}", where=where, hint=hint)
