"""Retention as part of the Session: automatic bases and compaction keep a
long session's log bounded, its recovery flat, and the kept window restorable."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from concordia import Session
from concordia.errors import ConcordiaError, SessionError
from concordia.policy import Policy
from concordia.wal import Log
from concordia.wal.planner import scan
from concordia.wal.snapshot import list_snapshots

from .test_bad_input import one_line

MiB = 1 << 20


def _touch(a: np.ndarray, e: int) -> None:
    """Epoch e's change: one word of one page (a deterministic walk over the pages)."""
    pages = a.size // 1024
    a[(e * 7919) % pages, e % 1024] = e


def _recovery_work(log: str, want: np.ndarray) -> tuple[int, int]:
    """(records a recovery of the latest epoch walks, payload bytes it reads),
    for one fresh Session on the log (its result checked).  The work that
    sets a recovery's time, counted rather than timed: a timing would depend
    on the load of the machine the test runs on."""
    with Session(log, create=False) as s:
        got = s.recover()["state"]
        read = s.last_recovery.bytes
    assert np.array_equal(got, want)
    with Log.open(log, writable=False) as lg:
        h = scan(lg)
        walked = len(h.batches) + len(h.commits)
    return walked, read


@pytest.mark.slow
def test_twenty_thousand_checkpoints_on_a_64_mib_log_stay_bounded_and_recover_flat(shm_log):
    # the required check: one dirty page per checkpoint of a 4 MiB
    # numpy state into a 64 MiB log, with the default policy (retention on).
    # The pages are found through per-page versions (an adapter's scanner), so
    # that the test spends its time in the log, not in diffing 4 MiB 20,000 times.
    a = np.zeros((1024, 1024), np.uint32)  # 4 MiB, 1024 pages of 4 KiB
    versions = np.zeros(1024, np.uint64)

    def register(s):
        s.register("state", a, kind="adapter", slot_versions=versions, pages_per_slot=1)

    def touch(e):
        _touch(a, e)
        versions[(e * 7919) % 1024] += 1

    s = Session(shm_log, size=64 * MiB, segment_size=1 * MiB, overwrite=True)
    register(s)
    for epoch in range(1, 201):
        touch(epoch)
        s.checkpoint()
    s.close()
    # the log as of epoch 200, kept beside the live one to be timed with it at the end
    early_log = shm_log + "-e200"
    shutil.copyfile("/dev/shm/" + shm_log.split(":", 1)[1], "/dev/shm/" + early_log.split(":", 1)[1])
    early_state = a.copy()
    s = Session(shm_log, create=False)
    register(s)
    s.recover(into="registered")
    lowest_free = s.retention.free_bytes()
    for epoch in range(201, 20_001):
        touch(epoch)
        assert s.checkpoint().pages["state"] == 1
        # (a LogFullError here fails the test)
        lowest_free = min(lowest_free, s.retention.free_bytes())
    assert s.epoch == 20_000
    counts = dict(s.retention.counts)
    assert s.retention.error is None
    assert counts["bases"] >= 20 and counts["segments_freed"] > 64, counts  # the log was recycled many times over
    assert lowest_free > 32 * MiB, lowest_free  # bounded well inside the log
    assert counts.get("scans", 0) <= 2, counts  # switches work from what the session knows
    s.close()
    try:
        early = _recovery_work(early_log, early_state)
        late = _recovery_work(shm_log, a)
    finally:
        os.unlink("/dev/shm/" + early_log.split(":", 1)[1])
    # recovery stays flat: after 20,000 checkpoints it walks and reads no more
    # than twice what it did after 200
    assert late[0] <= 2 * early[0] and late[1] <= 2 * early[1], (early, late)
    with Log.open(shm_log, writable=False) as log:
        v = log.verify()
        assert v["corrupt"] == 0, v["problems"]
        assert list_snapshots(log)  # recovery starts from a base, not from epoch 1


def test_the_kept_window_restores_and_older_epochs_are_refused_naming_the_oldest(shm_log):
    a = np.zeros((64, 1024), np.uint32)  # 256 KiB, 64 pages
    policy = Policy(base_every_bytes=8 * 4096, keep_epochs=6, slice_bytes=16 << 10)
    states = {}
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True, policy=policy) as s:
        s.register("state", a)
        for e in range(1, 901):
            _touch(a, e)
            s.checkpoint()
            states[e] = a.copy()
        assert s.retention.counts["bases"] >= 10 and s.retention.counts["segments_freed"] > 0
        for e in range(895, 901):  # the newest keep_epochs epochs, byte-identical
            assert np.array_equal(s.recover(e)["state"], states[e])
        oldest = int(s.log.volume.superblock.oldest_epoch)
        assert 800 < oldest <= 895
        assert np.array_equal(s.recover(oldest)["state"], states[oldest])
        with pytest.raises(ConcordiaError) as err:
            s.recover(oldest - 1)
        one_line(err.value, f"oldest restorable epoch {oldest}")


