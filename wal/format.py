"""Pure codecs for the bytes of a Concordia volume.

Everything here mirrors `wal/FORMAT.md` (the single source of truth): each
structure is one `struct.Struct` defined once, citing its FORMAT.md section.
No function here does I/O; the volume, appender and reader do.  Decoders treat
their input as untrusted: every length, count and offset is checked against the
buffer before it is used, and nothing is allocated from an unchecked length.

Byte order is little-endian throughout.  CRC32C is Castagnoli (init 0xFFFFFFFF,
reflected, final xor 0xFFFFFFFF), computed by the `crc32c` package, and per page
of a batch by `pagecrc` (many pages per call).
"""

from __future__ import annotations

import functools
import operator
import re
import struct
from typing import NamedTuple

import numpy as np
from crc32c import crc32c as _crc32c

from . import pagecrc as _pagecrc
from .errors import CorruptionError, UsageError, WalError

# --------------------------------------------------------------------------
# Checksums (FORMAT.md §1)


def crc32c(data, value: int = 0) -> int:
    """CRC32C of `data` (bytes-like or C-contiguous numpy array), continuing
    from the CRC `value` of the bytes before it."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data)).cast("B")
    return _crc32c(data, value)


CRC_OF_EMPTY = 0  # crc32c(b"")

# --------------------------------------------------------------------------
# Constants (FORMAT.md §1, §2)

MAJOR_VERSION = 1  # superblock and segment header `major` (FORMAT.md §3.1, §4)
MINOR_VERSION = 0  # `minor`; any minor of the major is read (FORMAT.md §3.1)

#: incompat feature bit 0: region descriptors may name a logical dtype and
#: the framework of the region (FORMAT.md §2.3, §7)
FEATURE_LOGICAL_DTYPE = 0x1
#: incompat feature bit 1: the snapshot catalog may list an epoch's own page
#: batches as a region's base (an image entry, FORMAT.md §2.3, §12.2)
FEATURE_IMAGE_BASES = 0x2
#: feature bits this code understands (FORMAT.md §2.3)
KNOWN_COMPAT = 0
KNOWN_INCOMPAT = FEATURE_LOGICAL_DTYPE | FEATURE_IMAGE_BASES
KNOWN_RO_COMPAT = 0

VOLUME_MAGIC = b"CNCRDVOL"  # FORMAT.md §3.1
SEGMENT_MAGIC = b"CNCRDSEG"  # FORMAT.md §4

RECORD_ALIGN = 64  # records start 64-byte aligned, lengths are multiples of 64 (FORMAT.md §5.1)
SEGMENT_ALIGN = 1 << 20  # segments start and end on 1 MiB boundaries (FORMAT.md §2, V-B6)
SLOT_ALIGN = 4096  # slot_bytes = align(256 + 32*segment_count, 4096) (FORMAT.md §2)
MAX_PAGE_BYTES = 1 << 26  # 64 MiB (FORMAT.md §6.2 V-P1, §7.2 V-G4)
MAX_SEGMENTS = 1 << 20  # FORMAT.md §3.3 V-B2


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def align64(n: int) -> int:
    return (n + 63) & ~63


# --------------------------------------------------------------------------
# Superblock (FORMAT.md §3)

SUPERBLOCK = struct.Struct(
    "<8sIIQQQ16s"  # magic, major, minor, compat, incompat, ro_compat, uuid      0..56
    "QQQQQII"  # sequence, volume_bytes, slot_bytes, segments_off, segment_bytes,
    #            segment_count, flags                                         56..104
    "QQQQQQQQ"  # next_lsn, next_segment_seq, oldest_lsn, oldest_epoch,
    #             catalog_lsn, retain_epochs, retain_bytes, created_ns      104..168
    "84sI"  # reserved (zero), crc                                          168..256
)
SUPERBLOCK_SIZE = 256
SUPERBLOCK_CRC_OFF = 252  # the CRC covers [0, 252) and then the segment table (FORMAT.md §3.1)
SLOT_COUNT = 2  # slots A and B; sequence n lives in slot n % 2 (FORMAT.md §3)

# Segment table entry (FORMAT.md §3.2), SLOT_COUNT tables of segment_count entries
SEGMENT_ENTRY = struct.Struct("<QQIIII")  # base_lsn, seq, salt, state, header_crc, reserved
SEGMENT_ENTRY_SIZE = 32

SEG_FREE = 0  # entry `state` (FORMAT.md §3.2)
SEG_LIVE = 1


class Superblock(NamedTuple):
    """One decoded superblock slot (FORMAT.md §3).  `segments` is a list of
    SegmentEntry, one per physical segment."""

    uuid: bytes
    sequence: int
    volume_bytes: int
    slot_bytes: int
    segments_off: int
    segment_bytes: int
    segment_count: int
    next_lsn: int
    next_segment_seq: int
    oldest_lsn: int
    oldest_epoch: int
    catalog_lsn: int
    retain_epochs: int
    retain_bytes: int
    created_ns: int
    segments: tuple
    compat: int = 0
    incompat: int = 0
    ro_compat: int = 0
    major: int = MAJOR_VERSION
    minor: int = MINOR_VERSION
    flags: int = 0


class SegmentEntry(NamedTuple):
    base_lsn: int
    seq: int
    salt: int
    state: int
    header_crc: int


def slot_bytes_for(segment_count: int) -> int:
    """Bytes reserved for one superblock slot holding `segment_count` entries."""
    return align(SUPERBLOCK_SIZE + SEGMENT_ENTRY_SIZE * segment_count, SLOT_ALIGN)


def encode_superblock(sb: Superblock) -> bytes:
    """Superblock slot bytes (header + segment table), CRC filled in."""
    if len(sb.segments) != sb.segment_count:
        raise WalError(f"superblock has {len(sb.segments)} table entries for {sb.segment_count} segments")
    table = b"".join(
        SEGMENT_ENTRY.pack(e.base_lsn, e.seq, e.salt, e.state, e.header_crc, 0) for e in sb.segments
    )
    head = SUPERBLOCK.pack(
        VOLUME_MAGIC, sb.major, sb.minor, sb.compat, sb.incompat, sb.ro_compat, sb.uuid,
        sb.sequence, sb.volume_bytes, sb.slot_bytes, sb.segments_off, sb.segment_bytes,
        sb.segment_count, sb.flags,
        sb.next_lsn, sb.next_segment_seq, sb.oldest_lsn, sb.oldest_epoch,
        sb.catalog_lsn, sb.retain_epochs, sb.retain_bytes, sb.created_ns,
        bytes(84), 0,
    )
    crc = crc32c(table, crc32c(head[:SUPERBLOCK_CRC_OFF]))
    return head[:SUPERBLOCK_CRC_OFF] + struct.pack("<I", crc) + table


def decode_superblock(buf, *, where: str = "superblock") -> Superblock:
    """Decode and validate one slot (FORMAT.md §3.1-§3.3, conditions V-B1..V-B6
    and V-B9; V-B7 needs the slot's index and is checked by Volume.open).  Raises
    CorruptionError (or NotALogError / FormatVersionError) naming the problem."""
    from .errors import FormatVersionError, NotALogError

    # one copy: fields and CRC of one version, however the media change meanwhile (R-B4)
    buf = memoryview(buf if isinstance(buf, bytes) else bytes(memoryview(buf).cast("B")))
    if len(buf) < SUPERBLOCK_SIZE:
        raise CorruptionError(f"superblock truncated to {len(buf)} bytes", where=where)
    f = SUPERBLOCK.unpack_from(buf, 0)
    (magic, major, minor, compat, incompat, ro_compat, uuid, sequence, volume_bytes, slot_bytes,
     segments_off, segment_bytes, segment_count, flags, next_lsn, next_seq, oldest_lsn,
     oldest_epoch, catalog_lsn, retain_epochs, retain_bytes, created_ns, reserved, crc) = f
    if magic != VOLUME_MAGIC:  # V-B1
        if bytes(buf[:8]) == bytes(8):
            raise NotALogError("no volume magic (zero bytes)", where=where)
        raise NotALogError(f"bad volume magic {bytes(magic)!r}", where=where)
    if not (0 < segment_count <= MAX_SEGMENTS):  # V-B2, before the table is touched
        raise CorruptionError(f"segment count {segment_count} out of range", where=where)
    table_end = SUPERBLOCK_SIZE + SEGMENT_ENTRY_SIZE * segment_count
    if slot_bytes != slot_bytes_for(segment_count) or table_end > len(buf):
        raise CorruptionError(
            f"slot size {slot_bytes} does not hold {segment_count} segment entries", where=where)
    computed = crc32c(buf[SUPERBLOCK_SIZE:table_end], crc32c(buf[:SUPERBLOCK_CRC_OFF]))
    if computed != crc:  # V-B3
        raise CorruptionError(
            f"superblock CRC mismatch, stored 0x{crc:08x}, computed 0x{computed:08x}", where=where)
    if major != MAJOR_VERSION:  # V-B4
        raise FormatVersionError(f"volume major version {major}, this code reads {MAJOR_VERSION}",
                                 where=where, hint="upgrade Concordia")
    if incompat & ~KNOWN_INCOMPAT:
        raise FormatVersionError(f"unknown incompatible features 0x{incompat & ~KNOWN_INCOMPAT:x}",
                                 where=where, hint="upgrade Concordia")
    if any(reserved):  # V-B5
        raise CorruptionError("reserved superblock bytes are not zero", where=where)
    if (segment_bytes % SEGMENT_ALIGN or segment_bytes < SEGMENT_ALIGN
            or segments_off % SEGMENT_ALIGN or segments_off < 2 * slot_bytes
            or segments_off + segment_count * segment_bytes > volume_bytes):  # V-B6
        raise CorruptionError(
            f"geometry inconsistent: {segment_count} x {segment_bytes} bytes at 0x{segments_off:x} "
            f"in a {volume_bytes}-byte volume", where=where)
    rows = [SEGMENT_ENTRY.unpack_from(buf, SUPERBLOCK_SIZE + i * SEGMENT_ENTRY_SIZE) for i in range(segment_count)]
    for i, row in enumerate(rows):
        if row[5]:  # V-B5: the table's reserved words too
            raise CorruptionError(f"segment table entry {i}: reserved word is 0x{row[5]:08x}, not zero",
                                  where=where)
        if row[3] not in (SEG_FREE, SEG_LIVE):
            raise CorruptionError(f"segment table entry {i}: state {row[3]} is neither free (0) nor live (1)",
                                  where=where)
    entries = tuple(SegmentEntry(*row[:5]) for row in rows)
    live = [e for e in entries if e.state == SEG_LIVE]
    issued = max([segment_bytes] + [e.base_lsn + segment_bytes for e in live])
    if next_lsn < issued:  # V-B9: a writer would issue these LSNs again
        raise CorruptionError(
            f"next_lsn 0x{next_lsn:x} lies below 0x{issued:x}, which the volume has issued "
            f"(a writer would reuse LSNs)", where=where)
    if live and next_seq <= max(e.seq for e in live):
        raise CorruptionError(
            f"next_segment_seq {next_seq} is not above live segment seq {max(e.seq for e in live)}",
            where=where)
    for name, lsn in (("oldest_lsn", oldest_lsn), ("catalog_lsn", catalog_lsn)):
        if lsn > next_lsn:  # V-B9: what it states reclaimed, or its catalog, lies beyond any LSN issued
            raise CorruptionError(f"{name} 0x{lsn:x} lies beyond next_lsn 0x{next_lsn:x}, past every LSN issued",
                                  where=where)
    return Superblock(
        uuid=bytes(uuid), sequence=sequence, volume_bytes=volume_bytes, slot_bytes=slot_bytes,
        segments_off=segments_off, segment_bytes=segment_bytes, segment_count=segment_count,
        next_lsn=next_lsn, next_segment_seq=next_seq, oldest_lsn=oldest_lsn,
        oldest_epoch=oldest_epoch, catalog_lsn=catalog_lsn, retain_epochs=retain_epochs,
        retain_bytes=retain_bytes, created_ns=created_ns, segments=entries, compat=compat,
        incompat=incompat, ro_compat=ro_compat, major=major, minor=minor, flags=flags,
    )


# --------------------------------------------------------------------------
# Segment header (FORMAT.md §4)

_SEGMENT_HEADER_TO_PREV_SEQ = (
    "<8sIIQQQ16s"  # magic, major, minor, compat, incompat, ro_compat, uuid   0..56
    "QQQII"  # seq, base_lsn, segment_bytes, index, salt                    56..88
)
SEGMENT_HEADER = struct.Struct(
    _SEGMENT_HEADER_TO_PREV_SEQ
    + "QIIQ"  # prev_seq, prev_header_crc, reserved0, created_ns            88..112
    + "140sI"  # reserved (zero), header_crc                               112..256
)
SEGMENT_HEADER_SIZE = 256  # records start at offset 256 of a segment (FORMAT.md §4)
SEGMENT_HEADER_CRC_OFF = 252  # header_crc covers [0, 252) (FORMAT.md §4)
#: where prev_seq lies in a segment header (FORMAT.md §4; u64, little-endian): `segment_prev_seq`
SEGMENT_PREV_SEQ_OFF = struct.calcsize(_SEGMENT_HEADER_TO_PREV_SEQ)


class SegmentHeader(NamedTuple):
    uuid: bytes
    seq: int
    base_lsn: int
    segment_bytes: int
    index: int
    salt: int
    prev_seq: int
    prev_header_crc: int
    created_ns: int
    header_crc: int = 0
    compat: int = 0
    incompat: int = 0
    ro_compat: int = 0


def encode_segment_header(h: SegmentHeader) -> bytes:
    body = SEGMENT_HEADER.pack(
        SEGMENT_MAGIC, MAJOR_VERSION, MINOR_VERSION, h.compat, h.incompat, h.ro_compat, h.uuid,
        h.seq, h.base_lsn, h.segment_bytes, h.index, h.salt,
        h.prev_seq, h.prev_header_crc, 0, h.created_ns, bytes(140), 0,
    )
    crc = crc32c(body[:SEGMENT_HEADER_CRC_OFF])
    return body[:SEGMENT_HEADER_CRC_OFF] + struct.pack("<I", crc)


def segment_prev_seq(arr, off: int) -> int:
    """The prev_seq word of the segment header at byte `off` of `arr`, read
    without decoding (or checking) the header: a scan for the segment that
    continues a chain (`Volume._adopt`) decodes only the headers whose word
    names the chain's last segment."""
    at = off + SEGMENT_PREV_SEQ_OFF
    return int.from_bytes(arr[at:at + 8], "little")


def decode_segment_header(buf) -> tuple[SegmentHeader | None, str | None]:
    """(header, None) when valid per FORMAT.md §4 V-S1..V-S2, else (None, reason).
    V-S3..V-S5 need the superblock: Volume.check_segment_header checks them.
    Decoded from one copy of the bytes: a writer beside a reader may be
    writing the header of a segment it takes into use (R-B4's reason)."""
    buf = memoryview(bytes(memoryview(buf).cast("B")[:SEGMENT_HEADER_SIZE]))
    if len(buf) < SEGMENT_HEADER_SIZE:
        return None, "segment header truncated"
    f = SEGMENT_HEADER.unpack_from(buf, 0)
    (magic, major, minor, compat, incompat, ro_compat, uuid, seq, base_lsn, segment_bytes, index,
     salt, prev_seq, prev_crc, reserved0, created_ns, reserved, crc) = f
    if magic != SEGMENT_MAGIC:
        return None, ("segment header is zero" if not any(buf[:SEGMENT_HEADER_SIZE])
                      else f"bad segment magic {bytes(magic)!r}")
    computed = crc32c(buf[:SEGMENT_HEADER_CRC_OFF])
    if computed != crc:
        return None, f"segment header CRC mismatch, stored 0x{crc:08x}, computed 0x{computed:08x}"
    if major != MAJOR_VERSION or incompat & ~KNOWN_INCOMPAT:
        return None, f"segment needs major version {major} / features 0x{incompat:x}"
    if reserved0 or any(reserved):
        return None, "reserved segment header bytes are not zero"
    return SegmentHeader(bytes(uuid), seq, base_lsn, segment_bytes, index, salt, prev_seq,
                         prev_crc, created_ns, crc, compat, incompat, ro_compat), None


# --------------------------------------------------------------------------
# Record header (FORMAT.md §5; docs/internals.md "WAL record layout")

RECORD_HEADER = struct.Struct("<QBBHIQQIIIIQII")
RECORD_HEADER_SIZE = 64
RECORD_HEADER_CRC_OFF = 60  # header_crc covers [0, 60) (FORMAT.md §5.1)

# offsets of the fields (FORMAT.md §5.1), for byte-poking tests; gpu_kernels/stage.cu
# writes the same words (tests/wal/test_format_spec.py holds the two together)
OFF_LENGTH, OFF_TYPE, OFF_FLAGS, OFF_RESERVED0, OFF_REGION = 0, 8, 9, 10, 12
OFF_LSN, OFF_EPOCH, OFF_SALT, OFF_BODY_CRC = 16, 24, 32, 36
OFF_COUNT, OFF_PAGE_BYTES, OFF_AUX, OFF_RESERVED1, OFF_HEADER_CRC = 40, 44, 48, 56, 60

#: the same header as a numpy record, for checking many headers at once
#: (tests/wal/test_format.py holds it equal to RECORD_HEADER)
RECORD_HEADER_DTYPE = np.dtype({
    "names": ["length", "type", "flags", "reserved0", "region_id", "lsn", "epoch", "salt", "body_crc",
              "count", "page_bytes", "aux", "reserved1", "header_crc"],
    "formats": ["<u8", "u1", "u1", "<u2", "<u4", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u4", "<u4"],
    "offsets": [OFF_LENGTH, OFF_TYPE, OFF_FLAGS, OFF_RESERVED0, OFF_REGION, OFF_LSN, OFF_EPOCH, OFF_SALT,
                OFF_BODY_CRC, OFF_COUNT, OFF_PAGE_BYTES, OFF_AUX, OFF_RESERVED1, OFF_HEADER_CRC],
    "itemsize": RECORD_HEADER_SIZE})

def record_headers_at(view: np.ndarray, offs: np.ndarray, lsn: int, salt: int, *, rows=None) -> tuple:
    """(headers, ok) of the record headers at `offs` (int64, ascending) of
    an extent `view` (uint8) whose first byte has LSN `lsn`: each as
    RECORD_HEADER_DTYPE, and whether each passes V-R2, V-R3 without the
    segment bound, V-R4 and V-R5 (FORMAT.md §5.5: its header CRC, its length
    a positive multiple of 64, its reserved bytes zero, its LSN and salt):
    the checks of `check_record_header_bytes` and a walk's placement, as
    arrays.  The caller keeps the offsets within the extent (V-R1).  rows:
    those headers' bytes, gathered already (an (n, 64) uint8 array:
    `pagecrc.walk_lengths(headers=True)`), not read from `view` again."""
    if rows is not None:
        if rows.shape != (offs.size, RECORD_HEADER_SIZE):
            raise UsageError(f"header rows of shape {rows.shape} for {offs.size} offsets of "
                             f"{RECORD_HEADER_SIZE}-byte headers")
        raw = rows
    elif offs.size and not (offs % RECORD_HEADER_SIZE).any():  # whole 64-byte rows: gathered a row at a time
        raw = view[:len(view) // RECORD_HEADER_SIZE * RECORD_HEADER_SIZE].reshape(-1, RECORD_HEADER_SIZE)[
            offs // RECORD_HEADER_SIZE]
    else:
        raw = view[offs[:, None] + np.arange(RECORD_HEADER_SIZE)]
    h = raw.view(RECORD_HEADER_DTYPE).reshape(-1)
    length = h["length"]
    ok = ((_pagecrc.page_crcs(raw[:, :RECORD_HEADER_CRC_OFF]) == h["header_crc"]) & (length >= RECORD_HEADER_SIZE)
          & (length % RECORD_ALIGN == 0) & (h["reserved0"] == 0) & (h["reserved1"] == 0)
          & (h["lsn"] == np.uint64(lsn) + offs.astype(np.uint64)) & (h["salt"] == salt))
    return h, ok


# record types (FORMAT.md §5.2)
TYPE_IGNORABLE = 0x80  # type bit 7: an unknown type may be skipped
TYPE_MASK = 0x7F

REC_PAGE_BATCH = 0x01  # FORMAT.md §6
REC_REGION = 0x02  # FORMAT.md §7
REC_COMMIT = 0x03  # FORMAT.md §8
REC_CATALOG = 0x04  # snapshot catalog (FORMAT.md §9, §12.2, written by wal.snapshot)
REC_SNAPSHOT = 0x05  # snapshot marker (FORMAT.md §9): reserved, version 1.0 writes none
REC_PAD = 0x7E  # FORMAT.md §5.4; always written with TYPE_IGNORABLE: 0xFE

TYPE_NAMES = {
    REC_PAGE_BATCH: "page_batch", REC_REGION: "region", REC_COMMIT: "commit",
    REC_CATALOG: "catalog", REC_SNAPSHOT: "snapshot", REC_PAD: "pad",
}

# record header `flags` (FORMAT.md §5.1)
FLAG_BASE = 0x01  # page batch: part of a base snapshot (FORMAT.md §12.1)
FLAG_ONE_SYNC = 0x02  # commit: persisted by the same sync as the records it counts (FORMAT.md §8, §10)
NO_REGION = 0xFFFFFFFF  # region_id of a record that concerns no region (FORMAT.md §5.1)


def counted_in_epoch(type_byte: int, flags: int) -> bool:
    """Whether a record counts in its epoch's commit (V-C4): pad, commit, region and
    snapshot records and BASE page batches do not (FORMAT.md §8, V-N1)."""
    kind = type_byte & 0x7F
    if kind == REC_PAGE_BATCH:
        return not flags & FLAG_BASE
    return kind not in (REC_PAD, REC_COMMIT, REC_REGION, REC_CATALOG, REC_SNAPSHOT)


def counted_in_epoch_mask(type_bytes: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """`counted_in_epoch` over arrays of type bytes and flags (bool array)."""
    kind = np.asarray(type_bytes) & 0x7F
    batch = (kind == REC_PAGE_BATCH) & ~(np.asarray(flags) & FLAG_BASE).astype(bool)
    other = ~np.isin(kind, (REC_PAGE_BATCH, REC_PAD, REC_COMMIT, REC_REGION, REC_CATALOG, REC_SNAPSHOT))
    return batch | other


class RecordHeader(NamedTuple):
    length: int
    type: int  # the full type byte, ignorable bit included
    flags: int
    region_id: int
    lsn: int
    epoch: int
    salt: int
    body_crc: int
    count: int
    page_bytes: int
    aux: int
    header_crc: int = 0

    @property
    def kind(self) -> int:
        return self.type & TYPE_MASK

    @property
    def ignorable(self) -> bool:
        return bool(self.type & TYPE_IGNORABLE)


def encode_record_header_into(dst, *, length, type, lsn, epoch, region_id=NO_REGION, salt,
                              body_crc, count, page_bytes=0, aux=0, flags=0) -> None:
    """Write a 64-byte record header at dst[0:64] with its header CRC."""
    RECORD_HEADER.pack_into(dst, 0, length, type, flags, 0, region_id, lsn, epoch, salt,
                            body_crc, count, page_bytes, aux, 0, 0)
    mv = memoryview(dst).cast("B") if isinstance(dst, np.ndarray) else dst
    struct.pack_into("<I", dst, RECORD_HEADER_CRC_OFF, _crc32c(mv[:RECORD_HEADER_CRC_OFF]))


def encode_record_header(**fields) -> bytes:
    buf = bytearray(RECORD_HEADER_SIZE)
    encode_record_header_into(buf, **fields)
    return bytes(buf)


# RecordHeader's fields among RECORD_HEADER's: all but reserved0 (3) and reserved1 (12)
_RECORD_HEADER_FIELDS = operator.itemgetter(0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 13)
_new_tuple = tuple.__new__


def record_body(buf, offset: int, nbytes: int):
    """The first `nbytes` bytes of the body of the record at `offset` of `buf`
    (the bytes after its header, §5.1): a slice of `buf`, no copy."""
    lo = offset + RECORD_HEADER_SIZE
    return buf[lo:lo + nbytes]


def record_header_bytes(buf, offset: int):
    """The header of the record at `offset` of `buf` (§5.1), a slice of `buf`."""
    return buf[offset:offset + RECORD_HEADER_SIZE]


def decode_record_header(buf, off: int = 0, *, check: bool = True, where: str | None = None) -> RecordHeader:
    """Decode the 64-byte header (FORMAT.md §5.1) at buf[off:]; raises CorruptionError (at `where`,
    default `record @ 0xOFF`) when it runs past the buffer or the header CRC (V-R2)
    or reserved bytes (V-R4) are wrong.  Placement checks (length, LSN, salt) need
    the segment and are done by the reader.  check=False reads the fields as they
    stand, for a caller that checks them itself (the reader's walk tests placement
    first) or holds a header a walk has checked; the one way to a RecordHeader."""
    if check:
        problem = check_record_header_bytes(buf, off)
        if problem:
            raise CorruptionError(problem, where=where or f"record @ 0x{off:x}")
    return record_header_of(RECORD_HEADER.unpack_from(buf, off))


def record_header_of(fields: tuple) -> RecordHeader:
    """The RecordHeader of a header's fields as RECORD_HEADER unpacks them (a
    walk that unpacks each header once: `check_record_header_bytes(fields=)`)."""
    # tuple.__new__ is RecordHeader._make without its frame and length check (the Struct fixes both)
    return _new_tuple(RecordHeader, _RECORD_HEADER_FIELDS(fields))


def check_record_header_bytes(buf, off: int = 0, *, fields: tuple | None = None) -> str | None:
    """None when the header at buf[off:off+64] lies inside buf and passes V-R2..V-R4
    (length a positive multiple of 64; its bound in the segment, V-R3, and V-R1,
    V-R5 need the segment: the reader checks them), else the reason.  `fields`:
    the header as RECORD_HEADER unpacked it already (not unpacked again)."""
    if off < 0 or off + RECORD_HEADER_SIZE > len(buf):
        return "record header runs past the end of the buffer"
    f = RECORD_HEADER.unpack_from(buf, off) if fields is None else fields
    length, stored = f[0], f[13]
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    computed = _crc32c(mv[off:off + RECORD_HEADER_CRC_OFF])
    if computed != stored:
        return f"record header CRC mismatch, stored 0x{stored:08x}, computed 0x{computed:08x}"
    if length < RECORD_HEADER_SIZE or length % RECORD_ALIGN:
        return f"record length {length} is not a positive multiple of 64"
    if f[3] or f[12]:
        return "reserved record header bytes are not zero"
    return None


# --------------------------------------------------------------------------
# Generic records (FORMAT.md §5.3): body of `count` bytes right after the header


def record_length(body_bytes: int) -> int:
    return RECORD_HEADER_SIZE + align64(body_bytes)


def encode_record_into(dst, *, type, lsn, epoch, salt, body, region_id=NO_REGION, flags=0,
                       aux=0, page_bytes=0) -> int:
    """Write a record whose body is `body` (bytes-like) into dst (writable
    buffer or uint8 array, zero beyond the body up to the 64-byte boundary is
    written too).  Returns the record length."""
    body = memoryview(body).cast("B")
    n = len(body)
    length = record_length(n)
    if len(dst) < length:
        raise WalError(f"record of {length} bytes does not fit a {len(dst)}-byte buffer")
    mv = memoryview(dst).cast("B") if isinstance(dst, np.ndarray) else memoryview(dst)
    mv[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + n] = body
    mv[RECORD_HEADER_SIZE + n:length] = bytes(length - RECORD_HEADER_SIZE - n)
    encode_record_header_into(mv, length=length, type=type, lsn=lsn, epoch=epoch,
                              region_id=region_id, salt=salt, body_crc=_crc32c(body), count=n,
                              page_bytes=page_bytes, aux=aux, flags=flags)
    return length


def generic_body(buf, hdr: RecordHeader, off: int = 0) -> memoryview:
    """Body of a generic record (all types but the page batch); bounds-checked."""
    if RECORD_HEADER_SIZE + hdr.count > hdr.length:
        raise CorruptionError(f"body of {hdr.count} bytes does not fit a {hdr.length}-byte record",
                              where=f"record @ 0x{off:x}")
    mv = memoryview(buf).cast("B") if isinstance(buf, np.ndarray) else memoryview(buf)
    return mv[off + RECORD_HEADER_SIZE: off + RECORD_HEADER_SIZE + hdr.count]


# --------------------------------------------------------------------------
# Page batch (FORMAT.md §6)

MAX_BATCH_PAGES = 1 << 24  # FORMAT.md §6.2 V-P1


def page_batch_tables_bytes(count: int) -> int:
    """Index table + CRC table, padded so the payload is 64-byte aligned."""
    return align64(8 * count)


def page_batch_payload_offset(count: int) -> int:
    """Offset of the payload from the record start (FORMAT.md §6.1); of each
    count, given an integer array."""
    return RECORD_HEADER_SIZE + page_batch_tables_bytes(count)


def page_batch_index_offset(count: int) -> int:
    """Offset of the index table (u32 page ids) from the record start (FORMAT.md §6.1)."""
    return RECORD_HEADER_SIZE


def page_batch_crcs_offset(count: int) -> int:
    """Offset of the page CRC table (u32 per page, after the index table) from the record start."""
    return RECORD_HEADER_SIZE + 4 * count


def page_batch_length(count: int, page_bytes: int) -> int:
    """length = 64 + align64(8 * count) + count * page_bytes."""
    return RECORD_HEADER_SIZE + align64(8 * count) + count * page_bytes


def page_batch_max_pages(capacity: int, page_bytes: int) -> int:
    """The most pages of `page_bytes` one page batch of at most `capacity`
    bytes holds (0 when not even one page fits): the inverse of
    page_batch_length, used to cut batches that fit the segment they go into."""
    if capacity < RECORD_HEADER_SIZE or page_bytes <= 0:
        return 0
    n = min((capacity - RECORD_HEADER_SIZE) // (page_bytes + 8), MAX_BATCH_PAGES)
    while n > 0 and page_batch_length(n, page_bytes) > capacity:  # the table's padding
        n -= 1
    return n


def page_crcs_of(pages: np.ndarray) -> np.ndarray:
    """CRC32C of each row of a (count, page_bytes) uint8 array, as uint32 (all
    pages in one call where the compiled helper is available, see pagecrc.py)."""
    return _pagecrc.page_crcs(pages)


def _as_pages(pages, count: int, page_bytes: int) -> np.ndarray:
    arr = pages if isinstance(pages, np.ndarray) else np.frombuffer(pages, dtype=np.uint8)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8) if arr.flags.c_contiguous else np.ascontiguousarray(arr).view(np.uint8)
    if arr.size != count * page_bytes:
        raise WalError(f"pages hold {arr.size} bytes, expected {count} x {page_bytes}")
    return arr.reshape(count, page_bytes)


def check_page_batch_shape(count: int, page_bytes: int) -> None:
    """V-P1 (FORMAT.md §6.2): 1..MAX_BATCH_PAGES pages of a nonzero multiple of 64 bytes."""
    if count == 0 or count > MAX_BATCH_PAGES:
        raise WalError(f"a page batch holds 1..{MAX_BATCH_PAGES} pages, not {count}")
    if page_bytes <= 0 or page_bytes % RECORD_ALIGN or page_bytes > MAX_PAGE_BYTES:
        raise WalError(f"page_bytes {page_bytes} is not a positive multiple of 64")


def check_page_batch_ids(ids: np.ndarray, count: int) -> None:
    """V-P4 (FORMAT.md §6.2): page ids strictly increase, and fit the u32 index table."""
    if count > 1 and not np.all(ids[1:] > ids[:-1]):
        raise WalError("page ids of a batch must be strictly increasing")
    if ids[0] < 0 or ids[-1] > 0xFFFFFFFF:
        raise WalError("page ids must fit in u32")


def page_batch_tables_into(tables: np.ndarray, ids, crcs, count: int) -> None:
    """FORMAT.md §6.1: the index table, then the CRC table, into `tables` (bytes
    after the record header; the caller zeroes the padding)."""
    crcs = np.asarray(crcs, dtype=np.uint32)
    if crcs.size != count:
        raise WalError(f"{crcs.size} page CRCs for {count} pages")
    t32 = tables[:8 * count].view("<u4")
    t32[:count] = ids
    t32[count:] = crcs


def encode_page_batch_into(dst_u8, *, lsn, epoch, region_id, salt, page_ids, pages, page_bytes,
                           flags=0, page_crcs=None) -> int:
    """Write one page-batch record into `dst_u8` (a writable uint8 array, e.g.
    a Reservation's view) and return its length.

    page_ids: the page numbers (strictly increasing, any integer array).
    pages:    the page payloads, a C-contiguous uint8 array of shape
              (count, page_bytes) or any buffer of count * page_bytes bytes,
              page i at i * page_bytes; a region's short last page must be
              zero-padded by the caller.
    page_crcs: the CRC32C of each page when already known (e.g. computed on the
              GPU); computed here when None.
    """
    ids = np.asarray(page_ids)
    count = int(ids.size)
    check_page_batch_shape(count, page_bytes)
    check_page_batch_ids(ids, count)
    length = page_batch_length(count, page_bytes)
    if dst_u8.size < length:
        raise WalError(f"page batch of {length} bytes does not fit a {dst_u8.size}-byte reservation")
    src = _as_pages(pages, count, page_bytes)
    poff = page_batch_payload_offset(count)
    payload = dst_u8[poff:poff + count * page_bytes].reshape(count, page_bytes)
    if page_crcs is None:
        # each page hashed as it is copied: the CRCs are of the bytes as they now lie in the log
        crcs = _pagecrc.copy_page_crcs(payload, src)
    else:
        np.copyto(payload, src)
        crcs = page_crcs
    tables = dst_u8[RECORD_HEADER_SIZE:poff]
    page_batch_tables_into(tables, ids, crcs, count)
    tables[8 * count:] = 0
    body_crc = _crc32c(memoryview(tables[:8 * count]))
    encode_record_header_into(dst_u8, length=length, type=REC_PAGE_BATCH, lsn=lsn, epoch=epoch,
                              region_id=region_id, salt=salt, body_crc=body_crc, count=count,
                              page_bytes=page_bytes, flags=flags)
    return length


class PageBatch(NamedTuple):
    page_ids: np.ndarray  # uint32 (count,), a view into the record
    page_crcs: np.ndarray  # uint32 (count,), a view
    payload: np.ndarray  # uint8 (count, page_bytes), a view
    header: RecordHeader


def _u8(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def page_batch_shape_problem(hdr: RecordHeader, off: int, buf_len: int):
    """The checks of `page_batch_problem` that need the header alone (V-P1,
    V-P2 the length, the bounds of a buffer of `buf_len` bytes): None, or (reason,
    byte offset).  A reader that checks many records' tables at once
    (reader.py) makes these first, as page_batch_problem does."""
    count, pb = hdr.count, hdr.page_bytes
    if count == 0 or count > MAX_BATCH_PAGES:
        return f"page batch count {count} out of range", off + OFF_COUNT
    if pb == 0 or pb % RECORD_ALIGN or pb > MAX_PAGE_BYTES:
        return f"page_bytes {pb} is not a positive multiple of 64", off + OFF_PAGE_BYTES
    if page_batch_length(count, pb) != hdr.length:
        return (f"length {hdr.length} disagrees with {count} pages of {pb} bytes "
                f"(expected {page_batch_length(count, pb)})"), off
    if off + hdr.length > buf_len:
        return "page batch runs past the end of the buffer", off
    return None


def page_batch_tables_bad(rows: np.ndarray, count: int, body_crcs: np.ndarray) -> np.ndarray:
    """`page_batch_problem`'s table checks (V-P3 the table CRC, V-P4 the ids
    strictly increasing, the padding zero) for many page batches of `count`
    pages at once: `rows` holds each record's page_batch_tables_bytes(count)
    bytes after its header, `body_crcs` its header's body CRC; whether each
    fails (page_batch_problem then names why)."""
    tb = 8 * count
    bad = _pagecrc.page_crcs(rows[:, :tb]) != body_crcs
    if count > 1:
        ids = rows[:, :4 * count].view("<u4")
        bad |= ~np.all(ids[:, 1:] > ids[:, :-1], axis=1)
    if rows.shape[1] > tb:
        bad |= rows[:, tb:].any(axis=1)
    return bad


def page_batch_problem(buf, hdr: RecordHeader, off: int = 0, *, check_pages=True):
    """None when the page batch at buf[off:] satisfies FORMAT.md §6.2 (V-P1..V-P5),
    else (reason, byte offset of the problem relative to buf)."""
    problem = page_batch_shape_problem(hdr, off, len(buf))
    if problem is not None:
        return problem
    count, pb = hdr.count, hdr.page_bytes
    u8 = _u8(buf)
    tables = u8[off + RECORD_HEADER_SIZE: off + RECORD_HEADER_SIZE + 8 * count]
    body_crc = _crc32c(memoryview(tables))
    if body_crc != hdr.body_crc:
        return (f"page table CRC mismatch, stored 0x{hdr.body_crc:08x}, "
                f"computed 0x{body_crc:08x}"), off + RECORD_HEADER_SIZE
    t32 = tables.view("<u4")
    if count > 1 and not np.all(t32[1:count] > t32[:count - 1]):
        return "page ids are not strictly increasing", off + RECORD_HEADER_SIZE
    pad = u8[off + RECORD_HEADER_SIZE + 8 * count: off + page_batch_payload_offset(count)]
    if pad.any():
        return "page table padding is not zero", off + RECORD_HEADER_SIZE + 8 * count
    if check_pages:
        poff = off + page_batch_payload_offset(count)
        crcs = t32[count:]
        got = _pagecrc.page_crcs(u8[poff:poff + count * pb].reshape(count, pb))
        bad = np.flatnonzero(got != crcs)
        if bad.size:
            i = int(bad[0])
            more = f" (and {bad.size - 1} more pages)" if bad.size > 1 else ""
            return (f"page CRC mismatch for page {int(t32[i])}, stored 0x{int(crcs[i]):08x}, "
                    f"computed 0x{int(got[i]):08x}{more}"), poff + i * pb
    return None


def decode_page_batch(buf, off: int = 0, *, check_pages: bool = True) -> PageBatch:
    """Decode the page-batch record at buf[off:] with every checksum checked;
    the arrays returned are views into `buf` (no copy).  Raises CorruptionError."""
    hdr = decode_record_header(buf, off)
    if hdr.kind != REC_PAGE_BATCH:
        raise CorruptionError(f"record type 0x{hdr.type:02x} is not a page batch",
                              where=f"record @ 0x{off:x}")
    problem = page_batch_problem(buf, hdr, off, check_pages=check_pages)
    if problem:
        raise CorruptionError(problem[0], where=f"record @ 0x{problem[1]:x}")
    u8 = _u8(buf)
    count, pb = hdr.count, hdr.page_bytes
    t32 = u8[off + RECORD_HEADER_SIZE: off + RECORD_HEADER_SIZE + 8 * count].view("<u4")
    poff = off + page_batch_payload_offset(count)
    payload = u8[poff:poff + count * pb].reshape(count, pb)
    return PageBatch(t32[:count], t32[count:], payload, hdr)


def region_digest(page_crcs) -> int:
    """CRC32C over the u32 little-endian array of every page's CRC32C, in page order."""
    arr = np.ascontiguousarray(np.asarray(page_crcs, dtype="<u4"))
    return _crc32c(memoryview(arr).cast("B"))


# --------------------------------------------------------------------------
# Region descriptor (FORMAT.md §7)

REGION_BODY = struct.Struct("<HBBBBBBQ")  # name_len, dtype_len, kind_len, ndim, logical_len, framework, 0, nbytes
REGION_BODY_SIZE = 16
MAX_NAME = 1024  # name_len 1..1024 (FORMAT.md §7)
MAX_NDIM = 32  # ndim 0..32 (FORMAT.md §7)
# the patterns of FORMAT.md §7 (V-G2)
_DTYPE_RE = re.compile(r"^[<>|=]?[biufcV]\d{1,3}$")
_KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_LOGICAL_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
#: the `framework` byte of FORMAT.md §7: what the region was registered as
FRAMEWORKS = ("array", "torch")


class RegionInfo(NamedTuple):
    id: int
    name: str
    dtype: str  # numpy dtype string of the byte layout, e.g. "<f2" ("<u2" for bfloat16)
    shape: tuple
    page_bytes: int
    kind: str
    nbytes: int
    pages: int
    logical: str = ""  # logical dtype by name ("bfloat16", "float8_e4m3fn"); "" = the one `dtype` names
    framework: str = "array"  # "array" (numpy or CuPy) or "torch" (registered as a PyTorch tensor)

    @property
    def logical_dtype(self) -> str:
        """The logical dtype's name: `logical`, or numpy's name of `dtype` ("float16")."""
        return self.logical or dtype_name(self.dtype)


@functools.lru_cache(maxsize=256)
def layout_dtype(dtype: str) -> np.dtype:
    """numpy's dtype of a descriptor's layout string ("<u2"), parsed once (a
    recovery compares every region's target with it)."""
    return np.dtype(dtype)


@functools.lru_cache(maxsize=256)
def dtype_name(dtype) -> str:
    """numpy's name of a dtype or dtype string, kept (numpy works it out afresh each time: a model's
    170 regions, asked a few times each, made it milliseconds of a fresh process's recovery)."""
    return np.dtype(dtype).name


def region_pages(nbytes: int, page_bytes: int) -> int:
    return -(-nbytes // page_bytes)


def check_dtype(dtype) -> str:
    """The dtype as a numpy dtype string, refused unless it is a plain numeric type."""
    s = np.dtype(dtype).str if not isinstance(dtype, str) or not _DTYPE_RE.match(dtype) else dtype
    if not _DTYPE_RE.match(s):
        raise WalError(f"dtype {dtype!r} is not a plain numeric type")
    return s


def encode_region_body(name: str, dtype, shape, page_bytes: int, kind: str, *, logical: str = "",
                       framework: str = "array") -> bytes:
    """The body of a region descriptor (FORMAT.md §7).  A descriptor with a
    logical dtype or framework="torch" needs the LOGICAL_DTYPE feature in the
    volume (the caller sets it); without them it is the 1.0 layout."""
    nb = name.encode("utf-8")
    ds = check_dtype(dtype).encode("ascii")
    kb = kind.encode("ascii")
    lb = logical.encode("ascii") if logical else b""
    shape = tuple(int(s) for s in shape)
    if not (1 <= len(nb) <= MAX_NAME):
        raise WalError(f"region name must be 1..{MAX_NAME} bytes")
    if not _KIND_RE.match(kind):
        raise WalError(f"region kind {kind!r} must be a short lower-case word")
    if logical and not _LOGICAL_RE.match(logical):
        raise WalError(f"logical dtype {logical!r} must be a short lower-case name")
    if framework not in FRAMEWORKS:
        raise WalError(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
        raise WalError(f"bad region shape {shape}")
    if page_bytes <= 0 or page_bytes % RECORD_ALIGN or page_bytes > MAX_PAGE_BYTES:
        raise WalError(f"page_bytes {page_bytes} is not a positive multiple of 64")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(ds.decode()).itemsize
    if region_pages(nbytes, page_bytes) > 0xFFFFFFFF:
        raise WalError("region has more than 2**32 pages")
    return (REGION_BODY.pack(len(nb), len(ds), len(kb), len(shape), len(lb), FRAMEWORKS.index(framework), 0,
                             nbytes)
            + struct.pack(f"<{len(shape)}Q", *shape) + nb + ds + kb + lb)


def region_needs_feature(body) -> bool:
    """Whether a descriptor body uses the LOGICAL_DTYPE feature (FORMAT.md §7)."""
    return bool(body[4] or body[5])


def decode_region_body(body, region_id: int, page_bytes: int) -> RegionInfo:
    """Decode a region descriptor body (FORMAT.md §7.2 V-G1..V-G5); raises CorruptionError
    (without `where`: the caller adds it)."""
    body = memoryview(body).cast("B")
    if len(body) < REGION_BODY_SIZE:
        raise CorruptionError("region descriptor body too short")
    name_len, dtype_len, kind_len, ndim, logical_len, fw, r0, nbytes = REGION_BODY.unpack_from(body, 0)
    if r0:
        raise CorruptionError("reserved region descriptor bytes are not zero")
    if fw >= len(FRAMEWORKS):
        raise CorruptionError(f"region descriptor framework {fw} is not known")
    if ndim > MAX_NDIM or not (1 <= name_len <= MAX_NAME):
        raise CorruptionError(f"region descriptor ndim {ndim} / name length {name_len} out of range")
    need = REGION_BODY_SIZE + 8 * ndim + name_len + dtype_len + kind_len + logical_len
    if need != len(body):
        raise CorruptionError(f"region descriptor body is {len(body)} bytes, fields need {need}")
    shape = struct.unpack_from(f"<{ndim}Q", body, REGION_BODY_SIZE)
    p = REGION_BODY_SIZE + 8 * ndim
    q = p + name_len + dtype_len
    try:
        name = bytes(body[p:p + name_len]).decode("utf-8")
        dtype = bytes(body[p + name_len:q]).decode("ascii")
        kind = bytes(body[q:q + kind_len]).decode("ascii")
        logical = bytes(body[q + kind_len:need]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptionError(f"region descriptor text is not valid ({exc.reason})") from None
    if not _DTYPE_RE.match(dtype) or not _KIND_RE.match(kind) or (logical and not _LOGICAL_RE.match(logical)):
        raise CorruptionError(f"region descriptor dtype {dtype!r} / kind {kind!r} / logical dtype {logical!r} "
                              f"not allowed")
    if page_bytes <= 0 or page_bytes % RECORD_ALIGN or page_bytes > MAX_PAGE_BYTES:
        raise CorruptionError(f"region page_bytes {page_bytes} is not a positive multiple of 64")
    itemsize = np.dtype(dtype).itemsize
    total = itemsize
    for s in shape:
        total *= s
        if total > 1 << 62:
            raise CorruptionError("region shape too large")
    if total != nbytes:
        raise CorruptionError(f"region nbytes {nbytes} disagrees with shape {shape} of {dtype}")
    return RegionInfo(region_id, name, dtype, tuple(shape), page_bytes, kind, nbytes,
                      region_pages(nbytes, page_bytes), logical, FRAMEWORKS[fw])


# --------------------------------------------------------------------------
# Commit record (FORMAT.md §8)

COMMIT_BODY = struct.Struct("<QQQII")  # record_count, record_bytes, first_lsn, n_regions, 0
COMMIT_BODY_SIZE = 32
COMMIT_DIGEST = struct.Struct("<II")  # region_id, digest
COMMIT_DIGEST_SIZE = 8
MAX_COMMIT_REGIONS = 1 << 16  # FORMAT.md §8.2 V-C1


class CommitInfo(NamedTuple):
    epoch: int
    record_count: int
    record_bytes: int
    first_lsn: int
    digests: dict  # {region_id: digest}
    prev_commit_lsn: int
    lsn: int = 0


COMMIT_DIGEST_DTYPE = np.dtype([("region_id", "<u4"), ("digest", "<u4")])  # COMMIT_DIGEST as numpy


def encode_commit_body(record_count: int, record_bytes: int, first_lsn: int,
                       digests) -> bytes:
    """digests: {region_id: digest}, or a pair of arrays (region ids, digests)
    for many regions at once (ids distinct)."""
    if len(digests) > MAX_COMMIT_REGIONS:
        raise WalError(f"a commit names at most {MAX_COMMIT_REGIONS} regions")
    if isinstance(digests, tuple):
        ids, values = (np.asarray(a).astype(np.uint64) for a in digests)
        if ids.shape != values.shape or ids.ndim != 1 or len(ids) > MAX_COMMIT_REGIONS:
            raise WalError(f"a commit names at most {MAX_COMMIT_REGIONS} regions, as equal 1-D arrays of ids "
                           "and digests")
        order = np.argsort(ids, kind="stable")
        table = np.empty(ids.size, COMMIT_DIGEST_DTYPE)
        table["region_id"] = ids[order]
        table["digest"] = values[order] & 0xFFFFFFFF
        if ids.size > 1 and bool((table["region_id"][1:] == table["region_id"][:-1]).any()):
            raise WalError("a commit names a region twice")
        return COMMIT_BODY.pack(record_count, record_bytes, first_lsn, ids.size, 0) + table.tobytes()
    items = sorted((int(k), int(v) & 0xFFFFFFFF) for k, v in digests.items())
    return COMMIT_BODY.pack(record_count, record_bytes, first_lsn, len(items), 0) + b"".join(
        COMMIT_DIGEST.pack(k, v) for k, v in items)


def decode_commit_body(body, hdr: RecordHeader) -> CommitInfo:
    body = memoryview(body).cast("B")
    if len(body) < COMMIT_BODY_SIZE:
        raise CorruptionError("commit body too short")
    count, nbytes, first_lsn, n, r = COMMIT_BODY.unpack_from(body, 0)
    if r:
        raise CorruptionError("reserved commit bytes are not zero")
    if n > MAX_COMMIT_REGIONS or COMMIT_BODY_SIZE + n * COMMIT_DIGEST_SIZE != len(body):
        raise CorruptionError(f"commit names {n} regions in a {len(body)}-byte body")
    rows = np.frombuffer(body, COMMIT_DIGEST_DTYPE, n, COMMIT_BODY_SIZE)  # as arrays: a model names hundreds
    rids = rows["region_id"]
    down = np.flatnonzero(rids[1:] <= rids[:-1])
    if down.size:  # V-C1: region ids strictly increase
        prev, rid = int(rids[int(down[0])]), int(rids[int(down[0]) + 1])
        raise CorruptionError(f"commit digests not sorted: region {rid} after region {prev} (V-C1)")
    digests = dict(zip(rids.tolist(), rows["digest"].tolist()))
    return CommitInfo(hdr.epoch, count, nbytes, first_lsn, digests, hdr.aux, hdr.lsn)


# --------------------------------------------------------------------------
# Pad record (FORMAT.md §5.4): covers the unused end of a finished extent


def encode_pad_header_into(dst, *, length: int, lsn: int, epoch: int, salt: int) -> None:
    """Header only: the pad body is not checksummed and is normally zero."""
    encode_record_header_into(dst, length=length, type=REC_PAD | TYPE_IGNORABLE, lsn=lsn,
                              epoch=epoch, salt=salt, body_crc=0, count=0)


# --------------------------------------------------------------------------
# Batched page-CRC verification (FORMAT.md §6.2 V-P5, checked fast)
#
# crc(A + B) == Z_len(B)(crc(A)) ^ crc(B), where Z_n is the linear map "feed n
# zero bytes through the CRC register".  So the CRC of a whole payload follows
# from its per-page CRCs by a binary tree of such combines, vectorised over
# every record of a segment; one crc32c call per record over the payload then
# checks all its pages at memory speed.  A mismatch is narrowed to the page by
# the per-page check.

_ZTABLES: dict[int, np.ndarray] = {}


def _zero_shift_tables(nbytes: int) -> np.ndarray:
    """(4, 256) uint32 tables applying Z_nbytes one byte of the input at a time."""
    t = _ZTABLES.get(nbytes)
    if t is None:
        half = _ZTABLES.get(nbytes // 2) if nbytes % 2 == 0 else None
        unit = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))
        if half is not None:  # Z_2n = Z_n twice: no megabytes of zeros hashed for long records
            cols = _apply_z(half, _apply_z(half, unit))
        else:
            zeros = bytes(nbytes)
            base = _crc32c(zeros, 0)
            cols = np.array([_crc32c(zeros, 1 << i) ^ base for i in range(32)], dtype=np.uint32)
        k = np.arange(256, dtype=np.uint32)
        t = np.zeros((4, 256), dtype=np.uint32)
        for b in range(4):
            for j in range(8):
                t[b] ^= np.where((k >> j) & 1 == 1, cols[8 * b + j], np.uint32(0))
        _ZTABLES[nbytes] = t
    return t


def _apply_z(t: np.ndarray, x: np.ndarray) -> np.ndarray:
    return t[0][x & 0xFF] ^ t[1][(x >> 8) & 0xFF] ^ t[2][(x >> 16) & 0xFF] ^ t[3][x >> 24]


def _zshift(x: np.ndarray, nbytes: int) -> np.ndarray:
    return _apply_z(_zero_shift_tables(nbytes), x)


def fold_page_crcs(page_crcs: np.ndarray, page_bytes: int) -> np.ndarray:
    """CRC32C of each row's concatenated pages, from a (records, count) array of
    per-page CRCs (all pages page_bytes long): in one call of the page CRC
    helper, which releases the GIL (a restore's host checks fold 117M pages
    at 32k tokens x 8 of KV), or on numpy where it is not loaded."""
    x = np.ascontiguousarray(page_crcs, dtype=np.uint32)
    got = _pagecrc.fold_crcs(x, _zero_shift_tables(page_bytes)) if x.ndim == 2 and x.size else None
    return got if got is not None else fold_page_crcs_numpy(x, page_bytes)


def fold_page_crcs_numpy(page_crcs: np.ndarray, page_bytes: int) -> np.ndarray:
    """fold_page_crcs on numpy, pairs of neighbours at a time (the helper's
    twin: the same values)."""
    x = np.ascontiguousarray(page_crcs, dtype=np.uint32)
    r, n = x.shape
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:  # empty pages in front: crc(empty) == 0 and Z(0) == 0
        x = np.concatenate([np.zeros((r, size - n), np.uint32), x], axis=1)
    length = page_bytes
    while x.shape[1] > 1:
        x = x.reshape(r, -1, 2)
        x = _zshift(x[:, :, 0], length) ^ x[:, :, 1]
        length *= 2
    return x[:, 0].copy()
