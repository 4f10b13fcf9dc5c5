"""An extent finished with the offsets of its records (how a table pass
finishes the epoch's one extent): the headers are checked as arrays with the
same conditions as the walk, and a commit takes its digests as arrays."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from concordia.gpu_kernels import reference as ref
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.errors import UsageError

from .helpers import image, reopen


def test_the_numpy_header_is_the_struct_header():
    assert F.RECORD_HEADER_DTYPE.itemsize == F.RECORD_HEADER_SIZE
    fields = dict(length=4224, type=F.REC_PAGE_BATCH, lsn=0x1234, epoch=9, region_id=7, salt=0xABCD, body_crc=5,
                  count=1, page_bytes=4096, aux=3, flags=F.FLAG_BASE)
    h = np.frombuffer(F.encode_record_header(**fields), F.RECORD_HEADER_DTYPE)[0]
    for k, v in fields.items():
        assert int(h[k]) == v, k
    assert int(h["header_crc"]) == struct.unpack_from("<I", F.encode_record_header(**fields), 60)[0]


def test_commit_digests_as_arrays_encode_as_the_dict():
    ids = np.array([9, 2, 5, 70000], np.uint32)
    dig = np.array([1, 0xFFFFFFFF, 3, 4], np.uint32)
    assert F.encode_commit_body(3, 4, 5, (ids, dig)) == F.encode_commit_body(3, 4, 5, dict(zip(ids.tolist(),
                                                                                           dig.tolist())))
    with pytest.raises(Exception, match="twice"):
        F.encode_commit_body(3, 4, 5, (np.array([1, 1]), np.array([2, 3])))


def _extent_of_records(n=20, pb=256, epochs=None, flags=None):
    log = Log.create("memory:", size=64 << 20, segment_size=8 << 20)
    rid = log.define_region("r", "uint8", (n * pb,), pb, "opaque")
    region = np.random.default_rng(1).integers(0, 255, n * pb, dtype=np.uint8)
    app = log.appender
    lengths = [ref.page_batch_length(1 + i % 3, pb) for i in range(n)]
    ext = app.reserve_extent(sum(lengths) + 4096)
    cursor = ref.new_cursor()
    offsets = []
    for i in range(n):
        offsets.append(int(cursor[ref.CURSOR_USED]))
        ids = np.arange(1 + i % 3, dtype=np.uint32)  # pages 0.. of the region, 1 to 3 of them
        ref.stage_page_batch(region, ids, ext.view, cursor, page_bytes=pb, base_lsn=ext.lsn,
                             epoch=1 if epochs is None else epochs[i], region_id=rid, salt=ext.salt,
                             flags=0 if flags is None else flags[i])
    return log, app, ext, np.array(offsets), int(cursor[ref.CURSOR_USED])


def test_finishing_by_offsets_counts_as_the_walk():
    log, app, ext, offsets, used = _extent_of_records()
    app.finish_extent(ext, used, offsets.size, offsets=offsets)
    by_offsets = dict(app.stats)
    log2, app2, ext2, offsets2, used2 = _extent_of_records()
    app2.finish_extent(ext2, used2, offsets2.size)
    assert by_offsets == app2.stats and by_offsets[1][:2] == [offsets.size, used]
    app.commit(1, digests=(np.array([0], np.uint32), np.array([7], np.uint32)))
    assert log.commits[-1].digests == {0: 7}


def test_headers_the_caller_checked_count_as_the_walk_for_many_epochs():
    """An arena's extent holds many epochs: finished with the offsets and the
    headers its own walk checked (`checked=`), with the offsets alone, or by
    the walk, the appender counts each epoch's records, bytes and first LSN
    alike (one epoch's records need not be together)."""
    epochs = [1, 1, 2, 2, 2, 3, 4, 4, 3, 5, 5, 5, 5, 6, 7, 7, 8, 8, 9, 9]
    base = [0, F.FLAG_BASE, 0, 0, 0, F.FLAG_BASE, 0, 0, 0, F.FLAG_BASE, F.FLAG_BASE] + [0] * 9  # BASE: not counted
    got = []
    for how in ("checked", "offsets", "walk"):
        log, app, ext, offsets, used = _extent_of_records(epochs=epochs, flags=base)
        if how == "checked":
            h, ok = F.record_headers_at(ext.view, offsets, ext.lsn, ext.salt)
            assert ok.all()
            app.finish_extent(ext, used, offsets.size, offsets=offsets, checked=h)
        elif how == "offsets":
            app.finish_extent(ext, used, offsets.size, offsets=offsets)
        else:
            app.finish_extent(ext, used, offsets.size)
        got.append(dict(app.stats))
    assert got[0] == got[1] == got[2]
    # epoch 3: its first record is BASE (not counted), so its first LSN is its second record's
    assert sorted(got[0]) == list(range(1, 10)) and got[0][3][0] == 1 and got[0][5][0] == 2
    assert got[0][3][2] == ext.lsn + int(offsets[8]) and got[0][1][0] == 1
    lengths = np.diff(np.append(offsets, used))
    assert sum(st[1] for st in got[0].values()) == int(lengths[np.array(base) == 0].sum())


def test_checked_headers_still_have_to_tile_the_bytes_used_and_be_this_extents():
    log, app, ext, offsets, used = _extent_of_records()
    h, _ = F.record_headers_at(ext.view, offsets, ext.lsn, ext.salt)
    with pytest.raises(UsageError, match="does not end where the next begins"):
        app.finish_extent(ext, used - 64, offsets.size, offsets=offsets, checked=h)
    log, app, ext, offsets, used = _extent_of_records()
    with pytest.raises(UsageError, match="checked headers for"):
        app.finish_extent(ext, used, offsets.size, offsets=offsets, checked=h[:-1])
    log, app, ext, offsets, used = _extent_of_records()   # another extent's headers: its LSNs and salt
    with pytest.raises(UsageError, match="names lsn"):
        app.finish_extent(ext, used, offsets.size, offsets=offsets, checked=h)


@pytest.mark.parametrize("damage, problem", [
    ("skip", "does not end where the next begins"),
    ("crc", "header CRC mismatch"),
    ("count", "producer said"),
    ("start", "start at 0"),
])
def test_bad_offsets_or_headers_are_named(damage, problem):
    log, app, ext, offsets, used = _extent_of_records()
    records = offsets.size
    if damage == "skip":
        offsets = np.delete(offsets, 5)
        records -= 1
    elif damage == "crc":
        ext.view[offsets[7] + 20] ^= 1
    elif damage == "count":
        records += 1
    elif damage == "start":
        offsets = offsets[1:]
        records -= 1
    with pytest.raises(UsageError, match=problem) as e:
        app.finish_extent(ext, used, records, offsets=offsets)
    assert "\n" not in str(e.value)
    if damage == "crc":
        assert f"0x{ext.offset + int(offsets[7]):x}" in str(e.value)


def _kinds(log) -> list:
    """(kind, epoch, lsn) of every valid record after the region descriptor."""
    return [(r.kind, r.epoch, r.lsn) for r in log.records(committed_only=False) if r.kind != F.REC_REGION]


def test_a_trimmed_extent_gives_its_unused_end_back_and_the_log_reads_as_an_exact_one():
    # an upper bound reserved (a pending epoch's extent), 4 KiB more than used:
    # trimmed, the commit follows the records directly and no pad is written
    log, app, ext, offsets, used = _extent_of_records()
    app.finish_extent(ext, used, offsets.size, offsets=offsets, trim=True)
    assert app.write_lsn == ext.lsn + used and app.stats[1][:2] == [offsets.size, used]
    app.commit(1)
    kinds = _kinds(log)
    assert [k for k, _, _ in kinds] == [F.REC_PAGE_BATCH] * offsets.size + [F.REC_COMMIT]
    assert kinds[-1][2] == ext.lsn + used  # the commit where an extent of `used` bytes would have ended
    # an extent with a reservation after it is not trimmed
    log2, app2, ext2, offsets2, used2 = _extent_of_records()
    exact = app2.reserve_extent(64)  # something taken after it: no trim, a pad covers the end
    app2.finish_extent(ext2, used2, offsets2.size, offsets=offsets2, trim=True)
    app2.finish_extent(exact, 0, 0)
    assert app2.write_lsn == ext2.lsn + ext2.length + 64  # the extent kept its length: its end is a pad
    assert app2.commit(1) == ext2.lsn + ext2.length + 64


def test_a_trimmed_extent_without_its_commit_is_a_clean_end():
    # a crash after the trim and before the commit: the records are there,
    # uncommitted, and the log ends cleanly at the zeroed slot after them
    log, app, ext, offsets, used = _extent_of_records()
    app.finish_extent(ext, used, offsets.size, offsets=offsets, trim=True)
    crashed = reopen(image(log.volume.backend), writable=False)
    assert crashed.last_committed_epoch == 0
    assert [k for k, _, _ in _kinds(crashed)] == [F.REC_PAGE_BATCH] * offsets.size
    assert [r for r in crashed.records(committed_only=True) if r.kind != F.REC_REGION] == []
