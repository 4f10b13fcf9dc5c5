"""The reader: walks a volume's live segments in LSN order, checks every
checksum, tells a clean end from a torn tail from corruption (FORMAT.md §5.5),
and applies the caller's recovery mode (FORMAT.md §11).

The scan treats the volume as untrusted input: every header is CRC-checked
before its length is believed, every length is checked against the segment
before it is used, and when a header is bad the scan resumes at the next
64-byte offset that holds a valid header for this segment (its LSN and salt
must match), so one damaged record never hides the records after it.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
from crc32c import crc32c as _crc32c

from . import format as F
from . import pagecrc
from .modes import RecoveryMode
from .errors import CorruptionError, TornTailError, UsageError
from .volume import SegmentInfo, Volume

# Page checks (V-P5) hash payloads on several threads (crc32c lets go of the
# GIL) once a segment's, or a check_pages_of call's, payloads add up to this
# many bytes: one thread hashes about 3-5 GB/s.  (Folding the page CRC tables on
# threads did not help on the H200: numpy's table gathers did not run side by
# side; docs/results/recovery.md.)
PARALLEL_CHECK_BYTES = 16 << 20
CHECK_THREADS = max(1, min(12, os.cpu_count() or 1))
# the search for valid records after a gap (Scanner._next_valid) reads this many
# bytes a slice and confirms at most this many candidates by their header CRC
NEXT_VALID_CHUNK = 32 << 20
NEXT_VALID_CONFIRMS = 4096


_CHECK_POOL: list = []  # one ThreadPoolExecutor of CHECK_THREADS, made on first use, kept


def thread_map(fn: Callable, items) -> list:
    """[fn(x) for x in items], on CHECK_THREADS threads when there are several
    (numpy and crc32c let go of the GIL for large buffers), in order.  The
    threads are kept between calls (a walk calls this once a segment); a call
    made from one of them runs in the calling thread."""
    items = list(items)
    if CHECK_THREADS < 2 or len(items) < 2 or threading.current_thread().name.startswith("concordia-check"):
        return [fn(x) for x in items]
    if not _CHECK_POOL:
        _CHECK_POOL.append(ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="concordia-check"))
    return list(_CHECK_POOL[0].map(fn, items))


@dataclass(frozen=True)
class Dropped:
    """A byte range the reader gave up, and why.

    kind: "torn" (tail damage), "corrupt" (damage before a valid commit),
    "uncommitted" (valid records of an epoch without a commit), "stopped"
    (valid bytes after a POINT_IN_TIME stop), "superblock" (one bad slot),
    "segment" (a live segment whose header is invalid), "truncated" (the
    media end before the volume the superblock declares)."""

    segment: int
    offset: int  # absolute offset in the backend mapping
    length: int
    reason: str
    kind: str
    lsn: int | None = None

    @property
    def where(self) -> str:
        # R-O1: the offset is absolute in the target
        return f"segment {self.segment} @ 0x{self.offset:x}" if self.segment >= 0 else f"@ 0x{self.offset:x}"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason} ({self.kind}, {self.length} bytes)"

    def to_json(self) -> dict:
        return {"where": self.where, "segment": self.segment, "offset": self.offset,
                "length": self.length, "reason": self.reason, "kind": self.kind, "lsn": self.lsn}


class Record:
    """One valid record: header fields, where it lies, and its body (a view)."""

    __slots__ = ("type", "flags", "region_id", "lsn", "epoch", "length", "segment", "offset",
                 "count", "page_bytes", "aux", "body_crc", "_backend")

    def __init__(self, hdr: F.RecordHeader, segment: int, offset: int, backend):
        # one unpacking, in RecordHeader's field order (a recovery makes a Record for every
        # record it keeps); the salt and the header CRC are the walk's concern, not kept
        (self.length, self.type, self.flags, self.region_id, self.lsn, self.epoch, _salt, self.body_crc,
         self.count, self.page_bytes, self.aux, _header_crc) = hdr
        self.segment = segment
        self.offset = offset
        self._backend = backend

    @property
    def kind(self) -> int | None:
        return record_kind(self.type)  # R-T1: the whole type byte

    @property
    def raw(self) -> memoryview:
        """The whole record's bytes (a view into the backend)."""
        return self._backend.view[self.offset:self.offset + self.length]

    @property
    def body(self) -> memoryview:
        """Page batch: everything after the header; other types: the `count` body bytes."""
        start = self.offset + F.RECORD_HEADER_SIZE
        if self.kind == F.REC_PAGE_BATCH:
            return self._backend.view[start:self.offset + self.length]
        return self._backend.view[start:start + self.count]

    def page_batch(self) -> F.PageBatch:
        """Decoded page batch (views; checksums were checked by the reader)."""
        return F.decode_page_batch(self._backend.array, self.offset, check_pages=False)

    @property
    def where(self) -> str:
        return f"segment {self.segment} @ 0x{self.offset:x}"

    def __repr__(self) -> str:
        name = F.TYPE_NAMES.get(self.kind, f"0x{self.type:02x}")
        return (f"<Record {name} lsn=0x{self.lsn:x} epoch={self.epoch} region={self.region_id} "
                f"len={self.length} {self.where}>")


# items produced by the scan: tuples with names (positions kept for old readers)
_REC = 0
_DMG = 1


#: a walk's record header is the format's (FORMAT.md §5.1, reserved words passed over)
Header = F.RecordHeader


class Found(NamedTuple):
    """A valid record the walk met: (REC, segment, absolute offset, Header)."""

    tag: int
    seg: SegmentInfo
    offset: int
    header: Header

    @property
    def length(self) -> int:
        return self.header.length


class Damaged(NamedTuple):
    """A damaged range: (DMG, segment, absolute offset, length, reason,
    hides_commit).  hides_commit: a damaged segment header over records of
    which a valid commit is one (the damage then hides committed data)."""

    tag: int
    seg: SegmentInfo
    offset: int
    length: int
    reason: str
    hides_commit: bool = False


def record_kind(type_byte: int) -> int | None:
    """R-T1 (FORMAT.md §5.2): the record type is the whole byte.  The known
    types (0x01..0x05, and pad 0xFE) give their kind (`format.REC_*`); any
    other byte gives None: ignorable when bit 7 is set (checked as a generic
    body and skipped), a damaged record when it is clear."""
    if type_byte == F.REC_PAD | F.TYPE_IGNORABLE:
        return F.REC_PAD
    if not type_byte & F.TYPE_IGNORABLE and type_byte in F.TYPE_NAMES and type_byte != F.REC_PAD:
        return type_byte
    return None


#: record_kind of every type byte, for loops over a whole walk (a lookup, not a call)
_KIND_OF = tuple(record_kind(t) for t in range(256))

#: R-F1: the flag bits each known type may carry; any other bit is a damaged record
_KNOWN_FLAGS = {F.REC_PAGE_BATCH: F.FLAG_BASE, F.REC_COMMIT: F.FLAG_ONE_SYNC}


def is_commit(it) -> bool:
    return it[0] == _REC and it.header.type == F.REC_COMMIT


def settles(it) -> bool:
    """Whether a valid record proves every reservation made before it finished
    (FORMAT.md §10.6): a commit (§10.4), a BASE page batch or a catalog record
    (appended only with no reservation outstanding)."""
    if it[0] != _REC:
        return False
    h = it.header
    return (h.type in (F.REC_COMMIT, F.REC_CATALOG)
            or (h.type == F.REC_PAGE_BATCH and bool(h.flags & F.FLAG_BASE)))

