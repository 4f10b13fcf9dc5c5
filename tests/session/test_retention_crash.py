"""The automatic path SIGKILLed: a Session whose retention writes bases in
slices and switches catalogs is killed while it writes a BASE record, around
a catalog, around the superblock write that frees segments, and at random
times; after every kill the log opens, the last epoch the child saw committed
is recovered byte-identical, and `verify` finds nothing corrupt.  The next
child goes on from the recovered state on the same log."""

from __future__ import annotations

import os
import random
import signal
import sys
import textwrap

import numpy as np
import pytest

from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.planner import plan
from concordia.wal.snapshot import list_snapshots

from .kill import kill_at_random_lines, run_child

PAGES = 64

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import concordia.wal.compaction as C
    import concordia.wal.snapshot as S
    from concordia.wal.volume import Volume
    from concordia import Session
    from concordia.policy import Policy

    spec, kill_at, epochs, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    step = [0]

    def point(what):
        if where in ("any", what):
            step[0] += 1
            if step[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, what, before=True, after=True):
        real = getattr(owner, name)
        def f(*a, **k):
            if before:
                point(what)
            out = real(*a, **k)
            if after:
                point(what)
            return out
        setattr(owner, name, f)

    wrap(S, "_append_base_batch", "base", before=False)           # after each BASE record
    wrap(C, "append_catalog", "switch")                            # around the catalog
    wrap(C.Compaction, "switch", "switch", after=False)            # between prepare and switch: commits may follow
    wrap(Volume, "reclaim_segments", "switch", before=False)       # after the superblock switch
    wrap(Volume, "write_superblock", "switch", before=False)

    a = np.zeros(({PAGES}, 1024), np.uint32)
    policy = Policy(base_every_bytes=6 * 4096, keep_epochs=4, slice_bytes=16 << 10)
    s = Session(spec, size=6 << 20, segment_size=1 << 20, policy=policy)
    s.register("state", a)
    if s.epoch:
        s.recover(into="registered")
    start = s.epoch
    for e in range(start + 1, start + epochs + 1):
        a[(e * 7) % {PAGES}, e % 1024] = e
        a[(e * 13) % {PAGES}, (e * 5) % 1024] = e
        s.checkpoint()
        print(e, flush=True)
    s.close()
    print("done", flush=True)
