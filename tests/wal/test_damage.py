"""A table of byte-level damages, each with the diagnostic it must produce and
its outcome in every recovery mode (FORMAT.md §5.5, §11).

The log: 60 epochs over several 1 MiB segments.  "Middle" damage hits epoch 10
(valid commits follow: corruption); "tail" damage hits what follows the last
commit (a torn tail)."""

from __future__ import annotations

import struct

import pytest

from concordia.wal import RecoveryMode as M
from concordia.wal import format as F
from concordia.wal.errors import CorruptionError, SuperblockError, TornTailError

from .helpers import build_log, fix_header_crc, fix_segment_crc, image, reopen, replay

EPOCHS = 60


@pytest.fixture(scope="module")
def base():
    log, model, rid = build_log(epochs=EPOCHS)
    # an uncommitted epoch 61 at the tail (a writer died before its commit)
    for ids, pages in model.epoch_batches(EPOCHS + 1)[:1]:
        log.appender.append_page_batch(EPOCHS + 1, rid, ids, pages)
    log.appender.sync()
    recs = list(log.records(committed_only=False))
    segs = log.volume.live_segments()
    assert len(segs) >= 3
    return image(log.backend), model, recs, segs, log.volume.superblock


def first(recs, kind, epoch):
    return next(r for r in recs if r.kind == kind and r.epoch == epoch)


