"""The hot standby's follow-and-apply protocol on the CPU twin (`Mirror`): a
log followed while its writer appends, bases, compacts and frees segments,
is SIGKILLed at random points and starts again on the same log; at every poll
the mirror equals a committed epoch, and after each kill it equals the last
one the log holds, as a fresh recovery restores it."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from concordia import Session
from concordia.devmem import open_backend
from concordia.mirror import Mirror
from concordia.wal import Log
from concordia.wal.errors import CorruptionError

from tests.session.test_retention_crash import CHILD, state_at


def _hot_takeover(path: str, device: str, lines: int, kill_after_s: float):
    """The retention crash child as the primary on `path`; a following
    standby on `device` warmed once the log exists; the primary SIGKILLed
    `kill_after_s` after `lines` more epochs, while the standby waits and
    follows (its own thread polls the mirror between tries of the writer
    lock).  Returns (standby, takeover)."""
    from concordia.standby import Standby

    p = subprocess.Popen([sys.executable, "-c", CHILD, path, "0", "100000", "none"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip().isdigit()
        sb = Standby(path, follow=True, device=device)
        rep = sb.warm()
        assert rep["device"] == device and rep["mirror_epoch"] >= 1
        for _ in range(lines):
            assert p.stdout.readline().strip().isdigit()
        threading.Timer(kill_after_s, p.send_signal, (signal.SIGKILL,)).start()
        return sb, sb.run(timeout=60)
    finally:
        p.kill()
        p.communicate(timeout=30)


def _last_committed(path: str) -> int:
    log = Log.open(path, writable=False)
    try:
        return int(log.last_committed_epoch or 0)
    finally:
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["file", "shm"])
def test_the_mirror_equals_a_committed_epoch_at_every_poll_through_random_kills(tier, tmp_path, request):
    if tier == "file":
        path = f"file:{tmp_path / 'mirror.log'}"
    else:
        from tests.session.conftest import _fresh_shm_log

        gen = _fresh_shm_log()
        path = next(gen)
        request.addfinalizer(lambda: next(gen, None))
    rng = random.Random(31 if tier == "file" else 32)
    mirror, backend, polls, seen = None, None, 0, 0
    for _ in range(4):
        p = subprocess.Popen([sys.executable, "-c", CHILD, path, "0", "100000", "none"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(10 + rng.randint(0, 40)):
                ln = p.stdout.readline()
                assert ln.strip().isdigit(), (ln, p.stderr.read() if p.poll() is not None else "")
                seen = int(ln)
                if mirror is None:   # the log exists once the child printed its first epoch
                    backend = open_backend(path)
                    mirror = Mirror(backend)
                if rng.random() < 0.6:
                    e = mirror.poll()
                    polls += 1
                    assert e >= 1
                    np.testing.assert_array_equal(mirror.arrays["state"], state_at(e), err_msg=f"epoch {e}")
            time.sleep(rng.random() * 0.03)
        finally:
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=30)
        e = mirror.poll()   # the writer is gone: everything it committed, nothing after
        last = _last_committed(path)
        assert seen <= e == last, (seen, e, last)
        np.testing.assert_array_equal(mirror.arrays["state"], state_at(e), err_msg=f"epoch {e} after the kill")
    assert polls >= 4 and mirror.epochs_applied > 0
    backend.close()


@pytest.mark.parametrize("kill_at,start_at", [(143, 1), (257, 1), (377, 1), (401, 1), (257, 120), (401, 200)])
def test_a_takeover_open_from_the_mirrors_walk_cuts_as_its_own_walk_would(tmp_path, kill_at, start_at):
    """A writer with retention (segments freed and reused) kills itself at a
    point of its epochs, compaction or snapshots while a mirror follows.  The
    writable open that starts from the mirror's walk (`Log.open(walked=)`)
    finds what a walk of its own finds in a copy of the log, and both leave
    the same bytes behind.  The open takes the mirror's walk up to where the
    follower stands, inside the segment it stands in (at kill 401 the writer
    died just after taking a new segment, before a commit in it), and walks
    on from there.  A mirror started late (`start_at` lines of the writer)
    holds its restore's walk up to the epoch's commit, and follows from there."""
    import shutil

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    p = subprocess.Popen([sys.executable, "-c", CHILD, f"file:{a}", str(kill_at), "100000", "any"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mirror = None
    for n, ln in enumerate(p.stdout, 1):
        if mirror is None and n >= start_at:
            mirror = Mirror(open_backend(f"file:{a}"))
        if mirror is not None:
            mirror.poll()
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    mirror.poll()   # the writer is dead: to the end of what it wrote
    shutil.copyfile(a, b)
    mine = Log.open(mirror.backend, writable=True, check_pages="last", walked=mirror.walked)
    theirs = Log.open(f"file:{b}", writable=True, check_pages="last")
    try:
        assert mine.open_stats["walked_before_lsn"] == mirror.follower.lsn and theirs.open_stats["walked_before_lsn"] == 0
        for log in (mine, theirs):
            assert log.last_committed_epoch == mirror.epoch
        assert [(c.epoch, c.lsn) for c in mine.commits] == [(c.epoch, c.lsn) for c in theirs.commits]
        assert [(r.lsn, r.type, r.epoch) for r in mine.records()] == [(r.lsn, r.type, r.epoch)
                                                                       for r in theirs.records()]
        assert mine.regions == theirs.regions
        assert mine.appender.write_lsn == theirs.appender.write_lsn
    finally:
        theirs.close()
        mine.close()
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("kept", [True, False], ids=["walk-kept", "walk-too-long"])
def test_a_mirror_started_on_a_long_log_follows_from_the_commit_it_restored(tmp_path, monkeypatch, kept):
    """The mirror's first restore walks the log once: the follower starts just
    past the commit of the epoch restored, not at the log's start, and a
    takeover's open from the mirror's walk matches its own walk.  When the
    restore's open keeps no walk (more records than `walk_kept` allows) the commit
    is found from the decision (`Log.last_commit_record`), the follower still
    starts past it, and a takeover's open walks the log itself."""
    import concordia.wal.reader as R

    if not kept:
        monkeypatch.setattr(R, "WALK_KEPT_MAX", 16)
        monkeypatch.setattr(R, "WALK_KEPT_LOG_BYTES", 1 << 40)
    path = f"file:{tmp_path / 'log'}"
    a = np.zeros((64, 256), np.uint32)
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        for i in range(40):
            a[i % 64, i] = i + 1
            s.checkpoint()
        m = Mirror(open_backend(path))
        log = Log.open(path, writable=False)
        try:
            walk = log.walk_through_commit()
            commit = log.last_commit_record()
        finally:
            log.close()
        assert (walk is not None) == kept
        if kept:   # the decision's commit is the walk's
            items, walked = walk
            assert items[-1] == walked and (commit.seg.index, commit.offset, commit.header) == \
                (walked.seg.index, walked.offset, walked.header)
        assert m.epoch == 40 and commit.header.epoch == 40
        assert m.follower.lsn == commit.seg.lsn(commit.offset) + commit.length
        assert m.follower.poll() == []   # nothing walked again
        for i in range(40, 45):
            a[i % 64, i] = i + 1
            st = s.checkpoint()
        assert m.poll() == st.epoch == 45
        np.testing.assert_array_equal(m.arrays["a"], a)
        now = Log.open(path, writable=False)
        try:
            took = m.walked(now.volume)
        finally:
            now.close()
    if kept:
        assert took is not None and took[1] == m.follower.lsn
        assert [it.header.lsn for it in took[0]][:len(items)] == [it.header.lsn for it in items]
    else:
        assert took is None   # the mirror holds no walk of what lies before the commit
    mine = Log.open(m.backend, writable=True, check_pages="last", walked=m.walked)
    try:
        assert mine.open_stats["walked_before_lsn"] == (m.follower.lsn if kept else 0)
        assert mine.last_committed_epoch == 45
    finally:
        mine.close()


