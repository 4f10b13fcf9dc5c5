"""Compaction: fold a base and the deltas after it into a new base, then let
retention give old segments back.

`compact(log, epoch=C)` writes, for every region, a base snapshot at the
committed epoch C (default: the latest).  The image comes either from the log
itself (the plan of C: newest base at or before C plus the deltas after it,
streamed page chunk by page chunk on the CPU, memory bounded by one chunk per
region, the live GPU untouched), or from the live region when the caller hands
its array in `live={name: array}`.

Then one new catalog lists the bases retention keeps, and a single superblock
write (FORMAT.md §3.4 "Reclaim") makes the catalog current, raises
`oldest_epoch` / `oldest_lsn` and frees every segment wholly below the oldest
record still needed.  That write is the commit point: a crash before it
leaves the old catalog in force (the new BASE records are unlisted and ignored),
a crash after it the new one; either way the log restores the same state.
Freed segments come back through roll-over with a new salt and base LSN, so
their stale bytes fail V-R5 and are never read as records.

Retention (`keep_bases`, `keep_epochs`; 0 or None = keep everything):
each region keeps its newest `keep_bases` bases, and every epoch among the
newest `keep_epochs` committed ones stays restorable.  The oldest restorable
epoch is then `floor = max over regions of cut(R)`, where cut(R) is the
newest kept base of R at or before the floor; deltas of R at or before cut(R)
and bases older than it are no longer needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from concordia.wal.apply import take_rows
from concordia.wal.errors import CorruptionError, WalError
from concordia.wal.planner import History, RegionPlan, plan_history, scan
from concordia.wal.snapshot import (
    DEFAULT_CHUNK_BYTES,
    Catalog,
    _page_source,
    append_catalog,
    current_catalog,
    write_base_records,
)


@dataclass
class CompactReport:
    epoch: int
    source: str  # "log" (folded) or "live"
    folded: list = field(default_factory=list)  # region names given a new base
    unchanged: list = field(default_factory=list)  # already had a base at the epoch
    bytes_written: int = 0
    records_written: int = 0
    bases_kept: int = 0
    bases_dropped: int = 0
    floor_epoch: int = 0
    oldest_lsn: int = 0
    segments_freed: list = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


def fold_source(rp: RegionPlan) -> Callable[[int, int], np.ndarray]:
    """The image of one region at its plan's epoch, read from the log itself,
    as a page source for `snapshot.create_base_snapshot` / `write_base_records`:
    (lo, hi) -> pages [lo, hi) as a (hi - lo, page_bytes) uint8 array, gathered
    from the plan's sources (newest base plus the deltas after it) with every
    page CRC-checked (CorruptionError naming the record otherwise), zero where
    nobody wrote.  Memory: one chunk; the log must stay open while it is used.

        p = plan_history(scan(log), epoch, "tolerate_tail", regions=[name])
        create_base_snapshot(log, name, fold_source(p.regions[name]), p.epoch)"""
    from crc32c import crc32c as _crc

    r = rp.region
    pb = r.page_bytes
    owner = np.full(r.pages, -1, dtype=np.int32)
    row = np.zeros(r.pages, dtype=np.int64)
    for i, s in enumerate(rp.sources):
        owner[s.page_ids] = i
        row[s.page_ids] = s.rows

    def pages(lo: int, hi: int) -> np.ndarray:
        out = np.zeros((hi - lo, pb), np.uint8)
        own = owner[lo:hi]
        for i in np.unique(own):
            if i < 0:
                continue
            at = np.flatnonzero(own == i)
            s = rp.sources[int(i)]
            rows = row[lo + at]
            got = take_rows(s.batch.payload, rows)
            stored = np.asarray(s.batch.page_crcs)[rows]
            mv = memoryview(np.ascontiguousarray(got)).cast("B")
            for k in range(at.size):
                c = _crc(mv[k * pb:(k + 1) * pb])
                if c != stored[k]:
                    b = s.batch
                    off = b.offset + (b.length - b.page_ids.size * pb) + int(rows[k]) * pb
                    raise CorruptionError(
                        f"page CRC mismatch for page {lo + int(at[k])} of region {r.name!r} in record "
                        f"lsn {b.lsn}, stored 0x{int(stored[k]):08x}, computed 0x{c:08x}",
                        where=f"segment {b.segment} @ {off:#x}")
            out[at] = got
        return out

    return pages


def retention(entries, committed: list, keep_bases: int, keep_epochs: int, region_ids) -> tuple:
    """(kept entries, floor epoch, cut per region) for catalog `entries` under
    the policy (see the module doc).  Pure."""
    by_region = {rid: sorted((e for e in entries if e.region_id == rid), key=lambda e: -e.epoch)
                 for rid in region_ids}
    if not keep_bases and not keep_epochs:
        return list(entries), 0, {rid: 0 for rid in region_ids}
    want_floor = None
    if keep_epochs and committed:
        newest = committed[-keep_epochs:]
        want_floor = newest[0]
    cut = {}
    for rid, bases in by_region.items():
        c_b = bases[keep_bases - 1].epoch if keep_bases and len(bases) >= keep_bases else 0
        c_e = max((e.epoch for e in bases if e.epoch <= want_floor), default=0) if want_floor else 0
        if keep_bases and keep_epochs:
            cut[rid] = min(c_b, c_e)
        else:
            cut[rid] = c_b if keep_bases else c_e
    floor = max(cut.values(), default=0)
    # every region may drop up to its newest base at or before the floor
    for rid, bases in by_region.items():
        cut[rid] = max((e.epoch for e in bases if e.epoch <= floor), default=0)
    kept = [e for e in entries if e.epoch >= cut.get(e.region_id, 0)]
    return kept, floor, cut


def needed_from(h: History, kept, cut: dict, floor: int) -> int | None:
    """The lowest LSN a restore of any retained epoch still reads (None: nothing
    recorded).  Records below it may be reclaimed."""
    lows = [e.first_lsn for e in kept]
    last_commit = max((c.lsn for c in h.commits.values()), default=0)
    min_cut = min(cut.values(), default=0)
    for b in h.batches:
        if b.base:
            continue
        if b.epoch > cut.get(b.region_id, 0) or b.lsn > last_commit:
            lows.append(b.lsn)
    for ep, c in h.commits.items():
        if ep > min_cut or ep >= floor:
            lows.append(c.lsn)
    if not lows:
        return None
    low = min(lows)
    # never split an epoch: a commit kept keeps every record it counts (V-C4)
    while True:
        firsts = [c.first_lsn for c in h.commits.values() if c.lsn >= low and 0 < c.first_lsn < low]
        if not firsts:
            return low
        low = min(firsts)


def compact(log, epoch: int | None = None, *, live: dict | None = None, keep_bases: int | None = None,
            keep_epochs: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            progress: Callable[[int, int], None] | None = None, reclaim: bool = True) -> CompactReport:
    """Fold every region into a base at committed `epoch` (default: latest),
    list the bases retention keeps in a new catalog, and switch to it while
    freeing the segments nobody needs any more (one superblock write).

    live: {region name: array} images to take instead of folding the log
    (the array must be the region's state at `epoch`; its digest is checked
    against the commit before anything is switched).
    progress(done_bytes, total_bytes) is called after every chunk written."""
    t0 = time.perf_counter()
    h = scan(log)
    p = plan_history(h, "latest" if epoch is None else int(epoch), "tolerate_tail")
    C = p.epoch
    prev = current_catalog(log)
    sb = log.volume.superblock
    keep_bases = prev.keep_bases if keep_bases is None else int(keep_bases)
    keep_epochs = int(sb.retain_epochs) if keep_epochs is None else int(keep_epochs)
    live = dict(live or {})
    unknown = set(live) - set(p.regions)
    if unknown:
        raise WalError(f"no region named {sorted(unknown)[0]!r} to take live")
    rep = CompactReport(epoch=C, source="live" if live else "log")

    todo = []
    for name, rp in p.regions.items():
        if name not in live and rp.base_epoch == C:
            rep.unchanged.append(name)  # its newest base already is the state at C
            continue
        todo.append(rp)
    total = sum(rp.region.pages * rp.region.page_bytes for rp in todo)
    done = [0]

    def tick(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    new = []
    for rp in todo:
        info = rp.region
        src = _page_source(info, live[info.name]) if info.name in live else fold_source(rp)
        entry = write_base_records(log, info, src, C, chunk_bytes=chunk_bytes, progress=tick)
        if rp.digest is not None and entry.digest != rp.digest:
            raise WalError(f"new base of region {info.name!r} at epoch {C} has digest 0x{entry.digest:08x}, "
                           f"the log states 0x{rp.digest:08x}; nothing was switched",
                           hint="a live image must be the region's state at the epoch compacted")
        new.append(entry)
        rep.folded.append(info.name)
        rep.records_written += entry.records
        rep.bytes_written += entry.pages * info.page_bytes

    replaced = {(e.region_id, e.epoch) for e in new}
    entries = [e for e in prev.entries if (e.region_id, e.epoch) not in replaced] + new
    kept, floor, cut = retention(entries, h.committed_epochs(), keep_bases, keep_epochs,
                                 [r.id for r in h.regions.values()])
    floor = max(floor, prev.floor_epoch)
    rep.bases_kept, rep.bases_dropped, rep.floor_epoch = len(kept), len(entries) - len(kept), floor
    if not new and len(kept) == len(prev.entries) and floor == prev.floor_epoch:
        rep.seconds = time.perf_counter() - t0
        return rep  # nothing changes: write nothing

    cat = Catalog(prev.sequence + 1, tuple(kept), keep_bases, floor)
    low = needed_from(h, kept, cut, floor) if reclaim else None
    if low is not None and h.region_lsns and min(h.region_lsns.values()) < low:
        _rewrite_descriptors(log)  # they would go with their segment
    cat_lsn = append_catalog(log, cat, prev.lsn)
    changes = dict(catalog_lsn=cat_lsn, oldest_epoch=floor, retain_epochs=keep_epochs)
    if low is not None:
        rep.segments_freed = log.volume.reclaim_segments(min(low, cat_lsn), **changes)
    else:
        log.volume.write_superblock(**changes)
    rep.oldest_lsn = log.volume.superblock.oldest_lsn
    rep.seconds = time.perf_counter() - t0
    return rep


def _rewrite_descriptors(log) -> None:
    """Append every region descriptor again (same id and attributes) so the log
    keeps describing itself once the segments holding the old ones are freed."""
    from concordia.wal import format as F

    app = log.appender
    for info in log.regions.values():
        body = F.encode_region_body(info.name, info.dtype, info.shape, info.page_bytes, info.kind,
                                    logical=info.logical, framework=info.framework)
        app.append_record(type=F.REC_REGION, epoch=0, body=body, region_id=info.id, page_bytes=info.page_bytes)


__all__ = ["compact", "CompactReport", "fold_source", "retention", "needed_from"]
