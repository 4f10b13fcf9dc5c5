"""The crash tests with the resident executor (CPU executor): a Session whose
epochs run on its consumer thread is SIGKILLed at random times, while it
writes BASE records, in the middle of a commit, and while device-side
triggers take the epochs; after every kill the last epoch the child saw
committed (or the one in flight) recovers bit-identical, and `verify` finds
nothing corrupt.  The same children as the host-path tests
(`test_retention_crash`), with executor="resident"."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from concordia import Session
from concordia.wal import Log

from .kill import kill_after_lines, kill_at_random_lines, run_child
from .state import LOG_SIZE, SEGMENT, assert_same, make_state, mutate, register_all
from .test_retention_crash import CHILD as HOST_CHILD
from .test_retention_crash import _check, _edit, _kill_runs
from .test_session import ROOT

CHILD = HOST_CHILD.replace("policy=policy)", "policy=policy, executor='resident')")
assert CHILD != HOST_CHILD


#: the resident child with kill points around the commit each arena epoch writes
#: (checkpoint/arena_route.py: on shm, every epoch after the first is one)
CHILD_ARENA = _edit(CHILD, 'wrap(Volume, "write_superblock", "switch", before=False)\n',
                    'wrap(Volume, "write_superblock", "switch", before=False)\n'
                    'import concordia.checkpoint.table as T\n'
                    'wrap(T, "write_commit", "commit")\n')


def _run(path, kill_at, epochs, where):
    return run_child(CHILD, path, kill_at, epochs, where)


@pytest.mark.slow
def test_resident_kills_at_random_times_lose_nothing(persistent_log):
    rng = random.Random(11 if persistent_log.startswith("file:") else 12)
    assert kill_at_random_lines(CHILD, persistent_log, 3, 20, rng, _check) > 0


@pytest.mark.slow
def test_resident_kills_while_writing_bases_lose_nothing(tmp_path):
    path = "file:" + str(tmp_path / "log")
    rng = random.Random(5)
    seen = kills = 0
    for _ in range(4):
        r, last = _run(path, rng.randint(1, 40), 120, "base")
        if r.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert r.returncode == 0, r.stderr[-2000:]
        if last is not None:
            seen = last
        seen = _check(path, seen)
    assert kills >= 3, kills


def test_an_uncommitted_resident_epoch_never_comes_back(tmp_path, persistent_log):
    """Killed inside the commit: by the host committer (file), or by the
    consumer writing the arena epoch's commit (shm: checkpoint/arena_route.py)."""
    log = persistent_log
    script = f"""
import os, signal, threading, numpy as np
from concordia import Session
from tests.session.state import make_state, register_all, mutate
s = Session({log!r}, size={LOG_SIZE}, segment_size={SEGMENT}, executor="resident")
st = make_state(); register_all(s, st); s.checkpoint()
np.savez({str(tmp_path / 'want.npz')!r}, **st)
mutate(st, 9)
def die(*a, **k):
    print(threading.current_thread().name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if {log!r}.startswith("file:"):
    s.log.appender.commit = die
else:
    import concordia.checkpoint.table as table
    table.write_commit = die
s.checkpoint()
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    assert r.stdout.split()[0].startswith("session-committer" if log.startswith("file:") else "cpu-executor-"), r.stdout
    with np.load(tmp_path / "want.npz") as z:
        want = {k: z[k] for k in z.files}
    with Session(log, create=False, executor="resident") as s:
        assert s.epoch == 1
        assert_same(s.recover(), want)
        again = make_state()
        register_all(s, again)
        s.recover(into="registered")
        assert_same(again, want)
        mutate(again, 3)
        assert s.checkpoint().epoch == 2
        assert_same(s.recover(), again)


TRIGGER_CHILD = textwrap.dedent("""
    import sys, threading, time
    import numpy as np
    from concordia import Session
    from concordia.executor.resident import PauseGate, StepCounter

    spec = sys.argv[1]
    a = np.zeros((32, 1024), np.uint32)
    step = np.zeros(1, np.uint64)
    s = Session(spec, size=16 << 20, segment_size=1 << 20, executor="resident")
    s.register("a", a)
    s.register("step", step, page_bytes=64)
    if s.epoch:
        s.recover(into="registered")
    s.checkpoint()
    counter, gate = StepCounter(), PauseGate()
    tr = s.resident.trigger(every=5, counter=counter, gate=gate)

    def device():
        k = int(step[0])
        while True:
            with gate.step():
                k += 1
                a[(k * 7) % 32, k % 1024] = k
                step[0] = k
                counter.add(1)
            time.sleep(2e-4)

    threading.Thread(target=device, daemon=True).start()
    printed = 0
    while True:                       # the caller: stalled, off the GIL, printing what the consumer committed
        time.sleep(0.2)
        # the last listed may have gone through the snapshot, its commit not yet in; the consumer commits
        # each epoch before it reads the next, so every one before it is durable
        durable = tr.fired[:-1]
        for epoch, _ in durable[printed:]:
            print(epoch, flush=True)
        printed = len(durable)
        if tr.errors:
            print("error", tr.errors, flush=True)
            sys.exit(3)
