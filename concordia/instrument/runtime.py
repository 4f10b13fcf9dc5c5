"""Host side of the hooks: the pause gate in mapped pinned memory, the epoch
counters, and the store tracker's region table and dirty-page bitmaps.

Everything here talks to a loaded module through its `.visible .global`
variables (names and layouts in `concordia.instrument.rewriter`), so kernel
signatures never change.  CuPy is imported lazily.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from concordia.instrument.rewriter import (EPOCHS, GATE, GATE_STAMP_OFFSET, HOLD, HOLD_SLOTS, MARK,
                                          MIRROR_CLOSED, MIRROR_DETACHED, MIRROR_OPEN, NREGIONS,
                                          REGION_WORDS, REGIONS, SLOTS, RewriteResult)
from concordia.instrument.errors import InstrumentError

_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped
_H2D = 1                # cudaMemcpyHostToDevice


def require_cupy():
    try:
        import cupy
    except Exception as exc:
        raise InstrumentError(f"CuPy is not importable ({type(exc).__name__}: {exc})", where="concordia.instrument",
                              hint="the hooks need a CUDA device and CuPy") from None
    return cupy


def module_global(module, name: str, count: int, dtype):
    """A CuPy array viewing the module variable `name` (count x dtype)."""
    cupy = require_cupy()
    try:
        ptr = int(module.get_global_var(name))
    except Exception as exc:
        raise InstrumentError(f"module has no variable {name} ({exc})", where=name,
                              hint="was the module instrumented?") from None
    nbytes = count * np.dtype(dtype).itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, module)
    return cupy.ndarray((count,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


_MIRROR_WORD = {MIRROR_CLOSED: 2, MIRROR_OPEN: 3, MIRROR_DETACHED: 4}   # gate word holding each value
_SLOT_BYTES = 16 * HOLD_SLOTS

# The gate's stamp: one thread writes its launch's %gridid into the gate.  The
# reserved register prefix makes both rewriters (CuPy's hook and the shim's)
# leave this module alone.
_STAMP_PTX = f"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry {MARK}stamp(.param .u64 {MARK}stamp_to)
{{
	.reg .b64 %__cnc_s<2>;
	ld.param.u64 %__cnc_s0, [{MARK}stamp_to];
	mov.u64 %__cnc_s1, %gridid;
	st.volatile.global.u64 [%__cnc_s0], %__cnc_s1;
	ret;
}}
"""


class Gate:
    """Words in mapped pinned host memory: word 0 is written by the host
    (non-zero = hold kernels at their exit), word 1 is set to 1 by a kernel held
    at the gate, words 2, 3 and 4 hold the mirror values closed, open and
    detached, copied into the `hold` mirror of attached modules, and words 6-7
    (byte 24) the `%gridid` of the stamp launch of the latest close().  One
    writer per word, so no CPU-GPU atomics.

    Threads count themselves only while the gate is closed (the mirror says
    so at their entry), each launch into a slot of its own module chosen by
    its `%gridid`; open and detached cost the same, so a gate may stay attached.
    close() clears the slots of every attached module and sets their mirrors,
    waits for both, and only then launches the stamp: every launch submitted
    after it has a larger `%gridid` (grid ids follow submission order across
    streams; docs/results/gridid-probe.json) and starts after the mirrors were
    written, so all of its threads count.  Block 0's thread 0 of such a launch
    holds it.  A launch submitted before the stamp may have started before the
    mirrors changed (some threads counting, others not): it is never held."""

    def __init__(self):
        cupy = require_cupy()
        self._rt = cupy.cuda.runtime
        self._host = self._rt.hostAlloc(32, _HOST_ALLOC_MAPPED)
        self.words = np.ctypeslib.as_array((ctypes.c_uint32 * 8).from_address(self._host))
        self.words[:] = (0, 0, MIRROR_CLOSED, MIRROR_OPEN, MIRROR_DETACHED, 0, 0, 0)
        # CuPy 14 does not wrap cudaHostGetDevicePointer; under unified
        # addressing mapped host memory has the same address on the device.
        get = getattr(self._rt, "hostGetDevicePointer", None)
        self.device_ptr = int(get(self._host, 0)) if get is not None else int(self._host)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._stamp_module = cupy.cuda.function.Module()
        self._stamp_module.load(_STAMP_PTX.encode())
        self._stamp = self._stamp_module.get_function(MARK + "stamp")
        self._mirrors: dict[int, int] = {}   # device address of a module's hold word -> of its slots

    def watch(self, hold_ptr: int, slots_ptr: int) -> None:
        """Keep the hold word at `hold_ptr` equal to this gate's state; clear
        the hold slots at `slots_ptr` now and whenever the gate closes."""
        self._mirrors[hold_ptr] = slots_ptr
        self._set_mirrors([hold_ptr], MIRROR_CLOSED if self.closed else MIRROR_OPEN, clear_slots=True)

    def unwatch(self, hold_ptr: int) -> None:
        if self._mirrors.pop(hold_ptr, None) is not None:
            self._set_mirrors([hold_ptr], MIRROR_DETACHED)

    def _set_mirrors(self, ptrs, value: int, clear_slots: bool = False) -> None:
        if not ptrs or not self._host:
            return
        src = self._host + 4 * _MIRROR_WORD[value]
        for ptr in ptrs:
            if clear_slots:
                self._rt.memsetAsync(self._mirrors[ptr], 0, _SLOT_BYTES, self._stream.ptr)
            self._rt.memcpyAsync(ptr, src, 4, _H2D, self._stream.ptr)
        self._stream.synchronize()

    def close(self) -> None:
        """Hold, at its exit, the first instrumented launch of each stream
        submitted from now on."""
        self.words[1] = 0
        self._set_mirrors(list(self._mirrors), MIRROR_CLOSED, clear_slots=True)
        self._stamp((1,), (1,), (np.uint64(self.device_ptr + GATE_STAMP_OFFSET),), stream=self._stream)
        self._stream.synchronize()
        self.words[0] = 1

    def open(self) -> None:
        """Release a held launch; a launch whose holder still waits for its
        threads leaves without reporting arrival."""
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

    @property
    def stamp(self) -> int:
        """The `%gridid` of the latest close()'s stamp launch (0 before any)."""
        return int(self.words[6]) | int(self.words[7]) << 32

    def free(self) -> None:
        if self._host:
            self.open()
            self._mirrors.clear()
            self._rt.freeHost(self._host)
            self._host = 0


