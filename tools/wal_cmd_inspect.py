"""`concordia-wal format`, `info` and `dump`: lay out a volume, and look at
one without changing a byte (the inspecting commands map the log read-only)."""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import click

from concordia.wal import format as F
from concordia.wal.errors import UsageError
from concordia.wal.volume import read_slot, slot_copy

from . import render as R
from .common import (EXIT_OK, EXIT_PROBLEMS, LSN, SIZE, FiniteRange, Where, emit_json, guarded, open_volume,
                     unwritten_slot)
from .wal_cmd_scan import DMG, REC, as_decided, decide_walk, record_dict, region_names, walk

#: the incompat feature bits by name (FORMAT.md §2.3), as `info` prints them
INCOMPAT_NAMES = {F.FEATURE_LOGICAL_DTYPE: "LOGICAL_DTYPE", F.FEATURE_IMAGE_BASES: "IMAGE_BASES"}

INFO_SCHEMA = "concordia-wal/info/1"
DUMP_SCHEMA = "concordia-wal/dump/1"


# --------------------------------------------------------------------------- format

@click.command("format")
@click.argument("log")
@click.option("--size", required=True, type=SIZE, help="Bytes of the volume (e.g. 256M, 1GiB).")
@click.option("--segment-size", "segment_size", default=None, type=SIZE,
              help="Bytes per segment, a multiple of 1 MiB (default: 64M, halved down to 1M "
                   "until the log holds 8 segments: 8M for a 64M log, 16M for 128M).")
@click.option("--force", is_flag=True, help="Overwrite an existing log or a target holding data.")
@guarded
def format_cmd(log, size, segment_size, force):
    """Lay out a new, empty volume on LOG (a device or a file, created when absent).

    Refuses a target that holds a Concordia log or any nonzero byte unless
    --force is given; every byte of the target is zeroed.

    Example:

    \b
        concordia-wal format file:./concordia-data/scratch.log --size 64M --segment-size 8M
    """
    from concordia.devmem.opener import parse_spec
    from concordia.wal import Log

    Where.target = log
    if parse_spec(log).kind in ("memory", "pinned"):   # a log of this process: it would end with the command
        raise UsageError("a log in the memory of the process that opens it: formatted here it would be gone "
                         "when this command ends", where=log, hint="format a log that outlives it: shm:NAME, "
                         "file:PATH, hugetlb:PATH or a device")
    # a refused target's hint speaks the command line's words (`--force`), as every error here does
    new = Log.create(log, size=size, segment_size=segment_size, overwrite=force)
    try:
        sb = new.volume.superblock
        where = new.backend.where
        click.echo(f"formatted {where}: {R.size(sb.volume_bytes)}, {sb.segment_count} segments of "
                   f"{R.size(sb.segment_bytes)}, uuid {sb.uuid.hex()}, persist path {new.backend.persist_path}")
    finally:
        new.close()


# --------------------------------------------------------------------------- info

def _slot_report(vol, i: int, off: int, hexdump: bool) -> dict:
    arr = vol.backend.array
    name = "AB"[i]
    where = f"superblock slot {name} @ 0x{off:x}"
    out = {"slot": name, "offset": off, "ok": False, "in_force": False, "sequence": None,
           "crc_stored": None, "crc_computed": None, "problem": None}
    if off + F.SUPERBLOCK_SIZE > arr.size:
        out["problem"] = "slot lies past the end of the target"
        return out
    # one copy, as the open reads it (a writer beside this reader may be rewriting the slot), taken again
    # while it changes; a slot known never written is not
    unused = unwritten_slot(vol) == name
    raw = slot_copy(arr, off) if unused else read_slot(arr, off, where)[0]
    head = raw[:F.SUPERBLOCK_SIZE]
    out["crc_stored"] = int.from_bytes(head[F.SUPERBLOCK_CRC_OFF:F.SUPERBLOCK_CRC_OFF + 4], "little")
    count = int.from_bytes(head[96:100], "little")
    if 0 < count <= F.MAX_SEGMENTS and off + F.slot_bytes_for(count) <= arr.size:
        table = raw[F.SUPERBLOCK_SIZE:] if len(raw) > F.SUPERBLOCK_SIZE else bytes(
            arr[off + F.SUPERBLOCK_SIZE:off + F.SUPERBLOCK_SIZE + F.SEGMENT_ENTRY_SIZE * count])  # (no magic)
        out["crc_computed"] = F.crc32c(table, F.crc32c(head[:F.SUPERBLOCK_CRC_OFF]))
    buf = memoryview(raw)
    if unused:
        out.update(ok=None, problem="never written (the volume has not been updated since it was formatted)")
        return out
    try:
        sb = F.decode_superblock(buf, where=where)
    except Exception as exc:  # the reason the slot is invalid is what info reports
        out["problem"] = getattr(exc, "message", None) or str(exc)
    else:
        out["ok"] = True
        out["sequence"] = sb.sequence
        out["in_force"] = sb.sequence == vol.superblock.sequence and sb.uuid == vol.superblock.uuid
    if hexdump:
        out["hex"] = head.hex()
    return out


