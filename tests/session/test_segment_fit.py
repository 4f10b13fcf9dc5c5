"""Page batches are cut to fit the segment they go into: a record's header,
page table, CRC table and payload together never exceed what one segment
holds, whatever the segment size and however large the region."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint import staging as session_mod
from concordia.errors import SessionError
from concordia.regions.region import Region
from concordia.wal import format as F

MiB = 1 << 20

#: segment sizes a log is made with (multiples of 1 MiB; 8 MiB is the CLI docs' example)
SEGMENTS = [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB, 8 * MiB, 9 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
PAGES = [64, 4096, 65536, 512 * 1024]


def _region(page_bytes: int) -> Region:
    return Region(name="r", kind="opaque", page_bytes=page_bytes, array=np.zeros(64, np.uint8), xp=np,
                  owner=None, storage=(), detect="shadow", hints={})


def _boundary_counts(segment: int, page_bytes: int) -> list[int]:
    """Page counts whose payload lies at the edges that matter: one segment's
    capacity, one segment, the batch limit, twice a segment."""
    cap = segment - F.SEGMENT_HEADER_SIZE
    out = set()
    for nbytes in (cap, segment, session_mod.MAX_BATCH_BYTES, 2 * segment):
        n = nbytes // page_bytes
        out.update(k for k in (n - 1, n, n + 1) if k > 0)
    return sorted(out)


@pytest.mark.parametrize("segment", SEGMENTS, ids=lambda s: f"{s // MiB}MiB")
@pytest.mark.parametrize("page_bytes", PAGES)
def test_every_batch_fits_its_segment(segment, page_bytes):
    cap = segment - F.SEGMENT_HEADER_SIZE
    r = _region(page_bytes)
    for count in _boundary_counts(segment, page_bytes):
        batches = session_mod.plan_batches(r, count, cap)
        assert batches[0].lo == 0 and batches[-1].hi == count
        assert all(a.hi == b.lo for a, b in zip(batches, batches[1:]))  # in order, no gap
        for b in batches:
            assert b.length == F.page_batch_length(b.hi - b.lo, page_bytes)
            assert b.length <= cap, (count, b)
            assert (b.hi - b.lo) * page_bytes <= session_mod.MAX_BATCH_BYTES
        # as large as allowed: one more page would break the segment or the batch limit
        full = batches[0].hi - batches[0].lo
        if len(batches) > 1:
            assert (F.page_batch_length(full + 1, page_bytes) > cap
                    or (full + 1) * page_bytes > session_mod.MAX_BATCH_BYTES)


def test_page_batch_max_pages_inverts_the_length():
    for cap in (64, 127, 128 + 64, MiB - 256, 8 * MiB - 256, 8 * MiB + 4096):
        for pb in (64, 128, 4096, 65536):
            n = F.page_batch_max_pages(cap, pb)
            assert n == 0 or F.page_batch_length(n, pb) <= cap
            assert F.page_batch_length(n + 1, pb) > cap


@pytest.mark.parametrize("staging", ["host", "mapped", "ring"])
def test_a_region_of_twice_the_segment_checkpoints_into_8_mib_segments(tmp_path, staging):
    # the report: with 8 MiB segments every checkpoint of a region >= 8 MiB
    # raised RecordTooLargeError (an 8 MiB payload plus its header and tables)
    seg = 8 * MiB
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, size=2 * seg, dtype=np.uint8)
    edge = rng.integers(0, 256, size=seg, dtype=np.uint8)
    log = f"file:{tmp_path / 'big.log'}"
    # room for retention's base images beside the deltas (it is on by default)
    with Session(log, size=160 * MiB, segment_size=seg, staging=staging) as s:
        s.register("big", big, page_bytes=4096)
        s.register("edge", edge, page_bytes=65536)
        first = s.checkpoint()
        assert first.pages == {"big": 2 * seg // 4096, "edge": seg // 65536}
        big[5 * MiB:13 * MiB] ^= 0xFF  # a delta larger than one batch, across batches
        edge[:] = 0
        s.checkpoint()
        want = {"big": big.copy(), "edge": edge.copy()}
    with Session(log, create=False) as s:
        got = s.recover()
        assert s.last_recovery.epoch == 2
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    from concordia.wal import Log

    with Log.open(log, writable=False) as lg:
        assert max(r.length for r in lg.records()) <= seg - F.SEGMENT_HEADER_SIZE


def test_a_region_across_many_small_segments():
    # 1 MiB segments, 64 KiB pages: 15 pages a record, a 3 MiB region in 4 records
    data = np.arange(3 * MiB, dtype=np.uint8)
    with Session("memory:", size=16 * MiB, segment_size=MiB) as s:
        s.register("r", data, page_bytes=65536)
        s.checkpoint()
        data[::7] += 1
        s.checkpoint()
        got = s.recover()
    assert got["r"].tobytes() == data.tobytes()


def test_a_page_that_fits_no_segment_is_refused_at_register(tmp_path):
    log = f"file:{tmp_path / 'x.log'}"
    with Session(log, size=16 * MiB, segment_size=MiB) as s:
        with pytest.raises(SessionError, match="does not fit a log segment") as ei:
            s.register("huge", np.zeros(2 * MiB, np.uint8), page_bytes=MiB)
        assert "region 'huge'" in str(ei.value) and "\n" not in str(ei.value)
        assert s.log.regions == {}  # refused before anything was written


def test_the_region_table_cuts_records_to_the_segment_too():
    # the table pass lays out its records from per_record: bounded by the
    # segment as the per-region paths are (an 8 MiB payload at 64 KiB pages
    # would not fit an 8 MiB segment with its header and tables)
    from concordia.checkpoint.table import RegionTable

    seg = 8 * MiB
    with Session("memory:", size=64 * MiB, segment_size=seg, staging="mapped") as s:
        s.register("a", np.zeros(2 * seg, np.uint8), page_bytes=65536)
        s.register("b", np.zeros(seg, np.uint8), page_bytes=4096)
        s.checkpoint()  # a table is made of regions with a base in the log
        cap = s.log.appender.segment_capacity
        t = RegionTable(list(s.regions.values()), cap)
        for e in t.entries:
            assert F.page_batch_length(int(e["per_record"]), int(e["page_bytes"])) <= cap
        assert int(t.entries["per_record"][0]) < 8 * MiB // 65536
