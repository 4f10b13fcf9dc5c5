"""Struct sizes, golden bytes and decode cases for wal.format (FORMAT.md §3-§8).

crcmod is the independent CRC32C reference: every checksum the codecs write is
recomputed with it here."""

from __future__ import annotations

import struct

import crcmod.predefined
import numpy as np
import pytest

from concordia.wal import format as F
from concordia.wal.errors import CorruptionError, NotALogError, WalError

crc_ref = crcmod.predefined.mkCrcFun("crc-32c")


def test_struct_sizes():
    assert F.RECORD_HEADER.size == F.RECORD_HEADER_SIZE == 64
    from concordia.wal import pagecrc

    assert pagecrc.HEADER == F.RECORD_HEADER_SIZE  # the page helper sits below format, with its own name
    assert F.RECORD_ALIGN == pagecrc.HEADER and F.OFF_LENGTH == 0  # what pagecrc.walk_lengths reads
    body = np.arange(200, dtype=np.uint8)
    assert F.record_body(body, 8, 10).tolist() == list(range(72, 82))
    assert F.record_header_bytes(body, 8).tolist() == list(range(8, 72))
    assert F.SUPERBLOCK.size == F.SUPERBLOCK_SIZE == 256
    assert F.SEGMENT_HEADER.size == F.SEGMENT_HEADER_SIZE == 256
    assert F.SEGMENT_ENTRY.size == F.SEGMENT_ENTRY_SIZE == 32
    assert F.REGION_BODY.size == F.REGION_BODY_SIZE == 16
    assert F.COMMIT_BODY.size == F.COMMIT_BODY_SIZE == 32
    assert F.COMMIT_DIGEST.size == F.COMMIT_DIGEST_SIZE == 8
    assert F.SUPERBLOCK_CRC_OFF == F.SEGMENT_HEADER_CRC_OFF == 252
    assert F.RECORD_HEADER_CRC_OFF == 60
    assert F.slot_bytes_for(1) == 4096 and F.slot_bytes_for(120) == 4096
    assert F.slot_bytes_for(121) == 8192


def test_segment_header_prev_seq_word_is_where_the_chain_scan_reads_it():
    """`Volume._adopt` reads prev_seq (`segment_prev_seq`) before it decodes a header."""
    h = F.SegmentHeader(uuid=bytes(range(16)), seq=7, base_lsn=4096, segment_bytes=1 << 20, index=3,
                        salt=0xABCD, prev_seq=0x0102030405060708, prev_header_crc=9, created_ns=11)
    raw = np.frombuffer(bytes(100) + F.encode_segment_header(h), np.uint8)
    assert F.SEGMENT_PREV_SEQ_OFF == 88   # FORMAT.md §4
    assert F.segment_prev_seq(raw, 100) == h.prev_seq == F.decode_segment_header(raw[100:])[0].prev_seq


def test_record_header_field_offsets():
    """The offsets docs/internals.md fixes for GPU kernels."""
    raw = F.encode_record_header(length=0x1122334455667740, type=0x81, flags=0x01, region_id=0xAABBCCDD,
                                 lsn=0x0102030405060708, epoch=0x1112131415161718, salt=0x21222324,
                                 body_crc=0x31323334, count=0x41424344, page_bytes=0x51525340,
                                 aux=0x6162636465666768)
    u = lambda off, fmt: struct.unpack_from("<" + fmt, raw, off)[0]
    assert u(0, "Q") == 0x1122334455667740
    assert raw[8] == 0x81 and raw[9] == 0x01 and u(10, "H") == 0
    assert u(12, "I") == 0xAABBCCDD
    assert u(16, "Q") == 0x0102030405060708
    assert u(24, "Q") == 0x1112131415161718
    assert u(32, "I") == 0x21222324 and u(36, "I") == 0x31323334
    assert u(40, "I") == 0x41424344 and u(44, "I") == 0x51525340
    assert u(48, "Q") == 0x6162636465666768 and u(56, "I") == 0
    assert u(60, "I") == crc_ref(raw[:60])


