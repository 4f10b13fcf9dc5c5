"""Bad input ends in one clear line, and loses nothing: the log and the arrays
are as they were, and the session still works once the input is fixed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from concordia import Session
from concordia.errors import (ConcordiaError, DuplicateRegionError, NothingToRecoverError, PathNotFoundError,
                              RecoverMismatchError, RegionMismatchError, SessionClosedError, SessionError,
                              ShapeChangedError, UnknownRegionError, UnsupportedArrayError)

from .state import LOG_SIZE, SEGMENT, assert_same, copy, make_state, register_all


def one_line(exc: ConcordiaError, *words):
    text = str(exc)
    assert "\n" not in text
    for w in words:
        assert w in text, (w, text)


@pytest.fixture
def session(file_log):
    s = Session(file_log, size=LOG_SIZE, segment_size=SEGMENT)
    yield s
    s.close()


def records(s):
    return [(r.type, r.epoch, r.lsn) for r in s.log.records()]


def test_register_after_close(session):
    session.close()
    with pytest.raises(SessionClosedError) as ei:
        session.register("kv", np.zeros(16, np.float32))
    one_line(ei.value, "closed", "'kv'")
    with pytest.raises(SessionClosedError):
        session.checkpoint()


def test_array_that_changed_shape_is_refused_and_nothing_is_written(session):
    state = make_state()
    register_all(session, state)
    session.checkpoint()
    before = records(session)
    state["sched"].shape = (150, 2)  # same memory, new shape
    state["kv"][0, 0, 0, 0] += 1
    with pytest.raises(ShapeChangedError) as ei:
        session.checkpoint()
    one_line(ei.value, "'sched'", "[300]", "[150, 2]")
    assert records(session) == before and session.epoch == 1
    state["sched"].shape = (300,)
    st = session.checkpoint()  # fixed: the pending KV change is still caught
    assert st.epoch == 2 and st.pages["kv"] == 1  # the refused attempt used no epoch
    assert_same(session.recover(), state)


def test_region_of_another_program_in_the_log(file_log):
    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("kv", np.zeros((4, 4), np.float32), kind="kv")
        s.checkpoint()
    with Session(file_log, create=False) as s:
        before = records(s)
        with pytest.raises(RegionMismatchError) as ei:
            s.register("kv", np.zeros((4, 4), np.float16), kind="kv")
        one_line(ei.value, "'kv'", "float32", "float16")
        with pytest.raises(RegionMismatchError) as ei:
            s.register("kv", np.zeros((8, 4), np.float32), kind="kv")
        one_line(ei.value, "[4, 4]", "[8, 4]")
        with pytest.raises(RegionMismatchError):
            s.register("kv", np.zeros((4, 4), np.float32), kind="adapter")
        assert records(s) == before
        assert s.recover()["kv"].dtype == np.float32  # the log is intact


def test_dtype_mismatch_on_recover_leaves_the_target_untouched(session):
    state = make_state()
    register_all(session, state)
    session.checkpoint()
    target = np.full(state["adapter"].shape, 7.0, np.float64)
    other = np.zeros_like(state["kv"])
    with pytest.raises(RecoverMismatchError) as ei:
        session.recover(into={"kv": other, "adapter": target})
    one_line(ei.value, "'adapter'", "float32", "float64")
    assert (target == 7.0).all() and not other.any()  # checked before anything was restored
    with pytest.raises(RecoverMismatchError) as ei:
        session.recover(into={"adapter": np.zeros((4, 2, 8, 64), np.float32)})
    one_line(ei.value, "shape")


def test_recover_names_a_region_the_log_lacks(session):
    session.register("a", np.zeros(64, np.int32))
    session.checkpoint()
    with pytest.raises(UnknownRegionError) as ei:
        session.recover(into={"b": np.zeros(64, np.int32)})
    one_line(ei.value, "'b'")


def test_recover_from_a_log_without_a_commit(session):
    session.register("a", np.zeros(64, np.int32))
    with pytest.raises(NothingToRecoverError) as ei:
        session.recover()
    one_line(ei.value, "no committed epoch")


def test_opening_a_missing_log_without_create(tmp_path):
    with pytest.raises(PathNotFoundError):
        Session(f"file:{tmp_path / 'absent.log'}", create=False)
    assert not (tmp_path / "absent.log").exists()


@pytest.mark.parametrize("args, kw, err, words", [
    (("x", [1, 2, 3]), {}, UnsupportedArrayError, ["'x'", "list"]),
    (("x", np.zeros((8, 8), np.float32)[:, ::2]), {}, UnsupportedArrayError, ["contiguous"]),
    (("x", np.zeros(0, np.float32)), {}, UnsupportedArrayError, ["empty"]),
    (("x", np.zeros(4, object)), {}, UnsupportedArrayError, ["dtype"]),
    (("x", np.zeros(64, np.float32)), {"kind": "weights"}, SessionError, ["kind", "weights"]),
    (("x", np.zeros(64, np.float32)), {"page_bytes": 100}, SessionError, ["page_bytes", "64"]),
    (("x", np.zeros(64, np.float32)), {"detect": "blocks"}, SessionError, ["block_tables"]),
    (("x", np.zeros(64, np.float32)), {"detect": "stores"}, SessionError, ["store tracker", "device array"]),
    (("", np.zeros(64, np.float32)), {}, SessionError, ["name"]),
])
def test_bad_registrations(session, args, kw, err, words):
    with pytest.raises(err) as ei:
        session.register(*args, **kw)
    one_line(ei.value, *words)
    assert session.regions == {}


def test_the_same_name_twice(session):
    a = np.zeros(64, np.float32)
    session.register("a", a)
    with pytest.raises(DuplicateRegionError) as ei:
        session.register("a", a.copy())
    one_line(ei.value, "'a'")


def test_checkpoint_with_nothing_registered(session):
    with pytest.raises(SessionError) as ei:
        session.checkpoint()
    one_line(ei.value, "no region")


def test_a_failed_checkpoint_loses_nothing(session):
    state = make_state()
    register_all(session, state)
    session.checkpoint()
    state["kv"][1, 1, 1, 1] += 3
    real = session.log.appender.commit

    def broken(*a, **k):
        raise OSError(5, "Input/output error")

    session.log.appender.commit = broken
    with pytest.raises(OSError):
        session.checkpoint()
    session.log.appender.commit = real
    st = session.checkpoint()  # the detectors were reset: everything is written again
    assert sorted(st.base) == sorted(state)
    assert_same(session.recover(), copy(state))


def test_a_checkpoint_whose_record_fails_leaves_the_writer_going(session, file_log, monkeypatch):
    # a record that cannot be written (here the host staging raises) fails its
    # checkpoint and closes its reservation with a pad record: the next
    # checkpoint commits (every region whole), the log closes, and a reader
    # recovers the new epoch exactly
    from concordia.checkpoint import staging

    state = make_state()
    register_all(session, state)
    session.checkpoint()
    state["kv"][1, 1, 1, 1] += 3
    real = staging.ref.stage_page_batch

    def broken(*a, **k):
        raise MemoryError("no memory for the pages")

    monkeypatch.setattr(staging.ref, "stage_page_batch", broken)
    with pytest.raises(MemoryError, match="no memory for the pages"):
        session.checkpoint()
    monkeypatch.setattr(staging.ref, "stage_page_batch", real)
    assert not session.log.appender.outstanding
    state["kv"][0, 1, 1, 1] += 5
    st = session.checkpoint()
    assert sorted(st.base) == sorted(state)
    assert_same(session.recover(), copy(state))
    session.close()
    with Session(file_log, create=False) as r:
        assert r.epoch == st.epoch
        assert_same(r.recover(), copy(state))


def test_a_second_session_on_the_log_does_not_reuse_a_failed_epoch(file_log):
    # session A's failed checkpoint leaves epoch 2's records of region b in the
    # log; session B on the same Log registers only a and must not commit epoch
    # 2, which would count b's uncommitted records in
    from concordia.wal import Log

    a, b = np.zeros(4096 * 4, np.uint8), np.zeros(4096 * 4, np.uint8)
    log = Log.create(file_log, size=LOG_SIZE, segment_size=SEGMENT)
    s = Session(log)
    s.register("a", a)
    s.register("b", b)
    s.checkpoint()
    b[0] = 7
    real = log.appender.commit

    def broken(*args, **kw):
        raise OSError(5, "Input/output error")

    log.appender.commit = broken
    with pytest.raises(OSError):
        s.checkpoint()
    log.appender.commit = real
    s.close()
    s2 = Session(log)
    s2.register("a", a)
    a[0] = 1
    assert s2.checkpoint().epoch == 3
    got = Session(log).recover()
    assert got["b"][0] == 0 and got["a"][0] == 1
    log.close()


@pytest.mark.parametrize("text,words", [("steps=x", ["steps='x'", "not a whole number"]),
                                        ("ms=fast", ["ms='fast'", "not a number"]),
                                        ("ms=inf", ["ms='inf'", "not a number"]),
                                        ("bytes=12Q", ["bytes='12Q'", "not a size"]),
                                        ("every=3", ["unknown field 'every'", "keep_epochs="]),
                                        ("steps=0", ["every_steps", "positive"]),
                                        ("steps=2,steps=3", ["steps= is given twice"]),
                                        ("keep_epochs", ["keep_epochs has no value"]),
                                        ("retain=maybe", ["retain='maybe'", "not on or off"]),
                                        ("base_every_bytes=1.5", ["base_every_bytes='1.5'", "not a size"]),
                                        ("base_every_bytes=0", ["base_every_bytes", "positive"]),
                                        ("keep_epochs=2.5", ["keep_epochs='2.5'", "not a whole number"]),
                                        ("keep_epochs=0", ["keep_epochs", "positive"]),
                                        ("keep_seconds=-1", ["keep_seconds", "positive"]),
                                        ("keep_seconds=soon", ["keep_seconds='soon'", "not a number"]),
                                        ("slice_bytes=-4K", ["slice_bytes='-4K'", "not a size"]),
                                        ("slice_bytes=0", ["slice_bytes", "positive"]),
                                        ("retain=none", ["retain='none'", "not on or off"])])
def test_a_bad_policy_is_one_line(text, words):
    from concordia.policy import Policy

    with pytest.raises(SessionError) as ei:
        Policy.parse(text)
    one_line(ei.value, "policy", *words)
    assert Policy.parse("steps=4, bytes=64M") == Policy(every_steps=4, every_bytes=64 << 20)


def test_policy_text_sets_the_retention_fields():
    from concordia.policy import Policy

    p = Policy.parse("steps=8, base_every_bytes=16M, keep_epochs=12, keep_seconds=30.5, slice_bytes=256K")
    assert p == Policy(every_steps=8, base_every_bytes=16 << 20, keep_epochs=12, keep_seconds=30.5,
                       slice_bytes=256 << 10)
    assert Policy.parse("retain=off") == Policy(retain=False)
    assert Policy.parse("retain=on, keep_epochs=none") == Policy(retain=True, keep_epochs=None)
    assert Policy.parse("") == Policy() and Policy.parse("").keep_epochs == 64  # the constructor's defaults


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed here: the device restore is tested in test_restore_gpu.py")
def test_recover_onto_a_gpu_without_cupy_is_one_line_and_loses_nothing(session):
    state = make_state(4)
    register_all(session, state)
    session.checkpoint()
    with pytest.raises(ConcordiaError) as e:
        session.recover(device="cupy")
    one_line(e.value, "CuPy is not importable")
    assert_same(session.recover(), state)  # the log and the session are as they were


def test_a_torn_last_commit_falls_back_to_the_epoch_before(file_log):
    # a Session opens its log checking only the last one-sync commit's pages;
    # a page of that commit's records that did not land (a crash inside its
    # sync) still drops the commit as torn, and the epoch before is recovered
    from .test_restore_transfer import flip_byte

    kv = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096)
    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("kv", kv, kind="kv", page_bytes=4096)
        s.checkpoint()
        first = kv.copy()
        kv[2] += 1
        s.checkpoint()
        assert s.log.appender.one_sync  # a file log: records and commit in one sync
        rec = [r for r in s.log.records() if r.kind == 0x01 and r.epoch == 2][0]
        offset = rec.offset + rec.length - 4096 + 100  # inside the last page of epoch 2's batch
    flip_byte(file_log, offset, 0x10)
    with Session(file_log, create=False) as s:
        assert s.log.last_committed_epoch == 1
        assert any(d.kind == "torn" and "one sync" in d.reason for d in s.log.dropped)
        assert np.array_equal(s.recover()["kv"], first)
