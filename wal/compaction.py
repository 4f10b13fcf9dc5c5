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

Retention (`Keep`: `bases`, `epochs`; 0 = no limit of that kind, both 0 =
keep everything): each region keeps its newest `bases` bases, and every epoch
among the newest `epochs` committed ones stays restorable.  The oldest
restorable epoch is then `floor = max over regions of cut(R)`, where cut(R)
is the newest kept base of R at or before the floor; deltas of R at or before
cut(R) and bases older than it are no longer needed.  A compaction told
nothing applies the policy the log already has (`stored_keep`: the catalog's
`keep_bases`, the superblock's `retain_epochs`), and stores the one it
applied.

Space (`decide`, FORMAT.md §12.5): a compaction run on its own (`compact`)
writes nothing unless, once it has switched, the log still holds the
retention reserve (`reserve_bytes`: what a session that opens the log needs
to write its first checkpoint, base every region and go on).  When its bases
do not fit the free space, it first switches with no new base, keeping what
the final switch keeps and what the fold reads, and writes the bases into
the segments that frees; when even that does not make room, or the result
would leave less than the reserve, it refuses up front in one line and the
log is unchanged.  (`concordia-wal snapshot create` checks its bases against
the same reserve: `check_snapshot_room`.)  A session's retention
keeps the log above the same reserve its own way: below it, it bases every
region at once and keeps only the newest epoch (`concordia.retention`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from concordia.root_error import Hint
from concordia.wal import format as F
from concordia.wal.apply import absent_names, check_pages, page_crcs, take_rows
from concordia.wal.catalog import CATALOG_ENTRY_SIZE, CATALOG_HEAD_SIZE, MAX_KEEP_BASES, BaseEntry
from concordia.wal.errors import CorruptionError, LogFullError, UsageError, WalError
from concordia.wal.planner import History, RegionPlan, plan_history, scan, walk_on
from concordia.wal.snapshot import (
    DEFAULT_CHUNK_BYTES,
    Catalog,
    _page_source,
    append_catalog,
    base_record_lengths,
    current_catalog,
    write_base_slices,
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
    keep_bases: int = 0    # the retention applied (0: no limit of that kind)
    keep_epochs: int = 0
    reclaim_first: bool = False  # a switch with no new base made room for the bases first
    #: regions with no state at the epoch (registered later): given no base, which would be invented
    absent: list = field(default_factory=list)
    free_bytes: int = 0    # what the log can still append afterwards (`Space.bytes`)
    reserve_bytes: int = 0  # what a compaction leaves free at the least (`reserve_bytes`)
    scanned: bool = False  # the switch read the log (no `Known` covered it); not reported
    #: regions listed with an image entry (a session's retention; `concordia-wal compact` folds): not reported
    imaged: list = field(default_factory=list)

    def to_json(self) -> dict:
        """The report as `concordia-wal compact --json` prints it (docs/cli.md)."""
        out = dict(self.__dict__)
        del out["scanned"], out["imaged"]
        return out


# --------------------------------------------------------------------------- policy and space

#: retain_epochs at or above this reads as 0 (every epoch): earlier writers stored 2**62 for it
_EVERY_EPOCH = 1 << 62


@dataclass(frozen=True)
class Keep:
    """A retention policy: each region keeps its newest `bases` bases, and the
    newest `epochs` committed epochs stay restorable; 0 is no limit of that
    kind, so Keep(0, 0) keeps everything.  Both limits hold together: what
    either keeps is kept."""

    bases: int = 0
    epochs: int = 0

    @classmethod
    def stored(cls, superblock, catalog: Catalog) -> "Keep":
        """The policy a log already has: the catalog's keep_bases and the
        superblock's retain_epochs (FORMAT.md §3.1, §12.2)."""
        e = int(superblock.retain_epochs)
        return cls(int(catalog.keep_bases), 0 if e >= _EVERY_EPOCH else e)

    def describe(self) -> str:
        """In words, as `info` and `compact` print it."""
        if not self.bases and not self.epochs:
            return "every base and every epoch"
        parts = []
        if self.bases:
            parts.append(f"the newest {self.bases} bases of each region" if self.bases > 1
                         else "the newest base of each region")
        if self.epochs:
            parts.append(f"the newest {self.epochs} epochs" if self.epochs > 1 else "the newest epoch")
        return " and ".join(parts)


def stored_keep(log) -> Keep:
    """The retention policy `log` already has (what a compaction told nothing applies)."""
    return Keep.stored(log.volume.superblock, current_catalog(log))


#: the most epochs a policy keeps restorable (the superblock's retain_epochs: 64 bits); MAX_KEEP_BASES: catalog.py
MAX_KEEP_EPOCHS = 0xFFFFFFFFFFFFFFFF


def resolve_keep(log, keep_bases: int | None = None, keep_epochs: int | None = None) -> Keep:
    """The policy a compaction applies: the log's own (`stored_keep`) when
    neither limit is given, else the limits given (one left out is 0: no
    limit of that kind)."""
    if keep_bases is None and keep_epochs is None:
        return stored_keep(log)
    bases, epochs = int(keep_bases or 0), int(keep_epochs or 0)
    # stored before anything is written: the catalog's head holds keep_bases in 32 bits (FORMAT.md §12.2)
    if not 0 <= bases <= MAX_KEEP_BASES or not 0 <= epochs <= MAX_KEEP_EPOCHS:
        raise UsageError(f"keep_bases must lie in [0, {MAX_KEEP_BASES}] and keep_epochs in [0, {MAX_KEEP_EPOCHS}], "
                         f"not {keep_bases!r} and {keep_epochs!r}; nothing was written", where=log.backend.where)
    return Keep(bases, epochs)


def record_bytes(nbytes: int, page_bytes: int) -> int:
    """Log bytes a full image of a region of `nbytes` takes in 8 MiB page batches."""
    pages = -(-int(nbytes) // page_bytes)
    per = max(1, (8 << 20) // page_bytes)
    full, rest = divmod(pages, per)
    return full * F.page_batch_length(per, page_bytes) + (F.page_batch_length(rest, page_bytes) if rest else 0)


def retention_reserve(state_bytes: int, segment_bytes: int, checkpoint_bytes: int) -> int:
    """Free log bytes a writer's retention needs to go on: a base of every
    region (`state_bytes`: `record_bytes` of each, and an eighth more for the
    ends of the segments it crosses), a segment for its catalog and the end of
    the segment being written, and `checkpoint_bytes` of checkpoints written
    before the switch that frees space comes.  A session is under pressure
    below it (`concordia.retention`); a compaction never leaves less
    (`reserve_bytes`)."""
    return int(state_bytes) + (int(state_bytes) >> 3) + int(segment_bytes) + int(checkpoint_bytes) + (64 << 10)


def state_bytes(log) -> int:
    """Log bytes one full image of every region of `log` takes."""
    return sum(record_bytes(r.nbytes, r.page_bytes) for r in log.regions.values())


def opening_reserve(state: int, segment_bytes: int) -> int:
    """The retention reserve of a session that opens a log of `state` bytes
    of regions (`state_bytes`): its first checkpoint writes every page of
    every region (a full image, with the ends of its segments)."""
    return retention_reserve(state, segment_bytes, state + (state >> 3))


def reserve_bytes(log) -> int:
    """What a compaction leaves free at the least (`opening_reserve` of the log's regions)."""
    return opening_reserve(state_bytes(log), log.volume.segment_bytes)


@dataclass(frozen=True)
class Space:
    """What a writer of a log can still append: the rest of the segment being
    written (`tail` bytes) and `free_segments` whole segments of `capacity`
    bytes each (`Appender.segment_capacity`).  The ends of older live
    segments are not in it: records never go back there."""

    tail: int
    free_segments: int
    capacity: int

    @property
    def bytes(self) -> int:
        return self.tail + self.free_segments * self.capacity

    def after(self, lengths, freed: int = 0) -> "Space | None":
        """The space left once records of `lengths` bytes are appended in
        order, the appender rolling over to a free segment whenever one does
        not fit the rest of the current one, and `freed` segments are freed
        afterwards; None when they do not fit."""
        tail, free = self.tail, self.free_segments
        for n in lengths:
            if n <= tail:
                tail -= n
                continue
            if not free or n > self.capacity:
                return None
            free -= 1
            tail = self.capacity - n
        return Space(tail, free + int(freed), self.capacity)


def free_space(log) -> Space:
    """The `Space` of `log`: for a log open for writing, from its appender;
    for a read-only one, as a writer opening it would find it (cut after the
    later of the last commit and the catalog the superblock names, FORMAT.md
    §10.5, V-N2: live segments after that point come back free)."""
    if log.writable:
        vol = log.volume
        app = log.appender
        tail = 0 if app.seg is None else app.seg.offset + app.seg.nbytes - app.pos
        free = sum(1 for e in vol.superblock.segments if e.state == F.SEG_FREE)
        return Space(int(tail), free, int(vol.segment_bytes) - F.SEGMENT_HEADER_SIZE)
    commits = log.commits
    return volume_space(log.volume, commits[-1].lsn if commits else 0)


def volume_space(vol, last_commit_lsn: int) -> Space:
    """The `Space` a writer opening volume `vol`, whose last commit record lies
    at `last_commit_lsn` (0: none), finds (see `free_space`)."""
    from concordia.wal.snapshot import record_at

    sb = vol.superblock
    cap = int(vol.segment_bytes) - F.SEGMENT_HEADER_SIZE
    free = sum(1 for e in sb.segments if e.state == F.SEG_FREE)
    live = vol.live_segments()
    if not live:
        return Space(0, free, cap)
    at = None
    for lsn in [x for x in (int(last_commit_lsn), int(sb.catalog_lsn)) if x]:
        try:
            _, _, h = record_at(vol, lsn)
        except CorruptionError:
            continue
        at = max(at or 0, lsn + h.length)
    if at is None:  # nothing committed: a writer starts at the oldest live segment
        seg = live[0]
        at = seg.base_lsn + F.SEGMENT_HEADER_SIZE
    seg = next((s for s in live if s.base_lsn <= at <= s.end_lsn), live[-1])
    later = sum(1 for s in live if s.seq > seg.seq)
    return Space(int(seg.end_lsn - at), free + later, cap)


def _descriptor_lengths(log) -> list:
    return [F.record_length(len(F.encode_region_body(r.name, r.dtype, r.shape, r.page_bytes, r.kind,
                                                       logical=r.logical, framework=r.framework)))
            for r in log.regions.values()]


def _catalog_length(entries: int) -> int:
    return F.record_length(CATALOG_HEAD_SIZE + CATALOG_ENTRY_SIZE * int(entries))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass
class Decision:
    """What a compaction will do, decided before it writes anything (`decide`)."""

    epoch: int
    keep: Keep
    fold: list             # region names given a new base
    unchanged: list        # regions whose newest base already is at the epoch
    bytes_written: int     # payload bytes of the new bases
    bases_kept: int
    bases_dropped: int
    floor_epoch: int
    segments_freed: list   # physical indexes
    first: tuple | None    # (kept, floor, cut) of a switch with no new base to run first, making room
    free_bytes: int        # what the log can append once it has switched
    reserve_bytes: int
    absent: list = field(default_factory=list)  # regions with no state at the epoch: no base for them

    def report(self) -> CompactReport:
        return CompactReport(epoch=self.epoch, source="log", folded=list(self.fold), unchanged=list(self.unchanged),
                             bytes_written=self.bytes_written, bases_kept=self.bases_kept,
                             bases_dropped=self.bases_dropped, floor_epoch=self.floor_epoch,
                             segments_freed=list(self.segments_freed), keep_bases=self.keep.bases,
                             keep_epochs=self.keep.epochs, reclaim_first=self.first is not None,
                             free_bytes=self.free_bytes, reserve_bytes=self.reserve_bytes, absent=list(self.absent))


def _freed(log, low) -> list:
    """Physical indexes of the live segments a reclaim below `low` frees
    (`Volume.reclaim_segments`: never the newest)."""
    live = log.volume.live_segments()
    return [s.index for s in live[:-1] if low is not None and s.end_lsn <= low]


def decide(log, epoch: int | None = None, *, keep: Keep, regions=None, upto_named: bool = False,
           live=(), reclaim: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           walked: list | None = None) -> Decision:
    """What compacting `log` at committed `epoch` (default: the latest) under
    `keep` does: the bases it writes, what it keeps and frees, and whether it
    must switch once first to make room (module doc, "Space").  Pure but for
    reading the log: nothing is written.  Raises, naming the figures, when the
    compaction must not run: its bases do not fit even after that first switch
    (LogFullError), it would leave less than `reserve_bytes(log)` free, or a
    base at an epoch the caller named (`upto_named`) would be dropped by the
    retention at once (WalError).  live: names of regions whose image the
    caller hands in (given a new base even when their newest one is at the
    epoch, as `Compaction` does).  reclaim=False: the switch frees nothing.
    walked: a list that receives the items of the walk decided from (`scan`),
    for a `Compaction` made before anything is written to walk no more."""
    where = log.backend.where
    h = scan(log, payload=False, walked=walked)
    p = plan_history(h, "latest" if epoch is None else int(epoch), "tolerate_tail", regions=regions)
    prev = current_catalog(log)
    infos = log.regions
    names = list(infos) if regions is None else list(regions)
    # a region with no state at the epoch (registered after it) gets no base there: one would be
    # invented (zeros), and a recovery of the epoch would hand it back instead of refusing the region
    absent = absent_names(p, names)
    names = [n for n in names if n not in absent]
    fold = [n for n in names if p.regions[n].base_epoch != p.epoch or n in live]
    unchanged = [n for n in names if n not in fold]
    # the new bases lie above every record there is: next_lsn stands for where
    at = int(log.volume.superblock.next_lsn)
    new = {n: BaseEntry(infos[n].id, p.epoch, at, at, 1, infos[n].pages, 0) for n in fold}
    replaced = {(e.region_id, e.epoch) for e in new.values()}
    old = [e for e in prev.entries if (e.region_id, e.epoch) not in replaced]
    ids = [r.id for r in h.regions.values()]
    committed = h.committed_epochs()

    kept, floor, cut = retention(old + list(new.values()), committed, keep.bases, keep.epochs, ids,
                                 first_delta_epochs(h))
    floor = max(floor, prev.floor_epoch)
    freed = _freed(log, needed_from(h, kept, cut, floor)) if reclaim else []
    # the base of each region at the epoch (new, or there already) that the retention drops at once
    at_epoch = {(e.region_id, e.epoch) for e in kept}
    lost = [n for n in names if (infos[n].id, p.epoch) not in at_epoch]
    if lost and upto_named:
        newest = max(e.epoch for e in kept if e.region_id == infos[lost[0]].id)
        raise WalError(f"the base of region {lost[0]!r} at epoch {p.epoch} would be dropped at once: the "
                       f"retention keeps {keep.describe()}, and it has a newer base (epoch {newest}); nothing "
                       f"was written", where=where, hint=Hint(api="leave out epoch, or pass a larger keep_bases",
                                                 cli="leave out --upto, or pass a larger --keep"))
    cap = int(log.volume.segment_bytes) - F.SEGMENT_HEADER_SIZE
    bases = [n for info in (infos[x] for x in fold) for n in base_record_lengths(info, chunk_bytes, cap)]
    meta = _descriptor_lengths(log)  # written again when their segment goes (counted always: the most)
    space = free_space(log)
    reserve = reserve_bytes(log)
    writes = bases + meta + [_catalog_length(len(kept))]
    after = space.after(writes, freed=len(freed))
    first = None
    if after is None and reclaim:
        # fold in place of what is freed: a switch with no new base first, keeping what the
        # final one keeps and what the fold reads (each region's newest base at or before
        # the epoch, and the deltas after it), so that the bases go where it freed
        src = {infos[n].id: p.regions[n].base_epoch or 0 for n in fold}
        cut_1 = {rid: min(c, src.get(rid, c)) for rid, c in cut.items()}
        kept_1 = [e for e in old if e.epoch >= cut_1.get(e.region_id, 0)]
        floor_1 = max(prev.floor_epoch, max(cut_1.values(), default=0))
        freed_1 = _freed(log, needed_from(h, kept_1, cut_1, floor_1))
        mid = space.after(meta + [_catalog_length(len(kept_1))], freed=len(freed_1))
        if mid is not None and freed_1 and floor_1 <= p.epoch:
            after = mid.after(writes, freed=len(set(freed) - set(freed_1)))
            first = (kept_1, floor_1, cut_1) if after is not None else None
    if after is None:
        raise LogFullError(f"compaction needs {_mib(sum(writes))} for its new bases and catalog, the log can "
                           f"append {_mib(space.bytes)} ({space.free_segments} free segments), and what a retention "
                           f"keeping {keep.describe()} lets go does not make room; nothing was written", where=where,
                           hint=Hint(api="pass keep_bases=1 to keep fewer bases, or restore the regions into a "
                                         "larger log",
                                     cli="pass --keep 1 to keep fewer bases, or restore the regions into a larger log"))
    if after.bytes < reserve:
        raise WalError(f"compaction keeping {keep.describe()} would leave {_mib(after.bytes)} free, less than the "
                       f"{_mib(reserve)} a session needs to go on (a checkpoint of every page and a base of every "
                       f"region); nothing was written", where=where,
                       hint=(Hint(api="pass keep_bases=1 to keep fewer bases", cli="pass --keep 1 to keep fewer bases")
                             if keep != Keep(1, 0) else "create a larger log"))
    return Decision(p.epoch, keep, fold, unchanged,
                    sum(infos[n].pages * infos[n].page_bytes for n in fold), len(kept),
                    len(old) + len(fold) - len(kept), floor, freed, first, after.bytes, reserve, absent)


def check_snapshot_room(log, names, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Refuse (LogFullError, or WalError naming the figures) base snapshots of
    regions `names`, each listed in a catalog of its own, that do not fit the
    log's free space or would leave it less than the retention reserve
    (`reserve_bytes`: the rule a compaction follows).  Writes nothing."""
    regions = log.regions
    cap = log.appender.segment_capacity
    entries = len(current_catalog(log).entries)
    writes = []
    for k, name in enumerate(names):
        writes += base_record_lengths(regions[name], chunk_bytes, cap) + [_catalog_length(entries + k + 1)]
    space, reserve = free_space(log), reserve_bytes(log)
    after = space.after(writes)
    where = log.backend.where
    if after is None:
        raise LogFullError(f"base snapshots of {', '.join(names)} need {_mib(sum(writes))}, and the log can append "
                           f"{_mib(space.bytes)}; nothing was written", where=where,
                           hint="compact the log instead, which frees what the bases replace: "
                                "concordia-wal compact LOG --keep 1")
    if after.bytes < reserve:
        raise WalError(f"base snapshots of {', '.join(names)} ({_mib(sum(writes))}) free nothing and would leave "
                       f"{_mib(after.bytes)} free, less than the {_mib(reserve)} a session needs to go on (a "
                       f"checkpoint of every page and a base of every region); nothing was written", where=where,
                       hint="compact the log instead, which frees what the bases replace: "
                            "concordia-wal compact LOG --keep 1")


def fold_source(rp: RegionPlan) -> Callable[[int, int], np.ndarray]:
    """The image of one region at its plan's epoch, read from the log itself,
    as a page source for `snapshot.create_base_snapshot` / `write_base_records`:
    (lo, hi) -> pages [lo, hi) as a (hi - lo, page_bytes) uint8 array, gathered
    from the plan's sources (newest base plus the deltas after it) with every
    page CRC-checked (CorruptionError naming the record otherwise), zero where
    nobody wrote.  Memory: one chunk; the log must stay open while it is used.

        p = plan_history(scan(log), epoch, "tolerate_tail", regions=[name])
        create_base_snapshot(log, name, fold_source(p.regions[name]), p.epoch)"""
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
            got = np.ascontiguousarray(take_rows(s.batch.payload, rows))
            check_pages(r.name, s.batch, rows, lo + at, pb, np.asarray(s.batch.page_crcs)[rows], page_crcs(got))
            out[at] = got
        return out

    return pages


def first_delta_epochs(h: History) -> dict:
    """{region id: the oldest epoch of a delta record of it} over a scan (`retention`'s `first`)."""
    first: dict = {}
    for b in h.batches:
        if not b.base and b.epoch < first.get(b.region_id, b.epoch + 1):
            first[b.region_id] = b.epoch
    return first


def retention(entries, committed: list, keep_bases: int, keep_epochs: int, region_ids,
              first: dict | None = None) -> tuple:
    """(kept entries, floor epoch, cut per region) for catalog `entries` under
    the policy (see the module doc).  Pure.

    A region with no base (registered after the epoch of the last fold, which
    invents none for it) restores from its deltas: its cut keeps every one,
    from the oldest in `first` ({region id: oldest delta epoch},
    `first_delta_epochs`), at the floor where it has none; unknown (`first`
    None), at 0, which keeps every epoch."""
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
    floor = max((c for rid, c in cut.items() if by_region[rid]), default=0)
    # every region may drop up to its newest base at or before the floor; one with no base
    # keeps every delta of it (those below the floor too: a region restores from them alone)
    for rid, bases in by_region.items():
        if bases:
            cut[rid] = max((e.epoch for e in bases if e.epoch <= floor), default=0)
        elif first is not None:
            cut[rid] = min(first[rid] - 1, floor) if rid in first else floor
        else:
            cut[rid] = 0
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
            progress: Callable[[int, int], None] | None = None, reclaim: bool = True,
            upto_named: bool = False) -> CompactReport:
    """Fold every region into a base at committed `epoch` (default: latest),
    list the bases retention keeps in a new catalog, and switch to it while
    freeing the segments nobody needs any more (one superblock write).

    keep_bases / keep_epochs: the retention (`resolve_keep`: neither given,
    the log's own policy).  What is written is decided first (`decide`): a
    compaction that would leave less than the retention reserve free, or
    whose bases do not fit, is refused before anything is written; one
    whose bases fit only once the bases already there have freed what they
    free switches to those first (`CompactReport.reclaim_first`).
    upto_named: `epoch` was asked for by a person (`compact --upto`): a base
    there that the retention would drop at once is refused, not written and
    dropped.

    live: {region name: array} images to take instead of folding the log
    (the array must be the region's state at `epoch`; its digest is checked
    against the commit before anything is switched).
    progress(done_bytes, total_bytes) is called after every chunk written."""
    keep = resolve_keep(log, keep_bases, keep_epochs)
    walked: list = []   # decide's walk: the compaction's, while nothing has been written since
    d = decide(log, epoch, keep=keep, upto_named=upto_named, live=set(live or ()), reclaim=reclaim,
               chunk_bytes=chunk_bytes, walked=walked)
    freed_first = []
    if d.first is not None:
        first = Compaction(log, d.epoch, regions=[], live={}, digests={})
        first.prepare(keep_bases=keep.bases, keep_epochs=keep.epochs, decided=d.first)
        freed_first = first.switch().segments_freed
        walked = None   # the switch freed segments: walk again
    job = Compaction(log, d.epoch, regions=d.fold, live=live, chunk_bytes=chunk_bytes, progress=progress,
                     walk=walked)
    while not job.step():
        pass
    rep = job.finish(keep_bases=keep.bases, keep_epochs=keep.epochs, reclaim=reclaim)
    rep.unchanged = list(d.unchanged)
    rep.absent = list(d.absent)
    rep.segments_freed = freed_first + rep.segments_freed
    rep.reclaim_first = d.first is not None
    rep.free_bytes = free_space(log).bytes
    rep.reserve_bytes = d.reserve_bytes
    return rep


class Compaction:
    """One compaction, in steps a caller can spread over time (a `Session`
    runs one step after a checkpoint): `step()` writes at most one chunk of
    BASE records and says whether the bases are all written; `finish()` lists
    them in a new catalog and makes it current, freeing what retention no
    longer needs (the commit point, one superblock write).  Until `finish`
    nothing a reader sees has changed: a crash, or an `abort()`, leaves the
    written BASE records unlisted, and they are ignored (FORMAT.md §12).

    epoch: the committed epoch the bases hold (default: the latest).
    regions: names to give a base (default: every region; a region whose
    newest base already is at the epoch is left out unless it is live).
    live: {name: array, buffer or (lo, hi) -> pages function} images of the
    regions at `epoch`; the others are folded from the log (which takes one
    scan of the log here).  stage: {name: writer} for live regions whose
    records another writer may write from the same image (a device reading
    it: `snapshot._append_base_batch`'s `stage`).  Each new base's digest is
    checked against the commit before `finish` switches.  The log must not be compacted by anyone
    else between the steps (the folded sources read records in place).
    walk: the items of a walk of the log as it is now (`decide`'s `walked`),
    taken instead of walking it again; `finish` then walks only what the
    compaction appended (`planner.walk_on`)."""

    def __init__(self, log, epoch: int | None = None, *, regions=None, live: dict | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[int, int], None] | None = None,
                 digests: dict | None = None, stage: dict | None = None, images: dict | None = None,
                 walk: list | None = None):
        self.t0 = time.perf_counter()
        #: {region name: image entry} listed as those regions' bases with the new ones
        #: (`snapshot.image_entries`: an epoch that wrote the region whole); nothing is written for them
        self.images = dict(images or {})
        self.log = log
        self.seconds = 0.0
        live = dict(live or {})
        known = log.regions
        unknown = set(live) - set(known) or set(regions or ()) - set(known)
        if unknown:
            raise WalError(f"no region named {sorted(unknown)[0]!r} to take live")
        want = list(known) if regions is None else list(regions)
        folded = [n for n in want if n not in live]
        self.plan = None
        #: the walk this compaction planned from (kept only when the caller handed one in, as `compact` does,
        #: and within the reader's bound), where it ended and the oldest LSN then: what `finish` walks on
        #: from while nothing has been freed (`planner.walk_on`)
        self._walk, self._walk_from, self._walk_oldest = None, 0, 0
        if folded or epoch is None or digests is None:
            from concordia.wal.reader import walk_kept

            walked: list = []
            oldest = log.volume.superblock.oldest_lsn
            h = scan(log, walk=walk or None, walked=walked)
            if walk and walked and walk_kept(len(walked), log.volume):
                last = walked[-1]
                self._walk, self._walk_oldest = walked, oldest
                self._walk_from = last.seg.lsn(last.offset) + last.length
            p = plan_history(h, "latest" if epoch is None else int(epoch), "tolerate_tail",
                             regions=folded or None)
            self.plan = p
            self.epoch = int(p.epoch)
        else:
            self.epoch = int(epoch)
        self.report = CompactReport(epoch=self.epoch, source="live" if live and not folded else "log")
        self._todo = []  # [info, source, expected digest, stage writer or None]
        stage = stage or {}
        for name in want:
            info = known[name]
            if name in live:
                want_digest = (digests or {}).get(name)
                if want_digest is None and self.plan is not None and name in self.plan.regions:
                    want_digest = self.plan.regions[name].digest
                self._todo.append([info, _page_source(info, live[name]), want_digest, stage.get(name)])
                continue
            rp = self.plan.regions[name]
            if rp.absent:   # no state at the epoch (registered later): no base is invented for it
                self.report.absent.append(name)
                continue
            if rp.base_epoch == self.epoch:
                self.report.unchanged.append(name)  # its newest base already is the state at the epoch
                continue
            self._todo.append([info, fold_source(rp), rp.digest, None])
        self.total = sum(t[0].pages * t[0].page_bytes for t in self._todo)
        self.done_bytes = 0
        self.chunk_bytes = int(chunk_bytes)
        self._budget = self.chunk_bytes  # what the step under way has left to write (`_chunk`)
        self.progress = progress
        self.new: list = []
        self._writer = None  # the generator writing the current region's base
        self._switch = None  # after prepare: (superblock changes, free below LSN), or False (nothing to write)

    @property
    def written(self) -> bool:
        return not self._todo and self._writer is None

    def step(self, max_bytes: int | None = None) -> bool:
        """Write BASE records, one chunk after another, until `max_bytes`
        (default: one chunk) are written or every base is; True once every
        base is written.  A chunk is `chunk_bytes`, or what is left of a larger
        `max_bytes` up to DEFAULT_CHUNK_BYTES: a step writes few records, each
        costing the same fixed work whatever its size."""
        t = time.perf_counter()
        budget = self.chunk_bytes if max_bytes is None else max(1, int(max_bytes))
        self._budget = budget
        while budget > 0 and not self.written:
            if self._writer is None:
                info, src, want, stage = self._todo[0]
                self._writer = write_base_slices(self.log, info, src, self.epoch, chunk_bytes=self._chunk,
                                                 stage=stage)
            try:
                n = next(self._writer)
            except StopIteration as stop:
                self._writer = None
                info, _, want, _ = self._todo.pop(0)
                entry = stop.value
                if want is not None and entry.digest != want:
                    self.abort()
                    raise WalError(f"new base of region {info.name!r} at epoch {self.epoch} has digest "
                                   f"0x{entry.digest:08x}, the log states 0x{want:08x}; nothing was switched",
                                   hint="a live image must be the region's state at the epoch compacted")
                self.new.append(entry)
                self.report.folded.append(info.name)
                self.report.records_written += entry.records
                self.report.bytes_written += entry.pages * info.page_bytes
                continue
            budget -= n
            self._budget = budget
            self._tick(n)
        self.seconds += time.perf_counter() - t
        return self.written

    def _chunk(self) -> int:
        """The next BASE record's payload bytes (`step`)."""
        return max(self.chunk_bytes, min(self._budget, DEFAULT_CHUNK_BYTES))

    def _tick(self, n: int) -> None:
        self.done_bytes += n
        if self.progress:
            self.progress(self.done_bytes, self.total)

    def abort(self) -> None:
        """Give up: what was written stays unlisted (ignored by every reader)."""
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        self._todo = []
        self._walk = None
        self._switch = None   # a prepared catalog is never switched to after this

    def finish(self, *, keep_bases: int | None = None, keep_epochs: int | None = None,
               reclaim: bool = True, known: "Known | None" = None) -> CompactReport:
        """List the new bases and the ones retention keeps in a new catalog and
        make it current, freeing every segment below what a kept epoch needs
        (one superblock write).  Writes nothing when nothing changes.

        known: what the writer knows of the log (see `Known`), so that no scan
        of the log is needed; used only when it covers every epoch the switch
        keeps, else the log is scanned.

        The same as `prepare` then `switch`, which a caller may run apart (a
        `Session` runs them after two checkpoints)."""
        self.prepare(keep_bases=keep_bases, keep_epochs=keep_epochs, reclaim=reclaim, known=known)
        return self.switch()

    @property
    def prepared(self) -> bool:
        """`prepare` ran and `switch` is still to run."""
        return self._switch is not None

    def prepare(self, *, keep_bases: int | None = None, keep_epochs: int | None = None,
                reclaim: bool = True, known: "Known | None" = None, decided: tuple | None = None) -> bool:
        """The first half of `finish`: decide what the new catalog keeps and
        append it (with the region descriptors again when their segment goes),
        not yet current: a reader still sees the old catalog, and a crash here
        leaves it in force.  True when `switch` has a superblock write to do;
        False when nothing changes (the report is then final).  Records
        committed between the two halves are kept: they lie above what the
        catalog frees.

        decided: (kept entries, floor, cut per region) the caller decided
        (`decide`'s switch before the bases, which keeps more than the
        policy would); the policy given is still the one stored."""
        if not self.written:
            raise WalError("compaction finished before its bases were written")
        t = time.perf_counter()
        log, rep = self.log, self.report
        prev = current_catalog(log)
        sb = log.volume.superblock
        if keep_bases is None and keep_epochs is None:
            keep = Keep.stored(sb, prev)
        else:
            keep = resolve_keep(log, keep_bases, keep_epochs)   # bounded as every policy is
        keep_bases, keep_epochs = keep.bases, keep.epochs
        rep.keep_bases, rep.keep_epochs = keep_bases, keep_epochs
        new = self.new + list(self.images.values())
        rep.imaged = list(self.images)
        replaced = {(e.region_id, e.epoch) for e in new}
        entries = [e for e in prev.entries if (e.region_id, e.epoch) not in replaced] + new
        ids = [r.id for r in log.regions.values()]
        h = None
        known_in = known
        if decided is not None:
            kept, floor, cut = decided
            known = None
            h = scan(log, payload=False)
            low = needed_from(h, kept, cut, floor) if reclaim else None
        elif known is not None and not keep_bases:
            # the window the writer keeps (keep_epochs 0: every epoch, a window from epoch 0)
            kept, floor, cut = retention(entries, [known.window_start if keep_epochs else 0], 0, 1, ids)
            floor = max(floor, prev.floor_epoch)
            low = known.needed_from(kept, cut, floor) if reclaim else None
            if low is False:  # the writer does not know every epoch kept
                known = None
        else:
            known = None
        if known is None and decided is None:
            rep.scanned = True
            h = scan(log, payload=False, walk=walk_on(log.volume, self._walk, self._walk_from, self._walk_oldest))
            kept, floor, cut = retention(entries, h.committed_epochs(), keep_bases, keep_epochs,
                                         [r.id for r in h.regions.values()], first_delta_epochs(h))
            floor = max(floor, prev.floor_epoch)
            low = needed_from(h, kept, cut, floor) if reclaim else None
        self._walk = None   # (whichever way it decided)
        rep.bases_kept, rep.bases_dropped, rep.floor_epoch = len(kept), len(entries) - len(kept), floor
        if (not new and len(kept) == len(prev.entries) and floor == prev.floor_epoch
                and keep == Keep.stored(sb, prev)):
            rep.oldest_lsn = sb.oldest_lsn
            self.seconds += time.perf_counter() - t
            rep.seconds = self.seconds
            self._switch = False
            return False  # nothing changes: write nothing

        cat = Catalog(prev.sequence + 1, tuple(kept), keep_bases, floor)
        if any(e.image for e in kept):  # FORMAT.md §2.3: the feature bit, durably, before the catalog needs it
            log.volume.enable_incompat(F.FEATURE_IMAGE_BASES)
        if h is not None:
            lowest = min(h.region_lsns.values(), default=None)
            rewrite = lowest is not None and low is not None and lowest < low
        else:
            lowest = known_in.descriptor_lsn
            rewrite = low is not None and (lowest is None or lowest < low)
        if rewrite:
            lowest = log.appender.write_lsn
            _rewrite_descriptors(log)  # they would go with their segment
        if known_in is not None:
            known_in.descriptor_lsn = lowest
        cat_lsn = append_catalog(log, cat, prev.lsn)
        self._switch = (dict(catalog_lsn=cat_lsn, oldest_epoch=floor, retain_epochs=keep_epochs),
                        None if low is None else min(low, cat_lsn))
        self.seconds += time.perf_counter() - t
        return True

    def switch(self) -> CompactReport:
        """The second half of `finish`: make the catalog `prepare` appended
        current and free the segments below what it keeps, in one superblock
        write (the commit point)."""
        if self._switch is None:
            raise WalError("compaction switched before it was prepared")
        rep = self.report
        if self._switch is False:  # nothing changed
            self._switch = None
            return rep
        t = time.perf_counter()
        (changes, below), self._switch = self._switch, None
        vol = self.log.volume
        if below is not None:
            rep.segments_freed = vol.reclaim_segments(below, **changes)
        else:
            vol.write_superblock(**changes)
        rep.oldest_lsn = vol.superblock.oldest_lsn
        self.seconds += time.perf_counter() - t
        rep.seconds = self.seconds
        return rep


@dataclass
class Known:
    """What a writer knows of its own log, so that a switch needs no scan.

    epochs: {epoch: (lowest LSN any record of it may have, LSN of its commit)}
    for the epochs this writer committed (a lower bound is enough: keeping
    more is safe), in commit order.  window_start: the oldest epoch the kept
    window holds.  descriptor_lsn: the lowest LSN of a live region descriptor
    (None: not known; the switch then writes them again when it frees)."""

    epochs: dict = field(default_factory=dict)
    window_start: int = 0
    descriptor_lsn: int | None = None

    def needed_from(self, kept, cut: dict, floor: int):
        """The lowest LSN a restore of a kept epoch reads (as `needed_from`
        computes it from a scan), or False when an epoch it needs is not known."""
        eps = self.epochs
        lows = [e.first_lsn for e in kept]
        min_cut = min(cut.values(), default=0)
        first_needed = min_cut + 1  # deltas after a region's cut; epochs split never (V-C4)
        at = [ep for ep in (floor, first_needed) if ep]
        for ep in at:
            if ep not in eps:
                if ep == first_needed and ep > max(eps, default=0):
                    continue  # no epoch after the cut yet
                return False
        if floor:
            lows.append(eps[floor][0])  # its commit and every record it counts
        if first_needed in eps:
            lows.append(eps[first_needed][0])
        return min(lows) if lows else None


def _rewrite_descriptors(log) -> None:
    """Append every region descriptor again (same id and attributes) so the log
    keeps describing itself once the segments holding the old ones are freed."""
    from concordia.wal import format as F

    app = log.appender
    for info in log.regions.values():
        body = F.encode_region_body(info.name, info.dtype, info.shape, info.page_bytes, info.kind,
                                    logical=info.logical, framework=info.framework)
        app.append_record(type=F.REC_REGION, epoch=0, body=body, region_id=info.id, page_bytes=info.page_bytes)


__all__ = ["compact", "Compaction", "Known", "CompactReport", "Decision", "Keep", "Space", "decide", "fold_source",
           "free_space", "needed_from", "opening_reserve", "record_bytes", "reserve_bytes", "resolve_keep", "retention",
           "retention_reserve", "state_bytes", "stored_keep", "volume_space", "check_snapshot_room"]
