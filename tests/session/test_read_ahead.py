"""A recovery read ahead (`concordia.prefetch`, `restore.ahead`): a fresh
process opens its log and restores the latest epoch on a thread while it
builds what the state goes into; the recovery it then asks for copies from
it, and decides everything as a recovery from the log does."""

from __future__ import annotations

import numpy as np
import pytest

import concordia
from concordia import Session
from concordia.root_error import ConcordiaError

from .state import LOG_SIZE, SEGMENT, make_state, register_all
from .test_restore_deferred import _flip, _page_offset


def _written(spec, epochs: int = 3) -> dict:
    """A log of `epochs` epochs of every kind of region; the state at the last one."""
    state = make_state(3)
    with Session(spec, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True) as s:
        register_all(s, state)
        s.checkpoint()
        for e in range(epochs - 1):
            state["kv"].reshape(-1)[e * 300] += 1.0
            state["sched"][e] = 1000 + e
            s.checkpoint()
    return {n: a.copy() for n, a in state.items()}


def _blank(state: dict, fill=0) -> dict:
    return {n: np.full_like(a, fill) for n, a in state.items()}


def test_the_recovery_copies_from_the_read_ahead_and_the_session_goes_on_in_deltas(persistent_log):
    want = _written(persistent_log)
    p = concordia.prefetch(persistent_log)
    targets = _blank(want)
    s = p.session()
    try:
        register_all(s, targets)        # the session's first call waits for the read
        assert s.ahead.done.is_set()
        s.recover(into="registered")
        for n, a in want.items():
            assert targets[n].tobytes() == a.tobytes(), n
        ph = s.last_recovery.phases
        assert ph["read_ahead"]["used"] is True and ph["read_ahead"]["why_not"] is None
        assert ph["read_ahead"]["epoch_seen"] == s.last_recovery.epoch == 3
        assert ph["read_ahead"]["open_s"] > 0 and ph["read_ahead"]["read_s"] > 0
        assert ph["copy"]["bytes"] == sum(a.nbytes for a in want.values())
        assert "parts" not in ph["copy"]               # host targets: no device copies to wait for
        assert "plan" not in ph and "open" not in ph   # the log was planned and read on the thread
        read = ph["read_ahead"]["read"]                # ... and there, phase by phase, as a recovery says
        assert set(read) >= {"plan", "check_copy", "present"} and read["check_copy"]["bytes"] > 0
        assert s.ahead.got is None                    # its arrays went with the copy
        # the next checkpoint continues from the recovered state: one page of one region
        targets["sched"][7] = -5
        st = s.checkpoint()
        assert st.epoch == 4 and sum(st.pages.values()) == 1
    finally:
        s.close()
    with Session(persistent_log, create=False, readonly=True) as r:
        got = r.recover()
        assert got["sched"][7] == -5 and got["kv"].tobytes() == want["kv"].tobytes()


def test_new_arrays_are_the_read_aheads_own(shm_log):
    want = _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        got = s.recover()
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert s.last_recovery.phases["copy"]["bytes"] == 0
        assert s.last_recovery.plan_ms == 0   # planned on its thread
    assert {n: a.tobytes() for n, a in got.items()} == {n: a.tobytes() for n, a in want.items()}


def test_another_epoch_or_a_mode_is_read_from_the_log(shm_log):
    _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        older = s.recover(2)
        ph = s.last_recovery.phases
        assert ph["read_ahead"]["used"] is False and "epoch 2 was asked for, it read 3" in ph["read_ahead"]["why_not"]
        assert "plan" in ph and s.last_recovery.epoch == 2
        with Session(shm_log, create=False, readonly=True) as plain:
            expect = plain.recover(2)
        assert {n: a.tobytes() for n, a in older.items()} == {n: a.tobytes() for n, a in expect.items()}
        # the read ahead's arrays went with that recovery: the next one reads the log too
        s.recover()
        assert s.last_recovery.phases["read_ahead"]["why_not"] == \
            "its arrays were let go (a recovery before passed it over)"
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        with pytest.raises(concordia.PlanError):   # a bool is no epoch, as the log's planner says
            s.recover(True)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        s.recover(mode="skip_corrupt")
        assert "mode='skip_corrupt' was asked for" in s.last_recovery.phases["read_ahead"]["why_not"]


