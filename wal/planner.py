"""The recovery planner: which bytes of the log rebuild each region at a target.

A plan is made before anything is copied, so a person (or `concordia-wal
recover --plan`) can see exactly what a restore will read.  For every region it
takes the newest valid base snapshot at or before the target epoch, then the
committed deltas after that base in (epoch, LSN) order; the last writer of a
page wins, so each page is copied once, from the record that wrote it last.
Pages nobody wrote since the region began are zero and are not read at all;
a region of which nothing is committed at or before the target (registered
after it) has no state there, and its plan says so (`RegionPlan.absent`)
rather than plan it as zeros.

The planner works in two steps that are kept apart so the second can be tested
without a log:

* `scan(log)` reads record metadata only (headers, page index tables, commit
  and catalog records) into a `History`;
* `plan_history(history, target, mode)` is pure: it resolves the target, finds
  damage that matters, falls back as the recovery mode says, and picks the
  source of every page.

Recovery modes (names as `RecoveryMode` in `concordia.wal`):

* ``absolute``: any damaged or torn record anywhere is an error.
* ``tolerate_tail``: a torn tail after the last commit is dropped silently
  (reported); damage to a record the target needs is an error.
* ``point_in_time``: the target falls back to the newest epoch at or before
  it that every region can reach without a damaged record; what was given up
  is listed in `Plan.dropped`.
* ``skip_corrupt``: each region falls back on its own to the newest epoch it
  can reach; regions may end at different epochs (each says which).

`Plan.to_json()` keys (stable):

``target`` (what was asked), ``epoch`` (epoch restored; per region in
``regions[*].epoch`` for skip_corrupt), ``mode``, ``bytes_to_read`` (payload
bytes the plan copies), ``naive_bytes`` (payload bytes of every committed
delta and base up to the target: what replaying every record would read),
``bandwidth`` (bytes/s used for the estimate), ``est_seconds``,
``segments`` (sorted segment numbers read), ``regions`` (by name: ``id``,
``epoch``, ``base_epoch`` (null without a base), ``pages``, ``pages_read``,
``zero_pages``, ``bytes_to_read``, ``segments``, ``records``, ``est_seconds``,
``sources`` (list of ``{"lsn", "epoch", "base", "segment", "pages"}`` where
``pages`` is the page count and ``page_ids`` the page numbers taken));
``absent`` (by name: ``id``, ``epoch``, ``first_epoch`` (null when no commit
holds it yet), ``reason``: the regions with no state at their epoch, which
are not in ``regions``: nothing of them is committed at or before it, and a
restore refuses them rather than restore zeros),
``dropped`` (list of ``{"where", "segment", "offset", "lsn", "epoch",
"region", "reason", "gave_up"}``; ``gave_up`` is ``{"epochs": [first, last],
"regions": [names]}`` or null when the damage cost nothing).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from concordia.wal.catalog import BaseEntry, decode_catalog_body
from concordia.wal.errors import CorruptionError, PlanError, TornTailError
from concordia.root_error import Hint
from concordia.wal.modes import CLI_MODES, MODES, RecoveryMode

#: page batch flag bit 0: the record is part of a base snapshot (FORMAT.md)
FLAG_BASE = 0x01

#: bytes/s used for `est_seconds` when the caller gives none: a conservative
#: host-memory copy rate (restore reads the log mapping once).
DEFAULT_BANDWIDTH = 8e9

def mode_name(mode) -> str:
    """'tolerate_tail' | 'absolute' | 'point_in_time' | 'skip_corrupt' from a
    RecoveryMode member, its value or its name (any case, '-' or '_'): the
    one mode type's parsing (wal.modes)."""
    from concordia.wal.errors import UsageError

    try:
        return RecoveryMode.parse(mode).value
    except UsageError:
        raise PlanError(f"unknown recovery mode {mode!r}",
                        hint=Hint(api="one of " + ", ".join(MODES), cli="one of " + ", ".join(CLI_MODES))) from None


# --------------------------------------------------------------------------- history


