"""The volume: two superblock slots, the segment table and the segments
(FORMAT.md §2-§4).  It owns every superblock write and every segment taken
into use or given back; the appender writes records, the reader reads them.

Internal API used by snapshots and compaction (docs/internals.md):

    vol.superblock                      # the current Superblock (format.Superblock)
    vol.write_superblock(**changes)     # atomic update of catalog_lsn, oldest_lsn,
                                        # oldest_epoch, retain_epochs, retain_bytes
    vol.live_segments()                 # [SegmentInfo] in LSN order
    vol.reclaim_segments(before_lsn, **changes)   # free whole segments below an LSN
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass

import numpy as np

from concordia.devmem import Backend, open_backend
from concordia.root_error import Hint

from . import format as F
from .errors import (
    CorruptionError,
    FormatVersionError,
    LogFullError,
    NotALogError,
    ReadOnlyFeatureError,
    SuperblockError,
    TargetNotEmptyError,
    UsageError,
    WalError,
)

#: superblock fields callers may change through write_superblock
SETTABLE = ("catalog_lsn", "oldest_lsn", "oldest_epoch", "retain_epochs", "retain_bytes")

#: a superblock slot that holds the magic and does not decode is read again by a read-only open, SLOT_SETTLE_S
#: apart, while its bytes change (at most SLOT_READS reads); two reads alike make it damaged: a writer beside
#: the open may be rewriting it (`read_slot`, R-B4)
SLOT_SETTLE_S = 0.002
SLOT_READS = 100


@dataclass(frozen=True)
class SegmentInfo:
    """A live segment incarnation, as the superblock table and header name it."""

    index: int
    seq: int
    base_lsn: int
    salt: int
    offset: int  # absolute offset of byte 0 in the backend
    nbytes: int  # segment_bytes
    header_crc: int

    @property
    def end_lsn(self) -> int:
        return self.base_lsn + self.nbytes

    def lsn(self, abs_offset: int) -> int:
        """The LSN of the byte at absolute offset `abs_offset` of this segment."""
        return self.base_lsn + (abs_offset - self.offset)

    def where(self, abs_offset: int) -> str:
        return f"segment {self.index} @ 0x{abs_offset:x}"


#: segment size of a volume large enough to hold MIN_SEGMENTS of them
DEFAULT_SEGMENT_SIZE = 64 << 20
#: a volume formatted with the default segment size holds at least this many
#: segments of it, when it is large enough for 1 MiB segments
MIN_SEGMENTS = 8


def default_segment_size(total: int) -> int:
    """The segment size a volume of `total` bytes gets when none is named:
    64 MiB, halved (down to 1 MiB) until `total` holds MIN_SEGMENTS of them
    (a 64 MiB volume gets 8 MiB segments, 128 MiB gets 16 MiB, 512 MiB and
    more gets 64 MiB).  The two superblock slots take the first MiB, so a
    volume of exactly 8 segments' bytes holds 7."""
    seg = DEFAULT_SEGMENT_SIZE
    while seg > F.SEGMENT_ALIGN and total < MIN_SEGMENTS * seg:
        seg //= 2
    return seg


def _random_salt(avoid: int) -> int:
    while True:
        s = int.from_bytes(os.urandom(4), "little")
        if s and s != avoid:
            return s


def _zero_fill(backend: Backend, total: int) -> None:
    """Clear and persist the first `total` bytes.  A page-cache file is cleared
    with write(2) (`write_at`), not with stores through the mapping, so that its
    pages are not all mapped writable into this process (the kernel has to
    write-protect each mapped page again at every writeback).  Measured on ext4
    with bare writes of 256 KiB and a sync every 4 MiB: 2.4 GB/s into a file
    cleared through its mapping, 3.2 GB/s into one cleared with write(2), as
    into a file never mapped; in the log's own append benchmark the difference
    was within the run-to-run noise."""
    write_at = getattr(backend, "write_at", None)
    if write_at is None:
        backend.array[:] = 0
    else:
        chunk = memoryview(bytes(min(total, 8 << 20)))
        for off in range(0, total, len(chunk)):
            write_at(off, [chunk[:min(len(chunk), total - off)]])
    backend.persist(0, total)


