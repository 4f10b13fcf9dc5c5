"""`concordia-wal bench longrun`: a session that runs for a long time against one log.

One numpy state (`--state`, one dirty page per checkpoint, found through
per-page versions as an adapter's scanner finds them, so the figures are the
log's and not a 4 MiB diff's) is checkpointed `--epochs` times (or for
`--seconds`) into one log (`--log-size`, `--segment`), through `Session`,
in two configurations in one run:

    retain      the default Policy: automatic bases and compaction
    noretain    Policy(retain=False), for `--noretain-epochs` (the log fills
                and the run stops at its LogFullError, which is reported)

For each: checkpoint latency (the wall time of `Session.checkpoint()`,
retention's slice included) median and p99 per bin of epochs, log usage (live
segments) and recovery time at sample epochs.  Recovery is a read-only open of
the log, its plan and the numpy restore (what `Session(...).recover()` does),
the min of 3 to 9 (as many as fit in RECOVERY_BUDGET_S after the third, so
that a sample measures the log more than the machine's load), every restore
checked against the state.  For `retain`, the p99
of the checkpoints whose retention hook wrote a base slice or switched
(`during_compaction`, also split `by_hook`: the job's host copies, a slice,
the new catalog, the superblock switch) is set beside the p99 of the others (`without`).
"""

from __future__ import annotations

import math
import time

import click
import numpy as np

from ..common import SIZE, FiniteRange, check_outputs, guarded, report
from .files import Scratch, force_option, save_figure


#: what retention's hook did after a checkpoint (Retention.last; None: nothing)
HOOK_KINDS = (None, "start", "base", "catalog", "switch")


def _samples(epochs: int, n: int) -> list:
    """Epochs to measure recovery at: 200 first, then log-spaced up to `epochs`."""
    pts = {min(200, epochs), epochs}
    if epochs > 200:
        for k in range(n):
            pts.add(int(round(200 * (epochs / 200) ** (k / max(1, n - 1)))))
    return sorted(p for p in pts if 1 <= p <= epochs)


#: recoveries of one sample: at least RECOVERY_REPS[0], at most [1], more than
#: the least only while the sample has taken less than RECOVERY_BUDGET_S
RECOVERY_REPS = (3, 9)
RECOVERY_BUDGET_S = 1.0


