"""Pending epochs (`Session.checkpoint(wait=False)`): a table pass's epoch is
queued and committed by the session's next call, so that a decode step does
not wait for its checkpoint.  On the CPU twin (numpy regions, staging="mapped",
the host table pass) the protocol is the device's: launch, return, finish and
commit at the next call (`settle`).  What a caller relies on:

  * the statistics say `pending` with the epoch's number, and are filled in
    place when it commits;
  * every epoch recovers exactly the state of its step, also after the caller
    wrote on before it committed;
  * a crash before the commit leaves the epoch before it;
  * the log holds the same records as with wait=True;
  * retention goes on (its copies are taken at a launch, while the arrays
    hold that epoch's state) and the log of four states never fills."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from concordia import Session
from concordia.policy import Policy

from .test_write_rate import _recover_fresh, _same, decode_in_four_states

MiB = 1 << 20


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"kv": rng.integers(0, 256, (64, 4096), dtype=np.uint8),
            "lora": rng.standard_normal(8192).astype(np.float32)}


def _step(arrays: dict, t: int) -> None:
    arrays["kv"][t % 64, : 1 + t % 4096] = t % 251
    arrays["lora"] *= np.float32(0.999)


def _run(log: str, steps: int, *, wait: bool, crash_at: int | None = None, copy=None) -> tuple[Session, dict, list]:
    arrays = _state()
    s = Session(log, size=64 * MiB, segment_size=4 * MiB, staging="mapped", overwrite=True)
    for k, a in arrays.items():
        s.register(k, a)
    first = s.checkpoint(wait=wait)
    assert not first.pending  # the first writes every region whole, by region: never pending
    states, stats = {first.epoch: {k: a.copy() for k, a in arrays.items()}}, [first]
    for t in range(1, steps + 1):
        _step(arrays, t)
        st = s.checkpoint(wait=wait)
        stats.append(st)
        states[st.epoch] = {k: a.copy() for k, a in arrays.items()}
        if crash_at == t:
            copy()
        for a in arrays.values():  # the caller writes on before the epoch commits, then puts it back
            a[...] = 0
        for k, a in arrays.items():
            a[...] = states[st.epoch][k]
    return s, states, stats


def test_a_pending_epoch_commits_at_the_next_call_and_each_recovers_its_step(tmp_path):
    log = f"file:{tmp_path / 'log'}"
    arrays = _state()
    with Session(log, size=64 * MiB, segment_size=4 * MiB, staging="mapped", overwrite=True) as s:
        for k, a in arrays.items():
            s.register(k, a)
        base = s.checkpoint(wait=False)
        assert not base.pending and s.epoch == base.epoch
        states, prev = {base.epoch: {k: a.copy() for k, a in arrays.items()}}, None
        for t in range(1, 21):
            _step(arrays, t)
            st = s.checkpoint(wait=False)
            assert st.pending and st.table_pass and st.epoch == base.epoch + t
            assert s.epoch == st.epoch - 1  # committed by the next call, not this one
            assert st.to_json()["pending"] is True and st.bytes == 0
            if prev is not None:
                assert not prev.pending and "pending" not in prev.to_json()
                assert prev.pages["kv"] == 1 and prev.pages["lora"] == 8 and prev.log_bytes > prev.bytes > 0
            states[st.epoch] = {k: a.copy() for k, a in arrays.items()}
            arrays["kv"][:] = 0  # written on before the epoch commits: in no epoch
            arrays["kv"][:] = states[st.epoch]["kv"]
            prev = st
        assert s.settle() is prev and not prev.pending and s.epoch == prev.epoch
        assert s.settle() is None
        assert s.checkpoint_totals.count == 21
    with Session(log, create=False) as r:
        for epoch, want in states.items():
            assert _same(r.recover(epoch), want), epoch


def test_wait_must_be_a_bool(tmp_path):
    from concordia.errors import SessionError

    with Session(f"file:{tmp_path / 'log'}", size=64 * MiB, segment_size=4 * MiB) as s:
        s.register("a", np.zeros(4096, np.uint8))
        with pytest.raises(SessionError, match="wait must be True or False, not 'no'") as e:
            s.checkpoint(wait="no")
        assert "\n" not in str(e.value) and s.epoch == 0


def test_close_commits_a_pending_epoch(tmp_path):
    log = f"file:{tmp_path / 'log'}"
    s, states, stats = _run(log, 3, wait=False)
    assert stats[-1].pending
    s.close()
    assert not stats[-1].pending
    with Session(log, create=False) as r:
        assert r.epoch == stats[-1].epoch and _same(r.recover(), states[stats[-1].epoch])


def test_a_crash_before_the_commit_leaves_the_epoch_before_it(tmp_path):
    log = tmp_path / "log"
    image = tmp_path / "crash"
    s, states, stats = _run(f"file:{log}", 6, wait=False, crash_at=4,
                            copy=lambda: shutil.copyfile(log, image))
    s.close()
    with Session(f"file:{image}", create=False) as r:  # the log as a crash after epoch 4's launch left it
        assert r.epoch == stats[4].epoch - 1
        assert _same(r.recover(), states[stats[4].epoch - 1])


def test_pending_epochs_write_the_records_waiting_ones_write(tmp_path):
    got = {}
    for wait in (True, False):
        s, states, stats = _run(f"file:{tmp_path / f'log-{wait}'}", 12, wait=wait)
        s.settle()
        lsn = s.log.appender.last_commit_lsn
        s.close()
        got[wait] = ([(st.epoch, st.pages, st.bytes, st.log_bytes) for st in stats], s.checkpoint_totals.log_bytes,
                     lsn)
    assert got[True] == got[False]


@pytest.mark.slow
def test_every_step_pending_checkpoints_never_fill_a_log_of_four_states(shm_log):
    # test_write_rate's decode loop with wait=False: retention's jobs take their
    # copies at a launch (the arrays hold that epoch then), never a later step
    d, s, log = decode_in_four_states(shm_log, staging="mapped")
    pending = 0
    for t in range(1, 3_001):
        d.step(t)
        st = s.checkpoint(on_full="coalesce", wait=False)
        pending += st.pending
        last = {k: a.copy() for k, a in d.arrays().items()}
        d.kv[:, (t + 1) % d.rows, :] = 0  # the next step's row, written before this epoch commits
        assert not st.coalesced, (t, s.retention.pacing)
        if t == 1_000:
            s.settle()
            assert _same(_recover_fresh(log), last)
    s.settle()
    assert pending > 2_900
    assert s.retention.error is None, s.retention.error
    counts = dict(s.retention.counts)
    assert counts["jobs"] > 5 and counts["switches"] > 5 and counts.get("scans", 0) == 0, counts
    s.close()
    assert _same(_recover_fresh(log), last)


# --- the device --------------------------------------------------------------------


@pytest.mark.gpu
def test_device_pending_epochs_hold_their_step_and_write_what_waiting_ones_write(tmp_path):
    """A CuPy decode state (a cache by positions, an adapter by fingerprints)
    checkpointed with wait=False on a shm log (the device table pass): each
    epoch is queued, reserved at its upper bound and trimmed to its records,
    so the log holds what a waiting run and the numpy twin write; writes the
    caller queues right after the call (zeroing every array) are in no epoch."""
    import cupy as cp

    from concordia.regions.region import position_page_bytes
    from tests.conftest import shm_test_name
    from tests.session.staging_cases import assert_same_log, log_contents

    def run(log, xp, wait, staging):
        rng = np.random.default_rng(5)
        host_kv = np.zeros((4, 8, 96, 128), np.float16)
        host_ad = rng.standard_normal(16384).astype(np.float32)
        kv, ad = xp.asarray(host_kv), xp.asarray(host_ad)
        length = [8]
        kv[:, :, :8, :] = xp.asarray(rng.standard_normal((4, 8, 8, 128)).astype(np.float16))
        states, stats, queued = {}, [], []
        # retention off: its bases would be taken an epoch later when pending (`Retention.launched`)
        with Session(log, size=64 * MiB, segment_size=4 * MiB, overwrite=True, staging=staging,
                     policy=Policy(retain=False)) as s:
            s.register("kv", kv, kind="kv", detect="positions", page_bytes=position_page_bytes(256),
                       length=lambda: length[0])
            s.register("lora", ad, kind="adapter", detect="fingerprint")
            stats.append(s.checkpoint(wait=wait))
            for t in range(1, 25):
                kv[:, :, 8 + t, :] = xp.asarray(rng.standard_normal((4, 8, 128)).astype(np.float16))
                length[0] = 9 + t
                if t % 3:
                    ad *= np.float32(0.999)
                st = s.checkpoint(wait=wait)
                stats.append(st)
                queued.append(st.pending)
                saved = (kv.copy(), ad.copy())
                states[st.epoch] = tuple(host(a).copy() for a in saved)
                kv[...] = 0  # queued after the call: the epoch must not see it
                ad[...] = 0
                kv[...], ad[...] = saved
            s.settle()
            got = {e: s.recover(e) for e in (stats[5].epoch, stats[-1].epoch)}
            return stats, log_contents(s.log), got, states, queued

    def host(a):
        return np.asarray(a.get() if hasattr(a, "get") else a)

    name = shm_test_name("pending")
    try:
        twin = run(f"file:{tmp_path / 'twin.log'}", np, False, "mapped")
        waiting = run(f"shm:{name}", cp, True, "auto")
        pending = run(f"shm:{name}", cp, False, "auto")
        assert all(pending[4]) and not any(waiting[4]) and not any(st.pending for st in pending[0])
        assert all(set(st.via.values()) == {"gpu-mapped"} for st in pending[0][1:])
        for other in (twin, waiting):
            assert [st.pages for st in pending[0]] == [st.pages for st in other[0]]
            assert [st.log_bytes for st in pending[0]] == [st.log_bytes for st in other[0]]
            assert_same_log(pending[1], other[1])
        for epoch, arrays in pending[2].items():
            want = pending[3][epoch]
            assert host(arrays["kv"]).tobytes() == want[0].tobytes()
            assert host(arrays["lora"]).tobytes() == want[1].tobytes()
    finally:
        import os

        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