@dataclass(frozen=True)
class RegionMeta:
    """What the planner needs of a region descriptor."""

    id: int
    name: str
    dtype: str
    shape: tuple
    page_bytes: int
    nbytes: int
    logical: str = ""  # the descriptor's logical dtype name (FORMAT.md §7.1), "" where `dtype` names it

    @property
    def pages(self) -> int:
        return -(-self.nbytes // self.page_bytes) if self.nbytes else 0

    @property
    def logical_dtype(self) -> str:
        return self.logical or np.dtype(self.dtype).name


@dataclass(frozen=True, eq=False)
class ScannedBatch:
    """One valid page batch found by `scan`: header fields, its page numbers and
    stored page CRCs.  (Not the checkpoint's plan of a record to write.)

    `payload` is a (count, page_bytes) uint8 view of the record's pages (in the
    log mapping for a real log; the planner never reads it).
    """

    lsn: int
    epoch: int
    region_id: int
    base: bool
    page_ids: np.ndarray
    page_crcs: np.ndarray
    page_bytes: int
    segment: int
    offset: int
    length: int
    payload: object = None


@dataclass(frozen=True)
class Commit:
    epoch: int
    lsn: int
    first_lsn: int = 0  # the epoch's records lie in [first_lsn, lsn)
    digests: dict = field(default_factory=dict)
    records: int | None = None  # page batches the commit counts, when known
    segment: int = -1
    offset: int = -1


@dataclass(frozen=True)
class Damage:
    """A record the scan could not trust.  epoch/region_id are None when the
    header itself is unreadable.  `tail` marks a torn end of the log."""

    segment: int
    offset: int
    lsn: int | None
    reason: str
    epoch: int | None = None
    region_id: int | None = None
    tail: bool = False
    base: bool = False  # the damaged record is part of a base snapshot

    @property
    def where(self) -> str:
        return f"segment {self.segment} @ {self.offset:#x}"


@dataclass
class History:
    """Record metadata of a log, as the planner sees it."""

    regions: dict  # id -> RegionMeta
    batches: list  # ScannedBatch, in LSN order
    commits: dict  # epoch -> Commit
    bases: list  # BaseEntry, from the current catalog
    damage: list = field(default_factory=list)  # Damage
    floor_epoch: int = 0  # oldest epoch retention still keeps (0 = all)
    region_lsns: dict = field(default_factory=dict)  # id -> LSN of its newest descriptor
    result: object = None  # the reader's ScanResult it was built from (what the log commits, R-D1)
    # the catalog the superblock names was read (or none is named): `bases` is every base
    # there is.  False: the bases are unknown, so no region's chain can start from zero
    # once anything was reclaimed (R-D5)
    catalog_read: bool = True

    def committed_epochs(self) -> list:
        eps = set(self.commits)
        eps.update(b.epoch for b in self.bases)
        return sorted(e for e in eps if e >= self.floor_epoch)

    def floor_past_last(self) -> str | None:
        """Why no epoch is restorable when the floor the log states lies beyond
        its last commit (R-D5: a compaction raises it only to an epoch it
        committed), or None; None too where the walk met damage, which is
        then the answer (a log moving under a live reader's walk)."""
        newest = max(self.commits, default=0)
        if self.floor_epoch <= newest or self.damage or (self.result is not None and self.result.dropped):
            return None
        return (f"the oldest restorable epoch the log states ({self.floor_epoch}) lies beyond its last commit "
                f"({newest or 'none'}): no epoch is restorable")


# --------------------------------------------------------------------------- plan objects


@dataclass
class Source:
    """Pages a region takes from one record: rows `rows` of its payload go to
    page numbers `page_ids`."""

    batch: ScannedBatch
    rows: np.ndarray
    page_ids: np.ndarray

    def to_json(self) -> dict:
        return {
            "lsn": self.batch.lsn,
            "epoch": self.batch.epoch,
            "base": self.batch.base,
            "segment": self.batch.segment,
            "pages": int(self.page_ids.size),
            "page_ids": self.page_ids.tolist(),
        }


@dataclass
class RegionPlan:
    region: RegionMeta
    epoch: int
    base_epoch: int | None
    sources: list  # Source, oldest first
    zero_page_ids: np.ndarray
    digest: int | None  # expected region digest, when a commit or catalog states it
    bandwidth: float = DEFAULT_BANDWIDTH
    # absent: nothing of the region is committed at or before `epoch` (no base, no
    # delta, no commit stating its digest: it was registered after it), so it has
    # no state there to restore; recovery refuses it rather than hand back zeros
    # (`wal.apply.check_present`).  first_epoch: the oldest epoch that holds it
    # (None: none yet).
    absent: bool = False
    first_epoch: int | None = None

    @property
    def name(self) -> str:
        return self.region.name

    @property
    def pages(self) -> int:
        return self.region.pages

    @property
    def pages_read(self) -> int:
        return int(sum(s.page_ids.size for s in self.sources))

    @property
    def bytes_to_read(self) -> int:
        return self.pages_read * self.region.page_bytes

    @property
    def segments(self) -> list:
        return sorted({s.batch.segment for s in self.sources})

    @property
    def est_seconds(self) -> float:
        return self.bytes_to_read / self.bandwidth

    def absent_reason(self) -> str:
        """Why an absent region has nothing to restore, in one line naming it."""
        since = (f"it was first written at epoch {self.first_epoch}" if self.first_epoch is not None
                 else "no committed epoch holds it yet")
        return f"region {self.name!r} has no state at epoch {self.epoch} ({since})"

    def to_json(self) -> dict:
        return {
            "id": self.region.id,
            "epoch": self.epoch,
            "base_epoch": self.base_epoch,
            "pages": self.pages,
            "pages_read": self.pages_read,
            "zero_pages": int(self.zero_page_ids.size),
            "bytes_to_read": self.bytes_to_read,
            "segments": self.segments,
            "records": len(self.sources),
            "est_seconds": self.est_seconds,
            "digest": self.digest,
            "sources": [s.to_json() for s in self.sources],
        }


@dataclass
class PlanLoss:
    """A damage the plan could not use, and what it cost: the epochs and regions
    no longer restorable because of it (None: it cost nothing restorable).
    Not `reader.Dropped`, which is a byte range the open-time walk gave up."""

    damage: Damage
    region: str | None
    gave_up_epochs: tuple | None  # (first, last) epochs no longer restorable
    gave_up_regions: list | None

    def to_json(self) -> dict:
        d = self.damage
        gave = None
        if self.gave_up_epochs is not None:
            gave = {"epochs": list(self.gave_up_epochs), "regions": self.gave_up_regions}
        return {
            "where": d.where,
            "segment": d.segment,
            "offset": d.offset,
            "lsn": d.lsn,
            "epoch": d.epoch,
            "region": self.region,
            "reason": d.reason,
            "gave_up": gave,
        }

    def one_line(self) -> str:
        text = f"{self.damage.where} (lsn {self.damage.lsn}): {self.damage.reason}"
        if self.gave_up_epochs:
            a, b = self.gave_up_epochs
            text += f"; gave up epochs {a}..{b}" + (
                f" of {', '.join(self.gave_up_regions)}" if self.gave_up_regions else ""
            )
        return text


@dataclass
class Plan:
    target: object
    epoch: int
    mode: str
    regions: dict  # name -> RegionPlan
    dropped: list  # PlanLoss
    naive_bytes: int
    bandwidth: float = DEFAULT_BANDWIDTH

    @property
    def absent(self) -> dict:
        """{name: RegionPlan} of the regions with no state at their epoch (`RegionPlan.absent`)."""
        return {n: r for n, r in self.regions.items() if r.absent}

    @property
    def bytes_to_read(self) -> int:
        return sum(r.bytes_to_read for r in self.regions.values())

    @property
    def segments(self) -> list:
        return sorted({s for r in self.regions.values() for s in r.segments})

    @property
    def est_seconds(self) -> float:
        return self.bytes_to_read / self.bandwidth

    def to_json(self) -> dict:
        t = self.target
        return {
            "target": list(t) if isinstance(t, tuple) else t,
            "epoch": self.epoch,
            "mode": self.mode,
            "bytes_to_read": self.bytes_to_read,
            "naive_bytes": self.naive_bytes,
            "bandwidth": self.bandwidth,
            "est_seconds": self.est_seconds,
            "segments": self.segments,
            "regions": {n: r.to_json() for n, r in self.regions.items() if not r.absent},
            "absent": {n: {"id": r.region.id, "epoch": r.epoch, "first_epoch": r.first_epoch,
                           "reason": r.absent_reason()} for n, r in self.absent.items()},
            "dropped": [d.to_json() for d in self.dropped],
        }


# --------------------------------------------------------------------------- pure planning


class _Index:
    """Derived views of a History used while planning."""

    def __init__(self, h: History):
        self.h = h
        self.committed = h.committed_epochs()
        committed = set(self.committed)
        # deltas that belong to a commit: epoch committed and written before the commit
        self.deltas = {}  # region_id -> [ScannedBatch] in (epoch, lsn) order
        counts = {}
        for b in h.batches:
            if b.base:
                continue
            c = h.commits.get(b.epoch)
            if c is None or not (c.first_lsn <= b.lsn < c.lsn):
                continue  # not committed, or left by an attempt the commit does not cover
            counts[b.epoch] = counts.get(b.epoch, 0) + 1
            self.deltas.setdefault(b.region_id, []).append(b)
        for lst in self.deltas.values():
            lst.sort(key=lambda b: (b.epoch, b.lsn))
        # bases: catalog entries whose records are all present and valid
        by_key = {}
        for b in h.batches:
            if b.base:
                by_key.setdefault((b.region_id, b.epoch), []).append(b)
        self.bases = {}  # region_id -> [(BaseEntry, [ScannedBatch])] newest first
        self.damage_of_base = {}
        for e in h.bases:
            if e.image:  # the epoch's own committed batches of the region (FORMAT.md §12.2)
                recs = [b for b in self.deltas.get(e.region_id, ())
                        if b.epoch == e.epoch and e.first_lsn <= b.lsn <= e.last_lsn]
            else:
                recs = [b for b in by_key.get((e.region_id, e.epoch), ()) if e.first_lsn <= b.lsn <= e.last_lsn]
            self.bases.setdefault(e.region_id, []).append((e, recs))
        for lst in self.bases.values():
            lst.sort(key=lambda x: -x[0].epoch)
        # damage attributed to (region, epoch); region None = every region
        self.bad = []  # (Damage, epoch, region_id|None, base: bool)
        for d in h.damage:
            if d.epoch is None:
                continue  # unattributable on its own; found through commit counts below
            self.bad.append((d, d.epoch, d.region_id, d.base))
        # what a commit counts (V-C4) is the reader's decision (scan, R-D1): a commit
        # here either holds its records or its missing ones are attributed damage
        self.committed_set = committed
        # the epochs at which each region has committed state: its deltas, its bases,
        # and the commits stating its digest (a region is absent before the first)
        held = {}
        for rid, lst in self.deltas.items():
            held.setdefault(rid, set()).update(b.epoch for b in lst)
        for e in h.bases:
            held.setdefault(e.region_id, set()).add(e.epoch)
        for c in h.commits.values():
            for rid in c.digests:
                held.setdefault(rid, set()).add(c.epoch)
        self.first_held = {rid: min(eps) for rid, eps in held.items()}

    def absent(self, r: RegionMeta, epoch: int) -> bool:
        """R-D6: region `r` has no committed state at or before `epoch` (an
        empty region always has: nothing)."""
        first = self.first_held.get(r.id)
        return r.pages > 0 and (first is None or first > epoch)

    def base_usable(self, entry: BaseEntry, recs: list) -> Damage | None:
        """None when the base is whole; else the damage that breaks it."""
        image = entry.image
        for d, ep, rid, _ in self.bad:
            # a BASE base is broken by damage to BASE records; an image by damage to the epoch's own
            if ep == entry.epoch and (rid is None or rid == entry.region_id) and (d.base != image or rid is None):
                if d.lsn is None or entry.first_lsn <= d.lsn <= entry.last_lsn:
                    return d
        if len(recs) != entry.records:
            return Damage(
                segment=-1, offset=-1, lsn=entry.first_lsn,
                reason=f"{'image ' if image else ''}base of region {entry.region_id} at epoch {entry.epoch} lists "
                f"{entry.records} records, {len(recs)} readable",
                epoch=entry.epoch, region_id=entry.region_id,
            )
        if image and not _covers(recs, entry.pages, self.h.regions.get(entry.region_id)):
            return Damage(
                segment=-1, offset=-1, lsn=entry.first_lsn,
                reason=f"image base of region {entry.region_id} at epoch {entry.epoch}: its records do not "
                f"cover every page of the region",
                epoch=entry.epoch, region_id=entry.region_id,
            )
        return None

    def chain(self, rid: int, target: int):
        """(base entry|None, base batches, deltas, damage|None) for region `rid` at `target`.

        damage is the first damaged record the chain needs (the plan cannot use it):
        R-D6, a region restores at `target` only if nothing its chain holds is damaged."""
        base, base_recs, bad_base = None, [], None
        floor = self.h.floor_epoch
        for entry, recs in self.bases.get(rid, ()):
            if entry.epoch > target:
                continue
            why = self.base_usable(entry, recs)
            if why is None:
                base, base_recs = entry, recs
                break
            bad_base = bad_base or why
        start = base.epoch if base else 0
        if base is None and floor > 0 and (bad_base is not None or not self.h.catalog_read):
            # R-D5: compaction based this region (or, the catalog being lost, may have),
            # and its deltas before the base may be reclaimed: without a usable base
            # nothing is whole.  Only a region the catalog in force lists no base of
            # starts from zero once something was reclaimed (compaction bases every
            # region whose deltas it reclaims)
            return None, [], [], bad_base or Damage(
                segment=-1, offset=-1, lsn=None,
                reason=f"no usable base of region {rid} at or before epoch {target} "
                f"(the snapshot catalog is lost) and deltas before epoch {floor} were reclaimed",
                epoch=target, region_id=rid,
            )
        deltas = [b for b in self.deltas.get(rid, ()) if start < b.epoch <= target]
        for d, ep, drid, is_base in sorted(self.bad, key=lambda x: x[1]):
            if start < ep <= target and (drid is None or drid == rid) and not d.tail and not is_base:
                return base, base_recs, deltas, d
        return base, base_recs, deltas, None


def _covers(recs: list, pages: int, region) -> bool:
    """Whether the page batches `recs` together hold every page of a region of
    `pages` pages (an image entry's rule, FORMAT.md §12.2 V-K3), and the
    region's descriptor, when known, says as many."""
    if region is not None and int(region.pages) != int(pages):
        return False
    runs = _runs(recs, int(pages))
    if runs is not None:   # records that are runs of pages: their union in intervals (`_own`), no page array
        owned: list = []
        for lo, c in runs:
            if c:
                _own(owned, lo, lo + c)
        return owned == ([(0, int(pages))] if pages else [])
    seen = np.zeros(int(pages), bool)
    for b in recs:
        ids = np.asarray(b.page_ids, np.int64)
        if ids.size and int(ids[-1]) >= pages:
            return False
        seen[ids] = True
    return bool(seen.all())


_RANGES: list = []   # the read-only int64 ranges `ascending` has handed out views of, largest last


def ascending(lo: int, n: int) -> np.ndarray:
    """lo, lo + 1, ..., lo + n - 1 (int64), a read-only view of one shared
    range: a source that takes a record whole (a KV region of 256-byte pages
    has millions) costs no memory or time per page.  `is_ascending` knows them."""
    if not _RANGES or _RANGES[-1].size < lo + n:
        r = np.arange(max(lo + n, 2 * _RANGES[-1].size if _RANGES else 1 << 16), dtype=np.int64)
        r.flags.writeable = False
        _RANGES.append(r)
    return _RANGES[-1][lo:lo + n]


def is_ascending(a) -> bool:
    """Whether `a` is a view `ascending` made (consecutive by construction)."""
    base = getattr(a, "base", None)
    return base is not None and any(base is r for r in _RANGES) and a.ndim == 1 and a.strides == (8,)


#: `_select` in interval arithmetic for a region of at most this many records (each
#: one run of pages); beyond, the page array (adding a run to many scattered ones
#: costs a list insertion each: 100,000 single-page runs took 1.6 s against 0.66)
RUN_SELECT_RECORDS = 4096


def _select(region: RegionMeta, base_recs: list, deltas: list):
    """Last writer per page wins: walk records newest first, give each page to
    the first record that has it.  Returns (sources oldest first, zero page ids)."""
    newest_first = list(reversed(deltas)) + sorted(base_recs, key=lambda b: -b.lsn)
    runs = _runs(newest_first, region.pages) if len(newest_first) <= RUN_SELECT_RECORDS else None
    if runs is not None:
        return _select_runs(newest_first, runs, region.pages)
    return _select_pages(newest_first, region.pages)


def _run_of(ids, n: int) -> tuple[int, int] | None:
    """(first page, page count) when page ids `ids` are one run inside a region
    of n pages (a valid record's ids strictly increase, V-P4, so its first and
    last id tell; no ids: (0, 0)), else None."""
    c = int(ids.size)
    if not c:
        return 0, 0
    lo = int(ids[0])
    return (lo, c) if int(ids[-1]) - lo == c - 1 and lo + c <= n else None


def _runs(records: list, n: int) -> list | None:
    """`_run_of` each record, or None when one of them is not a run."""
    out = []
    for b in records:
        run = _run_of(b.page_ids, n)
        if run is None:
            return None
        out.append(run)
    return out


def _select_runs(records: list, runs: list, n: int):
    """`_select` of records that are each one run of pages, in interval
    arithmetic: a few integer operations a record, where `_select_pages`
    makes several passes over an array of the region's pages (each a numpy
    call that lets go of the GIL, and beside a thread running Python waits up
    to a switch interval to get it back: a read ahead beside a model's build,
    `concordia.prefetch`).  The same sources and zero pages."""
    owned: list = []   # disjoint [a, b) intervals, sorted
    left, picked = n, []
    for b, (lo, c) in zip(records, runs):
        if left == 0:
            break
        if not c:
            continue
        hi = lo + c
        free, at = [], lo   # the parts of [lo, hi) no newer record has
        k = bisect.bisect_right(owned, (lo, float("inf"))) - 1
        k = max(k, 0)
        while k < len(owned) and owned[k][0] < hi:
            a, e = owned[k]
            if e > at:
                if a > at:
                    free.append((at, a))
                at = max(at, e)
            k += 1
        if at < hi:
            free.append((at, hi))
        if not free:
            continue
        if free == [(lo, hi)]:   # the whole record: views of one shared range, no memory per page
            rows, pids = ascending(0, c), ascending(lo, c)
        else:
            rows = np.concatenate([np.arange(a - lo, e - lo, dtype=np.int64) for a, e in free])
            pids = rows + lo
        _own(owned, lo, hi)
        left -= int(pids.size)
        picked.append(Source(batch=b, rows=rows, page_ids=pids))
    picked.reverse()
    gaps, at = [], 0
    for a, e in owned:
        if a > at:
            gaps.append((at, a))
        at = e
    if at < n:
        gaps.append((at, n))
    zeros = (np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in gaps]) if gaps
             else np.empty(0, np.int64))
    return picked, zeros


