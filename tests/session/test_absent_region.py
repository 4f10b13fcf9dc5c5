"""No silent zeros: a region with no state at the recovery's epoch (registered
after it, so no base, no delta and no commit of it lies at or before it) is
refused by every recover path, in one line naming the region and the epoch,
before anything is written; `absent="keep"` restores the rest and leaves it
as it is.  A region that is present at the epoch restores as before, and
skip-corrupt's fallback never goes back to before a region existed."""

from __future__ import annotations

import numpy as np
import pytest

import concordia
from concordia.errors import AbsentRegionError, SessionError
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.planner import plan

N = 3 * 4096  # three pages of each region


def _two_epochs(s):
    """A checkpointed at epoch 1; B registered after it and first written at
    epoch 2; both changed since (the live bytes are neither epoch's).
    Returns (a, b, {epoch: (a, b) as committed})."""
    a = np.full(N, 1, np.uint8)
    s.register("A", a)
    s.checkpoint()
    at = {1: (a.copy(), None)}
    b = np.arange(N, dtype=np.uint8)
    s.register("B", b)
    a[:4096] = 2
    b[4096:] = 3
    s.checkpoint()
    at[2] = (a.copy(), b.copy())
    a[:] = 4
    b[:] = 5
    return a, b, at


def _refusal(exc) -> str:
    line = str(exc.value)
    assert "\n" not in line
    assert "region 'B' has no state at epoch 1 (it was first written at epoch 2)" in line
    return line


@pytest.mark.parametrize("executor", ["host", "resident"])
def test_into_registered_refuses_an_absent_region_and_writes_nothing(executor):
    with concordia.Session("memory:", size=32 << 20, executor=executor) as s:
        a, b, at = _two_epochs(s)
        before = a.copy(), b.copy()
        with pytest.raises(AbsentRegionError) as e:
            s.recover(1, into="registered")
        assert "absent='keep'" in _refusal(e)
        # neither target was touched: not the absent one, not the one that has state
        assert np.array_equal(a, before[0]) and np.array_equal(b, before[1])
        assert s.last_recovery is None

        s.recover(1, into="registered", absent="keep")
        assert np.array_equal(a, at[1][0])  # A restored at epoch 1
        assert np.array_equal(b, before[1])  # B left as it was, and said so
        assert s.last_recovery.kept == ["B"] and s.last_recovery.epoch == 1
        assert set(s.last_recovery.regions) == {"A"}

        s.recover(2, into="registered")  # both have state at epoch 2
        assert np.array_equal(a, at[2][0]) and np.array_equal(b, at[2][1])
        assert s.last_recovery.kept == []


def test_new_arrays_refuse_or_leave_the_absent_region_out():
    with concordia.Session("memory:", size=32 << 20) as s:
        _, _, at = _two_epochs(s)
        with pytest.raises(AbsentRegionError) as e:
            s.recover(1)
        _refusal(e)
        with pytest.raises(AbsentRegionError):
            s.recover(1, regions=["B"])
        got = s.recover(1, absent="keep")
        assert set(got) == {"A"} and np.array_equal(got["A"], at[1][0])
        assert s.last_recovery.kept == ["B"]
        got = s.recover(2)
        assert np.array_equal(got["A"], at[2][0]) and np.array_equal(got["B"], at[2][1])
        # asked only for what has state at epoch 1: nothing to refuse
        assert np.array_equal(s.recover(1, regions=["A"])["A"], at[1][0]) and s.last_recovery.kept == []


def test_into_a_dict_refuses_then_keeps_the_given_array():
    with concordia.Session("memory:", size=32 << 20) as s:
        _, _, at = _two_epochs(s)
        x, y = np.full(N, 8, np.uint8), np.full(N, 9, np.uint8)
        with pytest.raises(AbsentRegionError) as e:
            s.recover(1, into={"A": x, "B": y})
        _refusal(e)
        assert (x == 8).all() and (y == 9).all()
        s.recover(1, into={"A": x, "B": y}, absent="keep")
        assert np.array_equal(x, at[1][0]) and (y == 9).all() and s.last_recovery.kept == ["B"]
        with pytest.raises(SessionError, match="unknown absent='zero'"):
            s.recover(1, into={"A": x}, absent="zero")