def test_an_epoch_committed_since_the_read_is_recovered_from_the_log(shm_log):
    want = _written(shm_log)
    p = concordia.prefetch(shm_log, readonly=True)
    p.wait()
    state = _blank(want)
    with Session(shm_log, create=False) as w:   # a writer commits epoch 4 after the read
        register_all(w, state)
        w.recover(into="registered")
        state["blob"][3] ^= 0xFF
        assert w.checkpoint().epoch == 4
    with p.session() as s:
        got = s.recover()
        ph = s.last_recovery.phases["read_ahead"]
        assert ph["used"] is False and "committed to since it read (epoch 3, now 4)" in ph["why_not"]
        assert s.last_recovery.epoch == 4 and got["blob"].tobytes() == state["blob"].tobytes()


def test_damage_is_decided_as_a_recovery_from_the_log_and_leaves_the_targets(file_log):
    """A page of the newest epoch's record damaged: the log's open decides that
    epoch is a torn tail, and the read ahead holds the one before it, as a
    recovery from the log does.  A damaged page that makes the log refuse
    fails the read ahead; the recovery from the log refuses alike, and every
    target stays as it was."""
    want = _written(file_log)
    _flip(file_log, _page_offset(file_log, "sched", 0, -1) + 3)
    with Session(file_log, create=False, readonly=True) as plain:
        expect = plain.recover()
        expect_epoch = plain.last_recovery.epoch
    with concordia.prefetch(file_log, readonly=True).session() as s:
        got = s.recover()
        ph = s.last_recovery.phases["read_ahead"]
        assert ph["used"] is True and s.last_recovery.epoch == expect_epoch == 2
        assert {n: a.tobytes() for n, a in got.items()} == {n: a.tobytes() for n, a in expect.items()}

    _written(file_log)
    _flip(file_log, _page_offset(file_log, "adapter", 1, 0) + 1)   # the base's page: no epoch has it whole
    with Session(file_log, create=False, readonly=True) as plain:
        with pytest.raises(ConcordiaError) as refused:
            plain.recover()
    targets = _blank(want, 7)
    with concordia.prefetch(file_log).session() as s:
        with pytest.raises(type(refused.value)) as again:
            s.recover(into=targets)
        assert str(again.value) == str(refused.value)
        assert s.ahead.used is False and s.ahead.why_not.startswith("the read ahead failed (")
    assert all((a == 7).all() for a in targets.values())


def test_a_region_absent_at_the_epoch_is_refused_before_any_copy(shm_log):
    want = _written(shm_log)
    targets = {**_blank(want, 9), "late": np.full(64, 9, np.int32)}
    with concordia.prefetch(shm_log).session() as s:
        register_all(s, {n: targets[n] for n in want})
        s.register("late", targets["late"], kind="scheduler", page_bytes=256)
        with pytest.raises(concordia.AbsentRegionError, match="late"):
            s.recover(into="registered")
        # the register wrote the region's descriptor: the session let the read go
        assert s.ahead.why_not == "its arrays were let go (the session wrote to the log)"
        assert all((a == 9).all() for a in targets.values())
    _written(shm_log)   # afresh: no descriptor of "late" left behind
    with concordia.prefetch(shm_log).session() as s:
        register_all(s, {n: targets[n] for n in want})
        s.register("late", targets["late"], kind="scheduler", page_bytes=256)
        s.recover(into="registered", absent="keep")
        assert s.last_recovery.kept == ["late"]
    assert (targets["late"] == 9).all() and targets["kv"].tobytes() == want["kv"].tobytes()


def test_a_refusal_leaves_the_read_ahead_for_the_call_that_follows(shm_log):
    """A region with no state at the epoch read (registered after it): refused
    before anything is written, and the read ahead stays for the retry with
    absent="keep", which copies from it."""
    want = _written(shm_log)
    late = np.full(64, 9, np.int32)
    with Session(shm_log, create=False) as w:   # "late" first written at epoch 4: no state at epoch 3
        register_all(w, _blank(want))
        w.recover(into="registered")
        w.register("late", np.ones(64, np.int32), kind="scheduler", page_bytes=256)
        assert w.checkpoint().epoch == 4
    targets = _blank(want)
    with concordia.prefetch(shm_log, readonly=True, target=3).session() as s:
        with pytest.raises(concordia.AbsentRegionError, match="late"):
            s.recover(3, into={**targets, "late": late})
        assert s.ahead.used is False and s.ahead.got is not None
        s.recover(3, into={**targets, "late": late}, absent="keep")
        assert s.last_recovery.phases["read_ahead"]["used"] is True and s.last_recovery.kept == ["late"]
    assert (late == 9).all() and targets["kv"].tobytes() == want["kv"].tobytes()