def test_a_mirror_follows_regions_added_and_short_last_pages(tmp_path):
    path = f"file:{tmp_path / 'log'}"
    rng = np.random.default_rng(3)
    a = np.zeros((16, 1024), np.uint32)
    b = np.zeros(10_000, np.uint8)              # its last page is short
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        s.checkpoint()
        m = Mirror(open_backend(path))
        assert m.epoch == 1 and set(m.arrays) == {"a"}
        s.register("b", b)
        for i in range(12):
            a[rng.integers(0, 16), rng.integers(0, 1024)] = i + 1
            b[9_999 - i] = i + 1
            st = s.checkpoint()
            if i % 4 == 3:
                assert m.poll() == st.epoch
                np.testing.assert_array_equal(m.arrays["a"], a)
                np.testing.assert_array_equal(m.arrays["b"], b)
        s.register("c", np.zeros(5000, np.int16))   # defined in the log, no state until the next epoch
        again = Mirror(open_backend(path))           # a mirror started in between holds it as zeros
        assert again.epoch == s.epoch and not again.arrays["c"].any()
        again.backend.close()
        a[0, 0] = 99
        s.checkpoint(wait=True)
        a[0, 0] = 100                           # not checkpointed: the mirror never sees it
        assert m.poll() == s.epoch and int(m.arrays["a"][0, 0]) == 99 and set(m.arrays) == {"a", "b", "c"}
        assert m.resyncs == 0 and m.pages_applied > 0
        m.backend.close()


