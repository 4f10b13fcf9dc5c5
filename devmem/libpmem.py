"""libpmem through cffi in ABI mode: no compiler, `dlopen("libpmem.so.1")` at
first use.  libpmem is optional: `load("auto")` returns None when it is absent
(or switched off with CONCORDIA_LIBPMEM=off), and the tiers then map with mmap
and persist with msync.  `load("require")` raises LibpmemUnavailableError.

libpmem reads PMEM_IS_PMEM_FORCE when it is loaded, so that variable must be in
the environment before the first `load` of the process.
"""

from __future__ import annotations

import os
import threading

from .errors import LibpmemUnavailableError

__all__ = ["Libpmem", "load", "available", "SONAME", "PMEM_FILE_CREATE", "PMEM_FILE_EXCL"]

SONAME = "libpmem.so.1"
ENV_SWITCH = "CONCORDIA_LIBPMEM"     # "off": behave as if libpmem were absent

PMEM_FILE_CREATE = 1 << 0
PMEM_FILE_EXCL = 1 << 1
PMEM_FILE_SPARSE = 1 << 2
PMEM_FILE_TMPFILE = 1 << 3

_CDEF = """
typedef unsigned int mode_t;
void *pmem_map_file(const char *path, size_t len, int flags, mode_t mode,
                    size_t *mapped_lenp, int *is_pmemp);
int pmem_unmap(void *addr, size_t len);
int pmem_is_pmem(const void *addr, size_t len);
void pmem_persist(const void *addr, size_t len);
int pmem_msync(const void *addr, size_t len);
void pmem_flush(const void *addr, size_t len);
void pmem_drain(void);
void *pmem_memcpy_nodrain(void *pmemdest, const void *src, size_t len);
const char *pmem_errormsg(void);
"""


class Libpmem:
    """The loaded library: thin, typed wrappers over the nine functions used.

    Addresses are Python ints; `map_file` returns a cdata pointer whose
    garbage collection unmaps (so a buffer built on it keeps the mapping alive).
    """

    def __init__(self, soname: str):
        import cffi

        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        self.lib = self.ffi.dlopen(soname)   # OSError when absent
        self.soname = soname

    def errormsg(self) -> str:
        msg = self.lib.pmem_errormsg()
        return self.ffi.string(msg).decode(errors="replace") if msg != self.ffi.NULL else ""

    def map_file(self, path: str, length: int = 0, flags: int = 0, mode: int = 0o600):
        """pmem_map_file.  Returns (ptr, mapped_len, is_pmem); raises OSError(errno,
        libpmem's message) when libpmem refuses."""
        ffi, lib = self.ffi, self.lib
        mapped = ffi.new("size_t *")
        is_pmem = ffi.new("int *")
        ffi.errno = 0
        ptr = lib.pmem_map_file(os.fsencode(path), length, flags, mode, mapped, is_pmem)
        if ptr == ffi.NULL:
            err = ffi.errno or 5
            raise OSError(err, self.errormsg() or os.strerror(err), path)
        n = mapped[0]
        owned = ffi.gc(ptr, lambda p, n=n, unmap=lib.pmem_unmap: unmap(p, n), size=n)
        return owned, n, bool(is_pmem[0])

    def address(self, ptr) -> int:
        return int(self.ffi.cast("uintptr_t", ptr))

    def _p(self, addr: int):
        return self.ffi.cast("void *", addr)

    def is_pmem(self, addr: int, length: int) -> bool:
        return bool(self.lib.pmem_is_pmem(self._p(addr), length))

    def persist(self, addr: int, length: int) -> None:
        self.lib.pmem_persist(self._p(addr), length)

    def flush(self, addr: int, length: int) -> None:
        self.lib.pmem_flush(self._p(addr), length)

    def drain(self) -> None:
        self.lib.pmem_drain()

    def msync(self, addr: int, length: int) -> None:
        self.ffi.errno = 0
        if self.lib.pmem_msync(self._p(addr), length) != 0:
            err = self.ffi.errno or 5
            raise OSError(err, self.errormsg() or os.strerror(err))

    def memcpy_nodrain(self, dest_addr: int, src, length: int | None = None) -> None:
        """Copy `src` (bytes-like) to `dest_addr` with non-temporal stores where
        libpmem picks them; durable only after `drain()`."""
        buf = self.ffi.from_buffer(src)
        n = len(buf) if length is None else length
        self.lib.pmem_memcpy_nodrain(self._p(dest_addr), buf, n)


_lock = threading.Lock()
_loaded: dict[str, Libpmem | OSError] = {}


def _try(soname: str) -> Libpmem | OSError:
    with _lock:
        if soname not in _loaded:
            try:
                _loaded[soname] = Libpmem(soname)
            except OSError as exc:
                _loaded[soname] = exc
        return _loaded[soname]


def load(mode: str = "auto", where: str | None = None) -> Libpmem | None:
    """The process-wide libpmem, or None.

    mode "off": None.  "auto": None when absent or CONCORDIA_LIBPMEM=off.
    "require": raise LibpmemUnavailableError instead of returning None.
    """
    if mode == "off":
        return None
    if os.environ.get(ENV_SWITCH, "").lower() in ("off", "0", "no"):
        if mode == "require":
            raise LibpmemUnavailableError(f"libpmem switched off by {ENV_SWITCH}=off",
                                          where=where, hint=f"unset {ENV_SWITCH}")
        return None
    got = _try(SONAME)
    if isinstance(got, OSError):
        if mode == "require":
            raise LibpmemUnavailableError(f"{SONAME} cannot be loaded", where=where,
                                          hint="install it (Debian: apt-get install libpmem1) "
                                               "or use libpmem='auto'")
        return None
    return got


def available() -> bool:
    """True when libpmem loads in this process (and is not switched off)."""
    return load("auto") is not None
