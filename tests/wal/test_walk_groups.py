"""A walk checks the page tables and pages of a group of segments together
(`Scanner._segments`, WALK_GROUP_BYTES), in a few numpy and helper calls for
the group: each such call lets go of the GIL and, beside a thread running
Python, waits up to a switch interval to get it back.  What the walk finds is
the same whatever the grouping: every record's checks are its own."""

from __future__ import annotations

import numpy as np
import pytest

import concordia.wal.reader as reader
from concordia.devmem import MemoryBackend
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.modes import RecoveryMode
from concordia.wal.planner import plan
from concordia.wal.reader import ScanResult, Scanner
from concordia.wal.volume import Volume

from .helpers import build_log, image


def _batches(log) -> list:
    """(segment index, offset, page count) of every page batch, in log order."""
    out = []
    for it in Scanner(log.volume, check_pages=True).items(ScanResult()):
        if it.tag == 0 and it.header.type == F.REC_PAGE_BATCH:
            out.append((it.seg.index, it.offset, it.header.count))
    return out


def _damaged_image(log) -> bytes:
    """The log's bytes with one page table and one payload byte flipped, in
    page batches of two different segments past the first."""
    img = image(log.backend)
    found = _batches(log)
    segs = sorted({s for s, _, _ in found})
    assert len(segs) >= 4, "the log spans too few segments for the test"
    in_seg = {s: [(o, c) for t, o, c in found if t == s] for s in segs}
    off, count = in_seg[segs[1]][1]
    img[off + F.RECORD_HEADER_SIZE + 8 * count - 1] ^= 0x40           # its page CRC table (V-P3)
    off, count = in_seg[segs[3]][0]
    img[off + F.page_batch_payload_offset(count) + 5] ^= 0x01         # a payload byte (V-P5)
    return bytes(img)


def _walk(img: bytes, check_pages, **kw) -> list:
    vol = Volume.open(MemoryBackend.from_bytes(img))
    res = ScanResult()
    items = [(it.tag, it.seg.index, it.offset, it.length, getattr(it, "reason", None))
             for it in Scanner(vol, check_pages=check_pages).items(res, **kw)]
    return items + [("bad segments", sorted(res.bad_segments))]


def _plan(img: bytes) -> str:
    return plan(Log.open(MemoryBackend.from_bytes(img), writable=False, mode=RecoveryMode.SKIP_CORRUPT)).to_json()


@pytest.mark.parametrize("check_pages", [True, False])
def test_the_walk_finds_the_same_items_and_damage_whatever_its_groups(monkeypatch, check_pages):
    log, _, _ = build_log(epochs=200, size=16 << 20)
    img = _damaged_image(log)
    seg_bytes = log.volume.live_segments()[0].nbytes
    walks = {}
    for per in (1, 2, 3, 1 << 40):   # segments a group: one (a walk a segment at a time), ..., all
        monkeypatch.setattr(reader, "WALK_GROUP_BYTES", per * seg_bytes if per < 1 << 40 else per)
        walks[per] = _walk(img, check_pages)
    assert walks[1] == walks[2] == walks[3] == walks[1 << 40]
    damage = [w for w in walks[1] if w[0] == 1]
    assert any("CRC" in (w[4] or "") for w in damage)     # the table the first flip broke
    if check_pages:
        assert len(damage) >= 2                            # ... and the payload the second broke
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1 << 40)
    grouped = _plan(img)
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1)
    assert _plan(img) == grouped


def test_a_group_checks_its_tables_in_one_pass(monkeypatch):
    log, _, _ = build_log(epochs=200, size=16 << 20)
    img = bytes(image(log.backend))
    calls = []
    real = reader.Scanner._check_tables
    monkeypatch.setattr(reader.Scanner, "_check_tables",
                        lambda self, out, batches: calls.append(len(batches)) or real(self, out, batches))
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1 << 40)
    whole = _walk(img, True)[:-1]
    segments = len({w[1] for w in whole})
    assert segments >= 4 and calls == [sum(calls)]         # every segment's batches in one call
    calls.clear()
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1)
    assert _walk(img, True)[:-1] == whole and len(calls) == segments


def test_rows_copies_the_spans_a_stack_would():
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    offsets = [0, 17, 4096, 60000]
    got = reader._copied_rows(memoryview(buf), offsets, 700)
    assert got.shape == (4, 700) and np.array_equal(got, np.stack([buf[o:o + 700] for o in offsets]))
    assert reader._copied_rows(memoryview(buf), offsets, 0).shape == (4, 0)
    assert reader._copied_rows(memoryview(buf), [], 64).shape == (0, 64)


def test_a_bad_segment_header_and_a_walk_from_or_until_an_lsn_find_the_same_whatever_the_groups(monkeypatch):
    log, _, _ = build_log(epochs=200, size=16 << 20)
    segs = log.volume.live_segments()
    img = bytearray(_damaged_image(log))
    img[segs[4].offset + 8] ^= 0x10            # segment 4's header: the whole segment one damaged range
    img = bytes(img)
    seg_bytes = segs[0].nbytes
    mid = segs[6].base_lsn + 4096
    for kw in ({}, {"from_lsn": mid}, {"start_lsn": segs[2].base_lsn + 64}):
        walks = []
        for per in (1, 3, 1 << 40):
            monkeypatch.setattr(reader, "WALK_GROUP_BYTES", per * seg_bytes)
            walks.append(_walk(img, True, **kw))
        assert walks[0] == walks[1] == walks[2], kw
        assert walks[0][-1] == ("bad segments", [4]) or kw.get("from_lsn")
    # a consumer that stops at until_lsn meets the same items up to it, with no later segment walked
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1 << 40)
    whole = _walk(img, True)[:-1]
    vol = Volume.open(MemoryBackend.from_bytes(img))
    lsn = [s.lsn(o) for s, o in ((vol.live_segments()[w[1]], w[2]) for w in whole)]
    before = [w for w, at in zip(whole, lsn) if at < mid]
    res = ScanResult()
    got = []
    for it in Scanner(vol, check_pages=True).items(res, until_lsn=mid):
        if it.seg.lsn(it.offset) >= mid:
            break
        got.append((it.tag, it.seg.index, it.offset, it.length, getattr(it, "reason", None)))
    assert got == before and res.segments[-1].base_lsn == segs[6].base_lsn   # the one holding it, the last


def test_a_walk_until_an_lsn_in_a_segment_with_a_bad_header_ends_with_that_segment():
    log, _, _ = build_log(epochs=200, size=16 << 20)
    segs = log.volume.live_segments()
    img = bytearray(image(log.backend))
    img[segs[6].offset + 8] ^= 0x10
    vol = Volume.open(MemoryBackend.from_bytes(bytes(img)))
    res = ScanResult()
    items = list(Scanner(vol, check_pages=False).items(res, until_lsn=segs[6].base_lsn + 4096))
    assert res.bad_segments == {6} and res.segments[-1].base_lsn == segs[6].base_lsn
    assert items[-1].tag == 1 and items[-1].seg.index == 6   # the bad segment, one damaged range, the last