def test_a_mirror_hashes_the_pages_it_applies_and_no_others(tmp_path, monkeypatch):
    """The first poll after a start walks the whole log: the epochs the mirror
    restored are read record by record, their pages not hashed again; then
    exactly the pages of each new epoch are."""
    from concordia.wal.reader import Scanner

    path = f"file:{tmp_path / 'log'}"
    a = np.zeros((64, 1024), np.uint32)
    hashed = []
    real = Scanner._entries   # every page batch a walk hashes goes through here
    monkeypatch.setattr(Scanner, "_entries",
                        lambda self, batches: hashed.extend(int(h.epoch) for _, _, h in batches) or real(self, batches))
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        for i in range(5):
            a[i, :] = i + 1
            s.checkpoint()
        m = Mirror(open_backend(path))
        hashed.clear()
        assert m.poll() == 5 and hashed == []
        a[9, 3] = 7
        a[40, 0] = 8
        assert s.checkpoint().epoch == 6
        assert m.poll() == 6
        np.testing.assert_array_equal(m.arrays["a"], a)
        assert hashed and set(hashed) == {6}
    m.backend.close()


def test_damage_the_writer_left_behind_is_one_line_and_the_mirror_keeps_its_epoch(tmp_path):
    """A page flipped in a record of a segment the writer has left: the poll
    says so in one line, and the mirror stays at the epoch before it."""
    path = f"file:{tmp_path / 'log'}"
    a = np.zeros(32 * 4096, np.uint8)
    states = {}
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        states[s.checkpoint().epoch] = a.copy()
        m = Mirror(open_backend(path))
        a[5] = 1
        states[s.checkpoint().epoch] = a.copy()
        a[70_000] = 2
        damaged = s.checkpoint().epoch
        rec = [r for r in s.log.records() if r.epoch == damaged and r.region_id == s.log.region("a").id][-1]
        for _ in range(12):                     # every page, 12 times: the writer leaves that segment
            a[:] += 1
            s.checkpoint()
    with open(path[len("file:"):], "r+b") as f:  # one byte of the damaged epoch's last page flipped
        f.seek(rec.offset + rec.length - 64)
        byte = f.read(1)
        f.seek(rec.offset + rec.length - 64)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptionError, match="page CRC") as e:
        m.poll()
    assert "\n" not in str(e.value)
    assert m.epoch == damaged - 1
    np.testing.assert_array_equal(m.arrays["a"], states[m.epoch])
    m.backend.close()


