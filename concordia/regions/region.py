"""One protected array and its checkpoint state (`Region`).

A region is a C-contiguous array (numpy, CuPy, or a PyTorch tensor seen
through DLPack, `concordia.regions.arrays`) cut into pages of `page_bytes`.
A `Region` holds what the checkpoint pipeline keeps between epochs: the
baseline (the page CRC table of the last committed epoch and its digest,
changed only by `concordia.regions.registry.RegionSet`) and the state of its
dirty-page detector (shadow copy, fingerprints, block tables, slot versions,
store-tracker bitmap; run by `concordia.checkpoint.detect`):

    kv        block-table scanner when the caller gives block tables and
              sequence lengths, else shadow diff
    adapter   slot-version scanner when the caller gives slot versions,
              else shadow diff
    scheduler, opaque   shadow diff
    any kind  `detect="stores"`: the pages the PTX store tracker marked
              (`concordia.instrument`, device arrays only), cross-checked by
              fingerprints every `check_every` checkpoints
    any kind  `detect="positions"`: a static KV cache [..., max_len, row]
              whose caller says how many positions hold data (`length=`):
              the pages of the positions added since the last checkpoint
              (`PositionGeometry`)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from concordia.regions.arrays import storage_change, storage_of, to_host
from concordia.regions.errors import RegionMismatchError, SessionError, ShapeChangedError
from concordia.wal import format as fmt

KINDS = ("kv", "adapter", "scheduler", "opaque")
DETECTORS = ("auto", "shadow", "fingerprint", "blocks", "versions", "stores", "positions", "all")

#: the detectors that run as a device kernel over the region (shadow diff,
#: fingerprints), writing one flag byte per page, once a base exists
FLAG_DETECTORS = ("shadow", "fingerprint")

#: fingerprint cross-checks of the detectors that take them, every N checkpoints
#: when `register` is given none (0: never): the store tracker misses writes by
#: kernels it does not instrument; a positions region is written where its
#: caller says, so a check is asked for, not paid by default
CHECK_EVERY = {"stores": 8, "positions": 0}


@dataclasses.dataclass
class KvGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def of(cls, shape, itemsize: int, where: str) -> "KvGeometry":
        """[..., num_blocks, 2, block_size, kv_heads, head_dim] (PagedAttention)."""
        if len(shape) < 5 or shape[-4] != 2:
            raise ShapeChangedError(f"a KV region scanned by block tables must be shaped "
                                    f"[..., num_blocks, 2, block_size, kv_heads, head_dim], not "
                                    f"{list(shape)}", where=where)
        lead = int(np.prod(shape[:-5])) if len(shape) > 5 else 1
        return cls(lead, int(shape[-5]), int(shape[-3]), int(shape[-2]), int(shape[-1]), itemsize)


def position_page_bytes(row_bytes: int) -> int:
    """The page size a positions region logs best: one row (head_dim x
    itemsize, 256 bytes for a head of 128 bf16), or where a row is not a
    whole number of 64-byte units (the least page a log holds, FORMAT.md
    V-P1), the fewest rows that are.  A decode step writes one row per
    (batch, head): each page it logs costs 8 bytes beside its payload (its
    index and CRC words) and a record's header is shared, so row-sized pages
    write 1.03x the new tokens where 4 KiB pages write 16x
    (tests/checkpoint/test_positions_detector.py measures 256 to 4096)."""
    return math.lcm(int(row_bytes), 64)


#: a flat region holds each of its arrays at a multiple of this many bytes from its start (the batched
#: copy's 16-byte path and the page kernels' alignment): how protect() lays out a model's LoRA weights
FLAT_ALIGN = 256


def flat_layout(counts, itemsize: int) -> tuple[list[int], int]:
    """([each array's first element], elements in all) of arrays of `counts`
    elements of `itemsize` bytes held in order in one flat array, each at a
    multiple of FLAT_ALIGN bytes; the gaps are the elements past the sum."""
    align = max(1, FLAT_ALIGN // int(itemsize))
    offsets, total = [], 0
    for n in counts:
        offsets.append(total)
        total += -(-int(n) // align) * align
    return offsets, total


@dataclasses.dataclass(frozen=True)
class PositionGeometry:
    """A static cache seen by `detect="positions"`: [..., max_len, row], the
    leading dimensions folded into `rows` (batch x heads), each a run of
    `max_len` positions of `row_bytes` (head_dim x itemsize), cut into pages
    of `page_bytes`, which divides a row or is a whole number of rows."""

    rows: int
    max_len: int
    row_bytes: int
    page_bytes: int

    @classmethod
    def of(cls, shape, itemsize: int, page_bytes: int, where: str) -> "PositionGeometry":
        if len(shape) < 2:
            raise SessionError(f"a region whose pages follow its positions is shaped [..., max_len, row] "
                               f"(a static KV cache [batch, heads, max_len, head_dim]), not {list(shape)}",
                               where=where, hint="use detect='fingerprint' for this array")
        row = int(shape[-1]) * int(itemsize)
        if row % page_bytes and page_bytes % row:
            raise SessionError(f"page_bytes {page_bytes} neither divides a row of {row} bytes nor is a whole "
                               f"number of rows", where=where,
                               hint=f"pass page_bytes={position_page_bytes(row)} (one row, or the fewest rows "
                                    f"that make a multiple of 64 bytes)")
        return cls(math.prod(int(n) for n in shape[:-2]), int(shape[-2]), row, int(page_bytes))

    @functools.cached_property
    def span_pages(self) -> int | None:
        """Pages of one row's run of positions, where no page holds two runs (else None)."""
        span = self.max_len * self.row_bytes
        return None if span % self.page_bytes else span // self.page_bytes

    @functools.cached_property
    def row_first_pages(self) -> np.ndarray:
        """The first page of every row's run (uint32, as a column), where
        `span_pages` is whole: a checkpoint's pages are these plus one range."""
        return np.arange(0, self.rows * self.span_pages, self.span_pages, dtype=np.uint32)[:, None]


def read_length(source, max_len: int, where: str) -> int:
    """The length a positions region's `length=` hint says now: a callable
    returning it, or a one-element integer array or tensor the caller keeps
    current (numpy, CuPy or torch; a device one costs a read of the device).
    Refused in one line unless a whole number in [0, max_len]."""
    v = source() if callable(source) else source
    if type(v) is not int:
        if isinstance(v, (bool, np.bool_)) or not (isinstance(v, np.integer) or hasattr(v, "shape")):
            raise SessionError(f"the length hint gave {v!r}, not a whole number of positions", where=where,
                               hint="length= takes a callable returning an int, or a one-element integer array")
        if not isinstance(v, np.integer):
            a = to_host(v)
            if a.size != 1 or a.dtype.kind not in "iu":
                raise SessionError(f"the length hint is a {a.dtype} array of {a.size} elements, not one whole "
                                   f"number", where=where, hint="give one element of an integer dtype")
            v = a.reshape(-1)[0]
        v = int(v)
    if not 0 <= v <= max_len:
        raise SessionError(f"the length hint says {v} positions hold data; the region holds 0 to {max_len}",
                           where=where, hint="the length is the number of positions written, at most max_len")
    return v


def read_sequence(source, where: str):
    """The sequence id a positions region's `seq_ids=` hint says now (an int,
    or a copy of an integer array): a value the caller changes whenever the
    cache starts over, so that the region is logged whole however the length
    moved.  A callable returning it, or an integer array or tensor kept current."""
    v = source() if callable(source) else source
    if type(v) is int:
        return v
    if isinstance(v, np.integer):
        return int(v)
    a = to_host(v) if hasattr(v, "shape") and not isinstance(v, np.bool_) else None
    if a is None or a.dtype.kind not in "iu":
        raise SessionError(f"the sequence id hint gave {v!r}, not an integer or integer array", where=where,
                           hint="seq_ids= takes a callable returning an int, or an integer array kept current")
    return np.array(a).reshape(-1)


@dataclasses.dataclass
class Region:
    """One registered array and its checkpoint state."""

    name: str
    kind: str
    page_bytes: int
    array: object          # numpy or CuPy view of the caller's memory
    xp: object
    owner: object          # what the caller gave (checked for shape/storage changes)
    storage: tuple         # (shape, dtype, address) at registration
    detect: str            # "shadow" | "fingerprint" | "blocks" | "versions" | "stores" | "positions" | "all"
    hints: dict
    id: int | None = None  # region id in the log
    crcs: object = None                 # page CRCs of the last committed epoch (None: no base yet),
                                        # numpy, or CuPy when the region is staged on the device
    digest: int | None = None           # region digest of `crcs` (None: to be computed)
    shadow: object = None               # shadow copy (shadow detector)
    fps: object = None                  # fingerprints (fingerprint detector)
    kv_prev: dict | None = None         # block tables, lens, stamps, seq ids at the last checkpoint
    seen_versions: np.ndarray | None = None
    tracked: object = None              # instrument.TrackedRegion (store tracker's bitmap)
    check_every: int = 0                # stores, positions: a fingerprint cross-check every N checkpoints (0: never)
    since_check: int = 0                # stores, positions: checkpoints since the last cross-check
    tracked_since_check: object = None  # stores: pages the tracker marked since then (sorted uint32)
    missed_pages: int = 0               # stores, positions: pages the cross-checks found, the detector not
    length_prev: int = 0                # positions: the length (positions holding data) at the last checkpoint
    length_checked: int | None = 0      # positions: the length at the last cross-check (None: named whole since)
    seq_prev: object = None             # positions: the sequence id at the last checkpoint (seq_ids=)
    logical: str = ""                   # logical dtype name where the layout's does not say it ("bfloat16")
    framework: str = "array"            # "array" (numpy, CuPy) or "torch": what the caller registered
    stream: object = None               # the producer stream given at register (None: the framework's current)
    _flat: object = dataclasses.field(default=None, repr=False, compare=False)

    # the array is numpy's or CuPy's: its dtype is numpy's, its shape a tuple of ints, its nbytes an int
    @property
    def dtype(self) -> np.dtype:
        """The dtype of the byte layout (uint16 for bfloat16)."""
        return self.array.dtype

    @property
    def logical_dtype(self) -> str:
        """The name of the dtype the region holds ("bfloat16", "float32")."""
        return self.logical or fmt.dtype_name(self.array.dtype)

    @property
    def shape(self) -> tuple:
        return self.array.shape

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def pages(self) -> int:
        return -(-self.nbytes // self.page_bytes)

    @property
    def flat(self):
        """The array as flat bytes (made once: the array never changes storage,
        `check_unchanged` sees to that, and a CuPy view costs microseconds)."""
        f = self._flat
        if f is None:
            f = self._flat = self.array.reshape(-1).view("u1")
        return f

    @property
    def on_gpu(self) -> bool:
        return self.xp is not np

    @property
    def device_aligned(self) -> bool:
        """The page kernels read regions with 16-byte loads (the array's address is its flat view's: asked
        of it, no view is made)."""
        return not self.on_gpu or self.array.data.ptr % 16 == 0

    def check_unchanged(self) -> None:
        """Refuse (one line naming the region) an array or tensor freed,
        resized, reallocated or moved to another device since `register`."""
        why = storage_change(self.storage, storage_of(self.owner))
        if why is not None:
            raise ShapeChangedError(f"the registered array cannot be read: {why}",
                                    where=f"region {self.name!r}", hint="register a new region for the new array")

    def unchanged_view(self):
        """(layout view, xp, "tensor" or "array", logical dtype) of the registered
        object while its storage is as registered (a recover target checked
        without adapting it again: `restore.run.check_view`), else None."""
        if storage_change(self.storage, storage_of(self.owner)) is not None:
            return None
        owner = self.owner   # strides changed in place (a square tensor's t_()) are no storage change
        contiguous = (owner.is_contiguous() if self.framework == "torch" else
                      getattr(getattr(owner, "flags", None), "c_contiguous", False))   # no flags: check it afresh
        if not contiguous:
            return None
        return self.array, self.xp, "tensor" if self.framework == "torch" else "array", self.logical_dtype

    def track_stores(self, check_every: int) -> None:
        """Start the PTX store tracker on this region (detect="stores"),
        cross-checked by fingerprints every `check_every` checkpoints."""
        from concordia import instrument
        from concordia.instrument.errors import InstrumentError

        try:
            self.tracked = instrument.track(self.name, self.array, self.page_bytes)
        except InstrumentError as exc:
            raise SessionError(f"the store tracker cannot take this region: {exc.message}",
                               where=f"region {self.name!r}",
                               hint="call concordia.instrument.enable(track_stores=True) before the kernels "
                                    "that write the array are compiled") from None
        self.check_every = int(check_every)

    def untrack(self) -> None:
        """Stop the store tracker on this region (nothing when it has none)."""
        if self.tracked is not None:
            from concordia import instrument

            instrument.untrack(self.tracked)
            self.tracked = None

    @property
    def flags_detector(self) -> bool:
        """Whether the detector runs as a device kernel over the region (shadow
        diff, fingerprints) once a base exists (`checkpoint.detect.launch`)."""
        return self.detect in FLAG_DETECTORS


def resolve_detector(kind: str, detect: str, where: str, arr, xp, *, block_tables, seq_lens, block_stamp,
                     seq_ids, slot_versions, pages_per_slot, check_every, length=None,
                     page_bytes: int = 4096) -> tuple[str, dict]:
    """(detector, hints) of a region being registered: "auto" resolved (block
    tables for a kv region that gives them, else positions for one that gives
    its length, slot versions for an adapter that gives them, else the shadow
    diff), and what the detector reads checked.  hints["check_every"]: the
    cross-check period of the detectors that take one (None: CHECK_EVERY's)."""
    hints: dict = {}
    if detect == "auto":
        if kind == "kv" and block_tables is not None and seq_lens is not None:
            detect = "blocks"
        elif kind == "kv" and length is not None:
            detect = "positions"
        elif kind == "adapter" and slot_versions is not None:
            detect = "versions"
        else:
            detect = "shadow"
    if detect == "blocks":
        if block_tables is None or seq_lens is None:
            raise SessionError("the block-table scanner needs block_tables and seq_lens", where=where)
        hints.update(block_tables=block_tables, seq_lens=seq_lens, block_stamp=block_stamp,
                     seq_ids=seq_ids, geometry=KvGeometry.of(arr.shape, arr.dtype.itemsize, where))
    if detect == "versions":
        if slot_versions is None or not pages_per_slot:
            raise SessionError("the version scanner needs slot_versions and pages_per_slot", where=where)
        hints.update(slot_versions=slot_versions, pages_per_slot=int(pages_per_slot))
    if detect == "stores" and xp is np:
        raise SessionError("the store tracker sees writes by GPU kernels: detect='stores' needs a device array",
                           where=where, hint="use detect='shadow' or 'fingerprint' for a host array")
    if detect == "positions":
        if length is None:
            raise SessionError("the positions detector needs length= (the positions holding data now)",
                               where=where, hint="pass length=lambda: n, or a one-element array kept current")
        geometry = PositionGeometry.of(arr.shape, arr.dtype.itemsize, int(page_bytes), where)
        read_length(length, geometry.max_len, where)  # a hint that cannot be read is refused now
        if seq_ids is not None:
            read_sequence(seq_ids, where)
        hints.update(length=length, positions=geometry, seq_ids=seq_ids)
    if detect in CHECK_EVERY:
        if check_every is None:
            check_every = CHECK_EVERY[detect]
        if isinstance(check_every, bool) or not isinstance(check_every, (int, np.integer)) or check_every < 0:
            raise SessionError(f"check_every must be a whole number >= 0, not {check_every!r}", where=where)
        hints["check_every"] = int(check_every)
    return detect, hints


def check_same(info, r: Region) -> None:
    """A region already in the log must be the same region."""
    diffs = []
    if info.logical_dtype != r.logical_dtype or fmt.layout_dtype(info.dtype) != r.dtype:
        diffs.append(f"dtype {info.logical_dtype} vs {r.logical_dtype}")
    if tuple(info.shape) != r.shape:
        diffs.append(f"shape {list(info.shape)} vs {list(r.shape)}")
    if int(info.page_bytes) != r.page_bytes:
        diffs.append(f"page_bytes {info.page_bytes} vs {r.page_bytes}")
    if info.kind != r.kind:
        diffs.append(f"kind {info.kind} vs {r.kind}")
    if diffs:
        raise RegionMismatchError("the log already holds this region with other attributes (log vs array: "
                                  + "; ".join(diffs) + ")", where=f"region {r.name!r}",
                                  hint="use another log or another region name")
