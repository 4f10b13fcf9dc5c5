"""Stream order: the one place where Concordia's device work is ordered
against the caller's CUDA streams (`StreamOrder`), and CuPy views of the
streams other frameworks own (`foreign_stream`)."""

from __future__ import annotations

import numpy as np

from concordia.regions.arrays import cupy_module, is_cupy, is_torch, torch_module
from concordia.regions.errors import UnsupportedArrayError


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
        self.streams = streams  # CuPy streams (views of the frameworks' own: foreign_stream), each once

    @classmethod
    def of(cls, objs, stream=None) -> "StreamOrder":
        """The producer streams of `objs` ((owner, register-time stream) pairs
        of device arrays); `stream` overrides them all."""
        cp = cupy_module()
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
        cp = cupy_module()
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
        cp = cupy_module()
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
            torch = torch_module()
            ts = torch.cuda.current_stream(owner.device)
            return foreign_stream(cp, int(ts.cuda_stream), int(owner.device.index), ts)
        if is_cupy(owner):
            return cp.cuda.get_current_stream()
        return None
    legacy = getattr(cp.cuda, "ExternalStream", None)  # deprecated in CuPy 14, to go in 15
    if isinstance(s, cp.cuda.Stream) or (legacy is not None and isinstance(s, legacy)):
        return s
    if hasattr(s, "cuda_stream"):  # torch.cuda.Stream
        dev = getattr(s, "device", None)
        idx = getattr(dev, "index", None)
        return foreign_stream(cp, int(s.cuda_stream), cp.cuda.Device().id if idx is None else int(idx), s)
    if isinstance(s, (int, np.integer)):
        return foreign_stream(cp, int(s), -1)  # device unknown: used on the current one
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


def foreign_stream(cp, ptr: int, device_id: int, owner=None):
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
