"""SIGKILL a writer at random moments (well over 200 kill points per run):
every epoch whose `commit` returned (the writer reports it on a pipe only
after commit returns) must recover bit-exact, and nothing uncommitted may be
applied.  The writer is a forked child, so a kill point costs milliseconds;
each child reopens the log for writing (cutting the previous torn tail) and
goes on from the last committed epoch."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.wal import Log

from .helpers import MiB, Model, kill_writer_after, replay

KILLS = 110  # per tier; two tiers


def _fresh(spec, seed):
    model = Model(npages=32, page_bytes=512, batches=2, per_batch=4, seed=seed)
    log = Log.create(open_backend(spec, size=16 * MiB, create=True), segment_size=MiB)
    log.define_region("r", np.uint8, (32 * 512,), 512, "opaque")
    log.close()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["shm", "file"])
def test_sigkill_writer(tier, tmp_path):
    if tier == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm on this machine")
        spec = f"shm:concordia-test-{os.getpid()}-{time.time_ns()}"
    else:
        spec = f"file:{tmp_path / 'log'}"
    rng = random.Random(1234 if tier == "shm" else 4321)
    seed = 0
    model = _fresh(spec, seed)
    last = 0
    kills = torn_seen = 0
    try:
        while kills < KILLS:
            # every tenth kill inside an epoch by construction, the rest at random moments
            reported = max(kill_writer_after(spec, model, rng.uniform(0.0, 0.025), from_writing=True,
                                             mid_epoch=kills % 10 == 0), default=last)
            kills += 1
            dropped = []
            log = Log.open(spec, writable=False, reporter=dropped.append)
            got = log.last_committed_epoch
            # every returned commit is there; at most the one in flight beyond it
            assert reported <= got <= reported + 1, (kills, reported, got)
            assert not [d for d in dropped if d.kind == "corrupt"], dropped
            torn_seen += any(d.kind in ("torn", "uncommitted") for d in dropped)
            assert not any(rec.epoch > got for rec in log.records())
            assert (replay(log, model.npages, model.page_bytes) == model.state_after(got)).all()
            assert [c.digests[0] for c in log.commits[-3:]] == [
                model.digest(k) for k in range(max(1, got - 2), got + 1)][-len(log.commits[-3:]):] \
                if log.commits else True
            last = got
            full = len(log.volume.live_segments()) >= 10
            log.close()
            if full:  # no compaction here: start a fresh log
                seed += 1
                model = _fresh(spec, seed)
                last = 0
    finally:
        if tier == "shm":
            try:
                os.unlink("/dev/shm/" + spec.split(":", 1)[1])
            except OSError:
                pass
    assert kills >= KILLS
    assert torn_seen >= KILLS // 10  # every tenth kill landed mid-epoch by construction, perhaps more
