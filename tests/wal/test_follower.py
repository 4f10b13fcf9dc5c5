"""`reader.Follower`, the tail of a live log, step by step in one process:
where it stands after each poll, when it leaves a segment, what it does with
a record in flight and with damage; and `Log.open(live=True)`'s second look
at damage found beside a writer."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal import log as log_mod
from concordia.wal.errors import CorruptionError, WalError
from concordia.wal.reader import Follower, Scanner

from .helpers import commit_pages

MiB = 1 << 20
PAGE = 4096


def _kinds(items):
    return [("rec", F.TYPE_NAMES[it.header.type & F.TYPE_MASK], it.header.epoch) if it[0] == 0 else ("dmg",) for it in items]


@pytest.fixture
def live(tmp_path):
    path = f"file:{tmp_path / 'f.log'}"
    log = Log.create(path, size=8 * MiB, segment_size=MiB)
    log.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
    reader = open_backend(path, readonly=True)
    yield log, reader
    reader.close()
    log.close()


def test_each_record_once_in_order_across_polls(live):
    log, reader = live
    f = Follower(reader)
    assert _kinds(f.poll()) == [("rec", "region", 0)]
    for e in (1, 2):
        commit_pages(log, e)
    assert _kinds(f.poll()) == [("rec", "page_batch", 1), ("rec", "commit", 1),
                                ("rec", "page_batch", 2), ("rec", "commit", 2)]
    assert f.poll() == []
    commit_pages(log, 3)
    assert _kinds(f.poll()) == [("rec", "page_batch", 3), ("rec", "commit", 3)]
    assert f.lsn == log.appender.write_lsn


def test_a_segment_is_left_only_after_a_commit_in_the_next_one(live, monkeypatch):
    # the reported loss: the next segment's header, prepared by a commit, is adopted by
    # the reader while the writer still appends to the old segment; a follower that
    # read the old segment's end, then the next segment with new records in it, skipped
    # the old segment's last records.  Here the writer runs right after the follower has
    # read the old segment in a poll, as a racing writer can.
    log, reader = live
    e = 0
    while log.appender.pos + 3 * F.page_batch_length(8, PAGE) < log.appender.seg.offset + MiB:
        e += 1
        commit_pages(log, e)
    f = Follower(reader)
    f.poll()
    assert log.appender._prepared is not None  # the next header is on the media, in a free segment
    assert len(f.volume.live_segments()) == 2  # ...and a reader takes it in
    real = Scanner._segment
    ran = []

    def racing(self, seg, start=None, **kw):
        out = real(self, seg, start, **kw)
        if seg.index == 0 and not ran:  # the writer finishes segment 0 and commits in segment 1
            ran.append(True)
            for k in range(1, 5):
                commit_pages(log, e + k)
        return out

    monkeypatch.setattr(Scanner, "_segment", racing)
    got = f.poll() + f.poll()
    monkeypatch.undo()
    got += f.poll()
    assert [k[2] for k in _kinds(got) if k[1] == "commit"] == [e + 1, e + 2, e + 3, e + 4]
    assert log.appender.seg.index == 1  # the epochs did run into the next segment


def test_a_record_in_flight_is_waited_for_and_damage_behind_the_writer_is_shown(live):
    log, reader = live
    commit_pages(log, 1)
    f = Follower(reader)
    f.poll()
    lsn = commit_pages(log, 2)
    seg = log.appender.seg
    # tear epoch 2's batch: the writer could still be writing it
    off = next(r.offset for r in log.records() if r.epoch == 2 and r.kind == F.REC_PAGE_BATCH)
    arr = log.backend.array
    saved = arr[off + 200:off + 208].copy()
    arr[off + 200:off + 208] ^= 0xFF
    assert f.poll() == []  # not shown, not skipped: looked at again next time
    arr[off + 200:off + 208] = saved  # the write completes
    assert _kinds(f.poll()) == [("rec", "page_batch", 2), ("rec", "commit", 2)]
    assert f.lsn > lsn and seg.index == 0


def test_a_new_format_under_the_follower_is_an_error(live, tmp_path):
    log, reader = live
    f = Follower(reader)
    f.poll()
    log.close()
    Log.create(f"file:{tmp_path / 'f.log'}", size=8 * MiB, segment_size=MiB, overwrite=True).close()
    with pytest.raises(WalError, match="formatted again"):
        f.poll()


def test_a_live_open_looks_again_at_damage(monkeypatch, tmp_path):
    path = f"file:{tmp_path / 'l.log'}"
    with Log.create(path, size=8 * MiB, segment_size=MiB) as log:
        log.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
        commit_pages(log, 1)
    real = log_mod.recover
    calls = []

    def flaky(vol, mode, reporter, **kw):
        calls.append(1)
        if len(calls) == 1:  # the first walk passed a record while it was being written
            raise CorruptionError("record header CRC mismatch", where="segment 0 @ 0x1000")
        return real(vol, mode, reporter, **kw)

    monkeypatch.setattr(log_mod, "recover", flaky)
    with Log.open(path, writable=False, live=True) as lg:
        assert lg.last_committed_epoch == 1 and len(calls) == 2

    def broken(vol, mode, reporter, **kw):
        calls.append(1)
        raise CorruptionError("record header CRC mismatch", where="segment 0 @ 0x1000")

    calls.clear()
    monkeypatch.setattr(log_mod, "recover", broken)
    with pytest.raises(CorruptionError):  # the same damage twice: it stands
        Log.open(path, writable=False, live=True)
    assert len(calls) == 2
    with pytest.raises(WalError, match="read-only"):
        Log.open(path, writable=True, live=True)


def test_a_writer_reopening_the_log_cuts_what_the_follower_showed_after_the_last_commit(tmp_path):
    path = f"file:{tmp_path / 'c.log'}"
    log = Log.create(path, size=8 * MiB, segment_size=MiB)
    log.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
    end1 = commit_pages(log, 1)
    log.appender.append_page_batch(2, 0, np.arange(4, dtype=np.uint32), np.full((4, PAGE), 2, np.uint8))
    log.appender.sync()  # a writer that dies here: epoch 2 has records, no commit
    reader = open_backend(path, readonly=True)
    f = Follower(reader)
    assert _kinds(f.poll())[-1] == ("rec", "page_batch", 2)
    log.volume.close()  # the writer is gone (nothing more written)
    with Log.open(path, writable=True) as again:  # the next writer cuts epoch 2 and writes its own
        again.appender.append_page_batch(2, 0, np.arange(1, dtype=np.uint32), np.full((1, PAGE), 9, np.uint8))
        again.appender.commit(2, digests={0: 0})
    got = f.poll()
    assert f.cuts == 1 and f.cut_at > end1
    assert _kinds(got) == [("rec", "page_batch", 2), ("rec", "commit", 2)]
    assert got[0].header.count == 1  # the new writer's one-page batch, not the dead writer's four
    reader.close()