@pytest.mark.slow
def test_a_following_standby_takes_over_from_its_mirror_at_the_last_commit(tmp_path):
    """Standby(follow=True) keeps the mirror while the primary writes (bases,
    compaction, segments freed), and after the primary's SIGKILL at a random
    point takes over from the mirror: the last committed epoch, exactly, with
    no restore from the log, and the log carries on from it."""
    rng = random.Random(7)
    path = f"file:{tmp_path / 'hot.log'}"
    sb, tk = _hot_takeover(path, "cpu", 20 + rng.randint(0, 40), rng.random() * 0.05)
    try:
        assert "mirror" in tk.restore_stats and sb.mirror_error is None, tk.restore_stats
        assert tk.epoch == tk.log.last_committed_epoch >= 1
        np.testing.assert_array_equal(tk.arrays["state"], state_at(tk.epoch))
        assert "held by the mirror" in tk.timeline[2].what
        assert set(tk.restore_stats["last_poll"]) >= {"read_s", "apply_s", "write_s", "items", "epochs"}
        with tk.session() as s:                 # the log carries on from the mirror's epoch
            s.register("state", tk.arrays["state"])
            tk.arrays["state"][0, 0] = 7
            assert s.checkpoint().epoch == tk.epoch + 1
    finally:
        tk.close()
        sb.close()
    assert _last_committed(path) == tk.epoch + 1


@pytest.mark.gpu
def test_a_device_mirror_follows_as_its_numpy_twin_does(tmp_path):
    """Mirror(device=True): CuPy arrays, restored and then written by each
    commit's pages, equal the writer's state at every poll and the numpy
    mirror's arrays, with the same CRC tables."""
    import cupy as cp

    path = f"file:{tmp_path / 'devmirror.log'}"
    rng = np.random.default_rng(5)
    a = np.zeros((16, 1024), np.uint32)
    b = np.zeros(10_000, np.uint8)              # a short last page
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        s.register("b", b)
        s.checkpoint()
        dev, host = Mirror(open_backend(path), device=True), Mirror(open_backend(path))
        assert isinstance(dev.arrays["a"], cp.ndarray)
        for i in range(12):
            a[rng.integers(0, 16), rng.integers(0, 1024)] = i + 1
            b[9_999 - i] = i + 1
            st = s.checkpoint()
            if i % 3 == 2:
                assert dev.poll() == host.poll() == st.epoch
                cp.cuda.get_current_stream().synchronize()
                for name, want in (("a", a), ("b", b)):
                    np.testing.assert_array_equal(cp.asnumpy(dev.arrays[name]), want)
                    np.testing.assert_array_equal(host.arrays[name], want)
        assert all(np.array_equal(dev._crcs[k], host._crcs[k]) for k in host._crcs)
        dev.backend.close()
        host.backend.close()


@pytest.mark.gpu
def test_a_following_standby_on_the_gpu_takes_over_from_its_device_mirror(tmp_path):
    import cupy as cp

    sb, tk = _hot_takeover(f"file:{tmp_path / 'hot-gpu.log'}", "gpu", 30, 0.01)
    assert sb.mirror.device
    try:
        assert "mirror" in tk.restore_stats, tk.restore_stats
        assert tk.epoch == tk.log.last_committed_epoch >= 1
        np.testing.assert_array_equal(cp.asnumpy(tk.arrays["state"]), state_at(tk.epoch))
    finally:
        tk.close()
        sb.close()


