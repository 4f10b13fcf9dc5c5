"""Arrays in and out: what Concordia accepts as a region and hands back.

A region is the bytes of a C-contiguous array: numpy, CuPy, or a PyTorch
tensor (a CUDA tensor seen by its address, `_cuda_view`; others through
DLPack), of any fixed-size dtype.  `adapt` takes what the
caller gives and returns the numpy or CuPy view of its bytes in their layout
(`layout_of`: a bfloat16 tensor is seen as uint16), `logical_of` says what it
holds, `storage_of` what must not change under it, and `present` turns
restored bytes back into what the region was registered as.
"""

from __future__ import annotations

import numpy as np

from concordia.regions.errors import UnsupportedArrayError
from concordia.wal import format as fmt

def cupy_module():
    """CuPy, or None where it is missing or cannot start (no CUDA)."""
    try:
        import cupy
    except Exception:  # ImportError or a broken CUDA install
        return None
    return cupy


def is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def is_torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def torch_module():
    """PyTorch, or None where it is not importable."""
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


def torch_numpy_dtype(name: str, where: str, itemsize: int, logged: str | None = None) -> np.dtype:
    """The numpy dtype that stands for PyTorch dtype `name` (its layout is
    what matters): numpy_dtype's answer, unless the log already holds this
    region with logical dtype `name` (`logged`).  The writer checked that
    name when it registered the region, so it is not checked again: the
    layout is numpy's own type of that name, else the unsigned integer of
    its width, and ml_dtypes (whose import costs a fresh recovering process
    seconds) is not loaded to say so.  Kept a dtype by `_torch_layout`."""
    if logged is None or name != logged:
        return numpy_dtype(name, where, itemsize)
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is not None and dt.name == name and dt.itemsize == itemsize and dt.type.__module__ == "numpy":
        return dt
    return np.dtype(f"<u{itemsize}" if itemsize > 1 else "|u1")


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
    torch = torch_module()
    tdt = getattr(torch, name, None) if torch is not None else None
    if not isinstance(tdt, getattr(torch, "dtype", ())) or (itemsize is not None and tdt.itemsize != itemsize):
        raise UnsupportedArrayError(f"logical dtype {name!r} has no PyTorch dtype in this build", where=where)
    return tdt


def adapt(obj, where: str, logged: str | None = None):
    """(array, xp, owner): the numpy or CuPy array sharing obj's memory, its
    array module, and the object whose shape and storage are checked later.
    The array holds the bytes in their layout (`layout_of`): a bfloat16 tensor
    or ml_dtypes array is seen as uint16, so the page kernels, the detectors
    and the host twins never meet a dtype numpy or CuPy lacks; `logical_of`
    says what it holds.  logged: the logical dtype the log holds the region
    as, when it does (`torch_numpy_dtype`)."""
    if isinstance(obj, np.ndarray):
        return _as_layout(obj, obj.dtype, where), np, obj
    if is_cupy(obj):
        return obj, cupy_module(), obj
    if is_torch(obj):
        _, dt, layout, _ = _torch_layout(obj, where, logged)
        if obj.is_conj() or obj.is_neg():
            raise UnsupportedArrayError("the tensor is a lazy conjugate or negative view (its bytes are not its "
                                        "values)", where=where, hint="pass t.resolve_conj().resolve_neg()")
        if not obj.is_contiguous():
            raise UnsupportedArrayError("the tensor is not contiguous", where=where,
                                        hint="protect the contiguous base tensor")
        if obj.is_cuda:
            xp = cupy_module()
            if xp is None:
                raise UnsupportedArrayError("a CUDA tensor needs CuPy to be protected or restored into",
                                            where=where, hint="install cupy-cuda13x (extra 'gpu')")
        elif obj.device.type == "cpu":
            xp = np
        else:
            raise UnsupportedArrayError(f"tensors on {obj.device} cannot be protected (cpu or cuda only)",
                                        where=where)
        torch = torch_module()
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                if xp is not np and obj.numel() and obj.data_ptr():
                    return _cuda_view(xp, obj, layout), xp, obj
                if xp is np and obj.numel() and obj.data_ptr() and _HOST_VIEWS:
                    return np.asarray(_HostBytes(obj, layout)), xp, obj
            # an empty tensor, or a subclass (a wrapper without storage of its own: DLPack says)
            raw = xp.from_dlpack(obj.detach().reshape(-1).view(torch.uint8))
        except Exception as exc:
            raise UnsupportedArrayError(f"tensor cannot be shared through DLPack: {exc}", where=where) from None
        return raw.view(layout).reshape(tuple(obj.shape)), xp, obj
    if hasattr(obj, "__dlpack__"):
        for mod in (np, cupy_module()):
            if mod is None:
                continue
            try:
                return mod.from_dlpack(obj), mod, obj
            except Exception:
                continue
    raise UnsupportedArrayError(f"cannot protect a {type(obj).__module__}.{type(obj).__name__}; "
                                "give a numpy or CuPy array or a DLPack tensor", where=where)


#: a CPU tensor is seen by its address (`_HostBytes`); False: through a DLPack export, as before (its
#: cost, 10 to 20 microseconds a tensor, was most of a CPU model's registration)
_HOST_VIEWS = True