#: tiers whose targets hold nothing before this process made them
VOLATILE_KINDS = ("memory", "pinned")


def target_contents(backend: Backend) -> str | None:
    """What formatting `backend` would destroy: "holds a Concordia log (...)",
    "is not empty (nonzero byte at 0x...)", or None when every byte is zero."""
    arr = backend.array
    if bytes(arr[:8]) == F.VOLUME_MAGIC:
        return "holds a Concordia log (superblock magic at offset 0)"
    step = 16 << 20
    for lo, hi in _data_extents(backend.path, arr.size):
        for start in range(lo, hi, step):
            chunk = arr[start:min(hi, start + step)]
            if chunk.any():
                first = start + int(chunk.nonzero()[0][0])
                return f"is not empty (nonzero byte at 0x{first:x})"
    return None


def _data_extents(path, size: int):
    """[(start, end)] of the file's data (SEEK_DATA / SEEK_HOLE): holes read as
    zero, so a large sparse file is checked at the cost of its data, not its
    length.  The whole range where the file cannot say (a device, no SEEK_HOLE)."""
    import errno
    import os

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path else -1
    except OSError:
        fd = -1
    if fd < 0:
        return [(0, size)]
    out, pos = [], 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break   # only a hole from here on
                raise       # no SEEK_DATA here (a device): the whole range
            if start >= size:
                break
            end = min(size, os.lseek(fd, start, os.SEEK_HOLE))
            if end <= start:
                return [(0, size)]   # a file that cannot say where its data is
            out.append((start, end))
            pos = end
    except OSError:
        return [(0, size)]
    finally:
        os.close(fd)
    return out


#: how to format a target that holds something anyway, in each interface's words
FORMAT_ANYWAY_HINT = Hint(api="pass overwrite=True to format it anyway", cli="pass --force to format it anyway")


def check_format_target(target, *, overwrite: bool = False, allow_log: bool = False,
                        hint: str | Hint = FORMAT_ANYWAY_HINT) -> None:
    """The one check every path that formats a log makes first (`Log.create`,
    so `Session`, `concordia demo` and `concordia-wal format`): a target that
    exists and holds anything (a log, or any nonzero byte) is refused with
    TargetNotEmptyError and left unchanged, unless `overwrite`; `allow_log`
    lets a target that holds a Concordia log through (the demo replaces its
    own log).  `target` is a log name (opened read-only here, nothing is
    created) or an open Backend.  An absent or empty file holds nothing."""
    if overwrite:
        return
    from concordia.devmem import parse_spec
    from concordia.devmem.errors import BadSizeError, PathNotFoundError

    if isinstance(target, Backend):
        backend, owned = target, False
    else:
        if parse_spec(target).kind in VOLATILE_KINDS:
            return
        try:
            backend, owned = open_backend(target, readonly=True), True
        except PathNotFoundError:
            return
        except BadSizeError as exc:
            if "file is empty" in exc.message:  # a zero-length file: nothing to lose
                return
            # a length no log has: a file of something else
            raise TargetNotEmptyError(f"refusing to format: the target is not a log ({exc.message})",
                                      where=exc.where, hint=hint) from None
    try:
        what = target_contents(backend)
        where = backend.where
    finally:
        if owned:
            backend.close()
    if what is None or (allow_log and what.startswith("holds a Concordia log")):
        return
    raise TargetNotEmptyError(f"refusing to format: the target {what}", where=where, hint=hint)


#: a log that may be read but not written: how to read it, in each interface's words
READ_IT_HINT = Hint(api="open it read-only (writable=False)",
                    cli="info, dump, verify and restore read it without writing")
TRUNCATED_HINT = Hint(api="open it read-only (writable=False) to read what is left, or put back a copy of it",
                      cli="info, dump, verify and restore read what is left; or put back a copy of it")


#: {backend: {slot offset: bytes}} of slots found damaged, so that a volume opened again and again (a
#: follower's poll) settles a damaged slot once, not at every open
_BAD_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _bad_slots(backend) -> dict | None:
    try:
        return _BAD_SLOTS.setdefault(backend, {})
    except TypeError:  # a backend that cannot be weakly referenced: settled at every open
        return None


