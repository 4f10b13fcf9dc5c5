"""The applier's two copy paths (one gather from the log mapping in destination
order; per record through a small buffer for loose arrays), restores into
caller arrays (`out=`), and page CRC checks on both paths."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c

from concordia.devmem import open_backend
from concordia.wal import Log
from concordia.wal import apply as A
from concordia.wal.errors import CorruptionError, UsageError
from concordia.wal.format import page_crcs_of, region_digest
from concordia.wal.planner import ScannedBatch, Source, plan

PB = 4096


def _log_with_history(epochs=5, seed=3):
    """Two regions (one with a short last page), random dirty pages per epoch,
    records of varying page counts so payloads sit at many offsets mod 4096."""
    log = Log.create(open_backend("memory:", size=48 << 20, create=True), segment_size=4 << 20)
    live = {"kv": np.zeros(300 * PB // 2, np.uint16), "ad": np.zeros((PB * 37 + 1000) // 4, np.float32)}
    ids = {n: log.define_region(n, a.dtype, a.shape, PB, "opaque") for n, a in live.items()}
    rng = np.random.default_rng(seed)
    oracle = {}
    for e in range(1, epochs + 1):
        digests = {}
        for n, a in live.items():
            flat = a.reshape(-1).view(np.uint8)
            pages = -(-flat.size // PB)
            dirty = np.arange(pages) if e == 1 else np.sort(rng.choice(pages, max(1, pages // 5), replace=False))
            if n == "ad" and e == 1:
                dirty = dirty[dirty % 7 != 3]  # some pages nobody ever writes: zero pages
            for p in dirty:
                lo, hi = p * PB, min((p + 1) * PB, flat.size)
                flat[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)
            padded = np.zeros(pages * PB, np.uint8)
            padded[:flat.size] = flat
            pg = padded.reshape(pages, PB)
            i = 0
            while i < dirty.size:
                k = int(rng.integers(1, 40))
                sel = dirty[i:i + k]
                log.appender.append_page_batch(e, ids[n], sel, pg[sel])
                i += k
            digests[ids[n]] = region_digest(page_crcs_of(pg))
        log.appender.commit(e, digests=digests)
        oracle[e] = {n: a.copy() for n, a in live.items()}
    return log, oracle


@pytest.fixture(scope="module")
def history():
    log, oracle = _log_with_history()
    yield log, oracle
    log.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", [PB, 5 * PB, 1 << 20])
def test_gather_path_restores_every_epoch(history, threads, chunk):
    log, oracle = history
    for e, want in oracle.items():
        p = plan(log, e)
        assert all(A._gather_map(rp) is not None for rp in p.regions.values())  # the one-gather path
        got = A.apply_plan_numpy(log, p, threads=threads, chunk_bytes=chunk)
        for n, a in want.items():
            assert got[n].tobytes() == a.tobytes(), (n, e)


def test_loose_arrays_take_the_per_record_path_with_the_same_result(history):
    log, oracle = history
    p = plan(log)
    for rp in p.regions.values():  # the same plan over private copies of every payload
        rp.sources = [Source(ScannedBatch(**{**s.batch.__dict__, "payload": np.array(s.batch.payload)}), s.rows,
                             s.page_ids) for s in rp.sources]
        assert A._gather_map(rp) is None
    for threads in (1, 2):
        got = A.apply_plan_numpy(None, p, threads=threads, chunk_bytes=3 * PB)
        for n, a in oracle[max(oracle)].items():
            assert got[n].tobytes() == a.tobytes()


def test_restore_into_existing_arrays_overwrites_everything(history):
    log, oracle = history
    e = max(oracle)
    p = plan(log, e)
    assert p.regions["ad"].zero_page_ids.size  # zero pages must be zeroed in a caller's array
    out = {n: np.full_like(a, 7) for n, a in oracle[e].items()}
    got = A.apply_plan_numpy(log, p, out=out)
    for n, a in oracle[e].items():
        assert got[n] is out[n] and out[n].tobytes() == a.tobytes()


@pytest.mark.parametrize("bad", [np.zeros(5, np.float32), np.zeros((150 * PB,), np.uint8), "x",
                                 np.zeros(300 * PB // 2, np.uint16)[::-1]])
def test_restore_into_a_wrong_array_is_one_line(history, bad):
    log, _ = history
    with pytest.raises(UsageError, match=r"out\['kv'\] must be a writable C-contiguous uint16"):
        A.apply_plan_numpy(log, plan(log), out={"kv": bad})
    with pytest.raises(UsageError, match="does not hold: 'nope'"):
        A.apply_plan_numpy(log, plan(log), out={"nope": np.zeros(1)})


def test_npy_restore_with_a_short_last_page(history, tmp_path):
    log, oracle = history
    p = plan(log)
    path = A.restore_region_npy(log, p, "ad", tmp_path / "ad.npy", chunk_bytes=3 * PB, threads=2)
    assert np.load(path).tobytes() == oracle[max(oracle)]["ad"].tobytes()


@pytest.mark.parametrize("loose", [False, True])
def test_a_flipped_byte_in_any_restored_page_is_named(loose):
    """A bit flipped in the payload of a page the plan reads is caught by that
    page's CRC on either path, and the error names record, page and place."""
    log, oracle = _log_with_history(epochs=3, seed=11)
    try:
        p = plan(log)
        rp = p.regions["kv"]
        rng = np.random.default_rng(5)
        for _ in range(6):
            s = rp.sources[int(rng.integers(len(rp.sources)))]
            i = int(rng.integers(s.rows.size))
            row, page = int(s.rows[i]), int(s.page_ids[i])
            byte = int(rng.integers(PB))
            pay = s.batch.payload
            pay[row, byte] ^= 0x10
            try:
                q = plan(log, check_pages=False)  # the applier's own check, not the decision's
                if loose:
                    for r in q.regions.values():
                        r.sources = [Source(ScannedBatch(**{**x.batch.__dict__, "payload": np.array(x.batch.payload)}),
                                            x.rows, x.page_ids) for x in r.sources]
                off = s.batch.offset + s.batch.length - s.batch.page_ids.size * PB + row * PB
                with pytest.raises(CorruptionError, match=rf"segment {s.batch.segment} @ {off:#x}: page CRC "
                                                          rf"mismatch for page {page} of region 'kv' in record "
                                                          rf"lsn {s.batch.lsn}"):
                    A.apply_plan_numpy(log if not loose else None, q, chunk_bytes=7 * PB)
            finally:
                pay[row, byte] ^= 0x10
        got = A.apply_plan_numpy(log, plan(log))  # repaired: restores again
        assert got["kv"].tobytes() == oracle[3]["kv"].tobytes()
    finally:
        log.close()


def test_page_crcs_match_one_call_per_page():
    pages = np.random.default_rng(2).integers(0, 256, (33, 256), dtype=np.uint8)
    want = [crc32c(bytes(r)) for r in pages]
    assert A.page_crcs(pages).tolist() == want
    assert A.page_crcs(pages, release_gil=True).tolist() == want
