"""`Session.adopt`: arrays that hold the log's latest epoch (a standby's
takeover) continue as deltas, held to the log's digests first."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.regions.errors import SessionError
from concordia.restore.run import restore
from concordia.wal import Log

PAGE = 4096


def _log_with_epochs(path: str) -> np.ndarray:
    a = np.zeros((32, PAGE // 4), np.uint32)
    with Session(path, size=16 << 20, segment_size=1 << 20) as s:
        s.register("a", a)
        for i in range(4):
            a[i, :] = i + 1
            s.checkpoint()
    return a


def _restored(path: str) -> dict:
    log = Log.open(path, writable=False)
    try:
        return restore(log).arrays
    finally:
        log.close()


def test_adopted_arrays_continue_as_deltas(tmp_path):
    path = f"file:{tmp_path / 'log'}"
    want = _log_with_epochs(path)
    a = _restored(path)["a"].copy()
    with Session(path, create=False) as s:
        s.register("a", a)
        assert s.adopt(s.epoch) == {"a": "delta"}
        a[7, 5] = 99
        st = s.checkpoint()
        assert st.pages == {"a": 1}   # the one page changed, not the region whole
        want[7, 5] = 99
    np.testing.assert_array_equal(_restored(path)["a"], want)


def test_without_adopt_the_first_checkpoint_writes_the_region_whole(tmp_path):
    path = f"file:{tmp_path / 'log'}"
    _log_with_epochs(path)
    a = _restored(path)["a"].copy()
    with Session(path, create=False) as s:
        s.register("a", a)
        a[7, 5] = 99
        assert s.checkpoint().pages == {"a": a.nbytes // PAGE}


def test_an_array_that_differs_from_the_epoch_is_refused_in_one_line(tmp_path):
    path = f"file:{tmp_path / 'log'}"
    _log_with_epochs(path)
    a = _restored(path)["a"].copy()
    a[30, 0] ^= 1
    with Session(path, create=False) as s:
        s.register("a", a)
        with pytest.raises(SessionError) as e:
            s.adopt(s.epoch)
        assert "region 'a'" in e.value.one_line() and "does not hold epoch 4" in e.value.one_line()
        assert "\n" not in e.value.one_line()
        # nothing adopted: the next checkpoint writes it whole, so the log holds what the array holds
        assert s.checkpoint().pages == {"a": a.nbytes // PAGE}
    np.testing.assert_array_equal(_restored(path)["a"], a)


def test_only_the_latest_epoch_is_adopted_and_new_regions_are_written_whole(tmp_path):
    path = f"file:{tmp_path / 'log'}"
    _log_with_epochs(path)
    a = _restored(path)["a"].copy()
    b = np.arange(3000, dtype=np.int16)
    with Session(path, create=False) as s:
        s.register("a", a)
        s.register("b", b)
        with pytest.raises(SessionError, match="not the log's latest committed epoch"):
            s.adopt(s.epoch - 1)
        assert s.adopt(s.epoch) == {"a": "delta", "b": "whole"}
        st = s.checkpoint()
        assert st.pages.get("a", 0) == 0 and st.pages["b"] == 2
