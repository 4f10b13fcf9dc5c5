"""SM-count targets of the matrix libraries other work uses, lowered while the
persistent executor is resident and put back when it has left.

Why: Hopper's full-GPU GEMM kernels size each block to fill an SM (most of its
shared memory and registers), and every resident block, even the executor's one
warp with no shared memory, reserves shared memory for the system; so the SM
that holds the executor hosts no GEMM block, and a GEMM planned for every SM
waits on that SM's share of tiles. On the H200 an 8192³ fp16 GEMM ran 8.6 %
slower beside the idle executor; with cuBLAS told to plan for one SM fewer
(`cublasSetSmCountTarget`) it ran 2.4 % faster than with nothing resident
(within the run's noise). The target is a per-handle setting read when a GEMM
is planned: nothing on the device, and a GEMM planned with it while no executor
is resident cost nothing measurable there (docs/results/executor.md).

What is lowered (each a "knob" with a value to lower and the original to put back):

- CuPy's cuBLAS handle of the thread that made the `SmTarget` (CuPy's handles
  are per thread), and any handles passed in `cupy_handles`;
- PyTorch, when it is already imported and has initialised CUDA: its
  experimental SM carve-out (read by its cuBLASLt paths only: `torch.mm` beside
  a resident block went from 6.8 % to 5.0 % with it) and the SM-count target of
  its current thread's cuBLAS handle (−4.7 %), the latter only when one cuBLAS
  library is loaded, so that the handle belongs to the library called.

Nesting: knobs are counted per handle, so several executors (a swap, two rings)
may hold one handle; the original value comes back when the last lets go.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from .errors import ExecutorError

_WHERE = "cublas sm target"
_LOCK = threading.Lock()
_HELD: dict = {}   # knob key -> [holders, original value]
_LIB_RE = re.compile(r"(\S*/libcublas\.so[.\d]*)\s*$")


@dataclass(frozen=True)
class Knob:
    """One setting lowered while held: `key` identifies it across holders."""

    key: tuple
    read: Callable[[], object]
    write: Callable[[object], None]
    lowered: object


def mapped_cublas_paths(maps_text: str) -> list[str]:
    """Distinct paths of libcublas (not libcublasLt) in a /proc/<pid>/maps text, in order."""
    seen: list[str] = []
    for line in maps_text.splitlines():
        m = _LIB_RE.search(line)
        if m and m.group(1) not in seen:
            seen.append(m.group(1))
    return seen


def _read_maps() -> str:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


class CublasLibrary:
    """`cublasGetSmCountTarget` / `cublasSetSmCountTarget` of the cuBLAS library
    CuPy uses: CuPy's own binding where it has one, else the loaded library
    through ctypes (found in this process's mappings; dlopen of a loaded path
    returns that same library, so the handle and the function agree)."""

    def __init__(self):
        self.via = None
        self._get = self._set = None
        try:
            from cupy_backends.cuda.libs import cublas as cb
        except Exception as exc:
            raise ExecutorError(f"CuPy's cuBLAS binding is not importable ({type(exc).__name__})",
                                where=_WHERE) from None
        if hasattr(cb, "setSmCountTarget") and hasattr(cb, "getSmCountTarget"):
            self._get, self._set, self.via = cb.getSmCountTarget, cb.setSmCountTarget, "cupy binding"
            self.paths = mapped_cublas_paths(_read_maps())
            return
        import cupy

        cupy.cuda.device.get_cublas_handle()       # loads the library if nothing did yet
        self.paths = mapped_cublas_paths(_read_maps())
        names = self.paths or [f"libcublas.so.{cb.getVersion(cupy.cuda.device.get_cublas_handle()) // 10000}"]
        lib = None
        for name in names:
            try:
                cand = ctypes.CDLL(name)
                cand.cublasSetSmCountTarget
                cand.cublasGetSmCountTarget
            except (OSError, AttributeError):
                continue
            lib = cand
            self.via = f"ctypes {name.rsplit('/', 1)[-1]}"
            break
        if lib is None:
            raise ExecutorError("no loaded cuBLAS library has cublasSetSmCountTarget (cuBLAS 11.3 or later needed)",
                                where=_WHERE)
        lib.cublasSetSmCountTarget.argtypes = (ctypes.c_void_p, ctypes.c_int)
        lib.cublasGetSmCountTarget.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))

        def get(handle: int) -> int:
            v = ctypes.c_int(-1)
            _check(lib.cublasGetSmCountTarget(ctypes.c_void_p(handle), ctypes.byref(v)), "get")
            return v.value

        def set_(handle: int, n: int) -> None:
            _check(lib.cublasSetSmCountTarget(ctypes.c_void_p(handle), int(n)), "set")

        self._get, self._set = get, set_

    @property
    def single_library(self) -> bool:
        """Only one cuBLAS is loaded now: any framework's handle belongs to it.
        Read at each call, since a framework may load its own cuBLAS after
        this binding was made (a handle of another library must not be set
        through this one)."""
        self.paths = mapped_cublas_paths(_read_maps())
        return len(self.paths) == 1

    def get(self, handle: int) -> int:
        return int(self._get(handle))

    def set(self, handle: int, n: int) -> None:
        self._set(handle, n)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ExecutorError(f"cublas{what.capitalize()}SmCountTarget returned status {status}", where=_WHERE)


_LIBRARY: CublasLibrary | None = None


def cublas_library() -> CublasLibrary:
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = CublasLibrary()
    return _LIBRARY


def device_sm_count() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])


def cupy_knobs(carveout: int, handles=None, *, n_sm: int | None = None) -> list[Knob]:
    """Knobs lowering CuPy cuBLAS handles (default: this thread's) to n_sm - carveout."""
    import cupy

    lib = cublas_library()
    n_sm = device_sm_count() if n_sm is None else n_sm
    hs = [int(cupy.cuda.device.get_cublas_handle())] if handles is None else [int(h) for h in handles]
    return [Knob(("cublas", h), lambda h=h: lib.get(h), lambda v, h=h: lib.set(h, v), n_sm - carveout) for h in hs]


def torch_knobs(carveout: int, *, n_sm: int | None = None) -> tuple[list[Knob], list[str]]:
    """Knobs for PyTorch, if it is imported and has initialised CUDA; with the
    reasons for what was left out."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [], ["torch not imported"]
    try:
        ready = torch.cuda.is_initialized()
    except Exception:
        ready = False
    if not ready:
        return [], ["torch has not initialised CUDA"]
    knobs, skipped = [], []
    c = torch._C
    if hasattr(c, "_set_sm_carveout_experimental") and hasattr(c, "_get_sm_carveout_experimental"):
        knobs.append(Knob(("torch", "carveout"), c._get_sm_carveout_experimental, c._set_sm_carveout_experimental,
                          int(carveout)))
    else:
        skipped.append("torch has no _set_sm_carveout_experimental")
    lib = cublas_library()
    if lib.single_library:
        n_sm = device_sm_count() if n_sm is None else n_sm
        h = int(torch.cuda.current_blas_handle())
        knobs.append(Knob(("cublas", h), lambda: lib.get(h), lambda v: lib.set(h, v), n_sm - carveout))
    else:
        skipped.append(f"torch cuBLAS handle: {len(lib.paths)} cuBLAS libraries loaded")
    return knobs, skipped


class SmTarget:
    """Lower the knobs while held (`apply` / `restore`, or `with`); idempotent per
    instance, counted per knob across instances.

        with SmTarget(1):              # GEMMs planned here leave one SM free
            cupy.matmul(a, b)
    """

    def __init__(self, carveout: int = 1, *, cupy_handles=None, torch: bool | None = None,
                 knobs: list[Knob] | None = None):
        if not isinstance(carveout, int) or carveout < 0:
            raise ExecutorError(f"SM carve-out must be a non-negative integer, got {carveout!r}", where=_WHERE)
        self.carveout = carveout
        self.skipped: list[str] = []
        if knobs is not None:
            self.knobs = list(knobs)
        elif carveout == 0:
            self.knobs = []
        else:
            n_sm = device_sm_count()
            if carveout >= n_sm:
                raise ExecutorError(f"SM carve-out {carveout} leaves no SM of {n_sm}", where=_WHERE)
            self.knobs = cupy_knobs(carveout, cupy_handles, n_sm=n_sm)
            if torch is not False:
                tk, self.skipped = torch_knobs(carveout, n_sm=n_sm)
                if torch and not tk:
                    raise ExecutorError(f"torch SM target asked for but unavailable: {'; '.join(self.skipped)}",
                                        where=_WHERE)
                have = {k.key for k in self.knobs}
                self.knobs += [k for k in tk if k.key not in have]
        self.active = False

    def apply(self) -> None:
        if self.active:
            return
        with _LOCK:
            done = []
            try:
                for k in self.knobs:
                    held = _HELD.get(k.key)
                    if held is None:
                        original = k.read()
                        k.write(k.lowered)
                        _HELD[k.key] = [1, original]
                    else:
                        held[0] += 1
                    done.append(k)
            except Exception:
                self._let_go(done)
                raise
            self.active = True

    def restore(self) -> None:
        if not self.active:
            return
        with _LOCK:
            self.active = False
            self._let_go(self.knobs)

    @staticmethod
    def _let_go(knobs) -> None:
        for k in knobs:
            held = _HELD.get(k.key)
            if held is None:
                continue
            held[0] -= 1
            if held[0] == 0:
                del _HELD[k.key]
                k.write(held[1])

    def __enter__(self) -> "SmTarget":
        self.apply()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def describe(self) -> dict:
        return {"carveout": self.carveout, "knobs": [list(map(str, k.key)) for k in self.knobs],
                "lowered_to": [k.lowered for k in self.knobs], "skipped": self.skipped,
                "via": _LIBRARY.via if _LIBRARY is not None else None,
                "cublas_libraries_loaded": [p.rsplit("/", 1)[-1] for p in _LIBRARY.paths] if _LIBRARY else None}
