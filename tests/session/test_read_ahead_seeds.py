"""A read ahead hashes its own arrays on its thread (`restore.ahead.Seeds`):
once a recovery copied them into the registered arrays, their page CRC tables
and fingerprints are the ones the detectors start from, and the caller's
recovery hashes none of them again.  They are the very tables the caller
would have made, the session goes on in deltas from them, and a region the
recovery did not write (not asked for, kept) is written whole at the next
checkpoint; one too large for fingerprints is fingerprinted by its detector."""

from __future__ import annotations

import numpy as np

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


def _read_back(path) -> dict:
    """The log's latest epoch, as a fresh reader recovers it."""
    with Session(path, create=False, readonly=True) as r:
        return {n: a.tobytes() for n, a in r.recover().items()}


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
    with concordia.prefetch(shm_log).session() as s:
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
        assert not s.ahead.take_seeds().held   # once
        targets["kv"].reshape(-1)[7] = 3.5    # one page of one fingerprinted region
        targets["adapter"].reshape(-1)[-1] = -1.0
        st = s.checkpoint()
        assert st.pages == {"kv": 1, "adapter": 1, "sched": 0, "blob": 8}   # "all" writes its 8 pages
    assert _read_back(shm_log) == {n: a.tobytes() for n, a in targets.items()}


def test_a_region_the_recovery_did_not_write_is_written_whole_next(shm_log):
    want = _written(shm_log)
    targets = {n: np.zeros_like(a) for n, a in want.items()}
    targets["sched"][:] = 9     # not asked for: it keeps what it holds, which the log never had
    with concordia.prefetch(shm_log).session() as s:
        _register(s, targets)
        s.recover(into="registered", regions=["kv", "adapter", "blob"])
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        sched = s.region_set.get("sched")
        assert sched.crcs is None and (targets["sched"] == 9).all()   # no seed, and no table of what it holds
        targets["sched"][0] = 10
        assert s.checkpoint().pages["sched"] == sched.pages   # whole: no delta from contents the log lacks
    assert _read_back(shm_log) == {n: a.tobytes() for n, a in targets.items()}


def test_seeds_of_a_recovery_into_targets_of_the_callers_own_are_let_go(shm_log):
    want = _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        targets = {n: np.zeros_like(a) for n, a in want.items()}   # not registered: no detector starts from them
        s.recover(into=targets)
        assert s.last_recovery.phases["read_ahead"]["used"] is True
        assert not s.ahead.seeds.held and not s.ahead.taken.held
    assert all(targets[n].tobytes() == a.tobytes() for n, a in want.items())


def test_a_region_above_the_fingerprint_bound_is_fingerprinted_by_its_detector(shm_log, monkeypatch):
    want = _written(shm_log)
    monkeypatch.setattr(ahead, "SEED_FPS_BYTES", want["adapter"].nbytes - 1)   # kv and adapter above it
    targets = {n: np.zeros_like(a) for n, a in want.items()}
    with concordia.prefetch(shm_log).session() as s:
        _register(s, targets)
        made, real = [], detect.fingerprints
        monkeypatch.setattr(detect, "fingerprints", lambda r: made.append(r.name) or real(r))
        s.recover(into="registered")
        assert sorted(made) == ["adapter", "kv"]   # by their detectors; the CRC tables came seeded
        for n in ("kv", "adapter"):
            r = s.region_set.get(n)
            assert np.array_equal(r.fps, detect.fingerprints(r)), n


def test_a_read_ahead_passed_over_seeds_nothing(shm_log):
    _written(shm_log)
    with concordia.prefetch(shm_log, readonly=True).session() as s:
        targets = {n: np.zeros_like(a) for n, a in make_state(5).items()}
        _register(s, targets)
        s.recover(1, into="registered")   # another epoch: read from the log
        assert s.last_recovery.phases["read_ahead"]["used"] is False
        assert not s.ahead.seeds.held and not s.ahead.take_seeds().held


def test_a_region_registered_at_another_page_size_or_side_is_not_seeded():
    seeds = ahead.Seeds(False, {"kv": (1024, np.zeros(1, np.uint32), np.zeros(1, np.uint64))})

    class R:
        name, on_gpu, device_aligned, page_bytes = "kv", False, True, 512

    def made(r):
        return "the caller's"
    assert seeds.crcs(R, made) == "the caller's" and seeds.fps(R) is None
    R.page_bytes = 1024
    assert seeds.crcs(R, made) is seeds.held["kv"][1] and seeds.fps(R) is seeds.held["kv"][2]
    R.on_gpu = True   # the read went to the host
    assert seeds.crcs(R, made) == "the caller's" and seeds.fps(R) is None
    assert ahead.Seeds().crcs(R, made) == "the caller's"   # none at all
