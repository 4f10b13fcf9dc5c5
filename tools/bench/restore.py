"""`concordia-wal bench restore`: how fast the CPU applier rebuilds regions from
a log, beside a memcpy of the same bytes measured in the same run, and how many
bytes a plan reads against a naive replay of every record.

The log is built in memory: epoch 1 writes every page of two regions, each
later epoch rewrites a random `--dirty` fraction of pages.  The plan of the
latest epoch reads each page once, from the record that wrote it last; the
naive replay reads every committed delta.  Restore is timed with one thread and
with the applier's default pool, into new arrays (the memory is faulted in as
it is written) and into existing arrays (`out=`, memory already faulted in);
the ceiling is a single memcpy of the region bytes into memory already faulted
in (and, for reference, into fresh memory).  Every variant and the ceiling
take turns in each of `--repeat` rounds; the best of each is kept.
"""

from __future__ import annotations

import os
import time

import click
import numpy as np

from ..common import BYTES, SIZE, FiniteRange, check_outputs, guarded, report
from .files import force_option


def log_options(epochs_help: str):
    """The options that shape `build_log`'s log, shared by bench restore and
    bench compact; `check_log_options` checks their values."""
    def wrap(fn):
        for opt in reversed([
            click.option("--size", type=BYTES, default="256M", show_default=True, help="bytes of region state"),
            click.option("--epochs", type=click.IntRange(min=1), default=16, show_default=True, help=epochs_help),
            click.option("--dirty", type=FiniteRange(0, 1, min_open=True), default=0.1, show_default=True,
                         help="fraction of pages each epoch rewrites"),
            click.option("--page-bytes", type=SIZE, default="4096", show_default=True),
        ]):
            fn = opt(fn)
        return fn
    return wrap


def check_log_options(size: int, epochs: int, dirty: float, page_bytes: int) -> None:
    if size <= 0 or epochs < 1 or not 0 < dirty <= 1 or page_bytes <= 0 or page_bytes % 64:
        raise click.BadParameter("size and epochs must be positive, dirty in (0, 1], "
                                 "page bytes a multiple of 64")


