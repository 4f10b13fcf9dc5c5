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


def _torch():
    try:
        import torch
    except Exception:
        return None
    return torch


# ----------------------------------------------------------------- dtypes
# A region is logged as bytes in a layout numpy names ("<f2", "<u2"); its
# logical dtype is recorded by name beside it (FORMAT.md §7.1).  Names are the
# ones numpy, ml_dtypes and PyTorch share ("bfloat16", "float8_e4m3fn",
# "complex64"): a name is resolved through numpy once ml_dtypes has registered
# its types, and through `getattr(torch, name)` for tensors, never a table.
def numpy_dtype(name: str, where: str, itemsize: int | None = None) -> np.dtype:
    """The numpy dtype (numpy's own or ml_dtypes') of logical dtype `name`;
    UnsupportedArrayError when this build cannot represent it."""
    import ml_dtypes  # noqa: F401  registers bfloat16, float8_*, int4, ... with numpy by name

    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if (dt is None or dt.name != name or dt.hasobject or dt.kind not in "biufcV" or dt.fields is not None
            or dt.subdtype is not None or (itemsize is not None and dt.itemsize != itemsize)):
        raise UnsupportedArrayError(f"logical dtype {name!r} cannot be represented by this build "
                                    "(neither numpy nor ml_dtypes has a fixed-size type of that name"
                                    + (f" and {itemsize} bytes" if itemsize is not None else "") + ")",
                                    where=where, hint="upgrade ml_dtypes, or restore the bytes in their layout")
    return dt


def layout_of(dt: np.dtype) -> str:
    """The numpy type string of `dt`'s byte layout: its own for numpy's
    numeric types, else the unsigned integer of its width (FORMAT.md §7.1)."""
    if dt.kind in "biufc" and dt.type.__module__ == "numpy":
        return dt.str
    return f"<u{dt.itemsize}" if dt.itemsize > 1 else "|u1"


def logical_name(dt: np.dtype) -> str:
    """The name recorded beside the layout: empty where numpy's name of the
    layout is the logical dtype itself (the 1.0 descriptor)."""
    return "" if np.dtype(layout_of(dt)) == dt else dt.name


def torch_dtype(name: str, where: str, itemsize: int | None = None):
    """PyTorch's dtype of logical dtype `name`."""
    torch = _torch()
    tdt = getattr(torch, name, None) if torch is not None else None
    if not isinstance(tdt, getattr(torch, "dtype", ())) or (itemsize is not None and tdt.itemsize != itemsize):
        raise UnsupportedArrayError(f"logical dtype {name!r} has no PyTorch dtype in this build", where=where)
    return tdt


def adapt(obj, where: str):
    """(array, xp, owner): the numpy or CuPy array sharing obj's memory, its
    array module, and the object whose shape and storage are checked later.
    The array holds the bytes in their layout (`layout_of`): a bfloat16 tensor
    or ml_dtypes array is seen as uint16, so the page kernels, the detectors
    and the host twins never meet a dtype numpy or CuPy lacks; `logical_of`
    says what it holds."""
    if isinstance(obj, np.ndarray):
        return _as_layout(obj, obj.dtype, where), np, obj
    if is_cupy(obj):
        return obj, _cupy(), obj
    if is_torch(obj):
        name = str(obj.dtype).split(".", 1)[1]
        dt = numpy_dtype(name, where, obj.element_size())
        if obj.is_conj() or obj.is_neg():
            raise UnsupportedArrayError("the tensor is a lazy conjugate or negative view (its bytes are not its "
                                        "values)", where=where, hint="pass t.resolve_conj().resolve_neg()")
        if not obj.is_contiguous():
            raise UnsupportedArrayError("the tensor is not contiguous", where=where,
                                        hint="protect the contiguous base tensor")
        if obj.is_cuda:
            xp = _cupy()
            if xp is None:
                raise UnsupportedArrayError("a CUDA tensor needs CuPy to be protected or restored into",
                                            where=where, hint="install cupy-cuda13x (extra 'gpu')")
        elif obj.device.type == "cpu":
            xp = np
        else:
            raise UnsupportedArrayError(f"tensors on {obj.device} cannot be protected (cpu or cuda only)",
                                        where=where)
        try:
            raw = xp.from_dlpack(obj.detach().reshape(-1).view(_torch().uint8))
        except Exception as exc:
            raise UnsupportedArrayError(f"tensor cannot be shared through DLPack: {exc}", where=where) from None
        return raw.view(layout_of(dt)).reshape(tuple(obj.shape)), xp, obj
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


def _as_layout(a, dt: np.dtype, where: str):
    if dt.hasobject or dt.fields is not None or dt.kind not in "biufcV" or dt.subdtype is not None:
        raise UnsupportedArrayError(f"dtype {dt} cannot be logged (a fixed-size numeric dtype is needed)",
                                    where=where)
    lay = np.dtype(layout_of(dt))
    if lay == dt:
        return a
    numpy_dtype(dt.name, where, dt.itemsize)  # a void or a structure is not a dtype we can name
    return a.view(lay) if a.ndim else a.reshape(1).view(lay).reshape(())