def _own(owned: list, lo: int, hi: int) -> None:
    """Add [lo, hi) to the sorted disjoint intervals `owned`, merging."""
    i = bisect.bisect_left(owned, (lo, lo))
    if i and owned[i - 1][1] >= lo:
        i -= 1
    j = i
    while j < len(owned) and owned[j][0] <= hi:
        lo, hi = min(lo, owned[j][0]), max(hi, owned[j][1])
        j += 1
    owned[i:j] = [(lo, hi)]


def _select_pages(records: list, n: int):
    """`_select` over an array of the region's pages (records whose page ids are not runs)."""
    owned = np.zeros(n, dtype=bool)
    left = n
    picked = []
    for b in records:
        if left == 0:
            break
        ids = b.page_ids
        run = _run_of(ids, n)
        if run is not None and run[1]:   # a run of page ids: slices, no gathers
            lo, c = run
            mine = ~owned[lo:lo + c]
            if mine.all():   # the whole record: views of one shared range, no memory per page
                rows, pids = ascending(0, c), ascending(lo, c)
            else:
                rows = np.flatnonzero(mine).astype(np.int64)
                if not rows.size:
                    continue
                pids = rows + lo
            owned[lo:lo + c] = True
        else:
            valid = ids < n
            take = valid & ~owned[np.minimum(ids, max(n - 1, 0))] if n else valid & False
            if not take.any():
                continue
            rows = np.flatnonzero(take).astype(np.int64)
            pids = ids[rows].astype(np.int64)
            owned[pids] = True
        left -= pids.size
        picked.append(Source(batch=b, rows=rows, page_ids=pids))
    picked.reverse()
    return picked, np.flatnonzero(~owned).astype(np.int64)


