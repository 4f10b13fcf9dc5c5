"""`concordia-wal bench into`: a program's recovery of --gib GiB of state into
its own framework tensors (--tensors bf16 PyTorch tensors, CUDA on a GPU), in
a fresh process, on each tier asked (shm, hugetlb), beside the host-to-device
ceiling measured in that same process.

Three processes a tier, all through public entry points:

* the writer: the tensors filled from seeded generators, protected by a
  `Session` on a new log of the tier (`register`, default 4 KiB pages), a
  base checkpoint, then --deltas checkpoints of a few changed rows each (a
  program that ran a while before it died); then it closes the log;
* the reader, twice (the second finds CuPy's kernel cache on disk, as a
  program deployed beside its logs does): a fresh Python process that has
  imported torch and concordia, started CUDA and allocated its zeroed
  target tensors (what a serving process has done before it recovers), then
  `Session(log, create=False)` (the open) and `recover(into={name: tensor})`
  (plan, check, transfer, scatter), synchronized; the tensors are then
  compared with the writer's, regenerated from the same seeds;
* this process: starts them and gathers their figures.

Figures, each reader's own: `recover_s` (the `recover(into=)` call),
`open_s`, `total_s` (open + recover: `fresh_total`), `GBps` (bytes over
recover_s), `h2d_GBps` (`bench recover`'s ceiling, measured in the same
process after the recovery: pinned host-to-device copy of up to 2 GiB, best
of 5), `ratio_to_h2d` = GBps / h2d_GBps, and the recovery's own phases
(`Session.last_recovery.phases`).  The tier's figure is its last reader's.
Without a GPU (`--quick` in CI) the same runs on the host with CPU tensors:
memcpy is the ceiling then.  CONCORDIA_INTO_PROFILE=FILE appends each
reader's profile (cProfile, open and recover, the 40 costliest by cumulative
time) to FILE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import click
import numpy as np

from ..common import check_outputs, guarded, report
from .files import Scratch, force_option
from .recover import _ceiling, _gpu

GIB = 1 << 30
SEED = 30
#: rows changed by each delta checkpoint, in every tensor
DELTA_ROWS = 4


# ---------------------------------------------------------------- the tensors
def _torch():
    try:
        import torch
    except ImportError:
        raise click.UsageError("bench into measures recovery into PyTorch tensors: PyTorch is not importable") \
            from None
    return torch


def _shape(nbytes: int, tensors: int) -> tuple[int, int]:
    """Each tensor's (rows, 4096 bf16 columns): 8 KiB rows."""
    rows = max(DELTA_ROWS, nbytes // tensors // 8192)
    return rows, 4096


def _fill(torch, i: int, shape, device: str, deltas: int):
    """Tensor `i` as the writer left it after `deltas` delta checkpoints: its
    seeded bits, then rows (k * DELTA_ROWS ...) each bumped once per delta k."""
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED * 1000 + i)
    t = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device, generator=gen)
    for k in range(1, deltas + 1):
        _bump(t, k)
    return t.view(torch.bfloat16)


def _bump(bits, k: int) -> None:
    """Delta k's change to a tensor's bits (int16 view): DELTA_ROWS rows, +k."""
    lo = (k * DELTA_ROWS) % max(1, bits.shape[0] - DELTA_ROWS)
    bits[lo:lo + DELTA_ROWS] += k


