"""Recovery that only reads takes no writer lock and cuts nothing: two
processes recover from one log while a third writes into it, all three at
once, and every recovery returns a committed epoch's exact bytes.  The
uncommitted tail is left for the next writer to cut."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from concordia import Session
from concordia.errors import SessionError
from concordia.wal import Log, compact

from . import live

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _child(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.session.live", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_epoch(proc, n: int) -> int:
    while True:
        line = proc.stdout.readline()
        assert line, f"writer ended early: {proc.stderr.read()}"
        if line.startswith("epoch ") and int(line.split()[1]) >= n:
            return int(line.split()[1])


@pytest.mark.parametrize("tier", ["file", "shm"])
def test_two_readers_recover_while_a_third_process_writes(tier, tmp_path, request):
    if tier == "file":
        log = f"file:{tmp_path / 'live.log'}"
    else:
        name = f"concordia-test-live-{os.getpid()}-{time.time_ns()}"
        log = f"shm:{name}"
        request.addfinalizer(lambda: os.path.exists(f"/dev/shm/{name}") and os.unlink(f"/dev/shm/{name}"))
    stop = tmp_path / "stop"
    writer = _child("writer", log, str(stop))
    try:
        first = _wait_for_epoch(writer, 3)
        readers = [_child("reader", log, "8", "create-false"), _child("reader", log, "8", "readonly")]
        outs = []
        for r in readers:
            out, err = r.communicate(timeout=120)
            assert r.returncode == 0, err
            outs.append(out.split("\n"))
        assert writer.poll() is None, "the writer must still be writing when the readers are done"
        stop.touch()
        rest, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        last = max(int(x.split()[1]) for x in rest.split("\n") if x.startswith("epoch "))
    finally:
        if writer.poll() is None:
            writer.kill()
    for out in outs:
        lines = [x for x in out if x]
        assert len(lines) == 8 and all(x.startswith("ok ") for x in lines), lines
        epochs = [int(x.split()[1]) for x in lines]
        assert all(first <= e <= last for e in epochs)
        assert epochs == sorted(set(epochs))  # each reader waited for a later epoch: the log grew under it
    # nothing was cut by the readers: the writer's last commit is the log's
    with Log.open(log, writable=False) as lg:
        assert lg.last_committed_epoch == last


def _log_with_a_tail(tmp_path):
    """A log whose last epoch has records and no commit (a writer died mid-epoch)."""
    log = f"file:{tmp_path / 'tail.log'}"
    data = np.arange(8 * 4096, dtype=np.uint8)
    with Session(log, size=8 << 20, segment_size=1 << 20) as s:
        s.register("r", data, page_bytes=4096)
        s.checkpoint()
        want = data.copy()
        data[:4096] = 7
        app = s.log.appender
        app.append_page_batch(2, 0, np.array([0], np.uint32), data[:4096].reshape(1, 4096))
        app.sync()  # the records are on the media, their commit never came
    return log, want


def test_recovery_neither_locks_nor_cuts_the_tail(tmp_path):
    from concordia.devmem import open_backend
    from concordia.devmem.errors import LockedError

    log, want = _log_with_a_tail(tmp_path)
    holder = open_backend(log)
    holder.lock()  # another writer holds the log throughout
    try:
        with pytest.raises(LockedError):
            Log.open(log, writable=True)
        for kw in ({}, {"readonly": True}):
            with Session(log, create=False, **kw) as s:
                assert not s.log.writable
                assert any(d.kind == "uncommitted" for d in s.log.dropped)
                assert s.recover()["r"].tobytes() == want.tobytes()
                assert s.last_recovery.epoch == 1
        with Session(log, create=False) as s:  # its first write needs the lock
            s.register("r", np.zeros_like(want), page_bytes=4096)
            with pytest.raises(LockedError):
                s.checkpoint()
    finally:
        holder.close()


def test_readers_change_no_byte(tmp_path):
    log, want = _log_with_a_tail(tmp_path)
    path = pathlib.Path(log.split(":", 1)[1])
    before = path.read_bytes()
    for kw in ({}, {"readonly": True}):
        with Session(log, create=False, **kw) as s:
            assert s.recover()["r"].tobytes() == want.tobytes()
    assert path.read_bytes() == before  # the tail is left for the next writer
    with Session(log, create=False) as s:  # the next writer cuts it, at its first write
        s.register("r", np.zeros_like(want), page_bytes=4096)
        s.recover(into="registered")
        assert path.read_bytes() == before
        st = s.checkpoint()
        # the cut dropped epoch 2's uncommitted records, so 2 is the next epoch; a delta
        # from the recovered state (no page changed)
        assert s.log.writable and st.epoch == 2 and st.pages == {"r": 0}
    with Log.open(log, writable=False) as lg:
        assert not [d for d in lg.dropped if d.kind == "uncommitted"]
        assert lg.last_committed_epoch == 2


def test_a_write_after_another_writer_committed_is_a_full_checkpoint(tmp_path):
    log, want = _log_with_a_tail(tmp_path)
    s = Session(log, create=False)
    r = np.zeros_like(want)
    s.register("r", r, page_bytes=4096)
    s.recover(into="registered")
    with Session(log, create=False) as other:  # commits epoch 2 while `s` only read
        other.register("r", np.full_like(want, 9), page_bytes=4096)
        other.checkpoint()
    st = s.checkpoint()  # the log moved on under `s`: its CRC tables say nothing of epoch 2
    assert st.pages == {"r": 8} and st.epoch == 3
    s.close()
    with Session(log, create=False) as s2:
        assert s2.recover()["r"].tobytes() == r.tobytes()


def test_a_read_only_session_refuses_to_write_and_reads_afresh(tmp_path):
    log, want = _log_with_a_tail(tmp_path)
    with pytest.raises(SessionError, match="create=False"):
        Session(log, readonly=True)
    with Session(log, create=False, readonly=True) as ro:
        ro.register("r", np.zeros_like(want), page_bytes=4096)  # the log holds it: nothing is written
        with pytest.raises(SessionError, match="read-only") as ei:
            ro.checkpoint()
        assert "\n" not in str(ei.value)
        with pytest.raises(SessionError, match="read-only"):
            ro.register("other", np.zeros(4096, np.uint8))
        with Session(log, create=False) as w:  # a writer commits epoch 2 meanwhile
            w.register("r", np.full_like(want, 5), page_bytes=4096)
            w.checkpoint()
        assert ro.recover()["r"].tobytes() == np.full_like(want, 5).tobytes()
        assert ro.last_recovery.epoch == 2 and ro.epoch == 2


def test_a_read_only_recovery_opens_the_log_again_only_when_its_writer_moved_on(tmp_path):
    """A recovery right after a read-only open, or after the writer only began
    an epoch, reads the log as the open did (the log is not walked a second
    time); a commit, or segments freed by compaction, since the open make it
    open the log again, and it restores the newest epoch."""
    path = f"file:{tmp_path / 'log'}"
    a = np.zeros(64 * 1024, np.uint8)
    with Session(path, size=16 << 20, segment_size=1 << 20) as w:
        w.register("a", a, page_bytes=4096)
        for e in range(1, 41):   # 40 epochs of every page: segments for compaction to free
            a[::4096] = e
            w.checkpoint()
        with Session(path, create=False, readonly=True) as ro:
            opened = ro.log
            assert ro.recover()["a"].tobytes() == a.tobytes() and ro.log is opened   # right after the open
            rid = w.log.regions["a"].id
            w.log.appender.append_page_batch(41, rid, np.arange(2, dtype=np.uint32),
                                             np.full((2, 4096), 9, np.uint8))   # an epoch begun, not committed
            w.log.appender.sync()
            assert ro.recover()["a"].tobytes() == a.tobytes() and ro.log is opened
    with Session(path, create=False) as w:   # a writer again: it cuts that tail and commits epoch 41
        w.register("a", a, page_bytes=4096)
        with Session(path, create=False, readonly=True) as ro:
            opened = ro.log
            a[0] = 41
            w.checkpoint()
            got = ro.recover()["a"]
            assert ro.log is not opened and ro.last_recovery.epoch == 41 and got.tobytes() == a.tobytes()
            opened = ro.log
            rep = compact(w.log, keep_bases=1, keep_epochs=0)   # segments freed: the superblock moves on
            assert rep.segments_freed
            got = ro.recover()["a"]
            assert ro.log is not opened and ro.last_recovery.epoch == 41 and got.tobytes() == a.tobytes()


def test_moved_on_reads_on_from_where_it_stopped_through_a_writers_cut(tmp_path):
    """`Log.moved_on` keeps its place past the last commit between calls (a read
    ahead asks first, the recovery again).  A tail it has walked that a writer
    then cuts and writes again, with a commit, is seen; once yes, it stays yes."""
    path = f"file:{tmp_path / 'log'}"
    a = np.zeros(64 * 1024, np.uint8)
    with Session(path, size=16 << 20, segment_size=1 << 20) as w:
        w.register("a", a, page_bytes=4096)
        w.checkpoint()
        ro = Log.open(path, writable=False)
        try:
            assert ro.moved_on() is False
            rid = w.log.regions["a"].id
            for _ in range(3):   # an epoch begun, not committed: walked by the next question, still no
                w.log.appender.append_page_batch(2, rid, np.arange(2, dtype=np.uint32),
                                                 np.full((2, 4096), 9, np.uint8))
            w.log.appender.sync()
            assert ro.moved_on() is False and ro.moved_on() is False
        except BaseException:
            ro.close()
            raise
    try:
        assert ro.moved_on() is False   # the writer went, nothing committed
        with Session(path, create=False) as w:   # a writer again: it cuts that tail and commits epoch 2 there
            w.register("a", a, page_bytes=4096)
            a[0] = 2
            w.checkpoint()
        assert ro.moved_on() is True and ro.moved_on() is True
    finally:
        ro.close()
