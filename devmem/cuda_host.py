"""CUDA host registration of a backend's mapping, so GPU kernels write the log
directly (zero copy).  CuPy is imported on first use.

`register(backend)` pins the mapping with cudaHostRegister (mapped | portable),
in 4 KiB-aligned chunks no larger than `chunk_bytes` (huge device-DAX mappings
are pinned piecewise), and returns the device address of byte 0.  Tiers whose
mappings the kernel will not pin for long (pmem files on fsdax, page-cache
files) are refused up front with HostRegisterRefusedError, before CUDA is
touched: callers then write through a pinned staging ring.  `pinned` backends
are already mapped: only their device address is looked up.

A restore that pins the pieces of a mapping it reads (`restore.device`) keeps
them pinned with the mapping (`keep_pinned`): given back when the backend
closes, or by `register`, which needs the mapping whole.  Unpinning 10 GiB
took 0.09 s of a restore's 0.8 s; a later restore from the same mapping
finds its pieces pinned.
"""

from __future__ import annotations

import threading
import weakref

from .backend import Backend
from .errors import HostRegisterRefusedError
from .pinned import cupy_or_raise

__all__ = ["register", "pin", "unpin", "keep_pinned", "kept_pins", "release_kept", "HostRegistration", "CHUNK"]

HOST_REGISTER_PORTABLE = 0x01    # cudaHostRegister flags
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08
PAGE = 4096
CHUNK = 1 << 30


