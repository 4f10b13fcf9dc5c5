"""Crash tests of the coordinated epoch: ranks SIGKILLed at random points, during
and between checkpoints; the group epoch read from the logs is committed by
every rank and restores each rank's bytes of that epoch."""

import random
import time

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from concordia import Session
from concordia.root_error import ConcordiaError
from concordia.demo import tp
from concordia.group import committed_epochs, group_epoch


@pytest.mark.parametrize("seed", [1])
def test_kill_ranks_at_random_points(tmp_path, seed):
    import torch.multiprocessing as mp

    rnd = random.Random(seed)
    world = 3
    logdir, rdzv = tmp_path / "logs", tmp_path / "rdzv"
    logdir.mkdir()
    rdzv.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=tp._checkpoint_loop, args=(r, world, str(logdir), str(rdzv), 100000), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    logs = [f"file:{logdir / f'rank{r}.log'}" for r in range(world)]
    # wait until every rank has committed two epochs (read from the logs, however slow the machine), then
    # kill one at a random moment, the rest soon after
    t_end = time.time() + 120
    while time.time() < t_end and _group_epoch_now(logdir, world) < 2:
        time.sleep(0.05)
    time.sleep(rnd.uniform(0.0, 1.0))
    order = list(range(world))
    rnd.shuffle(order)
    for r in order:
        procs[r].kill()
        time.sleep(rnd.uniform(0.0, 0.05))
    for p in procs:
        p.join(timeout=10)
    G = group_epoch(logs)
    assert G > 1, "no epoch committed by every rank before the kills"
    for r, lg in enumerate(logs):
        assert G in committed_epochs(lg)
        arrays = Session(lg, create=False).recover(G)
        step = int(np.asarray(arrays["step"])[0])
        assert step == G  # epoch t holds step t: without a failure the agreed numbering has no gap
        assert np.asarray(arrays["a"]).tobytes() == tp.crash_state(r, step).tobytes()


def _group_epoch_now(logdir, world) -> int:
    """The group epoch of the ranks' logs as they are being written (0 while one
    is missing or caught between two writes: read again)."""
    logs = [logdir / f"rank{r}.log" for r in range(world)]
    if not all(p.exists() for p in logs):
        return 0
    try:
        return group_epoch([f"file:{p}" for p in logs])
    except ConcordiaError:
        return 0
