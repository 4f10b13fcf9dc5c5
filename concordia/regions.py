"""Registered regions: what the session knows about each protected array.

A region is a C-contiguous array (numpy, CuPy, or a PyTorch tensor seen through
DLPack) cut into pages of `page_bytes`.  This module adapts the array, keeps
the per-region checkpoint state (page CRC table of the last committed epoch,
the shadow copy or fingerprints a detector needs) and finds the dirty pages:

    kv        block-table scanner (`gpu_kernels.kv_dirty_blocks`) when the
              caller gives block tables and sequence lengths, else shadow diff
    adapter   slot-version scanner (`adapter_dirty_pages`) when the caller
              gives slot versions, else shadow diff
    scheduler, opaque   shadow diff
    any kind  `detect="stores"`: the pages the PTX store tracker marked
              (`concordia.instrument`, device arrays only), cross-checked by
              fingerprints every `check_every` checkpoints

Every detector runs on the array's own device: the numpy twins in
`gpu_kernels.reference` for host arrays, `gpu_kernels.gpu` for CuPy arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from concordia.errors import SessionError, ShapeChangedError, UnsupportedArrayError
from concordia.gpu_kernels import reference as ref

KINDS = ("kv", "adapter", "scheduler", "opaque")
DETECTORS = ("auto", "shadow", "fingerprint", "blocks", "versions", "stores", "all")


# ----------------------------------------------------------------- arrays
def _cupy():
    try:
        import cupy
    except Exception:  # ImportError or a broken CUDA install
        return None
    return cupy


def is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def is_torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def adapt(obj, where: str):
    """(array, xp, owner): the numpy or CuPy array sharing obj's memory, its
    array module, and the object whose shape and storage are checked later."""
    if isinstance(obj, np.ndarray):
        return obj, np, obj
    if is_cupy(obj):
        return obj, _cupy(), obj
    if is_torch(obj):
        if obj.is_cuda:
            cp = _cupy()
            if cp is None:
                raise UnsupportedArrayError("a CUDA tensor needs CuPy to be protected", where=where)
            try:
                return cp.from_dlpack(obj.detach()), cp, obj
            except Exception as exc:
                raise UnsupportedArrayError(f"tensor cannot be shared through DLPack: {exc}",
                                            where=where, hint="bfloat16 may be viewed as int16") from None
        try:
            return np.from_dlpack(obj.detach()), np, obj
        except Exception as exc:
            raise UnsupportedArrayError(f"tensor cannot be shared through DLPack: {exc}",
                                        where=where, hint="bfloat16 may be viewed as int16") from None
    if hasattr(obj, "__dlpack__"):
        for mod in (np, _cupy()):
            if mod is None:
                continue
            try:
                return mod.from_dlpack(obj), mod, obj
            except Exception:
                continue
    raise UnsupportedArrayError(f"cannot protect a {type(obj).__module__}.{type(obj).__name__}; "
                                "give a numpy or CuPy array or a DLPack tensor", where=where)


def storage_of(owner) -> tuple:
    """(shape, dtype string, data address): what must not change under a registered region."""
    if is_torch(owner):
        return tuple(owner.shape), str(owner.dtype), owner.data_ptr()
    if is_cupy(owner):
        return tuple(owner.shape), owner.dtype.str, owner.data.ptr
    return tuple(owner.shape), owner.dtype.str, owner.__array_interface__["data"][0]


def to_host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


# ----------------------------------------------------------------- kernels
class _Ops:
    """Dispatch of the page kernels to the numpy twins or the CuPy launchers."""

    def __init__(self, xp, aligned: bool = True):
        self.xp = xp
        self.gpu = None
        if xp is not np and aligned:  # the page kernels read with 16-byte loads
            try:
                from concordia.gpu_kernels import gpu

                self.gpu = gpu
            except ImportError:
                self.gpu = None

    def shadow_diff(self, flat, shadow, page_bytes, update):
        if self.xp is np:
            return ref.shadow_diff(flat, shadow, page_bytes=page_bytes, update=update)
        if self.gpu is not None:
            return to_host(self.gpu.shadow_diff(flat, shadow, page_bytes=page_bytes, update=update))
        return _cupy_shadow_diff(self.xp, flat, shadow, page_bytes, update)

    def fingerprint_dirty(self, flat, fps, page_bytes, update):
        if self.xp is np:
            return ref.fingerprint_dirty(flat, fps, page_bytes=page_bytes, update=update)
        if self.gpu is not None:
            return to_host(self.gpu.fingerprint_dirty(flat, fps, page_bytes=page_bytes, update=update))
        host = to_host(fps)
        d = ref.fingerprint_dirty(to_host(flat), host, page_bytes=page_bytes, update=update)
        if update:
            fps[...] = self.xp.asarray(host)
        return d

    def fingerprints(self, flat, page_bytes):
        if self.xp is np:
            return ref.fingerprint_pages(flat, page_bytes=page_bytes)
        if self.gpu is not None:
            return self.gpu.fingerprint_pages(flat, page_bytes=page_bytes)
        return self.xp.asarray(ref.fingerprint_pages(to_host(flat), page_bytes=page_bytes))


def _cupy_shadow_diff(cp, flat, shadow, pb, update):
    """CuPy expression of `reference.shadow_diff`, for device arrays the page
    kernels cannot read (not 16-byte aligned)."""
    full = flat.size // pb
    found = []
    if full:
        word = cp.uint64 if flat.data.ptr % 8 == 0 else cp.uint8  # no misaligned wide loads
        a = flat[:full * pb].view(word).reshape(full, -1)
        b = shadow[:full * pb].view(word).reshape(full, -1)
        d = cp.flatnonzero((a != b).any(axis=1))
        if d.size:
            if update:
                b[d] = a[d]
            found.append(d.get())
    if flat.size % pb:
        lo = full * pb
        if not bool((flat[lo:] == shadow[lo:]).all()):
            if update:
                shadow[lo:] = flat[lo:]
            found.append(np.array([full]))
    if not found:
        return np.zeros(0, np.uint32)
    return np.concatenate(found).astype(np.uint32)


# ----------------------------------------------------------------- regions
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
    detect: str            # "shadow" | "fingerprint" | "blocks" | "versions" | "stores" | "all"
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
    check_every: int = 0                # stores: fingerprint cross-check every N checkpoints (0: never)
    since_check: int = 0                # stores: checkpoints since the last cross-check
    tracked_since_check: object = None  # stores: pages the tracker marked since then (sorted uint32)
    missed_pages: int = 0               # stores: pages the cross-checks found that the tracker did not
    _flat: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def shape(self) -> tuple:
        return tuple(int(n) for n in self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

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
        """The page kernels read regions with 16-byte loads."""
        return not self.on_gpu or self.flat.data.ptr % 16 == 0

    def check_unchanged(self) -> None:
        now = storage_of(self.owner)
        if now != self.storage:
            was = self.storage
            raise ShapeChangedError(
                f"array changed since registration: was {was[1]}{list(was[0])} at 0x{was[2]:x}, "
                f"now {now[1]}{list(now[0])} at 0x{now[2]:x}",
                where=f"region {self.name!r}", hint="register a new region for the new array")

    # ------------------------------------------------------------- detection
    def reset_detectors(self) -> None:
        """The caller's array now equals the committed state: (re)arm every detector."""
        flat = self.flat
        if self.detect == "shadow":
            if self.shadow is None:
                self.shadow = self.xp.empty(self.nbytes, dtype=self.xp.uint8)
            self.shadow[...] = flat
        elif self.detect == "fingerprint":
            self.fps = _Ops(self.xp, self.device_aligned).fingerprints(flat, self.page_bytes)
        elif self.detect == "blocks":
            self.kv_prev = self._kv_now()
        elif self.detect == "versions":
            self.seen_versions = to_host(self.hints["slot_versions"]).copy()
        elif self.detect == "stores":
            self.tracked.clear()
            self.since_check = 0
            self.tracked_since_check = np.zeros(0, np.uint32)
            if self.check_every:
                self.fps = _Ops(self.xp, self.device_aligned).fingerprints(flat, self.page_bytes)

    def dirty_pages(self, *, advance: bool) -> np.ndarray:
        """Sorted uint32 ids of the pages changed since the last checkpoint.
        With `advance` the detector takes the current state as its new baseline
        (only when the pages found are about to be logged)."""
        if self.crcs is None or self.detect == "all":
            return np.arange(self.pages, dtype=np.uint32)
        ops = _Ops(self.xp, self.device_aligned)
        if self.detect == "shadow":
            # without `advance` the shadow is only compared, never copied: a
            # dirty-bytes policy measures at every step
            return ops.shadow_diff(self.flat, self.shadow, self.page_bytes, update=advance)
        if self.detect == "fingerprint":
            return ops.fingerprint_dirty(self.flat, self.fps, self.page_bytes, update=advance)
        if self.detect == "blocks":
            return self._kv_dirty(advance)
        if self.detect == "stores":
            return self._stores_dirty(advance)
        if self.detect == "versions":
            seen = self.seen_versions if advance else self.seen_versions.copy()
            return ref.adapter_dirty_pages(to_host(self.hints["slot_versions"]), seen,
                                           pages_per_slot=int(self.hints["pages_per_slot"]),
                                           num_pages=self.pages, advance=True)
        raise AssertionError(self.detect)

    def _stores_dirty(self, advance: bool) -> np.ndarray:
        """The pages the store tracker marked since the last checkpoint (the
        bitmap is cleared when advancing).  Every `check_every`-th advancing
        call also diffs the fingerprints taken at the previous cross-check:
        a page changed since then that the tracker never marked (a write by
        a kernel that is not instrumented, a copy, a kernel loaded before
        instrumentation) is added to this checkpoint and counted in
        `missed_pages`.  The bitmap is read, then cleared: like every detector,
        this assumes the caller's kernels that write the region have finished
        (a page marked in between would wait for the next cross-check)."""
        from concordia import instrument

        if not instrument.is_tracked(self.tracked):
            raise SessionError("the store tracker no longer tracks this region (instrumentation was disabled "
                               "or its regions replaced): its writes since then are not known",
                               where=f"region {self.name!r}",
                               hint="register the array again (a new region gets a base checkpoint)")
        ids = self.tracked.dirty_pages().astype(np.uint32)
        if not advance:
            return ids
        self.tracked.clear()
        if not self.check_every:
            return ids
        self.tracked_since_check = np.union1d(self.tracked_since_check, ids).astype(np.uint32)
        self.since_check += 1
        if self.since_check < self.check_every:
            return ids
        changed = _Ops(self.xp, self.device_aligned).fingerprint_dirty(self.flat, self.fps, self.page_bytes,
                                                                       update=True)
        missed = np.setdiff1d(changed, self.tracked_since_check).astype(np.uint32)
        self.missed_pages += int(missed.size)
        self.since_check = 0
        self.tracked_since_check = np.zeros(0, np.uint32)
        return np.union1d(ids, missed).astype(np.uint32)

    @property
    def flags_detector(self) -> bool:
        """Whether the detector runs as a device kernel over the region (shadow
        diff, fingerprints) once a base exists: `launch_detect` queues it."""
        return self.detect in ("shadow", "fingerprint")

    def launch_detect(self, kernels, flags, found=None) -> bool:
        """Queue this region's detector as a device kernel writing one flag byte
        per page into `flags`, advancing it as dirty_pages(advance=True) does
        (and listing the dirty pages into `found`, see gpu.launch_shadow_diff).
        False (nothing queued) when there is no base yet or the detector scans
        host-side tables (block tables, slot versions): use dirty_pages then."""
        if self.crcs is None or not self.flags_detector:
            return False
        if self.detect == "shadow":
            kernels.launch_shadow_diff(self.flat, self.shadow, flags, page_bytes=self.page_bytes, update=True,
                                       found=found)
        else:
            kernels.launch_fingerprint(self.flat, self.fps, flags, page_bytes=self.page_bytes, update=True,
                                       found=found)
        return True

    def _kv_now(self) -> dict:
        h = self.hints
        now = {"tables": to_host(h["block_tables"]).astype(np.int64),
               "lens": to_host(h["seq_lens"]).astype(np.int64)}
        if h.get("block_stamp") is not None:
            now["stamp"] = to_host(h["block_stamp"]).astype(np.int64)
        if h.get("seq_ids") is not None:
            now["ids"] = to_host(h["seq_ids"]).astype(np.int64)
        return now

    def _kv_dirty(self, advance: bool) -> np.ndarray:
        """New tokens of every sequence (kv_dirty_blocks), plus whole blocks
        whose write stamp rose while no sequence held them across the interval
        (blocks freed, or freed and handed on, since the last checkpoint)."""
        g: KvGeometry = self.hints["geometry"]
        prev, now = self.kv_prev, self._kv_now()
        same = (now["ids"] == prev["ids"]) if "ids" in now else (now["lens"] >= prev["lens"])
        ckpt_lens = np.where(same, prev["lens"], 0).astype(np.int32)
        ids = ref.kv_dirty_blocks(now["tables"].astype(np.int32), now["lens"].astype(np.int32), ckpt_lens,
                                  block_size=g.block_size, kv_heads=g.kv_heads, head_dim=g.head_dim,
                                  dtype_bytes=g.dtype_bytes, page_bytes=self.page_bytes,
                                  num_blocks=g.num_blocks, num_layers=g.num_layers, advance=False)
        if "stamp" in now:
            rose = now["stamp"] > prev["stamp"]
            # blocks one sequence held from the last checkpoint until now: only it wrote them
            held = np.zeros(g.num_blocks, bool)
            t_prev, t_now = prev["tables"], now["tables"]
            nblk = -(-np.asarray(prev["lens"], np.int64) // g.block_size)   # blocks held at the last checkpoint
            in_use = np.arange(t_now.shape[1])[None, :] < nblk[:, None]
            keep = np.asarray(same)[:, None] & in_use & (t_prev == t_now) & (t_now >= 0)
            held[t_now[keep]] = True
            whole = np.flatnonzero(rose & ~held)
            if whole.size:
                ids = np.union1d(ids, _kv_block_pages(g, whole, self.page_bytes)).astype(np.uint32)
        if advance:
            self.kv_prev = now
        return ids


def _kv_block_pages(g: KvGeometry, blocks: np.ndarray, pb: int) -> np.ndarray:
    """Every page of the given blocks, K and V, in every layer."""
    geo = ref.kv_layout(block_size=g.block_size, kv_heads=g.kv_heads, head_dim=g.head_dim,
                        dtype_bytes=g.dtype_bytes, num_blocks=g.num_blocks)
    lo = (np.arange(g.num_layers, dtype=np.int64)[:, None] * geo["layer"]
          + blocks.astype(np.int64)[None, :] * geo["block"]).ravel()
    first = lo // pb
    return np.unique(ref.expand_ranges(first, (lo + geo["block"] - 1) // pb - first + 1))


def gather_pages(region: Region, ids: np.ndarray) -> np.ndarray:
    """Host uint8 [len(ids), page_bytes] copy of the listed pages (last page zero-padded)."""
    pb, flat, xp = region.page_bytes, region.flat, region.xp
    full = region.nbytes // pb
    out = np.zeros((ids.size, pb), np.uint8)
    body = ids[ids < full]
    if body.size:
        rows = flat[:full * pb].reshape(full, pb)
        if xp is np:
            np.take(rows, body, axis=0, out=out[:body.size])
        else:
            out[:body.size] = xp.take(rows, xp.asarray(body.astype(np.int64)), axis=0).get()
    if body.size < ids.size:  # the short last page
        tail = flat[full * pb:]
        out[-1, :tail.size] = to_host(tail)
    return out
