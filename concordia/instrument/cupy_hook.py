"""Route CuPy's kernel compilation through the PTX rewriter.

Every CuPy kernel (RawModule, RawKernel, ElementwiseKernel, ReductionKernel and
CuPy's own ufuncs) is compiled by `cupy.cuda.compiler._compile_with_cache_cuda`,
which calls the module-level `compile_using_nvrtc` and loads the result with
`function.Module.load`.  Both are looked up by name at call time, so replacing
them on the module reaches every path without touching user code:

- `_get_arch_for_options_for_nvrtc` is made to answer `compute_XX` / "ptx", so
  NVRTC returns PTX (which the rewriter needs) instead of a cubin;
- `compile_using_nvrtc` rewrites the PTX it returns;
- `_compile_with_cache_cuda` is asked to compile in memory, so an instrumented
  binary never lands in CuPy's disk cache (and an uninstrumented cached one is
  never loaded while enabled); it records the loaded module and attaches the
  gate and the tracked regions to it.

The nvcc back end produces cubins and is reported as skipped.  Kernels CuPy
compiled before `enable()` stay as they were (CuPy keeps them in per-kernel
memos); enable before first use.
"""

from __future__ import annotations

import inspect
import itertools
import threading

from concordia.instrument import runtime
from concordia.instrument.errors import InstrumentError
from concordia.instrument.report import ModuleRecord, Report
from concordia.instrument.rewrite import Options, rewrite

_generation = itertools.count(1)
_PATCHED = ("compile_using_nvrtc", "_compile_with_cache_cuda", "_get_arch_for_options_for_nvrtc")


class CupyHook:
    def __init__(self, compiler, options: Options, report: Report, gate=None):
        self.compiler = compiler
        self.options = options
        self.report = report
        self.gate = gate
        self.regions: list = []
        self.saved: dict[str, object] = {}
        self.local = threading.local()
        # How often each replacement ran: the first thing to look at when a
        # CuPy release routes compilation elsewhere and nothing gets rewritten.
        self.calls = {"compile": 0, "nvrtc": 0, "arch": 0}
        self.salt = f"-DCONCORDIA_INSTRUMENT={next(_generation)}"

    # installation ---------------------------------------------------------
    def install(self) -> None:
        c = self.compiler
        for name in _PATCHED:
            if hasattr(c, name):
                self.saved[name] = getattr(c, name)
        if "compile_using_nvrtc" not in self.saved or "_compile_with_cache_cuda" not in self.saved:
            raise InstrumentError("this CuPy has no compile_using_nvrtc/_compile_with_cache_cuda",
                                  where="cupy.cuda.compiler", hint="CuPy 12 to 14 are supported")
        self._cache_sig = inspect.signature(self.saved["_compile_with_cache_cuda"])
        c.compile_using_nvrtc = self._compile_using_nvrtc
        c._compile_with_cache_cuda = self._compile_with_cache_cuda
        if "_get_arch_for_options_for_nvrtc" in self.saved:
            c._get_arch_for_options_for_nvrtc = self._ptx_arch

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.compiler, name, fn)
        self.saved.clear()

    # replacements ---------------------------------------------------------
    def _ptx_arch(self, arch=None, *args, **kwargs):
        self.calls["arch"] += 1
        arch = arch or self.compiler._get_arch()
        return f"-arch=compute_{arch}", "ptx"

    def _compile_using_nvrtc(self, *args, **kwargs):
        self.calls["nvrtc"] += 1
        out = self.saved["compile_using_nvrtc"](*args, **kwargs)
        binary, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        new = self._instrument(binary)
        return (new, *rest) if rest is not None else new

    def _instrument(self, binary):
        pending = getattr(self.local, "pending", None)
        raw = binary.encode() if isinstance(binary, str) else bytes(binary)
        if raw[:4] == b"\x7fELF":
            self.report.skip("cupy:nvrtc", "NVRTC returned a cubin (SASS only); no PTX to instrument")
            return binary
        try:
            res = rewrite(raw, self.options)
        except (InstrumentError, UnicodeDecodeError) as exc:
            reason = exc.one_line() if isinstance(exc, InstrumentError) else f"not text: {exc}"
            self.report.skip("cupy:nvrtc", reason)
            return binary
        if pending is not None:
            pending.append(res)
        else:  # compiled outside a cached load (e.g. a direct call): report only
            self.report.add(ModuleRecord("cupy:" + ",".join(k.name for k in res.kernels), res))
        return res.ptx.encode() if isinstance(binary, (bytes, bytearray)) else res.ptx

    def _compile_with_cache_cuda(self, *args, **kwargs):
        self.calls["compile"] += 1
        bound = self._cache_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("backend", "nvrtc") != "nvrtc":
            self.report.skip("cupy:" + str(a.get("backend")), "the nvcc back end produces cubins only")
            return self.saved["_compile_with_cache_cuda"](*bound.args, **bound.kwargs)
        if "cache_in_memory" in a:
            a["cache_in_memory"] = True
        # A define of its own per enable() gives the rewritten binary its own
        # cache key, so no cache (on disk or in memory) hands back a module
        # compiled without this hook, nor one compiled under an earlier one.
        a["options"] = tuple(a.get("options") or ()) + (self.salt,)
        self.local.pending = []
        try:
            mod = self.saved["_compile_with_cache_cuda"](*bound.args, **bound.kwargs)
            results = self.local.pending
        finally:
            self.local.pending = None
        for res in results:
            rec = ModuleRecord("cupy:" + ",".join(k.name for k in res.kernels), res, handle=mod)
            runtime.attach(mod, res, self.gate, self.regions)
            self.report.add(rec)
        return mod

    # state changes --------------------------------------------------------
    def set_gate(self, gate) -> None:
        self.gate = gate
        for rec in self.report.modules:
            if rec.handle is not None:
                runtime.attach(rec.handle, rec.result, gate, self.regions)

    def set_regions(self, regions: list) -> None:
        self.regions = list(regions)
        for rec in self.report.modules:
            if rec.handle is not None and rec.result.options.track_stores:
                runtime.attach(rec.handle, rec.result, self.gate, self.regions)


def clear_cupy_memos() -> None:
    """Drop CuPy's memoised compile results so later calls compile again."""
    try:
        import cupy

        cupy._util.clear_memo()
    except Exception:
        pass
