"""A source that takes a record whole (a base of a KV region of 256-byte pages
holds millions of pages) is planned with no memory or time per page: its rows
and page ids are read-only views of one shared range (`planner.ascending`)."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.wal import Log
from concordia.wal.planner import ascending, is_ascending, plan


def test_ascending_views_are_read_only_ranges_and_known():
    a = ascending(5, 7)
    assert a.tolist() == list(range(5, 12)) and a.dtype == np.int64 and is_ascending(a)
    big = ascending(0, 1 << 20)   # the shared range grows; earlier views stay valid and known
    assert is_ascending(big) and is_ascending(a) and a.tolist() == list(range(5, 12))
    assert not is_ascending(np.arange(5, 12)) and not is_ascending(a[::2])
    with pytest.raises(ValueError):
        a[0] = 1


def test_a_record_taken_whole_plans_as_views_and_one_read_in_part_as_arrays(tmp_path):
    spec = f"file:{tmp_path / 'w.log'}"
    kv = np.arange(64 * 100, dtype=np.float32)   # 100 pages of 256 bytes
    with Session(spec, size=16 << 20, segment_size=4 << 20) as s:
        s.register("kv", kv, kind="kv", page_bytes=256)
        s.checkpoint()
        kv[64 * 7] = -1   # page 7
        s.checkpoint()
    with Log.open(spec, writable=False, check_pages=False) as log:
        first, delta = plan(log).regions["kv"].sources
    assert delta.page_ids.tolist() == [7] and not is_ascending(first.rows)   # page 7 is the delta's
    assert first.page_ids.tolist() == [i for i in range(100) if i != 7]
    with Log.open(spec, writable=False, check_pages=False) as log:
        (only,) = plan(log, target=1).regions["kv"].sources
    assert is_ascending(only.rows) and is_ascending(only.page_ids) and only.rows.tolist() == list(range(100))