def test_keep_seconds_keeps_every_epoch_of_a_young_session(shm_log):
    a = np.zeros((64, 1024), np.uint32)
    policy = Policy(base_every_bytes=8 * 4096, keep_epochs=2, keep_seconds=3600, slice_bytes=64 << 10)
    states = {}
    with Session(shm_log, size=32 * MiB, segment_size=1 * MiB, overwrite=True, policy=policy) as s:
        s.register("state", a)
        for e in range(1, 101):
            _touch(a, e)
            s.checkpoint()
            states[e] = a.copy()
        assert s.retention.counts["bases"] >= 5  # bases are written, nothing young is dropped
        assert int(s.log.volume.superblock.oldest_epoch) == 0
        for e in (1, 50, 100):
            assert np.array_equal(s.recover(e)["state"], states[e])


def test_a_small_log_under_pressure_keeps_checkpointing(shm_log):
    # a window the log cannot hold: the log wins, older epochs go, no LogFullError
    a = np.zeros((64, 1024), np.uint32)
    policy = Policy(keep_epochs=100_000, slice_bytes=64 << 10)
    with Session(shm_log, size=5 * MiB, segment_size=1 * MiB, overwrite=True, policy=policy) as s:
        s.register("state", a)
        for e in range(1, 1001):
            a[(e * 7) % 64] = e  # a whole page per epoch
            s.checkpoint()
        assert s.retention.counts["segments_freed"] > 0 and s.retention.error is None
        assert np.array_equal(s.recover()["state"], a)
        assert int(s.log.volume.superblock.oldest_epoch) > 1


def test_without_retention_the_log_only_grows(shm_log):
    a = np.zeros((64, 1024), np.uint32)
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True,
                 policy=Policy(retain=False)) as s:
        s.register("state", a)
        for e in range(1, 301):
            _touch(a, e)
            s.checkpoint()
        assert not s.retention.counts and not list_snapshots(s.log)
        assert int(s.log.volume.superblock.oldest_epoch) == 0
        assert s.recover(1)["state"].any()


def test_a_state_larger_than_the_log_is_refused_at_register_with_the_size_needed(shm_log):
    big = np.zeros(16 * MiB, np.uint8)
    with Session(shm_log, size=8 * MiB, segment_size=1 * MiB, overwrite=True) as s:
        s.register("small", np.zeros(4096, np.uint8))
        with pytest.raises(SessionError) as err:
            s.register("big", big)
        one_line(err.value, "region 'big'", "the log holds 7340032 bytes", "needs", "(18 MiB)")
        assert "big" not in s.log.regions and "big" not in s.regions  # nothing was written
        s.checkpoint()  # the session goes on with what fits
        assert s.epoch == 1


@pytest.mark.parametrize("bad", [dict(keep_epochs=0), dict(slice_bytes=-1), dict(base_every_bytes="1M"),
                                 dict(retain=1), dict(image_bases="yes")])
def test_bad_retention_fields_are_refused_in_one_line(bad):
    with pytest.raises(SessionError) as err:
        Policy(**bad)
    one_line(err.value, "policy")


def test_what_the_session_knows_never_frees_more_than_a_scan_of_the_log_would(shm_log):
    # the switch frees below Known.needed_from instead of scanning: it must be
    # at or below what the scan-based needed_from answers for the same catalog
    from concordia.wal.compaction import needed_from, retention
    from concordia.wal.planner import scan
    from concordia.wal.snapshot import current_catalog

    a = np.zeros((64, 1024), np.uint32)
    policy = Policy(base_every_bytes=8 * 4096, keep_epochs=6, slice_bytes=16 << 10)
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True, policy=policy) as s:
        s.register("state", a)
        checked = 0
        for e in range(1, 701):
            _touch(a, e)
            s.checkpoint()
            if e % 50 == 0:
                known = s.retention.known
                known.window_start = s.retention._window_start(e)
                entries = list(current_catalog(s.log).entries)
                ids = [r.id for r in s.log.regions.values()]
                kept, floor, cut = retention(entries, [known.window_start], 0, 1, ids)
                fast = known.needed_from(kept, cut, floor)
                if fast is False:
                    continue
                h = scan(s.log, payload=False)
                assert fast <= needed_from(h, kept, cut, floor), e
                checked += 1
        assert checked >= 10, checked
        assert s.retention.counts["scans"] == 0 and s.retention.counts["segments_freed"] > 0


