"""The standby protocol on the CPU: the writer lock as the lease on the
primary's life, a takeover after SIGKILL (uncommitted tail cut, state exact),
two standbys racing, a primary that comes back, a standby on a log no one
holds, and the heartbeat lease catching a hung primary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.devmem.errors import LockedError
from concordia.standby import Heartbeat, Standby, StandbyError, lease_path, read_lease

from .primary import state, write

EPOCHS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the repository root last: `tests.standby.primary` is found there, the installed package first
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}
CLI = [sys.executable, "-c", "import sys; from concordia.tools.cli import main; sys.argv[0] = 'concordia'; main()"]


def _remove_log(path):
    """Unlink a test log and the lease file a killed primary may have left for it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    lease = os.path.join("/dev/shm", f"concordia-lease-{st.st_dev:x}-{st.st_ino:x}")
    if os.path.exists(lease):
        os.unlink(lease)
    os.unlink(path)


@pytest.fixture
def shm_log():
    name = f"concordia-test-standby-{uuid.uuid4().hex[:10]}"
    yield f"shm:{name}"
    _remove_log(f"/dev/shm/{name}")


@pytest.fixture(params=["shm", "hugetlb"])
def any_log(request, shm_log):
    if request.param == "shm":
        yield shm_log
        return
    where = request.getfixturevalue("hugetlb_mount")
    path = os.path.join(where, f"standby-{uuid.uuid4().hex[:10]}")
    yield f"hugetlb:{path}"
    _remove_log(path)


def _same(arrays, epoch):
    want = state(epoch)
    assert set(arrays) == set(want)
    for k in want:
        assert arrays[k].dtype == want[k].dtype and arrays[k].shape == want[k].shape
        assert arrays[k].tobytes() == want[k].tobytes(), k


