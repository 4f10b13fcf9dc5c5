"""Stream order: the one place where Concordia's device work is ordered
against the caller's CUDA streams (`StreamOrder`), and CuPy views of the
streams other frameworks own (`foreign_stream`)."""

from __future__ import annotations

import numpy as np

from concordia.regions.arrays import cupy_module, is_cupy, is_torch, torch_module
from concordia.regions.errors import SessionError, UnsupportedArrayError


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
        """The producer streams of `objs` ((owner, register-time stream)
        pairs); `stream` overrides them all.  Host arrays and tensors have
        none: with no device one, the order is empty and CuPy not imported."""
        objs = [(o, s) for o, s in objs if s is not None or stream is not None or _on_device(o)]
        cp = cupy_module() if objs else None
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

    def verify(self) -> None:
        """Raise when the epoch's reads may not be one point of the producers'
        work; nothing to check where events order them (`HeldOrder`)."""

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


#: how long a hold keeps a producer stream, and Concordia's stream waits for
#: the holds, before each goes on (and the epoch is refused, `HeldOrder.verify`).
#: Bounds a stall as well: under CUDA's lazy loading (the default), a kernel's
#: first launch, by any thread, while a hold spins can wait for the hold
HOLD_TIMEOUT_S = 10.0


class Holds:
    """One consistent point in streams that another thread goes on queueing
    work on: a trigger's consumer takes its epochs while the caller queues
    steps, so the epoch's launches, queued on the caller's stream, would
    interleave with the caller's (stream order is a point only for what one
    thread queues).  `order(producers)` queues one hold on each producer
    stream, a one-thread kernel that stops it there (one launch: one point in
    its order), and makes Concordia's own stream (`stream`, non-blocking) wait
    on the device until every hold has arrived; the epoch queues its work on
    that stream, and `HeldOrder.release` lets the producers go on once all of
    it, retention's copies too, is queued.  A hold or a wait that takes longer
    than HOLD_TIMEOUT_S goes on and counts itself broken: the epoch's reads
    may have overlapped the producer's later writes, and `HeldOrder.verify`
    refuses its commit.  Streams of one device (the current one at creation).
    The point is one of the producer's stream, not of its steps: it may fall
    between two launches of one step (a step boundary needs a gate)."""

    def __init__(self):
        from concordia.gpu_kernels import gpu

        cp = cupy_module()
        self._gpu = gpu
        self.device_id = cp.cuda.Device().id
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._read = cp.cuda.Stream(non_blocking=True)
        self.seq = 0
        self.arrivals = 0
        # each kernel loaded and run once now: loading a module while a hold
        # keeps a stream can wait for that stream.  The words are zeroed on
        # this stream, before the kernels (a memory pool's block may hold an
        # older hold's words, and no stream waits for the caller's null stream)
        with self.stream:
            self.words = cp.zeros(3, cp.uint64)
            gpu.launch_hold(self.words, 0, 0)
            gpu.launch_await_holds(self.words, 1, 0)
            gpu.launch_release_holds(self.words, 0)
        self.stream.synchronize()
        self.arrivals = 1

    def broken(self) -> int:
        """How many holds and waits have timed out so far (read without waiting for queued work)."""
        with cupy_module().cuda.Device(self.device_id):
            got = self.words[2:3].get(stream=self._read)
            self._read.synchronize()
        return int(got[0])

    def order(self, producers) -> "HeldOrder":
        """Hold each of `producers` (CuPy streams or views, on this device) now."""
        seen, held = set(), []
        for s in producers:
            dev = getattr(s, "device_id", -1)
            if dev is not None and dev >= 0 and dev != self.device_id:
                raise UnsupportedArrayError(f"a hold keeps the streams of device {self.device_id}, "
                                            f"not stream {s.ptr:#x} of device {dev}")
            if s.ptr not in seen and s.ptr != self.stream.ptr:
                seen.add(s.ptr)
                held.append(s)
        self.seq += 1
        order = HeldOrder(self, self.seq, self.broken())
        timeout = int(HOLD_TIMEOUT_S * 1e9)
        try:
            with cupy_module().cuda.Device(self.device_id):
                for s in held:
                    with s:
                        self._gpu.launch_hold(self.words, self.seq, timeout)
                    self.arrivals += 1
                with self.stream:
                    self._gpu.launch_await_holds(self.words, self.arrivals, timeout)
        except BaseException:  # a hold queued is released, whatever failed
            order.release()
            raise
        return order


class HeldOrder(StreamOrder):
    """The order of one epoch under `Holds`: Concordia's stream (`stream`,
    made current by the caller) has waited for every hold, so there are no
    events to record (`after_producers` and `before_later_work` do nothing);
    `verify()` before the commit, `release()` when everything is queued."""

    def __init__(self, holds: Holds, seq: int, broken_before: int):
        super().__init__([])
        self.holds, self.seq, self._broken_before = holds, seq, broken_before
        self.released = False

    @property
    def stream(self):
        return self.holds.stream

    def verify(self) -> None:
        """Refuse (SessionError) an epoch whose holds or wait timed out: its
        reads may have overlapped the producers' later work."""
        n = self.holds.broken() - self._broken_before
        if n:
            raise SessionError(f"{n} stream hold(s) timed out after {HOLD_TIMEOUT_S:g} s: the epoch may not be "
                               "one point of the producers' work, and is not committed", where="stream hold")

    def release(self) -> None:
        """Let the held streams go on, after the work queued on `stream` so far."""
        if not self.released:
            self.released = True
            with cupy_module().cuda.Device(self.holds.device_id), self.holds.stream:
                self.holds._gpu.launch_release_holds(self.holds.words, self.seq)


def _on_device(owner) -> bool:
    """Whether `owner` (a registered object or a recover target) is a CuPy array or a CUDA tensor."""
    return is_cupy(owner) or (is_torch(owner) and owner.is_cuda)


def producer_stream(owner, stream):
    """A CuPy view of `stream` as given at `register` for `owner` (see `_as_cupy_stream`)."""
    return _as_cupy_stream(cupy_module(), stream, owner)


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
