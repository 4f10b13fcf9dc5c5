"""Planner, snapshots, compaction and the applier on real logs (memory backend):
random histories against the brute-force oracle, retention and reclaim, and a
damaged delta under every recovery mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from concordia.devmem import open_backend
from concordia.wal import Log, RecoveryMode
from concordia.wal import format as F
from concordia.wal.apply import apply_plan_numpy, restore_region_npy
from concordia.wal.compaction import compact
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import PlanError, plan
from concordia.wal.snapshot import create_base_snapshot, list_snapshots

from .model import PAGE, REGIONS, drive, ops_strategy


def new_log(size=32 << 20, segment=1 << 20):
    return Log.create(open_backend("memory:", size=size, create=True), segment_size=segment)


class LogSink:
    """Plays model operations against a real log."""

    def __init__(self, log, live_compaction=False):
        self.log = log
        self.ids = {n: log.define_region(n, np.dtype(d), shape, PAGE, "opaque") for n, d, shape in REGIONS}
        self.live_compaction = live_compaction

    def write(self, epoch, name, ids, pages):
        self.log.appender.append_page_batch(epoch, self.ids[name], ids, pages)

    def commit(self, epoch, digests):
        self.log.appender.commit(epoch, digests={self.ids[n]: d for n, d in digests.items()})

    def snapshot(self, name, epoch, arr):
        create_base_snapshot(self.log, name, arr, epoch)

    def compact(self, epoch, keep, arrays):
        compact(self.log, epoch, keep_bases=keep, live=arrays if self.live_compaction else None)


def assert_restores(log, oracle, epochs):
    for e in epochs:
        p = plan(log, e)
        assert p.epoch == e
        for rp in p.regions.values():
            ids = np.concatenate([s.page_ids for s in rp.sources] + [rp.zero_page_ids])
            assert np.unique(ids).size == ids.size == rp.pages  # each page copied at most once
        got = apply_plan_numpy(log, p)
        for n, a in oracle[e].items():
            np.testing.assert_array_equal(got[n], a, err_msg=f"region {n} at epoch {e}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy(max_ops=24), st.booleans())
def test_random_histories_restore_like_replay(ops, live):
    log = new_log(size=8 << 20)
    try:
        oracle = drive(ops, LogSink(log, live_compaction=live))
        floor = log.volume.superblock.oldest_epoch
        restorable = [e for e in oracle if e >= floor]
        assert_restores(log, oracle, restorable)
        # the same from a fresh read-only open of the same bytes
        again = Log.open(log.backend, writable=False)
        assert_restores(again, oracle, restorable[-2:])
        for e in oracle:
            if e < floor:
                with pytest.raises(PlanError, match="retention"):
                    plan(log, e)
    finally:
        log.close()


def _history(log, epochs, dirty_frac=0.3, seed=3, page=4096, pages=(96, 40)):
    """Regions 'kv' and 'ad' of `pages` pages, epoch 1 writes all, later epochs a fraction."""
    rng = np.random.default_rng(seed)
    arrs = {"kv": np.zeros(pages[0] * page // 2, np.uint16), "ad": np.zeros(pages[1] * page // 4 - 3, np.float32)}
    ids = {n: log.define_region(n, a.dtype, a.shape, page, "opaque") for n, a in arrs.items()}
    oracle = {}
    for e in range(1, epochs + 1):
        dig = {}
        for n, a in arrs.items():
            flat = a.reshape(-1).view(np.uint8)
            npg = -(-flat.size // page)
            sel = np.arange(npg) if e == 1 else np.sort(rng.choice(npg, max(1, int(npg * dirty_frac)), replace=False))
            for p in sel:
                lo, hi = p * page, min((p + 1) * page, flat.size)
                flat[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)
            padded = np.zeros(npg * page, np.uint8)
            padded[: flat.size] = flat
            pg = padded.reshape(npg, page)
            log.appender.append_page_batch(e, ids[n], sel, pg[sel])
            dig[ids[n]] = F.region_digest(F.page_crcs_of(pg))
        log.appender.commit(e, digests=dig)
        oracle[e] = {n: a.copy() for n, a in arrs.items()}
    return oracle


def test_retention_reclaims_segments_and_keeps_younger_epochs_exact():
    log = new_log(size=24 << 20, segment=1 << 20)
    try:
        oracle = _history(log, 12)
        used_before = len(log.volume.live_segments())
        rep = compact(log, 6, keep_bases=1)
        assert rep.floor_epoch == 6 and rep.folded == ["kv", "ad"]
        assert rep.segments_freed, "compaction freed no segment"
        assert len(log.volume.live_segments()) < used_before
        assert log.volume.superblock.oldest_epoch == 6
        for e in range(1, 6):
            with pytest.raises(PlanError, match="oldest restorable epoch 6"):
                plan(log, e)
        assert_restores(log, oracle, range(6, 13))
        # a later compaction with the same policy moves the floor again
        rep = compact(log, 10)
        assert rep.floor_epoch == 10 and rep.bases_dropped == 2
        assert [s.epoch for s in list_snapshots(log)] == [10, 10]
        assert_restores(log, oracle, range(10, 13))
        ro = Log.open(log.backend, writable=False)
        assert sorted(ro.regions) == ["ad", "kv"]  # descriptors survived the reclaim
        assert_restores(ro, oracle, [10, 12])
        assert ro.verify()["corrupt"] == 0
    finally:
        log.close()


def test_a_compaction_walks_the_log_once_and_then_only_what_it_appended(monkeypatch):
    """compact(): decide, the fold and the switch take one walk of the log
    (decide's) and a walk of the bases it appended; the result is what a
    compaction that walked three times made (the same restores)."""
    from concordia.wal import reader

    log = new_log(size=24 << 20, segment=1 << 20)
    try:
        oracle = _history(log, 12)
        walks = []
        real = reader.Scanner.items

        def counted(self, result=None, **kw):
            walks.append(kw.get("from_lsn", 0))
            return real(self, result, **kw)

        monkeypatch.setattr(reader.Scanner, "items", counted)
        start = log.appender.write_lsn
        rep = compact(log, 6, keep_bases=1)
        monkeypatch.undo()
        assert rep.floor_epoch == 6 and rep.segments_freed
        assert len([w for w in walks if w == 0]) <= 1 and [w for w in walks if w] == [start], walks
        assert_restores(log, oracle, range(6, 13))
        assert log.verify()["corrupt"] == 0
    finally:
        log.close()


def test_compaction_reads_far_less_than_replay_and_reports_progress():
    log = new_log()
    try:
        oracle = _history(log, 10, dirty_frac=0.5)
        before = plan(log)
        seen = []
        rep = compact(log, progress=lambda done, total: seen.append((done, total)))
        assert seen and seen[-1][0] == seen[-1][1] == sum(r.pages * 4096 for r in log.regions.values())
        after = plan(log)
        assert after.bytes_to_read == seen[-1][1] <= before.bytes_to_read <= before.naive_bytes
        assert {rp.base_epoch for rp in after.regions.values()} == {10}
        assert rep.unchanged == [] and compact(log).unchanged == ["kv", "ad"]  # nothing left to fold
        assert_restores(log, oracle, [10, 1])
    finally:
        log.close()


def test_live_image_that_disagrees_with_the_epoch_is_refused():
    log = new_log()
    try:
        oracle = _history(log, 3)
        wrong = {n: a.copy() for n, a in oracle[3].items()}
        wrong["kv"][5] ^= 1
        with pytest.raises(Exception, match="digest"):
            compact(log, 3, live=wrong)
        assert log.volume.superblock.catalog_lsn == 0  # nothing switched
        assert_restores(log, oracle, [3])
        compact(log, 3, live=oracle[3])
        assert plan(log).regions["kv"].base_epoch == 3
    finally:
        log.close()


def _damage_payload(log, epoch, region):
    """Flip one payload byte of the delta of `region` at `epoch`; returns (record, where)."""
    rid = log.regions[region].id
    rec = next(r for r in log.records() if r.kind == F.REC_PAGE_BATCH and r.epoch == epoch and r.region_id == rid)
    off = rec.offset + F.page_batch_payload_offset(rec.count) + 7
    log.backend.array[off] ^= 0x40
    return rec


def test_damaged_delta_mid_log_follows_the_mode():
    log = new_log()
    try:
        oracle = _history(log, 8)
        rec = _damage_payload(log, 4, "kv")
        where = f"segment {rec.segment} @ 0x{rec.offset:x}"
        for mode in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE):
            with pytest.raises(CorruptionError) as ei:
                apply_plan_numpy(log, plan(log, mode=mode, check_pages=True))
            assert where in str(ei.value) and "page CRC mismatch" in str(ei.value)
        with pytest.raises(CorruptionError, match=f"segment {rec.segment} @ 0x[0-9a-f]+: page CRC mismatch"):
            apply_plan_numpy(log, plan(log, 4))  # unchecked plan: the applier names the page
        p = plan(log, mode=RecoveryMode.POINT_IN_TIME)
        assert p.epoch == 3
        doc = p.to_json()
        (d,) = [x for x in doc["dropped"] if x["lsn"] == rec.lsn]
        assert d["where"] == where and "page CRC mismatch" in d["reason"]
        assert d["gave_up"] == {"epochs": [4, 8], "regions": ["kv", "ad"]}
        json.dumps(doc)
        got = apply_plan_numpy(log, p)
        for n in got:
            np.testing.assert_array_equal(got[n], oracle[3][n])
        p = plan(log, mode=RecoveryMode.SKIP_CORRUPT)
        assert p.regions["kv"].epoch == 3 and p.regions["ad"].epoch == 8
        got = apply_plan_numpy(log, p)
        np.testing.assert_array_equal(got["kv"], oracle[3]["kv"])
        np.testing.assert_array_equal(got["ad"], oracle[8]["ad"])
    finally:
        log.close()


def test_restore_into_npy_files(tmp_path):
    log = new_log()
    try:
        oracle = _history(log, 5)
        p = plan(log, 4)
        for n, a in oracle[4].items():
            path = restore_region_npy(log, p, n, tmp_path / f"{n}.npy", chunk_bytes=16 << 10)
            got = np.load(path)
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
    finally:
        log.close()


@pytest.mark.parametrize("share", [True, False], ids=["kept-by-size", "walked-twice"])
def test_a_log_of_many_small_records_is_walked_once_by_a_recovery(tmp_path, monkeypatch, share):
    """A checkpoint every step writes a record a region: a recovery's open
    keeps its walk for the planner while it is within a share of the log's
    size (`reader.walk_kept`), so the plan does not walk the log again; beyond
    it, the log is walked again.  Either way the state recovered is the same."""
    import concordia.wal.reader as R
    from concordia import Session

    monkeypatch.setattr(R, "WALK_KEPT_MAX", 16)   # fewer than the log's records
    if not share:
        monkeypatch.setattr(R, "WALK_KEPT_LOG_BYTES", 1 << 40)
    path = f"file:{tmp_path / 'log'}"
    regions = {f"r{i}": np.zeros(4 * 1024, np.uint8) for i in range(6)}
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        for n, a in regions.items():
            s.register(n, a, page_bytes=4096)
        for step in range(8):
            for a in regions.values():
                a[step * 512] = step + 1
            s.checkpoint()
    walks = []
    real = R.Scanner.items
    monkeypatch.setattr(R.Scanner, "items", lambda self, *a, **k: walks.append(1) or real(self, *a, **k))
    with Session(path, create=False) as s:
        got = s.recover()
        st = s.last_recovery
    assert all(np.array_equal(got[n], a) for n, a in regions.items()) and st.epoch == 8
    assert len(walks) == 1 if share else len(walks) >= 2, walks
