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
    hold that epoch's state) and the log of four states never fills;
  * where written bytes need no persist call (shared memory), the pass writes
    the commit record itself, so the epoch is durable once the pass has run,
    before the next call; the session checks that record and takes it on
    (`Appender.adopt_commit`), and refuses one that is not what its own
    commit would have written."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from concordia import Session
from concordia.policy import Policy
from tests.conftest import SHM_DIR

from .conftest import _fresh_shm_log
from .staging_cases import assert_same_log, log_contents

from .test_write_rate import _recover_fresh, _same, decode_in_four_states

MiB = 1 << 20


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"kv": rng.integers(0, 256, (64, 4096), dtype=np.uint8),
            "lora": rng.standard_normal(8192).astype(np.float32)}


def _step(arrays: dict, t: int) -> None:
    arrays["kv"][t % 64, : 1 + t % 4096] = t % 251
    arrays["lora"] *= np.float32(0.999)


def _run(log: str, steps: int, *, wait: bool, crash_at: int | None = None, copy=None,
         opened=None) -> tuple[Session, dict, list]:
    arrays = _state()
    s = Session(log, size=64 * MiB, segment_size=4 * MiB, staging="mapped", overwrite=True)
    if opened is not None:
        opened(s)
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


@pytest.mark.parametrize("tier", ["file", "shm"])
def test_pending_epochs_write_the_records_waiting_ones_write(tmp_path, tier):
    got = {}
    for wait in (True, False):
        names = iter([f"file:{tmp_path / f'log-{wait}'}"]) if tier == "file" else _fresh_shm_log()
        log = next(names)
        s, states, stats = _run(log, 12, wait=wait)
        s.settle()
        lsn = s.log.appender.last_commit_lsn
        contents = log_contents(s.log)
        s.close()
        next(names, None)  # the shm log's name ends: its file is removed
        got[wait] = ([(st.epoch, st.pages, st.bytes, st.log_bytes) for st in stats], s.checkpoint_totals.log_bytes,
                     lsn)
        # the epochs' own records and commits (retention's BASE records are
        # taken at a launch, so tagged an epoch later when pending)
        contents["batches"] = [b for b in contents["batches"] if not b["flags"]]
        got[wait, "log"] = contents
    assert got[True] == got[False]
    assert_same_log(got[True, "log"], got[False, "log"])


def test_on_shared_memory_the_pass_commits_its_epoch_before_the_next_call(tmp_path, shm_log):
    """A crash image taken right after checkpoint(wait=False) returned holds
    that epoch: the pass wrote its commit record (the twin writes it by the
    time launch returns; the device once the stream reaches it).  The
    session says the epoch before it until it has taken the commit on."""
    image = tmp_path / "crash"
    session, seen = [], []

    def copy():
        shutil.copyfile(os.path.join(SHM_DIR, shm_log.split(":", 1)[1]), image)
        seen.append(session[0].epoch)

    s, states, stats = _run(shm_log, 6, wait=False, crash_at=4, copy=copy, opened=session.append)
    assert stats[4].epoch == stats[3].epoch + 1 and seen == [stats[4].epoch - 1]
    s.close()
    with Session(f"file:{image}", create=False) as r:  # the log as a crash after epoch 4's launch left it
        assert r.epoch == stats[4].epoch
        for st in stats[:5]:
            assert _same(r.recover(st.epoch), states[st.epoch]), st.epoch


@pytest.mark.parametrize("wrong", ["aux", "count", "epoch", "crc"])
def test_a_commit_a_pass_wrote_wrong_is_refused_and_nothing_is_adopted(shm_log, wrong):
    from concordia.checkpoint.table import RegionTable, write_commit
    from concordia.errors import UsageError
    from concordia.gpu_kernels import reference as ref
    from concordia.wal import format as F

    with Session(shm_log, size=64 * MiB, segment_size=4 * MiB, staging="mapped", overwrite=True) as s:
        a = np.arange(8192, dtype=np.uint8)
        s.register("a", a)
        s.checkpoint()
        app = s.log.appender
        table = RegionTable(list(s.region_set))
        epoch, prev = app.next_epoch, app.last_commit_lsn
        r = table.regions[0]
        ext = app.reserve_extent(F.page_batch_length(1, r.page_bytes) + table.commit_length)
        used = records = 0
        if wrong != "count":  # one page batch of the epoch before the commit
            cursor = ref.new_cursor()
            ref.stage_page_batch(r.flat, np.array([0], np.uint32), ext.view, cursor, page_bytes=r.page_bytes,
                                 base_lsn=ext.lsn, epoch=epoch, region_id=r.id, salt=ext.salt)
            used, records = int(cursor[ref.CURSOR_USED]), 1
        write_commit(table, ext.view, used, 1, lsn=ext.lsn, epoch=epoch + (wrong == "epoch"), salt=ext.salt,
                     prev_commit=prev + 64 * (wrong == "aux"))
        if wrong == "crc":
            ext.view[used + 64 + 36] ^= 1  # the digest's first byte
        app.finish_extent(ext, used + table.commit_length, records + 1,
                          offsets=np.array([0, used][-(records + 1):], np.uint64), trim=True)
        with pytest.raises(UsageError, match="invalid commit record written by a producer") as e:
            app.adopt_commit(epoch, ext.lsn + used)
        assert "\n" not in str(e.value) and f"commit of epoch {epoch}" in str(e.value)
        assert app.last_committed_epoch == epoch - 1 and app.last_commit_lsn == prev and s.epoch == epoch - 1


def test_a_commit_is_adopted_only_where_writes_need_no_persist_call(tmp_path):
    from concordia.errors import UsageError

    with Session(f"file:{tmp_path / 'log'}", size=64 * MiB, segment_size=4 * MiB) as s:
        s.register("a", np.zeros(4096, np.uint8))
        s.checkpoint()
        app = s.log.appender
        with pytest.raises(UsageError, match="only where writes need no persist call, not on a msync tier"):
            app.adopt_commit(app.next_epoch, app.last_commit_lsn)
        assert s.epoch == 1


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
    caller queues right after the call (zeroing every array) are in no epoch.
    The device commits each epoch itself (table.cu's table_commit): once the
    stream has run the pass, a crash image holds the epoch, before the
    session's next call."""
    import shutil

    import cupy as cp

    from concordia.regions.region import position_page_bytes
    from tests.conftest import shm_test_name
    from tests.session.staging_cases import assert_same_log, log_contents

    def run(log, xp, wait, staging, image=None):
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
            if image is not None:  # the device has run the last pass: no host step has committed it
                cp.cuda.get_current_stream().synchronize()
                shutil.copyfile(f"/dev/shm/{log.split(':', 1)[1]}", image)
                assert s.epoch == stats[-1].epoch - 1
            s.settle()
            got = {e: s.recover(e) for e in (stats[5].epoch, stats[-1].epoch)}
            return stats, log_contents(s.log), got, states, queued

    def host(a):
        return np.asarray(a.get() if hasattr(a, "get") else a)

    name = shm_test_name("pending")
    try:
        twin = run(f"file:{tmp_path / 'twin.log'}", np, False, "mapped")
        waiting = run(f"shm:{name}", cp, True, "auto")
        pending = run(f"shm:{name}", cp, False, "auto", image=tmp_path / "image")
        with Session(f"file:{tmp_path / 'image'}", create=False) as r:
            last = pending[0][-1].epoch
            assert r.epoch == last
            arrays = r.recover(last)
            assert host(arrays["kv"]).tobytes() == pending[3][last][0].tobytes()
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