def build_log(size: int, epochs: int, dirty: float, page_bytes: int, seed: int = 7):
    """A memory log holding two regions of `size` bytes together and `epochs`
    committed epochs; returns (log, {name: array at the last epoch})."""
    from concordia.wal import Log
    from concordia.wal.format import page_crcs_of, region_digest

    kv_bytes = (size * 3 // 4) // page_bytes * page_bytes
    ad_bytes = max(page_bytes, (size - kv_bytes) // 4 * 4)
    live = {"kv": np.zeros(kv_bytes // 2, np.float16), "adapter": np.zeros(ad_bytes // 4, np.float32)}
    seg = 16 << 20
    # the epochs, and room for what `bench compact` folds beside the free space a
    # compaction must leave (wal.compaction.reserve_bytes: about 2.25 images)
    need = (size * (1 + dirty * (epochs - 1)) * 1.3) + 64 * seg + 3.5 * size
    log = Log.create("memory:", size=int(-(-need // seg) * seg), segment_size=seg)
    ids = {n: log.define_region(n, a.dtype, a.shape, page_bytes, "kv" if n == "kv" else "adapter")
           for n, a in live.items()}
    rng = np.random.default_rng(seed)
    app = log.appender
    for e in range(1, epochs + 1):
        digests = {}
        for n, a in live.items():
            flat = a.reshape(-1).view(np.uint8)
            pages = -(-flat.size // page_bytes)
            if e == 1:
                dirty_ids = np.arange(pages)
            else:
                k = max(1, int(pages * dirty))
                dirty_ids = np.sort(rng.choice(pages, size=k, replace=False))
            padded = np.zeros(pages * page_bytes, np.uint8)
            for p in dirty_ids:
                lo, hi = p * page_bytes, min((p + 1) * page_bytes, flat.size)
                flat[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)
            padded[: flat.size] = flat
            pg = padded.reshape(pages, page_bytes)
            step = max(1, (4 << 20) // page_bytes)
            for i in range(0, dirty_ids.size, step):
                sel = dirty_ids[i:i + step]
                app.append_page_batch(e, ids[n], sel, pg[sel])
            digests[ids[n]] = region_digest(page_crcs_of(pg))
        app.commit(e, digests=digests)
    return log, live


def _best_interleaved(fns: dict, repeat: int) -> dict:
    """Best seconds of each callable over `repeat` rounds, the callables taking
    turns within a round so that load from other processes hits all alike."""
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def run(size: int, epochs: int, dirty: float, page_bytes: int, repeat: int, threads: int | None) -> dict:
    from crc32c import crc32c

    from concordia.wal.apply import apply_plan_numpy, default_threads
    from concordia.wal.planner import plan

    t0 = time.perf_counter()
    log, live = build_log(size, epochs, dirty, page_bytes)
    build_s = time.perf_counter() - t0
    try:
        p = plan(log)
        restored = sum(rp.region.nbytes for rp in p.regions.values())
        threads = threads or default_threads()
        result = {}
        into = {n: np.ones_like(a) for n, a in live.items()}  # existing arrays, faulted in, not zero
        src = np.random.default_rng(1).integers(0, 256, restored, dtype=np.uint8)
        dst = np.empty_like(src)
        dst[:] = 0

        def restore(n, out=None):
            result["arrays"] = apply_plan_numpy(log, p, threads=n, out=out)

        fns = {
            "plan": lambda: plan(log),
            "memcpy": lambda: np.copyto(dst, src),
            "memcpy_fresh": lambda: np.copyto(np.empty_like(src), src),
            "crc32c": lambda: crc32c(src),
            "new_1": lambda: restore(1),
            "new_pool": lambda: restore(threads),
            "into_1": lambda: restore(1, into),
            "into_pool": lambda: restore(threads, into),
        }
        best = _best_interleaved(fns, repeat)
        for n, a in live.items():
            for got in (result["arrays"][n], into[n]):
                if not np.array_equal(got.view(np.uint8), a.view(np.uint8)):
                    raise AssertionError(f"restored region {n} differs from the state written")
    finally:
        log.close()
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    mem_s = best["memcpy"]
    rows = []
    for key, what, n in (("new_1", "new arrays", 1), ("new_pool", "new arrays", threads),
                         ("into_1", "existing arrays", 1), ("into_pool", "existing arrays", threads)):
        s = best[key]
        rows.append({"into": what, "threads": n, "seconds": s, "gb_per_s": gb(restored, s),
                     "ratio_to_memcpy": mem_s / s,
                     "ratio_to_memcpy_fresh": best["memcpy_fresh"] / s if what == "new arrays" else None})
    from concordia.wal import pagecrc

    return {
        "benchmark": "restore",
        "measured_through": ("component: wal.planner.plan + wal.apply.apply_plan_numpy, the CPU applier "
                             "Session.recover runs on the host, without the session's open"),
        "page_crc": {"backend": pagecrc.BACKEND, "reason": pagecrc.REASON},
        "params": {"size": size, "epochs": epochs, "dirty": dirty, "page_bytes": page_bytes,
                   "repeat": repeat, "threads": threads},
        "cpu_count": os.cpu_count(),
        "build_seconds": build_s,
        "restored_bytes": restored,
        "plan": {"seconds": best["plan"], "bytes_to_read": p.bytes_to_read, "naive_bytes": p.naive_bytes,
                 "read_ratio_to_naive": p.bytes_to_read / p.naive_bytes if p.naive_bytes else None,
                 "records": sum(len(rp.sources) for rp in p.regions.values())},
        "ceiling": {"what": "memcpy of the restored bytes into memory already faulted in",
                    "gb_per_s": gb(restored, mem_s),
                    "memcpy_fresh_gb_per_s": gb(restored, best["memcpy_fresh"]),
                    "crc32c_gb_per_s": gb(restored, best["crc32c"])},
        "results": rows,
    }


def _crc_path(doc: dict) -> str:
    c = doc.get("page_crc") or {}
    return f"page CRCs: {c.get('backend')}" + (f" ({c['reason']})" if c.get("reason") else "")


def _table(doc: dict) -> str:
    p = doc["plan"]
    lines = [
        f"restore of {doc['restored_bytes'] / 2**20:.1f} MiB after {doc['params']['epochs']} epochs "
        f"({doc['params']['dirty']:.0%} of pages dirty per epoch)",
        f"plan: {p['seconds'] * 1e3:.1f} ms, reads {p['bytes_to_read'] / 2**20:.1f} MiB "
        f"vs {p['naive_bytes'] / 2**20:.1f} MiB naive replay (ratio {p['read_ratio_to_naive']:.2f})",
        f"ceiling: memcpy {doc['ceiling']['gb_per_s']:.2f} GB/s, crc32c {doc['ceiling']['crc32c_gb_per_s']:.2f} GB/s",
        f"(into memory already faulted in; into fresh memory {doc['ceiling']['memcpy_fresh_gb_per_s']:.2f} GB/s)",
        _crc_path(doc),
        f"{'into':>16} {'threads':>8} {'seconds':>9} {'GB/s':>8} {'ratio':>7}",
    ]
    for r in doc["results"]:
        lines.append(f"{r['into']:>16} {r['threads']:>8} {r['seconds']:>9.4f} {r['gb_per_s']:>8.2f} "
                     f"{r['ratio_to_memcpy']:>7.2f}")
    return "\n".join(lines)


@click.command("restore")
@log_options("committed epochs")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="timed passes (best kept)")
@click.option("--threads", type=click.IntRange(1, None), default=None,
              help="applier threads (default: the applier's pool)")
@click.option("--quick", is_flag=True, help="8 MiB, 6 epochs, one pass (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(size, epochs, dirty, page_bytes, repeat, threads, quick, as_json, out, force):
    """Restore throughput of the CPU applier beside memcpy, and bytes read by a
    plan against naive replay.

    Example:

    \b
        concordia-wal bench restore --quick
        concordia-wal bench restore --size 1G --epochs 32 --json
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if quick:
        size, epochs, repeat = 8 << 20, 6, 1
    check_log_options(size, epochs, dirty, page_bytes)
    doc = run(size, epochs, dirty, page_bytes, repeat, threads)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
