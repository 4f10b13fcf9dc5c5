"""PTX instrumentation: exit hooks, pause gates and store tracking inserted into kernels as they load.

    from concordia import instrument
    rep = instrument.enable(track_stores=True)     # CuPy kernels compiled from now on are rewritten
    gate = instrument.Gate(); instrument.set_gate(gate)
    region = instrument.track_array("kv", kv, page_bytes=4096); instrument.set_regions([region])
    ... run kernels ...; region.dirty_pages(); gate.close(); gate.open()
    print(rep.summary()); instrument.disable()

Below CuPy, `concordia.instrument.shim` builds an LD_PRELOAD library that does
the same for modules loaded through the CUDA driver by any framework.
"""

from __future__ import annotations

from concordia.instrument.errors import InstrumentError
from concordia.lazy import exports, homes_of

# the classes load on first use (`concordia.lazy`): importing the errors loads no rewriter
__getattr__, __dir__ = exports(__name__, homes_of({
    "reports": ("ModuleRecord", "Report", "Skipped"),
    "rewriter": ("KernelInfo", "Options", "RewriteResult", "rewrite"),
    "runtime": ("Gate", "TrackedRegion", "epochs", "track_array"),
}))

_hook = None


def enable(*, exit_hooks: bool = True, pause_gate: bool = True, track_stores: bool = False,
           max_regions: int = 8, gate: Gate | None = None,
           compiler=None) -> Report:
    """Rewrite every CuPy kernel compiled from now on; return the live report.
    `compiler` defaults to `cupy.cuda.compiler`."""
    global _hook
    from concordia.instrument import runtime
    from concordia.instrument.cupy_hook import CupyHook, clear_cupy_memos
    from concordia.instrument.reports import Report
    from concordia.instrument.rewriter import Options

    if _hook is not None:
        raise InstrumentError("instrumentation is already enabled", hint="call disable() first")
    if compiler is None:
        compiler = runtime.require_cupy().cuda.compiler
    opts = Options(exit_hooks=exit_hooks, pause_gate=pause_gate, track_stores=track_stores,
                   max_regions=max_regions)
    hook = CupyHook(compiler, opts, Report(), gate)
    hook.install()
    clear_cupy_memos()
    _hook = hook
    return hook.report


def disable() -> Report | None:
    """Restore CuPy's compiler.  Kernels already loaded keep their exit hooks
    but are detached from the gate and the tracked regions."""
    global _hook
    from concordia.instrument.cupy_hook import clear_cupy_memos

    hook, _hook = _hook, None
    if hook is None:
        return None
    hook.uninstall()
    clear_cupy_memos()
    return hook.report


def report() -> Report | None:
    return _hook.report if _hook is not None else None


def set_gate(gate: Gate | None) -> None:
    """Attach every instrumented module (and those loaded later) to `gate`, or
    detach them (None).  Threads count themselves only while the gate is
    closed, so an open gate costs what no gate does and may stay attached:
    close it, wait for `gate.arrived`, checkpoint, open it.  Attach before
    closing (see `runtime.attach`)."""
    _require().set_gate(gate)


def set_regions(regions: list[TrackedRegion]) -> None:
    """Track stores into exactly `regions` (every instrumented module, and
    those loaded later)."""
    _require().set_regions(regions)


def track(name: str, array, page_bytes: int) -> TrackedRegion:
    """Start tracking stores into the CuPy array `array` (pages of
    `page_bytes`), beside the regions tracked already; returns its region,
    whose bitmap the store tracker marks.  Needs enable(track_stores=True)."""
    from concordia.instrument.runtime import track_array

    hook = _require()
    if not hook.options.track_stores:
        raise InstrumentError("store tracking is off", where=name,
                              hint="call instrument.enable(track_stores=True) before the kernels are compiled")
    region = track_array(name, array, page_bytes)
    hook.set_regions([*hook.regions, region])
    return region


def is_tracked(region: TrackedRegion) -> bool:
    """Whether stores into `region` are being tracked now (disable(),
    set_regions() and untrack() end it)."""
    return _hook is not None and any(r is region for r in _hook.regions)


def untrack(region: TrackedRegion) -> None:
    """Stop tracking `region` (nothing happens when it is not tracked)."""
    if is_tracked(region):
        _hook.set_regions([r for r in _hook.regions if r is not region])


def _require():
    if _hook is None:
        raise InstrumentError("instrumentation is not enabled", hint="call instrument.enable() first")
    return _hook


__all__ = ["enable", "disable", "report", "set_gate", "set_regions", "track", "untrack", "is_tracked", "rewrite", "Options",
           "RewriteResult", "KernelInfo", "Report", "ModuleRecord", "Skipped", "Gate",
           "TrackedRegion", "track_array", "epochs", "InstrumentError"]
