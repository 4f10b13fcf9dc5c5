"""`concordia-wal bench append`: append + commit throughput of page batches
(4 KiB pages, 1 to 1024 pages per record, a commit every few MiB) on a shm log
and on a file log, beside, on the same medium and with the same commit cadence:

* the ceiling: for shm, memcpy plus CRC32C of the same bytes into a mapping of
  the same kind, one CRC32C call per record, the fastest of three ways
  (SHM_CEILINGS): copy then the `crc32c` package, copy then the page CRC
  helper the log uses, or the helper copying and hashing in one pass
  (`ceiling_package_crc` is the first alone, the ceiling of earlier rounds); for a file, sequential write plus fdatasync per commit;
* SQLite in WAL mode inserting the same blobs (one transaction per commit;
  synchronous=FULL on a file, NORMAL on shm where a sync reaches nothing);
* LMDB inserting the same blobs (sync per commit on a file, none on shm).

The file log starts writeback of each MiB of an epoch while it writes the
rest (sync_file_range), which the ceiling does not: its ratio says how close
the whole log comes to bare synced writes of the same bytes, with the device
busy while the log hashes and frames, not that any one part costs less.

Every target is preallocated and touched before the timed pass, so page
faults and block allocation are not what is measured: the file log's file is
created with posix_fallocate, then every byte is written with zeros (pwritev)
and synced (FILE_TARGETS); the ceiling's file is written with zeros (1 MiB
writes) and fsynced.  Both then overwrite written extents whose pages are in
the page cache and clean, so neither sync has blocks to allocate or unwritten
extents to convert; the log's file is larger (its whole volume, about three
segments more than the payload), the ceiling's exactly the payload.  Then a full
verify pass of the shm log (every checksum) is timed beside one CRC32C call
over the same bytes.  Goals (issue 3): shm >= 70% of the ceiling for records of
256 KiB and more, file >= 85% of the synced-write ceiling and ahead of SQLite
and LMDB, verify >= 5 GB/s on one core.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time

import click
import numpy as np
from crc32c import crc32c

from concordia.devmem import open_backend
from concordia.wal import Log, pagecrc

from ..common import BYTES, SIZE, check_outputs, guarded, report
from .files import SHM_DIR, Scratch, force_option

PAGE = 4096
SIZES = (1, 4, 16, 64, 256, 1024)
QUICK_SIZES = (1, 64, 256)
MEDIA = ("shm", "file")
#: the ways the shm ceiling copies and hashes a record (the fastest counts)
SHM_CEILINGS = ("package", "helper", "fused")
#: how each file of the file medium is made before its timed pass (see above)
FILE_TARGETS = {
    "log": "posix_fallocate of the whole volume, zeros written over all of it with pwritev, msync",
    "ceiling": "zeros written over the payload's length with 1 MiB write(2) calls, fsync, seek to 0",
}


def _source() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (1024, PAGE), dtype=np.uint8)


def _plan(total: int, npp: int):
    rec = npp * PAGE
    nrec = max(1, total // rec)
    return rec, nrec, nrec * rec


def _concordia(spec: str, src, npp: int, nrec: int, commit_bytes: int, seg: int):
    """Seconds for nrec appends + commits, and the log (left open for verify)."""
    rec = npp * PAGE
    need = nrec * (rec + 128) + (nrec * rec // commit_bytes + 2) * 128
    size = (need // seg + 3) * seg + (1 << 20)
    log = Log.create(spec, size=size, segment_size=seg)  # a new log in the run's own folder (Scratch)
    rid = log.define_region("bench", np.uint8, (1024 * PAGE,), PAGE, "opaque")
    app = log.appender
    ids = np.arange(npp, dtype=np.uint32)
    batches = [src[k:k + npp] for k in range(0, 1024, npp)]
    epoch, since = 1, 0
    t0 = time.perf_counter()
    for i in range(nrec):
        app.append_page_batch(epoch, rid, ids, batches[i % len(batches)])
        since += rec
        if since >= commit_bytes:
            app.commit(epoch)
            epoch, since = epoch + 1, 0
    if since:
        app.commit(epoch)
    return time.perf_counter() - t0, log


def _ceiling_shm(path: str, src, npp: int, nrec: int, how: str) -> float:
    """memcpy plus one CRC32C call over each record's bytes into a shm mapping.
    how: "package" (copy, then the crc32c package), "helper" (copy, then the
    page CRC helper over the record as one row), "fused" (the helper copies and
    hashes the record in one pass, as the log copies and hashes each page)."""
    rec = npp * PAGE
    b = open_backend(f"shm:{path}", size=(nrec * rec // (1 << 20) + 1) * (1 << 20), create=True)  # Scratch's
    try:
        dst = b.array
        dst[:] = 0  # touch every page, as the log's zero fill does
        flat = src.reshape(-1)
        t0 = time.perf_counter()
        off = 0
        for i in range(nrec):
            s = (i * rec) % flat.size
            d = dst[off:off + rec]
            if how == "fused":
                pagecrc.copy_page_crcs(d, flat[s:s + rec].reshape(1, rec))
            else:
                np.copyto(d, flat[s:s + rec])
                if how == "package":
                    crc32c(d)
                else:
                    pagecrc.page_crcs(d.reshape(1, rec))
            off += rec
        return time.perf_counter() - t0
    finally:
        b.close()
        os.unlink(path)


def _ceiling_file(path: str, src, npp: int, nrec: int, commit_bytes: int) -> float:
    rec = npp * PAGE
    flat = src.reshape(-1)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # a fresh path of the run's (Scratch)
    try:
        zeros = bytes(1 << 20)
        for _ in range(-(-nrec * rec // len(zeros))):  # preallocate, as the log is
            os.write(fd, zeros)
        os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_SET)
        since = 0
        t0 = time.perf_counter()
        for i in range(nrec):
            s = (i * rec) % flat.size
            os.write(fd, memoryview(flat[s:s + rec]))
            since += rec
            if since >= commit_bytes:
                os.fdatasync(fd)
                since = 0
        if since:
            os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def _sqlite(path: str, src, npp: int, nrec: int, commit_bytes: int, synced: bool) -> float:
    rec = npp * PAGE
    flat = src.reshape(-1)
    blobs = [bytes(flat[s:s + rec]) for s in range(0, flat.size, rec)]
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if synced else 'NORMAL'}")
        db.execute("CREATE TABLE pages (id INTEGER PRIMARY KEY, data BLOB)")
        since = 0
        t0 = time.perf_counter()
        db.execute("BEGIN")
        for i in range(nrec):
            db.execute("INSERT INTO pages VALUES (?, ?)", (i, blobs[i % len(blobs)]))
            since += rec
            if since >= commit_bytes:
                db.execute("COMMIT")
                db.execute("BEGIN")
                since = 0
        db.execute("COMMIT")
        return time.perf_counter() - t0
    finally:
        db.close()
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(path + suffix)
            except OSError:
                pass


def _lmdb(path: str, src, npp: int, nrec: int, commit_bytes: int, synced: bool) -> float | None:
    try:
        import lmdb
    except ImportError:
        return None
    rec = npp * PAGE
    flat = src.reshape(-1)
    blobs = [bytes(flat[s:s + rec]) for s in range(0, flat.size, rec)]
    env = lmdb.open(path, map_size=2 * nrec * (rec + 8192) + (64 << 20), sync=synced,
                    metasync=synced, subdir=True)
    try:
        since = 0
        t0 = time.perf_counter()
        txn = env.begin(write=True)
        for i in range(nrec):
            txn.put(i.to_bytes(8, "big"), blobs[i % len(blobs)], append=True)
            since += rec
            if since >= commit_bytes:
                txn.commit()
                txn = env.begin(write=True)
                since = 0
        txn.commit()
        if synced:
            env.sync(True)
        return time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def _fstype(path: str) -> str | None:
    """The file system type holding `path` (what the file log is measured on)."""
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def run(total: int, sizes, commit_bytes: int, media, workdir: str | None, repeat: int, scratch: Scratch) -> dict:
    """Measure; every file goes in `scratch`'s folders (in /dev/shm for shm,
    in `workdir`, default the temporary folder, for file)."""
    src = _source()
    rows = []
    verify = None
    for medium in media:
        base = SHM_DIR if medium == "shm" else workdir
        synced = medium == "file"
        for npp in sizes:
            rec, nrec, payload = _plan(total, npp)
            seg = 16 << 20 if total <= 64 << 20 else 64 << 20  # a 4 MiB record fits either
            best = {"concordia": [], "ceiling": [], "ceiling_package_crc": [], "sqlite": [], "lmdb": []}
            for r in range(repeat):
                path = scratch.path(f"{npp}-{r}", base)
                spec = f"shm:{path}" if medium == "shm" else f"file:{path}"
                secs, log = _concordia(spec, src, npp, nrec, commit_bytes, seg)
                best["concordia"].append(secs)
                if medium == "shm" and npp == max(sizes) and r == repeat - 1:
                    v = log.verify()
                    raw = log.backend.array
                    t0 = time.perf_counter()
                    crc32c(raw[:v["bytes_checked"]])
                    ceil = time.perf_counter() - t0
                    verify = {"pages_per_record": npp, "bytes": v["bytes_checked"], "ok": v["ok"],
                              "seconds": v["seconds"], "gb_per_s": v["gb_per_s"],
                              "ceiling_crc32c_gb_per_s": v["bytes_checked"] / ceil / 1e9 if ceil else None}
                    verify["ratio"] = verify["gb_per_s"] / verify["ceiling_crc32c_gb_per_s"]
                log.close()
                scratch.discard(spec)
                if medium == "shm":
                    # the ceiling is the fastest way here to copy and CRC32C the bytes
                    # (the helper folds on AVX-512; fused, it reads each byte once)
                    ways = {how: _ceiling_shm(path + "-ceil", src, npp, nrec, how) for how in SHM_CEILINGS}
                    best["ceiling_package_crc"].append(ways["package"])
                    best["ceiling"].append(min(ways.values()))
                else:
                    best["ceiling"].append(_ceiling_file(path + "-ceil", src, npp, nrec, commit_bytes))
                best["sqlite"].append(_sqlite(path + ".sqlite", src, npp, nrec, commit_bytes, synced))
                t = _lmdb(path + ".lmdb", src, npp, nrec, commit_bytes, synced)
                if t is not None:
                    best["lmdb"].append(t)
            gbps = {k: (payload / min(v) / 1e9 if v else None) for k, v in best.items()}
            row = {"medium": medium, "pages_per_record": npp, "record_bytes": rec, "records": nrec,
                   "payload_bytes": payload, "commit_bytes": commit_bytes}
            row.update({f"{k}_gb_per_s": v for k, v in gbps.items()})
            c = gbps["concordia"]
            row["ratio_to_ceiling"] = c / gbps["ceiling"]
            row["x_sqlite"] = c / gbps["sqlite"]
            row["x_lmdb"] = c / gbps["lmdb"] if gbps["lmdb"] else None
            rows.append(row)
    goals = {}
    big = [r for r in rows if r["record_bytes"] >= 256 << 10]
    shm = [r for r in big if r["medium"] == "shm"]
    fil = [r for r in big if r["medium"] == "file"]
    if shm:
        goals["shm_ratio_min_ge_0.70"] = min(r["ratio_to_ceiling"] for r in shm) >= 0.70
    if fil:
        goals["file_ratio_min_ge_0.85"] = min(r["ratio_to_ceiling"] for r in fil) >= 0.85
        goals["file_ahead_of_sqlite_and_lmdb"] = all(
            r["x_sqlite"] > 1 and (r["x_lmdb"] is None or r["x_lmdb"] > 1) for r in fil)
    if verify:
        goals["verify_ge_5_gb_per_s"] = verify["gb_per_s"] >= 5.0
    return {"benchmark": "append",
            "page_crc": {"backend": pagecrc.BACKEND, "kernel": pagecrc.KERNEL, "reason": pagecrc.REASON},
            "shm_ceiling": "fastest of " + ", ".join(SHM_CEILINGS) if "shm" in media else None,
            "file_targets": FILE_TARGETS if "file" in media else None,
            "page_bytes": PAGE, "total_bytes": total, "commit_bytes": commit_bytes,
            "repeat": repeat, "cpu_count": os.cpu_count(), "file_fs": _fstype(scratch.folder(workdir)) if "file" in media else None,
            "results": rows,
            "verify": verify, "goals": goals}


def _table(doc: dict) -> str:
    head = (f"{'medium':6} {'pages':>5} {'record':>9} {'concordia':>10} {'ceiling':>9} {'ratio':>6} "
            f"{'sqlite':>8} {'x':>6} {'lmdb':>8} {'x':>6}   (GB/s)")
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        lm = r["lmdb_gb_per_s"]
        lines.append(
            f"{r['medium']:6} {r['pages_per_record']:>5} {r['record_bytes'] // 1024:>6} KiB "
            f"{r['concordia_gb_per_s']:>10.2f} {r['ceiling_gb_per_s']:>9.2f} {r['ratio_to_ceiling']:>6.2f} "
            f"{r['sqlite_gb_per_s']:>8.2f} {r['x_sqlite']:>6.1f} "
            + (f"{lm:>8.2f} {r['x_lmdb']:>6.1f}" if lm else f"{'-':>8} {'-':>6}"))
    v = doc.get("verify")
    if v:
        lines.append(f"verify (shm, {v['pages_per_record']} pages/record): {v['gb_per_s']:.2f} GB/s, "
                     f"CRC32C ceiling {v['ceiling_crc32c_gb_per_s']:.2f} GB/s, ratio {v['ratio']:.2f}")
    c = doc.get("page_crc") or {}
    lines.append(f"page CRCs: {c.get('backend')}" + (f", {c['kernel']}" if c.get("kernel") else "")
                 + (f" ({c['reason']})" if c.get("reason") else ""))
    for k, ok in doc["goals"].items():
        lines.append(f"goal {k}: {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


@click.command("append")
@click.option("--total", type=BYTES, default="256M", show_default=True, help="payload bytes per measurement")
@click.option("--pages", "sizes", type=click.IntRange(min=1), multiple=True,
              help=f"pages per record (repeatable; default {', '.join(map(str, SIZES))})")
@click.option("--commit-every", "commit_bytes", type=SIZE, default="4M", show_default=True,
              help="payload bytes between commits")
@click.option("--medium", "media", type=click.Choice(MEDIA), multiple=True, help="shm, file (default both)")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="where the file logs go, in a folder of the run's own (default: the temporary folder)")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="timed passes (best kept)")
@click.option("--quick", is_flag=True, help="16 MiB, three record sizes (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(total, sizes, commit_bytes, media, workdir, repeat, quick, as_json, out, force):
    """Append + commit throughput of page batches beside memcpy+CRC32C, SQLite WAL and LMDB.

    Example:

    \b
        concordia-wal bench append --quick
        concordia-wal bench append --pages 256 --pages 1024 --medium shm --json
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if quick:
        total, sizes = 16 << 20, sizes or QUICK_SIZES
    sizes = tuple(sizes) or SIZES
    if total <= 0 or commit_bytes <= 0 or repeat < 1 or any(not 1 <= s <= 1024 for s in sizes):
        raise click.BadParameter("total, commit-every and repeat must be positive, pages 1..1024")
    if workdir is not None and not os.path.isdir(workdir):
        raise click.BadParameter(f"{workdir}: no such folder", param_hint="--dir")
    if "shm" in (media or MEDIA) and not os.path.isdir("/dev/shm"):
        raise click.BadParameter("no /dev/shm on this machine", param_hint="--medium")
    with Scratch("append") as scratch:  # every file of the run goes, however it ends
        doc = run(total, sizes, commit_bytes, media or MEDIA, workdir, repeat, scratch)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