def _segment_report(vol, used: dict, hexdump: bool) -> list:
    sb = vol.superblock
    arr = vol.backend.array
    live = {s.index: s for s in vol.live_segments()}
    order = sorted(live.values(), key=lambda s: s.seq)
    prev_of = {s.index: (order[k - 1] if k else None) for k, s in enumerate(order)}
    out = []
    for i, e in enumerate(sb.segments):
        off = vol.segment_offset(i)
        d = {"index": i, "state": "live" if i in live else "free", "offset": off, "seq": e.seq,
             "base_lsn": e.base_lsn, "salt": e.salt, "header_crc": e.header_crc, "header_ok": None,
             "crc_computed": None, "problem": None, "used_bytes": 0}
        if off + F.SEGMENT_HEADER_SIZE <= arr.size:
            raw = bytes(arr[off:off + F.SEGMENT_HEADER_SIZE])
            d["crc_computed"] = F.crc32c(raw[:F.SEGMENT_HEADER_CRC_OFF])
            if hexdump:
                d["hex"] = raw.hex()
        if i in live:
            s = live[i]
            Where.at = s.where(off)
            d.update(seq=s.seq, base_lsn=s.base_lsn, salt=s.salt, header_crc=s.header_crc)
            why = vol.check_segment_header(s, prev_of[i])
            d["header_ok"] = why is None
            d["problem"] = why
            d["used_bytes"] = used.get(i, F.SEGMENT_HEADER_SIZE)
        out.append(d)
    return out


def _persist_path_for_writers(backend) -> str:
    """How a writer of this log makes bytes durable.  A read-only mapping never
    goes through libpmem, so the tier decides, not this process's mapping."""
    if not backend.readonly:
        return backend.persist_path
    if backend.kind in ("shm", "memory", "pinned"):
        return "none"
    if backend.kind in ("pmem", "devdax"):
        from concordia.devmem import libpmem

        return "libpmem" if libpmem.available() else "msync"
    return "msync"


