"""`concordia-wal bench instrument`: what the PTX hooks cost on memory-bound
kernels, measured side by side with the same kernels uninstrumented.

Two launch shapes of one streaming computation (`y[i] = a * x[i] + y[i]`, 12
bytes moved per element): `per-element` (one element per thread, a block of 256
threads per 256 elements: the shape where per-block and per-thread hook costs
weigh most) and `grid-stride` (4 blocks of 256 threads per SM, each thread
looping over the array).  Each is compiled through CuPy with
`concordia.instrument` set as named:

  plain         no instrumentation (the baseline)
  exit-hooks    exit hooks, epoch counters and the gate's mirror test (the
                defaults), no gate attached
  exit+gate     the same with an open gate attached (threads count themselves
                only while it is closed, so this should cost what exit-hooks does)
  strong+gate   exit+gate with the gate's mirror read as commit 8824538 read it: a
                GPU-scope relaxed load per thread, which L1 does not serve
                (kept to measure what the weak, L1-served read saves)
  no-gate       exit hooks built without the gate: block 0 counts the launch,
                no mirror is read (the floor under exit-hooks)
  store-track   exit hooks, gate, and the store tracker with the output registered
  track-l2      store-track with the tracker's test of the bitmap word read at GPU
                scope in L2, as before rewriter version 6

Times are CUDA-event medians over `--repeat` launches after warm-up, taken in
two rounds that alternate the variants (`spread` is the relative difference of
the two rounds' medians for `plain`: the noise floor); overhead is relative to
`plain`, and bandwidth is a ratio to a device-to-device copy measured in the
same run (the ceiling).  The goal for exit hooks is at most 5%.
"""

from __future__ import annotations

import click
import numpy as np

from concordia.instrument.errors import InstrumentError

from ..common import BYTES, check_outputs, guarded, report, require_cupy
from .files import force_option

SRC = r"""
extern "C" __global__ void stream_axpy(const float* x, float* y, float a, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = a * x[i] + y[i];
}
extern "C" __global__ void stride_axpy(const float* x, float* y, float a, long long n) {
  long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
    y[i] = a * x[i] + y[i];
}
"""
SHAPES = ("per-element", "grid-stride")
VARIANTS = ("plain", "exit-hooks", "exit+gate", "strong+gate", "no-gate", "store-track", "track-l2")
# enable() arguments per variant (the gate is attached where "gate" is true)
SETTINGS = {
    "exit-hooks": dict(gate=False),
    "exit+gate": dict(gate=True),
    "strong+gate": dict(gate=True),
    "no-gate": dict(gate=False, pause_gate=False),
    "store-track": dict(gate=True, track_stores=True),
    "track-l2": dict(gate=True, track_stores=True),
}
WEAK_READ = "ld.global.ca.u32 %__cnc_h, [__concordia_hold];"
STRONG_READ = "ld.relaxed.gpu.global.u32 %__cnc_h, [__concordia_hold];"
TRACK_READ = ("@%p1 ld.global.ca.u32 %r13, [%rd11];", "@%p1 ld.relaxed.gpu.global.u32 %r13, [%rd11];")
# Variants made by editing the rewritten PTX: [(text to replace, replacement,
# fewest times it must be found in the module of the two bench kernels)].
EDITS = {"strong+gate": [(WEAK_READ, STRONG_READ, 2)], "track-l2": [(*TRACK_READ, 1)]}


class _EditedRewrite:
    """While in use, CuPy kernels are rewritten and then edited as `EDITS` says."""

    def __init__(self, edits: list[tuple[str, str, int]]):
        self.edits = edits

    def __enter__(self):
        from concordia.instrument import cupy_hook

        self.module, self.saved = cupy_hook, cupy_hook.rewrite
        self.missing: list[str] = []

        def rewrite(text, options):
            res = self.saved(text, options)
            for old, new, least in self.edits:
                if res.ptx.count(old) < least:
                    self.missing.append(old.strip())
                res.ptx = res.ptx.replace(old, new)
            return res

        cupy_hook.rewrite = rewrite
        return self

    def __exit__(self, *exc):
        self.module.rewrite = self.saved


def _samples(cp, fn, repeat: int) -> list[float]:
    for _ in range(3):
        fn()
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return times


def _time(cp, fn, repeat: int) -> float:
    return float(np.median(_samples(cp, fn, repeat)))


def _load(cp, variant: str) -> dict:
    mod = cp.RawModule(code=SRC, options=(f"-DVARIANT_{variant.replace('-', '_').replace('+', '_')}",))
    return {"per-element": mod.get_function("stream_axpy"), "grid-stride": mod.get_function("stride_axpy")}


def _registers(fn) -> int | None:
    try:
        return int(fn.num_regs)
    except Exception:
        return None


