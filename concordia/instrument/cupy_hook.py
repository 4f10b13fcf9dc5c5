"""Route CuPy's kernel compilation through the PTX rewriter.

Every CuPy kernel (RawModule, RawKernel, ElementwiseKernel, ReductionKernel and
CuPy's own ufuncs) is compiled by `cupy.cuda.compiler._compile_with_cache_cuda`,
which calls the module-level NVRTC entry point (`_compile_using_nvrtc_no_warning`
in CuPy 14, `compile_using_nvrtc` before) and loads the result with
`function.Module.load`.  Both are looked up by name at call time, so replacing
them on the module reaches every path without touching user code:

- `_get_arch_for_options_for_nvrtc` is made to answer `compute_XX` / "ptx", so
  NVRTC returns PTX (which the rewriter needs) instead of a cubin;
- the NVRTC entry point rewrites the PTX it returns;
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

from concordia.gpu_kernels.jit import OWN_KERNEL_OPTION
from concordia.instrument import runtime
from concordia.instrument.errors import InstrumentError
from concordia.instrument.reports import ModuleRecord, Report
from concordia.instrument.rewriter import Options, rewrite

_generation = itertools.count(1)
# The NVRTC entry point that `_compile_with_cache_cuda` calls: CuPy 14 calls
# `_compile_using_nvrtc_no_warning` (the public `compile_using_nvrtc` is a thin
# wrapper around it); CuPy 12 and 13 call `compile_using_nvrtc`.  Only the
# innermost one present is replaced, so no module is rewritten twice.
_NVRTC_NAMES = ("_compile_using_nvrtc_no_warning", "compile_using_nvrtc")
_PATCHED = (*_NVRTC_NAMES, "_compile_with_cache_cuda", "_get_arch_for_options_for_nvrtc")


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
        self.nvrtc_name = next((n for n in _NVRTC_NAMES if hasattr(c, n)), None)
        for name in (self.nvrtc_name, "_compile_with_cache_cuda", "_get_arch_for_options_for_nvrtc"):
            if name is not None and hasattr(c, name):
                self.saved[name] = getattr(c, name)
        if self.nvrtc_name is None or "_compile_with_cache_cuda" not in self.saved:
            raise InstrumentError("this CuPy has no compile_using_nvrtc/_compile_with_cache_cuda",
                                  where="cupy.cuda.compiler", hint="CuPy 12 to 14 are supported")
        self._cache_sig = inspect.signature(self.saved["_compile_with_cache_cuda"])
        setattr(c, self.nvrtc_name, self._compile_using_nvrtc)
        c._compile_with_cache_cuda = self._compile_with_cache_cuda
        if "_get_arch_for_options_for_nvrtc" in self.saved:
            c._get_arch_for_options_for_nvrtc = self._ptx_arch

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.compiler, name, fn)
        self.saved.clear()
        # CuPy keeps compiled kernels in caches clear_memo() does not reach
        # (ufuncs, ElementwiseKernel instances), so modules of this session stay
        # in use after it ends.  They must stop polling a gate and marking
        # bitmaps that the caller is about to free (and whose memory the pool
        # hands to the next session's arrays): exit hooks stay, the rest goes.
        for rec in self.report.modules:
            if rec.handle is not None:
                runtime.attach(rec.handle, rec.result, None, [])

    # replacements ---------------------------------------------------------
    def _ptx_arch(self, arch=None, *args, **kwargs):
        self.calls["arch"] += 1
        arch = arch or self.compiler._get_arch()
        return f"-arch=compute_{arch}", "ptx"

    def _compile_using_nvrtc(self, *args, **kwargs):
        self.calls["nvrtc"] += 1
        out = self.saved[self.nvrtc_name](*args, **kwargs)
        if getattr(self.local, "ltoir", False) or getattr(self.local, "bypass", False):
            return out  # LTO IR for nvJitLink, not PTX: nothing to rewrite
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
        if OWN_KERNEL_OPTION in tuple(a.get("options") or ()):
            self.report.skip("cupy:concordia", "Concordia's own module (left as it is)")
            self.local.bypass = True
            try:
                return self.saved["_compile_with_cache_cuda"](*bound.args, **bound.kwargs)
            finally:
                self.local.bypass = False
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
        self.local.ltoir = bool(a.get("to_ltoir", False))
        try:
            mod = self.saved["_compile_with_cache_cuda"](*bound.args, **bound.kwargs)
            results = self.local.pending
        finally:
            self.local.pending = None
            self.local.ltoir = False
        if a.get("to_ltoir", False):  # bytes for a later nvJitLink link, not a loaded module
            self.report.skip("cupy:ltoir", "LTO IR is not PTX; linked code is not instrumented")
            return mod
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
        if len(regions) > self.options.max_regions:
            raise InstrumentError(f"{len(regions)} tracked regions, at most {self.options.max_regions}",
                                  where="set_regions", hint="pass a larger max_regions to instrument.enable()")
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
