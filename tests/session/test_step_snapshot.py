"""The CPU twin of the device's snapshot (`Arena.take`, `ResidentExecutor`'s
trigger): a step held for its epoch goes once the epoch has read every
region, and the epoch crosses into the arena, its commit last, while the
producer goes on.  What the epoch commits is what it read at the step, not
what the producer writes after; a crash while it crosses recovers the epoch
before.  Where the producer goes on is set by events, never by a delay."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint.arena import Arena
from concordia.policy import Policy

STEPS = 12
WAIT_S = 60   # what a step that has been let go needs to write (it never comes close)


def _write(a, k: int) -> None:
    """Step `k`'s writes: one byte in a page of its own, and one in the first
    page, which every epoch writes (so that a read after the release would
    take the next step's byte there)."""
    a[(k * 97) % a.shape[0], (k * 13) % a.shape[1]] = k % 251
    a[0, k % a.shape[1]] = k % 251


def _state(k: int) -> np.ndarray:
    a = np.zeros((64, 1024), np.uint8)
    for j in range(1, k + 1):
        _write(a, j)
    return a


def _session(log: str) -> Session:
    return Session(log, size=32 << 20, segment_size=4 << 20, executor="resident", policy=Policy(retain=False))


def _region(s) -> np.ndarray:
    """The region the producer writes, registered, with its base committed."""
    a = np.zeros((64, 1024), np.uint8)
    s.register("a", a, detect="shadow", page_bytes=4096)
    s.checkpoint()
    return a


def _watch_crossings(monkeypatch, s):
    """Each arena epoch that lets its step go: at the release, whether the
    arena still lacks it; after, wait until the producer has written its next
    step, then let the epoch cross.  Returns ({step: written}, [(epoch,
    count, both held)])."""
    written = {k: threading.Event() for k in range(1, STEPS + 2)}
    crossed = []
    take = Arena.take

    def watched(self, tpass, *, snapshot=None, release=None):
        if release is None:
            return take(self, tpass, snapshot=snapshot, release=release)
        at = self.word("used")
        before = bytes(self.ext.view[at:at + 64])   # where the epoch's first record goes

        def late(epoch):
            count = s.resident.trigger_.counter.read()   # the gate is closed: the step it holds
            not_in_arena = bytes(self.ext.view[at:at + 64]) == before
            release(epoch)
            went_on = count >= STEPS or written[count + 1].wait(WAIT_S)
            crossed.append((epoch, count, not_in_arena and went_on))

        return take(self, tpass, snapshot=snapshot, release=late)

    monkeypatch.setattr(Arena, "take", watched)
    return written, crossed


def _produce(s, a, written):
    tr = s.resident.step_trigger(1)
    for k in range(1, STEPS + 1):
        _write(a, k)
        written[k].set()
        tr.step()
    return tr


def test_the_step_goes_once_its_epoch_is_read_and_the_epoch_keeps_what_it_read(shm_log, monkeypatch):
    with _session(shm_log) as s:
        a = _region(s)
        written, crossed = _watch_crossings(monkeypatch, s)
        tr = _produce(s, a, written)
        assert not tr.errors and [c for _, c in tr.fired] == list(range(1, STEPS + 1))
        tr.disarm()
        s.settle()
        # every epoch was let go before it reached the arena, and its producer wrote on meanwhile
        assert [(e, c) for e, c, _ in crossed] == tr.fired and all(ok for *_, ok in crossed)
        assert tr.snapshot_epochs == STEPS and s.resident.info()["trigger"]["snapshot_epochs"] == STEPS
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in tr.fired:   # what it read at its step, not the next step's write
            np.testing.assert_array_equal(s.recover(epoch)["a"], _state(count), err_msg=f"epoch {epoch}")


def test_with_no_snapshot_the_step_holds_until_its_commit_is_in_the_arena(shm_log, monkeypatch):
    with _session(shm_log) as s:
        a = _region(s)
        s.resident.snapshot_max = 0
        written, crossed = _watch_crossings(monkeypatch, s)
        tr = _produce(s, a, written)
        tr.disarm()
        s.settle()
        assert crossed == [] and tr.snapshot_epochs == 0 and tr.trigger.in_arena == STEPS
        for epoch, count in tr.fired:
            np.testing.assert_array_equal(s.recover(epoch)["a"], _state(count), err_msg=f"epoch {epoch}")


class _Writes(np.ndarray):
    """An arena view that notes each slice written into it, in order."""

    def __setitem__(self, key, value):
        self.order.append((key.start or 0, key.stop))
        super().__setitem__(key, value)


def test_an_epoch_crosses_records_first_then_the_zeroed_slot_then_its_commit():
    arena = np.full(1024, 0xEE, np.uint8).view(_Writes)
    arena.order = []
    snap = np.arange(300, dtype=np.uint8)
    Arena._cross(arena, snap, 200, 100)
    assert arena.order == [(0, 200), (300, 364), (200, 300)]
    assert bytes(arena[:300]) == bytes(snap) and not arena[300:364].any() and (arena[364:] == 0xEE).all()


def test_an_epoch_that_fails_after_its_step_went_is_not_listed_and_the_log_keeps_the_one_before(
        shm_log, monkeypatch):
    cross, seen = Arena._cross, []

    def failing(view, snap, used, commit):
        seen.append(used)
        if len(seen) == 3:
            raise OSError("the arena could not be written")
        cross(view, snap, used, commit)

    monkeypatch.setattr(Arena, "_cross", staticmethod(failing))
    with _session(shm_log) as s:
        a = _region(s)
        tr = s.resident.step_trigger(1)
        for k in range(1, 4):
            _write(a, k)
            tr.step()
        s.settle()   # the consumer is done with the failed epoch
        assert not tr.armed and "could not be written" in tr.errors[-1]
        assert [c for _, c in tr.fired] == [1, 2] and tr.snapshot_epochs == 2
        assert s.log.verify()["corrupt"] == 0
        np.testing.assert_array_equal(s.recover()["a"], _state(2))
        np.testing.assert_array_equal(s.recover(tr.fired[-1][0])["a"], _state(2))
        st = s.checkpoint()   # every region whole after the failure: the state as it is now
        np.testing.assert_array_equal(s.recover(st.epoch)["a"], _state(3))


CHILD = r"""
import os, signal, sys, threading
import numpy as np
sys.path.insert(0, sys.argv[4])
from tests.session.test_step_snapshot import _region, _session, _write, STEPS
from concordia.checkpoint.arena import Arena

log, kill_at, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
written = {k: threading.Event() for k in range(1, STEPS + 2)}
take, cross = Arena.take, Arena._cross

armed = []

def watched(self, tpass, *, snapshot=None, release=None):
    def late(epoch):
        count = s.resident.trigger_.counter.read()   # the gate is closed: the step it holds
        release(epoch)
        if count == kill_at:
            written[count + 1].wait(60)   # the producer has written its next step
            if where == "released":
                os.kill(os.getpid(), signal.SIGKILL)
            armed.append(epoch)
    return take(self, tpass, snapshot=snapshot, release=late if release is not None else None)

class KillAtCommit(np.ndarray):
    def __setitem__(self, key, value):
        if key.start == self.commit_at:   # the records and the slot after the commit are in, not the commit
            os.kill(os.getpid(), signal.SIGKILL)
        super().__setitem__(key, value)

def crossing(view, snap, used, commit):
    if armed:   # the epoch of step kill_at, its step let go: the real crossing, cut at its commit
        view = view.view(KillAtCommit)
        view.commit_at = used
    cross(view, snap, used, commit)

Arena.take, Arena._cross = watched, staticmethod(crossing)
s = _session(log)
a = _region(s)
print("base", s.epoch, flush=True)
tr = s.resident.step_trigger(1)
for k in range(1, STEPS + 1):
    _write(a, k)
    written[k].set()
    tr.step()
    print("step", k, flush=True)
"""


@pytest.mark.parametrize("where", ["released", "records"])
def test_a_crash_while_an_epoch_crosses_into_the_arena_recovers_the_epoch_before(shm_log, where):
    kill_at = 7
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", CHILD, shm_log, str(kill_at), where, root],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr   # killed where asked, not ended otherwise
    lines = [line.split() for line in p.stdout.splitlines()]
    base = int(lines[0][1])
    # step kill_at was let go before the kill; the next one held for its epoch, which never came
    assert [int(w[1]) for w in lines[1:]] == list(range(1, kill_at + 1))
    with Session(shm_log, create=False, readonly=True) as s:
        assert s.log.verify()["corrupt"] == 0
        # the last commit is the step before: the crossing epoch's records, if any, have no commit
        assert s.epoch == base + kill_at - 1
        np.testing.assert_array_equal(s.recover()["a"], _state(kill_at - 1))