class Primary:
    """A primary process (tests/standby/primary.py) that has committed EPOCHS
    epochs and holds the log until killed."""

    def __init__(self, spec, *extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.standby.primary", spec, str(EPOCHS), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), self.proc.stderr.read()
        self.pid = self.proc.pid

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.kill()


def test_lock_wait_blocks_until_the_holder_goes(shm_log):
    with open_backend(shm_log, size=1 << 20, create=True) as first, open_backend(shm_log) as second:
        first.lock()
        with pytest.raises(LockedError) as ei:
            second.lock(wait=0.05)
        assert "another open of this log in this process" in str(ei.value)
        t = threading.Timer(0.05, first.close)
        t.start()
        second.lock(wait=True)   # returns once `first` gave the lock back
        t.join()
        assert second.locked and first.closed


def test_a_log_no_one_holds_is_taken_over_at_once(shm_log):
    write(shm_log, EPOCHS).close()
    sb = Standby(shm_log, device="cpu")
    tk = sb.run()
    try:
        assert tk.cause == "no primary held the log" and tk.primary_pid is None
        assert tk.epoch == EPOCHS
        _same(tk.arrays, EPOCHS)
        assert [p.phase for p in tk.timeline] == ["detect", "isolate", "restore", "reintegrate"]
        with pytest.raises(LockedError):   # the takeover holds the writer lock
            open_backend(shm_log).lock()
    finally:
        tk.close()
        sb.close()


def test_the_collector_is_held_off_from_the_takeover_until_the_caller_resumes(shm_log):
    """take_over holds off Python's cyclic collector (its passes over the
    open's records cost the takeover tens of milliseconds) and gives it back
    when the caller resumes, carries on or closes, and when run() ends,
    whatever `resume` did (a `resume` that raises leaves the log given back);
    a collector the caller had stopped stays stopped."""
    import gc

    write(shm_log, EPOCHS).close()
    assert gc.isenabled()
    sb = Standby(shm_log, device="cpu")
    try:
        tk = sb.take_over(sb.wait())
        assert not gc.isenabled() and tk.collector_held
        tk.resumed()
        assert gc.isenabled() and not tk.collector_held
        tk.close()
    finally:
        gc.enable()
        sb.close()

    sb = Standby(shm_log, device="cpu")
    seen = []

    def resume(tk):
        seen.append(gc.isenabled())
        raise RuntimeError("the caller's model failed")

    try:
        with pytest.raises(RuntimeError, match="model failed"):
            sb.run(resume)
        assert seen == [False] and gc.isenabled()
        b = open_backend(shm_log)
        try:
            b.lock()   # the failed takeover gave the log back
        finally:
            b.close()
    finally:
        gc.enable()
        sb.close()

    gc.disable()
    sb = Standby(shm_log, device="cpu")
    try:
        tk = sb.run()
        assert not gc.isenabled() and not tk.collector_held   # not the takeover's to turn on
        tk.close()
        assert not gc.isenabled()
    finally:
        gc.enable()
        sb.close()


def test_the_standby_opens_a_log_whose_primary_is_mid_epoch(shm_log, monkeypatch):
    # the standby's open met a record its primary had reserved and not yet written,
    # then the commit the primary wrote after it: damage before a commit, which
    # refused the warm-up; an open beside a live writer looks again
    import concordia.wal.log as log_mod
    from concordia.wal import format as F

    s = write(shm_log, EPOCHS)
    try:
        off = next(r.offset for r in s.log.records() if r.epoch == EPOCHS and r.kind == F.REC_PAGE_BATCH)
        arr = s.log.backend.array
        header = arr[off:off + F.RECORD_HEADER_SIZE].copy()
        arr[off:off + F.RECORD_HEADER_SIZE] = 0    # reserved: its header is not written yet
        real_sleep = log_mod.time.sleep
        looks = []

        def finish_the_write(seconds):
            looks.append(seconds)
            arr[off:off + F.RECORD_HEADER_SIZE] = header   # the primary finishes it
            real_sleep(seconds)

        monkeypatch.setattr(log_mod.time, "sleep", finish_the_write)
        sb = Standby(shm_log, device="cpu")
        try:
            rep = sb.warm()
            assert rep["epoch_seen"] == EPOCHS and len(looks) == 1
        finally:
            sb.close()
    finally:
        s.close()


def test_takeover_after_sigkill_cuts_the_tail_and_restores_exactly(any_log):
    with Primary(any_log, "--tail") as primary:
        def kill_once_watched(msg):   # the primary dies once the standby watches it, however slow the machine
            if msg.startswith("watching the primary"):
                primary.kill()

        sb = Standby(any_log, device="cpu", progress=kill_once_watched)
        rep = sb.warm()
        assert rep["epoch_seen"] == EPOCHS and set(rep["regions"]) == {"kv", "table"}
        assert sb.primary() == primary.pid
        seen = []

        def resume(tk):
            seen.append(tk.epoch)
            _same(tk.arrays, EPOCHS)
            tk.resumed()
            with tk.session() as s:   # carries on writing where the primary stopped
                s.register("kv", tk.arrays["kv"], kind="kv", page_bytes=4096)
                s.register("table", tk.arrays["table"], page_bytes=4096)
                tk.arrays["kv"][0] = 99
                return s.checkpoint().epoch

        tk = sb.run(resume, timeout=60)
        try:
            assert tk.cause == "the primary's writer lock came free" and tk.primary_pid == primary.pid
            assert seen == [EPOCHS] and tk.result == EPOCHS + 1
            assert tk.stamps["detected"] <= tk.stamps["isolated"] <= tk.stamps["restored"] <= tk.stamps["resumed"]
            assert all(p.ms is None or p.ms >= 0 for p in tk.timeline)
            json.dumps(tk.to_json())
        finally:
            tk.close()
            sb.close()
    from concordia.wal import Log

    with Log.open(any_log, writable=False) as log:   # the uncommitted tail is gone, the new epoch is there
        assert log.last_committed_epoch == EPOCHS + 1
        assert [c.epoch for c in log.commits] == list(range(1, EPOCHS + 2))


class StandbyCli:
    """`concordia standby SPEC --json --hold` in a child process, its output in files."""

    def __init__(self, spec, tmp_path, *extra):
        tag = uuid.uuid4().hex[:8]
        self.out, self.err = tmp_path / f"{tag}.out", tmp_path / f"{tag}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen([*CLI, "standby", spec, "--device", "cpu", "--json", "--hold", *extra],
                                         stdout=o, stderr=e, text=True, env=ENV, cwd=ROOT)
        self.pid = self.proc.pid

    def said(self, what) -> bool:
        return what in self.err.read_text()

    def report(self) -> dict:
        return json.loads(self.out.read_text())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _until(cond, what, within=60.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"waited {within} s for {what}")


def test_two_standbys_racing_exactly_one_takes_over(shm_log, tmp_path):
    with Primary(shm_log) as primary:
        a, b = StandbyCli(shm_log, tmp_path), StandbyCli(shm_log, tmp_path)
        try:
            _until(lambda: a.said("watching the primary") and b.said("watching the primary"), "both standbys")
            primary.kill()
            winner = _until(lambda: next((p for p in (a, b) if p.said("holding the log")), None), "a takeover")
            loser = b if winner is a else a
            rep = winner.report()
            assert rep["cause"] == "the primary's writer lock came free" and rep["epoch"] == EPOCHS
            assert rep["primary_pid"] == primary.pid
            # the other one keeps waiting, now behind the new primary
            assert loser.proc.poll() is None and not loser.said("took over")
            assert _lock_holder(shm_log) == winner.pid
            _until(lambda: loser.said(f"now held by pid {winner.pid}"), "the loser to see the new primary")
            winner.proc.send_signal(signal.SIGTERM)
            assert winner.proc.wait(30) == 0
            _until(lambda: loser.said("holding the log"), "the second takeover")
            rep2 = loser.report()
            assert rep2["epoch"] == EPOCHS and rep2["primary_pid"] == winner.pid
        finally:
            a.stop()
            b.stop()