def _resolve_target(h: History, idx: _Index, target) -> int:
    committed = idx.committed
    if target is None or target == "latest":
        if not committed:
            past = h.floor_past_last()
            raise PlanError(past or "the log holds no committed epoch", hint=None if past else "nothing to restore")
        return committed[-1]
    if isinstance(target, tuple) and len(target) == 2 and target[0] == "lsn":
        n = int(target[1])
        eps = [c.epoch for c in h.commits.values() if c.lsn <= n and c.epoch >= h.floor_epoch]
        if not eps:
            raise PlanError(f"no epoch committed at or before lsn {n}")
        return max(eps)
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        e = int(target)
        if h.floor_epoch and e < h.floor_epoch:
            raise PlanError(
                f"epoch {e} is older than retention keeps (oldest restorable epoch {h.floor_epoch})"
            )
        if e not in idx.committed_set and e not in {b.epoch for b in h.bases}:
            latest = committed[-1] if committed else None
            raise PlanError(f"epoch {e} was never committed", hint=f"latest committed epoch is {latest}")
        return e
    raise PlanError(f"bad target {target!r}", hint="'latest', an epoch number or ('lsn', N)")


def _expected_digest(h: History, rid: int, epoch: int, base, deltas) -> int | None:
    """The region digest the restored region must match: the commit of the
    newest epoch that wrote the region (state is unchanged after it), or the
    catalog's when the base is newest."""
    last = max((b.epoch for b in deltas), default=None)
    if last is None or (base is not None and base.epoch >= last):
        if base is not None:
            return base.digest
        c = h.commits.get(epoch)
        return c.digests.get(rid) if c else None
    # any commit from `last` to `epoch` that states a digest for rid is valid
    for ep in range(epoch, last - 1, -1):
        c = h.commits.get(ep)
        if c is not None and rid in c.digests:
            return c.digests[rid]
    return None