""")


def _step_state(count: int) -> np.ndarray:
    a = np.zeros((32, 1024), np.uint32)
    for k in range(1, count + 1):
        a[(k * 7) % 32, k % 1024] = k
    return a


@pytest.mark.slow
def test_kills_while_triggers_take_the_epochs_lose_nothing(persistent_log):
    """The epochs come from the consumer's trigger alone, with the caller's thread
    asleep; each recovered epoch holds the state of exactly the step it records
    (the pause gate held the producer between two steps)."""
    path = persistent_log
    rng = random.Random(4 if path.startswith("file:") else 3)
    seen = 0
    for _ in range(2):
        nums = kill_after_lines([sys.executable, "-c", TRIGGER_CHILD, path],
                                3 + rng.randint(0, 5), rng.random() * 0.1)
        assert nums, "the child printed no epoch before its kill"
        with Log.open(path, writable=False) as log:
            last = int(log.last_committed_epoch)
            assert last >= nums[-1] >= seen
            assert log.verify()["corrupt"] == 0
        with Session(path, create=False) as r:
            got_state = r.recover()
            count = int(got_state["step"][0])
            assert count > 0
            np.testing.assert_array_equal(got_state["a"], _step_state(count))
        seen = nums[-1]


@pytest.mark.slow
def test_resident_kills_around_the_arena_commits_lose_nothing(shm_log):
    """The resident executor's arena epochs on shm (its CPU twin of the device's
    route), killed just before or just after the commit an epoch writes into
    the arena, with retention on: every epoch the child saw returned is in the
    log, at most the one being written is more, each restores exactly."""
    rng = random.Random(77)
    points = [rng.randint(2, 80) for _ in range(6)]
    assert _kill_runs(CHILD_ARENA, shm_log, 6, points, "commit", _check) >= 5


#: a resident session on shm whose one region (2 MiB) is more than an arena of
#: its 1 MiB segments can hold whole: its epochs go into arenas sized by the
#: last epoch, and every fifth rewrites the region whole, which its arena loses
#: and the session's path writes (arena.py); the child prints each epoch
#: `checkpoint()` returned, with retention on
CHILD_LOST = textwrap.dedent("""
    import sys
    import numpy as np
    from concordia import Session

    spec = sys.argv[1]
    with Session(spec, size=24 << 20, segment_size=1 << 20, executor="resident", overwrite=True) as s:
        a = np.zeros(2 << 20, np.uint8)
        s.register("state", a, detect="shadow", page_bytes=4096)
        print(s.checkpoint().epoch, flush=True)
        for e in range(2, 100000):
            if e % 5 == 0:
                a[:] = e % 251
            else:
                a[4096 * (e % 512) + e % 4096] = e % 251
            print(s.checkpoint().epoch, flush=True)
""")


def _lost_state_at(epoch: int) -> np.ndarray:
    a = np.zeros(2 << 20, np.uint8)
    for e in range(2, epoch + 1):
        if e % 5 == 0:
            a[:] = e % 251
        else:
            a[4096 * (e % 512) + e % 4096] = e % 251
    return a


def _check_lost(path: str, seen: int) -> int:
    with Session(path, create=False, readonly=True) as r:
        last = int(r.epoch)
        assert seen <= last <= seen + 1, (seen, last)
        np.testing.assert_array_equal(r.recover()["state"], _lost_state_at(last), err_msg=f"epoch {last}")
        assert r.log.verify()["corrupt"] == 0
        return last


@pytest.mark.slow
def test_resident_kills_around_epochs_their_arenas_lose_lose_nothing(shm_log):
    """Killed at random times while arena epochs and lost ones (written whole
    on the session's path) follow each other: the last epoch the child saw
    returned is in the log (at most the one in flight is more), and it
    restores exactly."""
    from .kill import kill_after_lines

    rng = random.Random(31)
    for _ in range(4):
        nums = kill_after_lines([sys.executable, "-c", CHILD_LOST, shm_log], rng.randint(8, 40), rng.random() * 0.05)
        assert nums and _check_lost(shm_log, nums[-1]) >= nums[-1]
