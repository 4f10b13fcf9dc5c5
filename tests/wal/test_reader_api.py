"""The public reading entry points the command line builds on: a scan that
starts at an LSN without reading the segments below it, progress callbacks of
verification and restore, and the folded image of a region as a page source
for a base snapshot."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.wal import format as F
from concordia.wal.apply import apply_plan_numpy, restore_region_npy
from concordia.wal.compaction import fold_source
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import plan, plan_history, scan
from concordia.wal.reader import PROGRESS_STEP, Scanner, ScanResult, verify
from concordia.wal.snapshot import create_base_snapshot, list_snapshots

from .helpers import MiB, build_log, reopen


@pytest.fixture(scope="module")
def long_log():
    """A log spread over several 1 MiB segments."""
    log, model, rid = build_log(epochs=60, size=16 * MiB, npages=64, page_bytes=4096)
    assert len(log.volume.live_segments()) >= 3
    yield log, model, rid
    log.close()


def _lsn(it):
    return it[1].base_lsn + (it[2] - it[1].offset)


def _end(it):
    return _lsn(it) + (it[3] if it[0] == 1 else it[3][0])


def test_items_from_lsn_skips_whole_segments(long_log):
    log, _, _ = long_log
    vol = log.volume
    every = list(Scanner(vol).items(ScanResult()))
    live = vol.live_segments()
    for seg in live[1:]:
        # an LSN in the middle of a segment: earlier segments are not walked
        recs = [it for it in every if it[1].index == seg.index and it[0] == 0]
        start = _lsn(recs[len(recs) // 2])
        res = ScanResult()
        got = list(Scanner(vol).items(res, from_lsn=start))
        assert [s.index for s in res.segments] == [s.index for s in live if s.end_lsn > start]
        want = [it for it in every if _end(it) > start]
        assert [(_lsn(a), a[0]) for a in got] == [(_lsn(b), b[0]) for b in want]
        assert _lsn(got[0]) == start  # items that end at or below it are left out
    assert list(Scanner(vol).items(from_lsn=live[-1].end_lsn)) == []
    assert len(list(Scanner(vol).items())) == len(every)


def test_verify_progress_is_monotone_and_ends_at_the_total(long_log):
    log, _, _ = long_log
    vol = log.volume
    calls = []
    rep = verify(vol, progress=lambda d, t: calls.append((d, t)))
    assert rep["ok"]
    total = sum(min(s.offset + s.nbytes, vol.backend.size) - s.offset for s in vol.live_segments())
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done)
    # cheap: no more than one call per step, plus one per segment and the last
    assert len(calls) <= total // PROGRESS_STEP + len(vol.live_segments()) + 1
    assert verify(vol)["records"] == rep["records"]


def test_scan_progress_steps_inside_a_segment():
    """A segment larger than the step is reported from inside its walk."""
    log, _, _ = build_log(epochs=40, size=48 * MiB, segment=16 * MiB, npages=256, page_bytes=4096,
                          batches=4, per_batch=16)
    try:
        calls = []
        list(Scanner(log.volume, progress=lambda d, t: calls.append(d)).items())
        seg = log.volume.live_segments()[0]
        inside = [d for d in calls if 0 < d < seg.nbytes]
        assert inside and all(b - a >= PROGRESS_STEP for a, b in zip(inside, inside[1:]))
    finally:
        log.close()


def test_restore_progress_and_image(long_log, tmp_path):
    log, model, _ = long_log
    p = plan(log)
    r = p.regions["r"].region
    calls = []
    path = restore_region_npy(log, p, "r", tmp_path / "r.npy", chunk_bytes=64 << 10,
                              progress=lambda d, t: calls.append((d, t)))
    got = np.load(path)
    assert np.array_equal(got.reshape(model.npages, model.page_bytes), model.state_after(p.epoch))
    assert calls[-1] == (r.nbytes, r.nbytes)
    done = [d for d, _ in calls]
    assert done == sorted(done)
    steps = [b - a for a, b in zip(done[:-2], done[1:-1])]
    assert all(s >= PROGRESS_STEP for s in steps) or len(calls) <= 2


def test_restore_progress_many_chunks(tmp_path):
    """A region of many MiB: several reports, each at least a step apart, on
    one thread and on several."""
    log, model, _ = build_log(epochs=1, size=64 * MiB, segment=16 * MiB, npages=4096, page_bytes=4096,
                              batches=2, per_batch=2048)
    try:
        p = plan(log)
        for threads in (1, 3):
            calls = []
            restore_region_npy(log, p, "r", tmp_path / f"r{threads}.npy", threads=threads,
                               progress=lambda d, t: calls.append(d))
            assert len(calls) >= 3 and calls[-1] == 16 * MiB
            assert all(b - a >= PROGRESS_STEP for a, b in zip(calls[:-2], calls[1:-1]))
            got = np.load(tmp_path / f"r{threads}.npy")
            assert np.array_equal(got.reshape(4096, 4096), model.state_after(1))
    finally:
        log.close()


def test_fold_source_makes_the_base_the_log_states(long_log):
    log0, model, _ = long_log
    with reopen(log0.backend.array, writable=True) as log:
        p = plan_history(scan(log), 30, "tolerate_tail", regions=["r"])
        rp = p.regions["r"]
        src = fold_source(rp)
        want = model.state_after(30)
        assert np.array_equal(src(5, 17), want[5:17])
        entry = create_base_snapshot(log, "r", src, p.epoch)
        assert entry.digest == rp.digest == F.region_digest(F.page_crcs_of(want))
        assert (rp.region.id, 30) in {(e.region_id, e.epoch) for e in list_snapshots(log)}
        again = plan(log, 30).regions["r"]
        assert again.base_epoch == 30
        got = apply_plan_numpy(log, plan(log, 30))["r"]
        assert np.array_equal(got.reshape(want.shape), want)


def test_fold_source_names_a_bad_page(long_log):
    log0, _, _ = long_log
    with reopen(log0.backend.array, writable=False) as log:
        rp = plan(log, 20).regions["r"]
        s = rp.sources[-1]
        b = s.batch
        off = b.offset + (b.length - b.page_ids.size * 4096) + int(s.rows[0]) * 4096
        log.backend.array[off + 7] ^= 1
        with pytest.raises(CorruptionError, match=f"segment {b.segment} @ {off:#x}"):
            fold_source(rp)(0, rp.region.pages)
