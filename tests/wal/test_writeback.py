"""A file log starts writeback of its records every `writeback_bytes` while the
epoch is still being written (sync_file_range), and writes records larger than
two such steps one step at a time.  Neither may change what is durable when:
records recover bit-exact, across segment rollovers, after a failed write, and
after a SIGKILL at any moment."""

from __future__ import annotations

import random

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.devmem.backend import os_error
from concordia.devmem.errors import DevmemError, OutOfRangeError
from concordia.wal import Log
from concordia.wal.errors import WriterStoppedError

from .helpers import MiB, Model, kill_writer_after, replay


def _file_log(tmp_path, size=8 * MiB, segment=MiB, npages=64, page_bytes=4096):
    log = Log.create(open_backend(f"file:{tmp_path / 'log'}", size=size, create=True), segment_size=segment)
    rid = log.define_region("r", np.uint8, (npages * page_bytes,), page_bytes, "opaque")
    return log, rid


def test_writeback_steps_recover_bit_exact_across_rollovers(tmp_path):
    log, rid = _file_log(tmp_path)
    app = log.appender
    assert app._start_writeback is not None  # a page-cache file: one sync per commit, writeback on
    app.writeback_bytes = 16 << 10  # records of 5+ pages go in steps of 4 pages
    started, writes = [], []
    real_kick, real_write = app._kick, app._write_at
    app._kick = lambda start, end: (started.append((start, end - start)), real_kick(start, end))
    app._write_at = lambda off, parts: (writes.append((off, sum(memoryview(p).nbytes for p in parts))),
                                        real_write(off, parts))
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=12, seed=5)
    for e in range(1, 31):  # 30 x 3 x 48 KiB: several 1 MiB segments
        model.write_epoch(log, rid, e)
    assert len(log.volume.live_segments()) >= 4
    assert started and all(n >= app.writeback_bytes for _, n in started)
    ends = {o + m for o, m in writes}
    starts = {o for o, _ in writes}
    for off, n in started:
        # over bytes already written, up to the end of a write or of the record in it
        # (the zero header slot written after a record is not part of the record)
        assert (off + n in ends or off + n + 64 in ends) and min(starts) <= off, (off, n)
    assert 4 * 4096 in [n for _, n in writes], "no record was written in steps"  # a middle step
    log.close()
    back = Log.open(f"file:{tmp_path / 'log'}")
    assert back.last_committed_epoch == 30
    assert back.verify()["ok"]
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(30)).all()
    back.close()


def test_failed_write_frees_its_space_and_the_log_goes_on(tmp_path):
    log, rid = _file_log(tmp_path)
    app = log.appender
    app.writeback_bytes = 8 << 10
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=9)
    model.write_epoch(log, rid, 1)
    real = app._write_at
    calls = {"n": 0}

    def failing(off, parts):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step of the record: part of it is already written
            raise os_error(OSError(5, "Input/output error"), f"file @ {off:#x}", "write failed")
        real(off, parts)

    app._write_at = failing
    ids, pages = model.epoch_batches(2)[0]
    before = app.write_lsn
    with pytest.raises(DevmemError) as info:
        app.append_page_batch(2, rid, ids, pages)
    assert "\n" not in str(info.value) and "write failed" in str(info.value)
    assert app.write_lsn == before  # the space is free again
    app._write_at = real
    model.write_epoch(log, rid, 2)  # the whole epoch again, in the same space
    log.close()
    back = Log.open(f"file:{tmp_path / 'log'}")
    assert back.last_committed_epoch == 2 and back.verify()["ok"]
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(2)).all()
    back.close()


def test_start_writeback_checks_its_range(tmp_path):
    b = open_backend(f"file:{tmp_path / 'f'}", size=MiB, create=True)
    try:
        b.array[:8192] = 7
        b.start_writeback(0, 8192)  # a hint: returns at once
        b.persist(0, 8192)
        with pytest.raises(OutOfRangeError):
            b.start_writeback(MiB - 4096, 8192)
    finally:
        b.close()


