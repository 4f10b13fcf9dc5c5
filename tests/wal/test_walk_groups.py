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


def _walk(img: bytes, check_pages) -> list:
    vol = Volume.open(MemoryBackend.from_bytes(img))
    return [(it.tag, it.seg.index, it.offset, it.length, getattr(it, "reason", None))
            for it in Scanner(vol, check_pages=check_pages).items(ScanResult())]


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
    whole = _walk(img, True)
    segments = len({w[1] for w in whole})
    assert segments >= 4 and calls == [sum(calls)]         # every segment's batches in one call
    calls.clear()
    monkeypatch.setattr(reader, "WALK_GROUP_BYTES", 1)
    assert _walk(img, True) == whole and len(calls) == segments


def test_rows_copies_the_spans_a_stack_would():
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    offsets = [0, 17, 4096, 60000]
    got = reader._rows(memoryview(buf), offsets, 700)
    assert got.shape == (4, 700) and np.array_equal(got, np.stack([buf[o:o + 700] for o in offsets]))
    assert reader._rows(memoryview(buf), offsets, 0).shape == (4, 0)
    assert reader._rows(memoryview(buf), [], 64).shape == (0, 64)
