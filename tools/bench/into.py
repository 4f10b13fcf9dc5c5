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
(`Session.last_recovery.phases`; the device pipeline's names the way it read
the log, `transfer_check_scatter`'s `via`).  The
tier's figure is its last reader's.  --readers sets how many readers run
(default 2).

`--variant NAME:VAR=VALUE[,VAR=VALUE...]` (repeatable) runs readers of the
same log under other environment settings as well (a way of reading it,
`CONCORDIA_RESTORE_READ=copy`, say): each round runs the default's reader and
then each variant's, so the machine's drift falls on all of them alike, and
`variants` in the JSON holds each variant's figures per tier beside the
default's (`vs_default`: the variant's recover_s over the default's, both the
last round's, and the same over the medians of every round).  A variant whose
reader fails is recorded with its one-line `error` and not run again; the
others go on.
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

from ..common import FiniteRange, check_outputs, guarded, report
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
def _child(role: str, *args, env: dict | None = None) -> dict:
    """Run `_<role>(*args)` in a fresh Python process (with `env` added to
    this one's environment); its last stdout line, as JSON."""
    code = f"import sys; from concordia.tools.bench import into as b; b._{role}(*sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **env} if env else None)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        said = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        how = f"exit {proc.returncode}" if proc.returncode >= 0 else f"signal {-proc.returncode}"
        raise RuntimeError(f"bench into: the {role} ended ({how}): {said}")
    return json.loads(lines[-1])


def parse_variants(specs) -> dict:
    """{name: {VAR: VALUE}} from --variant NAME:VAR=VALUE[,VAR=VALUE...]
    options; a malformed one is a click.UsageError naming it."""
    out = {}
    for spec in specs:
        name, _, settings = spec.partition(":")
        name = name.strip()
        env = {}
        for item in settings.split(","):
            var, eq, value = item.strip().partition("=")
            if not eq or not var or not var.replace("_", "").isalnum() or not var.isupper():
                raise click.UsageError(f"--variant {spec!r}: {item.strip() or '(nothing)'} is no VAR=VALUE "
                                       "(an upper-case environment variable)")
            env[var] = value
        if not name or name == "default" or name in out:
            raise click.UsageError(f"--variant {spec!r}: name it NAME:VAR=VALUE, a name other than "
                                   f"'default' and the other variants'")
        out[name] = env
    return out


def _say(progress, tier: str, who: str, r: dict) -> None:
    if progress:
        progress(f"{tier}{'' if who == 'default' else f' [{who}]'}: open {r['open_s']:.3f} s, "
                 f"recover {r['recover_s']:.3f} s ({r['GBps']:.1f} GB/s, {r['ratio_to_h2d']:.3f} of H2D), "
                 f"identical {r['identical']}; "
                 + ", ".join(f"{k} {v['s']:.3f}" for k, v in r["phases"].items() if k != "open"))


def _figure(runs: list) -> dict:
    """A tier's figure from its readers' runs: the last reader's, with every run's summary."""
    last = dict(runs[-1])
    last["runs"] = [{k: r[k] for k in ("open_s", "recover_s", "total_s", "ratio_to_h2d", "identical")}
                    for r in runs]
    return last


def run(nbytes: int, tensors: int, deltas: int, tiers, gpu: bool, readers: int = 2,
        progress=None, variants: dict | None = None) -> dict:
    variants = variants or {}
    out = {"device": "gpu" if gpu else "cpu", "tensors": tensors, "dtype": "bfloat16", "deltas": deltas,
           "measured_through": {
               "recover_s": "Session(log, create=False).recover(into={name: tensor}) in a fresh process, "
                            "synchronized (plan, check, transfer, scatter)",
               "open_s": "Session(log, create=False)",
               "total_s": "open_s + recover_s (fresh_total)",
               "ratio_to_h2d": "bytes / recover_s over the pinned host-to-device copy measured in the "
                               "same process"},
           "tiers": {}}
    if variants:
        out["variants"] = {name: {"env": env, "tiers": {}} for name, env in variants.items()}
    args = (nbytes, tensors, deltas, "1" if gpu else "0")
    for tier in tiers:
        with Scratch("into") as scratch:   # the tier's log goes, however the run ends
            spec = scratch.log("into", tier)   # hugetlb: the default mount, or a one-line error
            wrote = _child("writer", spec, *args)
            runs = {name: [] for name in ("default", *variants)}
            failed = {}   # variant -> its reader's one line: its later rounds are not run
            for _ in range(readers):   # a round: the default's reader, then each variant's
                for name, env in (("default", None), *variants.items()):
                    if name in failed:
                        continue
                    try:
                        runs[name].append(_child("reader", spec, *args, env=env))
                    except RuntimeError as exc:
                        if name == "default":
                            raise
                        failed[name] = str(exc)
                        if progress:
                            progress(f"{tier} [{name}]: {exc}")
                        continue
                    _say(progress, tier, name, runs[name][-1])
        out["tiers"][tier] = {**_figure(runs["default"]), "writer": wrote}
        base = out["tiers"][tier]
        base_med = float(np.median([r["recover_s"] for r in runs["default"]]))
        for name in variants:
            if name in failed:   # recorded, not a figure: the default's and the other variants' stand
                out["variants"][name]["tiers"][tier] = {"error": failed[name]}
                continue
            fig = _figure(runs[name])
            med = float(np.median([r["recover_s"] for r in runs[name]]))
            fig["vs_default"] = {"recover_s": fig["recover_s"] / base["recover_s"],
                                 "median_recover_s": med / base_med}
            out["variants"][name]["tiers"][tier] = fig
    out["identical"] = all(r["identical"] for t in out["tiers"].values() for r in t["runs"]) and all(
        r["identical"] for v in out.get("variants", {}).values() for t in v["tiers"].values()
        for r in t.get("runs", ()))
    return out


def _table(r: dict) -> str:
    lines = [f"{'tier':8} {'variant':12} {'GiB':>6} {'open s':>8} {'recover s':>10} {'total s':>8} {'GB/s':>7} "
             f"{'H2D GB/s':>9} {'ratio':>6} {'vs dflt':>7} identical"]
    rows = [("default", tier, t) for tier, t in r["tiers"].items()]
    rows += [(name, tier, t) for name, v in r.get("variants", {}).items() for tier, t in v["tiers"].items()]
    for name, tier, t in sorted(rows, key=lambda row: list(r["tiers"]).index(row[1])):
        if "error" in t:
            lines.append(f"{tier:8} {name:12} failed: {t['error']}")
            continue
        vs = f"{t['vs_default']['recover_s']:7.3f}" if "vs_default" in t else f"{'':7}"
        lines.append(f"{tier:8} {name:12} {t['bytes'] / GIB:6.2f} {t['open_s']:8.3f} {t['recover_s']:10.3f} "
                     f"{t['total_s']:8.3f} {t['GBps']:7.1f} {t['h2d_GBps']:9.1f} {t['ratio_to_h2d']:6.3f} {vs} "
                     f"{t['identical']}")
    return "\n".join(lines)


@click.command("into")
@click.option("--gib", default=10.0, show_default=True, type=FiniteRange(min=0, min_open=True),
              help="State to protect and recover, in GiB.")
@click.option("--tensors", default=40, show_default=True, type=click.IntRange(min=1),
              help="bf16 tensors the state is split into.")
@click.option("--deltas", default=8, show_default=True, type=click.IntRange(min=0),
              help="Delta checkpoints after the base.")
@click.option("--tiers", default="shm,hugetlb", show_default=True,
              help="Comma-separated tiers of the log: shm, hugetlb, file.")
@click.option("--readers", default=2, show_default=True, type=click.IntRange(min=1),
              help="Fresh reader processes a tier (and a variant); the figure is the last one's.")
@click.option("--variant", "variant_specs", multiple=True, metavar="NAME:VAR=VALUE[,VAR=VALUE...]",
              help="Also run readers under these environment settings, alternated with the default's "
                   "(repeatable).")
@click.option("--quick", is_flag=True, help="A small state on the host, shm log (CI smoke test).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@force_option("--out")
@guarded
def command(gib, tensors, deltas, tiers, readers, variant_specs, quick, as_json, out, force):
    """Recover --gib GiB of state into --tensors bf16 PyTorch tensors in a
    fresh process, on each tier, against the host-to-device copy measured
    there.

    Example:

    \b
        concordia-wal bench into --gib 10 --tiers shm,hugetlb --out into.json
        concordia-wal bench into --tiers hugetlb --variant pin:CONCORDIA_RESTORE_READ=pin
    """
    check_outputs(force, out)   # before the run: a long benchmark is not refused at its end
    variants = parse_variants(variant_specs)
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
    res = run(int(gib * GIB), tensors, deltas, tiers, gpu, readers=readers, variants=variants,
              progress=None if as_json else (lambda m: click.echo(m, err=True)))
    report(res, as_json=as_json, out=out, table=_table, force=force)