def _recount_free(s) -> int:
    """Free bytes of the log counted afresh: free segments of the superblock and
    the rest of the appender's segment."""
    from concordia.wal import format as F

    vol, app = s.log.volume, s.log.appender
    free = sum(1 for e in vol.superblock.segments if e.state == F.SEG_FREE) * int(vol.segment_bytes)
    return free + (app.seg.offset + app.seg.nbytes - app.pos if app.seg is not None else 0)


@pytest.mark.parametrize("staging,size,keep,most", [("mapped", 24 * MiB, 4, 3), ("host", 24 * MiB, 4, 3),
                                                    ("mapped", 4 * MiB, 100_000, 12)],
                         ids=["table-pass", "per-region", "log-pressure"])
def test_the_kept_totals_and_chains_equal_a_recount_from_the_checkpoints(shm_log, staging, size, keep, most):
    # The hook keeps the state's size, the free space and every region's chain
    # between checkpoints instead of counting them over the regions each time.
    # They must equal a count made afresh (sizes from the regions, free space
    # from the superblock, chains from the checkpoints' own statistics and the
    # bases the switches report) after registers, bases, switches and, on the
    # small log, pressure.
    from concordia.retention import record_bytes

    rng = np.random.default_rng(7)
    # "d" is often written whole (its four pages), as an adapter updated every step is
    arrays = {"a": np.zeros((64, 1024), np.uint32), "b": np.zeros((16, 1024), np.uint32),
              "c": np.zeros((32, 1024), np.uint32), "d": np.zeros((4, 1024), np.uint32)}
    policy = Policy(keep_epochs=keep, slice_bytes=32 << 10)  # on the small log the log wins over the window
    pages, chains, resets, pb, switches = [], [], [], 4096, 0
    with Session(shm_log, size=size, segment_size=1 * MiB, overwrite=True, policy=policy, staging=staging) as s:
        r = s.retention
        s.register("a", arrays["a"])
        s.register("b", arrays["b"])
        s.register("d", arrays["d"])
        for e in range(1, 401):
            if e == 60:
                s.register("c", arrays["c"])  # a region added after bases and switches
            for name, a in arrays.items():
                if name in s.regions:
                    n = int(rng.integers(0, most)) if name != "d" else int(rng.integers(0, 5))
                    for p in rng.choice(a.shape[0], min(n, a.shape[0]), replace=False):
                        a[p, e % 1024] = e
            st = s.checkpoint()
            pages.append((st.epoch, dict(st.pages), list(st.base)))
            chains.append((st.epoch, r.chain))
            if r.counts["switches"] > switches:  # at most one a checkpoint; a job restarts its regions' chains
                switches = r.counts["switches"]
                resets.extend((r.reports[-1].epoch, n) for n in r.reports[-1].folded + r.reports[-1].unchanged)
            assert r.state_bytes() == sum(record_bytes(x.nbytes, pb) for n, x in arrays.items() if n in s.regions)
            assert r.free_bytes() == _recount_free(s), e
            assert r.error is None, r.error
        counts = dict(r.counts)
        assert counts["bases"] >= 6 and counts["switches"] >= 3 and counts["segments_freed"] > 0, counts
        if keep > 1000:  # under pressure the log keeps only its newest epochs, whatever the window
            assert s.log.volume.superblock.oldest_epoch > 350, s.log.volume.superblock.oldest_epoch
        open_job = r.job_epoch
    # the chains counted afresh: pages since the newest reset (a base's epoch, or an epoch
    # that wrote the region whole: its first full write, or every page of it since)
    since: dict = {}
    wholes = 0
    for (epoch, got, base), (_, chain) in zip(pages, chains):
        if open_job is not None and epoch >= open_job:
            break  # that job's regions are not reported yet
        for name, n in got.items():
            whole = name in base or n == arrays[name].shape[0]
            wholes += whole and name not in base
            since[name] = 0 if whole else since.get(name, 0) + n * pb
        for ep, name in resets:
            if ep == epoch:
                since[name] = 0
        assert chain == since, epoch
    assert wholes >= 20   # "d" was written whole often, after its first full write