_watched: dict[int, Gate] = {}   # hold word address -> the gate that keeps it


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
        """Sorted ids of the marked pages.  Only the non-zero words are
        unpacked: unpacking every bit of an 8 GiB region's 2 M pages took
        4.8 ms, finding its non-zero words 0.2 ms."""
        return bitmap_pages(self.bitmap.get(), self.pages)

    def row(self) -> list[int]:
        return [self.base, self.nbytes, int(self.bitmap.data.ptr), self.page_bytes]


def bitmap_pages(words: np.ndarray, pages: int) -> np.ndarray:
    """Sorted int64 ids of the set bits of a little-endian u32 bitmap (bit p%32
    of word p//32 = page p), below `pages`."""
    words = np.ascontiguousarray(words, dtype="<u4")
    nz = np.flatnonzero(words)
    if nz.size == 0:
        return np.zeros(0, np.int64)
    bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(nz.size, 32)
    row, col = np.nonzero(bits)
    ids = nz[row].astype(np.int64) * 32 + col
    return ids[ids < pages]


def track_array(name: str, array, page_bytes: int) -> TrackedRegion:
    """Register a CuPy array's bytes for store tracking in pages of `page_bytes`."""
    cupy = require_cupy()
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
    tracks stores, at `regions`.  Safe while its kernels run: attached-open and
    detached count nothing, so a launch in flight cannot tell them apart.
    Attach before closing the gate: a launch in flight when a closed gate is
    attached may hold and never see its threads counted (its holder then
    leaves when the gate opens, without reporting arrival)."""
    hold = module_global(module, HOLD, 1, np.uint32)
    hold_ptr = int(hold.data.ptr)
    old = _watched.get(hold_ptr)
    # attached to this gate already (the call changes regions only): leave the
    # gate alone, since watching again would clear the slots of a held launch
    if gate is None or old is not gate:
        _watched.pop(hold_ptr, None)
        if old is not None:
            old.unwatch(hold_ptr)
        if gate is None:
            hold.set(np.zeros(1, dtype=np.uint32))
        module_global(module, GATE, 1, np.uint64).set(np.array([gate.device_ptr if gate else 0], dtype=np.uint64))
        if gate is not None:
            slots = module_global(module, SLOTS, 2 * HOLD_SLOTS, np.uint64)
            gate.watch(hold_ptr, int(slots.data.ptr))
            _watched[hold_ptr] = gate
    if result.options.track_stores:
        table = region_table(regions or [], result.options.max_regions)
        module_global(module, REGIONS, table.size, np.uint64).set(table)
        module_global(module, NREGIONS, 1, np.uint32).set(
            np.array([len(regions or [])], dtype=np.uint32))


def epochs(module, result: RewriteResult, stream=None) -> dict[str, int]:
    """Launches per kernel of a loaded instrumented module, each counted by its
    block 0's thread 0 as it leaves (as it starts in a module where a `.func`
    calls `exit`).  Completed launches once the module's streams have been
    synchronised; while a launch is held at the gate, its holder has counted
    it and every other thread of it has left.  Pass a non-blocking stream to
    read while a launch is held."""
    n = len(result.kernels)
    counted = module_global(module, EPOCHS, n, np.uint64)
    values = counted.get(stream=stream) if stream is not None else counted.get()
    return {k.name: int(values[k.index]) for k in result.kernels}
