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

from concordia.wal.apply import check_pages, page_crcs, take_rows
from concordia.wal.errors import WalError
from concordia.wal.planner import History, RegionPlan, plan_history, scan
from concordia.wal.snapshot import (
    DEFAULT_CHUNK_BYTES,
    Catalog,
    _page_source,
    append_catalog,
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
    scanned: bool = False  # the switch read the log (no `Known` covered it)

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
    job = Compaction(log, epoch, live=live, chunk_bytes=chunk_bytes, progress=progress)
    while not job.step():
        pass
    return job.finish(keep_bases=keep_bases, keep_epochs=keep_epochs, reclaim=reclaim)


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
    scan of the log here).  Each new base's digest is checked against the
    commit before `finish` switches.  The log must not be compacted by anyone
    else between the steps (the folded sources read records in place)."""

    def __init__(self, log, epoch: int | None = None, *, regions=None, live: dict | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[int, int], None] | None = None,
                 digests: dict | None = None):
        self.t0 = time.perf_counter()
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
        if folded or epoch is None or digests is None:
            h = scan(log)
            p = plan_history(h, "latest" if epoch is None else int(epoch), "tolerate_tail",
                             regions=folded or None)
            self.plan = p
            self.epoch = int(p.epoch)
        else:
            self.epoch = int(epoch)
        self.report = CompactReport(epoch=self.epoch, source="live" if live and not folded else "log")
        self._todo = []  # [info, source, expected digest]
        for name in want:
            info = known[name]
            if name in live:
                want_digest = (digests or {}).get(name)
                if want_digest is None and self.plan is not None and name in self.plan.regions:
                    want_digest = self.plan.regions[name].digest
                self._todo.append([info, _page_source(info, live[name]), want_digest])
                continue
            rp = self.plan.regions[name]
            if rp.base_epoch == self.epoch:
                self.report.unchanged.append(name)  # its newest base already is the state at the epoch
                continue
            self._todo.append([info, fold_source(rp), rp.digest])
        self.total = sum(t[0].pages * t[0].page_bytes for t in self._todo)
        self.done_bytes = 0
        self.chunk_bytes = int(chunk_bytes)
        self.progress = progress
        self.new: list = []
        self._writer = None  # the generator writing the current region's base
        self._switch = None  # after prepare: (superblock changes, free below LSN), or False (nothing to write)

    @property
    def written(self) -> bool:
        return not self._todo and self._writer is None

    def step(self, max_bytes: int | None = None) -> bool:
        """Write BASE records, one chunk (`chunk_bytes`) after another, until
        `max_bytes` (default: one chunk) are written or every base is; True
        once every base is written."""
        t = time.perf_counter()
        budget = self.chunk_bytes if max_bytes is None else max(1, int(max_bytes))
        while budget > 0 and not self.written:
            if self._writer is None:
                info, src, want = self._todo[0]
                self._writer = write_base_slices(self.log, info, src, self.epoch, chunk_bytes=self.chunk_bytes)
            try:
                n = next(self._writer)
            except StopIteration as stop:
                self._writer = None
                info, _, want = self._todo.pop(0)
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
            self._tick(n)
        self.seconds += time.perf_counter() - t
        return self.written

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
                reclaim: bool = True, known: "Known | None" = None) -> bool:
        """The first half of `finish`: decide what the new catalog keeps and
        append it (with the region descriptors again when their segment goes),
        not yet current: a reader still sees the old catalog, and a crash here
        leaves it in force.  True when `switch` has a superblock write to do;
        False when nothing changes (the report is then final).  Records
        committed between the two halves are kept: they lie above what the
        catalog frees."""
        if not self.written:
            raise WalError("compaction finished before its bases were written")
        t = time.perf_counter()
        log, rep = self.log, self.report
        prev = current_catalog(log)
        sb = log.volume.superblock
        keep_bases = prev.keep_bases if keep_bases is None else int(keep_bases)
        keep_epochs = int(sb.retain_epochs) if keep_epochs is None else int(keep_epochs)
        new = self.new
        replaced = {(e.region_id, e.epoch) for e in new}
        entries = [e for e in prev.entries if (e.region_id, e.epoch) not in replaced] + new
        ids = [r.id for r in log.regions.values()]
        h = None
        known_in = known
        if known is not None and keep_epochs and not keep_bases:
            kept, floor, cut = retention(entries, [known.window_start], 0, 1, ids)
            floor = max(floor, prev.floor_epoch)
            low = known.needed_from(kept, cut, floor) if reclaim else None
            if low is False:  # the writer does not know every epoch kept
                known = None
        else:
            known = None
        if known is None:
            rep.scanned = True
            h = scan(log, payload=False)
            kept, floor, cut = retention(entries, h.committed_epochs(), keep_bases, keep_epochs,
                                         [r.id for r in h.regions.values()])
            floor = max(floor, prev.floor_epoch)
            low = needed_from(h, kept, cut, floor) if reclaim else None
        rep.bases_kept, rep.bases_dropped, rep.floor_epoch = len(kept), len(entries) - len(kept), floor
        if not new and len(kept) == len(prev.entries) and floor == prev.floor_epoch:
            rep.oldest_lsn = sb.oldest_lsn
            self.seconds += time.perf_counter() - t
            rep.seconds = self.seconds
            self._switch = False
            return False  # nothing changes: write nothing

        cat = Catalog(prev.sequence + 1, tuple(kept), keep_bases, floor)
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


__all__ = ["compact", "Compaction", "Known", "CompactReport", "fold_source", "retention", "needed_from"]
