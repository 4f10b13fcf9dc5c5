"""A backend wrapper that simulates power loss: it remembers what was persisted
and can produce the image a crash would leave behind.

Model (strict, as the Backend contract allows): a byte survives a crash with
the value it had when a `persist` covering it returned, or when a `flush`
covering it was followed by `drain()`.  Every other byte reverts to its last
persisted value (what the backend held when it was wrapped counts as persisted).
`crash("torn")` is less kind: each unpersisted 8-byte word independently keeps
its new or its old value, as cache lines evicted early would leave it.

Typical use in a WAL test:

    fb = FaultInjectingBackend(open_backend("memory:", size=1 << 20))
    log = Log.create(fb, size=...)           # ... write, persist some, not all ...
    image = fb.crash_image()
    log2 = Log.open(MemoryBackend.from_bytes(image))
"""

from __future__ import annotations

import os
import random

import numpy as np

from .backend import Backend
from .errors import InjectedFaultError
from .tiers import MemoryBackend

__all__ = ["FaultInjectingBackend", "DirectoryFaults"]

WORD = 8   # the store size the hardware never tears


class FaultInjectingBackend(Backend):
    """Wraps `inner`; writes go straight to `inner`'s bytes, persistence calls are
    recorded in a shadow copy and then passed on.

    fail_persist_after: after this many successful persist / drain calls, the next
    one raises InjectedFaultError and persists nothing (None: never).
    """

    def __init__(self, inner: Backend, fail_persist_after: int | None = None):
        self.inner = inner
        self.kind = inner.kind
        self.survives = inner.survives
        self.gpu_mappable = inner.gpu_mappable
        self.map_sync = getattr(inner, "map_sync", False)
        super().__init__(path=inner.path, size=inner.size, alignment=inner.alignment,
                         view=memoryview(inner.view), address=inner.address,
                         is_pmem=inner.is_pmem, persist_path=inner.persist_path,
                         readonly=inner.readonly)
        self._shadow = np.array(inner.array, copy=True)
        self._pending: list[tuple[int, np.ndarray]] = []
        self.fail_persist_after = fail_persist_after
        self.persist_calls = 0
        self.persisted_bytes = 0

    # -- recording ------------------------------------------------------------------
    def _tick(self, what: str) -> None:
        if self.fail_persist_after is not None and self.persist_calls >= self.fail_persist_after:
            raise InjectedFaultError(f"{what} failed on purpose after {self.persist_calls} calls",
                                     where=self.where)
        self.persist_calls += 1

    def _persist(self, offset, length):
        self._tick("persist")
        self._shadow[offset:offset + length] = self.array[offset:offset + length]
        self.persisted_bytes += length
        self.inner.persist(offset, length)

    def _flush(self, offset, length):
        # the bytes as they are now are what the flush carries; later stores are not
        self._pending.append((offset, self.array[offset:offset + length].copy()))
        self.inner.flush(offset, length)

    def _drain(self):
        self._tick("drain")
        for offset, data in self._pending:
            self._shadow[offset:offset + len(data)] = data
            self.persisted_bytes += len(data)
        self._pending.clear()
        self.inner.drain()

    def _release(self):
        self.inner.close()

    # the writer lock belongs to the file under the wrapped backend
    def lock(self, wait=False, stop=None) -> None:
        self.inner.lock(wait, stop)

    @property
    def locked(self) -> bool:
        return self.inner.locked

    # -- what a crash leaves ----------------------------------------------------------
    def unpersisted_ranges(self) -> list[tuple[int, int]]:
        """[(offset, length)] of bytes that differ from their persisted value."""
        diff = np.flatnonzero(self.array != self._shadow)
        if diff.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(diff) != 1)
        starts = np.concatenate(([diff[0]], diff[breaks + 1]))
        ends = np.concatenate((diff[breaks], [diff[-1]])) + 1
        return [(int(s), int(e - s)) for s, e in zip(starts, ends)]

    def crash(self, mode: str = "drop", seed: int | None = None) -> bytes:
        """The bytes a power loss would leave now, without changing anything.

        mode "drop": every unpersisted byte reverts (the contract's worst case for
        bytes never flushed).  "torn": each unpersisted 8-byte word keeps its new or
        its old value at random (reproducible with `seed`).  "keep": nothing is lost
        (a process crash on a tier that outlives one).
        """
        if mode == "keep":
            return self.array.tobytes()
        image = self._shadow.copy()
        if mode == "torn":
            rng = random.Random(seed)
            cur = self.array
            for off, n in self.unpersisted_ranges():
                w0, w1 = off // WORD, -(-(off + n) // WORD)
                for w in range(w0, w1):
                    if rng.random() < 0.5:
                        lo, hi = w * WORD, min(self.size, (w + 1) * WORD)
                        image[lo:hi] = cur[lo:hi]
        elif mode != "drop":
            raise ValueError(f"crash mode must be 'drop', 'torn' or 'keep', not {mode!r}")
        return image.tobytes()

    crash_image = crash

    def crash_backend(self, mode: str = "drop", seed: int | None = None) -> MemoryBackend:
        """A fresh `memory` backend holding the crash image (reopen a log from it)."""
        return MemoryBackend.from_bytes(self.crash(mode, seed))

    def crash_in_place(self, mode: str = "drop", seed: int | None = None) -> bytes:
        """Write the crash image over the wrapped backend and persist it, so the
        same path / object now holds what the crash left; returns the image."""
        image = self.crash(mode, seed)
        self.inner.view[:] = image
        self.inner.persist(0, self.size)
        self._shadow[:] = np.frombuffer(image, dtype=np.uint8)
        self._pending.clear()
        return image