def test_the_chain_a_recovery_reads_stays_within_the_bound(shm_log):
    # base_every_bytes (default a quarter of the region) bounds the deltas a
    # recovery reads after the newest base: a base starts early enough to be
    # in force (written and switched) before the chain passes the bound
    from concordia.wal.planner import plan

    a = np.zeros((256, 1024), np.uint32)  # 1 MiB: the bound is 256 KiB, 64 one-page epochs
    versions = np.zeros(256, np.uint64)
    longest = 0
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True) as s:
        s.register("state", a, kind="adapter", slot_versions=versions, pages_per_slot=1)
        bound = s.retention.bound(s.regions["state"])
        for e in range(1, 421):
            p = (e * 7919) % 256
            a[p, e % 1024] = e
            versions[p] += 1
            s.checkpoint()
            rp = plan(s.log).regions["state"]
            if rp.base_epoch is not None:
                longest = max(longest, (rp.epoch - rp.base_epoch) * 4096)
        assert s.retention.counts["bases"] >= 5 and s.retention.error is None, dict(s.retention.counts)
        assert np.array_equal(s.recover()["state"], a)
    assert bound // 2 < longest <= bound, (longest, bound)


def test_a_switch_prepared_but_not_made_current_leaves_the_old_catalog_and_keeps_later_epochs(shm_log):
    # Compaction.prepare appends the new catalog; until Compaction.switch writes
    # the superblock a reader sees the old one, and checkpoints committed between
    # the halves stay restorable after the switch
    from concordia.wal.compaction import Compaction
    from concordia.wal.snapshot import current_catalog

    a = np.zeros((64, 1024), np.uint32)
    states = {}
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True, policy=Policy(retain=False)) as s:
        s.register("state", a)
        for e in range(1, 301):
            _touch(a, e)
            s.checkpoint()
            states[e] = a.copy()
        job = Compaction(s.log, 300, live={"state": a.copy()})
        while not job.step():
            pass
        before = current_catalog(s.log)
        assert job.prepare(keep_epochs=1) and job.prepared  # keeps epoch 300 on
        for e in range(301, 304):  # between the halves
            _touch(a, e)
            s.checkpoint()
            states[e] = a.copy()
        with Log.open(shm_log, writable=False) as log:  # a reader meanwhile: the old catalog, every epoch
            assert current_catalog(log).sequence == before.sequence and not list_snapshots(log)
            assert int(log.volume.superblock.oldest_epoch) == 0
        assert np.array_equal(s.recover(1)["state"], states[1])
        rep = job.switch()
        assert not job.prepared and rep.segments_freed and rep.floor_epoch == 300
        assert current_catalog(s.log).sequence == before.sequence + 1
        for e in (300, 301, 303):
            assert np.array_equal(s.recover(e)["state"], states[e])
        with pytest.raises(ConcordiaError) as err:
            s.recover(299)
        one_line(err.value, "oldest restorable epoch 300")


@pytest.mark.parametrize("where", ["slice", "copies"])
def test_a_retention_step_that_fails_leaves_the_committed_checkpoint_standing(shm_log, monkeypatch, where):
    # Any failure inside retention's hook (here out of memory, in a job's
    # slice or in its host copies) comes after the epoch committed: the
    # checkpoint returns its statistics, retention says why in one line and
    # drops the job, and later jobs base and switch as before.
    from concordia import retention
    from concordia.wal import compaction

    owner, name = (compaction.Compaction, "step") if where == "slice" else (retention.Retention, "_host_copy")
    real = getattr(owner, name)
    calls = []

    def once(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no memory for the base")
        return real(*a, **k)

    monkeypatch.setattr(owner, name, once)
    a = np.zeros((64, 1024), np.uint32)
    policy = Policy(base_every_bytes=8 * 4096, keep_epochs=6, slice_bytes=16 << 10)
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True, policy=policy) as s:
        s.register("state", a)
        s.checkpoint()
        failed_at = None
        for e in range(1, 121):
            _touch(a, e)
            st = s.checkpoint()  # never raises
            assert st.epoch == s.epoch == e + 1
            if failed_at is None and s.retention.error is not None:
                failed_at = e
        assert failed_at is not None and s.retention.counts["errors"] == 1
        assert s.retention.error == "MemoryError: no memory for the base"
        assert s.retention.counts["switches"] >= 2  # jobs went on after the failed one
        assert np.array_equal(s.recover()["state"], a)
    with Session(shm_log, create=False) as r:
        assert np.array_equal(r.recover()["state"], a)