def logical_of(obj) -> tuple[str, str]:
    """(logical dtype name, framework) of an object `adapt` took: the name
    is "" where the layout's numpy name says it (FORMAT.md §7)."""
    if is_torch(obj):
        name = str(obj.dtype).split(".", 1)[1]
        return ("" if np.dtype(layout_of(numpy_dtype(name, ""))).name == name else name), "torch"
    return logical_name(np.dtype(obj.dtype)), "array"


def present(flat_or_array, info, *, device: bool, where: str):
    """The restored bytes of region `info` (an array of its layout dtype and
    shape, numpy or CuPy) as what the region was registered as: a PyTorch
    tensor of the logical dtype for framework "torch" when torch is importable
    (on the GPU when the bytes are), else a numpy array of the logical dtype
    (ml_dtypes for bfloat16 and float8), or a CuPy array (CuPy holds numpy's
    own dtypes only: a logical dtype it lacks is refused, naming the region)."""
    a = flat_or_array
    name = info.logical_dtype
    shape = tuple(info.shape)
    torch = _torch() if info.framework == "torch" else None
    if torch is not None:
        tdt = torch_dtype(name, where, np.dtype(info.dtype).itemsize)
        raw = a.reshape(-1).view(np.uint8)
        t = torch.from_dlpack(raw) if device else torch.from_numpy(raw)
        return t.view(tdt).reshape(shape)
    if not info.logical:  # the layout is the logical dtype (byte order included)
        return a
    dt = numpy_dtype(name, where, np.dtype(info.dtype).itemsize)
    if device:
        raise UnsupportedArrayError(f"CuPy has no {name} arrays: restore it as a PyTorch tensor or on the host",
                                    where=where)
    return a.reshape(-1).view(dt).reshape(shape)


def storage_of(owner) -> tuple:
    """(shape, dtype string, data address, device, storage bytes): what must
    not change under a registered region."""
    if is_torch(owner):
        try:
            held = owner.untyped_storage().nbytes()
        except Exception:  # a tensor without storage (a tensor subclass, say)
            held = -1
        return tuple(owner.shape), str(owner.dtype), owner.data_ptr(), str(owner.device), held
    if is_cupy(owner):
        return tuple(owner.shape), owner.dtype.str, owner.data.ptr, f"cuda:{owner.device.id}", int(owner.nbytes)
    return tuple(owner.shape), owner.dtype.str, owner.__array_interface__["data"][0], "cpu", int(owner.nbytes)


def storage_change(was: tuple, now: tuple) -> str | None:
    """How a registered object's storage changed, in words (None: it did not)."""
    if now == was:
        return None
    if now[4] != was[4] and now[4] < (was[4] if was[4] >= 0 else 1):
        return (f"its storage was freed or shrunk (now {now[4]} bytes, was {was[4]})")
    if now[3] != was[3]:
        return f"it moved from {was[3]} to {now[3]}"
    return (f"it changed since registration: was {was[1]}{list(was[0])} at 0x{was[2]:x}, "
            f"now {now[1]}{list(now[0])} at 0x{now[2]:x}")