class HostRegistration:
    """A live registration: `device_ptr` is the device address of the backend's
    byte 0, valid for `nbytes` bytes until `unregister()` (also on context exit).
    It keeps the mapping alive while registered, even if the backend is closed."""

    def __init__(self, backend: Backend, device_ptr: int, nbytes: int, chunks, runtime):
        self.backend = backend
        self.device_ptr = int(device_ptr)
        self.nbytes = int(nbytes)
        self.chunks = list(chunks)          # [(host address, length)] registered by us
        self._runtime = runtime
        self._keep = memoryview(backend.view)

    @property
    def piece(self) -> int | None:
        """Bytes of each registered chunk but the last (they start at byte 0),
        or None for one chunk: a copy engine transfer reads within one chunk
        (cudaMemcpy's source lies in one registration), so a copy across a
        chunk end is split there."""
        return self.chunks[0][1] if len(self.chunks) > 1 else None

    @property
    def registered(self) -> bool:
        return self._keep is not None

    def unregister(self) -> None:
        """Unpin every chunk this registration pinned.  Idempotent."""
        if self._keep is None:
            return
        for addr, _ in reversed(self.chunks):
            unpin(addr)
        self.chunks = []
        self._keep.release()
        self._keep = None

    def as_cupy(self, dtype="uint8", count: int | None = None):
        """A CuPy array over the registered bytes (no copy; the GPU writes the log)."""
        import cupy

        itemsize = cupy.dtype(dtype).itemsize
        n = self.nbytes // itemsize if count is None else count
        mem = cupy.cuda.UnownedMemory(self.device_ptr, n * itemsize, self,
                                       device_id=cupy.cuda.runtime.getDevice())
        return cupy.ndarray((n,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unregister()

    def __repr__(self):
        return f"<HostRegistration {self.backend.where} dev={self.device_ptr:#x} {self.nbytes} bytes>"


def pin(addr: int, nbytes: int, *, read_only: bool = False, where: str = "host memory") -> None:
    """The one cudaHostRegister call of the project: [addr, addr + nbytes)
    pinned for every device (portable) and mapped into the device's address
    space, read-only when asked (a mapping opened read-only).  A refusal is
    HostRegisterRefusedError naming `where`; nothing stays registered."""
    rt = cupy_or_raise(where).cuda.runtime
    flags = HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
    try:
        rt.hostRegister(addr, nbytes, flags)
    except Exception as exc:   # cupy.cuda.runtime.CUDARuntimeError
        raise HostRegisterRefusedError(f"cudaHostRegister refused: {exc}", where=where,
                                       hint="write through a pinned staging ring") from None


def unpin(addr: int) -> None:
    """Undo `pin` of the range starting at `addr`; a range already gone with its
    context is left as it is."""
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(addr)
    except Exception:
        pass


_kept_lock = threading.Lock()


def keep_pinned(backend: Backend, addr: int, nbytes: int) -> None:
    """Keep [addr, addr + nbytes) of `backend`'s mapping, pinned by `pin`,
    pinned until the backend closes (or is collected unclosed), or
    `release_kept`.  A piece pinned after the backend closed is unpinned now."""
    with _kept_lock:
        given_back = backend.__dict__.get("_kept_given_back")
        if given_back is None and not backend.closed:
            kept = backend._kept_pins = {}
            # no reference back to the backend: an unclosed one is still collected, and unpins then
            given_back = backend._kept_given_back = weakref.finalize(backend, _unpin_all, kept)
            given_back.atexit = False   # a process's exit takes every pin with it
            backend.at_close(given_back)
        if given_back is not None and given_back.alive:   # not closing, nor closed
            backend._kept_pins[int(addr)] = int(nbytes)
            return
    unpin(addr)


def kept_pins(backend: Backend) -> dict:
    """{host address: bytes} of the pieces of `backend`'s mapping kept pinned."""
    with _kept_lock:
        return dict(backend.__dict__.get("_kept_pins") or {})


def release_kept(backend: Backend) -> None:
    """Unpin every piece `keep_pinned` kept for `backend`."""
    _unpin_all(backend.__dict__.get("_kept_pins") or {})


def _unpin_all(kept: dict) -> None:
    with _kept_lock:
        addrs = list(kept)
        kept.clear()
    for addr in addrs:
        unpin(addr)


def register(backend: Backend, chunk_bytes: int = CHUNK) -> HostRegistration:
    """Pin `backend`'s mapping for the current CUDA device and return its device
    address.  Raises HostRegisterRefusedError for tiers that cannot be pinned or
    when the driver refuses (nothing stays registered), CudaUnavailableError
    without CuPy or a device."""
    where = backend.where
    if not backend.gpu_mappable:
        raise HostRegisterRefusedError(
            f"{backend.kind} mappings cannot be pinned for the GPU", where=where,
            hint="write through a pinned staging ring, or put the log on shm:, dax: or pinned:")
    view = backend.view   # raises when closed
    if chunk_bytes <= 0 or chunk_bytes % PAGE:
        raise HostRegisterRefusedError(f"chunk size {chunk_bytes} is not a positive multiple of "
                                       f"{PAGE}", where=where)
    addr, size = backend.address, len(view)
    if addr % PAGE:
        raise HostRegisterRefusedError(f"mapping at {addr:#x} is not {PAGE}-byte aligned",
                                       where=where)
    cupy = cupy_or_raise(where)
    rt = cupy.cuda.runtime
    release_kept(backend)   # a restore's pieces: the mapping is pinned whole now
    if backend.kind == "pinned":
        return HostRegistration(backend, _device_pointer(rt, addr), size, [], rt)
    span = -(-size // PAGE) * PAGE         # the mapping covers whole pages
    done: list[tuple[int, int]] = []
    try:
        for off in range(0, span, chunk_bytes):
            n = min(chunk_bytes, span - off)
            pin(addr + off, n, where=where)
            done.append((addr + off, n))
        base = _device_pointer(rt, addr)
        for a, _ in done[1:]:
            if _device_pointer(rt, a) != base + (a - addr):
                raise HostRegisterRefusedError("chunks did not land at contiguous device "
                                               "addresses", where=where,
                                               hint="register with one chunk (chunk_bytes >= size)")
    except BaseException:
        for a, _ in reversed(done):
            unpin(a)
        raise
    return HostRegistration(backend, base, size, done, rt)


def _device_pointer(rt, host_addr: int) -> int:
    """Device address of mapped, registered host memory.  CuPy 14 does not wrap
    cudaHostGetDevicePointer; with unified addressing (every 64-bit Linux CUDA
    system) a mapped registration is reachable on the device at its host
    address, which is what that call would return."""
    get = getattr(rt, "hostGetDevicePointer", None)
    return int(get(host_addr, 0)) if get is not None else int(host_addr)
