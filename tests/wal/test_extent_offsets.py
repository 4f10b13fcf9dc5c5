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


def _extent_of_records(n=20, pb=256):
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
        ref.stage_page_batch(region, ids, ext.view, cursor, page_bytes=pb, base_lsn=ext.lsn, epoch=1, region_id=rid,
                             salt=ext.salt)
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