def slot_copy(arr, off: int) -> bytes:
    """One copy of the bytes of the superblock slot at `off` of the mapping
    `arr`: its header and, where the header's segment count is in range, its
    segment table (a count changed by a writer meanwhile fails the decode)."""
    head = bytes(arr[off:off + F.SUPERBLOCK_SIZE])
    count = int.from_bytes(head[96:100], "little") if len(head) == F.SUPERBLOCK_SIZE else 0
    if head[:8] != F.VOLUME_MAGIC or not 0 < count <= F.MAX_SEGMENTS:  # (not a table to read)
        return head
    return bytes(arr[off:off + F.SUPERBLOCK_SIZE + F.SEGMENT_ENTRY_SIZE * count])


def read_slot(arr, off: int, where: str, *, settle: bool = True, bad: dict | None = None) -> tuple:
    """(bytes, Superblock or None, the error or None) of slot `off` of the
    mapping `arr`, decoded from one copy (`slot_copy`), not field by field: a
    writer rewriting the slot while it is read gives a copy that fails its
    CRC, never fields of two versions that pass it.  settle: a copy that
    holds the magic and does not decode is taken again, SLOT_SETTLE_S apart,
    while the bytes keep changing (a writer is rewriting it; at most
    SLOT_READS copies); two copies alike make it damage (R-B4).  bad: {offset:
    bytes} of slots of this target found damaged before, not settled again
    (a follower opens the volume at every poll), and updated."""
    raw = slot_copy(arr, off)
    for _ in range(SLOT_READS):
        try:
            return raw, decode_slot_copy(raw, arr.size, off, where), None
        except (CorruptionError, NotALogError) as exc:
            err = exc
        if not settle or raw[:8] != F.VOLUME_MAGIC or (bad is not None and bad.get(off) == raw):
            break
        time.sleep(SLOT_SETTLE_S)
        again = slot_copy(arr, off)
        if again == raw:
            break
        raw = again
    if bad is not None:
        bad[off] = raw
    return raw, None, err


def decode_slot_copy(raw: bytes, size: int, off: int, where: str) -> F.Superblock:
    """The superblock in `raw` (`slot_copy` of slot `off` of a target of `size`
    bytes), or the error naming why it is not one."""
    if off + F.SUPERBLOCK_SIZE > size:
        if off < size and raw[:8] != F.VOLUME_MAGIC[:min(8, size - off)]:
            # a file shorter than a superblock (any length is read, V-B8) without its magic
            raise NotALogError("no superblock magic", where=where)
        raise CorruptionError("slot lies past the end of the target", where=where)
    if raw[:8] != F.VOLUME_MAGIC:
        return F.decode_superblock(raw, where=where)  # raises with the reason
    count = int.from_bytes(raw[96:100], "little")
    if not 0 < count <= F.MAX_SEGMENTS:
        raise CorruptionError(f"segment count {count} out of range", where=where)
    if off + F.SUPERBLOCK_SIZE + F.SEGMENT_ENTRY_SIZE * count > size:
        raise CorruptionError("segment table runs past the end of the target", where=where)
    return F.decode_superblock(raw, where=where)