def collect_info(vol, *, stats: bool, hexdump: bool) -> dict:
    """Everything `info` shows, as the documented JSON (docs/cli.md)."""
    from concordia.wal.decide import counts, decide

    sb = vol.superblock
    backend = vol.backend
    # the one decision (R-D1..R-D8), every page checked as verify checks them
    decision = decide(vol, check_pages=True)
    hist = decision.history
    res = hist.result
    problems = list(decision.dropped)
    used = {}
    for r in res.records:
        used[r.segment] = max(used.get(r.segment, 0), r.offset + r.length - vol.segment_offset(r.segment))
    for p in problems:
        if p.segment >= 0 and p.kind != "uncommitted":
            used[p.segment] = max(used.get(p.segment, 0), p.offset + p.length - vol.segment_offset(p.segment))
    slots = [_slot_report(vol, 0, 0, hexdump), _slot_report(vol, 1, sb.slot_bytes, hexdump)]
    segments = _segment_report(vol, used, hexdump)
    names = {r.id: r.name for r in res.regions.values()}
    snapshots = [{"region": names.get(b.region_id, f"#{b.region_id}"), "region_id": b.region_id,
                  "epoch": b.epoch, "records": b.records, "pages": b.pages, "first_lsn": b.first_lsn,
                  "last_lsn": b.last_lsn, "digest": b.digest} for b in hist.bases]
    live_n = sum(s["state"] == "live" for s in segments)
    used_bytes = sum(s["used_bytes"] for s in segments if s["state"] == "live")
    capacity = sb.segment_count * sb.segment_bytes
    keep, writable, reserve = _retention(vol, hist)
    epochs = [c.epoch for c in res.commits]
    uncommitted = sorted({int(p.reason.split()[1]) for p in problems
                          if p.kind == "uncommitted" and p.reason.startswith("epoch ")})
    bad = [p for p in problems if counts(p.kind, decision.mode)]
    out = {
        "schema": INFO_SCHEMA,
        "ok": not bad and all(s["ok"] is not False for s in slots) and all(
            s["header_ok"] is not False for s in segments),
        "exit_code": decision.exit_code,
        "recovery": {"epoch": decision.epoch, "error": decision.error, "regions": dict(decision.regions)},
        "target": dict(backend.info(), writer_persist_path=_persist_path_for_writers(backend)),
        "volume": {
            "uuid": sb.uuid.hex(), "major": sb.major, "minor": sb.minor,
            "compat": sb.compat, "incompat": sb.incompat, "ro_compat": sb.ro_compat,
            "sequence": sb.sequence, "volume_bytes": sb.volume_bytes, "slot_bytes": sb.slot_bytes,
            "segments_off": sb.segments_off, "segment_bytes": sb.segment_bytes,
            "segment_count": sb.segment_count, "next_lsn": sb.next_lsn,
            "next_segment_seq": sb.next_segment_seq, "oldest_lsn": sb.oldest_lsn,
            "oldest_epoch": sb.oldest_epoch, "catalog_lsn": sb.catalog_lsn,
            "retain_epochs": keep.epochs, "retain_bytes": sb.retain_bytes,
            "created_ns": sb.created_ns,
        },
        "slots": slots,
        "segments": segments,
        "regions": [dict(r._asdict(), shape=list(r.shape), logical_dtype=r.logical_dtype)
                    for r in sorted(res.regions.values(), key=lambda r: r.id)],
        "epochs": {
            "committed": len(epochs), "first": epochs[0] if epochs else None,
            "last": epochs[-1] if epochs else None, "incomplete": list(res.incomplete_epochs),
            "uncommitted": uncommitted, "floor": max(sb.oldest_epoch, hist.floor_epoch),
        },
        "snapshots": snapshots,
        "retention": {"keep_bases": keep.bases, "keep_epochs": keep.epochs},
        "space": {
            "capacity_bytes": capacity, "live_segments": live_n, "free_segments": sb.segment_count - live_n,
            "used_bytes": used_bytes, "free_bytes": capacity - used_bytes,
            "writable_bytes": writable, "reserve_bytes": reserve,
        },
        "problems": [p.to_json() for p in problems if p.kind != "uncommitted"],
        "stats": _stats(res.records, names) if stats else None,
    }
    return out


def _retention(vol, hist) -> tuple:
    """(the retention policy `compact` applies when told nothing, the bytes a
    writer can still append, the reserve a compaction leaves free): the
    rules of `concordia.wal.compaction`, read from the volume.  A catalog that
    cannot be read (reported as a problem) counts as keeping every base."""
    from concordia.wal.catalog import EMPTY_CATALOG
    from concordia.wal.compaction import Keep, opening_reserve, record_bytes, volume_space
    from concordia.wal.errors import CorruptionError
    from concordia.wal.snapshot import current_catalog

    try:
        cat = current_catalog(vol)
    except CorruptionError:
        cat = EMPTY_CATALOG
    last = max((c.lsn for c in hist.commits.values()), default=0)
    writable = volume_space(vol, last).bytes
    state = sum(record_bytes(r.nbytes, r.page_bytes) for r in hist.regions.values())
    return Keep.stored(vol.superblock, cat), writable, opening_reserve(state, vol.segment_bytes)


def _stats(records, names: dict) -> dict:
    by_type = defaultdict(lambda: {"records": 0, "bytes": 0, "pages": 0})
    by_region = defaultdict(lambda: {"records": 0, "bytes": 0, "pages": 0})
    for r in records:
        t = F.TYPE_NAMES.get(r.kind, f"0x{r.type:02x}")
        pages = r.count if r.kind == F.REC_PAGE_BATCH else 0
        for key, d in ((t, by_type), (names.get(r.region_id, "-") if r.region_id != F.NO_REGION else "-", by_region)):
            d[key]["records"] += 1
            d[key]["bytes"] += r.length
            d[key]["pages"] += pages
    return {"by_type": dict(by_type), "by_region": dict(by_region)}