def _recovery_s(spec: str, want: np.ndarray) -> float:
    from concordia.wal import Log
    from concordia.wal.apply import apply_plan_numpy
    from concordia.wal.planner import plan

    best = math.inf
    started = time.perf_counter()
    for i in range(RECOVERY_REPS[1]):
        if i >= RECOVERY_REPS[0] and time.perf_counter() - started > RECOVERY_BUDGET_S:
            break
        t0 = time.perf_counter()
        log = Log.open(spec, writable=False, check_pages="last")
        try:
            got = apply_plan_numpy(log, plan(log))
        finally:
            log.close()
        best = min(best, time.perf_counter() - t0)
        if not np.array_equal(got["state"].reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
            raise click.ClickException(f"recovery of {spec} does not match the state")
    return best


def run_one(config: str, spec: str, *, epochs: int, seconds: float | None, state: int, log_size: int,
            segment: int, page_bytes: int, bins: int, samples: int, progress=None) -> dict:
    from concordia import Session
    from concordia.policy import Policy
    from concordia.wal.errors import LogFullError

    pages = state // page_bytes
    a = np.zeros((pages, page_bytes // 4), np.uint32)
    versions = np.zeros(pages, np.uint64)
    policy = Policy() if config == "retain" else Policy(retain=False)
    # the run's own log (Scratch): a fresh one, or the path --log named, which
    # holds nothing but this run's previous log
    s = Session(spec, size=log_size, segment_size=segment, overwrite=True, policy=policy)
    lat = np.zeros(epochs, np.float64)
    busy = np.zeros(epochs, bool)
    did = np.zeros(epochs, np.int8)  # index into HOOK_KINDS: what retention's hook did after the checkpoint
    when = set(_samples(epochs, samples))
    step = max(1, epochs // bins)
    rec, used, full_at, done = [], [], None, 0
    seg_bytes = s.log.volume.segment_bytes
    t_start = time.perf_counter()
    try:
        s.register("state", a, kind="adapter", slot_versions=versions, pages_per_slot=1, page_bytes=page_bytes)
        for e in range(1, epochs + 1):
            p, col = (e * 7919) % pages, e % a.shape[1]
            old = a[p, col]
            a[p, col] = e
            versions[p] += 1
            t0 = time.perf_counter()
            try:
                s.checkpoint()
            except LogFullError as exc:
                a[p, col] = old  # the state stays that of the last commit, which recovery checks
                full_at = {"epoch": e, "error": exc.one_line()}
                break
            lat[e - 1] = time.perf_counter() - t0
            busy[e - 1] = s.retention.last is not None
            did[e - 1] = HOOK_KINDS.index(s.retention.last)  # a kind not listed fails the run, never counts as none
            done = e
            if e % step == 0 or e == epochs:
                used.append([e, len(s.log.volume.live_segments()) * seg_bytes])
            if e in when:
                rec.append([e, _recovery_s(spec, a)])
            if progress and e % 1000 == 0:
                progress(config, e)
            if seconds and time.perf_counter() - t_start >= seconds:
                break
        if done and (not rec or rec[-1][0] != done):
            rec.append([done, _recovery_s(spec, a)])
        counts = dict(s.retention.counts)
        floor = int(s.log.volume.superblock.oldest_epoch)
    finally:
        s.close()
    lat_ms, busy, did = lat[:done] * 1e3, busy[:done], did[:done]
    p99, med = [], []
    for lo in range(0, done, step):
        w = lat_ms[lo:lo + step]
        p99.append([min(done, lo + step), float(np.percentile(w, 99))])
        med.append([min(done, lo + step), float(np.median(w))])
    steady = lat_ms[1:]  # the first checkpoint writes the whole state
    doc = {
        "config": config, "epochs": done, "seconds": time.perf_counter() - t_start,
        "policy": {k: getattr(policy, k) for k in ("retain", "base_every_bytes", "keep_epochs", "keep_seconds",
                                                    "slice_bytes")},
        "recovery_s_by_epoch": rec,
        "ckpt_ms_p99_by_epoch": p99,
        "ckpt_ms_median_by_epoch": med,
        "log_bytes_by_epoch": used,
        "ckpt_ms_median": float(np.median(steady)) if steady.size else None,
        "ckpt_ms_p99": float(np.percentile(steady, 99)) if steady.size else None,
        "log_full": full_at,
        "retention": counts,
        "oldest_epoch": floor,
    }
    if config == "retain" and done > 1:
        b, q = busy[1:], steady
        doc["during_compaction"] = {"ckpt_ms_p99": float(np.percentile(q[b], 99)) if b.any() else None,
                                    "ckpt_ms_median": float(np.median(q[b])) if b.any() else None,
                                    "checkpoints": int(b.sum())}
        doc["without"] = {"ckpt_ms_p99": float(np.percentile(q[~b], 99)) if (~b).any() else None,
                          "ckpt_ms_median": float(np.median(q[~b])) if (~b).any() else None,
                          "checkpoints": int((~b).sum())}
        # the checkpoints of compaction by what the hook did: its host copies, a slice, a switch
        k = did[1:]
        doc["during_compaction"]["by_hook"] = {
            name: {"checkpoints": int((k == i).sum()), "ckpt_ms_median": float(np.median(q[k == i])),
                   "ckpt_ms_p99": float(np.percentile(q[k == i], 99))}
            for i, name in enumerate(HOOK_KINDS) if i and (k == i).any()}
    if rec:
        doc["recovery_last_over_first"] = rec[-1][1] / rec[0][1]
    return doc


def _table(doc: dict) -> str:
    p = doc["params"]
    lines = [f"longrun: {p['state'] / 2**20:g} MiB state, one dirty page a checkpoint, "
             f"{p['log_size'] / 2**20:g} MiB log of {p['segment'] / 2**20:g} MiB segments ({p['log']})"]
    for c in doc["configs"].values():
        lines.append(f"[{c['config']}] {c['epochs']} epochs in {c['seconds']:.0f} s; checkpoint median "
                     f"{c['ckpt_ms_median']:.3f} ms p99 {c['ckpt_ms_p99']:.3f} ms; oldest kept epoch {c['oldest_epoch']}"
                     + (f"; log full at epoch {c['log_full']['epoch']}" if c["log_full"] else ""))
        if "during_compaction" in c:
            d, w = c["during_compaction"], c["without"]
            if d["ckpt_ms_p99"] is not None:
                lines.append(f"  checkpoint p99 during compaction {d['ckpt_ms_p99']:.3f} ms ({d['checkpoints']} "
                             f"checkpoints), without {w['ckpt_ms_p99']:.3f} ms: "
                             f"{d['ckpt_ms_p99'] / w['ckpt_ms_p99']:.2f}x")
                lines.append("  by hook: " + "; ".join(
                    f"{k} {v['checkpoints']} median {v['ckpt_ms_median']:.3f} p99 {v['ckpt_ms_p99']:.3f} ms"
                    for k, v in d.get("by_hook", {}).items()))
        lines.append(f"  {'epoch':>8} {'recovery s':>11} {'log MiB':>8} {'p99 ms':>8}")
        used = dict(c["log_bytes_by_epoch"])
        p99 = c["ckpt_ms_p99_by_epoch"]
        for e, r in c["recovery_s_by_epoch"]:
            u = used.get(e) or next((v for k, v in sorted(used.items()) if k >= e), None)
            q = next((v for k, v in p99 if k >= e), None)
            lines.append(f"  {e:>8} {r:>11.4f} {'' if u is None else f'{u / 2**20:8.0f}':>8} "
                         f"{'' if q is None else f'{q:8.3f}':>8}")
    return "\n".join(lines)


def _plot(doc: dict, path: str, *, replace: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for c in doc["configs"].values():
        name = c["config"]
        if c["log_bytes_by_epoch"]:
            ax[0, 0].plot(*zip(*[(e, b / 2**20) for e, b in c["log_bytes_by_epoch"]]), label=name)
        if c["recovery_s_by_epoch"]:
            ax[0, 1].plot(*zip(*c["recovery_s_by_epoch"]), "o-", label=name)
        if c["ckpt_ms_median_by_epoch"]:
            ax[1, 0].plot(*zip(*c["ckpt_ms_median_by_epoch"]), label=f"{name} median")
            ax[1, 0].plot(*zip(*c["ckpt_ms_p99_by_epoch"]), "--", label=f"{name} p99")
        if c.get("during_compaction", {}).get("ckpt_ms_p99") is not None:
            ax[1, 1].bar([f"{name}\nduring compaction", f"{name}\nwithout"],
                         [c["during_compaction"]["ckpt_ms_p99"], c["without"]["ckpt_ms_p99"]])
    ax[0, 0].axhline(doc["params"]["log_size"] / 2**20, ls=":", c="k", label="log size")
    ax[0, 0].set(xlabel="epoch", ylabel="MiB of live segments", title="log usage")
    ax[0, 1].set(xlabel="epoch", ylabel="s", xscale="log", title="recovery (open + plan + restore, min of 3-9)",
                 ylim=(0, None))
    ax[1, 0].set(xlabel="epoch", ylabel="ms", yscale="log", title="checkpoint latency per bin")
    ax[1, 1].set(ylabel="ms", title="checkpoint p99")
    for a in ax.flat[:3]:
        a.legend(fontsize=8)
    fig.suptitle(f"Concordia long run: {doc['params']['state'] / 2**20:g} MiB state, "
                 f"{doc['params']['log_size'] / 2**20:g} MiB log")
    fig.tight_layout()
    save_figure(fig, path, replace=replace)


@click.command("longrun")
@click.option("--epochs", type=click.IntRange(min=2), default=100_000, show_default=True,
              help="checkpoints with retention on")
@click.option("--seconds", type=FiniteRange(min=0, min_open=True), default=None,
              help="stop each configuration after this long instead (whichever comes first)")
@click.option("--noretain-epochs", type=click.IntRange(min=0), default=20_000, show_default=True,
              help="checkpoints without retention (0: skip; the run stops where the log is full)")
@click.option("--state", type=SIZE, default="4M", show_default=True, help="bytes of state")
@click.option("--log-size", type=SIZE, default="64M", show_default=True)
@click.option("--segment", type=SIZE, default="1M", show_default=True, help="segment size of the log")
@click.option("--page-bytes", type=int, default=4096, show_default=True)
@click.option("--log", "spec", default=None,
              help="where the log lives: a path that does not exist or holds nothing, refused otherwise "
                   "(default: a shm: log of this run); a file made here is removed afterwards")
@click.option("--bins", type=click.IntRange(min=1), default=50, show_default=True,
              help="bins of epochs for the latency curves")
@click.option("--samples", type=click.IntRange(min=2), default=10, show_default=True,
              help="epochs at which recovery is measured (log-spaced from 200)")
@click.option("--quick", is_flag=True, help="2,000 + 500 epochs (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="write a PNG of the curves")
@force_option("--out", "--plot")
@guarded
def command(epochs, seconds, noretain_epochs, state, log_size, segment, page_bytes, spec, bins, samples, quick,
            as_json, out, plot, force):
    """A long session against one log, with and without retention: log usage,
    checkpoint latency (median, p99) and recovery time against epochs.

    Example:

    \b
        concordia-wal bench longrun --quick
        concordia-wal bench longrun --epochs 100000 --out longrun.json --plot longrun.png
    """
    check_outputs(force, out, plot)
    if quick:
        epochs, noretain_epochs = 2000, 500
    if page_bytes <= 0 or page_bytes % 64:
        raise click.BadParameter(f"{page_bytes} is not a positive multiple of 64", param_hint="--page-bytes")
    if state < page_bytes or state % page_bytes:
        raise click.BadParameter(f"{state} bytes is not a whole number of {page_bytes}-byte pages",
                                 param_hint="--state")
    params = {"epochs": epochs, "seconds": seconds, "noretain_epochs": noretain_epochs, "state": state,
              "log_size": log_size, "segment": segment, "page_bytes": page_bytes, "log": spec or "shm",
              "detector": "versions (one page a checkpoint)"}
    shown = [0.0]

    def progress(config, e):
        if not as_json and time.monotonic() - shown[0] > 10:
            shown[0] = time.monotonic()
            click.echo(f"{config}: epoch {e}", err=True)

    configs = {}
    with Scratch("longrun") as scratch:
        if spec:
            scratch.claim(spec, option="--log")
        for config, n in (("retain", epochs), ("noretain", noretain_epochs)):
            if n:
                log = spec or scratch.log(config)
                configs[config] = run_one(config, log, epochs=n, seconds=seconds, state=state,
                                          log_size=log_size, segment=segment, page_bytes=page_bytes, bins=bins,
                                          samples=samples, progress=progress)
                scratch.discard(log)
    doc = {"bench": "longrun", "params": params, "configs": configs}
    r = configs.get("retain")
    if r and "during_compaction" in r:
        doc["during_compaction"] = r["during_compaction"]["ckpt_ms_p99"]
        doc["without"] = r["without"]["ckpt_ms_p99"]
    report(doc, as_json=as_json, out=out, table=_table, force=force)
    if plot:  # after the JSON is out: a machine without matplotlib still keeps the figures
        _plot(doc, plot, replace=force)
