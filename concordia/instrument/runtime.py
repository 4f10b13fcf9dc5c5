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
from concordia.instrument.rewrite import (EPOCHS, EXITS, GATE, HOLD, MIRROR_CLOSED, MIRROR_DETACHED, MIRROR_OPEN,
                                          NREGIONS, REGION_WORDS, REGIONS,
                                          STRIPE_WORDS, STRIPES, TARGETS, RewriteResult)
from concordia.instrument.errors import InstrumentError

_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped
_H2D = 1                # cudaMemcpyHostToDevice


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


_MIRROR_WORD = {MIRROR_CLOSED: 2, MIRROR_OPEN: 3, MIRROR_DETACHED: 4}   # gate word holding each value


class Gate:
    """Words in mapped pinned host memory: word 0 is written by the host
    (non-zero = hold kernels at their exit), word 1 is set to 1 by a kernel held
    at the gate, words 2, 3 and 4 hold the mirror values closed, open and
    detached, copied into the `hold` mirror of attached modules.  One writer per
    word, so no CPU-GPU atomics.

    close() sets the mirrors first, with copies on a stream of its own that
    does not wait for running kernels, and the host word after them: a launch
    that starts after close() returns is held at its exit.  open() clears the
    host word first (held launches leave), then the mirrors.  While no gate is
    attached a module's threads are not counted at all; attach() changes that
    only with no launch in flight (see `attach`)."""

    def __init__(self):
        cupy = _cupy()
        self._rt = cupy.cuda.runtime
        self._host = self._rt.hostAlloc(32, _HOST_ALLOC_MAPPED)
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * 8).from_address(self._host))
        self.words[:] = (0, 0, MIRROR_CLOSED, MIRROR_OPEN, MIRROR_DETACHED, 0, 0, 0)
        # CuPy 14 does not wrap cudaHostGetDevicePointer; under unified
        # addressing mapped host memory has the same address on the device.
        get = getattr(self._rt, "hostGetDevicePointer", None)
        self.device_ptr = int(get(self._host, 0)) if get is not None else int(self._host)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._mirrors: dict[int, object] = {}   # device address of a module's hold word -> module

    def watch(self, hold_ptr: int, module) -> None:
        """Keep the hold word at `hold_ptr` equal to this gate's state."""
        self._mirrors[hold_ptr] = module
        self._set_mirrors([hold_ptr], MIRROR_CLOSED if self.closed else MIRROR_OPEN)

    def unwatch(self, hold_ptr: int) -> None:
        if self._mirrors.pop(hold_ptr, None) is not None:
            self._set_mirrors([hold_ptr], MIRROR_DETACHED)

    def _set_mirrors(self, ptrs, value: int) -> None:
        if not ptrs or not self._host:
            return
        src = self._host + 4 * _MIRROR_WORD[value]
        for ptr in ptrs:
            self._rt.memcpyAsync(ptr, src, 4, _H2D, self._stream.ptr)
        self._stream.synchronize()

    def close(self) -> None:
        """Hold every instrumented launch that starts from now on, at its exit."""
        self.words[1] = 0
        self._set_mirrors(list(self._mirrors), MIRROR_CLOSED)
        self.words[0] = 1

    def open(self) -> None:
        self.words[0] = 0
        self._set_mirrors(list(self._mirrors), MIRROR_OPEN)

    @property
    def closed(self) -> bool:
        return bool(self.words[0])

    @property
    def arrived(self) -> bool:
        """A launch is held (or was) at the gate since it was last closed, and
        every thread of it but the holder has left."""
        return bool(self.words[1])

    def free(self) -> None:
        if self._host:
            self.open()
            self._mirrors.clear()
            self._rt.freeHost(self._host)
            self._host = 0


_watched: dict[int, Gate] = {}   # hold word address -> the gate that keeps it
_attached_once: set[int] = set()   # hold words of modules attached before (they may have launches in flight)


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
    tracks stores, at `regions`.  Threads are counted only while a gate is
    attached, and every thread of one launch must agree on that, so attaching
    or detaching a module that may have launches in flight first waits for the
    device (no launch may start meanwhile from another thread); a module just
    loaded has none and is attached at once."""
    g = module_global(module, GATE, 1, np.uint64)
    hold = module_global(module, HOLD, 1, np.uint32)
    hold_ptr = int(hold.data.ptr)
    old = _watched.pop(hold_ptr, None)
    if (old is None) != (gate is None) and hold_ptr in _attached_once:
        _cupy().cuda.Device().synchronize()
    _attached_once.add(hold_ptr)
    if old is not None and old is not gate:
        old.unwatch(hold_ptr)
    if gate is None:
        hold.set(np.zeros(1, dtype=np.uint32))
    g.set(np.array([gate.device_ptr if gate else 0], dtype=np.uint64))
    if gate is not None:
        gate.watch(hold_ptr, module)
        _watched[hold_ptr] = gate
    if result.options.track_stores:
        table = region_table(regions or [], result.options.max_regions)
        module_global(module, REGIONS, table.size, np.uint64).set(table)
        module_global(module, NREGIONS, 1, np.uint32).set(
            np.array([len(regions or [])], dtype=np.uint32))


def epochs(module, result: RewriteResult, stream=None) -> dict[str, int]:
    """Completed launches per kernel of a loaded instrumented module: launches
    counted (block 0's thread 0 counts its launch as it leaves), less one for a
    kernel whose latest counted launch still has threads running (see
    `concordia.instrument.rewrite`).  Exact when no launch of the
    module is in flight and while one is held at the gate; pass a non-blocking
    stream to read while a launch is held.  While no gate is attached to a
    module built with the gate, its threads are not counted, so a launch in
    flight counts once its block 0's thread 0 has left."""
    n = len(result.kernels)
    arrays = (module_global(module, EPOCHS, n, np.uint64), module_global(module, TARGETS, n, np.uint64),
              module_global(module, EXITS, STRIPES * STRIPE_WORDS, np.uint64))
    counted, targets, exits = (a.get(stream=stream) if stream is not None else a.get() for a in arrays)
    left = int(exits[::STRIPE_WORDS].sum())
    return {k.name: int(counted[k.index]) - int(counted[k.index] > 0 and int(targets[k.index]) > left)
            for k in result.kernels}