@pytest.mark.parametrize("mode", [None, "point_in_time", "skip_corrupt"])
def test_a_region_no_commit_holds_yet_is_refused_beside_a_live_writer(shm_log, mode):
    """A writer registered "late" (its descriptor follows the last commit) and
    committed nothing since: a read-only recovery into a target for it is
    refused, not left as it was unsaid, in every mode (no damage gave it up);
    absent="keep" lists it in `kept`."""
    a = np.full(N, 1, np.uint8)
    with concordia.Session(shm_log, size=32 << 20) as w:
        w.register("A", a)
        w.checkpoint()
    late = np.full(N, 9, np.uint8)
    with concordia.Session(shm_log, create=False) as w:
        w.register("A", np.zeros(N, np.uint8))
        w.register("late", np.zeros(N, np.uint8))   # the descriptor is written; no epoch commits it
    target = np.zeros(N, np.uint8)
    with concordia.Session(shm_log, create=False, readonly=True) as r:
        assert "late" in r.log.regions
        with pytest.raises(AbsentRegionError) as e:
            r.recover(into={"A": target, "late": late}, mode=mode)
        assert "region 'late' has no state at epoch 1 (no committed epoch holds it yet)" in str(e.value)
        assert (target == 0).all() and (late == 9).all()   # nothing written
        r.recover(into={"A": target, "late": late}, absent="keep", mode=mode)
        assert r.last_recovery.kept == ["late"] and (target == 1).all() and (late == 9).all()


def test_a_kept_region_is_written_whole_by_the_next_checkpoint():
    """Kept at the latest epoch, the region holds what the log does not: the
    next checkpoint must write all of it, not a delta against its live bytes."""
    with concordia.Session("memory:", size=32 << 20) as s:
        a = np.full(N, 1, np.uint8)
        s.register("A", a)
        s.checkpoint()
        b = np.full(N, 6, np.uint8)
        s.register("B", b)  # not checkpointed yet: absent at the latest epoch
        with pytest.raises(AbsentRegionError, match="no committed epoch holds it yet"):
            s.recover(into="registered")
        s.recover(into="registered", absent="keep")
        assert s.last_recovery.kept == ["B"] and (b == 6).all()
        s.checkpoint()
        got = s.recover(2)
        assert (got["B"] == 6).all() and (got["A"] == 1).all()


def test_a_region_present_at_its_first_epoch_restores():
    """Registered and checkpointed at epoch 1, recovered at epoch 1: present.
    So is a region whose only state is a commit naming its digest (a chain
    with no record: every page zero)."""
    with concordia.Session("memory:", size=32 << 20) as s:
        a = np.full(N, 1, np.uint8)
        s.register("A", a)
        s.checkpoint()
        assert np.array_equal(s.recover(1)["A"], a) and s.last_recovery.kept == []

    log = Log.create("memory:", size=8 << 20, segment_size=1 << 20)
    z = log.define_region("z", "|u1", (N,), 4096, "opaque")
    log.appender.commit(1, {z: F.region_digest(F.page_crcs_of(np.zeros((3, 4096), np.uint8)))})
    p = plan(log, 1)
    assert not p.regions["z"].absent and p.absent == {}
    from concordia.restore.run import recover

    out, stats = recover(log, 1)
    assert (out["z"] == 0).all() and stats.kept == []
    log.close()


def test_the_plan_says_absent_with_the_first_epoch():
    with concordia.Session("memory:", size=32 << 20) as s:
        _two_epochs(s)
        p = plan(s.log, 1)
        assert list(p.absent) == ["B"] and p.regions["B"].first_epoch == 2
        d = p.to_json()
        assert set(d["regions"]) == {"A"}
        assert d["absent"] == {"B": {"id": s.log.regions["B"].id, "epoch": 1, "first_epoch": 2,
                                     "reason": "region 'B' has no state at epoch 1 (it was first written at epoch 2)"}}
        assert plan(s.log, 2).absent == {}
        from concordia.wal.apply import apply_plan_numpy

        with pytest.raises(AbsentRegionError):  # the applier itself never zeroes it
            apply_plan_numpy(s.log, p)
        assert set(apply_plan_numpy(s.log, p, regions=["A"])) == {"A"}


def test_skip_corrupt_never_falls_back_to_before_a_region_existed(tmp_path):
    """B's only record (epoch 2, before the last commit) is damaged: skip-corrupt
    gives B up (listed in dropped, its target untouched) rather than restore it
    as zeros at epoch 1."""
    path = tmp_path / "s.log"
    with concordia.Session(f"file:{path}", size=32 << 20, segment_size=4 << 20) as s:
        a, _, at = _two_epochs(s)
        s.checkpoint()  # epoch 3: A changed, B not (its commit names B's digest all the same)
        a3 = a.copy()
        rec = next(r for r in s.log.records() if r.kind == F.REC_PAGE_BATCH and r.epoch == 2
                   and r.region_id == s.log.regions["B"].id)
        at_byte = rec.offset + rec.length - 1  # in the last page's payload
    raw = bytearray(path.read_bytes())
    raw[at_byte] ^= 0xFF
    path.write_bytes(bytes(raw))
    with concordia.Session(f"file:{path}", create=False) as s:
        a, b = np.full(N, 4, np.uint8), np.full(N, 5, np.uint8)
        s.register("A", a)
        s.register("B", b)
        s.recover(3, into="registered", mode="skip_corrupt")
        assert np.array_equal(a, a3)
        assert (b == 5).all()  # given up, not zeroed
        # (the commit of epoch 2, which counts the damaged record, is listed too: no region's)
        assert [d["region"] for d in s.last_recovery.dropped if d["region"]] == ["B"]
        assert s.last_recovery.dropped[0]["gave_up"] == {"epochs": [2, 3], "regions": ["B"]}
        assert s.last_recovery.kept == []


