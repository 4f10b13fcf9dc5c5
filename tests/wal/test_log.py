"""Round trips through the appender and reader: regions, commits, roll-over,
recycling, reservations and extents, reopen for writing."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.wal import Log, RecoveryMode
from concordia.wal import format as F
from concordia.wal.errors import (LogFullError, NotALogError, RecordTooLargeError, RegionError,
                                  UsageError)

from .helpers import MiB, build_log, replay


def test_roundtrip_many_epochs_across_segments():
    log, model, rid = build_log(epochs=60)
    assert len(log.volume.live_segments()) >= 3
    assert log.last_committed_epoch == 60
    v = log.verify()
    assert v["ok"] and v["commits"] == 60 and v["problems"] == []
    img = log.backend
    log2 = Log.open(img, writable=False)
    assert log2.last_committed_epoch == 60
    assert (replay(log2, model.npages, model.page_bytes) == model.state_after(60)).all()
    digests = [c.digests[rid] for c in log2.commits]
    assert digests == [model.digest(e) for e in range(1, 61)]
    assert log2.regions["r"].pages == model.npages and log2.regions["r"].kind == "opaque"
    lsns = [r.lsn for r in log2.records()]
    assert lsns == sorted(lsns) and len(set(lsns)) == len(lsns)


def test_reopen_for_write_continues_and_chains():
    log, model, rid = build_log(epochs=10)
    b = log.backend
    log2 = Log.open(b, writable=True)
    assert log2.regions["r"].id == rid
    for e in range(11, 21):
        model.write_epoch(log2, rid, e)
    log3 = Log.open(b, writable=False)
    assert log3.last_committed_epoch == 20 and log3.dropped == []
    assert (replay(log3, model.npages, model.page_bytes) == model.state_after(20)).all()


def test_recycled_segment_gets_new_salt_and_stale_bytes_are_rejected():
    log, model, rid = build_log(epochs=60, size=5 * MiB)
    vol = log.volume
    live = vol.live_segments()
    old = {s.index: s.salt for s in live}
    # compaction's move: reclaim every segment but the newest, then keep writing
    freed = vol.reclaim_segments(live[-1].base_lsn, oldest_epoch=1)
    assert freed == [s.index for s in live[:-1]]
    assert vol.superblock.oldest_lsn == live[-1].base_lsn
    for e in range(61, 121):
        model.write_epoch(log, rid, e)
    reused = [s for s in vol.live_segments() if s.index in freed]
    assert reused and all(s.salt != old[s.index] for s in reused)
    lsns = [s.base_lsn for s in vol.live_segments()]
    assert lsns == sorted(lsns) and lsns[0] >= live[-1].base_lsn
    log2 = Log.open(log.backend, writable=False)
    assert log2.last_committed_epoch == 120
    assert not [d for d in log2.dropped if d.kind == "corrupt"]
    # replay from the oldest live LSN: only epochs after the reclaim point are there,
    # so compare just the pages those epochs wrote
    epochs = sorted({r.epoch for r in log2.records() if r.kind == F.REC_PAGE_BATCH})
    assert epochs[-1] == 120 and epochs[0] > 1


def test_log_full_and_record_too_large():
    log, model, rid = build_log(epochs=1, size=3 * MiB)
    with pytest.raises(RecordTooLargeError):
        log.appender.reserve(MiB)
    with pytest.raises(LogFullError, match="compact"):
        for e in range(2, 1000):
            model.write_epoch(log, rid, e)


def test_reservation_extent_and_pad():
    log = Log.create(open_backend("memory:", size=4 * MiB), segment_size=MiB)
    rid = log.define_region("x", np.uint8, (16 * 256,), 256, "kv")
    app = log.appender
    pages = np.arange(2 * 256, dtype=np.uint32).astype(np.uint8).reshape(2, 256)
    n = F.page_batch_length(2, 256)
    res = app.reserve(n)
    assert res.view.size == n and np.shares_memory(res.view, log.backend.array)
    F.encode_page_batch_into(res.view, lsn=res.lsn, epoch=1, region_id=rid, salt=res.salt,
                             page_ids=[0, 3], pages=pages, page_bytes=256)
    with pytest.raises(UsageError, match="not yet persisted"):
        app.commit(1)
    app.persist(res)
    # an extent with two records written by a "producer", then unused space
    ext = app.reserve_extent(4 * n)
    off = 0
    for ids in ([1, 2], [5, 9]):
        off += F.encode_page_batch_into(ext.view[off:], lsn=ext.lsn + off, epoch=1, region_id=rid,
                                        salt=ext.salt, page_ids=ids, pages=pages, page_bytes=256)
    app.finish_extent(ext, off, 2)
    app.commit(1, {rid: 0})
    log2 = Log.open(log.backend, writable=False)
    pbs = [r for r in log2.records() if r.kind == F.REC_PAGE_BATCH]
    assert [list(r.page_batch().page_ids) for r in pbs] == [[0, 3], [1, 2], [5, 9]]
    assert log2.commits[0].record_count == 3 and log2.dropped == []


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_a_record_that_fails_leaves_no_hole(tmp_path, monkeypatch, tier):
    # A record that fails to encode, and a reservation whose record failed
    # (`release`), leave the log as if they never were: the commit after
    # them commits, and a reader reaches it.
    spec = "memory:" if tier == "memory" else f"file:{tmp_path / 'x.log'}"
    log = Log.create(open_backend(spec, size=4 * MiB, create=True), segment_size=MiB)
    rid = log.define_region("x", np.uint8, (16 * 256,), 256, "kv")
    app = log.appender
    pages = np.ones((1, 256), np.uint8)
    app.append_page_batch(1, rid, [0], pages, page_bytes=256)
    real = F.encode_record_into

    def broken(buf, **kw):
        memoryview(buf).cast("B")[:8] = bytes([0xAB] * 8)  # half a header, then the failure
        raise ValueError("no body")

    monkeypatch.setattr(F, "encode_record_into", broken)
    with pytest.raises(ValueError, match="no body"):
        app.append_record(type=F.REC_REGION, epoch=1, body=b"x" * 40)
    monkeypatch.setattr(F, "encode_record_into", real)
    res = app.reserve(F.page_batch_length(1, 256))
    res.view[:100] = 0xCD  # half a record, then the writer gives it up
    app.release(res)
    app.append_page_batch(1, rid, [3], pages, page_bytes=256)
    app.commit(1, {rid: 0})
    log2 = Log.open(log.backend, writable=False)
    assert log2.last_committed_epoch == 1 and log2.dropped == []
    pbs = [r for r in log2.records() if r.kind == F.REC_PAGE_BATCH]
    assert [list(r.page_batch().page_ids) for r in pbs] == [[0], [3]]
    assert log2.verify()["ok"]


def test_producer_bug_is_caught_at_persist():
    log = Log.create(open_backend("memory:", size=4 * MiB), segment_size=MiB)
    res = log.appender.reserve(F.page_batch_length(1, 64))
    F.encode_page_batch_into(res.view, lsn=res.lsn + 64, epoch=1, region_id=0, salt=res.salt,
                             page_ids=[0], pages=np.zeros(64, np.uint8), page_bytes=64)
    with pytest.raises(UsageError, match="expected lsn"):
        log.appender.persist(res)
    ext = log.appender.reserve_extent(1024)
    with pytest.raises(UsageError, match="producer said 1"):
        log.appender.finish_extent(ext, 0, 1)


def test_define_region_twice():
    log = Log.create(open_backend("memory:", size=4 * MiB), segment_size=MiB)
    a = log.define_region("a", np.float16, (10, 64), 128, "kv")
    assert log.define_region("a", np.float16, (10, 64), 128, "kv") == a
    assert log.define_region("b", "<u4", (3,), 64, "adapter") == a + 1
    with pytest.raises(RegionError, match="already defined"):
        log.define_region("a", np.float32, (10, 64), 128, "kv")
    log2 = Log.open(log.backend, writable=False)
    assert list(log2.regions) == ["a", "b"] and log2.regions["a"].dtype == "<f2"


def test_region_defined_after_last_commit_survives_reopen_for_write():
    log, model, rid = build_log(epochs=3)
    log.define_region("late", np.uint8, (128,), 64, "opaque")
    log2 = Log.open(log.backend, writable=True)
    assert "late" in log2.regions and log2.last_committed_epoch == 3
    model.write_epoch(log2, rid, 4)
    log3 = Log.open(log.backend, writable=False)
    assert set(log3.regions) == {"r", "late"} and log3.last_committed_epoch == 4


def test_not_a_log_and_bad_mode():
    b = open_backend("memory:", size=4 * MiB)
    with pytest.raises(NotALogError):
        Log.open(b)
    log, _, _ = build_log(epochs=1)
    with pytest.raises(UsageError, match="read-only"):
        Log.open(log.backend, writable=True, mode=RecoveryMode.SKIP_CORRUPT)
    with pytest.raises(UsageError, match="unknown recovery mode"):
        Log.open(log.backend, writable=False, mode="sometimes")


def test_file_log_roundtrip(tmp_path):
    path = tmp_path / "log"
    log, model, rid = build_log(open_backend(f"file:{path}", size=4 * MiB, create=True), epochs=20)
    log.close()
    log2 = Log.open(f"file:{path}", writable=False)
    assert log2.last_committed_epoch == 20
    assert (replay(log2, model.npages, model.page_bytes) == model.state_after(20)).all()
    log2.close()
