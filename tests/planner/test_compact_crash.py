"""Compaction SIGKILLed at random points, again and again, on a file-backed
log: after every kill the log opens, restores the same state for every
retained epoch, and `verify` finds nothing corrupt."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.planner import plan

from .test_log_planner import _history

CHILD = textwrap.dedent("""
    import os, signal, sys
    import concordia.wal.compaction as C
    from concordia.wal import Log

    path, kill_at, epoch, keep, live = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    step = [0]

    def point():
        step[0] += 1
        if step[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    log = Log.open("file:" + path, writable=True)
    real_catalog, real_reclaim = C.append_catalog, log.volume.reclaim_segments

    def append_catalog(*a, **k):
        point()
        lsn = real_catalog(*a, **k)
        point()
        return lsn

    def reclaim(*a, **k):
        out = real_reclaim(*a, **k)
        point()
        return out

    C.append_catalog = append_catalog
    log.volume.reclaim_segments = reclaim
    arrays = None
    if live == "live":  # the regions as a live process holds them: restored from the log
        from concordia.wal.apply import apply_plan_numpy
        from concordia.wal.planner import plan
        arrays = apply_plan_numpy(log, plan(log, epoch))
    C.compact(log, epoch, live=arrays, keep_bases=keep, chunk_bytes=64 << 10, progress=lambda d, t: point())
    print("done", step[0])
""")


def writable_open_keeps_catalog(tmp_path) -> bool:
    """FORMAT.md V-N2: a writable open must cut after the catalog the superblock
    names, not only after the last commit.  Probe it on a tiny log."""
    from concordia.wal.snapshot import create_base_snapshot, current_catalog

    path = "file:" + str(tmp_path / "probe")
    log = Log.create(path, size=4 << 20, segment_size=1 << 20)
    rid = log.define_region("r", np.uint8, (128,), 64, "opaque")
    log.appender.append_page_batch(1, rid, [0, 1], np.ones((2, 64), np.uint8))
    log.appender.commit(1)
    create_base_snapshot(log, "r", np.concatenate([np.ones(128, np.uint8)]), 1)
    log.close()
    log = Log.open(path, writable=True)
    try:
        return len(current_catalog(log).entries) == 1
    except Exception:
        return False
    finally:
        log.close()


def _check(path, oracle):
    log = Log.open("file:" + str(path), writable=False)
    try:
        floor = log.volume.superblock.oldest_epoch
        for e in sorted({max(oracle), max(floor, min(oracle))}):
            got = apply_plan_numpy(log, plan(log, e))
            for n, a in oracle[e].items():
                np.testing.assert_array_equal(got[n], a, err_msg=f"{n} at epoch {e}")
        v = log.verify()
        assert v["corrupt"] == 0, v["problems"]
        return floor
    finally:
        log.close()


@pytest.mark.slow
def test_compaction_killed_at_random_points(tmp_path):
    if not writable_open_keeps_catalog(tmp_path):
        pytest.xfail("Log.open(writable=True) cuts after the last commit and drops a switched catalog "
                     "(FORMAT.md V-N2 not yet honoured by the writer)")
    path = tmp_path / "log"
    log = Log.create("file:" + str(path), size=40 << 20, segment_size=1 << 20)
    oracle = _history(log, 10)
    log.close()
    rng = random.Random(11)
    env = dict(os.environ)
    kills = completed = 0
    floor = 0
    for i in range(14):
        epoch = rng.randint(max(1, floor), 10)
        # 9 chunks + catalog before/after + reclaim = 12 points; 0 (every 4th run) lets it finish
        kill_at = 0 if i % 4 == 3 else rng.randint(1, 12)
        r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(kill_at), str(epoch), str(rng.choice([1, 2])),
                            rng.choice(["fold", "live"])],
                           env=env, capture_output=True, text=True, timeout=60)
        if r.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert r.returncode == 0, r.stderr
            completed += 1
        floor = _check(path, oracle)
    assert kills >= 8 and completed >= 3, (kills, completed)