def _first_given_up(h: History, idx: _Index, ep: int, want: int) -> int:
    """The oldest epoch after `ep` up to `want` that a fallback to `ep` gives up:
    committed, or incomplete (its commit fails V-C4, R-D4)."""
    cands = [e for e in idx.committed if ep < e <= want]
    cands += [d.epoch for d in h.damage if d.epoch is not None and not d.tail and ep < d.epoch <= want]
    return min(cands, default=want)


def _consistent_epoch(h: History, idx: _Index, r: RegionMeta, target: int):
    """Newest committed epoch <= target at which region r's chain is whole.
    Returns (epoch|None, first damage met).  A fallback never goes back past
    the region's first committed state: before it the region has none (it is
    given up, as when every chain is damaged)."""
    first = None
    for ep in reversed(idx.committed):
        if ep > target:
            continue
        base, _, _, bad = idx.chain(r.id, ep)
        if bad is None:
            if first is not None and idx.absent(r, ep):
                return None, first
            return ep, first
        first = first or bad
    return None, first


def plan_history(
    h: History,
    target="latest",
    mode="tolerate_tail",
    *,
    regions: Iterable[str] | None = None,
    bandwidth: float | None = None,
) -> Plan:
    """Plan a restore of `h` at `target` under recovery `mode` (pure; see module doc)."""
    mode = mode_name(mode)
    bw = float(bandwidth or DEFAULT_BANDWIDTH)
    idx = _Index(h)
    dropped: list = []
    name_of = {r.id: r.name for r in h.regions.values()}

    tail = [d for d in h.damage if d.tail]
    corrupt = [d for d in h.damage if not d.tail]
    if mode == "absolute" and h.damage:
        d = h.damage[0]
        cls = TornTailError if d.tail else CorruptionError
        raise cls(f"{'torn tail: ' if d.tail else ''}{d.reason} (lsn {d.lsn})",
                  where=d.where if d.segment >= 0 else None, hint=RecoveryMode.ABSOLUTE.refusal_hint)
    if mode == "tolerate_tail" and corrupt:
        # R-D4: corruption before a commit point refuses the whole log, whichever
        # regions are asked for (no per-region leniency in this mode)
        d = corrupt[0]
        raise CorruptionError(f"{d.reason} (lsn {d.lsn}): corruption before the last commit",
                              where=d.where if d.segment >= 0 else None,
                              hint=RecoveryMode.TOLERATE_TAIL.refusal_hint)
    if corrupt and not h.regions:
        # R-D6: no region is known, and damage may be what hides the descriptors
        # (compaction writes them again beside its bases): nothing can be restored
        d = corrupt[0]
        raise CorruptionError(f"no region descriptor of the log is readable, and {d.reason}"
                              + (f" (lsn {d.lsn})" if d.lsn is not None else ""),
                              where=d.where if d.segment >= 0 else None,
                              hint="nothing can be restored from this log alone")
    for d in tail:
        dropped.append(PlanLoss(d, name_of.get(d.region_id), None, None))

    want = _resolve_target(h, idx, target)
    chosen = list(h.regions.values())
    if regions is not None:
        names = {r.name: r for r in chosen}
        missing = [n for n in regions if n not in names]
        if missing:
            raise PlanError(f"no region named {missing[0]!r}", hint="regions: " + ", ".join(sorted(names)))
        chosen = [names[n] for n in regions]

    # epoch each region restores to
    per_region = {}
    if mode in ("tolerate_tail", "absolute"):
        for r in chosen:
            _, _, _, bad = idx.chain(r.id, want)
            if bad is not None:
                raise CorruptionError(
                    f"region {r.name!r} at epoch {want} needs a damaged record (lsn {bad.lsn}): {bad.reason}",
                    where=bad.where if bad.segment >= 0 else None,
                    hint=RecoveryMode.parse(mode).refusal_hint,
                )
            per_region[r.id] = want
    elif mode == "point_in_time":
        # R-D4: the newest committed epoch <= want whose commit lies before the
        # first corruption and at which every region of the log (not only the
        # asked ones) has a whole chain
        first_bad = min((d.lsn for d in corrupt if d.lsn is not None), default=None)
        ep = None
        for cand in reversed(idx.committed):
            c = h.commits.get(cand)
            if first_bad is not None and (c is None or c.lsn >= first_bad):
                continue
            if cand <= want and all(idx.chain(r.id, cand)[3] is None for r in h.regions.values()):
                ep = cand
                break
        if ep is None:
            bad = next((b for b in (idx.chain(r.id, want)[3] for r in h.regions.values()) if b is not None),
                       corrupt[0] if corrupt else None)
            raise CorruptionError(
                f"no epoch at or before {want} is consistent: {bad.reason} (lsn {bad.lsn})",
                where=bad.where if bad.segment >= 0 else None,
            )
        for r in chosen:
            per_region[r.id] = ep
        if ep != want:
            gave = [r.name for r in chosen]
            first = _first_given_up(h, idx, ep, want)
            seen = set()
            for r in h.regions.values():
                _, _, _, bad = idx.chain(r.id, want)
                if bad is not None and id(bad) not in seen:
                    seen.add(id(bad))
                    dropped.append(PlanLoss(bad, name_of.get(bad.region_id), (first, want), gave))
            for d in corrupt:
                if id(d) not in seen and d.lsn is not None and d.lsn < h.commits[want].lsn:
                    seen.add(id(d))
                    dropped.append(PlanLoss(d, name_of.get(d.region_id), (first, want), gave))
    else:  # skip_corrupt: each region on its own
        for r in chosen:
            ep, bad = _consistent_epoch(h, idx, r, want)
            if ep is None:
                since = max(idx.committed[0], idx.first_held.get(r.id, 0))  # what it had to give up
                dropped.append(PlanLoss(bad, r.name, (since, want), [r.name]))
                continue
            per_region[r.id] = ep
            if ep != want:
                dropped.append(PlanLoss(bad, r.name, (_first_given_up(h, idx, ep, want), want), [r.name]))
        if chosen and not per_region:
            # not one asked region restores at any epoch: recovery refuses, as POINT_IN_TIME does
            bad = dropped[-1].damage
            raise CorruptionError(f"no region restores at any epoch at or before {want}: {bad.reason}"
                                  + (f" (lsn {bad.lsn})" if bad.lsn is not None else ""),
                                  where=bad.where if bad.segment >= 0 else None)

    plans = {}
    naive = 0
    for r in chosen:
        if r.id not in per_region:
            continue
        ep = per_region[r.id]
        base, base_recs, deltas, _ = idx.chain(r.id, ep)
        sources, zeros = _select(r, base_recs, deltas)
        plans[r.name] = RegionPlan(
            region=r,
            epoch=ep,
            base_epoch=base.epoch if base else None,
            sources=sources,
            zero_page_ids=zeros,
            digest=_expected_digest(h, r.id, ep, base, deltas),
            bandwidth=bw,
            absent=idx.absent(r, ep),
            first_epoch=idx.first_held.get(r.id),
        )
        # naive replay: the base used, then every committed delta up to ep still in the log
        naive += sum(b.page_ids.size * b.page_bytes for b in base_recs)
        naive += sum(b.page_ids.size * b.page_bytes for b in idx.deltas.get(r.id, ()) if b.epoch <= ep)
    # damage that the plan did not need still gets reported
    listed = {id(x.damage) for x in dropped}
    for d, _, rid, _ in idx.bad:
        if id(d) not in listed and not d.tail:
            dropped.append(PlanLoss(d, name_of.get(rid), None, None))
            listed.add(id(d))
    for d in h.damage:
        if id(d) not in listed and not d.tail and d.epoch is None:
            dropped.append(PlanLoss(d, None, None, None))
            listed.add(id(d))
    effective = min(per_region.values()) if per_region else want
    if mode == "skip_corrupt":  # the newest epoch a region reaches; each says its own
        effective = max(per_region.values()) if per_region else want
    return Plan(
        target=target, epoch=effective, mode=mode,
        regions=plans, dropped=dropped, naive_bytes=naive, bandwidth=bw,
    )