KILLS = 80


def _steps_of_two_pages(log):
    log.appender.writeback_bytes = 1024  # writeback in steps of two 512-byte pages


@pytest.mark.slow
def test_sigkill_writer_with_writeback_steps(tmp_path):
    spec = f"file:{tmp_path / 'log'}"
    rng = random.Random(2468)

    def fresh(seed):
        m = Model(npages=32, page_bytes=512, batches=2, per_batch=6, seed=seed)
        lg = Log.create(open_backend(spec, size=16 * MiB, create=True), segment_size=MiB)
        lg.define_region("r", np.uint8, (32 * 512,), 512, "opaque")
        lg.close()
        return m

    seed = last = 0
    model = fresh(seed)
    for kill in range(KILLS):
        reported = max(kill_writer_after(spec, model, rng.uniform(0.0, 0.02), prepare=_steps_of_two_pages),
                       default=last)
        dropped = []
        log = Log.open(spec, writable=False, reporter=dropped.append)
        got = log.last_committed_epoch
        assert reported <= got <= reported + 1, (kill, reported, got)
        assert not [d for d in dropped if d.kind == "corrupt"], dropped
        assert (replay(log, model.npages, model.page_bytes) == model.state_after(got)).all()
        last = got
        full = len(log.volume.live_segments()) >= 10
        log.close()
        if full:
            seed += 1
            model = fresh(seed)
            last = 0


def test_failed_commit_write_frees_its_space_and_the_commit_can_be_retried(tmp_path):
    log, rid = _file_log(tmp_path)
    app = log.appender
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=11)
    model.write_epoch(log, rid, 1)
    for ids, pages in model.epoch_batches(2):
        app.append_page_batch(2, rid, ids, pages)
    real = app._write_at

    def failing(off, parts):
        raise os_error(OSError(28, "No space left on device"), f"file @ {off:#x}", "write failed")

    app._write_at = failing
    before = app.write_lsn
    with pytest.raises(DevmemError) as info:
        app.commit(2, {rid: model.digest(2)})
    assert "\n" not in str(info.value) and "write failed" in str(info.value)
    assert app.write_lsn == before and app.last_committed_epoch == 1
    app._write_at = real
    app.commit(2, {rid: model.digest(2)})  # the same epoch: its records still counted
    log.close()
    back = Log.open(f"file:{tmp_path / 'log'}")
    assert back.last_committed_epoch == 2 and back.verify()["ok"]
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(2)).all()
    back.close()


@pytest.mark.parametrize("one_sync", [True, False], ids=["one-sync", "two-syncs"])
def test_failed_commit_sync_stops_the_writer_and_a_reopen_recovers(tmp_path, one_sync):
    # After a failed sync what reached the media is unknown (the kernel may drop
    # the pages it could not write and report the next sync clean). A retried
    # commit used to write a second commit record for the same epoch, which made
    # the log fail to open there (V-C2). Now the writer stops, says so in one
    # line, and a reopen recovers every commit that is whole.
    log, rid = _file_log(tmp_path)
    app = log.appender
    app.one_sync = one_sync
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=11)
    model.write_epoch(log, rid, 1)
    for ids, pages in model.epoch_batches(2):
        app.append_page_batch(2, rid, ids, pages)
    real = app.backend.persist

    def failing(off, n):
        raise os_error(OSError(5, "Input/output error"), f"file @ {off:#x}", "sync failed")

    app.backend.persist = failing
    with pytest.raises(DevmemError, match="sync failed"):
        app.commit(2, {rid: model.digest(2)})
    app.backend.persist = real
    for retry in (lambda: app.commit(2, {rid: model.digest(2)}), app.sync,
                  lambda: app.append_page_batch(3, rid, *next(iter(model.epoch_batches(3))))):
        with pytest.raises(WriterStoppedError) as info:
            retry()
        msg = info.value.one_line()
        assert "\n" not in msg and "stopped after a failed sync" in msg and "Input/output error" in msg
        assert "reopen the log" in msg
    log.close()  # writes nothing more
    dropped = []
    back = Log.open(f"file:{tmp_path / 'log'}", writable=False, reporter=dropped.append)
    # the commit's bytes were written to the file before its sync failed: here
    # they are whole, so epoch 2 is recovered; epoch 1 is in either way
    assert back.last_committed_epoch in (1, 2) and back.verify()["ok"]
    got = back.last_committed_epoch
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(got)).all()
    back.close()


