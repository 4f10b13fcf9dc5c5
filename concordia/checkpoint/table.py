"""The region table: every region one table pass checkpoints, as one row of a
structured numpy array (mirrored on the device by `device.DeviceTablePass`).

    base, nbytes       the region's bytes (device address; 0 on the host twin)
    state              its detector's state: shadow copy or fingerprints (address)
    crc_table          its page CRC table of the last committed epoch (address)
    first_page         where its pages start in the epoch's page space: the
                       pages of every region, back to back in table order
    pages, page_bytes
    detector           DET_* below: which launch finds its dirty pages
    region_id          its id in the log
    digest_slot        its row in the digest array the commit takes
    per_record         most pages in one of its page-batch records

A checkpoint of the table is one detection launch per group of rows that
share a detector and page size, writing one flag per page of the page space;
the flags become the epoch's sorted dirty pages, and those its records: one
region after the other in table order, each region's pages cut into records
of at most `per_record` pages (`plan_records`, and on the device the
`table_plan` kernel of gpu_kernels/table.cu, which lays them out the same
way).  Record lengths come from `wal.format`.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from concordia.checkpoint import staging
from concordia.regions.arrays import is_torch, storage_of
from concordia.wal import format as fmt

#: one row of the region table (gpu_kernels/table.cu: struct TableEntry)
ENTRY = np.dtype([("base", "<u8"), ("nbytes", "<u8"), ("state", "<u8"), ("crc_table", "<u8"),
                  ("first_page", "<u8"), ("pages", "<u4"), ("page_bytes", "<u4"), ("detector", "<u4"),
                  ("region_id", "<u4"), ("digest_slot", "<u4"), ("per_record", "<u4")])
assert ENTRY.itemsize == 64

#: one record of a table pass (table.cu: struct TableRecord): pages [lo, lo + count)
#: of the epoch's sorted dirty pages, at `offset` of the extent
RECORD = np.dtype([("lo", "<u8"), ("offset", "<u8"), ("length", "<u8"), ("region", "<u4"), ("count", "<u4")])
assert RECORD.itemsize == 32

#: what the plan found (table.cu: struct TablePlan); `fits` is 0 when the
#: records need more than the extent holds (`bytes` says how much)
PLAN = np.dtype([("fits", "<u8"), ("bytes", "<u8"), ("records", "<u8"), ("pages", "<u8")])

DET_ALL = 0          # every page (a region without a base: not in a table)
DET_SHADOW = 1       # shadow diff, on the device or by the twin
DET_FINGERPRINT = 2  # fingerprints
DET_LISTED = 3       # the region lists its pages on the host (block tables, slot versions, store tracker)
DET_POSITIONS = 4    # a static cache's rows from a length the caller keeps in a word beside it (`positions_words`)
DETECTOR_CODES = {"shadow": DET_SHADOW, "fingerprint": DET_FINGERPRINT}
#: the detectors the device runs with no list from the host
DEVICE_DETECTORS = (DET_SHADOW, DET_FINGERPRINT, DET_POSITIONS)

#: a DET_POSITIONS row's detector state (table.cu: struct PositionsState): the
#: addresses of its length and sequence words (0: no sequence word), the last
#: epoch's values (last < 0: none yet), what this epoch's detection read, the
#: cache's geometry, then the detection's baseline (the last values as it
#: found them), the pages it counted and where the plan put their ids
POSITIONS = np.dtype([("length", "<u8"), ("seq", "<u8"), ("last", "<i8"), ("last_seq", "<i8"), ("now", "<i8"),
                      ("now_seq", "<i8"), ("max_len", "<u8"), ("row_bytes", "<u8"), ("lo", "<i8"),
                      ("lo_seq", "<i8"), ("count", "<u8"), ("at", "<u8")])
assert POSITIONS.itemsize == 96


def detector_code(detect: str) -> int:
    return DETECTOR_CODES.get(detect, DET_LISTED)


def detector_of(r) -> int:
    """The table detector of region `r`: DET_POSITIONS for a positions region
    whose length (and sequence id, when it has one) are one-element int64
    arrays on the region's own side (numpy beside numpy, device beside
    device) and that asks for no cross-check, so that a pass reads them
    where the region is, with no host step; else by its `detect`."""
    if r.detect == "positions":
        return DET_POSITIONS if positions_words(r) is not None else DET_LISTED
    return detector_code(r.detect)


def positions_words(r) -> tuple | None:
    """(length word, sequence word or None) of positions region `r` as
    arrays on its side (`detector_of`), or None when it has no such words."""
    from concordia.regions.arrays import adapt

    if r.check_every:
        return None
    h = r.hints
    out = []
    for key in ("length", "seq_ids"):
        v = h.get(key)
        if v is None and key == "seq_ids":
            out.append(None)
            continue
        if v is None or callable(v) or isinstance(v, (int, np.integer)) or not hasattr(v, "shape"):
            return None
        try:
            a, xp, _ = adapt(v, f"region {r.name!r}")
        except Exception:  # an array the pass cannot read: listed by the host, as before
            return None
        if a.size != 1 or a.dtype != np.int64 or (xp is np) == bool(r.on_gpu) or not a.flags.c_contiguous:
            return None
        out.append(a)
    return tuple(out)


class RegionTable:
    """The rows of `regions` (in that order) and what a pass keeps between
    checkpoints: the digest of every region (the commit's), and the record
    bytes of the last epoch (the next extent's size).

    The digests here are the truth while the table is in use: `write_back`
    hands them to the regions when another path takes over."""

    def __init__(self, regions: list, capacity: int | None = None):
        """capacity: the bytes one log segment holds (`Appender.segment_capacity`);
        every page-batch record is cut to fit it, as the per-region paths cut
        theirs (`staging.batch_pages`).  None: MAX_BATCH_BYTES of payload only."""
        self.regions = list(regions)
        n = len(self.regions)
        e = np.zeros(n, ENTRY)
        e["pages"] = [r.pages for r in self.regions]
        e["page_bytes"] = [r.page_bytes for r in self.regions]
        e["detector"] = [detector_of(r) for r in self.regions]
        e["region_id"] = [r.id for r in self.regions]
        e["digest_slot"] = np.arange(n)
        if capacity is None:
            e["per_record"] = np.maximum(1, staging.MAX_BATCH_BYTES // e["page_bytes"])
        else:
            per_size = {int(pb): staging.batch_pages(int(pb), int(capacity)) for pb in set(e["page_bytes"].tolist())}
            e["per_record"] = [per_size[int(pb)] for pb in e["page_bytes"]]
        pages = e["pages"].astype(np.int64)
        e["first_page"] = np.cumsum(pages) - pages
        self.entries = e
        self.names = [r.name for r in self.regions]
        self.total_pages = int(pages.sum())
        self.page_bytes = e["page_bytes"].astype(np.int64)
        self.digests = np.array([r.digest for r in self.regions], np.uint32)
        #: the rows in region-id order: a commit's digests, as a pass that
        #: commits its own epoch writes them (`write_commit`, table.cu's table_commit)
        self.commit_order = np.argsort(e["region_id"], kind="stable").astype(np.uint32)
        #: bytes of this table's commit record
        self.commit_length = fmt.record_length(fmt.COMMIT_BODY_SIZE + fmt.COMMIT_DIGEST_SIZE * n)
        #: most records an epoch can need (every page dirty)
        per = e["per_record"].astype(np.int64)
        self.max_records = int((-(-pages // per)).sum())
        self.last_bytes = 0
        #: record bytes of the last epoch an arena lost (its records did not fit what was left), and the
        #: arenas lost in a row since one's epoch was taken on: kept by the session's runner across tables
        #: (`arena.last_epoch_bytes`: arenas are sized for it; `too_large` heeds it after a second loss)
        self.arena_hint = 0
        self.arena_losses = 0
        #: rows by (detector code, page bytes): one detection launch each
        self.groups: dict = {}
        keys = np.stack([e["detector"].astype(np.int64), self.page_bytes], axis=1) if n else np.zeros((0, 2), np.int64)
        for key in sorted({(int(a), int(b)) for a, b in keys}):
            self.groups[key] = np.flatnonzero((keys[:, 0] == key[0]) & (keys[:, 1] == key[1])).astype(np.uint32)
        # what `unchanged` compares: a numpy or CuPy array cannot move its memory
        # without changing its shape (neither resizes in place otherwise), so its
        # shape and dtype say enough; a tensor can be given new storage
        moved = [r for r in self.regions if is_torch(r.owner)]
        fixed = [r.owner for r in self.regions if not is_torch(r.owner)]
        self._shape, self._dtype = operator.attrgetter("shape"), operator.attrgetter("dtype")
        self._fixed = fixed
        self._fixed_shapes = list(map(self._shape, fixed))  # two lists: no (shape, dtype) pair made per array
        self._fixed_dtypes = list(map(self._dtype, fixed))
        # a tensor: the same fields `storage_of` gives, each gathered for every
        # tensor by one C-level map (dtype and device compared as objects: equal
        # exactly when their names are)
        self._movable = [r.owner for r in moved]
        self._t_probe = operator.attrgetter("shape", "dtype", "device")
        self._t_ptr = operator.methodcaller("data_ptr")
        self._t_storage = operator.methodcaller("untyped_storage")
        self._t_nbytes = operator.methodcaller("nbytes")
        self._movable_want = None
        if moved:
            try:
                want = self._tensor_state()
            except Exception:  # a tensor without storage: `storage_of` region by region
                want = None
            self._movable_want = want
        self._movable_regions = moved
        # what is compared from now on is what `register` saw: a region that
        # changed before this table was made is found by `Region.check_unchanged`
        self._as_registered = all(storage_of(r.owner) == r.storage for r in self.regions)

    def _tensor_state(self) -> tuple:
        owners = self._movable
        return (list(map(self._t_probe, owners)), list(map(self._t_ptr, owners)),
                list(map(self._t_nbytes, map(self._t_storage, owners))))

    def __len__(self) -> int:
        return len(self.regions)

    def unchanged(self) -> bool:
        """Whether every region's array still has its registered shape, dtype
        and storage (False: `Region.check_unchanged` says which did not)."""
        if not self._as_registered:
            return False
        fixed = self._fixed
        if list(map(self._shape, fixed)) != self._fixed_shapes or list(map(self._dtype, fixed)) != self._fixed_dtypes:
            return False
        if not self._movable:
            return True
        if self._movable_want is None:
            return all(storage_of(r.owner) == r.storage for r in self._movable_regions)
        try:
            return self._tensor_state() == self._movable_want
        except Exception:  # storage gone: `Region.check_unchanged` says how
            return False

    def listed(self) -> np.ndarray:
        """Rows whose pages the host lists (DET_LISTED)."""
        return np.flatnonzero(self.entries["detector"] == DET_LISTED)

    def commit_digests(self):
        """The digests for `Appender.commit`: (region ids, digests) arrays, or
        for a few regions a dict (cheaper to encode)."""
        if len(self.regions) <= 16:
            return dict(zip(self.entries["region_id"].tolist(), self.digests.tolist()))
        return self.entries["region_id"], self.digests

    def write_back(self, owner) -> None:
        """Give each region its digest from the table (another path takes over),
        through `owner` (the `RegionSet`)."""
        owner.take_digests(self.regions, self.digests.tolist())


def write_commit(table: RegionTable, view: np.ndarray, used: int, records: int, *, lsn: int, epoch: int,
                 salt: int, prev_commit: int) -> None:
    """The commit record of a pass that commits its own epoch, at `used` of
    the extent `view` (whose byte 0 has LSN `lsn`) right after its `records`
    records, and a zeroed header slot after it when that lies in the extent:
    the numpy twin of table.cu's `table_commit`, by `wal.format`."""
    body = fmt.encode_commit_body(records, used, lsn if records else 0,
                                  (table.entries["region_id"], table.digests[table.entries["digest_slot"]]))
    n = fmt.encode_record_into(view[used:], type=fmt.REC_COMMIT, lsn=lsn + used, epoch=epoch, salt=salt,
                               body=body, aux=prev_commit)
    if used + n + fmt.RECORD_HEADER_SIZE <= view.size:
        view[used + n:used + n + fmt.RECORD_HEADER_SIZE] = 0


def plan_records(entries: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The records an epoch writes, given each row's dirty-page count: RECORD
    rows, region after region in table order, each region's pages cut into
    records of at most per_record pages, back to back from offset 0.  The
    twin of table.cu's `table_plan` (no loop over regions)."""
    c = np.asarray(counts, np.int64)
    per = entries["per_record"].astype(np.int64)
    pb = entries["page_bytes"].astype(np.int64)
    nrec = -(-c // per)
    total = int(nrec.sum())
    out = np.zeros(total, RECORD)
    if total == 0:
        return out
    region = np.repeat(np.arange(c.size, dtype=np.int64), nrec)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nrec) - nrec, nrec)
    start = np.cumsum(c) - c  # the region's first dirty page among the epoch's sorted dirty pages
    count = np.minimum(per[region], c[region] - j * per[region])
    length = fmt.page_batch_length(count, pb[region])
    out["region"] = region
    out["count"] = count
    out["lo"] = start[region] + j * per[region]
    out["length"] = length
    out["offset"] = np.cumsum(length) - length
    return out


def plan_bytes(recs: np.ndarray) -> int:
    """The bytes of the records `plan_records` laid out."""
    return int(recs["length"].sum()) if recs.size else 0


def records_bytes(table, counts) -> int:
    """Record bytes of an epoch of `table` whose rows have `counts` dirty pages."""
    return plan_bytes(plan_records(table.entries, np.asarray(counts, np.int64)))


class TableResult:
    """What one table pass did: dirty pages per row, record bytes written,
    seconds detecting and staging, host waits on the device, and where the
    commit record it wrote lies (`commit_lsn`, 0 when the host commits)."""

    __slots__ = ("counts", "log_bytes", "detect_s", "stage_s", "device_reads", "commit_lsn")

    def __init__(self, counts, log_bytes, detect_s, stage_s, device_reads, commit_lsn: int = 0):
        self.commit_lsn = commit_lsn  # the LSN of the commit record the pass wrote (0: none)
        self.counts = counts
        self.log_bytes = log_bytes
        self.detect_s = detect_s
        self.stage_s = stage_s
        self.device_reads = device_reads


@dataclasses.dataclass
class Launched:
    """A table pass's epoch between `launch` and `complete`: its extent (None
    when it wrote no page), epoch, and the times detection was queued from
    (t0) to (t1) and staging from t1 to t2.  deferred: `complete` may come
    after the producers wrote on (the records cannot outgrow the extent).
    The device pass keeps its device reads so far (`reads0`) and, for a
    deferred epoch, the event recorded after its last launch; the host pass
    its plan (`counts`, `recs`, `used`) and, for an epoch staged region by
    region and finished at launch, the result (`done`).  committed: the pass
    wrote the epoch's commit record itself, right after its records
    (`write_commit`); the appender adopts it (`Appender.adopt_commit`)."""

    ext: object
    epoch: int
    t0: float
    t1: float
    t2: float
    deferred: bool
    committed: bool = False
    reads0: int = 0
    event: object = None
    counts: object = None
    recs: object = None
    used: int = 0
    done: object = None


def abandon(app, ext) -> None:
    """Close `ext` with nothing in it (padding) after a failure; quietly."""
    if ext is None:
        return
    try:
        app.finish_extent(ext, 0, 0)
    except Exception:
        pass


def counts_of(entries: np.ndarray, ids: np.ndarray, total_pages: int) -> np.ndarray:
    """Dirty pages per row, from the epoch's sorted dirty pages (page space indices)."""
    bounds = np.append(entries["first_page"].astype(np.int64), total_pages)
    return np.diff(np.searchsorted(ids, bounds)).astype(np.int64)