def d_length_zero(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    img[r.offset:r.offset + 8] = bytes(8)


def d_length_changed(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    struct.pack_into("<Q", img, r.offset, r.length + 64)


def d_type_unknown(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    img[r.offset + 8] = 0x33
    fix_header_crc(img, r.offset)


def d_type_flipped(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    img[r.offset + 8] = F.REC_COMMIT


def d_header_crc(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    img[r.offset + 61] ^= 0xFF


def d_page_crc(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    img[r.offset + r.length - 100] ^= 0x01


def d_missing_commit(img, recs, segs, sb):
    r = first(recs, F.REC_COMMIT, 10)
    img[r.offset:r.offset + r.length] = bytes(r.length)


def d_missing_last_commit(img, recs, segs, sb):
    r = first(recs, F.REC_COMMIT, EPOCHS)
    img[r.offset:r.offset + r.length] = bytes(r.length)


def d_torn_tail(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, EPOCHS + 1)
    img[r.offset + r.length - 1] ^= 0x80


def d_stale_salt(img, recs, segs, sb):
    r = first(recs, F.REC_PAGE_BATCH, 10)
    struct.pack_into("<I", img, r.offset + 32, 0x5A5A5A5A)
    fix_header_crc(img, r.offset)


def d_broken_chain(img, recs, segs, sb):
    s = segs[1]
    struct.pack_into("<I", img, s.offset + 96, 0x12345678)
    fix_segment_crc(img, s.offset)


def d_last_segment_header(img, recs, segs, sb):
    img[segs[-1].offset + 70] ^= 0x01  # base_lsn, header CRC left stale


def _newest_slot(sb):
    return (sb.sequence % 2) * sb.slot_bytes


def d_one_slot(img, recs, segs, sb):
    img[_newest_slot(sb) + 70] ^= 0x01


def d_both_slots(img, recs, segs, sb):
    img[70] ^= 0x01
    img[sb.slot_bytes + 70] ^= 0x01


RAISE_C = ("raise", CorruptionError)
MIDDLE = {M.TOLERATE_TAIL: RAISE_C, M.ABSOLUTE: RAISE_C, M.POINT_IN_TIME: ("epoch", 9),
          M.SKIP_CORRUPT: ("epoch", EPOCHS)}
ALL_OK = {m: ("epoch", EPOCHS) for m in M}

# name, damage, diagnostic (regex), outcome per mode, SKIP_CORRUPT's incomplete epochs
TABLE = [
    ("length word zeroed", d_length_zero, r"zero length word followed by valid records", MIDDLE, [10]),
    ("length word changed", d_length_changed, r"record header CRC mismatch", MIDDLE, [10]),
    ("type unknown", d_type_unknown, r"unknown record type 0x33", MIDDLE, [10]),
    ("type flipped", d_type_flipped, r"record header CRC mismatch", MIDDLE, [10]),
    ("header CRC", d_header_crc, r"record header CRC mismatch, stored", MIDDLE, [10]),
    ("page CRC", d_page_crc, r"page CRC mismatch for page \d+", MIDDLE, [10]),
    ("missing commit", d_missing_commit, r"zero length word followed by valid records", MIDDLE, [11]),
    # the commit's zeroed bytes are followed by epoch 61's record: a lost record at the tail
    ("missing last commit", d_missing_last_commit,
     r"epoch 60 has no commit record|torn tail: zero length word followed by valid records",
     {M.TOLERATE_TAIL: ("epoch", EPOCHS - 1), M.ABSOLUTE: ("raise", TornTailError),
      M.POINT_IN_TIME: ("epoch", EPOCHS - 1), M.SKIP_CORRUPT: ("epoch", EPOCHS - 1)}, []),
    ("torn tail", d_torn_tail, r"page CRC mismatch",
     {M.TOLERATE_TAIL: ("epoch", EPOCHS), M.ABSOLUTE: ("raise", TornTailError),
      M.POINT_IN_TIME: ("epoch", EPOCHS), M.SKIP_CORRUPT: ("epoch", EPOCHS)}, []),
    ("stale salt", d_stale_salt, r"stale record .* followed by valid records", MIDDLE, [10]),
    ("broken chain", d_broken_chain, r"segment chain broken",
     {M.TOLERATE_TAIL: RAISE_C, M.ABSOLUTE: RAISE_C, M.POINT_IN_TIME: ("epoch", None),
      M.SKIP_CORRUPT: ("epoch", EPOCHS)}, None),
    # a bad header on the last segment hides the commits in it: corruption, not a tail
    ("last segment header", d_last_segment_header, r"segment header CRC mismatch",
     {M.TOLERATE_TAIL: RAISE_C, M.ABSOLUTE: RAISE_C, M.POINT_IN_TIME: ("epoch", None),
      M.SKIP_CORRUPT: ("epoch", None)}, None),
    ("one superblock slot bad", d_one_slot, r"superblock slot [AB] .*CRC mismatch.*other slot", ALL_OK, []),
    ("both superblock slots bad", d_both_slots, r"both superblock slots are invalid",
     {m: ("raise", SuperblockError) for m in M}, None),
]


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.value)
@pytest.mark.parametrize("name,damage,diag,outcome,incomplete", TABLE, ids=[t[0] for t in TABLE])
def test_damage(base, name, damage, diag, outcome, incomplete, mode):
    img0, model, recs, segs, sb = base
    img = bytearray(img0)
    damage(img, recs, segs, sb)
    dropped = []
    want, arg = outcome[mode]
    if want == "raise":
        with pytest.raises(arg, match=diag) as ei:
            reopen(img, writable=False, mode=mode, reporter=dropped.append)
        assert "\n" not in str(ei.value)
        if arg is not SuperblockError:
            assert "segment " in str(ei.value) and "@ 0x" in str(ei.value)
        return
    log = reopen(img, writable=False, mode=mode, reporter=dropped.append)
    reasons = [f"{d.where}: {d.reason}" for d in dropped]
    assert any(__import__("re").search(diag, r) for r in reasons), reasons
    assert all(d.where.startswith("segment ") or d.kind == "superblock" for d in dropped)
    assert log.dropped == dropped
    e = log.last_committed_epoch
    if arg is not None:
        assert e == arg, reasons
    # nothing uncommitted is applied, and what is recovered is bit-exact
    assert not any(r.epoch > e for r in log.records())
    if mode is not M.SKIP_CORRUPT:
        assert (replay(log, model.npages, model.page_bytes) == model.state_after(e)).all()
        assert [c.epoch for c in log.commits] == list(range(1, e + 1))
    elif incomplete is not None:
        assert log.incomplete_epochs == incomplete
    # the uncommitted epoch 61 at the tail is always reported
    if name not in ("torn tail",) and e == EPOCHS:
        assert any(d.kind == "uncommitted" and "epoch 61" in d.reason for d in dropped)


def test_verify_reports_all_problems(base):
    img0, model, recs, segs, sb = base
    img = bytearray(img0)
    d_page_crc(img, recs, segs, sb)                      # epoch 10: corrupt
    r30 = first(recs, F.REC_PAGE_BATCH, 30)
    img[r30.offset + 61] ^= 0xFF                         # epoch 30: corrupt
    d_torn_tail(img, recs, segs, sb)                     # epoch 61: torn
    log = reopen(img, writable=False, mode=M.SKIP_CORRUPT)
    v = log.verify()
    kinds = [(p["kind"], p["reason"]) for p in v["problems"]]
    assert not v["ok"] and v["corrupt"] == 4 and v["torn"] == 1, kinds
    # the two damaged records, and the two commits whose epochs they leave incomplete
    assert sum(k == "corrupt" and r.startswith("page CRC mismatch") for k, r in kinds) == 1
    assert sum(k == "corrupt" and r.startswith("record header CRC mismatch") for k, r in kinds) == 1
    assert v["incomplete_epochs"] == [10, 30]
    assert all(p["where"].startswith("segment ") for p in v["problems"])


def test_writable_open_cuts_torn_tail_and_zeroes_it(base):
    img0, model, recs, segs, sb = base
    img = bytearray(img0)
    d_torn_tail(img, recs, segs, sb)
    from concordia.devmem import MemoryBackend
    from concordia.wal import Log
    b = MemoryBackend.from_bytes(bytes(img))
    log = Log.open(b, writable=True)
    last_commit = first(recs, F.REC_COMMIT, EPOCHS)
    cut = last_commit.offset + last_commit.length
    seg_end = next(s for s in log.volume.live_segments() if s.index == last_commit.segment)
    assert not b.array[cut:seg_end.offset + seg_end.nbytes].any()
    model.write_epoch(log, 0, EPOCHS + 1)
    log2 = Log.open(b, writable=False, mode=M.ABSOLUTE)
    assert log2.last_committed_epoch == EPOCHS + 1 and log2.dropped == []
    assert (replay(log2, model.npages, model.page_bytes) == model.state_after(EPOCHS + 1)).all()