def test_a_failed_header_write_ahead_of_the_roll_over_does_not_fail_the_commit(tmp_path):
    # the one-sync commit also writes the next segment's header (a head start
    # for the roll over); its failure must not fail the commit, whose record is
    # already appended: a retry would write a second one for the epoch (V-C2)
    log, rid = _file_log(tmp_path)
    app = log.appender
    app.one_sync = True
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=11)
    real = log.volume.prepare_segment
    calls = []

    def failing(after):
        calls.append(after.index)
        raise os_error(OSError(28, "No space left on device"), "file", "write failed")

    log.volume.prepare_segment = failing
    model.write_epoch(log, rid, 1)
    log.volume.prepare_segment = real
    assert calls and app.last_committed_epoch == 1 and app.stopped is None
    for e in range(2, 12):  # across roll overs
        model.write_epoch(log, rid, e)
    log.close()
    back = Log.open(f"file:{tmp_path / 'log'}", writable=False)
    assert back.last_committed_epoch == 11 and back.verify()["ok"] and len(back.volume.live_segments()) >= 2
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(11)).all()
    back.close()


def test_a_close_whose_sync_fails_still_releases_the_log(tmp_path):
    log, rid = _file_log(tmp_path)
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=11)
    model.write_epoch(log, rid, 1)
    for ids, pages in model.epoch_batches(2):
        log.appender.append_page_batch(2, rid, ids, pages)

    def failing(off, n):
        raise os_error(OSError(5, "Input/output error"), f"file @ {off:#x}", "sync failed")

    log.appender.backend.persist = failing
    with pytest.raises(DevmemError, match="sync failed"):
        log.close()
    again = Log.open(f"file:{tmp_path / 'log'}")   # the lock was released
    assert again.last_committed_epoch == 1
    again.close()


def test_a_writer_stopped_for_a_producer_that_may_still_write_keeps_every_commit(tmp_path):
    # a device that did not finish an epoch may still write into the extent it was
    # given (checkpoint/device_epoch.py): the writer stops as after a failed write,
    # the extent is neither finished nor trimmed, and a reopen keeps the commits before
    from concordia.root_error import ConcordiaError

    log, rid = _file_log(tmp_path)
    app = log.appender
    model = Model(npages=64, page_bytes=4096, batches=3, per_batch=8, seed=12)
    model.write_epoch(log, rid, 1)
    ext = app.reserve_extent(64 << 10)
    app.backend.array[ext.offset:ext.offset + 256] = 0x5A  # what a late device write leaves there
    app.stop_after("device epoch", ConcordiaError("the kernel did not finish", where="device epochs"))
    for write in (lambda: app.finish_extent(ext, 0, 0, trim=True), app.sync,
                  lambda: app.append_page_batch(2, rid, *next(iter(model.epoch_batches(2))))):
        with pytest.raises(WriterStoppedError) as info:
            write()
        msg = info.value.one_line()
        assert "\n" not in msg and "stopped after a failed device epoch" in msg and "did not finish" in msg
    log.close()
    back = Log.open(f"file:{tmp_path / 'log'}", writable=False)
    assert back.last_committed_epoch == 1
    assert (replay(back, model.npages, model.page_bytes) == model.state_after(1)).all()
    back.close()
