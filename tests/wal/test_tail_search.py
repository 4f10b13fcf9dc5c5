"""The reads past a segment's last record: the search for valid records after
a gap (`Scanner._next_valid`, sliced over threads), a follower that stops at
the gap of a segment its writer is still filling, and the cut's zeroing of
the tail (`log._zero_tail`).  Each is held to what a plain one-slot-at-a-time
reading says."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.wal import format as F
from concordia.wal import log as log_mod
from concordia.wal import reader as reader_mod
from concordia.wal.reader import Follower, Scanner
from concordia.wal.volume import Volume
from tests.wal.helpers import commit_pages
from tests.wal.test_follower import live  # noqa: F401 (the fixture)



def _slow_next_valid(scanner, seg, start, end):
    """The definition: the first 64-byte slot from `start` whose header checks
    in place and whose record fits the segment."""
    for pos in range(start, end - F.RECORD_HEADER_SIZE + 1, 64):
        h = F.decode_record_header(scanner.mv, pos, check=False)
        if (h.length and h.lsn == seg.lsn(pos) and h.salt == seg.salt
                and F.check_record_header_bytes(scanner.mv, pos) is None
                and pos + h.length <= seg.offset + seg.nbytes):
            return pos
    return None


@pytest.mark.parametrize("chunk,threads", [(4096, 1), (4096, 3), (64 << 10, 2), (32 << 20, 1)])
def test_the_search_after_a_gap_finds_what_a_slot_by_slot_reading_finds(live, monkeypatch, chunk,
                                                                         threads):
    log, reader = live
    for e in range(1, 12):
        commit_pages(log, e)
    seg = log.appender.seg
    end_of_records = log.appender.pos
    arr = log.backend.array
    # the segment's tail: old bytes, among them headers of another incarnation (other salt)
    # and one slot that carries this segment's salt but not its LSN
    rng = np.random.default_rng(5)
    tail = seg.offset + seg.nbytes - end_of_records
    arr[end_of_records:end_of_records + tail] = rng.integers(0, 256, tail, dtype=np.uint8)
    first = Scanner(Volume.open(reader, writable=False), check_pages=False)._segment(seg)[1]
    stale = bytearray(F.record_header_bytes(arr, first.offset))
    arr[end_of_records + 4096:end_of_records + 4096 + 64] = np.frombuffer(bytes(stale), np.uint8)
    monkeypatch.setattr(reader_mod, "NEXT_VALID_CHUNK", chunk)
    monkeypatch.setattr(reader_mod, "CHECK_THREADS", threads)
    scanner = Scanner(Volume.open(reader, writable=False), check_pages=False)
    starts = [it.offset + 64 for it in scanner._segment(seg, to_gap=True)] + [
        seg.offset + F.SEGMENT_HEADER_SIZE, end_of_records, end_of_records - 64 * 7]
    found = 0
    for s in starts:
        got = scanner._next_valid(seg, s, seg.offset + seg.nbytes)
        assert got == _slow_next_valid(scanner, seg, s, seg.offset + seg.nbytes)
        found += got is not None
    assert found >= 10  # the starts inside the records find the next one; the tail finds none


def test_a_lost_record_is_found_across_slices(live, monkeypatch):
    log, reader = live
    for e in range(1, 9):
        commit_pages(log, e)
    items = Scanner(Volume.open(reader, writable=False), check_pages=False)._segment(log.appender.seg)
    lost = items[5]
    log.backend.array[lost.offset:lost.offset + 8] = 0   # its length word: a record lost here
    monkeypatch.setattr(reader_mod, "NEXT_VALID_CHUNK", 4096)
    monkeypatch.setattr(reader_mod, "CHECK_THREADS", 3)
    got = Scanner(Volume.open(reader, writable=False), check_pages=False)._segment(log.appender.seg)
    dmg = [it for it in got if it[0] == reader_mod._DMG]
    assert len(dmg) == 1 and dmg[0].offset == lost.offset
    assert dmg[0].length == items[6].offset - lost.offset
    assert "a record was lost" in dmg[0].reason


def test_a_follower_stops_at_the_gap_of_the_segment_being_written(live, monkeypatch):
    log, reader = live
    commit_pages(log, 1)
    f = Follower(reader)
    assert len(f.poll()) == 3   # region, batch, commit
    # the rest of the segment holds old bytes (a reused segment): a poll reads none of them
    arr = log.backend.array
    seg, pos = log.appender.seg, log.appender.pos
    arr[pos:seg.offset + seg.nbytes] = np.random.default_rng(1).integers(
        1, 256, seg.offset + seg.nbytes - pos, dtype=np.uint8)
    searched = []
    real = Scanner._next_valid
    monkeypatch.setattr(Scanner, "_next_valid", lambda self, *a: searched.append(a) or real(self, *a))
    assert f.poll() == [] and searched == []
    commit_pages(log, 2)
    got = f.poll()
    assert [it.header.epoch for it in got] == [2, 2] and searched == []
    # a full walk of the same segment still reads past its end to tell the end from a loss
    Scanner(Volume.open(reader, writable=False), check_pages=False)._segment(seg)
    assert searched


@pytest.mark.parametrize("threads", [1, 3])
def test_the_cut_zeroes_only_what_is_not_zero(monkeypatch, threads):
    monkeypatch.setattr(log_mod, "NEXT_VALID_CHUNK", 4096)
    monkeypatch.setattr(reader_mod, "CHECK_THREADS", threads)
    a = np.zeros(10 * 4096 + 100, np.uint8)
    a.flags.writeable = False   # a slice that is zero already is not written
    assert log_mod._zero_tail(a, 100, a.size) is False
    a = np.zeros(10 * 4096 + 100, np.uint8)
    a[50] = 7                    # before the cut: kept
    a[4096 * 3 + 9] = a[-1] = 1  # after it: zeroed
    assert log_mod._zero_tail(a, 100, a.size) is True
    assert a[50] == 7 and not a[100:].any()


def test_a_walk_started_at_a_record_boundary_inside_a_segment_is_the_rest_of_a_whole_walk(live, monkeypatch):
    log, reader = live
    for e in range(1, 9):
        commit_pages(log, e)
    vol = Volume.open(reader, writable=False)
    whole = list(Scanner(vol, check_pages=True).items())
    read = []
    monkeypatch.setattr(Scanner, "_walk", lambda self, seg, out, pending, start=None, to_gap=False: (
        read.append(start), _real_walk(self, seg, out, pending, start, to_gap))[1])
    for k in (3, 7, len(whole) - 1):
        at = whole[k].seg.lsn(whole[k].offset)
        assert whole[k].seg.base_lsn < at < whole[k].seg.end_lsn   # inside its segment
        read.clear()
        rest = list(Scanner(vol, check_pages=True).items(from_lsn=at, start_lsn=at))
        assert rest == whole[k:]
        assert read[0] == whole[k].offset   # that segment walked from there, not from its start


_real_walk = Scanner._walk