#: a scan's progress callback is told at most this often (bytes walked)
PROGRESS_STEP = 4 << 20
#: segments are walked in groups of about this many bytes, each group's checks
#: made together (`Scanner._segments`): 16 segments of 64 MiB, whose page tables
#: (8 bytes a page) gathered for the check are at most 32 MiB at 256-byte pages
WALK_GROUP_BYTES = 1 << 30


@dataclass
class ScanResult:
    """What recovery found; `Log` keeps it."""

    records: list = field(default_factory=list)  # accepted Records, LSN order
    commits: list = field(default_factory=list)  # CommitInfo of committed epochs
    regions: dict = field(default_factory=dict)  # id -> RegionInfo
    dropped: list = field(default_factory=list)  # Dropped
    incomplete_epochs: list = field(default_factory=list)  # SKIP_CORRUPT: epochs missing records
    last_committed_epoch: int = 0
    last_commit_lsn: int = 0
    cut: tuple | None = None  # (SegmentInfo, absolute end offset) after the last commit
    tail_regions: list = field(default_factory=list)  # region descriptor Records after the cut
    bytes_checked: int = 0
    segments: list = field(default_factory=list)
    bad_segments: set = field(default_factory=set)
    # the raw walk (Scanner.items) and whether it checked page CRCs: a read-only
    # Log hands it to the planner, which would otherwise walk the log again
    walk: list | None = None
    walk_checked_pages: bool | str = False
    # a writable Log keeps the walk up to its cut (Log._keep_walk_before_cut):
    # the planner walks on from walk_end_lsn, unless compaction moved
    # oldest_lsn (walk_oldest_lsn) in between
    walk_end_lsn: int | None = None
    walk_oldest_lsn: int = 0
    # R-D2: LSN of the later commit point (last valid commit, or the catalog the
    # superblock names); damage before it is corruption, after it a torn tail.
    # commit_point_end: the LSN just past it (what a live read-only open answers up to)
    commit_point_lsn: int = -1
    commit_point_end: int = -1
    # the LSN just past the last commit record of the walk, whether it commits or
    # not (torn, §10.4b, R-D1): what decides the last commits lies before it
    last_commit_record_end: int = -1
    # a live read-only open (Log._snapshot_at_cut): the torn tail it found past
    # walk_end_lsn, which the plans made from its walk report as the open saw it
    tail_dropped: list = field(default_factory=list)


