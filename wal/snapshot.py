"""Base snapshots and the snapshot catalog.

A base snapshot is a full image of one region at one committed epoch, written
as page batches carrying the BASE flag (FORMAT.md "Snapshots and compaction").
It becomes part of the log only when a catalog record lists it and the
superblock's `catalog_lsn` points at that catalog: the superblock switch is the
commit point, so a crash while a base is written leaves the previous catalog in
force and the half-written base unused.

The catalog's entry type and codec (`BaseEntry`, `Catalog`,
`encode_catalog_body` / `decode_catalog_body`) live in `catalog.py`; this
module writes and reads them in a log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from concordia.wal.catalog import (  # noqa: F401  (the catalog's names, for the writers' callers)
    CATALOG_ENTRY,
    CATALOG_ENTRY_SIZE,
    CATALOG_HEAD,
    CATALOG_HEAD_SIZE,
    EMPTY_CATALOG,
    ENTRY_IMAGE,
    MAX_CATALOG_ENTRIES,
    BaseEntry,
    Catalog,
    decode_catalog_body,
    encode_catalog_body,
)
from concordia.wal.errors import CorruptionError, RegionError, WalError

#: pages written per BASE record unless the caller says otherwise
DEFAULT_CHUNK_BYTES = 8 << 20

# --------------------------------------------------------------------------- log side


def _region(log, region):
    regions = log.regions
    if isinstance(region, str):
        if region not in regions:
            raise RegionError(f"no region named {region!r}", hint="regions: " + ", ".join(sorted(regions)))
        return regions[region]
    for r in regions.values():
        if r.id == region:
            return r
    raise RegionError(f"no region with id {region}")


def _page_source(info, data) -> Callable[[int, int], np.ndarray]:
    """A function (lo, hi) -> (hi-lo, page_bytes) uint8 pages of the region image
    `data` (array of the region's dtype/shape, any buffer of nbytes bytes, or
    already such a function)."""
    if callable(data):
        return data
    pb = info.page_bytes
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data), dtype=np.uint8)
    if arr.nbytes != info.nbytes:
        raise WalError(f"image of region {info.name!r} has {arr.nbytes} bytes, the region {info.nbytes}")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    full = info.nbytes // pb

    def pages(lo: int, hi: int) -> np.ndarray:
        if hi <= full:
            return flat[lo * pb:hi * pb].reshape(hi - lo, pb)
        out = np.zeros((hi - lo, pb), np.uint8)
        out.reshape(-1)[: info.nbytes - lo * pb] = flat[lo * pb:]
        return out

    return pages


def _append_base_batch(log, epoch: int, info, lo: int, hi: int, source, stage=None) -> tuple[int, np.ndarray]:
    """Append one BASE page batch of pages [lo, hi) of region `info` at a
    committed epoch (the appender's append_page_batch refuses committed
    epochs: base records are outside epoch accounting, FORMAT.md V-N1) and
    persist it; returns its LSN and its page CRCs (the record's CRC table).
    `stage(res, info, epoch, lo, hi)`, when given, may write the whole record
    into the reservation itself (e.g. a device reading the image) and return
    True, or return False: the pages are then read from `source` and copied
    in here, each hashed as it is copied."""
    from concordia.wal import format as F

    count, pb = hi - lo, info.page_bytes
    app = log.appender
    _settled(app, "a base snapshot batch")
    with app.record(F.page_batch_length(count, pb)) as res:  # released if the record fails
        if stage is None or not stage(res, info, epoch, lo, hi):
            pages = np.ascontiguousarray(source(lo, hi), dtype=np.uint8).reshape(count, pb)
            F.encode_page_batch_into(res.view, lsn=res.lsn, epoch=epoch, region_id=info.id, salt=res.salt,
                                     page_ids=np.arange(lo, hi, dtype=np.uint32), pages=pages, page_bytes=pb,
                                     flags=F.FLAG_BASE)
        at = F.page_batch_crcs_offset(count)
        crcs = res.view[at:at + 4 * count].view("<u4").copy()
    return res.lsn, crcs


def base_batch_pages(page_bytes: int, chunk_bytes: int, capacity: int) -> int:
    """Pages per BASE page batch: `chunk_bytes` of them (at least one page),
    halved until the record fits a segment of `capacity` usable bytes."""
    from concordia.wal.format import page_batch_length

    per = max(1, min(chunk_bytes // page_bytes, 1 << 20))
    while per > 1 and page_batch_length(per, page_bytes) > capacity:
        per //= 2
    return per


def base_record_lengths(info, chunk_bytes: int, capacity: int) -> list:
    """Lengths of the BASE page batches `write_base_slices` appends for region
    `info`, in order (what a compaction must find room for)."""
    from concordia.wal.format import page_batch_length

    per = base_batch_pages(info.page_bytes, chunk_bytes, capacity)
    full, rest = divmod(int(info.pages), per)
    pb = info.page_bytes
    return [page_batch_length(per, pb)] * full + ([page_batch_length(rest, pb)] if rest else [])


def write_base_slices(log, info, source, epoch: int, *, chunk_bytes=DEFAULT_CHUNK_BYTES, stage=None):
    """A generator appending the BASE page batches of a full image of region
    `info` at `epoch`, one chunk (at most `chunk_bytes`, at least one page, and
    never more than a segment holds) per step: each `next()` writes and
    persists one record and yields its payload bytes; the generator returns
    (StopIteration.value) the catalog entry that would list them.  Nothing is
    listed: the caller writes the catalog.  A caller may stop between steps
    (the records written stay unlisted and ignored).  chunk_bytes: a number,
    or a callable asked before each record (a caller that writes more at a
    step takes fewer, larger records: each costs the same fixed work).
    stage: see `_append_base_batch` (a writer of the same records)."""
    from concordia.wal.format import region_digest

    pb = info.page_bytes
    cap = log.appender.segment_capacity
    size = chunk_bytes if callable(chunk_bytes) else (lambda: chunk_bytes)
    crcs = np.zeros(info.pages, dtype=np.uint32)
    first = last = None
    records = 0
    lo = 0
    while lo < info.pages:
        hi = min(info.pages, lo + base_batch_pages(pb, int(size()), cap))
        lsn, crcs[lo:hi] = _append_base_batch(log, epoch, info, lo, hi, source, stage)
        first = lsn if first is None else first
        last = lsn
        records += 1
        yield (hi - lo) * pb
        lo = hi
    if first is None:
        raise WalError(f"region {info.name!r} has no pages to snapshot")
    return BaseEntry(info.id, int(epoch), int(first), int(last), records, info.pages, region_digest(crcs))


def write_base_records(log, info, source, epoch: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       progress: Callable[[int], None] | None = None) -> BaseEntry:
    """Append the BASE page batches of a full image of region `info` at `epoch`,
    chunk by chunk (memory: one chunk), and return the catalog entry that would
    list them.  Nothing is listed yet: the caller writes the catalog."""
    steps = write_base_slices(log, info, source, epoch, chunk_bytes=chunk_bytes)
    while True:
        try:
            n = next(steps)
        except StopIteration as stop:
            return stop.value
        if progress:
            progress(n)


def record_at(log, lsn: int):
    """(segment index, absolute offset, RecordHeader) of the valid record at `lsn`
    of `log` (a Log or its Volume); raises CorruptionError naming the place when
    there is none."""
    from concordia.wal import format as F

    vol = getattr(log, "volume", log)
    for seg in vol.live_segments():
        if seg.base_lsn <= lsn < seg.end_lsn:
            off = seg.offset + (lsn - seg.base_lsn)
            where = f"segment {seg.index} @ {off:#x}"
            h = F.decode_record_header(vol.backend.view, off, where=where)
            if h.lsn != lsn or h.salt != seg.salt:
                raise CorruptionError(f"no record of lsn {lsn} here (found lsn {h.lsn})", where=where)
            return seg.index, off, h
    raise CorruptionError(f"lsn {lsn} lies in no live segment")


def image_entries(log, pages: dict, epoch: int, first_lsn: int, commit_lsn: int, digests: dict) -> dict:
    """{region id: image entry} (FORMAT.md §12.2, ENTRY_IMAGE) at committed
    `epoch` of the regions of `pages` ({region id: its pages}) that the epoch
    wrote whole, from one walk of the record headers in [`first_lsn`, its
    commit at `commit_lsn`) (no payload read).  `first_lsn` is a lower bound
    of the epoch's records (where the writer stood when the epoch began);
    `digests`: the commit's digests.  A region whose batches there do not
    hold each of its pages once, or whose digest the commit does not state,
    has none.  Damage on the way raises (CorruptionError).

    A bounded walk of headers, not the reader's (`reader.Scanner`, which reads
    on to the end of the log and through the current segment's old bytes): a
    writer's own committed range, between a record boundary and its commit.
    It stops at a zero length word or a header of another place (FORMAT.md
    §5.5), so it can only miss records, and a miss leaves the pages short and
    no entry; what it counts has a valid header at its LSN.  Every read of
    the entry checks it again as a base (V-K3, `planner._Index.base_usable`)."""
    from concordia.wal import format as F

    vol = getattr(log, "volume", log)
    view = vol.backend.view
    seen: dict = {}   # region id -> [records, pages, last lsn]
    for seg in vol.live_segments():
        if seg.end_lsn <= first_lsn or seg.base_lsn >= commit_lsn:
            continue
        lsn = max(int(first_lsn), seg.base_lsn + F.SEGMENT_HEADER_SIZE)
        while lsn < min(commit_lsn, seg.end_lsn - F.RECORD_HEADER_SIZE + 1):
            off = seg.offset + (lsn - seg.base_lsn)
            if not int.from_bytes(view[off:off + 8], "little"):
                break  # a zero length word: the end of this segment's records (a roll over)
            h = F.decode_record_header(view, off, where=f"segment {seg.index} @ {off:#x}")  # damage raises
            if h.lsn != lsn or h.salt != seg.salt:
                break  # stale bytes past the end (FORMAT.md §5.5)
            if (h.type == F.REC_PAGE_BATCH and h.region_id in pages and h.epoch == epoch
                    and not h.flags & F.FLAG_BASE):
                got = seen.setdefault(h.region_id, [0, 0, 0])
                got[0] += 1
                got[1] += int(h.count)
                got[2] = lsn
            lsn += int(h.length)
    return {rid: BaseEntry(rid, int(epoch), int(first_lsn), last, n, int(pages[rid]),
                           int(digests[rid]) & 0xFFFFFFFF, ENTRY_IMAGE)
            for rid, (n, k, last) in seen.items() if k == int(pages[rid]) and rid in digests}


def image_entry(log, region_id: int, pages: int, epoch: int, first_lsn: int, commit_lsn: int,
                digest: int) -> BaseEntry | None:
    """The image entry of one region (`image_entries`), or None."""
    return image_entries(log, {region_id: pages}, epoch, first_lsn, commit_lsn, {region_id: digest}).get(region_id)


def current_catalog(log) -> Catalog:
    """The catalog the superblock of `log` (a Log or its Volume) points at
    (EMPTY_CATALOG when none)."""
    from concordia.wal import format as F
    from crc32c import crc32c as _crc

    vol = getattr(log, "volume", log)
    lsn = int(vol.superblock.catalog_lsn)
    if not lsn:
        return EMPTY_CATALOG
    seg, off, h = record_at(vol, lsn)
    where = f"segment {seg} @ {off:#x}"
    if h.type != F.REC_CATALOG:  # the whole type byte (R-T1): 0x84 is an ignorable record, not a catalog
        raise CorruptionError(f"superblock names lsn {lsn} as the catalog, but it holds record type "
                              f"0x{h.type:02x}", where=where)
    body = F.record_body(vol.backend.view, off, h.count)
    if _crc(body) != h.body_crc:
        raise CorruptionError("catalog body CRC mismatch", where=where)
    try:
        return decode_catalog_body(body, lsn=lsn)
    except CorruptionError as exc:
        raise CorruptionError(exc.message, where=where) from None


def _settled(app, what: str) -> None:
    """FORMAT.md §10.6: BASE batches and catalog records are appended only with
    no reservation outstanding, so that a reader following the log may take
    one, as it takes a commit, for proof that every byte before it is final."""
    if app.outstanding:
        from concordia.wal.errors import UsageError

        raise UsageError(f"{what} is appended with {len(app.outstanding)} reservations not yet persisted",
                         hint="persist them (or commit) first")


def append_catalog(log, cat: Catalog, prev_lsn: int) -> int:
    """Append catalog `cat` (not yet current) and persist it; returns its LSN."""
    from concordia.wal import format as F

    _settled(log.appender, "a snapshot catalog")
    return log.appender.append_record(type=F.REC_CATALOG, epoch=cat.newest_epoch,
                                      body=encode_catalog_body(cat), aux=prev_lsn)


def write_catalog(log, cat: Catalog) -> Catalog:
    """Append catalog `cat` with the next sequence number and make it current
    (one superblock write: the commit point)."""
    prev = current_catalog(log)
    cat = Catalog(prev.sequence + 1, tuple(cat.entries), cat.keep_bases, cat.floor_epoch)
    lsn = append_catalog(log, cat, prev.lsn)
    log.volume.write_superblock(catalog_lsn=lsn)
    return Catalog(cat.sequence, cat.entries, cat.keep_bases, cat.floor_epoch, lsn)


def create_base_snapshot(log, region, data_or_source, epoch: int | None = None, *,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                         progress: Callable[[int], None] | None = None) -> BaseEntry:
    """Write a base snapshot of `region` (name or id) holding `data_or_source`
    (an array of the region's dtype and shape, a buffer of its bytes, or a
    function (lo, hi) -> pages) as the region's state at committed `epoch`
    (default: the last committed), then list it in a new catalog.

    When the commit of `epoch` states a digest for the region, the image must
    match it: a base that disagrees with its epoch is refused before the
    catalog switch, so it never becomes visible.

    A snapshot frees nothing: `concordia-wal snapshot create` first refuses
    one that would leave the log less free space than the retention reserve
    (`compaction.check_snapshot_room`); a caller that compacts right after (which frees
    what the base replaces) may go below it in between."""
    info = _region(log, region)
    last = log.last_committed_epoch
    epoch = last if epoch is None else int(epoch)
    if not epoch or epoch > (last or 0):
        raise WalError(f"epoch {epoch} is not committed", hint=f"last committed epoch is {last}")
    entry = write_base_records(log, info, _page_source(info, data_or_source), epoch,
                               chunk_bytes=chunk_bytes, progress=progress)
    want = _commit_digest(log, info.id, epoch)
    if want is not None and want != entry.digest:
        raise WalError(f"image of region {info.name!r} does not match epoch {epoch}: digest "
                       f"0x{entry.digest:08x}, commit states 0x{want:08x}",
                       hint="snapshot the region as it was at that epoch")
    prev = current_catalog(log)
    keep = [e for e in prev.entries if not (e.region_id == info.id and e.epoch == epoch)]
    write_catalog(log, Catalog(0, tuple(keep) + (entry,), prev.keep_bases, prev.floor_epoch))
    return entry


def _commit_digest(log, region_id: int, epoch: int):
    from concordia.wal.planner import scan

    h = scan(log, payload=False)
    c = h.commits.get(epoch)
    if c is None:
        return None
    if region_id in c.digests:
        return c.digests[region_id]
    return None


@dataclass(frozen=True)
class SnapshotInfo:
    region: str
    region_id: int
    epoch: int
    records: int
    pages: int
    bytes: int
    first_lsn: int
    last_lsn: int
    digest: int
    image: bool = False  # the epoch's own page batches, not BASE ones (FORMAT.md §12.2)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def list_snapshots(log) -> list:
    """The base snapshots the current catalog lists, oldest first per region."""
    cat = current_catalog(log)
    names = {r.id: r for r in log.regions.values()}
    out = []
    for e in sorted(cat.entries, key=lambda e: (e.region_id, e.epoch)):
        r = names.get(e.region_id)
        out.append(SnapshotInfo(r.name if r else f"#{e.region_id}", e.region_id, e.epoch, e.records,
                                e.pages, e.pages * (r.page_bytes if r else 0), e.first_lsn, e.last_lsn,
                                e.digest, e.image))
    return out


__all__ = [
    "Catalog", "EMPTY_CATALOG", "encode_catalog_body", "decode_catalog_body", "current_catalog",
    "write_catalog", "write_base_records", "write_base_slices", "create_base_snapshot", "list_snapshots", "SnapshotInfo",
    "base_batch_pages", "base_record_lengths", "image_entry", "image_entries",
]