def render_info(d: dict, hexdump: bool) -> list[str]:
    from concordia.wal.compaction import Keep

    keep = Keep(d["retention"]["keep_bases"], d["retention"]["keep_epochs"])
    v, t = d["volume"], d["target"]
    lines = [
        f"target        {t['kind']}:{t['path'] or ''}  {R.size(t['size'])}",
        f"tier          {t['kind']} (survives {t['survives']}, durable {'yes' if t['durable'] else 'no'}, "
        f"gpu-mappable {'yes' if t['gpu_mappable'] else 'no'})",
        f"persist path  {t['writer_persist_path']}",
        f"uuid          {v['uuid']}",
        f"version       {v['major']}.{v['minor']}",
        f"features      compat {R.features(v['compat'])}, incompat {R.features(v['incompat'], INCOMPAT_NAMES)}, "
        f"ro_compat {R.features(v['ro_compat'])}",
        f"geometry      {v['segment_count']} segments of {R.size(v['segment_bytes'])} at 0x{v['segments_off']:x}, "
        f"slots of {R.size(v['slot_bytes'])}, volume {R.size(v['volume_bytes'])}",
        f"lsn           next 0x{v['next_lsn']:x}, oldest 0x{v['oldest_lsn']:x}; next segment seq {v['next_segment_seq']}",
        f"retention     keeps {keep.describe()} (compact's default); oldest epoch "
        f"{v['oldest_epoch']}, catalog lsn 0x{v['catalog_lsn']:x}, retain bytes {v['retain_bytes']}",
        f"created       {R.when(v['created_ns'])}",
        "superblock slots",
    ]
    for s in d["slots"]:
        crc = "" if s["crc_stored"] is None else f"crc 0x{s['crc_stored']:08x} "
        state = f"sequence {s['sequence']}" + (" (in force)" if s["in_force"] else "") if s["ok"] else s["problem"]
        if s["ok"] is None:
            crc = ""
        lines.append(f"  {s['slot']} @ 0x{s['offset']:06x}  {crc}{R.mark(s['ok'])}  {state}")
        if hexdump and "hex" in s:
            lines += R.hexdump(bytes.fromhex(s["hex"]), s["offset"])
    lines.append("segments")
    rows = []
    free_run: list[int] = []

    def flush_free():
        if free_run:
            idx = str(free_run[0]) if len(free_run) == 1 else f"{free_run[0]}-{free_run[-1]}"
            rows.append([idx, "free", "-", "-", "-", "-", "[--]", ""])
            free_run.clear()

    for s in d["segments"]:
        if s["state"] == "free":
            free_run.append(s["index"])
            continue
        flush_free()
        rows.append([s["index"], "live", s["seq"], f"0x{s['base_lsn']:x}", f"0x{s['salt']:08x}",
                     R.size(s["used_bytes"]), f"0x{s['header_crc']:08x} {R.mark(s['header_ok'])}",
                     s["problem"] or ""])
    flush_free()
    lines += R.table(rows, ["#", "state", "seq", "base_lsn", "salt", "used", "header crc", ""])
    if hexdump:
        for s in d["segments"]:
            if s["state"] == "live" and "hex" in s:
                lines.append(f"  segment {s['index']} header @ 0x{s['offset']:x}")
                lines += R.hexdump(bytes.fromhex(s["hex"]), s["offset"])
    lines.append("regions")
    if not d["regions"]:
        lines.append("  (none)")
    rows = [[r["id"], r["name"], r["kind"], _dtype_text(r), R.size(r["nbytes"]),
             f"{r['pages']} x {R.size(r['page_bytes'])}"] for r in d["regions"]]
    if rows:
        lines += R.table(rows, ["id", "name", "kind", "dtype[shape]", "bytes", "pages"])
    e = d["epochs"]
    span = f"{e['first']}..{e['last']}" if e["committed"] else "none"
    lines.append(f"epochs        {e['committed']} committed ({span}); restorable from epoch "
                 f"{max(e['floor'], e['first'] or 0) if e['committed'] else '-'}"
                 + (f"; incomplete {e['incomplete']}" if e["incomplete"] else "")
                 + (f"; uncommitted tail {e['uncommitted']}" if e["uncommitted"] else ""))
    if d["snapshots"]:
        lines.append("snapshots")
        lines += R.table([[s["region"], s["epoch"], s["records"], s["pages"], f"0x{s['first_lsn']:x}",
                           f"0x{s['last_lsn']:x}", f"0x{s['digest']:08x}"] for s in d["snapshots"]],
                         ["region", "epoch", "records", "pages", "first_lsn", "last_lsn", "digest"])
    else:
        lines.append("snapshots     none")
    sp = d["space"]
    lines.append(f"space         {R.size(sp['used_bytes'])} used in {sp['live_segments']} live segments, "
                 f"{R.size(sp['free_bytes'])} free ({sp['free_segments']} free segments) of "
                 f"{R.size(sp['capacity_bytes'])}; a writer can append {R.size(sp['writable_bytes'])}, "
                 f"compaction keeps {R.size(sp['reserve_bytes'])} free")
    if d["stats"]:
        lines.append("records by type")
        lines += R.table([[k, v["records"], v["pages"], R.size(v["bytes"])] for k, v in sorted(d["stats"]["by_type"].items())],
                         ["type", "records", "pages", "bytes"])
        lines.append("records by region")
        lines += R.table([[k, v["records"], v["pages"], R.size(v["bytes"])] for k, v in sorted(d["stats"]["by_region"].items())],
                         ["region", "records", "pages", "bytes"])
    for p in d["problems"]:
        lines.append(f"problem       {p['where']}: {p['reason']} ({p['kind']})")
    rc = d.get("recovery") or {}
    if not d["ok"]:
        status = "PROBLEMS FOUND (run concordia-wal verify)"
    elif d.get("exit_code"):
        status = f"RECOVERY INCOMPLETE: {rc.get('error') or 'restores less than the last commit'}"
    else:
        status = "OK"
    lines.append("status        " + status)
    return lines


