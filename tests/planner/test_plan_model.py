"""The pure planner against a brute-force oracle, on random histories of
writes, commits, base snapshots and compactions with retention (no log I/O)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from concordia.wal.apply import apply_plan_numpy
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import Damage, PlanError, plan_history

from .model import ModelHistory, drive, ops_strategy

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_plan(p):
    """Each page copied at most once, and only pages the region has."""
    for rp in p.regions.values():
        ids = np.concatenate([s.page_ids for s in rp.sources] + [rp.zero_page_ids])
        assert ids.size == rp.pages
        assert np.unique(ids).size == ids.size
        assert rp.bytes_to_read == rp.pages_read * rp.region.page_bytes


@SETTINGS
@given(ops_strategy())
def test_every_committed_epoch_restores_like_replay(ops):
    m = ModelHistory()
    oracle = drive(ops, m)
    h = m.history()
    restorable = h.committed_epochs()
    assert restorable and restorable[-1] == max(oracle)
    for epoch in restorable:
        p = plan_history(h, epoch)
        check_plan(p)
        assert p.epoch == epoch
        got = apply_plan_numpy(None, p, threads=1 if epoch % 2 else 2)
        for name, arr in oracle[epoch].items():
            np.testing.assert_array_equal(got[name], arr, err_msg=f"{name} at epoch {epoch}")
        assert p.bytes_to_read <= p.naive_bytes
        json.dumps(p.to_json())
    # epochs below the floor are refused, naming the oldest restorable one
    for epoch in sorted(oracle):
        if epoch < h.floor_epoch:
            with pytest.raises(PlanError, match="retention"):
                plan_history(h, epoch)


@SETTINGS
@given(ops_strategy(max_ops=20))
def test_latest_and_lsn_targets(ops):
    m = ModelHistory()
    oracle = drive(ops, m)
    h = m.history()
    latest = plan_history(h, "latest")
    assert latest.epoch == max(oracle)
    for e, c in h.commits.items():
        if e < h.floor_epoch:  # kept on media for a retained delta, not restorable
            continue
        assert plan_history(h, ("lsn", c.lsn)).epoch == e
        assert plan_history(h, ("lsn", c.lsn + 1)).epoch >= e


def _history_with_deltas():
    m = ModelHistory()
    ops = []
    for e in range(1, 7):
        ops.append(("write", "kv", (0, e % 7, 6), e))
        ops.append(("write", "ad", (e % 4,), 100 + e))
        ops.append(("commit",))
    oracle = drive(ops, m)
    return m, oracle


def _damage_of(m, epoch, name):
    rid = m.id_of[name]
    b = next(b for b in m.batches if b.epoch == epoch and b.region_id == rid and not b.base)
    m.batches.remove(b)
    return Damage(segment=b.segment, offset=b.offset, lsn=b.lsn, reason="page CRC mismatch for page 0",
                  epoch=b.epoch, region_id=rid)


def test_damaged_delta_follows_the_mode():
    m, oracle = _history_with_deltas()
    d = _damage_of(m, 4, "kv")
    h = m.history([d])
    for mode in ("tolerate_tail", "absolute"):
        with pytest.raises(CorruptionError) as ei:
            plan_history(h, "latest", mode)
        assert d.where in str(ei.value)
    # point in time: everything falls back to epoch 3, naming the record
    p = plan_history(h, "latest", "point_in_time")
    assert p.epoch == 3 and all(rp.epoch == 3 for rp in p.regions.values())
    got = apply_plan_numpy(None, p)
    for n in got:
        np.testing.assert_array_equal(got[n], oracle[3][n])
    (dr,) = [x for x in p.to_json()["dropped"] if x["lsn"] == d.lsn]
    assert dr["where"] == d.where and dr["gave_up"] == {"epochs": [4, 6], "regions": ["kv", "ad", "tb"]}
    # skip corrupt: only kv falls back
    p = plan_history(h, "latest", "skip_corrupt")
    assert p.regions["kv"].epoch == 3 and p.regions["ad"].epoch == 6
    got = apply_plan_numpy(None, p)
    np.testing.assert_array_equal(got["kv"], oracle[3]["kv"])
    np.testing.assert_array_equal(got["ad"], oracle[6]["ad"])
    (dr,) = p.to_json()["dropped"]
    assert dr["region"] == "kv" and dr["gave_up"]["regions"] == ["kv"]
    # a target before the damage needs nothing damaged: the lenient modes plan
    # it; tolerate_tail refuses a corrupt log whatever the target (R-D4)
    for mode in ("point_in_time", "skip_corrupt"):
        assert plan_history(h, 3, mode).epoch == 3
    with pytest.raises(CorruptionError, match="corruption before the last commit"):
        plan_history(h, 3, "tolerate_tail")


def test_base_after_damage_makes_later_epochs_whole_again():
    m, oracle = _history_with_deltas()
    m.snapshot("kv", 5, oracle[5]["kv"])
    d = _damage_of(m, 4, "kv")
    h = m.history([d])
    with pytest.raises(CorruptionError):  # R-D4: no per-region leniency in tolerate_tail
        plan_history(h, "latest", "tolerate_tail")
    p = plan_history(h, "latest", "skip_corrupt")  # the base at 5 covers the damage at 4
    assert p.epoch == 6 and p.regions["kv"].base_epoch == 5 and p.regions["kv"].epoch == 6
    got = apply_plan_numpy(None, p)
    np.testing.assert_array_equal(got["kv"], oracle[6]["kv"])
    assert plan_history(h, 4, "point_in_time").epoch == 3


def test_lost_record_found_through_commit_count():
    """A record whose header is lost names no epoch; the reader finds the loss
    through the commit's count (V-C4) and reports that commit, attributed to
    its epoch (what `scan` turns into a Damage): every region breaks there."""
    m, oracle = _history_with_deltas()
    b = next(b for b in m.batches if b.epoch == 2)
    m.batches.remove(b)
    c = m.commits.pop(2)
    d = Damage(segment=b.segment, offset=b.offset, lsn=b.lsn, reason="record header CRC mismatch")
    dc = Damage(segment=c.segment, offset=c.offset, lsn=c.lsn, epoch=2,
                reason="commit of epoch 2 counts 2 records, the log holds 1 (V-C4)")
    h = m.history([d, dc])
    with pytest.raises(CorruptionError, match="header CRC"):
        plan_history(h, "latest")
    assert plan_history(h, "latest", "skip_corrupt").regions["ad"].epoch == 1
    p = plan_history(h, "latest", "point_in_time")
    assert p.epoch == 1
    assert any("header CRC" in x["reason"] for x in p.to_json()["dropped"])


def test_torn_tail_is_reported_not_fatal_except_absolute():
    m, oracle = _history_with_deltas()
    tail = Damage(segment=9, offset=0x1000, lsn=m.lsn, reason="record runs past the end", tail=True)
    h = m.history([tail])
    p = plan_history(h)
    assert p.epoch == 6 and p.to_json()["dropped"][0]["gave_up"] is None
    with pytest.raises(CorruptionError, match="segment 9 @ 0x1000"):
        plan_history(h, mode="absolute")


def test_bad_targets_say_what_is_wrong():
    m, _ = _history_with_deltas()
    h = m.history()
    with pytest.raises(PlanError, match="epoch 9 was never committed.*latest committed epoch is 6"):
        plan_history(h, 9)
    with pytest.raises(PlanError, match="bad target"):
        plan_history(h, "newest")
    with pytest.raises(PlanError, match="no region named 'zz'"):
        plan_history(h, regions=["zz"])
    with pytest.raises(PlanError, match="unknown recovery mode"):
        plan_history(h, mode="hopeful")


def test_digest_mismatch_is_caught():
    m, oracle = _history_with_deltas()
    c = m.commits[6]
    m.commits[6] = type(c)(**{**c.__dict__, "digests": {**c.digests, 0: c.digests[0] ^ 1}})
    with pytest.raises(CorruptionError, match="digest mismatch"):
        apply_plan_numpy(None, plan_history(m.history()))


def test_page_damage_found_by_the_applier_names_the_record():
    m, oracle = _history_with_deltas()
    b = next(b for b in m.batches if b.epoch == 6 and b.region_id == 0)
    b.payload[0, 5] ^= 0xFF
    with pytest.raises(CorruptionError, match=rf"segment {b.segment} @ 0x[0-9a-f]+: page CRC mismatch .* lsn {b.lsn}"):
        apply_plan_numpy(None, plan_history(m.history()))