def to_host(a) -> np.ndarray:
    """A host numpy array of `a` (numpy as it is, CuPy copied, a torch tensor
    such as a block table seen or copied through numpy)."""
    if isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        return a.detach().cpu().numpy()
    return a.get()


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
    logical: str = ""                   # logical dtype name where the layout's does not say it ("bfloat16")
    framework: str = "array"            # "array" (numpy, CuPy) or "torch": what the caller registered
    stream: object = None               # the producer stream given at register (None: the framework's current)
    _flat: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the byte layout (uint16 for bfloat16)."""
        return np.dtype(self.array.dtype)

    @property
    def logical_dtype(self) -> str:
        """The name of the dtype the region holds ("bfloat16", "float32")."""
        return self.logical or self.dtype.name

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
        """Refuse (one line naming the region) an array or tensor freed,
        resized, reallocated or moved to another device since `register`."""
        why = storage_change(self.storage, storage_of(self.owner))
        if why is not None:
            raise ShapeChangedError(f"the registered array cannot be read: {why}",
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


# ----------------------------------------------------------------- stream order
class StreamOrder:
    """The one place where Concordia's device work is ordered against the
    caller's CUDA streams, with events only (no device-wide synchronise, no
    host wait).

    The rule: a checkpoint captures every region as of the call in its
    producer's stream order, the producer stream being the `stream=` given to
    `checkpoint`, else the one given to `register`, else the framework's
    current stream at the call (PyTorch's current stream of the tensor's
    device for a torch tensor, CuPy's current stream for a CuPy array).  An
    event is recorded on each producer stream and Concordia's stream (CuPy's
    current stream, on which the checkpoint queues its device work) waits on
    it (`after_producers`); when the checkpoint is done, each producer stream
    waits on an event recorded on Concordia's stream (`before_later_work`), so
    work queued after the call cannot overtake what the checkpoint still
    reads.  PyTorch creates its streams non-blocking: without this, a write
    queued on a side stream is not ordered before work on any other stream.
    A recovery into device tensors is ordered the same way against each
    target's current stream: after the work queued there before the call,
    before the work queued after it."""

    def __init__(self, streams: list):
        self.streams = streams  # CuPy streams (views of the frameworks' own: _foreign_stream), each once

    @classmethod
    def of(cls, objs, stream=None) -> "StreamOrder":
        """The producer streams of `objs` ((owner, register-time stream) pairs
        of device arrays); `stream` overrides them all."""
        cp = _cupy()
        if cp is None:
            return cls([])
        out, seen, current = [], set(), {}
        for owner, given in objs:
            given = stream if stream is not None else given
            if given is None:  # the framework's current stream, looked up once per framework and device
                key = (type(owner).__module__.split(".")[0], str(getattr(owner, "device", "")))
                if key not in current:
                    current[key] = _as_cupy_stream(cp, None, owner)
                s = current[key]
            else:
                s = _as_cupy_stream(cp, given, owner)
            if s is not None and s.ptr not in seen:
                seen.add(s.ptr)
                out.append(s)
        return cls(out)

    @classmethod
    def for_checkpoint(cls, regions, stream=None) -> "StreamOrder":
        return cls.of([(r.owner, r.stream) for r in regions if r.on_gpu], stream)

    def after_producers(self, consumer=None) -> None:
        """Concordia's stream waits for what each producer stream holds now."""
        if not self.streams:
            return
        cp = _cupy()
        consumer = consumer or cp.cuda.get_current_stream()
        for s in self.streams:
            if s.ptr != consumer.ptr:
                dev = getattr(s, "device_id", -1)
                # an event is recorded on a stream of its own device
                with cp.cuda.Device(dev if dev is not None and dev >= 0 else cp.cuda.Device().id):
                    ev = s.record()
                consumer.wait_event(ev)

    def before_later_work(self, consumer=None) -> None:
        """Every producer stream waits for what Concordia's stream holds now."""
        if not self.streams:
            return
        cp = _cupy()
        consumer = consumer or cp.cuda.get_current_stream()
        ev = None
        for s in self.streams:
            if s.ptr != consumer.ptr:
                ev = ev or consumer.record()
                s.wait_event(ev)


def _as_cupy_stream(cp, s, owner):
    """A CuPy view of stream `s` (a CuPy stream, a torch.cuda.Stream, or a raw
    cudaStream_t), or of `owner`'s framework's current stream when s is None."""
    if s is None:
        if is_torch(owner):
            if not owner.is_cuda:
                return None
            torch = _torch()
            ts = torch.cuda.current_stream(owner.device)
            return _foreign_stream(cp, int(ts.cuda_stream), int(owner.device.index), ts)
        if is_cupy(owner):
            return cp.cuda.get_current_stream()
        return None
    legacy = getattr(cp.cuda, "ExternalStream", None)  # deprecated in CuPy 14, to go in 15
    if isinstance(s, cp.cuda.Stream) or (legacy is not None and isinstance(s, legacy)):
        return s
    if hasattr(s, "cuda_stream"):  # torch.cuda.Stream
        dev = getattr(s, "device", None)
        idx = getattr(dev, "index", None)
        return _foreign_stream(cp, int(s.cuda_stream), cp.cuda.Device().id if idx is None else int(idx), s)
    if isinstance(s, (int, np.integer)):
        return _foreign_stream(cp, int(s), -1)  # device unknown: used on the current one
    raise UnsupportedArrayError(f"stream {s!r} is neither a CuPy stream, a torch.cuda.Stream nor a cudaStream_t")


class _StreamHandle:
    """A cudaStream_t offered by the CUDA stream protocol, the one thing
    `cupy.cuda.Stream.from_external` takes; it holds the framework's stream
    object, so that the stream outlives the CuPy view of it."""

    __slots__ = ("ptr", "owner")

    def __init__(self, ptr: int, owner=None):
        self.ptr, self.owner = ptr, owner

    def __cuda_stream__(self):
        return (0, self.ptr)


_FOREIGN_CLASSES: dict = {}


def _foreign_stream(cp, ptr: int, device_id: int, owner=None):
    """A CuPy view of the stream `ptr` another framework owns, on device
    `device_id` (-1: unknown, used on the current device), that never destroys
    it: `cupy.cuda.Stream.from_external` where CuPy has it (14 on), else the
    `ExternalStream` of older CuPy.  from_external takes the device from the
    current one (the protocol names none): the device asked for is set after."""
    base = cp.cuda.Stream
    if not hasattr(base, "from_external"):
        return cp.cuda.ExternalStream(ptr, device_id)
    cls = _FOREIGN_CLASSES.get(base)
    if cls is None:
        class ForeignStream(base):
            """A view of a stream another framework owns: unlike a CuPy
            Stream, it destroys no handle when it goes (as ExternalStream)."""

            def __del__(self):
                pass

        cls = _FOREIGN_CLASSES[base] = ForeignStream
    view = cls.from_external(_StreamHandle(ptr, owner))
    view.device_id = device_id
    return view


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