class Volume:
    """A formatted volume on a backend.  Not thread-safe: one writer."""

    def __init__(self, backend: Backend, sb: F.Superblock, *, writable: bool,
                 slot_problems: list[tuple[str, str]]):
        self.backend = backend
        self.writable = writable
        self._sb = sb
        #: [(where, reason)] for superblock slots found invalid at open
        self.slot_problems = slot_problems
        self.short: str | None = None  # why the media are shorter than the volume, when they are
        #: segments taken into use that the superblock in force does not list (FORMAT.md §3.4)
        self.adopted: list[SegmentInfo] = []

    # -- creating and opening -------------------------------------------------
    @classmethod
    def create(cls, target, *, size: int | None = None, segment_size: int | None = None,
               zero: bool = True) -> "Volume":
        """Format `target` (a Backend or a log name) as an empty volume.

        segment_size: None picks `default_segment_size` of the target's size.
        zero: clear every byte first; pass False only for a target known to be
        zero (a file just created), the segments are then taken as preallocated.
        """
        backend = open_backend(target, size=size, create=True) if not isinstance(target, Backend) else target
        if segment_size is None:
            segment_size = default_segment_size(backend.size)
        if segment_size % F.SEGMENT_ALIGN or segment_size < F.SEGMENT_ALIGN:
            raise WalError(f"segment size {segment_size} is not a positive multiple of 1 MiB",
                           where=backend.where)
        total = backend.size
        count = max(0, (total - 2 * F.SLOT_ALIGN) // segment_size)
        while count > 0:
            slot = F.slot_bytes_for(count)
            off = F.align(2 * slot, F.SEGMENT_ALIGN)
            if off + count * segment_size <= total:
                break
            count -= 1
        if count < 2:
            raise WalError(f"a {total}-byte target holds fewer than 2 segments of {segment_size} bytes",
                           where=backend.where,
                           hint=Hint(api="use a larger size or a smaller segment_size",
                                     cli="use a larger --size or a smaller --segment-size"))
        count = min(count, F.MAX_SEGMENTS)
        slot = F.slot_bytes_for(count)
        off = F.align(2 * slot, F.SEGMENT_ALIGN)
        if zero:
            _zero_fill(backend, total)
        else:
            backend.array[:2 * slot] = 0
        sb = F.Superblock(
            uuid=os.urandom(16), sequence=0, volume_bytes=total, slot_bytes=slot, segments_off=off,
            segment_bytes=segment_size, segment_count=count, next_lsn=segment_size,
            next_segment_seq=1, oldest_lsn=0, oldest_epoch=0, catalog_lsn=0, retain_epochs=0,
            retain_bytes=0, created_ns=time.time_ns(),
            segments=tuple(F.SegmentEntry(0, 0, 0, F.SEG_FREE, 0) for _ in range(count)))
        vol = cls(backend, sb, writable=True, slot_problems=[])
        vol._store(sb)  # sequence 0 -> slot A
        return vol

    @classmethod
    def open(cls, target, *, writable: bool = False) -> "Volume":
        """Open an existing volume; one bad superblock slot is survived (and listed in
        `slot_problems`), two are a SuperblockError."""
        backend = target if isinstance(target, Backend) else open_backend(target, readonly=not writable)
        arr = backend.array
        found, problems = [], []
        first_err = None
        magicless = 0  # slots without the magic, or past the end of the target
        slot_guess = F.SLOT_ALIGN
        for i in range(F.SLOT_COUNT):
            # slot B's place depends on slot_bytes, which slot A (or B) states
            off = 0 if i == 0 else slot_guess
            where = f"superblock slot {'AB'[i]} @ 0x{off:x}"
            try:
                # a writable open holds the writer lock: no writer rewrites a slot beside it
                sb = cls._decode_slot(arr, off, where, settle=not writable, bad=_bad_slots(backend))
                if sb.sequence % 2 != i:  # V-B7
                    raise CorruptionError(f"slot holds sequence {sb.sequence}, which belongs to the other slot",
                                          where=where)
                if i == 0:
                    slot_guess = sb.slot_bytes
                elif sb.slot_bytes != off:  # R-B1: slot B lies where its own slot_bytes says
                    raise CorruptionError(f"slot states slot_bytes {sb.slot_bytes}, found at 0x{off:x}",
                                          where=where)
                found.append(sb)
            except (FormatVersionError,):
                raise
            except (CorruptionError, NotALogError) as exc:
                if i == 0:
                    # slot A unreadable: find B by trying the slot sizes in use
                    slot_guess = cls._find_slot_b(arr)
                problems.append((where, exc.message))
                first_err = first_err or exc
                magicless += isinstance(exc, NotALogError) or off >= arr.size
        if not found:
            if magicless == F.SLOT_COUNT and isinstance(first_err, NotALogError):
                raise NotALogError("no Concordia volume here (no superblock magic in either slot)",
                                   where=backend.where)
            raise SuperblockError("both superblock slots are invalid: "
                                  + "; ".join(f"{w}: {p}" for w, p in problems), where=backend.where)
        sb = max(found, key=lambda s: s.sequence)
        if writable and sb.ro_compat & ~F.KNOWN_RO_COMPAT:
            raise ReadOnlyFeatureError(f"unknown ro-compat features 0x{sb.ro_compat:x}",
                                       where=backend.where, hint=READ_IT_HINT)
        if writable and backend.readonly:
            raise UsageError("backend is read-only", where=backend.where)
        short = None
        if backend.size < sb.volume_bytes:  # V-B8: the media end before the volume does
            short = (f"the log is {backend.size} bytes but its superblock declares {sb.volume_bytes}: "
                     f"it was truncated, and what lay beyond reads as zero")
            if writable:
                raise CorruptionError(short, where=backend.where, hint=TRUNCATED_HINT)
        if problems and found:
            sb = cls._unlist_cut_segments(arr, sb)
        vol = cls(backend, sb, writable=writable, slot_problems=problems)
        vol.short = short
        vol._adopt()
        return vol

    def _adopt(self) -> None:
        """R-B3, R-S1: a free segment whose valid header continues the chain of the newest live
        one was taken into use by a superblock write that is not in force (a crash
        between header and superblock, or the newer slot lost): list it as live."""
        live, arr = self.live_segments(), self.backend.array
        while live:
            last = live[-1]
            nxt = None
            for i, e in enumerate(self._sb.segments):
                if e.state != F.SEG_FREE:
                    continue
                off = self.segment_offset(i)
                if off + F.SEGMENT_HEADER_SIZE > self.backend.size:
                    continue
                # only a header whose chain word names the newest live segment can continue it; the others
                # (zero, or an earlier use's: most of a log's free segments) are not decoded
                if F.segment_prev_seq(arr, off) != last.seq:
                    continue
                hdr, why = F.decode_segment_header(memoryview(arr[off:off + F.SEGMENT_HEADER_SIZE]))
                # FORMAT.md R-S1: seq may jump (a cut frees segments whose numbers
                # are not reissued); the chain words decide, not seq + 1
                if (why is None and hdr.uuid == self._sb.uuid and hdr.seq > last.seq
                        and hdr.prev_seq == last.seq and hdr.prev_header_crc == last.header_crc
                        and hdr.index == i and hdr.segment_bytes == self._sb.segment_bytes
                        and hdr.base_lsn >= last.end_lsn):
                    nxt = SegmentInfo(i, hdr.seq, hdr.base_lsn, hdr.salt, off, hdr.segment_bytes, hdr.header_crc)
                    break
            if nxt is None:
                break
            self.adopted.append(nxt)
            live.append(nxt)
        if self.adopted:
            entries = list(self._sb.segments)
            for s in self.adopted:
                entries[s.index] = F.SegmentEntry(s.base_lsn, s.seq, s.salt, F.SEG_LIVE, s.header_crc)
            last = self.adopted[-1]
            changes = dict(segments=tuple(entries), next_lsn=max(self._sb.next_lsn, last.end_lsn),
                           next_segment_seq=max(self._sb.next_segment_seq, last.seq + 1))
            if self.writable:
                self._update(**changes)
            else:
                self._sb = self._sb._replace(**changes)

    @staticmethod
    def _unlist_cut_segments(arr, sb: F.Superblock) -> F.Superblock:
        """R-B3: read from the older slot (the other one is invalid), a segment
        the table lists live whose header is all zero was freed by the lost
        update (a cut zeroes the headers of the segments it frees, §10.5): it
        is read as free, not as a damaged segment."""
        entries = list(sb.segments)
        changed = False
        for i, e in enumerate(entries):
            off = sb.segments_off + i * sb.segment_bytes
            if e.state == F.SEG_LIVE and off + F.SEGMENT_HEADER_SIZE <= arr.size \
                    and not arr[off:off + F.SEGMENT_HEADER_SIZE].any():
                entries[i] = e._replace(state=F.SEG_FREE)
                changed = True
        return sb._replace(segments=tuple(entries)) if changed else sb

    @staticmethod
    def _decode_slot(arr, off, where, *, settle: bool = True, bad: dict | None = None) -> F.Superblock:
        """Slot `off` of the mapping `arr`, decoded from one copy of its bytes
        (`read_slot`); raises the error that names why it is not valid."""
        _, sb, err = read_slot(arr, off, where, settle=settle, bad=bad)
        if err is not None:
            raise err
        return sb

    @staticmethod
    def _find_slot_b(arr) -> int:
        """Where slot B lies when slot A cannot say: the first place a slot size
        in use (`slot_bytes_for(n)`, n <= MAX_SEGMENTS) puts it that holds the
        magic.  The search stops at the largest slot size and within the first
        half of the target (both slots precede the segments), 8 bytes read at
        each place; a sparse file is read from a copy, never through a mapping
        of its holes (devmem.tiers.CopiedMapping)."""
        limit = min(F.slot_bytes_for(F.MAX_SEGMENTS), arr.size // 2)
        for off in range(F.SLOT_ALIGN, limit + 1, F.SLOT_ALIGN):
            if bytes(arr[off:off + 8]) == F.VOLUME_MAGIC:
                return off
        return F.SLOT_ALIGN

    # -- the superblock -------------------------------------------------------
    @property
    def superblock(self) -> F.Superblock:
        return self._sb

    @property
    def uuid(self) -> bytes:
        return self._sb.uuid

    def _store(self, sb: F.Superblock) -> None:
        """Write `sb` into slot sequence % 2 and persist it (FORMAT.md §3)."""
        raw = F.encode_superblock(sb)
        off = (sb.sequence % 2) * sb.slot_bytes
        self._write(off, raw)
        self.backend.persist(off, len(raw))
        self._sb = sb

    def _write(self, off: int, raw: bytes) -> None:
        """Store `raw` at `off` (not persisted).  A page-cache file takes it with
        pwritev (`write_at`): a store through the mapping would fault on the page
        the last sync left write-protected, which here cost up to milliseconds."""
        write_at = getattr(self.backend, "write_at", None)
        if write_at is not None:
            write_at(off, [raw])
        else:
            self.backend.array[off:off + len(raw)] = np.frombuffer(raw, np.uint8)

    def _update(self, **changes) -> F.Superblock:
        if not self.writable:
            raise UsageError("volume opened read-only", where=self.backend.where)
        sb = self._sb._replace(sequence=self._sb.sequence + 1, **changes)
        self._store(sb)
        return sb

    def write_superblock(self, **changes) -> F.Superblock:
        """Atomically change the fields named in SETTABLE (catalog_lsn,
        oldest_lsn, oldest_epoch, retain_epochs, retain_bytes); returns the new
        superblock.  Durable when it returns."""
        bad = set(changes) - set(SETTABLE)
        if bad:
            raise UsageError(f"superblock fields {sorted(bad)} cannot be set; settable: {', '.join(SETTABLE)}")
        for k, v in changes.items():
            if not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 1 << 64:
                raise UsageError(f"superblock field {k} must be a u64, not {v!r}")
        return self._update(**{k: int(v) for k, v in changes.items()})

    def enable_incompat(self, bits: int) -> F.Superblock:
        """Set incompat feature `bits` in the superblock (FORMAT.md §2.3) before
        the first structure that needs them is written: from then on a reader
        that lacks them refuses the volume instead of misreading it.  Durable
        when it returns; a no-op when they are set already."""
        if bits & ~F.KNOWN_INCOMPAT:
            raise UsageError(f"incompat features 0x{bits & ~F.KNOWN_INCOMPAT:x} are not known to this code")
        if self._sb.incompat & bits == bits:
            return self._sb
        return self._update(incompat=self._sb.incompat | bits)

    # -- segments -------------------------------------------------------------
    @property
    def segment_bytes(self) -> int:
        return self._sb.segment_bytes

    def segment_offset(self, index: int) -> int:
        return self._sb.segments_off + index * self._sb.segment_bytes

    def live_segments(self) -> list[SegmentInfo]:
        """Live segments in LSN (= seq) order, as the superblock table lists them."""
        out = [SegmentInfo(i, e.seq, e.base_lsn, e.salt, self.segment_offset(i), self._sb.segment_bytes,
                           e.header_crc)
               for i, e in enumerate(self._sb.segments) if e.state == F.SEG_LIVE]
        out.sort(key=lambda s: s.seq)
        return out

    def check_segment_header(self, seg: SegmentInfo, prev: SegmentInfo | None) -> str | None:
        """None when the header of live segment `seg` satisfies V-S1..V-S5, else why not."""
        end = seg.offset + F.SEGMENT_HEADER_SIZE
        if end > self.backend.size:
            return "segment header lies past the end of the target (truncated volume)"
        hdr, why = F.decode_segment_header(memoryview(self.backend.array[seg.offset:end]))
        if why:
            return why
        # V-S5 / R-S1: every live segment names the live one before it, whatever
        # the gap in seq numbers (a cut leaves gaps; they never excuse a link)
        if prev is not None and (
                hdr.prev_seq != prev.seq or hdr.prev_header_crc != prev.header_crc):
            return (f"segment chain broken: header names previous segment seq {hdr.prev_seq} "
                    f"crc 0x{hdr.prev_header_crc:08x}, expected seq {prev.seq} crc 0x{prev.header_crc:08x}")
        if hdr.uuid != self._sb.uuid:
            return "segment header belongs to another volume (uuid differs)"
        if hdr.index != seg.index or hdr.segment_bytes != self._sb.segment_bytes:
            return f"segment header says index {hdr.index}, size {hdr.segment_bytes}"
        if (hdr.seq, hdr.base_lsn, hdr.salt, hdr.header_crc) != (seg.seq, seg.base_lsn, seg.salt, seg.header_crc):
            return (f"segment header (seq {hdr.seq}, base_lsn 0x{hdr.base_lsn:x}, salt 0x{hdr.salt:08x}) "
                    f"disagrees with the superblock (seq {seg.seq}, base_lsn 0x{seg.base_lsn:x}, "
                    f"salt 0x{seg.salt:08x})")
        return None

    def _next_free(self, after: SegmentInfo | None) -> int:
        """Index of the free segment a roll over after `after` takes: the next one
        cyclically.  Raises LogFullError when none is free."""
        sb = self._sb
        n = sb.segment_count
        start = 0 if after is None else (after.index + 1) % n
        for k in range(n):
            i = (start + k) % n
            if sb.segments[i].state == F.SEG_FREE:
                return i
        raise LogFullError(f"all {n} segments are live", where=self.backend.where,
                           hint="compact the log to reclaim segments, or create a larger one")

    def _write_header(self, i: int) -> SegmentInfo:
        """Write (not persist) the header of segment `i` as the next one of the
        chain, with a new salt, and zero its first record slot."""
        sb = self._sb
        live = self.live_segments()
        prev = live[-1] if live else None
        salt = _random_salt(sb.segments[i].salt)
        h = F.SegmentHeader(sb.uuid, sb.next_segment_seq, sb.next_lsn, sb.segment_bytes, i, salt,
                            prev.seq if prev else 0, prev.header_crc if prev else 0, time.time_ns())
        raw = F.encode_segment_header(h)
        crc = int.from_bytes(raw[F.SEGMENT_HEADER_CRC_OFF:], "little")
        off = self.segment_offset(i)
        # the first record slot starts zero, so a fresh segment ends cleanly at once
        self._write(off, raw + bytes(F.RECORD_HEADER_SIZE))
        return SegmentInfo(i, h.seq, h.base_lsn, salt, off, sb.segment_bytes, crc)

    def prepare_segment(self, after: SegmentInfo) -> SegmentInfo | None:
        """Write, but do not persist, the header (and zeroed first record slot)
        of the segment that a roll over after `after` will take, so that the
        caller can persist it with a sync it makes anyway (a commit's).  Once
        persisted, `take_segment(after, prepared=...)` only has to write the
        superblock.  FORMAT.md §3.4 "Prepared header": a persisted header in
        a free segment is ignored or adopted by a reader, and holds no record.
        None when no segment is free."""
        try:
            i = self._next_free(after)
        except LogFullError:
            return None
        return self._write_header(i)

    def take_segment(self, after: SegmentInfo | None, *, prepared: SegmentInfo | None = None) -> SegmentInfo:
        """Roll over: take the next free segment (cyclically after `after`), give it a
        new salt and base_lsn, write and persist its header, then record it live in
        the superblock (FORMAT.md §3.4).  Raises LogFullError when none is free.

        prepared: a header from `prepare_segment(after)` that the caller has
        persisted since; when it is still the segment and chain position this
        roll over takes, only the superblock is written.  Otherwise its header
        is zeroed and persisted first (it must never be adopted), and the roll
        over goes the usual way."""
        sb = self._sb
        i = self._next_free(after)
        live = self.live_segments()
        prev = live[-1] if live else None
        if prepared is not None and not (
                prepared.index == i and prepared.seq == sb.next_segment_seq and prepared.base_lsn == sb.next_lsn
                and prev is not None and prev.seq == prepared.seq - 1
                and sb.segments[i].state == F.SEG_FREE and self._header_is(prepared, prev)):
            if sb.segments[prepared.index].state == F.SEG_FREE:
                self.zero_header(prepared.index)
            prepared = None
        if prepared is None:
            seg = self._write_header(i)
            self.backend.persist(seg.offset, F.SEGMENT_HEADER_SIZE + F.RECORD_HEADER_SIZE)
        else:
            seg = prepared
        entries = list(sb.segments)
        entries[i] = F.SegmentEntry(seg.base_lsn, seg.seq, seg.salt, F.SEG_LIVE, seg.header_crc)
        self._update(segments=tuple(entries), next_lsn=seg.base_lsn + sb.segment_bytes,
                     next_segment_seq=seg.seq + 1)
        return seg

    def _header_is(self, seg: SegmentInfo, prev: SegmentInfo) -> bool:
        """Whether the media still hold `seg`'s header, chained to `prev`, and its zero first slot."""
        off = seg.offset
        hdr, why = F.decode_segment_header(memoryview(self.backend.array[off:off + F.SEGMENT_HEADER_SIZE]))
        slot = self.backend.array[off + F.SEGMENT_HEADER_SIZE:off + F.SEGMENT_HEADER_SIZE + F.RECORD_HEADER_SIZE]
        return (why is None and hdr.header_crc == seg.header_crc and hdr.salt == seg.salt
                and hdr.prev_seq == prev.seq and hdr.prev_header_crc == prev.header_crc
                and not slot.any())

    def free_segments(self, indexes, *, invalidate: bool = False, **changes) -> None:
        """Mark segments free in one superblock write (with other `changes`).
        invalidate: also zero their headers afterwards, so they are never adopted
        again (used when cutting a tail; compaction keeps them readable)."""
        entries = list(self._sb.segments)
        for i in indexes:
            e = entries[i]
            entries[i] = F.SegmentEntry(e.base_lsn, e.seq, e.salt, F.SEG_FREE, e.header_crc)
        self._update(segments=tuple(entries), **changes)
        if invalidate:
            for i in indexes:
                self.zero_header(i)

    def zero_header(self, index: int, *, persist: bool = True) -> None:
        """Zero the header of free segment `index`, so that no open adopts it
        (FORMAT.md §3.2, §3.4).  persist=False: the caller persists the 256 bytes
        with a sync it makes anyway."""
        off = self.segment_offset(index)
        self._write(off, bytes(F.SEGMENT_HEADER_SIZE))
        if persist:
            self.backend.persist(off, F.SEGMENT_HEADER_SIZE)

    def reclaim_segments(self, before_lsn: int, *, keep_index: int | None = None, **changes) -> list[int]:
        """Free every live segment whose whole LSN range lies below `before_lsn`
        (never the newest live segment, nor `keep_index`), raise oldest_lsn to
        `before_lsn` and apply `changes` (SETTABLE fields), all in one atomic
        superblock write.  Returns the freed physical indexes."""
        bad = set(changes) - set(SETTABLE)
        if bad:
            raise UsageError(f"superblock fields {sorted(bad)} cannot be set")
        live = self.live_segments()
        newest = live[-1].index if live else None
        freed = [s.index for s in live
                 if s.end_lsn <= before_lsn and s.index not in (newest, keep_index)]
        changes = {k: int(v) for k, v in changes.items()}
        changes["oldest_lsn"] = max(self._sb.oldest_lsn, int(before_lsn), changes.get("oldest_lsn", 0))
        self.free_segments(freed, **changes)
        return freed

    def close(self) -> None:
        self.backend.close()
