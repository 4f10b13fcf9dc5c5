"""The extent pipeline of checkpoints (reserve extents, stage records at a
cursor, finish from the cursor, digests from a kept CRC table), driven here by
the numpy twins: the same orchestration the GPU path runs, minus the device.
Every staging path must leave the same records and digests in the log."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint import host as host_mod
from concordia.checkpoint import staging as staging_mod
from concordia.errors import SessionError
from concordia.regions.region import Region

from .staging_cases import assert_same_log, page_batches_by_epoch, run_workload
from .state import LOG_SIZE, SEGMENT, assert_same, copy, make_state, mutate, register_all


@pytest.mark.parametrize("staging", ["mapped", "ring"])
def test_extent_pipeline_writes_the_host_paths_records(persistent_log, tmp_path, staging):
    host_stats, host_log, host_got, truth = run_workload(f"file:{tmp_path / 'host.log'}", staging="host")
    stats, contents, got, _ = run_workload(persistent_log, staging=staging)
    assert all(set(st.via.values()) == {f"cpu-{staging}"} for st in stats)
    assert all(set(st.via.values()) == {"host"} for st in host_stats)
    assert_same_log(contents, host_log)
    assert [st.pages for st in stats] == [st.pages for st in host_stats]
    assert [st.log_bytes for st in stats] == [st.log_bytes for st in host_stats]
    assert_same(got, truth)
    assert_same(host_got, truth)
    by_epoch = page_batches_by_epoch(contents)
    assert sorted(by_epoch) == [1, 2, 3]  # the clean fourth epoch wrote no page
    assert sum(by_epoch[2].values()) == 4


@pytest.mark.parametrize("staging", ["mapped", "ring"])
def test_many_records_and_extents_per_checkpoint(tmp_path, monkeypatch, staging):
    # small records and extents: one checkpoint spans many extents, so the
    # ring alternates its halves and every extent is finished from its cursor
    monkeypatch.setattr(staging_mod, "MAX_BATCH_BYTES", 4096)
    monkeypatch.setattr(staging_mod, "EXTENT_BYTES", 3 * 4096)
    host = run_workload(f"file:{tmp_path / 'host.log'}", staging="host")
    stats, contents, got, truth = run_workload(f"file:{tmp_path / 'x.log'}", staging=staging)
    assert len(contents["batches"]) > 12
    assert_same_log(contents, host[1])
    assert_same(got, truth)


def test_plan_extents_packs_in_order_within_the_cap():
    r = Region(name="r", kind="opaque", page_bytes=4096, array=np.zeros(1 << 20, np.uint8), xp=np, owner=None,
               storage=(), detect="shadow", hints={})
    lengths = [100, 200, 300, 5000, 50, 50]
    batches = [staging_mod.Batch(r, i, i + 1, n) for i, n in enumerate(lengths)]
    ext = staging_mod.plan_extents(batches, 600)
    assert [[b.length for b in e] for e in ext] == [[100, 200, 300], [5000], [50, 50]]
    assert [b for e in ext for b in e] == batches
    assert staging_mod.plan_extents([], 600) == []
    # records as the host path cuts them: at most MAX_BATCH_BYTES of payload each
    cut = staging_mod.plan_batches(r, 5000, 64 << 20)
    per = staging_mod.MAX_BATCH_BYTES // 4096
    assert [(b.lo, b.hi) for b in cut][:2] == [(0, per), (per, 2 * per)] and cut[-1].hi == 5000


def test_a_failure_while_staging_leaves_the_log_and_the_session_usable(file_log, monkeypatch):
    state = make_state(4)
    calls = {"n": 0}
    real = host_mod.HostKernels.stage

    def failing(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the third record of the second checkpoint
            raise OSError("injected failure while staging")
        return real(self, *a, **kw)

    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT, staging="ring") as s:
        register_all(s, state)
        s.checkpoint()
        at1 = copy(state)
        mutate(state, 2)
        monkeypatch.setattr(host_mod.HostKernels, "stage", failing)
        with pytest.raises(OSError, match="injected"):
            s.checkpoint()
        monkeypatch.setattr(host_mod.HostKernels, "stage", real)
        assert s.epoch == 1
        assert_same(s.recover(), at1)
        again = s.checkpoint()  # the appender took the failed extents back as padding
        assert sorted(again.base) == sorted(state)  # detectors had advanced: a full write
        at3 = copy(state)
    with Session(file_log, create=False) as s:
        assert s.epoch == 3
        assert_same(s.recover(), at3)
        report = s.log.verify()
        assert report["ok"] and report["corrupt"] == 0, report["problems"]


def test_unknown_staging_is_refused(file_log):
    with pytest.raises(SessionError, match="unknown staging"):
        Session(file_log, staging="teleport")


@pytest.mark.parametrize("staging", ["host", "mapped"])
def test_recover_an_older_epoch_in_place_then_continue(file_log, staging):
    # epoch 2 stays in the log: continuing from epoch 1's contents must not
    # leave epoch 2's pages under the next epoch, so it is written whole
    state = make_state(6)
    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT, staging=staging) as s:
        register_all(s, state)
        s.checkpoint()
        at1 = copy(state)
        mutate(state, 1)
        s.checkpoint()
        s.recover(target=1, into="registered")
        assert_same(state, at1)
        mutate(state, 3)
        third = s.checkpoint()
        assert sorted(third.base) == sorted(state)
        at3 = copy(state)
    with Session(file_log, create=False) as s:
        assert_same(s.recover(), at3)