def _device(torch, want_gpu: str) -> str:
    return "cuda" if want_gpu == "1" and torch.cuda.is_available() else "cpu"


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the writer
def _writer(spec: str, nbytes: str, tensors: str, deltas: str, gpu: str) -> None:
    """Protect the tensors on a new log at `spec`: a base, then the deltas;
    print {"write_s", "epoch", "log_bytes", "bytes"} and close."""
    from concordia import Session

    torch = _torch()
    nbytes, tensors, deltas = int(nbytes), int(tensors), int(deltas)
    device = _device(torch, gpu)
    shape = _shape(nbytes, tensors)
    ts = [_fill(torch, i, shape, device, 0) for i in range(tensors)]
    total = sum(t.numel() * 2 for t in ts)
    mib = 1 << 20
    seg = min(GIB, max(16 * mib, -(-(total // 8) // mib) * mib))
    size = -(-(total + total // 8 + 4 * seg) // seg) * seg
    t0 = time.perf_counter()
    with Session(spec, size=size, segment_size=seg) as s:
        for i, t in enumerate(ts):
            s.register(f"t{i:02d}", t)
        s.checkpoint()
        for k in range(1, deltas + 1):
            for t in ts:
                _bump(t.view(torch.int16), k)
            _sync(torch, device)
            s.checkpoint()
        epoch = s.epoch
    print(json.dumps({"write_s": time.perf_counter() - t0, "epoch": epoch, "log_bytes": size, "bytes": total}),
          flush=True)


# ---------------------------------------------------------------- the reader
def _reader(spec: str, nbytes: str, tensors: str, deltas: str, gpu: str) -> None:
    """A fresh process's recovery into its own zeroed tensors: print the figures."""
    from concordia import Session

    torch = _torch()
    nbytes, tensors, deltas = int(nbytes), int(tensors), int(deltas)
    device = _device(torch, gpu)
    shape = _shape(nbytes, tensors)
    targets = {f"t{i:02d}": torch.zeros(shape, dtype=torch.bfloat16, device=device) for i in range(tensors)}
    _sync(torch, device)
    profile = os.environ.get("CONCORDIA_INTO_PROFILE")   # a file: where this reader's profile goes
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    s = Session(spec, create=False)
    t1 = time.perf_counter()
    try:
        s.recover(into=targets)
        _sync(torch, device)
        t2 = time.perf_counter()
        if prof is not None:
            prof.disable()
            import pstats

            with open(profile, "a") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
        phases = s.last_recovery.phases
        epoch = s.last_recovery.epoch
    finally:
        s.close()
    total = sum(t.numel() * 2 for t in targets.values())
    identical = all(torch.equal(targets[f"t{i:02d}"].view(torch.int16),
                                _fill(torch, i, shape, device, deltas).view(torch.int16))
                    for i in range(tensors))
    ceiling = _ceiling((_gpu() or np) if device == "cuda" else np, total)   # bench recover's, in this process
    rate = total / (t2 - t1) / 1e9
    print(json.dumps({"open_s": t1 - t0, "recover_s": t2 - t1, "total_s": t2 - t0, "bytes": total,
                      "GBps": rate, "h2d_GBps": ceiling["GBps"], "ceiling": ceiling,
                      "ratio_to_h2d": rate / ceiling["GBps"], "identical": identical, "epoch": epoch,
                      "device": device, "phases": phases}, default=str), flush=True)


# ---------------------------------------------------------------- the run
def _child(role: str, *args) -> dict:
    """Run `_<role>(*args)` in a fresh Python process; its last stdout line, as JSON."""
    code = f"import sys; from concordia.tools.bench import into as b; b._{role}(*sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        said = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        how = f"exit {proc.returncode}" if proc.returncode >= 0 else f"signal {-proc.returncode}"
        raise RuntimeError(f"bench into: the {role} ended ({how}): {said}")
    return json.loads(lines[-1])


def run(nbytes: int, tensors: int, deltas: int, tiers, gpu: bool, readers: int = 2,
        progress=None) -> dict:
    out = {"device": "gpu" if gpu else "cpu", "tensors": tensors, "dtype": "bfloat16", "deltas": deltas,
           "measured_through": {
               "recover_s": "Session(log, create=False).recover(into={name: tensor}) in a fresh process, "
                            "synchronized (plan, check, transfer, scatter)",
               "open_s": "Session(log, create=False)",
               "total_s": "open_s + recover_s (fresh_total)",
               "ratio_to_h2d": "bytes / recover_s over the pinned host-to-device copy measured in the "
                               "same process"},
           "tiers": {}}
    for tier in tiers:
        with Scratch("into") as scratch:   # the tier's log goes, however the run ends
            spec = scratch.log("into", tier)   # hugetlb: the default mount, or a one-line error
            wrote = _child("writer", spec, nbytes, tensors, deltas, "1" if gpu else "0")
            runs = []
            for _ in range(readers):
                runs.append(_child("reader", spec, nbytes, tensors, deltas, "1" if gpu else "0"))
                if progress:
                    r = runs[-1]
                    progress(f"{tier}: open {r['open_s']:.3f} s, recover {r['recover_s']:.3f} s "
                             f"({r['GBps']:.1f} GB/s, {r['ratio_to_h2d']:.3f} of H2D), identical {r['identical']}; "
                             + ", ".join(f"{k} {v['s']:.3f}" for k, v in r["phases"].items() if k != "open"))
        last = dict(runs[-1])
        last["writer"] = wrote
        last["runs"] = [{k: r[k] for k in ("open_s", "recover_s", "total_s", "ratio_to_h2d", "identical")}
                        for r in runs]
        out["tiers"][tier] = last
    out["identical"] = all(r["identical"] for t in out["tiers"].values() for r in t["runs"])
    return out


def _table(r: dict) -> str:
    lines = [f"{'tier':8} {'GiB':>6} {'open s':>8} {'recover s':>10} {'total s':>8} {'GB/s':>7} "
             f"{'H2D GB/s':>9} {'ratio':>6} identical"]
    for tier, t in r["tiers"].items():
        lines.append(f"{tier:8} {t['bytes'] / GIB:6.2f} {t['open_s']:8.3f} {t['recover_s']:10.3f} "
                     f"{t['total_s']:8.3f} {t['GBps']:7.1f} {t['h2d_GBps']:9.1f} {t['ratio_to_h2d']:6.3f} "
                     f"{t['identical']}")
    return "\n".join(lines)


@click.command("into")
@click.option("--gib", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="State to protect and recover, in GiB.")
@click.option("--tensors", default=40, show_default=True, type=click.IntRange(min=1),
              help="bf16 tensors the state is split into.")
@click.option("--deltas", default=8, show_default=True, type=click.IntRange(min=0),
              help="Delta checkpoints after the base.")
@click.option("--tiers", default="shm,hugetlb", show_default=True,
              help="Comma-separated tiers of the log: shm, hugetlb, file.")
@click.option("--quick", is_flag=True, help="A small state on the host, shm log (CI smoke test).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@force_option("--out")
@guarded
def command(gib, tensors, deltas, tiers, quick, as_json, out, force):
    """Recover --gib GiB of state into --tensors bf16 PyTorch tensors in a
    fresh process, on each tier, against the host-to-device copy measured
    there.

    Example:

    \b
        concordia-wal bench into --gib 10 --tiers shm,hugetlb --out into.json
    """
    check_outputs(force, out)   # before the run: a long benchmark is not refused at its end
    profile = os.environ.get("CONCORDIA_INTO_PROFILE")
    if profile and not os.access(os.path.dirname(os.path.abspath(profile)), os.W_OK):
        raise click.UsageError(f"CONCORDIA_INTO_PROFILE={profile}: its folder is not there or not writable")
    torch = _torch()
    tiers = [t.strip() for t in tiers.split(",") if t.strip()]
    bad = [t for t in tiers if t not in ("shm", "hugetlb", "file")]
    if bad or not tiers:
        raise click.UsageError(f"--tiers: unknown tier {bad[0] if bad else '(none)'} (use shm, hugetlb, file)")
    gpu = torch.cuda.is_available() and not quick
    if quick:
        gib, tensors, tiers = 4 / 1024, 4, ["shm"]
    res = run(int(gib * GIB), tensors, deltas, tiers, gpu,
              progress=None if as_json else (lambda m: click.echo(m, err=True)))
    report(res, as_json=as_json, out=out, table=_table, force=force)
