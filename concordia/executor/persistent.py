"""The GPU executor: the persistent kernel of `gpu_kernels/executor.cu` as a
consumer of the task ring (see host.py for the consumer interface).

Rules this module keeps (ARCHITECTURE.md, pitfalls):

- every module is compiled and loaded before any executor is launched, and never
  while one is resident (`ExecutorModule.load` refuses);
- the kernel runs on a non-blocking stream; the host never synchronises the
  device, only queries that stream (`is_resident`) or waits on other streams;
- all device memory the kernel needs (the scratch line) is allocated before launch;
- the ring sits in page-aligned host memory registered as mapped, used on the
  device at its host address (unified addressing);
- every wait on the host is bounded; the kernel leaves on its own after an idle
  interval (the host relaunches it lazily) or its lifetime.

CuPy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import itertools
import mmap
import platform
import time
import weakref
from pathlib import Path

import concordia.gpu_kernels as _gpu_kernels_pkg
from concordia.devmem import cuda_host
from concordia.root_error import ConcordiaError

import numpy as np

from .errors import ExecutorError
from .ring import Op, Ring, ring_bytes
from .smtarget import SmTarget

# The sources ship inside concordia.gpu_kernels (package data), wherever the
# package is installed; the source tree's layout is not assumed.
KERNEL_SOURCE = Path(_gpu_kernels_pkg.__file__).resolve().parent / "executor.cu"
HANDLER_OPS = (Op.CHECKPOINT, Op.APPEND_LOG, Op.SCATTER)
ALL_OPS_MASK = sum(1 << int(op) for op in Op)

_IDS = itertools.count(1001)
_RESIDENT: "weakref.WeakSet[GpuExecutor]" = weakref.WeakSet()


def require_cupy():
    try:
        import cupy
    except Exception as exc:
        raise ExecutorError(f"CuPy is not importable ({type(exc).__name__}: {exc})", where="gpu executor",
                            hint="the GPU executor needs CuPy and a CUDA device; use CpuExecutor") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:
        raise ExecutorError(f"no CUDA device ({exc})", where="gpu executor",
                            hint="use CpuExecutor") from None
    return cupy


def kernel_source(path: Path = KERNEL_SOURCE) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ExecutorError(f"cannot read kernel source: {exc.strerror}", where=str(path)) from None


def compile_options(*, child: bool, ops_mask: int = ALL_OPS_MASK) -> tuple[str, ...]:
    """NVRTC / nvcc options of one executor module variant."""
    from concordia.gpu_kernels.jit import OWN_KERNEL_OPTION

    opts = (f"-DCX_CHILD={int(child)}", f"-DCX_OPS=0x{ops_mask:x}u", OWN_KERNEL_OPTION)
    return opts + (("-rdc=true",) if child else ())


def any_resident() -> bool:
    return any(e.is_resident() for e in list(_RESIDENT))


class ExecutorModule:
    """One compiled variant of executor.cu: `child` selects dynamic-parallelism
    handlers (-rdc=true) or handlers run by the resident warp; `ops` the operator
    table compiled in.  Compiling and loading happen together in `load()`."""

    def __init__(self, *, child: bool = True, ops=HANDLER_OPS, extra_options: tuple[str, ...] = ()):
        self.child = child
        self.ops = tuple(int(o) for o in ops)
        self.ops_mask = sum(1 << o for o in self.ops) | (1 << Op.PING) | (1 << Op.QUIESCE) | (1 << Op.STOP)
        self.options = compile_options(child=child, ops_mask=self.ops_mask) + tuple(extra_options)
        self.functions: dict | None = None
        self.load_s: float | None = None

    @property
    def name(self) -> str:
        return f"{'child' if self.child else 'inline'}/ops=0x{self.ops_mask:x}"

    def load(self) -> "ExecutorModule":
        """Compile (NVRTC, CuPy's cache) and load.  Refused while any executor is
        resident: loading a module beside a persistent kernel can deadlock."""
        if self.functions is not None:
            return self
        if any_resident():
            raise ExecutorError("module load while a persistent executor is resident", where=f"module {self.name}",
                                hint="load every module before launch, or quiesce first")
        from concordia.gpu_kernels import jit
        from concordia.gpu_kernels.errors import KernelCompileError

        require_cupy()
        t0 = time.perf_counter()
        names = ("cx_executor", "cx_checkpoint", "cx_copy", "cx_scatter")
        code = kernel_source()
        if "-DCX_EPOCH" in self.options or "-DCX_RECOVER" in self.options:
            # the EPOCH handler launches the table pass's kernels, RECOVER its page CRCs: one module
            code = code.replace('#include "table.cu"', jit.source("table"), 1)
        if "-DCX_EPOCH" in self.options:
            names += ("cx_epoch_driver", "cx_epoch_small", "cx_epoch_close", "cx_step_gate")
        if "-DCX_RECOVER" in self.options:
            names += ("cx_recover",)
        try:
            while True:
                try:
                    mod = jit.load(code, self.options, names, where=f"executor.cu {self.name}")
                    fns = {n: mod.get_function(n) for n in names}
                    break
                except KernelCompileError as exc:
                    if (self.child and "cudaGetLastError" in getattr(exc, "log", "")
                            and "-DCX_NO_LAUNCH_STATUS" not in self.options):
                        # NVRTC without the device runtime's declarations: launch failures show as timeouts.
                        self.options += ("-DCX_NO_LAUNCH_STATUS",)
                    else:
                        raise
        except ExecutorError:
            raise
        except Exception as exc:
            text = exc.message if isinstance(exc, KernelCompileError) else str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise ExecutorError(f"compile or load failed: {first}", where=f"module {self.name}") from None
        self.functions = fns
        self.load_s = time.perf_counter() - t0
        return self


#: the hosts whose store order the ring's protocol with the device relies on (ring.py, "Memory
#: ordering": plain numpy stores seen in program order, a lock acquire as the store->load fence)
TSO_HOSTS = ("x86_64", "amd64", "i686", "i386")


def host_order_why(machine: str | None = None) -> str | None:
    """Why this host cannot run the persistent kernel's ring, or None: its
    protocol assumes an x86 host's total store order (ring.py); on a weakly
    ordered host (aarch64, ...) the device could see a task's sequence word
    before its body."""
    m = (platform.machine() if machine is None else machine) or "unknown"
    if m.lower() in TSO_HOSTS:
        return None
    return (f"the persistent kernel's ring assumes an x86 host's store order (concordia/executor/ring.py); "
            f"this host is {m}")


class GpuRing:
    """A task ring in mapped pinned host memory, plus the device scratch line
    and the non-blocking stream every executor of this ring launches on (so
    instances run strictly one after another).  Refused on a host whose
    store order the protocol does not hold on (`host_order_why`)."""

    def __init__(self, capacity: int = 1024, *, where: str = "gpu ring"):
        why = host_order_why()
        if why is not None:
            raise ExecutorError(why, where=where)
        cupy = require_cupy()
        n = ring_bytes(capacity)
        self._mm = mmap.mmap(-1, (n + 4095) // 4096 * 4096)
        host = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = host.ctypes.data
        try:
            cuda_host.pin(self.ptr, len(self._mm), where=where)
        except ConcordiaError as exc:
            raise ExecutorError(f"cannot register the ring with CUDA: {exc.message}", where=where) from None
        self._registered = True
        self.ring = Ring.format(host, capacity, where=where)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.scratch = cupy.zeros(8, dtype=cupy.uint64)  # cx_scratch, 64 bytes
        self.stream.synchronize()
        self.n_sm = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]

    def is_busy(self) -> bool:
        return not self.stream.done

    def close(self, timeout: float = 10.0) -> None:
        """Unregister the ring; refused (ExecutorError) while a kernel is still on its stream."""
        if not self._registered:
            return
        t0 = time.monotonic()
        while self.is_busy():
            if time.monotonic() - t0 > timeout:
                raise ExecutorError("ring still in use by a resident kernel; stop it first", where=self.ring.where)
            time.sleep(1e-3)
        cuda_host.unpin(self.ptr)
        self._registered = False


#: SMs cuBLAS is told to leave to a resident executor unless told otherwise
DEFAULT_SM_CARVEOUT = 1


class GpuExecutor:
    """The persistent kernel as a ring consumer.

    idle_s: the kernel leaves after this long without a task (released
    residency; the host relaunches on the next submit).  lifetime_s: it leaves
    after this long in any case, or, with a device trigger armed whose steps
    still come, once they stop (executor.cu: a due step must not pass with no
    epoch).  child_timeout_s: a handler grid that runs
    longer fails its task and faults the executor.  poll_max_ns: longest sleep
    between two polls of host memory while idle.

    sm_carveout: while resident, cuBLAS (CuPy's handle of the thread that made
    this executor, and PyTorch's when imported; see smtarget.py) plans GEMMs for
    that many SMs fewer, so that a full-GPU GEMM is not held up by the SM the
    executor occupies.  Lowered at each launch, put back when the host sees the
    executor gone (`is_resident()` false, `join()`); after an idle release that
    nobody has looked at yet it is still lowered.  Or pass a ready `sm_target`
    (an `SmTarget`, e.g. naming other handles).  On the H200, 1 took an
    8192³ fp16 GEMM beside the idle executor from +8.6 % to −2.4 %, and cost
    nothing measurable with no executor resident (docs/results/executor.md).
    1 by default (it changes a setting of the caller's cuBLAS handle while the
    executor is resident; pass 0 to leave cuBLAS alone).  When the default
    cannot be applied (no cuBLAS with the call), the executor runs without it
    and says why in `sm_target_skipped`; an explicit carve-out raises instead."""

    kind = "gpu"
    host_busy_spins = 20000   # the waiter spins on host memory; nothing needs its GIL

    def __init__(self, gring: GpuRing, module: ExecutorModule, *, executor_id: int | None = None,
                 idle_s: float = 0.002, lifetime_s: float = 60.0, child_timeout_s: float = 20.0,
                 poll_max_ns: int = 2000, sm_carveout: int | None = None, sm_target: SmTarget | None = None):
        self.gring = gring
        self.ring = gring.ring
        self.module = module
        self.executor_id = next(_IDS) if executor_id is None else executor_id
        self.idle_ns = int(idle_s * 1e9)
        self.lifetime_ns = int(lifetime_s * 1e9)
        self.child_timeout_ns = int(child_timeout_s * 1e9)
        self.poll_max_ns = int(poll_max_ns)
        self.launches = 0
        self.sm_target_skipped = None
        if sm_target is not None:
            self.sm_target = sm_target
        elif sm_carveout is None:  # the default: one SM, if cuBLAS can be told
            try:
                self.sm_target = SmTarget(DEFAULT_SM_CARVEOUT)
            except ExecutorError as exc:
                self.sm_target, self.sm_target_skipped = None, str(exc)
        else:
            self.sm_target = SmTarget(sm_carveout) if sm_carveout else None

    # -- consumer interface ------------------------------------------------------

    def prepare(self) -> None:
        self.module.load()

    def launch(self, instance: int, resume: bool = False) -> None:
        if self.module.functions is None:
            self.module.load()   # refuses while anything is resident
        fn = self.module.functions["cx_executor"]
        g = self.gring
        if self.sm_target is not None:
            self.sm_target.apply()       # before the launch: GEMMs planned from now on leave its SM free
        with g.stream:
            fn((1,), (32,), (np.uint64(g.ptr), np.uint32(self.ring.capacity), np.uint32(self.executor_id),
                             np.uint32(instance), g.scratch, np.uint32(g.n_sm), np.uint64(self.idle_ns),
                             np.uint64(self.lifetime_ns), np.uint64(self.child_timeout_ns),
                             np.uint32(self.poll_max_ns), np.uint32(bool(resume))))
        self.launches += 1
        _RESIDENT.add(self)

    def is_resident(self) -> bool:
        busy = self.gring.is_busy()
        if not busy and self.sm_target is not None:
            self.sm_target.restore()
        return busy

    def join(self, timeout: float) -> bool:
        t0 = time.monotonic()
        while self.gring.is_busy():
            if time.monotonic() - t0 > timeout:
                return False
            time.sleep(5e-5)
        if self.sm_target is not None:
            self.sm_target.restore()
        return True


class MappedHostBuffer:
    """Page-aligned host memory registered as mapped: a numpy view on the host,
    the same address on the device.  Unregistered by `close()` (only when no
    kernel that uses it is running)."""

    def __init__(self, nbytes: int, *, where: str = "mapped buffer"):
        cupy = require_cupy()
        self._mm = mmap.mmap(-1, max(4096, (nbytes + 4095) // 4096 * 4096))
        self.array = np.frombuffer(self._mm, dtype=np.uint8)[:nbytes]
        self.ptr = self.array.ctypes.data
        try:
            cuda_host.pin(self.ptr, len(self._mm), where=where)
        except ConcordiaError as exc:
            raise ExecutorError(f"cannot register {nbytes} bytes with CUDA: {exc.message}", where=where) from None
        self._registered = True

    def close(self) -> None:
        if self._registered:
            cuda_host.unpin(self.ptr)
            self._registered = False