def test_a_poll_writes_each_region_once_and_an_epoch_that_fails_its_digest_not_at_all(tmp_path, monkeypatch):
    """Epochs of a primary checkpointing every step, read in one poll: their
    pages reach each region in one write, a page several of them wrote as
    the latest wrote it.  An epoch whose digest does not match leaves the
    arrays and the page CRC tables at the epoch before it."""
    from concordia.gpu_kernels import reference as ref
    from concordia.wal import format as F

    path = f"file:{tmp_path / 'log'}"
    a = np.zeros((16, 1024), np.uint32)   # 16 pages of 4 KiB
    b = np.zeros(8 * 4096, np.uint8)
    states = {}
    with Session(path, size=8 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        s.register("b", b)
        first = s.checkpoint().epoch
        m, failing = Mirror(open_backend(path)), Mirror(open_backend(path))
        for i in range(9):
            a[i % 3, i] = i + 1          # pages 0-2 of `a`, each written by three epochs
            b[4096 * (i % 2)] = i + 1
            states[s.checkpoint().epoch] = (a.copy(), b.copy())
    writes = []
    real = Mirror._write_pages
    monkeypatch.setattr(Mirror, "_write_pages", lambda self, info, ids, rows: (
        writes.append((info.name, [int(x) for x in ids])), real(self, info, ids, rows))[1])
    assert m.poll() == first + 9
    assert sorted(writes) == [("a", [0, 1, 2]), ("b", [0, 1])]
    # the poll says where its time went: 9 epochs of at least 3 records each (two batches, a commit)
    lp = m.last_poll
    assert (lp["epochs"], lp["resynced"]) == (9, False) and lp["items"] >= 27, lp
    assert all(lp[k] >= 0 for k in ("read_s", "apply_s", "write_s"))
    for k, name in enumerate("ab"):
        np.testing.assert_array_equal(m.arrays[name], states[first + 9][k])
    m.backend.close()

    calls = []
    real_digest = F.region_digest
    # two regions an epoch: the 9th digest is the fifth epoch's first
    monkeypatch.setattr(F, "region_digest", lambda crcs: real_digest(crcs) ^ (len(calls.append(1) or calls) == 9))
    writes.clear()
    with pytest.raises(CorruptionError, match="differs from the digest"):
        failing.poll()
    assert failing.epoch == first + 4 and len(writes) == 2
    for k, name in enumerate("ab"):
        np.testing.assert_array_equal(failing.arrays[name], states[first + 4][k])
        info = next(i for i in failing._info.values() if i.name == name)
        flat = failing.arrays[name].reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(failing._crcs[info.id], ref.crc32c_pages(flat, page_bytes=info.page_bytes))
    failing.backend.close()


def test_a_poll_over_epochs_of_many_sizes_writes_each_page_as_the_last_epoch_wrote_it(tmp_path, monkeypatch):
    """Thirty epochs, each writing a random set of pages (one to all sixteen),
    read in one poll: the region gets one write of every page any of them
    wrote, each with the bytes of the last epoch that wrote it."""
    path = f"file:{tmp_path / 'log'}"
    rng = np.random.default_rng(11)
    a = np.zeros((16, 1024), np.uint32)   # 16 pages of 4 KiB
    with Session(path, size=16 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        s.checkpoint()
        m = Mirror(open_backend(path))
        touched = set()
        for e in range(30):
            pages = rng.choice(16, size=int(rng.integers(1, 17)), replace=False)
            a[pages, int(rng.integers(0, 1024))] = e + 1
            touched.update(int(p) for p in pages)
            s.checkpoint()
    writes = []
    real = Mirror._write_pages
    monkeypatch.setattr(Mirror, "_write_pages", lambda self, info, ids, rows: (
        writes.append([int(x) for x in ids]), real(self, info, ids, rows))[1])
    m.poll()
    assert writes == [sorted(touched)] and m.last_poll["epochs"] == 30
    np.testing.assert_array_equal(m.arrays["a"], a)
    m.backend.close()


EXITING_PRIMARY = """
import os, sys, time
import numpy as np
from concordia import Session
spec, release = sys.argv[1], sys.argv[2]
a = np.zeros((16, 1024), np.uint32)
s = Session(spec, size=8 << 20, segment_size=1 << 20)
s.register("state", a)
s.checkpoint()
parent = os.getpid()
if os.fork() == 0:
    # shares the log's descriptor, so the writer lock stays held after the primary dies,
    # as a SIGKILLed primary holds it through its teardown, until the test says
    while not os.path.exists(release):
        time.sleep(0.005)
    os._exit(0)
e = 1
while True:
    e += 1
    a[e % 16, e % 1024] = e
    s.checkpoint()
    print(e, flush=True)
"""


def _exiting_state(epoch: int) -> np.ndarray:
    a = np.zeros((16, 1024), np.uint32)
    for e in range(2, epoch + 1):
        a[e % 16, e % 1024] = e
    return a


def _through_a_kill(script: str, path: str, flag, *, lines: int = 20, resume=None, while_held=None, **standby):
    """`script` as the primary on `path` (argv: path, flag: a file it waits for
    before letting go of the writer lock, which a forked child shares); a
    following standby (`standby`: Standby's options, device "cpu" unless
    given) warmed after the primary's first line, `lines` more lines read;
    `Standby.run(resume)` on a thread; the primary SIGKILLed; then
    `while_held(standby, runner)` and the flag made (without it, `resume`
    makes the flag).  Returns (standby, takeover)."""
    from concordia.standby import Standby

    p = subprocess.Popen([sys.executable, "-c", script, path, str(flag)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = {}
    try:
        assert p.stdout.readline().strip().isdigit()
        sb = Standby(path, follow=True, **{"device": "cpu", **standby})
        sb.warm()
        for _ in range(lines):
            assert p.stdout.readline().strip().isdigit()
        runner = threading.Thread(target=lambda: got.update(tk=sb.run(resume, timeout=60)))
        runner.start()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        if while_held is not None:
            while_held(sb, runner)
            flag.touch()   # the lock comes free (else `resume` makes the flag)
        runner.join(timeout=60)
    finally:
        flag.touch()
        p.kill()
        p.communicate(timeout=30)
    return sb, got["tk"]


def _carries_on(path: str, sb, tk) -> None:
    """The log carries on from the takeover's epoch: a checkpoint through
    `tk.session()` commits the next one; then both are closed."""
    try:
        with tk.session() as s:
            s.register("state", tk.arrays["state"])
            tk.arrays["state"][0, 0] = 7
            assert s.checkpoint().epoch == tk.epoch + 1
    finally:
        tk.close()
        sb.close()
    assert _last_committed(path) == tk.epoch + 1


def test_a_following_standby_decides_the_log_while_its_primary_exits(tmp_path):
    """A hot standby that sees its primary exiting before the writer lock comes
    free (a SIGKILLed primary's teardown) and waits for the lock (early=False)
    makes the takeover's decision of the log meanwhile; with the lock held and
    nothing new in the log, the open takes that decision: the last committed
    epoch, exactly, and the log carries on from it."""
    path = f"file:{tmp_path / 'log'}"

    def while_held(sb, runner):
        deadline = time.monotonic() + 30
        while sb._decided is None and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sb._decided is not None, "the standby made no decision while the lock was held"

    sb, tk = _through_a_kill(EXITING_PRIMARY, path, tmp_path / "release", early=False, while_held=while_held)
    try:
        assert tk.restore_stats["open"]["decided_before_s"] > 0 and "locked" in tk.stamps
        assert tk.stamps["detected"] <= tk.stamps["locked"] <= tk.stamps["isolated"]
        assert "mirror" in tk.restore_stats and "decided meanwhile" in tk.timeline[1].what
        assert tk.epoch == tk.log.last_committed_epoch >= 21
        np.testing.assert_array_equal(tk.arrays["state"], _exiting_state(tk.epoch))
    except BaseException:
        tk.close()
        sb.close()
        raise
    _carries_on(path, sb, tk)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_an_early_takeover_resumes_while_the_lock_is_held_and_confirms_after(tmp_path, device, monkeypatch):
    """A hot standby (early, the default) whose primary's every thread is
    exiting hands the mirror's epoch to the caller while the writer lock is
    still held (here by a child sharing the log's descriptor, as a SIGKILLed
    primary's teardown holds it); the lock, the open and the log's decision
    follow beside the caller, and the log carries on from that epoch."""
    # the killed primary's threads seen exiting however long a loaded machine takes to run them to it
    # (the bound matters only for threads already dying): the early takeover is always the one taken
    monkeypatch.setattr("concordia.standby.EARLY_THREADS_S", 60.0)
    path, release = f"file:{tmp_path / 'log'}", tmp_path / "release"
    seen = []

    def resume(tk):
        # the child still holds the lock: nothing lets it go before this line
        a = tk.arrays["state"]
        seen.append((tk.epoch, tk.pending is not None, a.get() if device == "gpu" else a.copy()))
        tk.resumed()
        release.touch()
        return "resumed"

    sb, tk = _through_a_kill(EXITING_PRIMARY, path, release, device=device, resume=resume)
    try:
        assert [(e, pending) for e, pending, _ in seen] == [(tk.epoch, True)] and tk.result == "resumed"
        np.testing.assert_array_equal(seen[0][2], _exiting_state(tk.epoch))
        st = tk.stamps
        assert st["detected"] <= st["isolated"] <= st["restored"] <= st["resumed"] <= st["locked"] <= st["confirmed"]
        assert "early" in tk.restore_stats and "mirror" in tk.restore_stats
        assert [ph.phase for ph in tk.timeline] == ["detect", "isolate", "restore", "confirm", "reintegrate"]
        assert tk.epoch == tk.log.last_committed_epoch >= 21 and sb.mirror.device == (device == "gpu")
    except BaseException:
        tk.close()
        sb.close()
        raise
    _carries_on(path, sb, tk)


REVOKING_PRIMARY = """
import os, sys, time
import numpy as np
from concordia import Session
spec, go = sys.argv[1], sys.argv[2]
a = np.zeros((16, 1024), np.uint32)
s = Session(spec, size=8 << 20, segment_size=1 << 20)
s.register("state", a)
for e in range(1, 6):
    a[e % 16, e % 1024] = e
    s.checkpoint()
if os.fork() == 0:
    # shares the log's descriptor and its writer lock: once told, after the primary's
    # death, it commits one more epoch (as no process of a primary could once every
    # thread of it is exiting) and exits
    while not os.path.exists(go):
        time.sleep(0.005)
    a[6 % 16, 6 % 1024] = 6
    s.checkpoint()
    os._exit(0)
print(s.epoch, flush=True)
while True:
    time.sleep(3600)
"""


def test_an_early_takeover_the_log_does_not_confirm_is_resumed_again_from_the_decided_epoch(tmp_path,
                                                                                          monkeypatch):
    """An early takeover resumed from epoch 5; a process sharing the dead
    primary's descriptor then commits epoch 6 before the lock comes free.
    The confirmation finds the log decides 6: the takeover is revoked, epoch
    6 is restored from the log and the caller resumes again from it; the log
    carries on from 6."""
    # the killed primary's threads seen exiting however long a loaded machine takes to run them to it
    # (the bound matters only for threads already dying): the early takeover is always the one taken
    monkeypatch.setattr("concordia.standby.EARLY_THREADS_S", 60.0)
    path, go = f"file:{tmp_path / 'log'}", tmp_path / "go"
    seen = []

    def resume(tk):
        seen.append((tk.epoch, tk.arrays["state"].copy()))
        go.touch()   # the child commits epoch 6 now, then lets the lock go
        return len(seen)

    sb, tk = _through_a_kill(REVOKING_PRIMARY, path, go, lines=0, resume=resume)
    try:
        want = {e: np.zeros((16, 1024), np.uint32) for e in (5, 6)}
        for e, a in want.items():
            for k in range(1, e + 1):
                a[k % 16, k % 1024] = k
        assert [e for e, _ in seen] == [5, 6] and tk.result == 2
        for e, a in seen:
            np.testing.assert_array_equal(a, want[e])
        assert tk.epoch == tk.log.last_committed_epoch == 6
        assert "epoch 5" in tk.restore_stats["revoked"] and "epoch 6" in tk.restore_stats["revoked"]
        np.testing.assert_array_equal(tk.arrays["state"], want[6])
    except BaseException:
        tk.close()
        sb.close()
        raise
    _carries_on(path, sb, tk)