def _lock_holder(spec):
    from concordia.devmem.backend import lock_holder

    with open_backend(spec) as b:
        return lock_holder(b._file_fd)


def test_a_primary_that_comes_back_is_refused_or_stands_by(shm_log):
    with Primary(shm_log) as primary:
        sb = Standby(shm_log, device="cpu")
        sb.warm()
        primary.kill()
        tk = sb.run(timeout=60)
    try:
        # the old primary restarted as a writer: refused at its first write (a
        # Session(create=False) opens read-only, lock-free, and takes the lock to write)
        back = subprocess.run([sys.executable, "-c", "import numpy as np; from concordia import Session; "
                               f"Session({shm_log!r}, create=False).register('back', np.zeros(4096, np.uint8))"],
                              capture_output=True, text=True, env=ENV, cwd=ROOT)
        assert back.returncode != 0 and "LockedError" in back.stderr
        assert f"log is open for writing by another process (pid {os.getpid()})" in back.stderr
        # ... or restarted as a standby: it waits behind the new primary (here: gives up after 0.5 s)
        r = subprocess.run([*CLI, "standby", shm_log, "--device", "cpu", "--timeout", "0.5"],
                           capture_output=True, text=True, env=ENV, cwd=ROOT)
        assert r.returncode == 2, r.stderr
        err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(err) == 1
        assert f"the primary (pid {os.getpid()}) still holds the log after 0.5 s" in err[0]
        assert "Traceback" not in r.stderr
    finally:
        tk.close()
        sb.close()


def test_heartbeat_stamps_the_lease(shm_log):
    s = write(shm_log, 1)
    try:
        with Heartbeat(s.log, period_s=0.01) as hb:
            first = read_lease(hb.path)
            assert first.pid == os.getpid() and first.period_s == pytest.approx(0.01)
            deadline = time.monotonic() + 30
            while read_lease(hb.path).beats == first.beats and time.monotonic() < deadline:
                time.sleep(0.005)
            assert read_lease(hb.path).beats > first.beats   # the thread renews it
            path = hb.path
        assert not os.path.exists(path)   # removed when the primary stops it
    finally:
        s.close()


def test_a_live_lease_keeps_the_standby_waiting(shm_log):
    with Primary(shm_log, "--heartbeat", "0.01") as primary:
        sb = Standby(shm_log, device="cpu", lease_s=5.0)
        try:
            with pytest.raises(StandbyError) as ei:
                sb.wait(timeout=0.3)
            assert f"the primary (pid {primary.pid}) still holds the log" in str(ei.value)
            assert primary.proc.poll() is None   # not killed: its lease was kept
        finally:
            sb.close()
    # taken over after the primary died: the lease file it could not remove goes
    with open_backend(shm_log, readonly=True) as b:
        lease = lease_path(b)
    assert read_lease(lease) is not None
    tk = Standby(shm_log, device="cpu").run(timeout=60)
    try:
        assert not os.path.exists(lease)
    finally:
        tk.close()


def test_an_expired_lease_isolates_a_hung_primary(shm_log):
    with Primary(shm_log, "--heartbeat", "0.01") as primary:
        sb = Standby(shm_log, device="cpu", lease_s=0.2)
        sb.warm()
        lease = read_lease(lease_path(sb.backend))
        assert lease is not None and lease.pid == primary.pid
        os.kill(primary.pid, signal.SIGSTOP)   # hung: alive, holding the lock, no more beats
        tk = sb.run(timeout=60)
        try:
            assert tk.cause.startswith("lease expired") and f"pid {primary.pid} killed" in tk.cause
            assert primary.proc.wait(30) == -signal.SIGKILL
            assert tk.epoch == EPOCHS
            _same(tk.arrays, EPOCHS)
            assert tk.timeline[0].ms >= 200   # detect: at least the lease
            assert tk.heartbeat is not None   # the new primary keeps a lease for the next standby
            assert read_lease(tk.heartbeat.path).pid == os.getpid()
        finally:
            tk.close()
            sb.close()