def test_crc32c_matches_reference():
    rng = np.random.default_rng(1)
    for n in (0, 1, 63, 64, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert F.crc32c(data) == crc_ref(data)
    assert F.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert F.crc32c(b"56789", F.crc32c(b"1234")) == 0xE3069283
    assert F.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283


GOLDEN_HEADER = bytes.fromhex(
    "0001000000000000010000000700000000100000000000000300000000000000"
    "efbeadde88d6225802000000400000000000000000000000000000009ca30f03")
GOLDEN_TABLES = bytes.fromhex("0500000009000000eb366dfb41065dec")


def _golden_record():
    dst = np.zeros(F.page_batch_length(2, 64), np.uint8)
    pages = np.arange(128, dtype=np.uint8).reshape(2, 64)
    n = F.encode_page_batch_into(dst, lsn=0x1000, epoch=3, region_id=7, salt=0xDEADBEEF,
                                 page_ids=[5, 9], pages=pages, page_bytes=64)
    return n, dst, pages


def test_page_batch_golden_bytes():
    n, dst, pages = _golden_record()
    assert n == 256 == F.page_batch_length(2, 64) == 64 + 64 + 128
    raw = dst.tobytes()
    assert raw[:64] == GOLDEN_HEADER
    assert raw[64:80] == GOLDEN_TABLES
    assert raw[80:128] == bytes(48)
    assert raw[128:256] == pages.tobytes()
    # the same bytes built independently with crcmod
    c0, c1 = crc_ref(pages[0].tobytes()), crc_ref(pages[1].tobytes())
    tables = struct.pack("<IIII", 5, 9, c0, c1)
    assert tables == GOLDEN_TABLES
    head = struct.pack("<QBBHIQQIIIIQI", 256, 1, 0, 0, 7, 0x1000, 3, 0xDEADBEEF, crc_ref(tables), 2, 64, 0, 0)
    assert head + struct.pack("<I", crc_ref(head)) == GOLDEN_HEADER


def test_page_batch_decode_roundtrip():
    _, dst, pages = _golden_record()
    pb = F.decode_page_batch(dst)
    assert list(pb.page_ids) == [5, 9]
    assert (pb.payload == pages).all()
    assert pb.header.lsn == 0x1000 and pb.header.epoch == 3 and pb.header.salt == 0xDEADBEEF
    assert F.region_digest(pb.page_crcs) == crc_ref(pb.page_crcs.astype("<u4").tobytes())
    assert np.shares_memory(pb.payload, dst)  # views, no copy
    # from bytes too
    assert list(F.decode_page_batch(dst.tobytes()).page_ids) == [5, 9]


def _poke(dst, off, value, fix_header=True):
    d = dst.copy()
    d[off] ^= value
    if fix_header:  # recompute the header CRC so the deeper check is what fails
        struct.pack_into("<I", d, 60, crc_ref(d[:60].tobytes()))
    return d


@pytest.mark.parametrize("off,fix,expect", [
    (60, False, "record header CRC mismatch"),
    (0, False, "record header CRC mismatch"),
    (0, True, "not a positive multiple of 64"),          # length 256 ^ 1
    (10, True, "reserved record header bytes"),
    (40, True, "disagrees with 3 pages"),                  # count 2 -> 3
    (44, True, "page_bytes 0"),                            # 64 ^ 64 = 0
    (64, True, "page table CRC mismatch"),
    (100, True, "page table padding is not zero"),
    (130, True, "page CRC mismatch for page 5"),
    (200, True, "page CRC mismatch for page 9"),
])
def test_page_batch_damage(off, fix, expect):
    _, dst, _ = _golden_record()
    bad = _poke(dst, off, 0x40 if off in (44, 100) else 0x01, fix)
    with pytest.raises(CorruptionError, match=expect):
        F.decode_page_batch(bad)


def test_page_batch_ids_not_increasing_detected_even_with_crcs_fixed():
    _, dst, _ = _golden_record()
    d = dst.copy()
    struct.pack_into("<II", d, 64, 9, 5)
    body = crc_ref(d[64:80].tobytes())
    struct.pack_into("<I", d, 36, body)
    struct.pack_into("<I", d, 60, crc_ref(d[:60].tobytes()))
    with pytest.raises(CorruptionError, match="strictly increasing"):
        F.decode_page_batch(d)


def test_page_batch_truncated_buffer_is_refused():
    _, dst, _ = _golden_record()
    for cut in (0, 10, 63, 64, 100, 255):
        with pytest.raises(CorruptionError):
            F.decode_page_batch(dst[:cut])


def test_encode_refuses_bad_input():
    dst = np.zeros(4096, np.uint8)
    kw = dict(lsn=0, epoch=1, region_id=0, salt=1, page_bytes=64)
    with pytest.raises(WalError, match="strictly increasing"):
        F.encode_page_batch_into(dst, page_ids=[3, 3], pages=np.zeros((2, 64), np.uint8), **kw)
    with pytest.raises(WalError, match="multiple of 64"):
        F.encode_page_batch_into(dst, page_ids=[1], pages=np.zeros(100, np.uint8), **{**kw, "page_bytes": 100})
    with pytest.raises(WalError, match="expected 2 x 64"):
        F.encode_page_batch_into(dst, page_ids=[1, 2], pages=np.zeros(64, np.uint8), **kw)
    with pytest.raises(WalError, match="does not fit"):
        F.encode_page_batch_into(dst[:100], page_ids=[1], pages=np.zeros(64, np.uint8), **kw)


def test_given_page_crcs_are_used():
    pages = np.ones((3, 128), np.uint8)
    crcs = F.page_crcs_of(pages)
    a = np.zeros(F.page_batch_length(3, 128), np.uint8)
    b = np.zeros_like(a)
    kw = dict(lsn=64, epoch=1, region_id=0, salt=1, page_ids=[0, 1, 2], pages=pages, page_bytes=128)
    F.encode_page_batch_into(a, **kw)
    F.encode_page_batch_into(b, page_crcs=crcs, **kw)
    assert (a == b).all()
    assert [int(c) for c in crcs] == [crc_ref(bytes(pages[i])) for i in range(3)]


def test_generic_record_and_commit_roundtrip():
    body = F.encode_commit_body(5, 12345, 0x2000, {3: 0xAABBCCDD, 1: 7})
    dst = bytearray(F.record_length(len(body)))
    n = F.encode_record_into(dst, type=F.REC_COMMIT, lsn=0x3000, epoch=9, salt=4, body=body, aux=0x2800)
    assert n == 64 + 64 and len(body) == 32 + 16
    hdr = F.decode_record_header(dst)
    assert hdr.kind == F.REC_COMMIT and hdr.count == len(body) and hdr.body_crc == crc_ref(body)
    info = F.decode_commit_body(F.generic_body(dst, hdr), hdr)
    assert info.epoch == 9 and info.record_count == 5 and info.record_bytes == 12345
    assert info.digests == {1: 7, 3: 0xAABBCCDD} and info.prev_commit_lsn == 0x2800
    with pytest.raises(CorruptionError, match="commit names"):
        F.decode_commit_body(body[:-8], hdr)


def test_region_body_roundtrip_and_untrusted_fields():
    body = F.encode_region_body("kv.layer0", np.float16, (4, 1024, 8), 4096, "kv")
    info = F.decode_region_body(body, 3, 4096)
    assert info == F.RegionInfo(3, "kv.layer0", "<f2", (4, 1024, 8), 4096, "kv", 65536, 16)
    with pytest.raises(CorruptionError):
        F.decode_region_body(body[:-1], 3, 4096)
    evil = bytearray(body)
    evil[0:2] = struct.pack("<H", 60000)  # name length far beyond the body
    with pytest.raises(CorruptionError, match="out of range|fields need"):
        F.decode_region_body(bytes(evil), 3, 4096)
    evil = bytearray(body)
    evil[8:16] = struct.pack("<Q", 1)  # nbytes disagrees
    with pytest.raises(CorruptionError, match="disagrees"):
        F.decode_region_body(bytes(evil), 3, 4096)
    with pytest.raises(WalError, match="plain numeric"):
        F.encode_region_body("x", "O", (1,), 64, "opaque")


def _superblock(**kw):
    base = dict(uuid=bytes(range(16)), sequence=1, volume_bytes=8 << 20, slot_bytes=4096,
                segments_off=1 << 20, segment_bytes=1 << 20, segment_count=3, next_lsn=1 << 20,
                next_segment_seq=1, oldest_lsn=0, oldest_epoch=0, catalog_lsn=0, retain_epochs=0,
                retain_bytes=0, created_ns=123,
                segments=tuple(F.SegmentEntry(0, 0, 0, F.SEG_FREE, 0) for _ in range(3)))
    base.update(kw)
    return F.Superblock(**base)


def test_superblock_roundtrip_and_crc():
    sb = _superblock()
    raw = F.encode_superblock(sb)
    assert len(raw) == 256 + 3 * 32
    crc = struct.unpack_from("<I", raw, 252)[0]
    assert crc == crc_ref(raw[:252] + raw[256:])
    assert F.decode_superblock(raw) == sb
    bad = bytearray(raw)
    bad[300] ^= 1
    with pytest.raises(CorruptionError, match="superblock CRC mismatch"):
        F.decode_superblock(bytes(bad))
    with pytest.raises(NotALogError):
        F.decode_superblock(bytes(len(raw)))


@pytest.mark.parametrize("field_off, value, words", [
    (28, 7, "segment table entry 1: reserved word is 0x00000007, not zero"),
    (20, 2, "segment table entry 1: state 2 is neither free (0) nor live (1)"),
])
def test_segment_table_reserved_word_and_state_are_checked(field_off, value, words):
    # FORMAT.md §1 and V-B5: a reader refuses reserved bytes that are not zero,
    # the segment table's included; a state other than free or live is refused
    # too (both under a valid CRC, i.e. written so by a writer, not torn)
    sb = _superblock()
    raw = bytearray(F.encode_superblock(sb))
    struct.pack_into("<I", raw, 256 + 32 + field_off, value)
    struct.pack_into("<I", raw, 252, crc_ref(bytes(raw[:252]) + bytes(raw[256:])))
    with pytest.raises(CorruptionError) as info:
        F.decode_superblock(bytes(raw))
    assert words in info.value.one_line()


def test_segment_header_roundtrip():
    h = F.SegmentHeader(bytes(16), 4, 0x400000, 1 << 20, 2, 0x1234, 3, 0xCAFE, 99)
    raw = F.encode_segment_header(h)
    assert len(raw) == 256 and struct.unpack_from("<I", raw, 252)[0] == crc_ref(raw[:252])
    got, why = F.decode_segment_header(raw)
    assert why is None and got._replace(header_crc=0) == h
    bad = bytearray(raw)
    bad[64] ^= 1
    assert F.decode_segment_header(bytes(bad)) == (None, F.decode_segment_header(bytes(bad))[1])
    assert "CRC mismatch" in F.decode_segment_header(bytes(bad))[1]


@pytest.mark.parametrize("fold", [F.fold_page_crcs, F.fold_page_crcs_numpy], ids=["helper", "numpy"])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 64, 100])
def test_fold_page_crcs_equals_payload_crc(count, fold):
    rng = np.random.default_rng(count)
    pages = rng.integers(0, 256, (3, count, 128), dtype=np.uint8)
    crcs = np.array([[crc_ref(pages[r, i].tobytes()) for i in range(count)] for r in range(3)], np.uint32)
    folded = fold(crcs, 128)
    assert [int(x) for x in folded] == [crc_ref(pages[r].tobytes()) for r in range(3)]
    crcs[1, count // 2] ^= 1
    assert fold(crcs, 128)[1] != folded[1]


@pytest.mark.parametrize("page_bytes", [64, 256, 4096, 1 << 20])
def test_the_helpers_fold_equals_its_numpy_twin(page_bytes):
    """The page CRC helper folds a row page after page, numpy pairs of
    neighbours: the same values for any count (a power of two or not), and
    the helper's path is the one taken where it is loaded."""
    from concordia.wal import pagecrc

    rng = np.random.default_rng(page_bytes)
    for count in (1, 2, 5, 16, 17, 1000, 4097):
        crcs = rng.integers(0, 1 << 32, (6, count), dtype=np.uint64).astype(np.uint32)
        want = F.fold_page_crcs_numpy(crcs, page_bytes)
        assert np.array_equal(F.fold_page_crcs(crcs, page_bytes), want)
        if pagecrc.native():
            assert np.array_equal(pagecrc.fold_crcs(crcs, F._zero_shift_tables(page_bytes)), want)
        else:
            assert pagecrc.fold_crcs(crcs, F._zero_shift_tables(page_bytes)) is None


def test_counted_in_epoch():
    assert F.counted_in_epoch(F.REC_PAGE_BATCH, 0)
    assert not F.counted_in_epoch(F.REC_PAGE_BATCH, F.FLAG_BASE)
    for t in (F.REC_COMMIT, F.REC_REGION, F.REC_CATALOG, F.REC_SNAPSHOT, F.REC_PAD | F.TYPE_IGNORABLE):
        assert not F.counted_in_epoch(t, 0)


def test_record_header_decoded_checked_or_as_it_stands():
    from concordia.wal.reader import Header

    assert Header is F.RecordHeader  # a walk's header is the format's, not a second layout
    raw = bytearray(F.encode_record_header(length=128, type=F.REC_COMMIT, lsn=0x40, epoch=3, region_id=7,
                                           salt=9, body_crc=0x55, count=48, page_bytes=0, aux=0x11))
    h = F.decode_record_header(raw)
    assert (h.length, h.type, h.region_id, h.lsn, h.epoch, h.salt, h.count, h.aux) == (128, F.REC_COMMIT, 7, 0x40,
                                                                                       3, 9, 48, 0x11)
    assert h == F.decode_record_header(raw, check=False)
    raw[F.OFF_EPOCH] ^= 1  # the header CRC no longer covers it
    with pytest.raises(CorruptionError, match=r"^segment 2 @ 0x1040: record header CRC mismatch"):
        F.decode_record_header(raw, where="segment 2 @ 0x1040")
    assert F.decode_record_header(raw, check=False).epoch == 2  # as it stands, for a caller that checks itself
    with pytest.raises(CorruptionError, match="runs past the end"):
        F.decode_record_header(raw, 32)