""").replace("{PAGES}", str(PAGES))


def state_at(epoch: int) -> np.ndarray:
    a = np.zeros((PAGES, 1024), np.uint32)
    for e in range(1, epoch + 1):
        a[(e * 7) % PAGES, e % 1024] = e
        a[(e * 13) % PAGES, (e * 5) % 1024] = e
    return a


def _check(path: str, seen: int) -> int:
    log = Log.open(path, writable=False)
    try:
        last = int(log.last_committed_epoch or 0)
        # nothing committed is lost; at most the epoch being committed at the kill is extra
        assert seen <= last <= seen + 1, (seen, last)
        if last:
            got = apply_plan_numpy(log, plan(log))
            np.testing.assert_array_equal(got["state"], state_at(last), err_msg=f"epoch {last}")
            oldest = int(log.volume.superblock.oldest_epoch)
            if oldest and oldest < last:  # the oldest kept epoch restores too
                got = apply_plan_numpy(log, plan(log, oldest))
                np.testing.assert_array_equal(got["state"], state_at(oldest), err_msg=f"epoch {oldest}")
        v = log.verify()
        assert v["corrupt"] == 0, v["problems"]
        return last
    finally:
        log.close()


def _kill_runs(child: str, path: str, runs: int, points: list, where: str, check, after=None) -> int:
    """`runs` children of `child` on the log at `path`, the i-th killed at its
    `points[i]`-th point of `where` (each goes on from what the one before left;
    `check` after each, `after(path)` too when given), then one run to the end.
    Returns the children killed."""
    seen = kills = 0
    for i in range(runs):
        r, last = run_child(child, path, points[i], 120, where)
        if r.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert r.returncode == 0, r.stderr[-2000:]
        if last is not None:
            seen = last
        seen = check(path, seen)
        if after is not None:
            after(path)
    r, last = run_child(child, path, 0, 40, where)  # a last run to the end on the same log
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]
    assert check(path, last) == last
    return kills


@pytest.mark.slow
@pytest.mark.parametrize("where", ["base", "switch"])
def test_kills_during_automatic_bases_and_switches_lose_nothing(tmp_path, where):
    path = "file:" + str(tmp_path / "log")
    rng = random.Random(24 if where == "base" else 42)
    # bases every ~3 epochs, 4 slices each, and two switches per base: points come often
    points = [rng.randint(1, 40 if where == "base" else 12) for _ in range(6)]
    assert _kill_runs(CHILD, path, 6, points, where, _check) >= 5
    with Log.open(path, writable=False) as log:  # retention was at work all along
        assert list_snapshots(log) and int(log.volume.superblock.oldest_epoch) > 100


@pytest.mark.slow
def test_kills_at_random_times_of_a_retaining_session_lose_nothing(tmp_path):
    # each child gets past its imports and a few bases, then is killed wherever it is
    path = "file:" + str(tmp_path / "log")
    assert kill_at_random_lines(CHILD, path, 5, 30, random.Random(7), _check) > 0


# The same, with regions whose epochs are their bases (image entries, FORMAT.md §12.2):
# "lora" is written whole at every epoch, "state" at every tenth; kills around the
# switches that list them must lose nothing either.
def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


CHILD_IMAGES = _edit(_edit(CHILD, '''s.register("state", a)
''', '''lora = np.zeros((4, 1024), np.uint32)
s.register("state", a)
s.register("lora", lora)
'''), '''    s.checkpoint()
''', '''    if e % 10 == 0:
        a[:, 1023] = e
    lora[:] = e
    s.checkpoint()
''')


def state_with_images_at(epoch: int) -> dict:
    a = np.zeros((PAGES, 1024), np.uint32)
    for e in range(1, epoch + 1):
        a[(e * 7) % PAGES, e % 1024] = e
        a[(e * 13) % PAGES, (e * 5) % 1024] = e
        if e % 10 == 0:
            a[:, 1023] = e
    return {"state": a, "lora": np.full((4, 1024), epoch, np.uint32)}


def _check_images(path: str, seen: int) -> int:
    log = Log.open(path, writable=False)
    try:
        last = int(log.last_committed_epoch or 0)
        assert seen <= last <= seen + 1, (seen, last)
        if last:
            for epoch in {last, int(log.volume.superblock.oldest_epoch) or last}:
                got = apply_plan_numpy(log, plan(log, epoch))
                for name, want in state_with_images_at(epoch).items():
                    np.testing.assert_array_equal(got[name], want, err_msg=f"{name} at epoch {epoch}")
        v = log.verify()
        assert v["corrupt"] == 0, v["problems"]
        return last
    finally:
        log.close()


@pytest.mark.slow
def test_kills_around_switches_that_list_image_entries_lose_nothing(tmp_path):
    path = "file:" + str(tmp_path / "log")
    rng = random.Random(77)
    images = []

    def count_images(path):
        with Log.open(path, writable=False) as log:
            images.append(sum(x.image for x in list_snapshots(log)))
    kills = _kill_runs(CHILD_IMAGES, path, 8, [rng.randint(1, 12) for _ in range(8)], "switch", _check_images,
                       after=count_images)
    assert kills >= 6 and sum(images) > 0, (kills, images)


@pytest.mark.slow
def test_kills_at_random_times_of_a_session_whose_epochs_are_images_lose_nothing(tmp_path):
    path = "file:" + str(tmp_path / "log")
    assert kill_at_random_lines(CHILD_IMAGES, path, 5, 30, random.Random(11), _check_images) > 0


# Pending epochs on shared memory (`checkpoint(wait=False)`, staging="mapped",
# the twin of the device's table pass): the pass writes each epoch's commit
# record itself, so an epoch printed (its checkpoint call returned) is
# committed; kills just before and after that record, around retention's
# switches and at random times lose nothing.
CHILD_PENDING = _edit(_edit(_edit(
    CHILD, "policy=policy)", 'policy=policy, staging="mapped")'),
    "    s.checkpoint()\n", "    s.checkpoint(wait=False)\n"),
    'wrap(Volume, "write_superblock", "switch", before=False)\n',
    'wrap(Volume, "write_superblock", "switch", before=False)\n'
    'import concordia.checkpoint.table as T\n'
    'wrap(T, "write_commit", "commit")                              # around the commit a pass writes\n')


@pytest.mark.slow
@pytest.mark.parametrize("where", ["commit", "switch"])
def test_kills_around_the_commits_pending_passes_write_lose_nothing(shm_log, where):
    rng = random.Random(31 if where == "commit" else 32)
    points = [rng.randint(2, 60) if where == "commit" else rng.randint(1, 12) for _ in range(6)]
    assert _kill_runs(CHILD_PENDING, shm_log, 6, points, where, _check) >= 5


@pytest.mark.slow
def test_kills_at_random_times_of_pending_epochs_lose_nothing(shm_log):
    assert kill_at_random_lines(CHILD_PENDING, shm_log, 5, 30, random.Random(13), _check) > 0