def test_cli_takes_over_a_log_no_one_holds_and_prints_the_timeline(shm_log):
    write(shm_log, EPOCHS).close()
    r = subprocess.run([*CLI, "standby", shm_log, "--device", "cpu"], capture_output=True, text=True,
                       env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for phase in ("detect", "isolate", "restore", "reintegrate"):
        assert f"  {phase}" in r.stdout
    assert "no process holds the log: taking over at once" in r.stderr
    r = subprocess.run([*CLI, "standby", shm_log, "--device", "cpu", "--json"], capture_output=True,
                       text=True, env=ENV, cwd=ROOT)
    rep = json.loads(r.stdout)
    assert rep["epoch"] == EPOCHS and rep["warm"]["tier"] == "shm"
    assert [p["phase"] for p in rep["timeline"]] == ["detect", "isolate", "restore", "reintegrate"]


@pytest.mark.parametrize("first", [[], ["--lock-first"]], ids=["early", "lock-first"])
def test_cli_follow_takes_over_from_the_mirror(shm_log, first):
    write(shm_log, EPOCHS).close()
    r = subprocess.run([*CLI, "standby", shm_log, "--follow", *first, "--device", "cpu", "--json"], capture_output=True,
                       text=True,
                       env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["epoch"] == EPOCHS and rep["warm"]["device"] == "cpu" and rep["warm"]["mirror_epoch"] == EPOCHS
    restore = [p for p in rep["timeline"] if p["phase"] == "restore"][0]
    assert "held by the mirror" in restore["what"]


@pytest.mark.parametrize("args,needle", [
    (["shm:concordia-test-no-such-log"], "no such file"),
    (["memory:"], "memory"),
    (["shm:x", "--resume", "nocolon"], "is not MODULE:FUNCTION"),
    (["shm:x", "--gpu", "1"], "GPU 1 was asked for with device 'cpu'"),
    (["shm:x", "--lock-first"], "pass --follow too"),
])
def test_cli_bad_input_is_one_line(args, needle):
    r = subprocess.run([*CLI, "standby", *args, "--device", "cpu"], capture_output=True, text=True,
                       env=ENV, cwd=ROOT)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.gpu
def test_gpu_standby_restores_from_its_registered_mapping(any_log):
    """On the GPU: the mapping registered while waiting is what the copy engine
    reads at the takeover; the arrays are CuPy and exact."""
    with Primary(any_log) as primary:
        sb = Standby(any_log, device="gpu")
        rep = sb.warm()
        assert rep["device"] == "gpu" and rep["kernels"] > 1 and sb.registration is not None
        primary.kill()
        tk = sb.run(timeout=60)
        try:
            assert "registered mapping" in tk.restore_stats["via"]
            _same({k: v.get() for k, v in tk.arrays.items()}, EPOCHS)
        finally:
            tk.close()
            sb.close()


def _zombie(pid: int) -> None:
    """Wait (a minute at most) until `pid`, killed or ended, is a zombie: not yet
    reaped, its other threads gone.  The leader shows "Z" as soon as it has
    exited itself, while a thread the SIGKILL has woken may not have run yet
    (on a loaded machine), and has not begun to exit."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1:
                return
        time.sleep(0.01)


def test_exit_fence_waits_only_for_a_dying_process():
    """A process alive and not exiting, a zombie and one gone are not waited
    for: wait_exited returns at its first look, without sleeping."""
    from concordia import standby

    def sleeps(pid) -> list:
        naps = []

        class Clock:   # the standby module's `time`, its sleeps counted (the process's own untouched)
            sleep = staticmethod(naps.append)

            def __getattr__(self, name):
                return getattr(time, name)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(standby, "time", Clock())
            standby.wait_exited(pid, within=30)
        return naps

    assert sleeps(os.getpid()) == []   # alive, not exiting
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_pid = child.pid
    _zombie(child_pid)
    assert sleeps(child_pid) == []
    child.wait()
    assert sleeps(child_pid) == []   # gone


def test_every_thread_of_a_live_process_is_not_exiting_of_a_killed_one_is():
    """An early takeover starts only when every thread of the primary is
    exiting: a live process with a second thread is not; SIGKILLed, as a
    zombie and once reaped, it is."""
    from concordia.standby import _all_exiting

    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\nprint('up', flush=True)\ntime.sleep(3600)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert len(os.listdir(f"/proc/{child.pid}/task")) >= 2 and not _all_exiting(child.pid)
        assert not _all_exiting(os.getpid())
        child.send_signal(signal.SIGKILL)
        _zombie(child.pid)
        assert _all_exiting(child.pid)
    finally:
        child.kill()
        child.wait()
    assert _all_exiting(child.pid)   # gone
