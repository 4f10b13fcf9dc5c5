"""The planner's last-writer-wins selection of a region's pages: records that
are each one run of page ids (a base image, a region written whole) are
selected in interval arithmetic (`_select_runs`: a few integer operations a
record, no pass over an array of the region's pages, none of which lets go of
the GIL), and give the very sources and zero pages the page-array selection
(`_select_pages`) gives."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from concordia.wal import planner


class _Rec(NamedTuple):
    page_ids: np.ndarray
    lsn: int


def _same(a, b):
    (sa, za), (sb, zb) = a, b
    assert [s.batch for s in sa] == [s.batch for s in sb]
    for x, y in zip(sa, sb):
        assert np.array_equal(x.rows, y.rows) and np.array_equal(x.page_ids, y.page_ids)
        assert x.rows.dtype == y.rows.dtype == np.int64 and x.page_ids.dtype == np.int64
    assert np.array_equal(za, zb) and za.dtype == zb.dtype == np.int64


@pytest.mark.parametrize("seed", range(40))
def test_runs_select_what_the_page_array_does(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    recs = []
    for k in range(int(rng.integers(0, 12))):
        lo = int(rng.integers(0, n))
        c = int(rng.integers(0, n - lo + 1))
        recs.append(_Rec(np.arange(lo, lo + c, dtype=np.uint32), 1000 - k))
    runs = planner._runs(recs, n)
    assert runs is not None
    _same(planner._select_runs(recs, runs, n), planner._select_pages(recs, n))


def test_a_whole_record_is_a_view_of_the_shared_range_and_a_region_wholly_written_has_no_zeros():
    n = 1 << 20
    recs = [_Rec(np.arange(0, n, dtype=np.uint32), 5), _Rec(np.arange(10, 20, dtype=np.uint32), 9)]
    picked, zeros = planner._select_runs(recs[::-1], planner._runs(recs[::-1], n), n)
    assert zeros.size == 0 and [s.batch.lsn for s in picked] == [5, 9]
    assert planner.is_ascending(picked[1].rows) and planner.is_ascending(picked[1].page_ids)
    assert picked[0].rows.size == n - 10 and not planner.is_ascending(picked[0].rows)


def test_runs_are_selected_without_the_page_array(monkeypatch):
    n = 4096
    recs = [_Rec(np.arange(0, n, dtype=np.uint32), 1), _Rec(np.arange(100, 300, dtype=np.uint32), 2)]
    want = planner._select_pages(recs[::-1], n)

    def refused(*a):
        raise AssertionError("the page array was made for records that are runs")
    monkeypatch.setattr(planner, "_select_pages", refused)
    _same(planner._select(_Region(n), [recs[0]], [recs[1]]), want)
    monkeypatch.setattr(planner, "RUN_SELECT_RECORDS", 1)   # more records than that: the page array
    with pytest.raises(AssertionError, match="page array"):
        planner._select(_Region(n), [recs[0]], [recs[1]])


def test_records_that_are_not_runs_take_the_page_array():
    n = 64
    recs = [_Rec(np.array([1, 5, 9], dtype=np.uint32), 2), _Rec(np.arange(0, 8, dtype=np.uint32), 1)]
    assert planner._runs(recs, n) is None
    assert planner._runs([_Rec(np.arange(60, 70, dtype=np.uint32), 1)], n) is None   # past the region's end
    _same(planner._select(_Region(n), [recs[1]], [recs[0]]), planner._select_pages(recs, n))


class _Region(NamedTuple):
    pages: int


def _covers_by_pages(recs, pages):
    seen = np.zeros(pages, bool)
    for b in recs:
        ids = np.asarray(b.page_ids, np.int64)
        if ids.size and ids[-1] >= pages:
            return False
        seen[ids] = True
    return bool(seen.all())


@pytest.mark.parametrize("seed", range(40))
def test_an_image_bases_cover_in_runs_is_the_page_arrays(seed):
    # an image base's records must hold every page (V-K3); runs decide it without the page array
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    recs, at = [], 0
    while at < n:   # mostly a whole cover in pieces, at times with a gap, an overlap or a run past the end
        c = int(rng.integers(1, n - at + 1))
        lo = at + int(rng.integers(-2, 3)) if at else 0
        lo = max(lo, 0)
        hi = min(lo + c, n + int(rng.integers(0, 2)))
        recs.append(_Rec(np.arange(lo, hi, dtype=np.uint32), 0))
        at = hi
    rng.shuffle(recs)
    want = _covers_by_pages(recs, n)
    assert planner._covers(recs, n, None) is want
    assert planner._covers(recs, n, _Region(n + 1)) is False   # the descriptor says otherwise


def test_an_image_base_of_scattered_pages_is_covered_by_the_page_array():
    n = 10
    recs = [_Rec(np.array([0, 2, 4, 6, 8], dtype=np.uint32), 0), _Rec(np.array([1, 3, 5, 7, 9], dtype=np.uint32), 0)]
    assert planner._runs(recs, n) is None and planner._covers(recs, n, None) is True
    assert planner._covers(recs[:1], n, None) is False


def test_a_cover_of_no_pages_or_no_records_is_the_page_arrays():
    empty = _Rec(np.zeros(0, np.uint32), 0)
    for recs, n in (([], 0), ([empty], 0), ([], 5), ([empty], 5), ([empty, _Rec(np.arange(5, dtype=np.uint32), 0)], 5)):
        assert planner._covers(recs, n, None) is _covers_by_pages(recs, n), (len(recs), n)