# --------------------------------------------------------------------------- reading a log


def _volume(log):
    vol = getattr(log, "volume", None) or getattr(log, "_volume", None) or getattr(log, "vol", None)
    if vol is None and hasattr(log, "live_segments"):
        vol = log
    if vol is None:
        raise PlanError(f"cannot read records of {type(log).__name__}", hint="pass an open Log")
    return vol


def walk_on(vol, walk: list | None, from_lsn: int, oldest_lsn: int, check_pages: bool = False) -> list | None:
    """A walk of `vol` now, from `walk` (one made before, which ended at
    `from_lsn` with the volume's oldest LSN `oldest_lsn`) and a walk of what
    was appended after it; None (walk it all) when there is none, or when
    segments were freed since (the oldest LSN moved)."""
    from concordia.wal.reader import ScanResult, Scanner

    if walk is None or vol.superblock.oldest_lsn != oldest_lsn:
        return None
    return walk + list(Scanner(vol, check_pages=check_pages).items(ScanResult(), from_lsn=from_lsn))


def _walk_of_open(log, vol, check_pages: bool, progress):
    """The walk a Log made when it opened, when it answers this scan exactly.
    Read-only: nothing can have been appended since, and it checked pages as
    this scan would.  Writable: the walk stops at the open's cut, before which
    the open left only valid records (their pages checked too when this scan
    checks pages), and this scan walks on from the cut (what the cut rewrote
    and what was appended since), with no compaction in between.  Handed over
    once (the Log does not keep it after).  None otherwise, and when progress
    is wanted (the walk is then shown)."""
    from concordia.wal.reader import ScanResult, Scanner, walk_kept

    res = getattr(log, "_result", None)
    walk = getattr(res, "walk", None)
    if not getattr(log, "writable", True) and getattr(res, "walk_end_lsn", None) is not None:
        # a read-only open beside a live writer (Log.open(live=True)): the log as of its last
        # commit, kept for every plan of this Log (a walk on would see what is being written)
        if walk is None or (check_pages and res.walk_checked_pages is not True):
            walk = []
            for it in Scanner(vol, check_pages=check_pages, progress=progress).items(
                    ScanResult(), until_lsn=res.walk_end_lsn):
                if it.seg.lsn(it.offset) >= res.walk_end_lsn:
                    break
                walk.append(it)
            if walk_kept(len(walk), vol):
                res.walk, res.walk_checked_pages = walk, check_pages
        return walk
    if walk is None or progress is not None:
        return None
    if getattr(log, "writable", True):
        if res.walk_end_lsn is None or (check_pages and res.walk_checked_pages is not True):
            return None
        res.walk = None
        return walk_on(vol, walk, res.walk_end_lsn, res.walk_oldest_lsn, check_pages)
    if res.walk_checked_pages is not True and res.walk_checked_pages != check_pages:
        return None  # a walk with page checks answers one without them too
    res.walk = None
    return walk