def test_a_region_the_session_adds_lets_the_read_go_without_a_region_list(shm_log):
    """No targets, no regions=: the session's register of a region the log
    lacks writes its descriptor, so the read ahead is let go and the
    recovery is the log's: the new region is refused, or kept."""
    _written(shm_log)
    with concordia.prefetch(shm_log).session() as s:
        s.register("late", np.full(64, 9, np.int32), kind="scheduler", page_bytes=256)
        with pytest.raises(concordia.AbsentRegionError, match="late"):
            s.recover()
        assert s.ahead.why_not == "its arrays were let go (the session wrote to the log)"
        got = s.recover(absent="keep")
        assert s.last_recovery.kept == ["late"] and "late" not in got


def test_a_session_closed_at_once_waits_for_the_read(shm_log, monkeypatch):
    """The read is held back until close() has begun: close must wait for it."""
    import threading

    from concordia.restore import run as restore_run

    _written(shm_log)
    closing, restore = threading.Event(), restore_run.restore

    def slow(*a, **kw):
        assert closing.wait(timeout=60), "close() did not begin"
        return restore(*a, **kw)

    monkeypatch.setattr(restore_run, "restore", slow)
    s = concordia.prefetch(shm_log, readonly=True).session()
    assert not s.ahead.done.is_set()
    closing.set()
    s.close()
    assert s.ahead.done.is_set() and s.ahead.got is None and s.ahead.error is None
    assert s.ahead.dropped == "the session closed"
    with pytest.raises(concordia.SessionClosedError):
        s.recover()


def test_a_log_that_does_not_open_is_the_sessions_error(tmp_path):
    p = concordia.prefetch(str(tmp_path / "none.log"))
    with pytest.raises(concordia.PathNotFoundError):
        p.session()
    p.wait()   # and the read ahead ended, saying why
    assert p.ahead.error.startswith("the log did not open")


def test_a_session_that_writes_first_lets_the_read_go(shm_log):
    want = _written(shm_log)
    state = _blank(want)
    with concordia.prefetch(shm_log).session() as s:
        register_all(s, state)
        assert s.ahead.got is not None
        s.checkpoint()   # the session's own state, not a recovery's: the read ahead is of no use now
        assert s.ahead.got is None and s.ahead.dropped == "the session wrote to the log"


def test_a_prefetch_given_up_closes_its_session_and_lets_the_read_go(shm_log):
    """A caller that does not recover after all (its model did not build)."""
    _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True) as p:
        s = p.session()
    assert s.closed and s.ahead.got is None and s.ahead.dropped == "the session closed"
    with concordia.prefetch(shm_log + "-none") as p:   # an open that failed: nothing to close
        pass
    assert p.ahead.error.startswith("the log did not open")


def test_a_keyword_session_does_not_take_is_refused_at_the_prefetch_call(tmp_path):
    from concordia.errors import SessionError

    for kw in ({"read_only": True}, {"create": True}):
        with pytest.raises(SessionError, match="prefetch cannot open a Session with these keywords"):
            concordia.prefetch(f"file:{tmp_path / 'none.log'}", **kw)


def test_a_second_recovery_reports_no_read_ahead_and_latest_by_number_takes_it(shm_log):
    want = _written(shm_log)
    with concordia.prefetch(shm_log, target=3, readonly=True).session() as s:
        s.recover()   # "latest" is epoch 3, the epoch the read ahead was asked for
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        got = s.recover()
        ph = s.last_recovery.phases
        assert ph["read_ahead"]["used"] is False and ph["read_ahead"]["why_not"] == "its arrays were used already"
        assert "plan" in ph
        assert all(got[n].tobytes() == a.tobytes() for n, a in want.items())


def test_a_close_interrupted_while_it_waits_for_the_read_leaves_the_session_open(shm_log, monkeypatch):
    _written(shm_log)
    s = concordia.prefetch(shm_log, readonly=True).session()

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(s.ahead, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.close()
    assert not s.closed   # its log stays open under a read that may still run
    monkeypatch.undo()
    s.close()
    assert s.closed


def test_the_pools_free_bytes_are_zero_where_cupy_is_not_loaded_or_has_no_device(monkeypatch):
    """A restore's baseline of CuPy's free blocks (`restore.run.pool_free_bytes`): 0 where CuPy is not
    imported (nothing of it to give back), and 0, not an error, where CuPy is imported but has no
    device to ask (a host restore)."""
    import sys
    import types

    from concordia.restore import run

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert run.pool_free_bytes() == 0

    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=no_device))
    assert run.pool_free_bytes() == 0