class _HostBytes:
    """CPU tensor `t`'s bytes as numpy takes them (`__array_interface__`: its
    address, shape, layout and byte strides, None where contiguous), holding `t` and
    its storage for the array made from it.  Not `Tensor.numpy()`: that
    marks the storage as never to be resized, and a registered tensor's
    storage may be (resized or freed: a refusal to name, `storage_change`)."""

    def __init__(self, t, layout: np.dtype, strides: tuple | None = None):
        self.held = (t, t.untyped_storage())
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": layout.str, "strides": strides, "version": 3}


def _cuda_view(cp, t, layout: np.dtype):
    """A CuPy array of contiguous CUDA tensor `t`'s bytes in `layout`, made
    from its address and device: DLPack would ask PyTorch for its current
    stream and order two streams (0.05 ms a tensor, most of a registration),
    where making a view reads nothing (checkpoints, recoveries and adoptions
    order their reads against the producer streams: `StreamOrder`).  The
    view holds `t` and its storage (a tensor given new storage since leaves
    the old one alive under the view until the region is refused)."""
    nbytes = t.numel() * t.element_size()
    mem = cp.cuda.UnownedMemory(t.data_ptr(), nbytes, (t, t.untyped_storage()), t.device.index)
    return cp.ndarray(tuple(t.shape), dtype=layout, memptr=cp.cuda.MemoryPointer(mem, 0))


def _as_layout(a, dt: np.dtype, where: str):
    if dt.hasobject or dt.fields is not None or dt.kind not in "biufcV" or dt.subdtype is not None:
        raise UnsupportedArrayError(f"dtype {dt} cannot be logged (a fixed-size numeric dtype is needed)",
                                    where=where)
    lay = np.dtype(layout_of(dt))
    if lay == dt:
        return a
    numpy_dtype(dt.name, where, dt.itemsize)  # a void or a structure is not a dtype we can name
    return a.view(lay) if a.ndim else a.reshape(1).view(lay).reshape(())


def logical_of(obj, logged: str | None = None) -> tuple[str, str]:
    """(logical dtype name, framework) of an object `adapt` took: the name
    is "" where the layout's numpy name says it (FORMAT.md §7)."""
    if is_torch(obj):
        return _torch_layout(obj, "", logged)[3], "torch"
    return logical_name(np.dtype(obj.dtype)), "array"


def _torch_layout(t, where: str, logged: str | None) -> tuple:
    """(name, numpy dtype, layout dtype, logical name recorded) of tensor `t`'s
    dtype (`torch_numpy_dtype`, `layout_of`), worked out once a dtype: a
    model's regions share two or three, and numpy works a dtype's name out
    afresh each time.  Answers are kept, refusals are not."""
    key = (t.dtype, logged)
    got = _TORCH_LAYOUTS.get(key)
    if got is None:
        name = str(t.dtype).split(".", 1)[1]
        dt = torch_numpy_dtype(name, where, t.element_size(), logged)
        layout = np.dtype(layout_of(dt))
        got = (name, dt, layout, "" if fmt.dtype_name(layout.str) == name else name)
        if logged is None or logged == name:   # (another logged name is a refusal to come: not kept)
            _TORCH_LAYOUTS[key] = got
    return got


_TORCH_LAYOUTS: dict = {}


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
    torch = torch_module() if info.framework == "torch" else None
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
    """(shape, dtype, data address, device, storage bytes): what must not
    change under a registered region.  A tensor's dtype and device are
    PyTorch's objects (equal exactly when their names are, and printed as
    them), not their names: a name is a string made afresh at each call, a
    few microseconds a region at every registration and recovery."""
    if is_torch(owner):
        try:
            held = owner.untyped_storage().nbytes()
        except Exception:  # a tensor without storage (a tensor subclass, say)
            held = -1
        return tuple(owner.shape), owner.dtype, owner.data_ptr(), owner.device, held
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
    such as a block table copied from the device, or seen where it is on the
    CPU).  A CPU tensor is seen by its address (`_HostBytes`), not
    `Tensor.numpy()`, which would mark the caller's storage as never to be
    resized: a hint tensor read at every checkpoint is the caller's."""
    if isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        t = a.detach()
        if t.device.type != "cpu":
            t = t.cpu()   # a copy of our own, seen as a CPU tensor is
        t = t.resolve_conj().resolve_neg()
        torch = torch_module()
        dt = _host_dtype(t.dtype, t.element_size())
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() and t.data_ptr():
            strides = tuple(s * t.element_size() for s in t.stride())
            return np.asarray(_HostBytes(t, dt, strides))
        if not t.numel():
            return np.empty(tuple(t.shape), dt)
        return t.clone().numpy()   # a subclass: a copy of our own
    return a.get()


def _host_dtype(tdt, itemsize: int) -> np.dtype:
    """The numpy dtype numpy's own conversion gives PyTorch dtype `tdt`, else
    (bfloat16, float8: none of numpy's) raw bytes of its width, which a hint
    reader refuses in one line; worked out once a dtype, without ml_dtypes
    (whose import costs a fresh recovering process seconds)."""
    got = _HOST_DTYPES.get(tdt)
    if got is None:
        torch = torch_module()
        try:
            got = torch.empty(0, dtype=tdt).numpy().dtype
        except TypeError:
            got = np.dtype(f"V{itemsize}")
        _HOST_DTYPES[tdt] = got
    return got


_HOST_DTYPES: dict = {}


def dtype_name(obj) -> str:
    """The logical dtype name of an array or tensor ("bfloat16", "float32")."""
    if is_torch(obj):
        return str(obj.dtype).split(".", 1)[1]
    return np.dtype(obj.dtype).name