def scan(log, *, payload: bool = True, check_pages: bool = False, progress=None, walk: list | None = None,
         walked: list | None = None) -> History:
    """Read the metadata of every record of `log` into a History.

    What the log commits, and what is torn or corrupt, is the reader's
    decision (`reader.recover`, R-D1..R-D3), made here over the same walk in
    SKIP_CORRUPT mode so that nothing is refused yet: the History holds the
    commits it accepted, the valid records it kept, and every damaged range
    it reported as a `Damage` (attributed to its epoch and region when the
    record header is intact; `tail` for a torn one).  The planner then decides
    what the recovery mode does with it (R-D4).  Page payloads are CRC-checked
    only with check_pages=True.  With payload=True each ScannedBatch carries a view
    of its pages in the log mapping (no copy).  progress(done_bytes,
    total_bytes) follows the walk (reader.Scanner).  `walk`: the items of a
    walk of this volume made with the same check_pages (reader.verify's), used
    instead of walking again.  `walked`: a list that receives the items of the
    walk the History was made from (`plan_unchecked` checks their pages after)."""
    from concordia.wal import format as F
    from concordia.wal.reader import ScanResult, Scanner, intact_header, recover

    vol = _volume(log)
    sb = vol.superblock
    arr = vol.backend.array
    mv = vol.backend.view
    items = walk if walk is not None else _walk_of_open(log, vol, check_pages, progress)
    if items is None:
        items = list(Scanner(vol, check_pages=check_pages, progress=progress).items(ScanResult()))
    if walked is not None:
        walked.extend(items)
    res = recover(vol, RecoveryMode.SKIP_CORRUPT, None, check_pages=bool(check_pages), items=items)
    opened = getattr(log, "_result", None)
    if walk is None and not getattr(log, "writable", True) and getattr(opened, "walk_end_lsn", None) is not None:
        # a live read-only open's walk ends at its commit point: the torn tail it saw
        # after it is still reported (ABSOLUTE refuses it, as the command lines do)
        res.dropped.extend(opened.tail_dropped)

    regions = {rid: RegionMeta(rid, r.name, r.dtype, tuple(r.shape), r.page_bytes, r.nbytes, r.logical)
               for rid, r in res.regions.items()}
    region_lsns, batches, catalogs, where = {}, [], {}, {}
    for rec in res.records:
        kind = rec.kind
        if kind == F.REC_PAGE_BATCH:
            count, pb, off = rec.count, rec.page_bytes, rec.offset
            t = F.record_body(arr, off, 8 * count).view("<u4")
            poff = off + F.page_batch_payload_offset(count)
            batches.append(ScannedBatch(
                lsn=rec.lsn, epoch=rec.epoch, region_id=rec.region_id, base=bool(rec.flags & FLAG_BASE),
                page_ids=t[:count], page_crcs=t[count:], page_bytes=pb, segment=rec.segment,
                offset=off, length=rec.length,
                payload=arr[poff: poff + count * pb].reshape(count, pb) if payload else None))
        elif kind == F.REC_COMMIT:
            where[rec.lsn] = (rec.segment, rec.offset)
        elif kind == F.REC_REGION:
            region_lsns[rec.region_id] = rec.lsn
        elif kind == F.REC_CATALOG:
            catalogs[rec.lsn] = (rec.segment, rec.offset, rec.count)
    commits = {}
    # each epoch's counted batches (their LSNs), found once: a commit counts those of its
    # epoch in its range (looking through every batch for each commit was quadratic:
    # 20 s of a 23 s open at 15,000 one-page epochs)
    lsns_of: dict[int, list] = {}
    for b in batches:
        if not b.base:
            lsns_of.setdefault(b.epoch, []).append(b.lsn)
    for c in res.commits:  # R-D1: only the commits the reader accepted
        seg_i, off = where.get(c.lsn, (-1, -1))
        counted = sum(1 for lsn in lsns_of.get(c.epoch, ()) if c.first_lsn <= lsn < c.lsn)
        commits[c.epoch] = Commit(c.epoch, c.lsn, c.first_lsn, dict(c.digests), counted, seg_i, off)

    damage = []
    committed_at = {c.lsn for c in res.commits}
    for d in res.dropped:
        if d.kind not in ("corrupt", "torn"):
            continue  # uncommitted, superblock, truncated: reported by the reader, nothing to plan around
        epoch = rid = None
        base = False
        reason = d.reason
        off = d.offset
        seg = next((sg for sg in res.segments if sg.index == d.segment), None)
        # a zero-length place (a lost catalog) is no record's damage; a damaged
        # header says nothing that is believed
        h = intact_header(seg, off, mv) if seg is not None and d.length > 0 else None
        if h is not None:
            if h.type == F.REC_PAGE_BATCH:
                epoch, rid, base = h.epoch, h.region_id, bool(h.flags & FLAG_BASE)
            elif h.type == F.REC_COMMIT:
                # a commit that fails V-C1..V-C4 leaves its epoch incomplete (R-D4), unless
                # SKIP_CORRUPT committed it for the regions whose records are whole (partial)
                epoch = None if h.lsn in committed_at else h.epoch
                if not reason.startswith("commit"):
                    reason = f"commit of epoch {h.epoch}: {reason}"
            elif h.type == F.REC_REGION:
                reason = f"region descriptor {h.region_id}: {reason}"
        lsn = d.lsn
        if lsn is None and d.segment >= 0:
            seg = next((sg for sg in res.segments if sg.index == d.segment), None)
            lsn = seg.lsn(off) if seg is not None else None
        damage.append(Damage(d.segment, off, lsn, reason, epoch, rid, tail=d.kind == "torn", base=base))

    # R-D4, SKIP_CORRUPT's per-region leniency is the reader's (reader._commit_verdicts):
    # a partial commit is among res.commits, and its damaged batches, attributed
    # to their regions above, break only those regions' chains

    bases, floor, catalog_read = [], int(sb.oldest_epoch), True
    if sb.catalog_lsn:
        found = catalogs.get(sb.catalog_lsn)
        catalog_read = False
        if found is None:
            if not any("snapshot catalog the superblock names" in d.reason for d in damage):
                damage.append(Damage(-1, 0, sb.catalog_lsn,
                                     f"the catalog the superblock names (lsn {sb.catalog_lsn}) is missing or damaged"))
        else:
            seg_i, off, count = found
            try:
                cat = decode_catalog_body(F.record_body(mv, off, count), lsn=sb.catalog_lsn)
            except CorruptionError as exc:
                damage.append(Damage(seg_i, off, sb.catalog_lsn, f"catalog: {exc.message}"))
            else:
                bases = list(cat.entries)
                floor = max(floor, cat.floor_epoch)
                catalog_read = True
    if not regions and hasattr(log, "regions"):
        for r in log.regions.values():
            regions[r.id] = RegionMeta(r.id, r.name, r.dtype, tuple(r.shape), r.page_bytes, r.nbytes,
                                       getattr(r, "logical", ""))
    return History(regions=regions, batches=batches, commits=commits, bases=bases, damage=damage,
                   floor_epoch=floor, region_lsns=region_lsns, result=res, catalog_read=catalog_read)