@click.command("info")
@click.argument("log")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON instead of text.")
@click.option("-x", "--headers-hex", "headers_hex", is_flag=True,
              help="Also dump the superblock slots and live segment headers in hex.")
@click.option("--stats", is_flag=True, help="Count records, pages and bytes per type and per region.")
@guarded
def info_cmd(log, as_json, headers_hex, stats):
    """Show the volume: tier and persist path, superblock slots and segment
    headers with [OK]/[BAD] beside every checksum, feature flags, regions,
    epochs, snapshots and space used.  Read-only.

    Record headers and bodies are checked; page payloads are left to verify.
    Exit 0 when every checksum shown is good, 1 when one is bad.

    Example:

    \b
        concordia-wal info file:./concordia-data/demo.log --stats
        concordia-wal info file:./concordia-data/demo.log -x
    """
    vol = open_volume(log)
    try:
        d = collect_info(vol, stats=stats, hexdump=headers_hex)
    finally:
        vol.close()
    if as_json:
        emit_json(d)
    else:
        click.echo("\n".join(render_info(d, headers_hex)))
    sys.exit(d["exit_code"] if d["ok"] else EXIT_PROBLEMS)


# --------------------------------------------------------------------------- dump

def _type_filter(value: str | None):
    if value is None:
        return None
    key = value.strip().lower().replace("-", "_")
    for code, name in F.TYPE_NAMES.items():
        if key in (name, f"0x{code:02x}", str(code)):
            return name
    if key == "damaged":
        return "damaged"
    raise click.BadParameter(f"unknown record type {value!r}; use one of "
                             f"{', '.join(sorted(F.TYPE_NAMES.values()))}, damaged", param_hint="--type")


def _keep(r: dict, start, end, region, typ, epoch) -> bool:
    if start is not None and r["lsn"] < start:
        return False
    if end is not None and r["lsn"] >= end:
        return False
    if region is not None and region not in (r["region"], str(r["region_id"])):
        return False
    if typ is not None and r["type"] != typ and not (typ == "damaged" and r["crc"] == "BAD"):
        return False
    if epoch is not None and r["epoch"] != epoch:
        return False
    return True


