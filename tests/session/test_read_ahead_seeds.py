"""A read ahead hashes its own arrays on its thread (`restore.ahead.Seeds`):
once a recovery copied them into the registered arrays, their page CRC tables
and fingerprints are the ones the detectors start from, and the caller's
recovery hashes none of them again.  They are the very tables the caller
would have made, the session goes on in deltas from them, and a region the
recovery did not write (not asked for, kept, too large for fingerprints)
is hashed by the caller as before."""

from __future__ import annotations

import numpy as np
import pytest

import concordia
from concordia import Session
from concordia.checkpoint import detect, staging
from concordia.restore import ahead

from .state import LOG_SIZE, SEGMENT, make_state

PAGE = {"kv": 1024, "adapter": 4096, "sched": 256, "blob": 128}
DETECT = {"kv": "fingerprint", "adapter": "fingerprint", "sched": "shadow", "blob": "all"}


def _register(s, state):
    for n, a in state.items():
        s.register(n, a, page_bytes=PAGE[n], detect=DETECT[n])


def _written(path) -> dict:
    state = make_state(5)
    with Session(path, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True) as s:
        _register(s, state)
        s.checkpoint()
        state["kv"].reshape(-1)[100] += 1.0
        s.checkpoint()
    return {n: a.copy() for n, a in state.items()}


def _no_hashing_by_the_caller(monkeypatch, names):
    real_crcs, real_fps = staging.page_crcs, detect.fingerprints

    def crcs(r):
        assert r.name not in names, f"the caller hashed {r.name!r} again"
        return real_crcs(r)

    def fps(r):
        assert r.name not in names, f"the caller fingerprinted {r.name!r} again"
        return real_fps(r)
    monkeypatch.setattr(concordia.session, "page_crcs", crcs)
    monkeypatch.setattr(detect, "fingerprints", fps)


def test_the_detectors_start_from_the_read_aheads_tables_and_go_on_in_deltas(shm_log, monkeypatch):
    want = _written(shm_log)
    targets = {n: np.zeros_like(a) for n, a in want.items()}
    s = concordia.prefetch(shm_log).session()
    try:
        _register(s, targets)
        _no_hashing_by_the_caller(monkeypatch, set(want))
        s.recover(into="registered")
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert s.last_recovery.phases["read_ahead"]["seeds_s"] >= 0
        monkeypatch.undo()
        for r in s.region_set:   # the tables the caller would have made
            assert np.array_equal(r.crcs, staging.page_crcs(r)), r.name
            if r.detect == "fingerprint":
                assert np.array_equal(r.fps, detect.fingerprints(r)), r.name
        assert s.ahead.take_seeds() is None   # once
        targets["kv"].reshape(-1)[7] = 3.5    # one page of one fingerprinted region
        targets["adapter"].reshape(-1)[-1] = -1.0
        st = s.checkpoint()
        assert st.pages == {"kv": 1, "adapter": 1, "sched": 0, "blob": 8}   # "all" writes its 8 pages
    finally:
        s.close()
    with Session(shm_log, create=False, readonly=True) as r:
        got = r.recover()
    assert got["kv"].tobytes() == targets["kv"].tobytes() and got["adapter"].tobytes() == targets["adapter"].tobytes()


def test_a_region_the_recovery_did_not_write_is_written_whole_next(shm_log):
    want = _written(shm_log)
    targets = {n: np.zeros_like(a) for n, a in want.items()}
    targets["sched"][:] = 9     # not asked for: it keeps what it holds, which the log never had
    s = concordia.prefetch(shm_log).session()
    try:
        _register(s, targets)
        s.recover(into="registered", regions=["kv", "adapter", "blob"])
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        sched = s.region_set.get("sched")
        assert sched.crcs is None and (targets["sched"] == 9).all()   # no seed, and no table of what it holds
        targets["sched"][0] = 10
        assert s.checkpoint().pages["sched"] == sched.pages   # whole: no delta from contents the log lacks
    finally:
        s.close()
    with Session(shm_log, create=False, readonly=True) as r:
        got = r.recover()
    assert got["sched"].tobytes() == targets["sched"].tobytes() and got["kv"].tobytes() == want["kv"].tobytes()


def test_seeds_of_a_recovery_into_targets_of_the_callers_own_are_let_go(shm_log):
    want = _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        targets = {n: np.zeros_like(a) for n, a in want.items()}   # not registered: no detector starts from them
        s.recover(into=targets)
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert s.ahead.seeds is None and s.ahead.taken is None
    assert all(targets[n].tobytes() == a.tobytes() for n, a in want.items())


def test_a_region_above_the_fingerprint_bound_is_fingerprinted_by_its_detector(shm_log, monkeypatch):
    want = _written(shm_log)
    monkeypatch.setattr(ahead, "SEED_FPS_BYTES", want["adapter"].nbytes - 1)   # kv and adapter above it
    targets = {n: np.zeros_like(a) for n, a in want.items()}
    s = concordia.prefetch(shm_log).session()
    try:
        _register(s, targets)
        made, real = [], detect.fingerprints
        monkeypatch.setattr(detect, "fingerprints", lambda r: made.append(r.name) or real(r))
        s.recover(into="registered")
        assert sorted(made) == ["adapter", "kv"]   # by their detectors; the CRC tables came seeded
        for n in ("kv", "adapter"):
            r = s.region_set.get(n)
            assert np.array_equal(r.fps, detect.fingerprints(r)), n
    finally:
        s.close()


def test_a_read_ahead_passed_over_seeds_nothing(shm_log):
    _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        targets = {n: np.zeros_like(a) for n, a in make_state(5).items()}
        _register(s, targets)
        s.recover(1, into="registered")   # another epoch: read from the log
        assert s.last_recovery.phases["read_ahead"]["used"] is False
        assert s.ahead.seeds is None and s.ahead.take_seeds() is None


@pytest.mark.parametrize("page_bytes", [512])
def test_a_region_registered_at_another_page_size_is_not_seeded(shm_log, page_bytes):
    _written(shm_log)
    seeds = ahead.Seeds(False)
    seeds.page_bytes["kv"], seeds.crc["kv"], seeds.fp["kv"] = 1024, np.zeros(1, np.uint32), np.zeros(1, np.uint64)

    class R:
        name, on_gpu, device_aligned = "kv", False, True
    R.page_bytes = page_bytes
    assert seeds.crcs(R) is None and seeds.fps(R) is None
    R.page_bytes = 1024
    assert seeds.crcs(R) is not None and seeds.fps(R) is not None
