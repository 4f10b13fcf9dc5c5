"""`concordia-wal bench compact`: compaction throughput on the CPU.

A memory log holds two regions after `--epochs` epochs (epoch 1 writes every
page, later ones a `--dirty` fraction).  Compaction folds the base-less history
into a base at the latest epoch, streaming page chunk by chunk from the log
(`fold`), and once more from a live image of the regions (`live`).  Throughput
is region bytes written as a new base per second, beside a memcpy of the same
bytes and a CRC32C pass over them, measured in the same run (a fold reads,
checks and writes every byte once and CRCs it again as it is encoded, so the
ceiling is bounded by those two).  Bytes the plan reads after compaction and
segments freed by retention are reported too.
"""

from __future__ import annotations

import time

import click
import numpy as np

from .restore import build_log, check_log_options, log_options
from ..common import SIZE, check_outputs, guarded, report
from .files import force_option


def run(size: int, epochs: int, dirty: float, page_bytes: int, chunk: int) -> dict:
    import crc32c

    from concordia.wal.compaction import compact
    from concordia.wal.planner import plan

    log, live = build_log(size, epochs, dirty, page_bytes)
    try:
        region_bytes = sum(r.pages * r.page_bytes for r in log.regions.values())
        before = plan(log)
        segs_before = len(log.volume.live_segments())
        t0 = time.perf_counter()
        rep = compact(log, chunk_bytes=chunk)
        fold_s = time.perf_counter() - t0
        after = plan(log)
        # a second compaction from the live arrays at the same epoch, keeping one base
        t0 = time.perf_counter()
        rep_live = compact(log, live=live, keep_bases=1, chunk_bytes=chunk)
        live_s = time.perf_counter() - t0
        segs_after = len(log.volume.live_segments())
        src = np.random.default_rng(1).integers(0, 256, region_bytes, dtype=np.uint8)
        dst = np.empty_like(src)
        dst[:] = 0
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mem_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        crc32c.crc32c(src)
        crc_s = time.perf_counter() - t0
    finally:
        log.close()
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    ceiling_s = mem_s + crc_s
    return {
        "benchmark": "compact",
        "params": {"size": size, "epochs": epochs, "dirty": dirty, "page_bytes": page_bytes, "chunk": chunk},
        "region_bytes": region_bytes,
        "ceiling": {"what": "memcpy + one crc32c pass over the region bytes",
                    "gb_per_s": gb(region_bytes, ceiling_s), "memcpy_gb_per_s": gb(region_bytes, mem_s),
                    "crc32c_gb_per_s": gb(region_bytes, crc_s)},
        "results": [
            {"source": "fold", "seconds": fold_s, "gb_per_s": gb(region_bytes, fold_s),
             "ratio_to_ceiling": ceiling_s / fold_s, "records_written": rep.records_written},
            {"source": "live", "seconds": live_s, "gb_per_s": gb(region_bytes, live_s),
             "ratio_to_ceiling": ceiling_s / live_s, "records_written": rep_live.records_written},
        ],
        "plan_bytes_before": before.bytes_to_read,
        "naive_bytes_before": before.naive_bytes,
        "plan_bytes_after": after.bytes_to_read,
        "segments_before": segs_before,
        "segments_after": segs_after,
        "segments_freed": len(rep.segments_freed) + len(rep_live.segments_freed),
    }


def _table(doc: dict) -> str:
    c = doc["ceiling"]
    lines = [
        f"compaction of {doc['region_bytes'] / 2**20:.1f} MiB after {doc['params']['epochs']} epochs",
        f"ceiling: memcpy + crc32c {c['gb_per_s']:.2f} GB/s (memcpy {c['memcpy_gb_per_s']:.2f}, "
        f"crc32c {c['crc32c_gb_per_s']:.2f})",
        f"plan reads {doc['plan_bytes_before'] / 2**20:.1f} MiB before (naive {doc['naive_bytes_before'] / 2**20:.1f}), "
        f"{doc['plan_bytes_after'] / 2**20:.1f} MiB after; segments {doc['segments_before']} -> {doc['segments_after']}",
        f"{'source':>8} {'seconds':>9} {'GB/s':>8} {'ratio':>7}",
    ]
    for r in doc["results"]:
        lines.append(f"{r['source']:>8} {r['seconds']:>9.4f} {r['gb_per_s']:>8.2f} {r['ratio_to_ceiling']:>7.2f}")
    return "\n".join(lines)


@click.command("compact")
@log_options("committed epochs before compaction")
@click.option("--chunk", type=SIZE, default="8M", show_default=True, help="bytes per base record (memory bound)")
@click.option("--quick", is_flag=True, help="8 MiB, 6 epochs (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(size, epochs, dirty, page_bytes, chunk, quick, as_json, out, force):
    """Compaction throughput (fold from the log, and from a live image) beside
    memcpy + CRC32C of the same bytes.

    Example:

    \b
        concordia-wal bench compact --quick
        concordia-wal bench compact --size 1G --json
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if quick:
        size, epochs = 8 << 20, 6
    check_log_options(size, epochs, dirty, page_bytes)
    if chunk < page_bytes:
        raise click.BadParameter(f"{chunk} bytes is less than a page ({page_bytes})", param_hint="--chunk")
    doc = run(size, epochs, dirty, page_bytes, chunk)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
