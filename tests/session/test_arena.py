"""The arena (concordia/checkpoint/arena.py): an extent reserved ahead into
which a consumer writes epochs and their commits with no appender, taken on
by the session's next call.  What a user of the resident executor relies on:
an epoch is taken only when the most it can write fits (so detection never
runs for an epoch that is not written), a table whose pages the host lists is
never taken there (the device could not), and a commit the consumer wrote
wrong is refused in one line, nothing of it adopted, every region's next
checkpoint then whole."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint import arena
from concordia.checkpoint.table import RegionTable
from concordia.errors import ConcordiaError
from concordia.policy import Policy

MiB = 1 << 20


def _session(log, **kw):
    s = Session(log, size=16 * MiB, segment_size=4 * MiB, staging="mapped", policy=Policy(retain=False), **kw)
    a = np.zeros((32, 1024), np.uint32)
    s.register("a", a)
    s.checkpoint()
    return s, a


def _one_epoch_in_an_arena(s, a):
    """(runner, its open arena, the epoch taken there after a page of `a` was written)."""
    runner = s.runner
    assert runner.open_arena(s.log) is None
    a[1, 1] = 7
    return runner, runner.arena, runner.arena_take()


def test_an_epoch_is_taken_only_when_its_most_fits_and_a_miss_detects_nothing(shm_log):
    s, a = _session(shm_log)
    with s:
        runner = s.runner
        table = runner.table_pass(s.log).table
        need = arena.full_bound(table) + table.commit_length
        assert need > 32 * 4096
        # an arena with room for one whole-table epoch and a little more
        ar = runner.arena = arena.Arena(s.log.appender, table, s.log.appender.next_epoch, nbytes=need + 64)
        a[3, 5] = 1
        first = runner.arena_take()
        assert first == 2 and ar.word("epochs") == 1 and ar.word("last_epoch") == 2
        a[7, 9] = 2
        assert not ar.room and runner.arena_take() is None and ar.word("missed") == 1
        s.settle()
        assert s.epoch == first and [c.pages["a"] for c in s.checkpoints][-1] == 1
        stats = s.checkpoint()
        assert stats.pages["a"] == 1  # page 7: the miss detected nothing, so it is still dirty
        np.testing.assert_array_equal(s.recover()["a"], a)


def test_a_table_the_host_lists_pages_of_or_a_file_log_takes_no_arena(tmp_path, shm_log):
    s, _ = _session(f"file:{tmp_path / 'log'}")
    with s:
        assert "tier needs a persist call (msync)" in s.runner.open_arena(s.log)
    with Session(shm_log, size=16 * MiB, segment_size=4 * MiB, staging="mapped", overwrite=True) as s:
        kv = np.zeros((4, 64, 256), np.uint16)
        s.register("kv", kv, kind="kv", detect="positions", length=lambda: 8)
        s.checkpoint()
        why = s.runner.open_arena(s.log)
        assert why == "region 'kv' has its dirty pages listed by the host" and s.runner.arena is None
        assert arena.why_not(RegionTable(list(s.region_set)), s.log.backend) == why


def test_a_commit_written_wrong_is_refused_and_every_region_is_then_written_whole(shm_log):
    s, a = _session(shm_log)
    with s:
        runner, ar, epoch = _one_epoch_in_an_arena(s, a)
        commit_at = ar.word("last_commit") - ar.ext.lsn
        ar.ext.view[commit_at + 64 + 36] ^= 1  # the commit's digest, under its body CRC
        with pytest.raises(ConcordiaError, match="invalid commit record written by a producer") as e:
            s.settle()
        assert "\n" not in str(e.value) and f"commit of epoch {epoch}" in str(e.value)
        assert s.epoch == epoch - 1 and runner.arena is None
        stats = s.checkpoint()
        assert stats.epoch > epoch and stats.pages["a"] == 32  # whole again: nothing of the refused epoch counts
        assert s.log.verify()["corrupt"] == 0  # the refused commit and its records lie under a pad
    with Session(shm_log, create=False) as r:
        assert r.epoch == stats.epoch
        np.testing.assert_array_equal(r.recover()["a"], a)


def test_what_follows_a_damaged_record_is_padded_over_and_the_epochs_before_it_stand(shm_log):
    s, a = _session(shm_log)
    with s:
        runner, ar, first = _one_epoch_in_an_arena(s, a)
        want = a.copy()
        second_at = ar.word("used")
        a[2, 2] = 8
        runner.arena_take()
        ar.ext.view[second_at + 20] ^= 1  # the second epoch's first record header (its LSN), under its CRC
        with pytest.raises(ConcordiaError, match="the arena holds no whole record or commit after") as e:
            s.settle()
        assert "\n" not in str(e.value) and s.epoch == first
        np.testing.assert_array_equal(s.recover()["a"], want)
        assert s.checkpoint().pages["a"] == 32  # written whole after the failure
        assert s.log.verify()["corrupt"] == 0
    with Session(shm_log, create=False) as r:
        np.testing.assert_array_equal(r.recover()["a"], a)


def test_a_used_word_past_the_extent_takes_on_the_epochs_within_it_and_refuses_in_one_line(shm_log):
    """The arena's `used` word is the consumer's (the device's, in mapped
    memory).  One past the extent is a fault: the walk reads the extent and no
    byte past it, its epochs are taken on, and the refusal is one line."""
    s, a = _session(shm_log)
    with s:
        runner, ar, first = _one_epoch_in_an_arena(s, a)
        ar.words[0]["used"] = ar.ext.length + 4096
        after = ar.ext.offset + ar.ext.length
        past = s.log.backend.array[after:after + 4096].copy()
        with pytest.raises(ConcordiaError, match="words say .* bytes were written into its extent") as e:
            s.settle()
        assert "\n" not in str(e.value) and s.epoch == first
        np.testing.assert_array_equal(s.log.backend.array[after:after + 4096], past)
        np.testing.assert_array_equal(s.recover()["a"], a)
        assert s.log.verify()["corrupt"] == 0


def test_a_record_whose_type_byte_only_masks_to_an_epochs_is_not_taken_on(shm_log):
    """R-T1: the type is the whole byte.  A page batch header with the
    ignorable bit set (0x81), its CRC right, is no record an arena epoch
    writes: the walk stops before it, as before any other damage."""
    import crc32c

    from concordia.wal import format as fmt

    s, a = _session(shm_log)
    with s:
        runner, ar, first = _one_epoch_in_an_arena(s, a)
        want = a.copy()
        second_at = ar.word("used")
        a[2, 2] = 8
        runner.arena_take()
        head = ar.ext.view[second_at:second_at + fmt.RECORD_HEADER_SIZE]
        assert head[fmt.OFF_TYPE] == fmt.REC_PAGE_BATCH
        head[fmt.OFF_TYPE] |= fmt.TYPE_IGNORABLE
        head[fmt.RECORD_HEADER_CRC_OFF:].view("<u4")[0] = crc32c.crc32c(bytes(head[:fmt.RECORD_HEADER_CRC_OFF]))
        with pytest.raises(ConcordiaError, match="the arena holds no whole record or commit after") as e:
            s.settle()
        assert "\n" not in str(e.value) and s.epoch == first
        np.testing.assert_array_equal(s.recover()["a"], want)
        assert s.log.verify()["corrupt"] == 0


def test_a_log_with_no_room_for_an_arena_says_so_and_opens_none(shm_log):
    """Every segment live and too little left of the one being written: no
    arena, the reason named (a trigger's epoch then goes through the session)."""
    from concordia.errors import LogFullError

    with Session(shm_log, size=4 * MiB, segment_size=1 * MiB, staging="mapped", policy=Policy(retain=False)) as s:
        s.register("a", np.zeros((32, 1024), np.uint32))
        s.checkpoint()
        app = s.log.appender
        while True:  # fill the log with records no one will read (padding)
            try:
                ext = app.reserve_extent(app.segment_rest if app.segment_rest >= 4096 else app.segment_capacity)
            except LogFullError:
                break
            app.finish_extent(ext, 0, 0)
        assert s.runner.open_arena(s.log) == "the log has no room for an arena now (no free segment)"
        assert s.runner.arena is None and not app.outstanding


def test_an_epoch_that_does_not_fit_what_is_left_is_lost_and_the_next_checkpoint_is_whole(shm_log):
    """A table of 2 MiB against 1 MiB segments is tried with room for twice
    its last epoch (at least ARENA_MIN_BYTES), not every page: an epoch that
    rewrites it whole is detected, does not fit, and is lost (nothing
    written); the arena takes nothing more (a miss) and, once taken on, every
    region's next checkpoint is whole."""
    with Session(shm_log, size=16 * MiB, segment_size=MiB, staging="mapped", policy=Policy(retain=False)) as s:
        a = np.zeros(2 * MiB, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        runner = s.runner
        table = runner.table_pass(s.log).table
        assert arena.full_bound(table) > MiB // 2
        assert arena.epoch_bound(table, s.log.appender) == arena.ARENA_MIN_BYTES  # no epoch of the table yet
        assert runner.open_arena(s.log) is None
        ar = runner.arena
        a[3] = 1
        first = runner.arena_take()
        assert first is not None and ar.lost == 0
        a[:] = 2
        assert runner.arena_take() is None and ar.lost == first + 1 and ar.word("missed") == 0
        used = ar.word("used")
        a[7] = 3
        assert not ar.room and runner.arena_take() is None and ar.word("missed") == 1 and ar.word("used") == used
        s.settle()
        assert runner.arenas_lost == 1 and s.epoch == first
        st = s.checkpoint()
        assert st.epoch == first + 1 and st.pages["a"] == 512  # whole: what the lost epoch held is here
        assert s.log.verify()["corrupt"] == 0
        np.testing.assert_array_equal(s.recover(first)["a"][:8], [0, 0, 0, 1, 0, 0, 0, 0])
        np.testing.assert_array_equal(s.recover()["a"], a)


def test_an_arena_is_a_segment_tried_with_twice_the_last_epoch_at_most_what_it_holds(shm_log):
    """A table of 2 MiB against 1 MiB segments: the bound is twice the last
    epoch (at least ARENA_MIN_BYTES) up to what a segment holds beside the
    commit, and the arena a whole segment (`segment_capacity`) or, once the
    last epoch is known, the rest of the one being written where that holds
    an epoch, so an epoch of 640 KiB still has one; after an epoch of 320 KiB, `expect` asks for
    twice it, at most the whole arena; only a last epoch that alone does
    not fit a segment has none (`too_large`)."""
    with Session(shm_log, size=16 * MiB, segment_size=MiB, staging="mapped", policy=Policy(retain=False)) as s:
        a = np.zeros(2 * MiB, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        runner, app = s.runner, s.log.appender
        table = runner.table_pass(s.log).table
        whole, commit = app.segment_capacity, table.commit_length
        assert arena.epoch_bound(table, app) == arena.ARENA_MIN_BYTES and arena.too_large(table, app) is None
        table.last_bytes = 320 << 10                    # twice that is more than half a segment holds
        assert arena.epoch_bound(table, app) == 640 << 10 and arena.too_large(table, app) is None
        table.last_bytes = 600 << 10                    # twice that is more than a segment holds
        assert arena.epoch_bound(table, app) == whole - commit and arena.too_large(table, app) is None
        table.last_bytes = 320 << 10
        rest = app.segment_rest // 64 * 64              # more than one epoch of twice 320 KiB: the arena is that
        assert 640 << 10 < rest < whole and runner.open_arena(s.log) is None
        ar = runner.arena
        assert ar.ext.length == rest and ar.room
        a[:4096 * 80:4096] = 1                          # 80 pages: 320 KiB and their headers
        first = runner.arena_take()
        used = ar.word("used") - commit
        assert first is not None and not ar.lost and ar.word("expect") == 2 * used
        assert ar.room and not ar.holds(2)              # room for one more of twice it, not two
        a[4096 * 100:4096 * 180:4096] = 2
        second = runner.arena_take()
        assert second == first + 1 and not ar.room      # the next takes an arena of its own
        s.settle()
        np.testing.assert_array_equal(s.recover(second)["a"], a)
        table = runner.table_pass(s.log).table
        table.last_bytes = whole - commit + 64          # an epoch that alone fills more than a segment
        why = arena.too_large(table, app)
        assert why is not None and "more than a segment" in why, why
        with pytest.raises(ValueError, match="more than a segment"):
            arena.Arena(app, table, 99)


def test_a_table_of_more_than_half_a_segment_gets_a_segment_and_a_rest_only_where_it_holds_enough(shm_log):
    """A 768 KiB table against 1 MiB segments whose every page fits a segment
    but not half of one, its last epoch large enough that every page is the
    bound (no epoch lost): its arena is a whole segment (or the rest of the
    one being written, where that holds an epoch), not one epoch's bytes.  A
    rest is taken only where it holds `least` epochs (a device trigger keeps
    room for two), else a whole segment."""
    with Session(shm_log, size=16 * MiB, segment_size=MiB, staging="mapped", policy=Policy(retain=False)) as s:
        a = np.zeros(768 << 10, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        app = s.log.appender
        table = s.runner.table_pass(s.log).table
        full, commit, whole = arena.full_bound(table), table.commit_length, app.segment_capacity
        table.last_bytes = full // 2 + 4096             # twice it is every page: no epoch can be lost
        assert app.segment_capacity // 2 < full + commit <= whole and arena.epoch_bound(table, app) == full
        rest = app.segment_rest // 64 * 64
        assert rest < full + commit, rest               # the bases left too little: a segment (a rest: below)
        ar = arena.Arena(app, table, 99)
        assert ar.word("adapt") == 0 and ar.ext.length == whole, rest
        ar.adopt(app)
    with Session(shm_log, size=16 * MiB, segment_size=MiB, staging="mapped", policy=Policy(retain=False),
                 overwrite=True) as s:
        a = np.zeros(2 * MiB, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        app = s.log.appender
        table = s.runner.table_pass(s.log).table
        rest, commit = app.segment_rest // 64 * 64, table.commit_length
        table.last_bytes = (rest * 3 // 4 - commit) // 2  # an epoch tried with three quarters of the rest
        need = arena.epoch_bound(table, app) + commit
        assert arena.ARENA_MIN_BYTES < need <= rest < 2 * need, (need, rest)
        one = arena.Arena(app, table, 99)               # least=1: the rest
        assert one.ext.length == rest
        one.adopt(app)                                  # no epoch: given back, the same rest again
        two = arena.Arena(app, table, 99, least=2)      # the rest holds one epoch, not two: a segment instead
        assert two.ext.length == app.segment_capacity
        two.adopt(app)
