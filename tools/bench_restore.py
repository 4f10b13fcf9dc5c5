"""`concordia-wal bench restore`: how fast the CPU applier rebuilds regions from
a log, beside a memcpy of the same bytes measured in the same run, and how many
bytes a plan reads against a naive replay of every record.

The log is built in memory: epoch 1 writes every page of two regions, each
later epoch rewrites a random `--dirty` fraction of pages.  The plan of the
latest epoch reads each page once, from the record that wrote it last; the
naive replay reads every committed delta.  Restore is timed with one thread and
with the applier's default pool; the ceiling is a single memcpy of the region
bytes into memory already faulted in, the best of `--repeat` passes.
"""

from __future__ import annotations

import time

import click
import numpy as np

from .common import SIZE, emit_json, guarded


def build_log(size: int, epochs: int, dirty: float, page_bytes: int, seed: int = 7):
    """A memory log holding two regions of `size` bytes together and `epochs`
    committed epochs; returns (log, {name: array at the last epoch})."""
    from concordia.wal import Log
    from concordia.wal.format import page_crcs_of, region_digest

    kv_bytes = (size * 3 // 4) // page_bytes * page_bytes
    ad_bytes = max(page_bytes, (size - kv_bytes) // 4 * 4)
    live = {"kv": np.zeros(kv_bytes // 2, np.float16), "adapter": np.zeros(ad_bytes // 4, np.float32)}
    seg = 16 << 20
    need = (size * (1 + dirty * (epochs - 1)) * 1.3) + 64 * seg
    log = Log.create(f"memory:", size=int(-(-need // seg) * seg), segment_size=seg)
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


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(size: int, epochs: int, dirty: float, page_bytes: int, repeat: int, threads: int | None) -> dict:
    from concordia.wal.apply import apply_plan_numpy, default_threads
    from concordia.wal.planner import plan

    t0 = time.perf_counter()
    log, live = build_log(size, epochs, dirty, page_bytes)
    build_s = time.perf_counter() - t0
    try:
        plan_s = _best(lambda: plan(log), repeat)
        p = plan(log)
        restored = sum(rp.region.nbytes for rp in p.regions.values())
        threads = threads or default_threads()
        result = {}

        def restore(n):
            result["arrays"] = apply_plan_numpy(log, p, threads=n)

        one_s = _best(lambda: restore(1), repeat)
        pool_s = _best(lambda: restore(threads), repeat)
        for n, a in live.items():
            if not np.array_equal(result["arrays"][n].view(np.uint8), a.view(np.uint8)):
                raise AssertionError(f"restored region {n} differs from the state written")
        # ceiling: one memcpy of the same bytes, destination already faulted in
        src = np.random.default_rng(1).integers(0, 256, restored, dtype=np.uint8)
        dst = np.empty_like(src)
        dst[:] = 0
        mem_s = _best(lambda: np.copyto(dst, src), repeat)
        crc_s = _best(lambda: __import__("crc32c").crc32c(src), repeat)
    finally:
        log.close()
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    return {
        "benchmark": "restore",
        "params": {"size": size, "epochs": epochs, "dirty": dirty, "page_bytes": page_bytes,
                   "repeat": repeat, "threads": threads},
        "build_seconds": build_s,
        "restored_bytes": restored,
        "plan": {"seconds": plan_s, "bytes_to_read": p.bytes_to_read, "naive_bytes": p.naive_bytes,
                 "read_ratio_to_naive": p.bytes_to_read / p.naive_bytes if p.naive_bytes else None,
                 "records": sum(len(rp.sources) for rp in p.regions.values())},
        "ceiling": {"what": "memcpy of the restored bytes", "gb_per_s": gb(restored, mem_s),
                    "crc32c_gb_per_s": gb(restored, crc_s)},
        "results": [
            {"threads": 1, "seconds": one_s, "gb_per_s": gb(restored, one_s),
             "ratio_to_memcpy": mem_s / one_s},
            {"threads": threads, "seconds": pool_s, "gb_per_s": gb(restored, pool_s),
             "ratio_to_memcpy": mem_s / pool_s},
        ],
    }


def _table(doc: dict) -> str:
    p = doc["plan"]
    lines = [
        f"restore of {doc['restored_bytes'] / 2**20:.1f} MiB after {doc['params']['epochs']} epochs "
        f"({doc['params']['dirty']:.0%} of pages dirty per epoch)",
        f"plan: {p['seconds'] * 1e3:.1f} ms, reads {p['bytes_to_read'] / 2**20:.1f} MiB "
        f"vs {p['naive_bytes'] / 2**20:.1f} MiB naive replay (ratio {p['read_ratio_to_naive']:.2f})",
        f"ceiling: memcpy {doc['ceiling']['gb_per_s']:.2f} GB/s, crc32c {doc['ceiling']['crc32c_gb_per_s']:.2f} GB/s",
        f"{'threads':>8} {'seconds':>9} {'GB/s':>8} {'ratio':>7}",
    ]
    for r in doc["results"]:
        lines.append(f"{r['threads']:>8} {r['seconds']:>9.4f} {r['gb_per_s']:>8.2f} {r['ratio_to_memcpy']:>7.2f}")
    return "\n".join(lines)


@click.command("restore")
@click.option("--size", type=SIZE, default="256M", show_default=True, help="bytes of region state")
@click.option("--epochs", type=int, default=16, show_default=True, help="committed epochs")
@click.option("--dirty", type=float, default=0.1, show_default=True, help="fraction of pages each epoch rewrites")
@click.option("--page-bytes", type=SIZE, default="4096", show_default=True)
@click.option("--repeat", type=int, default=3, show_default=True, help="timed passes (best kept)")
@click.option("--threads", type=int, default=None, help="applier threads (default: the applier's pool)")
@click.option("--quick", is_flag=True, help="8 MiB, 6 epochs, one pass (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@guarded
def command(size, epochs, dirty, page_bytes, repeat, threads, quick, as_json, out):
    """Restore throughput of the CPU applier beside memcpy, and bytes read by a
    plan against naive replay.

    Example:

        concordia-wal bench restore --quick
        concordia-wal bench restore --size 1G --epochs 32 --json
    """
    if quick:
        size, epochs, repeat = 8 << 20, 6, 1
    if size <= 0 or epochs < 1 or repeat < 1 or not 0 < dirty <= 1 or page_bytes <= 0 or page_bytes % 64:
        raise click.BadParameter("size, epochs, repeat must be positive, dirty in (0, 1], page bytes a multiple of 64")
    doc = run(size, epochs, dirty, page_bytes, repeat, threads)
    if out:
        import json

        with open(out, "w") as f:
            json.dump(doc, f, indent=2)
    if as_json:
        emit_json(doc)
    else:
        click.echo(_table(doc))