def _dump_records(vol, start, end, region, typ, epoch, limit) -> list:
    """The records `dump` shows.  A walk of the record headers alone (no page
    payload is read) gives the region names and the last commit, which decides
    whether a damaged range is a torn tail; then only the records from `start`
    on are read with every checksum, up to `end` or `limit`, so that looking at
    the end of a long log does not read all of it."""
    heads = list(walk(vol, check_pages=False))
    names = region_names(vol, heads)
    decision = decide_walk(vol, heads)  # torn or corrupt is the reader's call (R-D2)
    if region is not None and region not in names.values() and region not in {str(i) for i in names}:
        # a filter that can match nothing is a mistake, not an empty log
        raise UsageError(f"no region {region!r} in this log (regions: "
                         f"{', '.join(f'{n} (id {i})' for i, n in sorted(names.items())) or 'none'})",
                         where=vol.backend.where)
    recs = []
    for it in walk(vol, check_pages=True, from_lsn=start or 0):
        lsn = it.seg.lsn(it.offset)
        if end is not None and lsn >= end:
            break
        it, tail = as_decided(it, decision)
        r = record_dict(vol, it, names, tail)
        if _keep(r, start, end, region, typ, epoch):
            recs.append(r)
            if limit is not None and len(recs) >= limit:
                break
    return recs, decision


def _dump_stats(recs: list) -> dict:
    by_type = defaultdict(lambda: {"records": 0, "bytes": 0, "pages": 0, "bad": 0})
    by_region = defaultdict(lambda: {"records": 0, "bytes": 0, "pages": 0, "bad": 0})
    for r in recs:
        for key, d in ((r["type"], by_type), (r["region"] or "-", by_region)):
            d[key]["records"] += 1
            d[key]["bytes"] += r["length"]
            d[key]["pages"] += r["pages"]
            d[key]["bad"] += r["crc"] == "BAD"
    return {"by_type": dict(by_type), "by_region": dict(by_region),
            "total": {"records": len(recs), "bytes": sum(r["length"] for r in recs),
                      "pages": sum(r["pages"] for r in recs), "bad": sum(r["crc"] == "BAD" for r in recs)}}


@click.command("dump")
@click.argument("log")
@click.option("--start", type=LSN, default=None, help="First LSN to show (decimal or 0x hex).")
@click.option("--end", type=LSN, default=None, help="Show records below this LSN.")
@click.option("--region", default=None, help="Only records of this region (name or id).")
@click.option("--type", "typ", default=None,
              help="Only records of this type: page_batch, region, commit, catalog, snapshot, pad, damaged.")
@click.option("--epoch", type=click.IntRange(0, None), default=None, help="Only records of this epoch.")
@click.option("--limit", type=click.IntRange(1, None), default=None, help="Stop after N records.")
@click.option("--stats", is_flag=True, help="Summarise per type and per region instead of listing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the documented JSON (with --follow: one JSON object per line).")
@click.option("--follow", is_flag=True, help="Keep printing records as a live writer appends them (Ctrl-C stops).")
@click.option("--interval", type=FiniteRange(0.01, 60), default=0.25, show_default=True,
              help="Seconds between polls with --follow.")
@guarded
def dump_cmd(log, start, end, region, typ, epoch, limit, stats, as_json, follow, interval):
    """One fixed-format line per record, in LSN order, like pg_waldump:
    LSN, segment and offset, type, epoch, region, pages, bytes and CRC status
    (every checksum, page payloads included).  Damaged ranges are shown as
    type 'damaged' with crc BAD.  Read-only.

    Exit 0 when nothing shown is damaged (a torn tail after the last commit
    does not count), 1 otherwise; 2 when --region names no region of the log.

    Example:

    \b
        concordia-wal dump file:./concordia-data/demo.log --type commit --limit 5
        concordia-wal dump file:./concordia-data/demo.log --region kv --stats
    """
    typ = _type_filter(typ)
    if not follow and click.get_current_context().get_parameter_source("interval").name != "DEFAULT":
        raise click.UsageError("--interval is how often --follow looks: give it with --follow")
    if follow:
        if stats:
            raise click.UsageError("--stats and --follow do not go together")
        return _follow(log, start, end, region, typ, epoch, limit, as_json, interval)
    vol = open_volume(log)
    try:
        recs, decision = _dump_records(vol, start, end, region, typ, epoch, limit)
        # R-D8: damage shown that the decision calls corruption, or a problem
        # of the log outside any record (a bad slot, truncated media, a lost catalog)
        bad = any(r["crc"] == "BAD" and not r["tail"] for r in recs) or bool(decision.outside)
        if decision.outside:  # one line, as every error: the rest is verify's to list
            more = len(decision.outside) - 1
            click.echo(f"error: {decision.outside[0]}" + (f" (and {more} more; run concordia-wal verify)"
                                                          if more else ""), err=True)
        if stats:
            st = _dump_stats(recs)
            if as_json:
                emit_json({"schema": DUMP_SCHEMA, "log": vol.backend.where, "stats": st})
            else:
                _print_stats(st)
        elif as_json:
            emit_json({"schema": DUMP_SCHEMA, "log": vol.backend.where, "records": recs})
        else:
            for r in recs:
                click.echo(R.record_line(r))
    finally:
        vol.close()
    sys.exit(EXIT_PROBLEMS if bad else EXIT_OK)