class Scanner:
    """Record-level scan of one volume (no mode logic): yields records and damaged ranges."""

    def __init__(self, vol: Volume, *, check_pages: bool | Callable = True,
                 progress: Callable[[int, int], None] | None = None):
        """check_pages: True checks every page batch's pages, False none, a
        callable(header) those batches it is true for (the others are
        returned unchecked: a consumer that reads their pages checks them).
        progress(done_bytes, total_bytes), if given, is called as the walk
        advances, at most every PROGRESS_STEP bytes and once at the end; total
        is the bytes of the live segments (a segment's zero tail counts as
        walked when the walk reaches its end)."""
        self.vol = vol
        self.backend = vol.backend
        self.arr = vol.backend.array
        self.mv = vol.backend.view
        self.check_pages = check_pages
        self.oldest = vol.superblock.oldest_lsn
        self.bytes_checked = 0
        self.progress = progress
        self._done = 0  # bytes of the segments walked so far (for progress)
        self._shown = 0  # what progress was last told
        self._total = 0

    def items(self, result: ScanResult | None = None, *, from_lsn: int = 0, start_lsn: int = 0,
              until_lsn: int | None = None):
        """Every valid record and damaged range of the live segments, in LSN
        order: (0, seg, offset, raw header tuple) for a record, (1, seg,
        offset, length, reason[, hides_commit]) for damage (a live segment
        whose header is invalid is one damaged range).

        from_lsn: segments that end at or below it are not read at all (what
        keeps tailing a long log cheap); of the rest, items that end at or
        below it are left out.  Each segment is walked from its start, so
        the bytes before from_lsn in its segment are still read and checked.
        start_lsn: a record boundary an earlier walk reached (its items before
        it held): the segment holding it is walked from there, not its start.
        until_lsn: a consumer that stops at the first item at or past it (a
        read-only open beside a live writer): no segment after the one holding
        it is walked (segments are walked and checked in groups, `_segments`).
        `result`, when given, collects the segments walked."""
        result = ScanResult() if result is None else result
        segs = self.vol.live_segments()
        size = self.backend.size
        self._total = sum(max(0, min(s.offset + s.nbytes, size) - s.offset)
                          for s in segs if s.end_lsn > from_lsn)
        prev = None
        group: list = []   # (seg, start): walked one after another, their checks made together
        group_bytes = 0
        for seg in segs:
            why = self.vol.check_segment_header(seg, prev)
            prev = seg
            if seg.end_lsn <= from_lsn:
                continue
            result.segments.append(seg)
            if why:
                yield from self._checked(group, from_lsn)
                group, group_bytes = [], 0
                result.bad_segments.add(seg.index)
                end = min(seg.offset + seg.nbytes, size)
                # records inside may still check (the table names salt and base LSN):
                # a valid commit among them means this damage hides committed data
                hides_commit = any(is_commit(it) for it in self._segment(seg))
                yield from _after(seg, [Damaged(_DMG, seg, seg.offset, max(0, end - seg.offset), why, hides_commit)],
                                  from_lsn)
                if until_lsn is not None and seg.end_lsn > until_lsn:
                    return
                continue
            group.append((seg, seg.offset + (start_lsn - seg.base_lsn) if seg.base_lsn < start_lsn < seg.end_lsn
                          else None))
            group_bytes += seg.nbytes
            if until_lsn is not None and seg.end_lsn > until_lsn:
                break
            if group_bytes >= WALK_GROUP_BYTES:
                yield from self._checked(group, from_lsn)
                group, group_bytes = [], 0
        yield from self._checked(group, from_lsn)
        if self.progress is not None:
            self.progress(self._total, self._total)

    def _tell(self, done: int) -> None:
        """Progress: `done` bytes walked (called from the walk's loop)."""
        if done - self._shown >= PROGRESS_STEP:
            self._shown = done
            self.progress(done, self._total)

    def _next_valid(self, seg: SegmentInfo, start: int, end: int) -> int | None:
        """Absolute offset of the first valid record header at or after `start`
        (64-byte steps) in `seg`, or None.  Vectorised: the segment's salt,
        then the LSN the slot must carry, filter the candidates, the header
        CRC confirms them (at most NEXT_VALID_CONFIRMS of them).  The range is
        read in NEXT_VALID_CHUNK slices, CHECK_THREADS at a time (numpy lets
        go of the GIL), and the search ends at the first slice holding one: a
        segment's tail of old bytes costs one read at memory speed spread over
        the cores, not several passes on one."""
        n = (end - start) // 64
        if n <= 0:
            return None
        first = seg.lsn(start)
        salt = np.uint32(seg.salt)   # never 0 (volume._random_salt): a zero tail matches nothing
        per = NEXT_VALID_CHUNK // 64
        arr = self.arr

        def candidates(lo: int) -> np.ndarray:
            hi = min(n, lo + per)
            w32 = arr[start + lo * 64:start + hi * 64].view("<u4").reshape(hi - lo, 16)
            c = np.flatnonzero(w32[:, F.OFF_SALT // 4] == salt)
            if c.size:
                lsns = w32[c, F.OFF_LSN // 4].astype(np.uint64) | (w32[c, F.OFF_LSN // 4 + 1].astype(np.uint64) << 32)
                c = c[lsns == (c + lo).astype(np.uint64) * np.uint64(64) + np.uint64(first)] + lo
            return c

        starts = list(range(0, n, per))
        tried = 0
        for k in range(0, len(starts), CHECK_THREADS):
            for cand in thread_map(candidates, starts[k:k + CHECK_THREADS]):
                for c in cand[:NEXT_VALID_CONFIRMS - tried]:
                    pos = start + int(c) * 64
                    if F.check_record_header_bytes(self.mv, pos) is None:
                        length = int(arr[pos:pos + 8].view("<u8")[0])
                        if pos + length <= seg.offset + seg.nbytes:
                            return pos
                tried += min(cand.size, NEXT_VALID_CONFIRMS - tried)
                if tried >= NEXT_VALID_CONFIRMS:
                    return None
        return None

    def _segment(self, seg: SegmentInfo, start: int | None = None, *, to_gap: bool = False) -> list:
        """The items of one segment whose header checked (from absolute offset
        `start`, a record boundary found by an earlier walk, when given).
        to_gap: stop at the first place no valid record starts, without
        looking past it for valid records (a segment its writer is still
        filling ends there for now; what lies beyond is the tail's old bytes,
        which a full walk reads through to tell the end from a lost record)."""
        return self._segments([(seg, start)], to_gap=to_gap)[0]

    def _segments(self, jobs: list, *, to_gap: bool = False) -> list:
        """`_segment` of each (seg, start) of `jobs`, walked one after another
        into one list, their page tables and pages then checked together: a
        few numpy and helper calls for the group, not a few a segment.  Each
        such call lets go of the GIL, and beside a thread that runs Python (a
        model's build beside a read ahead, `concordia.prefetch`) each costs up
        to a switch interval (5 ms) to get it back: an open of 450 segments
        took 8 s so, 0.8 s alone.  Every record's checks are its own, so the
        items are those of a walk a segment at a time."""
        out, batches, ends = [], [], []
        for seg, start in jobs:
            self._walk(seg, out, batches, start, to_gap)
            ends.append(len(out))
            self._done += max(0, min(seg.offset + seg.nbytes, self.backend.size) - seg.offset)
        bad = self._check_tables(out, batches)
        cp = self.check_pages
        pending = [b for b in batches if b[0] not in bad and cp and (cp is True or cp(b[2]))]
        self._check_pages(out, self._entries(pending))
        if self.progress is not None:
            self._tell(self._done)
        return [out[a:b] for a, b in zip([0, *ends], ends)]

    def _checked(self, group: list, from_lsn: int):
        """The items of `group`'s segments (`_segments`), in order, those that end
        at or below from_lsn left out."""
        if group:
            for (seg, _), found in zip(group, self._segments(group)):
                yield from _after(seg, found, from_lsn)

    def check_pages_of(self, items: list, indices) -> None:
        """V-P5 for the page batches among items[indices] of a walk made without
        page checks, as a walk with them would have made it: a failing record
        becomes a damaged range in `items`."""
        batches = [(i, items[i].offset, items[i].header) for i in indices
                   if items[i].tag == _REC and items[i].header.type == F.REC_PAGE_BATCH]
        self._check_pages(items, self._entries(batches))

    def _entries(self, batches: list) -> list:
        """What _check_pages needs of each page batch (index, offset, header):
        (index, offset, count, page bytes, one CRC32C over its whole payload).
        The payloads are hashed many to a call (`pagecrc.span_crcs`, the GIL
        released), in CHECK_THREADS slices of about equal bytes on as many
        threads where they add up to PARALLEL_CHECK_BYTES or more: a log of
        small records (a checkpoint every decode step writes one a region)
        costs no call, task or slice per record."""
        if not batches:
            return []
        n = len(batches)
        counts = np.fromiter((h.count for _, _, h in batches), np.int64, n)
        lengths = counts * np.fromiter((h.page_bytes for _, _, h in batches), np.int64, n)
        offsets = np.fromiter((pos for _, pos, _ in batches), np.int64, n) + F.page_batch_payload_offset(counts)
        crcs = np.empty(n, np.uint32)
        ends = np.cumsum(lengths)
        if ends[-1] >= PARALLEL_CHECK_BYTES and n > 1:
            cuts = np.searchsorted(ends, ends[-1] * np.arange(1, CHECK_THREADS) / CHECK_THREADS)
            bounds = sorted(set([0, *cuts.tolist(), n]))
            thread_map(lambda ab: pagecrc.span_crcs(self.arr, offsets[ab[0]:ab[1]], lengths[ab[0]:ab[1]],
                                                    out=crcs[ab[0]:ab[1]]), list(zip(bounds, bounds[1:])))
        else:
            pagecrc.span_crcs(self.arr, offsets, lengths, out=crcs)
        return [(idx, pos, h.count, h.page_bytes, c) for (idx, pos, h), c in zip(batches, crcs.tolist())]

    def _check_pages(self, out: list, pending: list) -> None:
        """V-P5 for every page batch of a group of segments: the per-page CRC table, folded,
        must equal one CRC32C over the payload (format.fold_page_crcs); a record
        that fails is checked page by page for the exact diagnostic."""
        groups: dict[tuple, list] = {}
        for p in pending:
            groups.setdefault((p[2], p[3]), []).append(p)
        arr = self.arr
        for (count, pb), items in groups.items():
            tables = _copied_rows(self.mv, [pos + F.RECORD_HEADER_SIZE + 4 * count for _, pos, _, _, _ in items],
                                  4 * count)
            folded = F.fold_page_crcs(tables.view("<u4"), pb)
            actual = np.fromiter((it[4] for it in items), dtype=np.uint32, count=len(items))
            for k in np.flatnonzero(folded != actual):
                idx, pos = items[k][0], items[k][1]
                item = out[idx]
                hdr = item.header
                problem = F.page_batch_problem(arr, hdr, pos, check_pages=True)
                reason = "page CRC table does not fold to the payload CRC" if problem is None else _reason(problem, pos)
                self.bytes_checked -= hdr.length
                out[idx] = Damaged(_DMG, item.seg, pos, hdr.length, reason)

    def _check_tables(self, out: list, batches: list) -> set:
        """V-P3 and V-P4 for the page batches (index, offset, header)
        a walk found (`_walk` checked their headers and shapes), every record of
        a page count at once (`format.page_batch_tables_bad`); a record that
        fails becomes the damaged range `page_batch_problem` names, as if the
        walk had found it.  Returns the indices into `out` that failed."""
        groups: dict[int, list] = {}
        for b in batches:
            groups.setdefault(b[2].count, []).append(b)
        arr, failed = self.arr, set()
        for count, items in groups.items():
            width = F.page_batch_tables_bytes(count)
            rows = _copied_rows(self.mv, [pos + F.RECORD_HEADER_SIZE for _, pos, _ in items], width)
            stored = np.fromiter((h.body_crc for _, _, h in items), dtype=np.uint32, count=len(items))
            for k in np.flatnonzero(F.page_batch_tables_bad(rows, count, stored)).tolist():
                idx, pos, h = items[k]
                self.bytes_checked -= h.length
                out[idx] = Damaged(_DMG, out[idx].seg, pos, h.length,
                                   _reason(F.page_batch_problem(arr, h, pos, check_pages=False), pos))
                failed.add(idx)
        return failed

    def _walk(self, seg: SegmentInfo, out: list, batches: list, start: int | None = None,
              to_gap: bool = False) -> None:
        """The items of `seg` into `out`, each page batch's (index, offset,
        header) also into `batches`: their tables and pages are checked a
        group of segments at a time (`_segments`)."""
        mv = self.mv
        seg_end = seg.offset + seg.nbytes
        end = min(seg_end, self.backend.size)  # a truncated volume reads as zero beyond its end
        base_rel = seg.base_lsn - seg.offset  # lsn = abs offset + base_rel
        salt = seg.salt
        unpack, header_of = F.RECORD_HEADER.unpack_from, F.record_header_of
        oldest = self.oldest
        pos = seg.offset + F.SEGMENT_HEADER_SIZE if start is None else start
        # progress: checked against one number per record, told every PROGRESS_STEP
        tick = seg.offset + PROGRESS_STEP if self.progress is not None else 1 << 62
        while pos + F.RECORD_HEADER_SIZE <= end:
            if pos >= tick:
                self._tell(self._done + pos - seg.offset)
                tick = pos + PROGRESS_STEP
            f = unpack(mv, pos)  # read once: placement first, then the header's own checks
            h = header_of(f)
            length = h.length
            if length == 0 or (h.lsn != pos + base_rel or h.salt != salt):
                if to_gap:
                    return
                if length and _crc32c(mv[pos:pos + 60]) != h.header_crc:
                    problem = (f"record header CRC mismatch, stored 0x{h.header_crc:08x}, "
                               f"computed 0x{_crc32c(mv[pos:pos + 60]):08x}")
                else:
                    # zero length word, or a complete header of another incarnation: the end,
                    # unless valid records follow (then a record was lost here)
                    nxt = self._next_valid(seg, pos + F.RECORD_HEADER_SIZE, end)
                    if nxt is None:
                        return
                    what = ("zero length word" if length == 0 else
                            f"stale record (lsn 0x{h.lsn:x}, salt 0x{h.salt:08x}; expected lsn 0x{pos + base_rel:x}, salt 0x{salt:08x})")
                    if pos + base_rel >= oldest:  # V-R7: below oldest_lsn nothing is read (R-D3)
                        out.append(Damaged(_DMG, seg, pos, nxt - pos,
                                           f"{what} followed by valid records at 0x{nxt:x} (a record was lost)"))
                    pos = nxt
                    continue
            else:
                problem = F.check_record_header_bytes(mv, pos, fields=f)
                if problem is None and pos + length > seg_end:
                    problem = f"record length {length} runs past the end of the segment"
            if problem is not None:
                if to_gap:
                    return
                nxt = self._next_valid(seg, pos + F.RECORD_HEADER_SIZE, end)
                stop = end if nxt is None else nxt
                if stop + base_rel > oldest:  # R-D3: damage wholly below oldest_lsn is reclaimed, not read
                    out.append(Damaged(_DMG, seg, pos, stop - pos, problem))
                if nxt is None:
                    return
                pos = nxt
                continue
            if pos + length > end:
                out.append(Damaged(_DMG, seg, pos, end - pos, "record runs past the end of the target (truncated volume)"))
                return
            lsn = h.lsn
            if lsn < oldest:
                pos += length  # reclaimed by compaction: not read
                continue
            problem = self._body_problem(h, pos)
            if problem is not None:
                out.append(Damaged(_DMG, seg, pos, length, problem))
            else:
                self.bytes_checked += length
                kind = record_kind(h.type)
                if kind is None:
                    pos += length  # R-T1, R-T2: an unknown ignorable type, checked, is skipped
                    continue
                if kind == F.REC_PAGE_BATCH:  # its tables and pages: the group's at once (_segments)
                    batches.append((len(out), pos, h))
                out.append(Found(_REC, seg, pos, h))
            pos += length

    def _body_problem(self, h, pos) -> str | None:
        typ = h.type
        kind = record_kind(typ)
        count = h.count
        if h.flags & ~_KNOWN_FLAGS.get(kind, 0) and kind != F.REC_PAD:
            return f"unknown record flags 0x{h.flags:02x} for type 0x{typ:02x} (R-F1)"
        if kind == F.REC_PAGE_BATCH:  # its tables: _check_tables, its pages: _check_pages
            p = F.page_batch_shape_problem(h, pos, len(self.arr))
            return None if p is None else _reason(p, pos)
        if kind == F.REC_PAD:
            return None
        if kind is None and not typ & F.TYPE_IGNORABLE:
            return f"unknown record type 0x{typ:02x} (not marked ignorable)"
        length = h.length
        if F.RECORD_HEADER_SIZE + count > length or F.align64(count) + F.RECORD_HEADER_SIZE != length:
            return f"body of {count} bytes does not match record length {length}"
        got = _crc32c(F.record_body(self.mv, pos, count))
        if got != h.body_crc:
            return f"body CRC mismatch, stored 0x{h.body_crc:08x}, computed 0x{got:08x}"
        if self.arr[pos + F.RECORD_HEADER_SIZE + count:pos + length].any():
            return "record padding is not zero"
        if kind == F.REC_COMMIT:
            # V-C1 is the commit body's own structure (V-R6): a commit failing it is a
            # damaged record, never a commit point (R-D2); V-C2..V-C4 depend on the
            # records before it and are recover's (_commit_verdicts)
            try:
                F.decode_commit_body(F.record_body(self.mv, pos, count), h)
            except CorruptionError as exc:
                return f"commit of epoch {h.epoch}: {exc.message}"
        return None


def _copied_rows(mv, offsets: list, width: int) -> np.ndarray:
    """The `width` bytes at each offset of `mv`, as the rows of a read-only
    uint8 array, copied in one call that keeps the GIL: numpy copies each row
    in a call of its own that lets go of it (rows of more than 500 bytes), and
    each costs up to a switch interval to get it back beside a thread that runs
    Python (`Scanner._segments`)."""
    return np.frombuffer(b"".join([mv[o:o + width] for o in offsets]), np.uint8).reshape(len(offsets), width)


def _after(seg: SegmentInfo, found: list, from_lsn: int):
    """The items of `found` (of segment `seg`) that end above from_lsn (all when 0)."""
    for it in found:
        if not from_lsn or seg.lsn(it.offset) + it.length > from_lsn:
            yield it


def _reason(problem: tuple, pos: int) -> str:
    """A (reason, offset) of format's record checks as a damaged range's words:
    the offset named when it is not the record's own."""
    return problem[0] if problem[1] == pos else f"{problem[0]} (at 0x{problem[1]:x})"


#: records of an open-time walk kept for the planner (beyond, it walks again):
#: about 470-600 bytes each, so some 40 MB; an 8 MiB-record log of 64 K records
#: holds 512 GiB of pages.  A log of small records (a checkpoint every decode
#: step writes one a region: 1,000 steps of 64 regions are 66 K records) keeps
#: more, up to one item per WALK_KEPT_LOG_BYTES of the volume's size (a 32nd of
#: it at 512 bytes an item) and WALK_KEPT_CEILING items in all (some 250 MB):
#: its second walk cost a recovery as much as the open's.  A writable open
#: holds the walk until the planner takes it or the log closes.
WALK_KEPT_MAX = 1 << 16
WALK_KEPT_LOG_BYTES = 16 << 10
WALK_KEPT_CEILING = 1 << 19


def walk_kept(count: int, vol: Volume) -> bool:
    """Whether an open's walk of `count` items of `vol` is kept for the planner."""
    return count <= max(WALK_KEPT_MAX, min(WALK_KEPT_CEILING, vol.backend.size // WALK_KEPT_LOG_BYTES))


def recover(vol: Volume, mode: RecoveryMode = RecoveryMode.TOLERATE_TAIL,
            reporter: Callable[[Dropped], None] | None = None, *, check_pages: bool = True,
            progress: Callable[[int, int], None] | None = None, items: list | None = None) -> ScanResult:
    """Scan `vol` and apply `mode` (FORMAT.md §11).  Every dropped range goes to
    `reporter` (and into result.dropped).  Raises CorruptionError / TornTailError
    where the mode says so.  progress(done_bytes, total_bytes): see Scanner.
    check_pages: True checks every page payload's CRC, False none (a reader
    that checks the pages it reads), "last" only those of the last commit's
    records when one sync wrote them with it: a crash inside that sync leaves
    some of them unwritten, and V-C4 then drops the commit as torn; every other
    page is checked where a recovery reads it.  items: a walk of `vol` already
    made (Scanner.items, with page checks as check_pages says), decided
    again without reading the log (the planner's History, `decide`)."""
    mode = RecoveryMode.parse(mode)
    res = ScanResult()

    def report(d: Dropped):
        res.dropped.append(d)
        if reporter is not None:
            reporter(d)

    unused = _unwritten_slot(vol)
    for where, why in vol.slot_problems:
        if unused is not None and where.startswith(f"superblock slot {unused} "):
            continue  # R-B2: a slot never written since formatting is unused, not damaged
        report(Dropped(-1, 0, 0, f"{where}: {why} (the other slot is used)", "superblock"))

    if check_pages not in (True, False, "last"):
        raise UsageError(f"check_pages must be True, False or 'last', not {check_pages!r}")
    scanner = Scanner(vol, check_pages=check_pages is True, progress=progress)
    if items is None:
        items = list(scanner.items(res))
    else:
        items = list(items)
        seen, seg = [], None
        for it in items:
            if it.seg is not seg:
                seg = it.seg
                seen.append(seg)
        res.segments = seen
        res.bad_segments = {it.seg.index for it in items if it.tag == _DMG and it.offset == it.seg.offset}
    if walk_kept(len(items), vol):
        res.walk, res.walk_checked_pages = items, check_pages
    items = _check_regions(items, vol.backend.view)  # R-P1, R-G1
    backend = vol.backend
    # where the commit records lie, found once: nothing below makes or unmakes a
    # commit (a page check turns only page batches into damaged ranges)
    commit_at = _records_of(items, F.REC_COMMIT)  # where is_commit holds

    def commit_before(i: int) -> int:
        """The index of the last commit record before items[i], or -1."""
        k = bisect.bisect_left(commit_at, i)
        return commit_at[k - 1] if k else -1

    # R-D2: the commit point is the last commit record that is a valid record (its
    # body decodes, V-C1: one that does not is a damaged range of the walk), or a
    # damaged segment header that hides one (the point is then just past it)
    last_commit = commit_at[-1] if commit_at else -1
    if commit_at:
        it = items[last_commit]
        res.last_commit_record_end = it.seg.lsn(it.offset) + it.length
    hidden = [i for i, it in enumerate(items) if it.tag == _DMG and it.hides_commit]
    if hidden:
        last_commit = max(last_commit, hidden[-1] + 1)

    # a last commit written by one sync with its records (FLAG_ONE_SYNC) is in flight
    # at a crash until that sync returns: its records' pages decide V-C4 (§10.4b)
    if (check_pages == "last" and 0 <= last_commit < len(items) and is_commit(items[last_commit])
            and items[last_commit].header.flags & F.FLAG_ONE_SYNC):
        scanner.check_pages_of(items, range(commit_before(last_commit) + 1, last_commit))
    oldest = vol.superblock.oldest_lsn
    verdicts, late = _commit_verdicts(items, backend.view, oldest)

    # R-D1: what the log commits ends with its last commit record only when that
    # record commits (V-C2..V-C4).  One that does not is dropped as the torn tail,
    # and the commit before it is the commit point, when nothing damaged lies
    # between the two (the commit itself is then the only thing wrong), or when it
    # was written by one sync with its records (§10.4b: damage between is what a
    # crash inside that sync leaves, and a ONE_SYNC commit that does satisfy V-C4
    # stands).  Damage before a two-phase commit is corruption: its records were
    # persisted before it was written.
    torn_commits: dict = {}  # index -> why it is torn
    while 0 <= last_commit < len(items) and is_commit(items[last_commit]):
        prev_commit = commit_before(last_commit)
        between = any(items[i].tag == _DMG for i in range(prev_commit + 1, last_commit))
        if not torn_commits and items[last_commit].header.flags & F.FLAG_ONE_SYNC and between:
            why = "written by one sync with its records, so the sync did not complete"
        elif verdicts[last_commit][1] is not None and not between:
            why = "no commit follows it, so it commits nothing (R-D1)"
        else:
            break
        torn_commits[last_commit] = why
        last_commit = prev_commit

    # R-D2: the catalog record the superblock names is a commit point too (V-N2):
    # its base snapshots were persisted before the superblock switched to it, so
    # damage at or before it is corruption, not a torn tail; a catalog_lsn that
    # names no valid catalog record is corruption
    cat_lsn = vol.superblock.catalog_lsn
    stop_lsn = None  # POINT_IN_TIME: where a lost catalog stops the reading
    if cat_lsn:
        at = _first_holding(items, cat_lsn)
        named = (at is not None and items[at].tag == _REC and items[at].header.type == F.REC_CATALOG
                 and items[at].header.lsn == cat_lsn)
        # a damaged range there is reported as corruption by itself (it lies at the commit point)
        if not named and (at is None or items[at].tag == _REC):
            seg = next((sg for sg in res.segments if sg.base_lsn <= cat_lsn < sg.end_lsn), None)
            off = seg.offset + cat_lsn - seg.base_lsn if seg else 0
            why = f"the snapshot catalog the superblock names (lsn 0x{cat_lsn:x}) is missing or damaged"
            if at is not None:
                h = items[at].header
                name = F.TYPE_NAMES.get(record_kind(h.type), f"0x{h.type:02x}")
                why += (f": a {name} record lies there" if h.lsn == cat_lsn
                        else f": it falls inside a {name} record at lsn 0x{h.lsn:x}")
            why += " (R-D2)"
            if mode in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE):
                raise CorruptionError(why, where=seg.where(off) if seg else None,
                                      hint=mode.refusal_hint)
            report(Dropped(seg.index if seg else -1, off, 0, why, "corrupt", cat_lsn))
            stop_lsn = cat_lsn
        if at is not None:
            last_commit = max(last_commit, at)
    if 0 <= last_commit < len(items):
        it = items[last_commit]
        res.commit_point_lsn = it.seg.lsn(it.offset)
        res.commit_point_end = res.commit_point_lsn + it.length
    elif last_commit >= len(items) and items:  # a damaged segment header hides the last commit
        it = items[-1]
        res.commit_point_lsn = res.commit_point_end = it.seg.lsn(it.offset) + it.length

    res.bytes_checked = scanner.bytes_checked
    stats: dict[int, list] = {}  # epoch -> [count, bytes, first_lsn, seg, first_off]: the uncommitted report
    region_records: list = []  # the region descriptors among res.records, for tail_regions
    cut = None
    stopped_at = None

    def fail(cls, seg, off, reason):
        raise cls(reason, where=f"segment {seg.index} @ 0x{off:x}", hint=mode.refusal_hint)

    for i, it in enumerate(items):
        seg, off = it.seg, it.offset
        if (mode is RecoveryMode.POINT_IN_TIME and stopped_at is None and stop_lsn is not None
                and seg.lsn(off) + it.length > stop_lsn):
            stopped_at = f"the lost snapshot catalog (lsn 0x{stop_lsn:x})"
        if stopped_at is not None:
            length = it.length
            report(Dropped(seg.index, off, length, f"after the point-in-time stop at {stopped_at}",
                           "stopped"))
            continue
        if it.tag == _DMG:
            length, reason = it.length, it.reason
            # R-D2: a live segment's header was persisted before the superblock
            # listed it (§3.4), so a damaged one is never what a crash leaves
            torn = i > last_commit and it.offset != seg.offset
            if torn:
                if mode is RecoveryMode.ABSOLUTE:
                    fail(TornTailError, seg, off, f"torn tail: {reason}")
                report(Dropped(seg.index, off, length, reason, "torn"))
                continue
            if mode in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE):
                fail(CorruptionError, seg, off, reason)
            report(Dropped(seg.index, off, length, reason, "corrupt"))
            if mode is RecoveryMode.POINT_IN_TIME:
                stopped_at = f"segment {seg.index} @ 0x{off:x}"
            continue
        rec = Record(it.header, seg.index, off, backend)
        kind = _KIND_OF[rec.type]
        if kind == F.REC_COMMIT:
            info, problem, partial = verdicts[i]
            if problem is not None and i in torn_commits:
                if mode is RecoveryMode.ABSOLUTE:
                    fail(TornTailError, seg, off, f"torn tail: {problem}")
                report(Dropped(seg.index, off, rec.length, f"{problem}; {torn_commits[i]}", "torn", rec.lsn))
                continue
            stats.pop(rec.epoch, None)
            if problem is not None and partial and mode is RecoveryMode.SKIP_CORRUPT:
                # R-D4: the epoch is committed for the regions whose records are whole; the
                # damaged batches (reported as such) break their own regions' chains
                report(Dropped(seg.index, off, rec.length, problem, "corrupt", rec.lsn))
                res.incomplete_epochs.append(rec.epoch)
                res.commits.append(info)
                res.records.append(rec)
                cut = (seg, off + rec.length)
                continue
            if problem is not None:
                if mode in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE):
                    fail(CorruptionError, seg, off, problem)
                report(Dropped(seg.index, off, rec.length, problem, "corrupt", rec.lsn))
                if mode is RecoveryMode.POINT_IN_TIME:
                    stopped_at = f"segment {seg.index} @ 0x{off:x}"
                    continue
                # SKIP_CORRUPT: the epoch is incomplete; the chain goes on (_commit_verdicts)
                res.incomplete_epochs.append(rec.epoch)
                continue
            res.commits.append(info)
            res.records.append(rec)
            cut = (seg, off + rec.length)
            continue
        if kind == F.REC_REGION:
            try:
                body = rec.body
                info = F.decode_region_body(body, rec.region_id, rec.page_bytes)
            except CorruptionError as exc:
                if mode in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE) and i < last_commit:
                    fail(CorruptionError, seg, off, f"region descriptor: {exc.message}")
                report(Dropped(seg.index, off, rec.length, f"region descriptor: {exc.message}",
                               "corrupt" if i < last_commit else "torn", rec.lsn))
                continue
            res.regions[rec.region_id] = info
            res.records.append(rec)
            region_records.append(rec)
            continue
        if kind == F.REC_PAD:
            continue
        if not F.counted_in_epoch(rec.type, rec.flags):
            res.records.append(rec)  # BASE batches, snapshot records: the catalog decides (V-N1)
            continue
        if i in late:
            # a record of an epoch already committed (a crashed writer's leftover that
            # reappears after the cut was not taken): never applied
            report(Dropped(seg.index, off, rec.length,
                           f"record of epoch {rec.epoch} after that epoch's commit", "uncommitted", rec.lsn))
            continue
        st = stats.get(rec.epoch)
        if st is None:
            stats[rec.epoch] = [1, rec.length, rec.lsn, seg, off]
        else:
            st[0] += 1
            st[1] += rec.length
        res.records.append(rec)

    # valid records of epochs never committed: reported dropped; they stay in
    # res.records (tools may show them) but Log.records() leaves them out by default
    if stats:
        committed = {c.epoch for c in res.commits}
        for e in sorted(x for x in stats if x not in committed):
            count, nbytes, first_lsn, seg, first_off = stats[e]
            report(Dropped(seg.index, first_off, nbytes,
                           f"epoch {e} has no commit record: {count} records dropped", "uncommitted",
                           first_lsn))
    if vol.short:  # after everything read: the media's end is the last thing on them
        size = vol.backend.size
        report(Dropped(-1, size, vol.superblock.volume_bytes - size, vol.short, "truncated"))
    res.last_committed_epoch = res.commits[-1].epoch if res.commits else 0
    res.last_commit_lsn = res.commits[-1].lsn if res.commits else 0
    res.cut = cut
    if cut is not None:
        res.tail_regions = [r for r in region_records if r.lsn > res.last_commit_lsn]
    else:
        res.tail_regions = region_records
    return res


def _records_of(items: list, type_byte: int) -> list:
    """The indices of a walk's valid records of type `type_byte`, in order."""
    return [i for i, it in enumerate(items) if it.tag == _REC and it.header.type == type_byte]


def _first_holding(items: list, lsn: int) -> int | None:
    """The index of the first item of a walk whose bytes hold `lsn`, or None:
    `seg.lsn(offset) <= lsn < seg.lsn(offset) + length`, tested as offsets
    (`lsn` is turned into an offset once for each run of items of one
    segment, not an LSN computed for every item)."""
    seg = None
    for i, it in enumerate(items):
        if it.seg is not seg:
            seg = it.seg
            at = seg.offset + (lsn - seg.base_lsn)  # where `lsn` would lie in this segment
        if it.offset <= at < it.offset + it.length:
            return i
    return None


def _unwritten_slot(vol: Volume) -> str | None:
    """R-B2: 'B' when slot B was never written (all zero) on a volume whose
    superblock was not updated since it was formatted: unused, not damaged."""
    sb = vol.superblock
    if sb.sequence != 0:
        return None
    off, arr = sb.slot_bytes, vol.backend.array
    if off + sb.slot_bytes <= arr.size and not arr[off:off + sb.slot_bytes].any():
        return "B"
    return None


def _check_regions(items: list, mv) -> list:
    """R-P1 and R-G1 over a walk: a page batch must name a region that a valid
    descriptor in the log defines (anywhere in it: compaction writes the
    descriptors again after the bases it writes, R-G1), with that descriptor's
    page size and page numbers below its page count; a descriptor that defines
    an id again must repeat it exactly.  A record failing either becomes a
    damaged range."""
    regions: dict = {}
    out = items
    bad: dict = {}
    for i in _records_of(items, F.REC_REGION):
        it = items[i]
        h = it.header
        try:
            r = F.decode_region_body(F.record_body(mv, it.offset, h.count), h.region_id, h.page_bytes)
        except CorruptionError:
            continue  # recover reports it
        old = regions.setdefault(h.region_id, r)
        if old != r:
            bad[i] = (f"region descriptor redefines region {h.region_id} ({old.name!r}) "
                      f"with other attributes (R-G1)")
    for i in _records_of(items, F.REC_PAGE_BATCH):
        it = items[i]
        h = it.header
        r = regions.get(h.region_id)
        if r is None:
            if regions:  # R-P1: a region the log's descriptors do not define
                bad[i] = f"page batch of region {h.region_id}, which no descriptor in the log defines (R-P1)"
            continue  # no descriptor left at all (a raw reclaim): not restorable, not damaged
        if h.page_bytes != r.page_bytes:
            bad[i] = (f"page batch of region {r.name!r} has {h.page_bytes}-byte pages, "
                      f"its descriptor {r.page_bytes} (R-P1)")
        else:
            # the last page id (ids increase, V-P4): a little-endian u32, read without numpy, which
            # costs a microsecond a call and a takeover reads one per batch of the log
            at = it.offset + F.RECORD_HEADER_SIZE + 4 * (h.count - 1)
            last = int.from_bytes(mv[at:at + 4], "little")
            if last >= r.pages:
                bad[i] = f"page batch of region {r.name!r} names page {last}, the region has {r.pages} (R-P1)"
    if bad:
        out = list(items)
        for i, problem in bad.items():
            it = items[i]
            out[i] = Damaged(_DMG, it.seg, it.offset, it.header.length, problem)
    return out


def _commit_problem(info: F.CommitInfo, st, last_epoch, last_commit_lsn, oldest) -> str | None:
    e = info.epoch
    if e <= last_epoch:
        return f"commit of epoch {e} does not follow epoch {last_epoch} (V-C2)"
    expected_prev = last_commit_lsn
    if info.prev_commit_lsn != expected_prev and not (
            last_commit_lsn == 0 and info.prev_commit_lsn < max(oldest, 1)):
        return (f"commit of epoch {e} names previous commit at lsn 0x{info.prev_commit_lsn:x}, "
                f"found 0x{expected_prev:x}: a commit is missing (V-C3)")
    count, nbytes = (st[0], st[1]) if st else (0, 0)
    if (count, nbytes) != (info.record_count, info.record_bytes):
        return (f"commit of epoch {e} counts {info.record_count} records / {info.record_bytes} bytes, "
                f"the log holds {count} / {nbytes} (V-C4)")
    return None


def intact_header(seg: SegmentInfo, off: int, mv) -> F.RecordHeader | None:
    """The header at the start of a damaged range when the header itself is
    intact (its CRC checks, and it is placed at its own LSN in this segment's
    incarnation, V-R5), so that what it says (type, epoch, region, length)
    may be believed: a record whose body or pages are damaged, or that fails
    R-P1.  None when the header is damaged too."""
    if off < seg.offset + F.SEGMENT_HEADER_SIZE:
        return None
    try:
        h = F.decode_record_header(mv, off)  # past the mapping's end: refused too
    except CorruptionError:
        return None
    return h if h.lsn == seg.lsn(off) and h.salt == seg.salt else None


def _commit_verdicts(items: list, mv, oldest: int) -> tuple[dict, set]:
    """V-C2..V-C4 for every commit record of a walk, the one place they are
    decided (V-C1 is the walk's: a commit whose body does not decode is a
    damaged range).  Read in LSN order, and on past a failing commit as
    SKIP_CORRUPT reads on: the next commit must still name it (V-C3) and pass
    its epoch (V-C2), so that one damaged epoch does not make every later
    commit fail.  Every mode decides the same until its first failure, where
    TOLERATE_TAIL and ABSOLUTE refuse and POINT_IN_TIME stops.

    A commit that fails V-C4 only by page batches that are damaged but whose
    headers are intact (`intact_header`: they name the commit's epoch and lie
    in its range, and with them the count and the bytes are right) is
    *partial*: SKIP_CORRUPT commits its epoch for the other regions (R-D4).

    Returns ({item index: (CommitInfo, problem or None, frozenset of the
    region ids of those damaged batches when partial, else None)}, {indices
    of records of an epoch already committed}: never counted, never applied)."""
    verdicts: dict = {}
    late: set = set()
    stats: dict = {}  # epoch -> [records, bytes] counted for its commit (V-C4, V-N1)
    damaged: dict = {}  # epoch -> [(lsn, length, region id)] of its damaged batches with intact headers
    last_epoch = last_lsn = 0
    for i, it in enumerate(items):
        if it.tag != _REC:
            h = intact_header(it.seg, it.offset, mv)
            if (h is not None and h.type == F.REC_PAGE_BATCH and F.counted_in_epoch(h.type, h.flags)
                    and h.epoch > last_epoch):
                damaged.setdefault(h.epoch, []).append((h.lsn, h.length, h.region_id))
            continue
        h = it.header
        if h.type == F.REC_COMMIT:  # is_commit (R-T1: the whole type byte)
            info = F.decode_commit_body(F.record_body(mv, it.offset, h.count), h)
            st = stats.pop(h.epoch, None)
            problem = _commit_problem(info, st, last_epoch, last_lsn, oldest)
            known = [x for x in damaged.pop(h.epoch, ()) if info.first_lsn <= x[0] < info.lsn] if damaged else []
            partial = None
            if problem is not None and known:
                with_them = [(st[0] if st else 0) + len(known), (st[1] if st else 0) + sum(x[1] for x in known)]
                if _commit_problem(info, with_them, last_epoch, last_lsn, oldest) is None:
                    partial = frozenset(x[2] for x in known)
            verdicts[i] = (info, problem, partial)
            last_epoch = h.epoch if problem is None else max(last_epoch, h.epoch)
            last_lsn = h.lsn
            continue
        if not F.counted_in_epoch(h.type, h.flags):
            continue  # region, pad, catalog and snapshot records, BASE batches (V-C4, V-N1)
        if h.epoch <= last_epoch and h.epoch != 0:
            late.add(i)
            continue
        st = stats.get(h.epoch)
        if st is None:
            stats[h.epoch] = [1, h.length]
        else:
            st[0] += 1
            st[1] += h.length
    return verdicts, late


def verify(vol: Volume, *, check_pages: bool = True,
           progress: Callable[[int, int], None] | None = None, walk: list | None = None) -> dict:
    """Check every checksum of the volume and report ALL problems (never raises
    for data problems).  Returns a JSON-able dict: problems, counts, throughput.
    progress(done_bytes, total_bytes) is told how far the walk is, at most
    every few MiB (Scanner).  `walk`, a list, receives the walk's items when
    they were kept (`walk_kept`), for a `planner.scan` of the same volume."""
    t0 = time.perf_counter()
    problems: list[Dropped] = []
    res = recover(vol, RecoveryMode.SKIP_CORRUPT, problems.append, check_pages=check_pages,
                  progress=progress)
    dt = time.perf_counter() - t0
    if walk is not None and res.walk is not None:
        walk.extend(res.walk)
    corrupt = [p for p in problems if p.kind in ("corrupt", "superblock")]
    return {
        "ok": not corrupt,
        "problems": [p.to_json() for p in problems],
        "corrupt": len(corrupt),
        "torn": sum(p.kind == "torn" for p in problems),
        "uncommitted": sum(p.kind == "uncommitted" for p in problems),
        "records": len(res.records),
        "commits": len(res.commits),
        "last_committed_epoch": res.last_committed_epoch,
        "incomplete_epochs": res.incomplete_epochs,
        "bytes_checked": res.bytes_checked,
        "seconds": dt,
        "gb_per_s": res.bytes_checked / dt / 1e9 if dt > 0 else 0.0,
    }


class Follower:
    """Tails a log that a live writer appends to (`concordia-wal dump --follow`):
    each `poll()` returns the Scanner items appended since the last one, in
    LSN order, none twice and none left out.

    The position is an LSN (`lsn`: every item ending at or below it has been
    returned) with the record boundary to resume from.  A writer fills a
    segment, then rolls over, but another segment can be listed (or adopted
    from the header an msync tier's commit prepares) while the old one still
    takes records: a follower that moved on as soon as it saw the next
    segment lost the old one's last records.  So a segment is left only once
    a later segment holds a valid record that settles every reservation
    before it (`settles`: a commit, or a BASE batch or catalog record, which
    a writer appends only with no reservation outstanding, FORMAT.md §10.6),
    so every byte of the old segment is final by then; that record is read
    first, the old segment's end once more after it, and only then the next
    segment.  Until then a damaged range is taken for a record still being
    written (the poll stops before it and looks again next time); in a
    segment the writer has left it is damage, and is returned as such.
    Other records after the writer's last settling record in a later segment
    (an epoch's page batches) are shown once such a record follows them
    there.  So a base snapshot slice that retention writes after a commit
    is shown even when it is the first record of a new segment and the
    writer stops (or dies) before its next commit.

    A writer that reopens the log cuts what follows its last commit and
    writes again at those LSNs: when the last record returned is no longer
    there, the follower goes back to the end of the last commit it returned
    (`cut_at` says where; `cuts` counts them) and returns what is there now.
    """

    def __init__(self, backend, *, from_lsn: int = 0, check_pages: bool | Callable = True, after=None):
        """check_pages as Scanner's: a callable(header) checks the pages of
        the batches it is true for (a mirror: those it will apply).
        after: a record of a walk of this log made already (a `Found` item,
        `Log.walk_through_commit`): the follower starts just past it, as if
        it had returned it last (and goes back to it when the log is cut
        there, should it be a commit), instead of from `from_lsn`."""
        self.backend = backend
        self.check_pages = check_pages
        self.lsn = int(from_lsn)
        self.uuid: bytes | None = None
        self.volume: Volume | None = None  # the volume of the last poll (its superblock)
        self._resume: tuple | None = None  # (segment index, seq, absolute offset of the next record)
        self._last: tuple | None = None  # (index, seq, offset, header bytes, lsn) of the last record returned
        self._commit: tuple | None = None  # (lsn, resume) just after the last commit returned
        self.cuts = 0
        self.cut_at: int | None = None
        if after is not None:
            seg = after.seg
            self.lsn = seg.lsn(after.offset) + after.length
            self._resume = (seg.index, seg.seq, after.offset + after.length)
            self._last = (seg.index, seg.seq, after.offset,
                          bytes(F.record_header_bytes(backend.view, after.offset)), self.lsn)
            if is_commit(after):
                self._commit = (self.lsn, self._resume)

    def poll(self, vol: Volume | None = None) -> list:
        """The items appended since the last poll (module docstring of Scanner
        for their form).  Raises WalError when the log was formatted again.
        vol: the volume opened just now by the caller (read-only, of this
        backend), instead of opening it again here."""
        from .errors import WalError

        if vol is None:
            vol = Volume.open(self.backend, writable=False)
        if self.uuid is None:
            self.uuid = vol.uuid
        elif vol.uuid != self.uuid:
            raise WalError("the log was formatted again while it was followed", where=self.backend.where)
        self.volume = vol
        scanner = Scanner(vol, check_pages=self.check_pages)
        live = vol.live_segments()
        self._check_cut(vol, live)
        out: list = []
        for k, seg in enumerate(live):
            if seg.end_lsn <= self.lsn:
                continue
            # first: has the writer left this segment?  (read before the segment itself)
            left = self._settled_after(Scanner(vol, check_pages=False), vol, live, k)
            why = vol.check_segment_header(seg, live[k - 1] if k else None)
            if why:
                if not left:
                    break  # a superblock read while the segment was being taken: look again
                out.append(Damaged(_DMG, seg, seg.offset, seg.nbytes, why))
                self.lsn = seg.end_lsn
                continue
            start = None
            if self._resume is not None and self._resume[:2] == (seg.index, seg.seq):
                start = self._resume[2]
            # a segment the writer has not left ends, for now, where no record starts: the
            # walk stops there instead of reading the rest of the segment (its old bytes)
            for it in scanner._segment(seg, start, to_gap=not left):
                length = it.length
                end = seg.lsn(it.offset) + length
                if end <= self.lsn:
                    continue
                if it[0] == _DMG and not left:
                    return out  # a record still being written: from here next time
                out.append(it)
                self.lsn = end
                self._resume = (seg.index, seg.seq, it.offset + length)
                if it[0] == _REC:
                    self._last = (seg.index, seg.seq, it.offset, bytes(F.record_header_bytes(self.backend.view, it.offset)),
                                  end)
                    if is_commit(it):
                        self._commit = (end, self._resume)
            if not left:
                break
            self.lsn = max(self.lsn, seg.end_lsn)  # every record of the segment is out
        return out

    def _check_cut(self, vol: Volume, live: list) -> None:
        """Go back to the last commit returned when the log was cut after it:
        the last record returned is overwritten in its segment, or its segment
        and every later one were freed (LSNs only grow otherwise, and the
        newest segment is never reclaimed)."""
        if self._last is None:
            return
        idx, seq, off, raw, end = self._last
        seg = next((s for s in live if (s.index, s.seq) == (idx, seq)), None)
        changed = seg is not None and bytes(F.record_header_bytes(vol.backend.view, off)) != raw
        gone = seg is None and (not live or live[-1].end_lsn < end)
        if not (changed or gone):
            return
        self.lsn, self._resume = self._commit if self._commit is not None else (0, None)
        self._last = None
        self.cuts += 1
        self.cut_at = self.lsn

    def _settled_after(self, scanner: Scanner, vol: Volume, live: list, k: int) -> bool:
        """Whether a live segment after live[k] holds a valid record that
        settles every reservation before it (`settles`: a commit, a BASE
        batch, a catalog): the writer has left live[k] for good then."""
        for j in range(k + 1, len(live)):
            if vol.check_segment_header(live[j], live[j - 1]):
                continue
            # to the first gap only: a writer appends a settling record with no reservation
            # outstanding, so one past a gap is past damage, which the segment shows once
            # a later one settles it (the rest of a reused segment is old bytes, not read)
            if any(settles(it) for it in scanner._segment(live[j], to_gap=True)):
                return True
        return False
