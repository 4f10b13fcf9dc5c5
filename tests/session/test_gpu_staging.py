"""Checkpoints of CuPy regions staged on the device: the records must be
byte-identical to what the numpy path writes for the same state, the path
actually taken must be the device one (zero copy into a registered shm
mapping, or a pinned staging ring for file logs), and the device must be read
back at most twice per checkpoint (dirty counts, then cursors with digests),
and once when a region's few dirty pages fit the extent reserved for them
before its detector ran (stage_delta)."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint import staging as staging_mod

from .staging_cases import EPOCHS, assert_same_log, log_contents, run_workload
from .state import KINDS, LOG_SIZE, PAGE, SEGMENT, assert_same, copy, make_state, mutate

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _numpy_run(tmp_path, **kw):
    stats, contents, got, truth = run_workload(f"file:{tmp_path / 'numpy.log'}", **kw)
    assert all(set(st.via.values()) == {"host"} for st in stats)
    return contents, got, truth


def _reads_are_minimal(stats, via="gpu-mapped"):
    # base: no counts to read (every page), one read after staging.  Mapped
    # deltas: one table pass each, one read when the records fit the extent
    # sized by the last epoch's, two when they grew (the first delta, sized by
    # nothing).  Ring deltas: the dirty counts, then the cursors and digests;
    # the clean last epoch: counts only
    if via == "gpu-mapped":
        reads = [st.device_reads for st in stats]
        assert reads[0] == 1 and reads[1] == 2 and reads[-1] == 1 and max(reads) <= 2, reads
        assert [st.table_pass for st in stats] == [False] + [True] * (EPOCHS - 1)
    else:
        assert [st.device_reads for st in stats] == [1] + [2] * (EPOCHS - 2) + [1]


@pytest.mark.parametrize("tier,via", [("shm", "gpu-mapped"), ("file", "gpu-ring")])
def test_device_staging_writes_the_numpy_records(cp, tmp_path, shm_log, tier, via):
    want, _, truth = _numpy_run(tmp_path)
    log = shm_log if tier == "shm" else f"file:{tmp_path / 'gpu.log'}"
    stats, contents, got, _ = run_workload(log, to_device=cp.asarray)
    assert all(set(st.via.values()) == {via} for st in stats), [st.via for st in stats]
    _reads_are_minimal(stats, via)
    assert_same_log(contents, want)
    assert_same(got, truth)


@pytest.mark.parametrize("staging", ["ring", "mapped"])
def test_many_extents_per_checkpoint_on_the_device(cp, tmp_path, shm_log, monkeypatch, staging):
    # small records and extents: the ring alternates halves and overlaps the
    # host copy of one extent with the staging of the next
    monkeypatch.setattr(staging_mod, "MAX_BATCH_BYTES", 4096)
    monkeypatch.setattr(staging_mod, "EXTENT_BYTES", 3 * 4096)
    want, _, truth = _numpy_run(tmp_path)
    stats, contents, got, _ = run_workload(shm_log, staging=staging, to_device=cp.asarray)
    assert all(set(st.via.values()) == {f"gpu-{staging}"} for st in stats)
    assert len(contents["batches"]) > 12
    assert_same_log(contents, want)
    assert_same(got, truth)


def test_fingerprint_detector_on_the_device(cp, tmp_path, shm_log):
    detect = {"kv": "fingerprint", "adapter": "fingerprint"}
    want, _, truth = _numpy_run(tmp_path, detect=detect)
    stats, contents, got, _ = run_workload(shm_log, to_device=cp.asarray, detect=detect)
    assert all(set(st.via.values()) == {"gpu-mapped"} for st in stats)
    _reads_are_minimal(stats)
    assert_same_log(contents, want)
    assert_same(got, truth)


def _kv_flow(log, to_device, staging="auto"):
    """A paged KV cache written token by token, scanned through its block tables."""
    layers, blocks, bs, heads, dim = 2, 16, 4, 2, 16
    rng = np.random.default_rng(9)
    kv = rng.standard_normal((layers, blocks, 2, bs, heads, dim), dtype=np.float32)
    tables = np.array([[3, 7, -1, -1], [0, 12, 5, -1]], np.int32)
    lens = np.array([2, 5], np.int32)
    dev = to_device(kv) if to_device else kv
    stats = []
    with Session(log, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True, staging=staging) as s:
        s.register("kv", dev, kind="kv", page_bytes=512, block_tables=tables, seq_lens=lens)
        stats.append(s.checkpoint())
        for step in range(3):
            for seq in range(2):
                pos = int(lens[seq])
                blk = int(tables[seq, pos // bs])
                kv[:, blk, :, pos % bs] = rng.standard_normal((layers, 2, heads, dim), dtype=np.float32)
                lens[seq] += 1
            if to_device:
                dev.set(kv)
            stats.append(s.checkpoint())
        return stats, log_contents(s.log), np.asarray(s.recover()["kv"]), kv


def test_kv_block_table_scanner_feeds_the_device_staging(cp, tmp_path, shm_log):
    _, want, _, truth = _kv_flow(f"file:{tmp_path / 'numpy.log'}", None)
    stats, contents, got, _ = _kv_flow(shm_log, cp.asarray)
    assert all(st.via == {"kv": "gpu-mapped"} for st in stats)
    assert all(st.pages["kv"] > 0 for st in stats)
    assert_same_log(contents, want)
    assert got.tobytes() == truth.tobytes()


def _recover_then_continue(log, to_device):
    state = make_state(7)
    arrays = {k: (to_device(v) if to_device else v) for k, v in state.items()}
    with Session(log, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True, executor="host") as s:
        for name, arr in arrays.items():
            s.register(name, arr, kind=KINDS[name], page_bytes=PAGE[name])
        s.checkpoint()
        mutate(state, 1)
        if to_device:
            for k, v in state.items():
                arrays[k].set(v)
        s.checkpoint()
        at2 = copy(state)
        mutate(state, 2)  # lost: never committed
        if to_device:
            for k, v in state.items():
                arrays[k].set(v)
        s.recover(into="registered")  # back to epoch 2, in place
        for k in state:  # the numpy truth too (it is the registered array on the numpy run)
            state[k][...] = at2[k]
        mutate(state, 3)
        if to_device:
            for k, v in state.items():
                arrays[k].set(v)
        last = s.checkpoint()
        return last, log_contents(s.log), {k: np.asarray(v) for k, v in s.recover().items()}, state


def test_recover_into_registered_then_delta_on_the_device(cp, tmp_path, shm_log):
    _, want, _, truth = _recover_then_continue(f"file:{tmp_path / 'numpy.log'}", None)
    last, contents, got, _ = _recover_then_continue(shm_log, cp.asarray)
    assert last.base == [] and set(last.via.values()) == {"gpu-mapped"}
    assert last.device_reads == 2
    assert_same_log(contents, want)
    assert_same(got, truth)


def test_recover_on_device_reuses_the_kept_registration(cp, shm_log):
    state = make_state(2)
    a = cp.asarray(state["adapter"])
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="host") as s:
        s.register("adapter", a, kind="adapter", page_bytes=4096)
        s.checkpoint()
        a[1, 1, 3] = 9.0
        assert s.checkpoint().via == {"adapter": "gpu-mapped"}
        got = s.recover(device="cupy")["adapter"]
        assert bool((got == a).all())
        a[0, 0, 0] = -9.0
        again = s.checkpoint()  # the mapping is still registered and written in place
        assert again.via == {"adapter": "gpu-mapped"} and again.pages == {"adapter": 1}
        assert np.array_equal(s.recover()["adapter"], a.get())


def test_unaligned_cupy_region_falls_back_to_the_host_path(cp, shm_log):
    base = cp.arange(2049, dtype=cp.float32)
    odd = base[1:]  # contiguous, 4 bytes past an aligned address
    ok = cp.ones(4096, cp.float32)
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("odd", odd, page_bytes=1024)
        s.register("ok", ok, page_bytes=1024)
        first = s.checkpoint()
        odd[100] = -1.0
        ok[5] = 2.0
        second = s.checkpoint()
        assert first.via == second.via == {"odd": "host", "ok": "gpu-mapped"}
        assert "aligned" in s.gpu_fallback
        assert second.pages == {"odd": 1, "ok": 1}
        got = s.recover()
    assert np.array_equal(got["odd"], odd.get()) and np.array_equal(got["ok"], ok.get())


def test_host_staging_of_cupy_regions_still_matches(cp, tmp_path):
    want, _, truth = _numpy_run(tmp_path)
    stats, contents, got, _ = run_workload(f"file:{tmp_path / 'host.log'}", staging="host", to_device=cp.asarray)
    assert all(set(st.via.values()) == {"host"} for st in stats)
    assert_same_log(contents, want)
    assert_same(got, truth)


def _by_region(contents):
    """Page batches ordered by (epoch, region): the device path writes the
    regions done in one launch first, the numpy path in registration order."""
    out = dict(contents)
    out["batches"] = sorted(contents["batches"], key=lambda b: (b["epoch"], b["region"]))
    return out


# dirty pages per checkpoint: one (fits the 1-page guess after the base), many
# (refused: compacted and staged), a few after many (no extent reserved),
# fewer than the guess (the rest padded), clean, clean with no extent, one again
DIRTY_STEPS = [1, 100, 3, 2, 0, 0, 1, 32, 33]


def _transitions(log, to_device, detect):
    rng = np.random.default_rng(4)
    pb, npages = 256, 200
    truth = rng.integers(0, 256, size=npages * pb - 77, dtype=np.uint8)
    other = rng.standard_normal(5000).astype(np.float32)
    arr = to_device(truth) if to_device else truth
    arr2 = to_device(other) if to_device else other
    stats = []
    with Session(log, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True, executor="host") as s:
        s.register("r", arr, page_bytes=pb, detect=detect)
        s.register("o", arr2, page_bytes=1024, detect=detect)
        s.checkpoint()
        for k, n in enumerate(DIRTY_STEPS):
            pages = rng.choice(npages, n, replace=False)
            at = np.minimum(pages * pb + rng.integers(0, pb, n), truth.size - 1)
            truth[at] ^= 0x3C
            other[k % other.size] += 1.0
            if to_device:
                arr.set(truth)
                arr2.set(other)
            stats.append(s.checkpoint())
            assert stats[-1].pages == {"r": n, "o": 1}
        got = {k: np.asarray(v) for k, v in s.recover().items()}
        return stats, log_contents(s.log), got, {"r": truth, "o": other}


@pytest.mark.parametrize("detect", ["shadow", "fingerprint"])
def test_few_pages_in_one_launch_and_every_fallback(cp, tmp_path, shm_log, detect):
    _, want, _, truth = _transitions(f"file:{tmp_path / 'numpy.log'}", None, detect)
    stats, contents, got, _ = _transitions(shm_log, cp.asarray, detect)
    assert all(set(st.via.values()) == {"gpu-mapped"} for st in stats)
    # one table pass each: one wait where the epoch's records fit the extent
    # sized by the last epoch's, two where they grew (the first delta, many,
    # one after a clean epoch, 32 after one, 33 after 32)
    assert [st.device_reads for st in stats] == [2, 2, 1, 1, 1, 1, 2, 2, 2]
    assert all(st.table_pass for st in stats)
    assert_same_log(_by_region(contents), _by_region(want))
    assert_same(got, truth)