def _print_stats(st: dict) -> None:
    click.echo("by type")
    click.echo("\n".join(R.table([[k, v["records"], v["pages"], v["bytes"], v["bad"]]
                                  for k, v in sorted(st["by_type"].items())],
                                 ["type", "records", "pages", "bytes", "bad"])))
    click.echo("by region")
    click.echo("\n".join(R.table([[k, v["records"], v["pages"], v["bytes"], v["bad"]]
                                  for k, v in sorted(st["by_region"].items())],
                                 ["region", "records", "pages", "bytes", "bad"])))
    t = st["total"]
    click.echo(f"total: {t['records']} records, {t['pages']} pages, {t['bytes']} bytes, {t['bad']} bad")


def _follow(log, start, end, region, typ, epoch, limit, as_json, interval) -> None:
    """Poll the live log through `reader.Follower` (which tracks the position
    by LSN across segments and leaves a segment only once the writer has),
    printing each record as it appears.  Exit 0 when nothing shown was
    damaged, 1 otherwise (Ctrl-C, --limit or --end ends the command)."""
    from concordia.wal.errors import WalError
    from concordia.wal.reader import Follower

    vol = open_volume(log)  # same checks and messages as the other commands
    backend = vol.backend
    follower = Follower(backend, from_lsn=0 if start is None else start)
    seen = {"shown": 0, "bad": False}
    names: dict = {}

    def run() -> None:
        while True:
            cuts = follower.cuts
            try:
                items = follower.poll()
            except WalError as exc:
                raise click.ClickException(exc.message) from None
            if follower.cuts != cuts:
                click.echo(f"note: a writer reopened the log and cut it at lsn 0x{follower.cut_at:x}: "
                           "records shown after that were dropped, what is there now follows", err=True)
            vol = follower.volume
            for it in items:
                Where.at = it[1].where(it[2])
                lsn = it[1].lsn(it[2])
                if it[0] == REC and it.header.type == F.REC_REGION:
                    names.update(region_names(vol, [it]))
                if end is not None and lsn >= end:
                    return
                r = record_dict(vol, it, names, False)
                if _keep(r, start, end, region, typ, epoch):
                    click.echo(_json_line(r) if as_json else R.record_line(r))
                    seen["bad"] = seen["bad"] or r["crc"] == "BAD"
                    seen["shown"] += 1
                    if limit is not None and seen["shown"] >= limit:
                        return
            sys.stdout.flush()
            time.sleep(interval)

    try:
        run()
    except KeyboardInterrupt:
        pass  # Ctrl-C is how following ends
    finally:
        backend.close()
    sys.exit(EXIT_PROBLEMS if seen["bad"] else EXIT_OK)


def _json_line(r: dict) -> str:
    import json

    return json.dumps(r, allow_nan=False)


def _dtype_text(r: dict) -> str:
    """"bfloat16[4, 8] as <u2 (torch)": the logical dtype and shape, the byte
    layout where it differs, the framework where it is not an array."""
    text = f"{r['logical_dtype']}{r['shape']}"
    if r.get("logical"):
        text += f" as {r['dtype']}"
    if r.get("framework", "array") != "array":
        text += f" ({r['framework']})"
    return text