def run(nbytes: int, repeat: int) -> dict:
    cp = require_cupy(InstrumentError, where="bench instrument", hint="run it on a GPU machine")
    from concordia import instrument
    from concordia.instrument import runtime

    n = max(1024, nbytes // 4)
    x = cp.random.standard_normal(n, dtype=cp.float32)
    y = cp.random.standard_normal(n, dtype=cp.float32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    launches = {"per-element": ((n + 255) // 256, 256), "grid-stride": (4 * sms, 256)}
    args = (x, y, np.float32(0.5), np.int64(n))
    copy_dst = cp.empty_like(x)
    ceiling_s = _time(cp, lambda: copy_dst.__setitem__(Ellipsis, x), repeat)
    ceiling_bw = 2 * x.nbytes / ceiling_s
    gate = instrument.Gate()
    kernels = {}
    attached: dict[str, tuple] = {}   # variant -> (report, gate or None, tracked regions)
    try:
        for v in VARIANTS:
            instrument.disable()
            if v == "plain":
                kernels[v] = _load(cp, v)
                continue
            settings = dict(SETTINGS[v])
            attach = settings.pop("gate")
            rep = instrument.enable(gate=gate if attach else None, **settings)
            if v in EDITS:
                with _EditedRewrite(EDITS[v]) as edit:
                    fns = _load(cp, v)
                if edit.missing:
                    raise InstrumentError(f"{v}: the rewritten bench kernels lack the text to edit",
                                          where="bench instrument", hint=edit.missing[0])
            else:
                fns = _load(cp, v)
            if settings.get("track_stores"):
                region = instrument.track_array("y", y, 4096)
                instrument.set_regions([region])
                regions = [region]
                if rep.stores_tracked < 2:
                    raise InstrumentError("the store tracker instrumented no store of the bench kernels",
                                          where="bench instrument",
                                          hint=f"{len(rep.modules)} modules rewritten, {rep.hook_sites} hook sites")
            else:
                regions = []
            result = rep.find("stream_axpy").result
            opts = result.options
            if opts.pause_gate != settings.get("pause_gate", True):
                raise InstrumentError(f"{v}: the bench kernels were rewritten with {opts}", where="bench instrument")
            kernels[v] = fns
            attached[v] = (rep, gate if attach else None, regions)
        instrument.disable()
        # disable() detaches every module from its gate and regions (and a
        # module with no gate attached counts no threads): attach each variant's
        # modules again as its settings say, for the timing
        for rep, g, regions in attached.values():
            for rec in rep.modules:
                runtime.attach(rec.handle, rec.result, g, regions)
        shapes = []
        for shape in SHAPES:
            grid, block = launches[shape]
            samples: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
            for _round in range(2):
                for v in VARIANTS:
                    f = kernels[v][shape]
                    samples[v].append(_samples(cp, lambda: f((grid,), (block,), args), repeat))
            base = float(np.median(samples["plain"][0] + samples["plain"][1]))
            r0, r1 = (float(np.median(s)) for s in samples["plain"])
            rows = []
            for v in VARIANTS:
                secs = float(np.median(samples[v][0] + samples[v][1]))
                bw = 3 * 4 * n / secs
                rows.append({"variant": v, "median_us": secs * 1e6, "overhead": secs / base - 1.0,
                             "bandwidth_GBps": bw / 1e9, "ratio_to_copy": bw / ceiling_bw,
                             "registers": _registers(kernels[v][shape])})
            shapes.append({"shape": shape, "launch": {"grid": grid, "block": block},
                           "spread": abs(r0 - r1) / ((r0 + r1) / 2), "variants": rows})
    finally:
        instrument.disable()
        for rep, _g, _regions in attached.values():
            for rec in rep.modules:
                runtime.attach(rec.handle, rec.result, None, [])
        gate.free()
    goal = 0.05
    met = {}
    for s in shapes:
        by = {r["variant"]: r["overhead"] for r in s["variants"]}
        met[s["shape"]] = {v: by[v] <= goal for v in ("exit-hooks", "exit+gate")}
    return {"bytes_per_array": n * 4, "repeat": repeat, "rounds": 2,
            "ceiling": {"what": "device-to-device copy (read + write)", "bandwidth_GBps": ceiling_bw / 1e9},
            "shapes": shapes, "goal": {"exit_hooks_max_overhead": goal, "met": met}}


def _table(res: dict) -> str:
    lines = [f"ceiling (D2D copy): {res['ceiling']['bandwidth_GBps']:.0f} GB/s; "
             f"goal for exit hooks: at most {res['goal']['exit_hooks_max_overhead']:.0%}"]
    for s in res["shapes"]:
        lines.append(f"{s['shape']}: grid {s['launch']['grid']} x {s['launch']['block']}, "
                     f"noise {s['spread']:.1%}")
        lines.append(f"  {'variant':<12} {'median us':>10} {'overhead':>9} {'GB/s':>8} {'/copy':>6} {'regs':>5}")
        for r in s["variants"]:
            lines.append(f"  {r['variant']:<12} {r['median_us']:>10.1f} {r['overhead']:>8.1%} "
                         f"{r['bandwidth_GBps']:>8.0f} {r['ratio_to_copy']:>6.2f} {r['registers'] or '?':>5}")
    return "\n".join(lines)


@click.command("instrument")
@click.option("--size", type=BYTES, default="256M", show_default=True, help="bytes per array")
@click.option("--repeat", type=click.IntRange(min=1), default=50, show_default=True, help="timed launches per round")
@click.option("--quick", is_flag=True, help="small and fast (CI smoke test)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), help="also write the JSON here")
@force_option("--out")
@guarded
def command(size, repeat, quick, as_json, out, force):
    """Overhead of exit hooks, the pause gate and store tracking on a
    memory-bound kernel, beside the uninstrumented kernel.

    Example:

    \b
        concordia-wal bench instrument --json
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if quick:
        size, repeat = min(size, 16 << 20), min(repeat, 10)
    report(run(size, repeat), as_json=as_json, out=out, table=_table, force=force)
