"""Host side of the hooks: the pause gate in mapped pinned memory, the epoch
counters, and the store tracker's region table and dirty-page bitmaps.

Everything here talks to a loaded module through its `.visible .global`
variables (names and layouts in `concordia.instrument.rewrite`), so kernel
signatures never change.  CuPy is imported lazily.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

# Not `from concordia.instrument import rewrite`: the package re-exports the
# function `rewrite` under that name, which hides the module.
from concordia.instrument.rewrite import EPOCHS, GATE, NREGIONS, REGION_WORDS, REGIONS, RewriteResult
from concordia.instrument.errors import InstrumentError

_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped


def _cupy():
    try:
        import cupy
    except Exception as exc:
        raise InstrumentError(f"CuPy is not importable ({type(exc).__name__}: {exc})",
                              hint="the hooks need a CUDA device and CuPy") from None
    return cupy


def module_global(module, name: str, count: int, dtype):
    """A CuPy array viewing the module variable `name` (count x dtype)."""
    cupy = _cupy()
    try:
        ptr = int(module.get_global_var(name))
    except Exception as exc:
        raise InstrumentError(f"module has no variable {name} ({exc})",
                              hint="was the module instrumented?") from None
    nbytes = count * np.dtype(dtype).itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, module)
    return cupy.ndarray((count,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


class Gate:
    """Two u32 words in mapped pinned host memory: word 0 is written by the host
    (non-zero = hold kernels at their exit), word 1 is set to 1 by a kernel that
    reached the closed gate.  One writer per word, so no CPU-GPU atomics."""

    def __init__(self):
        cupy = _cupy()
        self._rt = cupy.cuda.runtime
        self._host = self._rt.hostAlloc(8, _HOST_ALLOC_MAPPED)
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * 2).from_address(self._host))
        self.words[:] = 0
        # CuPy 14 does not wrap cudaHostGetDevicePointer; under unified
        # addressing mapped host memory has the same address on the device.
        get = getattr(self._rt, "hostGetDevicePointer", None)
        self.device_ptr = int(get(self._host, 0)) if get is not None else int(self._host)

    def close(self) -> None:
        """Hold every instrumented launch that completes from now on."""
        self.words[1] = 0
        self.words[0] = 1

    def open(self) -> None:
        self.words[0] = 0

    @property
    def closed(self) -> bool:
        return bool(self.words[0])

    @property
    def arrived(self) -> bool:
        """A launch is waiting (or waited) at the gate since it was last closed."""
        return bool(self.words[1])

    def free(self) -> None:
        if self._host:
            self.words[0] = 0
            self._rt.freeHost(self._host)
            self._host = 0


@dataclass
class TrackedRegion:
    """A device range whose pages the store tracker marks.  `bitmap` is a CuPy
    uint32 array, bit p%32 of word p//32 = page p written since `clear()`."""

    name: str
    base: int
    nbytes: int
    page_bytes: int
    bitmap: object

    @property
    def pages(self) -> int:
        return -(-self.nbytes // self.page_bytes)

    def clear(self) -> None:
        self.bitmap.fill(0)

    def dirty_pages(self) -> np.ndarray:
        words = self.bitmap.get().astype("<u4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.pages]
        return np.flatnonzero(bits).astype(np.int64)

    def row(self) -> list[int]:
        return [self.base, self.nbytes, int(self.bitmap.data.ptr), self.page_bytes]


def track_array(name: str, array, page_bytes: int) -> TrackedRegion:
    """Register a CuPy array's bytes for store tracking in pages of `page_bytes`."""
    cupy = _cupy()
    if page_bytes <= 0:
        raise InstrumentError(f"page_bytes {page_bytes} must be positive", where=name)
    nbytes = int(array.nbytes)
    pages = -(-nbytes // page_bytes)
    bitmap = cupy.zeros(max(1, -(-pages // 32)), dtype=cupy.uint32)
    return TrackedRegion(name, int(array.data.ptr), nbytes, int(page_bytes), bitmap)


def region_table(regions: list[TrackedRegion], max_regions: int) -> np.ndarray:
    if len(regions) > max_regions:
        raise InstrumentError(f"{len(regions)} tracked regions, at most {max_regions}",
                              hint="raise Options.max_regions before enable()")
    table = np.zeros(REGION_WORDS * max_regions, dtype=np.uint64)
    for i, reg in enumerate(regions):
        table[REGION_WORDS * i : REGION_WORDS * (i + 1)] = reg.row()
    return table


def attach(module, result: RewriteResult, gate: Gate | None,
           regions: list[TrackedRegion] | None = None) -> None:
    """Point a loaded instrumented module at `gate` (None = no gate) and, when it
    tracks stores, at `regions`."""
    g = module_global(module, GATE, 1, np.uint64)
    g.set(np.array([gate.device_ptr if gate else 0], dtype=np.uint64))
    if result.options.track_stores:
        table = region_table(regions or [], result.options.max_regions)
        module_global(module, REGIONS, table.size, np.uint64).set(table)
        module_global(module, NREGIONS, 1, np.uint32).set(
            np.array([len(regions or [])], dtype=np.uint32))


def epochs(module, result: RewriteResult, stream=None) -> dict[str, int]:
    """Completed launches per kernel of a loaded instrumented module.  Pass a
    non-blocking stream to read while a launch is held at the gate."""
    n = len(result.kernels) + 1
    arr = module_global(module, EPOCHS, n, np.uint64)
    host = arr.get(stream=stream) if stream is not None else arr.get()
    return {k.name: int(host[k.index]) for k in result.kernels}
