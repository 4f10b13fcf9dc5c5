"""Page batches appended to a page-cache file go in with pwritev from the
caller's pages; they must be byte-identical to the encoder's records and
recover like any other."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.errors import WalError
from concordia.wal.compaction import compact
from concordia.wal.planner import plan
from concordia.wal.snapshot import create_base_snapshot
from concordia.wal.apply import apply_plan_numpy

PB = 4096


def _fill(log, rng, epochs=4):
    rid = log.define_region("r", np.uint8, (64 * PB,), PB, "opaque")
    state = np.zeros((64, PB), np.uint8)
    for e in range(1, epochs + 1):
        ids = np.sort(rng.choice(64, int(rng.integers(1, 40)), replace=False)).astype(np.uint32)
        state[ids] = rng.integers(0, 256, (ids.size, PB), dtype=np.uint8)
        for part in np.array_split(ids, 3):
            if part.size:
                log.appender.append_page_batch(e, rid, part, state[part])
        log.appender.commit(e, digests={rid: F.region_digest(F.page_crcs_of(state))})
    return state


@pytest.mark.parametrize("spec", ["file", "memory"])
def test_records_match_the_encoder_and_restore(tmp_path, spec):
    name = f"file:{tmp_path}/log" if spec == "file" else "memory:"
    log = Log.create(open_backend(name, size=8 << 20, create=True), segment_size=1 << 20)
    assert (log.appender._write_at is not None) == (spec == "file")
    state = _fill(log, np.random.default_rng(4))
    n = 0
    for rec in log.records():
        if rec.kind != F.REC_PAGE_BATCH:
            continue
        pb = rec.page_batch()
        want = np.zeros(rec.length, np.uint8)
        F.encode_page_batch_into(want, lsn=rec.lsn, epoch=rec.epoch, region_id=rec.region_id,
                                 salt=F.RECORD_HEADER.unpack_from(rec.raw, 0)[7],
                                 page_ids=pb.page_ids, pages=np.array(pb.payload), page_bytes=PB)
        assert bytes(rec.raw) == want.tobytes()
        n += 1
    assert n >= 6 and log.verify()["ok"]
    assert apply_plan_numpy(log, plan(log))["r"].tobytes() == state.tobytes()
    log.close()
    if spec == "file":  # what reached the file, read by a fresh open
        again = Log.open(f"file:{tmp_path}/log")
        assert apply_plan_numpy(again, plan(again))["r"].tobytes() == state.tobytes()
        again.close()


def test_segments_roll_and_recycle_through_the_descriptor(tmp_path):
    log = Log.create(open_backend(f"file:{tmp_path}/log", size=8 << 20, create=True), segment_size=1 << 20)
    rid = log.define_region("r", np.uint8, (200 * PB,), PB, "opaque")
    rng = np.random.default_rng(9)
    state = np.zeros((200, PB), np.uint8)
    for e in range(1, 30):  # ~ 14 MiB through an 8 MiB log of 1 MiB segments
        ids = np.arange(e % 5 * 20, e % 5 * 20 + 70, dtype=np.uint32)
        state[ids] = rng.integers(0, 256, (70, PB), dtype=np.uint8)
        log.appender.append_page_batch(e, rid, ids, state[ids])
        log.appender.commit(e)
        if e % 4 == 0:
            create_base_snapshot(log, "r", state.reshape(-1), e)
            compact(log, e, keep_bases=1)
    assert max(s.seq for s in log.volume.live_segments()) > 8  # segments were taken again
    assert log.verify()["ok"]
    assert apply_plan_numpy(log, plan(log))["r"].reshape(200, PB).tobytes() == state.tobytes()
    log.close()


def test_checked_path_names_a_bad_batch_before_taking_space(tmp_path):
    """Page CRCs given: a file log's batch takes the checked path, with the
    encoder's checks, and a refused batch takes no space."""
    log = _log(tmp_path, "file")
    rid = log.define_region("r", np.uint8, (64 * PB,), PB, "opaque")
    app = log.appender
    before = app.write_lsn
    crcs, pages = np.zeros(2, np.uint32), np.zeros((2, PB), np.uint8)
    cases = [([3, 3], pages, crcs, "strictly increasing"),
             ([1, 2], np.zeros((2, 100), np.uint8), crcs, "multiple of 64"),
             ([1, 2], pages, crcs[:1], "1 page CRCs for 2 pages"),
             ([], pages[:0], crcs[:0], "1..16777216 pages, not 0")]
    for ids, p, c, msg in cases:
        with pytest.raises(WalError, match=msg):
            app.append_page_batch(1, rid, np.array(ids, np.uint32), p, page_crcs=c)
        assert app.write_lsn == before
    log.close()


def _log(tmp_path, spec):
    name = f"file:{tmp_path}/log" if spec == "file" else "memory:"
    return Log.create(open_backend(name, size=4 << 20, create=True), segment_size=1 << 20)


@pytest.mark.parametrize("spec", ["file", "memory"])
@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.int32, np.uint64])
def test_ids_of_any_integer_type_give_the_same_record(tmp_path, dtype, spec):
    """uint32 and int64 ids take the helper's one-call tables (written aside for
    pwritev, or in place with the pages copied), other types the checked path;
    the bytes on media are the same."""
    log = _log(tmp_path, spec)
    rid = log.define_region("r", np.uint8, (64 * PB,), PB, "opaque")
    pages = np.random.default_rng(3).integers(0, 256, (5, PB), dtype=np.uint8)
    ids = np.array([0, 7, 8, 40, 63], dtype=dtype)
    lsn = log.appender.append_page_batch(1, rid, ids, pages)
    log.appender.commit(1)
    rec = next(r for r in log.records() if r.kind == F.REC_PAGE_BATCH)
    want = np.zeros(rec.length, np.uint8)
    F.encode_page_batch_into(want, lsn=lsn, epoch=1, region_id=rid, salt=F.RECORD_HEADER.unpack_from(rec.raw, 0)[7],
                             page_ids=ids.astype(np.uint32), pages=pages, page_bytes=PB)
    assert bytes(rec.raw) == want.tobytes()
    log.close()


@pytest.mark.parametrize("ids, problem", [
    ([1, 2, 2, 3], "strictly increasing"),
    ([5, 4, 6, 7], "strictly increasing"),
    ([-1, 2, 3, 4], "fit in u32"),
    ([1, 2, 3, 1 << 32], "fit in u32"),
])
@pytest.mark.parametrize("spec", ["file", "memory"])
def test_bad_ids_are_refused_before_space_is_taken(tmp_path, ids, problem, spec):
    log = _log(tmp_path, spec)
    rid = log.define_region("r", np.uint8, (64 * PB,), PB, "opaque")
    pages = np.ones((4, PB), np.uint8)
    before = log.appender.write_lsn
    with pytest.raises(WalError, match=problem):
        log.appender.append_page_batch(1, rid, np.array(ids, np.int64), pages)
    assert log.appender.write_lsn == before
    log.appender.append_page_batch(1, rid, np.arange(4, dtype=np.int64), pages)  # the log goes on
    log.appender.commit(1)
    assert log.verify()["ok"]
    log.close()