class DirectoryFaults:
    """Records, in call order, the calls that decide whether a file's *name*
    survives a power loss, and says which names a crash now would lose.

    Model (ext4 / XFS without the rename heuristics, the strict case POSIX
    allows): a directory entry created (open with O_CREAT) or renamed into
    place survives only when an fsync of its directory returned after that
    change.  The file's bytes are a separate matter (`FaultInjectingBackend`).

        with DirectoryFaults() as fs:
            Log.create(f"file:{path}", size=...)
        fs.calls        # [("create", path), ("fsync-dir", dir), ("persist", path), ...]
        fs.lost()       # names a power loss now would take away

    While active it wraps `os.open`, `os.fsync`, `os.replace`, `os.rename`, `os.link`, `os.unlink` and
    the mapped tiers' persist (as "persist" of the backend's path) in this
    process; the calls themselves go through unchanged.
    """

    def __init__(self):
        self.calls: list[tuple] = []
        self._fds: dict[int, str] = {}
        self._saved: list = []

    # -- the model ----------------------------------------------------------------------
    def lost(self) -> list[str]:
        """Paths whose last create or rename no fsync of their directory followed."""
        pending: dict[str, int] = {}
        for i, call in enumerate(self.calls):
            if call[0] == "rename":
                pending.pop(call[1], None)  # the old name is gone either way
                pending[call[2]] = i
            elif call[0] == "create":
                pending[call[1]] = i
            elif call[0] == "unlink":
                pending.pop(call[1], None)  # a name taken away is not one a crash can lose
            elif call[0] == "fsync-dir":
                pending = {p: j for p, j in pending.items() if os.path.dirname(p) != call[1]}
        return sorted(pending)

    def index(self, kind: str, path: str | None = None) -> int:
        """Position of the first call of `kind` (on `path`, when given); -1 when none."""
        for i, call in enumerate(self.calls):
            if call[0] == kind and (path is None or call[-1] == path):
                return i
        return -1

    # -- the wrappers ---------------------------------------------------------------------
    def __enter__(self) -> "DirectoryFaults":
        from . import tiers

        real_open, real_fsync, real_replace, real_rename, real_link = os.open, os.fsync, os.replace, os.rename, os.link
        real_unlink = os.unlink
        real_persist = tiers.MappedBackend._persist
        me = self

        def open_(path, flags, *args, **kw):
            fd = real_open(path, flags, *args, **kw)
            full = os.path.abspath(os.fspath(path))
            me._fds[fd] = full
            if flags & os.O_CREAT:
                me.calls.append(("create", full))
            return fd

        def fsync_(fd):
            real_fsync(fd)
            path = me._fds.get(fd if isinstance(fd, int) else fd.fileno(), "?")
            me.calls.append(("fsync-dir" if os.path.isdir(path) else "fsync", path))

        def replace_(src, dst, *a, **kw):
            real_replace(src, dst, *a, **kw)
            me.calls.append(("rename", os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))

        def rename_(src, dst, *a, **kw):
            real_rename(src, dst, *a, **kw)
            me.calls.append(("rename", os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))

        def link_(src, dst, *a, **kw):  # a new name for a file, like a create
            real_link(src, dst, *a, **kw)
            me.calls.append(("create", os.path.abspath(os.fspath(dst))))

        def unlink_(path, *a, **kw):
            real_unlink(path, *a, **kw)
            me.calls.append(("unlink", os.path.abspath(os.fspath(path))))

        def persist_(backend, offset, length):
            real_persist(backend, offset, length)
            me.calls.append(("persist", os.path.abspath(backend.path)))

        self._saved = [(os, "open", real_open), (os, "fsync", real_fsync), (os, "replace", real_replace),
                       (os, "rename", real_rename), (os, "link", real_link), (os, "unlink", real_unlink),
                       (tiers.MappedBackend, "_persist", real_persist)]
        os.open, os.fsync, os.replace, os.rename, os.link = open_, fsync_, replace_, rename_, link_
        os.unlink = unlink_
        tiers.MappedBackend._persist = persist_
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, fn in self._saved:
            setattr(obj, name, fn)
        self._saved = []
