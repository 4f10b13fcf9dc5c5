"""Naming a log's home and opening it: `parse_spec` and `open_backend`, the one
way a log's home is named (CLI and API alike).

A name is `KIND:REST` or a plain path:

    dax:/dev/dax0.0       device DAX (CXL memory, NVDIMM namespace in devdax mode)
    pmem:/mnt/pmem/log    a file on an fsdax mount, mapped through libpmem
    shm:NAME              a file in /dev/shm (or shm:/dev/shm/NAME)
    file:PATH             a plain page-cache file, mmap + msync
    pinned:               cudaHostAlloc memory (volatile; GPU loss only)
    memory:               an anonymous mapping (volatile; for tests)
    /some/path            detected: a DAX character device, a file under a tmpfs,
                          a file on a dax-mounted file system, else a plain file

The contract every tier keeps is `backend.Backend`; this module owns only the
naming and the dispatch to the tiers.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import numpy as np

from .backend import Backend, mount_of
from .devdax import DevDaxBackend
from .errors import BadSpecError, ReadOnlyError
from .pinned import PinnedBackend
from .tiers import FileBackend, MemoryBackend, PmemBackend, ShmBackend

__all__ = ["Spec", "parse_spec", "detect_kind", "open_backend", "SHM_DIR"]

SHM_DIR = "/dev/shm"
KINDS = ("devdax", "pmem", "shm", "file", "pinned", "memory")
_PREFIX = {"dax": "devdax", "devdax": "devdax", "pmem": "pmem", "shm": "shm", "file": "file",
           "pinned": "pinned", "memory": "memory"}


@dataclass(frozen=True)
class Spec:
    """A parsed log name: the tier and the path (None for pinned / memory)."""

    kind: str
    path: str | None
    text: str


def parse_spec(spec: str) -> Spec:
    """Turn a log name into a `Spec`; plain paths are classified by `detect_kind`.

    Raises BadSpecError for an unknown prefix or a prefix without the path it needs.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise BadSpecError(f"a log name must be a string, not {type(spec).__name__}")
    text = os.fspath(spec)
    if not text:
        raise BadSpecError("empty log name")
    prefix, sep, rest = text.partition(":")
    if sep and prefix in _PREFIX:
        kind = _PREFIX[prefix]
        if kind in ("pinned", "memory"):
            if rest:
                raise BadSpecError(f"{prefix}: takes no path, got {rest!r}", where=text)
            return Spec(kind, None, text)
        if not rest:
            raise BadSpecError(f"{prefix}: needs a path", where=text,
                               hint=f"e.g. {prefix}:{'NAME' if kind == 'shm' else '/path/log'}")
        if kind == "shm" and "/" not in rest:
            rest = os.path.join(SHM_DIR, rest)
        return Spec(kind, os.path.abspath(rest), text)
    if sep and prefix.isalnum() and len(prefix) > 1 and not os.path.exists(text):
        raise BadSpecError(f"unknown log kind {prefix!r}", where=text,
                           hint="use dax:, pmem:, shm:, file:, pinned:, memory: or a path")
    path = os.path.abspath(text)
    return Spec(detect_kind(path), path, text)


def detect_kind(path: str) -> str:
    """Classify a plain path: a character device -> devdax; a file on tmpfs ->
    shm; a file on a mount with a `dax` option -> pmem; anything else -> file.
    A path that does not exist yet is classified by the file system it would be in."""
    try:
        st = os.stat(path)
        if stat.S_ISCHR(st.st_mode):
            return "devdax"
    except OSError:
        pass
    mount = mount_of(path)
    if mount is not None:
        fstype, options = mount
        if fstype == "tmpfs":
            return "shm"
        if any(o == "dax" or o.startswith("dax=") and o != "dax=never" for o in options):
            return "pmem"
    return "file"


def open_backend(spec, size: int | None = None, create: bool = False, readonly: bool = False,
                 numa_node: int | None = None, libpmem: str = "auto",
                 allow_foreign_owner: bool = False) -> Backend:
    """Open (or with `create=True`, create) the log home named by `spec`.

    size:      bytes to map; required when creating; for an existing file the
               file's length when None.  Must be a positive multiple of the tier's
               alignment.
    create:    create the file / shm object (mode 0600) when absent, grow it to
               `size` when shorter; never shrinks.
    readonly:  map read-only; `persist` then refuses.
    numa_node: shm only: bind the pages to this NUMA node.
    libpmem:   "auto" (use libpmem when it loads), "require" (fail with
               LibpmemUnavailableError when it does not), "off" (mmap + msync).
    allow_foreign_owner: open a log owned by another user (refused by default).

    Bad input raises a one-line DevmemError subclass and creates or changes nothing.
    """
    if isinstance(spec, Backend):
        return spec
    if libpmem not in ("auto", "require", "off"):
        raise BadSpecError(f"libpmem must be 'auto', 'require' or 'off', not {libpmem!r}")
    if create and readonly:
        raise ReadOnlyError("cannot create a log read-only", where=str(spec))
    s = parse_spec(spec)
    if numa_node is not None and s.kind != "shm":
        raise BadSpecError(f"numa_node applies to shm logs, not {s.kind}", where=s.text)
    if size is not None and (not isinstance(size, (int, np.integer)) or isinstance(size, bool)):
        raise BadSpecError(f"size must be an integer, not {type(size).__name__}", where=s.text)
    common = dict(size=None if size is None else int(size), create=create, readonly=readonly)
    if s.kind == "memory":
        return MemoryBackend.open(size)
    if s.kind == "pinned":
        return PinnedBackend.open(size)
    owner = dict(allow_foreign_owner=allow_foreign_owner, libpmem=libpmem)
    if s.kind == "file":
        return FileBackend.open(s.path, **common, **owner)
    if s.kind == "shm":
        return ShmBackend.open(s.path, numa_node=numa_node, **common, **owner)
    if s.kind == "pmem":
        return PmemBackend.open(s.path, **common, **owner)
    return DevDaxBackend.open(s.path, **common, **owner)