def test_the_standby_refuses_a_region_absent_at_the_last_commit(tmp_path):
    from concordia.standby import Standby

    log = f"file:{tmp_path / 'sb.log'}"
    with concordia.Session(log, size=32 << 20, segment_size=4 << 20) as s:
        s.register("A", np.full(N, 1, np.uint8))
        s.checkpoint()
        s.register("B", np.full(N, 2, np.uint8))  # after the last commit
    sb = Standby(log, device="cpu")
    try:
        with pytest.raises(AbsentRegionError, match="region 'B' has no state at epoch 1"):
            sb.run()
    finally:
        sb.close()


def test_transformers_restore_refuses_an_adapter_added_after_the_epoch(tmp_path):
    torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
    pytest.importorskip("transformers", reason="the transformers integration needs transformers")
    peft = pytest.importorskip("peft", reason="the adapters need peft")
    from transformers import StaticCache

    from concordia.demo.model import build, lora_update
    from concordia.integrations.transformers import protect, restore

    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=16)
    with concordia.Session(f"file:{tmp_path / 'hf.log'}", size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=1)
        s.checkpoint()  # epoch 1: the first adapter only
        first = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
        model.add_adapter("late", peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        late = {f"hf.lora.{n}": p for n, p in model.named_parameters() if ".lora_" in n and ".late." in n}
        assert late
        for name, p in late.items():
            s.register(name, p.data, kind="adapter", detect="fingerprint")
        lora_update(model)(1, None)
        s.checkpoint()  # epoch 2: both
        lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        before = {n: p.detach().clone() for n, p in lora.items()}

        with pytest.raises(AbsentRegionError) as e:
            restore(s, g, target=1)
        line = str(e.value)
        assert "\n" not in line and "has no state at epoch 1 (it was first written at epoch 2)" in line
        assert next(iter(late)) in line
        for n, p in lora.items():  # nothing zeroed, nothing restored
            assert torch.equal(p, before[n]), n
        assert all(p.abs().sum() > 0 for p in late.values())

        r = restore(s, g, target=1, absent="keep")
        assert r.epoch == 1 and sorted(r.stats.kept) == sorted(late)
        for n, p in lora.items():
            assert torch.equal(p, before[n] if ".late." in n else first[n]), n

        r = restore(s, g, target=2)
        assert r.stats.kept == []
        for n, p in lora.items():
            assert torch.equal(p, before[n]), n


@pytest.mark.gpu
def test_device_targets_refuse_then_keep(shm_log):
    """The device pipeline (CuPy targets restored in place, new CuPy arrays):
    the absent region is refused before anything is scattered, then kept."""
    import cupy as cp

    from concordia.restore.device import apply_plan_cupy

    with concordia.Session(shm_log, size=32 << 20, executor="host") as s:  # the caller's pipeline
        a = cp.full(N, 1, cp.uint8)
        s.register("A", a)
        s.checkpoint()
        b = cp.arange(N, dtype=cp.uint8)
        s.register("B", b)
        a[:4096] = 2
        s.checkpoint()
        a2, b2 = a.get(), b.get()
        a[:] = 4
        b[:] = 5
        with pytest.raises(AbsentRegionError) as e:
            s.recover(1, into="registered")
        _refusal(e)
        assert (a.get() == 4).all() and (b.get() == 5).all()
        s.recover(1, into="registered", absent="keep")
        assert (a.get() == 1).all() and (b.get() == 5).all() and s.last_recovery.kept == ["B"]
        assert s.last_recovery.via == {"A": "device pipeline"}
        got = s.recover(1, device="cupy", absent="keep")
        assert set(got) == {"A"} and (got["A"].get() == 1).all()
        with pytest.raises(AbsentRegionError):  # the device applier itself never zeroes it
            apply_plan_cupy(s.log, plan(s.log, 1))
        s.recover(2, into="registered")
        assert np.array_equal(a.get(), a2) and np.array_equal(b.get(), b2)