def test_a_region_written_whole_at_every_checkpoint_is_never_due_for_a_base(shm_log):
    # An adapter updated at every step is written whole by each checkpoint: that delta is
    # an image of it, which bounds its chain as a base does.  Its bases then come from the
    # log's pacing alone (2,000 checkpoints of a 64 KiB region on a 16 MiB log: 20 jobs,
    # where counting its deltas as a chain started one every fourth checkpoint, 500)
    a = np.zeros((16, 1024), np.uint32)
    with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True) as s:
        s.register("lora", a)
        for e in range(1, 2001):
            a[:, e % 1024] = e
            s.checkpoint()
            assert s.retention.chain == {"lora": 0}
        counts = dict(s.retention.counts)
        assert s.retention.error is None and counts["segments_freed"] > 0, counts
        assert counts["jobs"] < 100, counts
        assert np.array_equal(s.recover()["lora"], a)



def test_a_small_region_rewritten_a_little_at_every_step_is_based_only_once_its_chain_passes_the_floor(shm_log):
    # A decoder's token buffer: [batch, tokens] of int64, one column written a step, so
    # a page per row each step (8 of its 16 pages).  A quarter of it is four pages, which
    # every step's chain passed: it took a job (its copies, a slice, a catalog and a
    # superblock write) every few steps.  Its bound is now at least CHAIN_FLOOR_SHARE of a segment
    # (a switch frees whole segments), so its jobs come once per floor's worth of chain.
    from concordia.retention import CHAIN_FLOOR_SHARE

    seg = 16 * MiB
    tokens = np.zeros((8, 1024), np.int64)             # 64 KiB, a row two pages
    kv = np.zeros((64, 8, 4096), np.uint8)             # 2 MiB, unchanged while the tokens grow
    steps = 96
    with Session(shm_log, size=8 * seg, segment_size=seg, overwrite=True) as s:
        s.register("kv", kv)
        s.register("tokens", tokens)
        floor = seg // CHAIN_FLOOR_SHARE
        assert s.retention.bound(s.regions["tokens"]) == floor          # 256 KiB, not a quarter of 64 KiB
        assert s.retention.bound(s.regions["kv"]) == max(floor, kv.nbytes // 4)
        s.checkpoint()
        jobs = []
        start = s.retention._start

        def count(epoch, names, live, pressure):
            jobs.append(("tokens" in names, epoch))
            return start(epoch, names, live, pressure)
        s.retention._start = count
        for t in range(steps):
            tokens[:, t] = t + 1
            assert not s.checkpoint().coalesced
        # 32 KiB of chain a step against a 256 KiB floor: a job every eight steps at the
        # most (each restarts the chain); a quarter of the region made one every fourth
        # step (24 in 96 steps), as fast as each job's four hooks allowed
        took = [e for with_tokens, e in jobs if with_tokens]
        assert 1 <= len(took) <= -(-steps * 8 * 4096 // floor) == 12, jobs
        assert s.retention.error is None
        got = s.recover()
        assert np.array_equal(got["tokens"], tokens) and np.array_equal(got["kv"], kv)
    with Session(shm_log, size=8 * seg, segment_size=seg, overwrite=True, policy=Policy(base_every_bytes=4096)) as s:
        s.register("tokens", tokens)
        assert s.retention.bound(s.regions["tokens"]) == 4096           # the policy's bound, as set


def test_a_first_full_write_makes_the_copy_buffers_a_later_job_fills(shm_log):
    """The first checkpoint writes every region whole, so its base job copies
    nothing (each base is an image entry); it still makes the buffers the
    next jobs copy into, there and not inside a later step, where making
    them (pinning a device region's, faulting pages in) stalled a decode
    step by a few hundred ms.  The later jobs fill the same buffers."""
    regions = [np.zeros(MiB, np.uint8) for _ in range(8)]
    with Session(shm_log, size=32 * MiB, segment_size=MiB) as s:
        for i, a in enumerate(regions):
            s.register(f"r{i}", a, page_bytes=4096)
        s.checkpoint()
        ret = s.retention
        assert ret.counts["jobs"] == 1 and ret.counts["images"] == len(regions)
        kept = dict(ret._copies)
        assert sorted(kept) == sorted(s.regions)
        assert all(b.nbytes == MiB for b in kept.values())
        filled = []  # the copies each later job took
        start = ret._start
        ret._start = lambda epoch, names, live, pressure: (filled.append(live), start(epoch, names, live, pressure))
        for e in range(200):
            for a in regions:
                a[(e * 4096 * 3) % MiB] = e % 251
            s.checkpoint()
        assert ret.counts["jobs"] > 1 and ret.counts["bases"] > 0  # later jobs copied regions
        assert any(filled) and all(kept[n] is b for live in filled for n, b in live.items())
        assert all(ret._copies[n] is b for n, b in kept.items())
        for i, a in enumerate(regions):  # what they copied is what was checkpointed
            assert np.array_equal(s.recover()[f"r{i}"], a)
