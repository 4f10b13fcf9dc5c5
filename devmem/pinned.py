"""Pinned host memory from cudaHostAlloc (portable, mapped): the GPU reads and
writes it directly, and it outlives only the loss of a GPU, never the process.
CuPy is imported when such a backend is opened, not before."""

from __future__ import annotations

from .backend import Backend, Survives
from .errors import CudaUnavailableError
from .tiers import check_size

__all__ = ["PinnedBackend", "cupy_or_raise"]

HOST_ALLOC_PORTABLE = 0x01
HOST_ALLOC_MAPPED = 0x02


def cupy_or_raise(where: str):
    """CuPy, with at least one CUDA device, or CudaUnavailableError."""
    try:
        import cupy
    except Exception as exc:   # ImportError, or a CUDA library that fails to load
        raise CudaUnavailableError(f"CuPy cannot be imported ({type(exc).__name__})", where=where,
                                   hint="install the gpu extra (cupy-cuda13x) on a GPU machine") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise CudaUnavailableError(f"no usable CUDA device ({exc})", where=where) from None
    if count < 1:
        raise CudaUnavailableError("no CUDA device", where=where)
    return cupy


class PinnedBackend(Backend):
    """cudaHostAlloc(size, portable | mapped).  The allocation is freed when the
    backend is closed and no view of it remains."""

    kind = "pinned"
    survives = Survives.GPU_LOSS
    gpu_mappable = True
    ALIGNMENT = 4096

    def __init__(self, size: int):
        cupy = cupy_or_raise("pinned:")
        try:
            # cudaHostAlloc hands small sizes out of a pool, not always on a page
            # boundary: ask for a page more and start at the first boundary
            mem = cupy.cuda.PinnedMemory(size + self.ALIGNMENT, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        except Exception as exc:
            raise CudaUnavailableError(f"cudaHostAlloc of {size} bytes failed ({exc})",
                                       where="pinned:", hint="choose a smaller size") from None
        skip = -int(mem.ptr) % self.ALIGNMENT
        self._ptr = cupy.cuda.PinnedMemoryPointer(mem, skip)
        view = memoryview(self._ptr).cast("B")[:size]
        super().__init__(path=None, size=size, alignment=self.ALIGNMENT, view=view,
                         address=int(mem.ptr) + skip, persist_path="none")

    @classmethod
    def open(cls, size: int | None) -> "PinnedBackend":
        check_size(size, cls.ALIGNMENT, "pinned:", required=True)
        return cls(size)

    def _persist(self, offset, length):
        pass   # nothing to order: host memory the GPU sees coherently

    def _release(self):
        self._ptr = None   # freed with the last view