def plan(log, target="latest", mode=None, *, regions=None, bandwidth: float | None = None,
         check_pages: bool | None = None) -> Plan:
    """Plan a restore of the open `log` at `target` ("latest", an epoch, or
    ("lsn", n)) under recovery `mode` (default: the mode the log was opened
    with, else tolerate_tail).  See the module doc for what the plan holds.

    check_pages (default True, R-D5: what the log holds is decided with every
    page CRC checked, so a damaged page that no plan would read still makes
    tolerate_tail refuse, as verify says; a walk the Log's open made with
    page checks is reused, not repeated) CRC-checks every page of the log
    during the scan; False leaves it to the applier, which checks the pages
    it copies (a component path, not the decision)."""
    if mode is None:
        mode = getattr(log, "mode", None)
    if check_pages is None:
        check_pages = True
    return plan_history(scan(log, check_pages=check_pages), target, mode, regions=regions, bandwidth=bandwidth)


def plan_unchecked(log, target="latest", mode=None, *, regions=None) -> tuple[Plan, "PageCheck"]:
    """A plan made from the log's metadata (every header, table and commit
    checked, no page payload read), and the page checks R-D5 makes before a
    plan is trusted, left for the caller to run where the bytes flow
    (`PageCheck`).  The plan is the one `plan` would make whenever those checks
    find nothing: a page that fails them changes what the log holds, and then
    only `plan` (with its checks) decides."""
    if mode is None:
        mode = getattr(log, "mode", None)
    items: list = []
    h = scan(log, check_pages=False, walked=items)
    return plan_history(h, target, mode, regions=regions), PageCheck(_volume(log), items)


class PageCheck:
    """R-D5's page checks (V-P5) of the page batches of one walk, left from
    planning.  `run(read)`: `read` are the Sources whose pages an applier
    copies, checking each against its stored CRC as it does; the rest is
    checked here: of a record read in part, the rows no source copies, each
    against its stored CRC (a record every page of which matches its CRC is
    what V-P5's fold of the table says), and every other record whole.
    Returns whether all of them passed."""

    def __init__(self, vol, items: list):
        self.vol, self.items = vol, items

    def run(self, read=()) -> bool:
        from concordia.wal import pagecrc
        from concordia.wal.reader import Found, Scanner

        left: dict = {}   # record offset -> (its batch, rows no source copies; None: none)
        for s in read:
            b = s.batch
            had = left.get(b.offset)
            if had is not None and had[1] is None:
                continue   # copied whole already
            if s.rows.size == b.page_ids.size:   # a source's rows are distinct: this one copies every row
                left[b.offset] = (b, None)
                continue
            rows = had[1] if had is not None else np.ones(b.page_ids.size, bool)
            rows[s.rows] = False
            left[b.offset] = (b, rows)
        for b, rows in left.values():
            if rows is not None and rows.any() and not np.array_equal(
                    pagecrc.page_crcs(b.payload[rows], release_gil=True), np.asarray(b.page_crcs)[rows]):
                return False
        items = list(self.items)   # check_pages_of puts damaged ranges in place of records
        idx = [i for i, it in enumerate(items) if isinstance(it, Found) and it.offset not in left]
        Scanner(self.vol, check_pages=False).check_pages_of(items, idx)  # the page batches among them
        return all(isinstance(items[i], Found) for i in idx)


__all__ = [
    "FLAG_BASE", "DEFAULT_BANDWIDTH", "MODES", "PlanError", "mode_name",
    "RegionMeta", "ScannedBatch", "Commit", "BaseEntry", "Damage", "History",
    "Source", "RegionPlan", "PlanLoss", "Plan", "plan_history", "scan", "plan", "plan_unchecked", "PageCheck",
]
