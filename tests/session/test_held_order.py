"""An epoch whose order says its reads may not be one point of the producers'
work (`StreamOrder.verify`, which `HeldOrder` answers from the stream holds'
timeout counter) is refused before its commit, on the per-region paths and on
the table pass alike: nothing of it is recovered, and the session goes on."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.errors import SessionError
from concordia.regions.streams import StreamOrder

from .state import LOG_SIZE, SEGMENT


class Refusing(StreamOrder):
    def __init__(self):
        super().__init__([])
        self.asked = 0

    def verify(self) -> None:
        self.asked += 1
        raise SessionError("the holds timed out", where="test order")


def test_a_refused_order_commits_nothing_on_either_path(file_log):
    a = np.zeros(64 * 4096, np.uint8)
    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT, staging="mapped") as s:
        s.register("a", a)
        a[5] = 1
        order = Refusing()
        with pytest.raises(SessionError, match="holds timed out"):
            s.checkpoint(stream=order)                # the first epoch: the per-region path (a base)
        assert order.asked == 1
        s.checkpoint()
        a[6] = 1
        first = s.checkpoint()                        # the table pass takes every later epoch
        assert s.runner.table_pass(s.log) is not None
        a[5] = 2
        a[40 * 4096] = 3
        with pytest.raises(SessionError, match="holds timed out"):
            s.checkpoint(stream=order)                # on the table pass
        assert order.asked == 2
        got = s.recover()
        assert s.last_recovery.epoch == first.epoch and int(got["a"][5]) == 1 and int(got["a"][40 * 4096]) == 0
        st = s.checkpoint()                           # written whole after the refusal
        assert st.pages["a"] == 64
        got = s.recover()
        assert s.last_recovery.epoch == st.epoch
        np.testing.assert_array_equal(got["a"], a)
    with Session(file_log, create=False) as r:
        np.testing.assert_array_equal(r.recover()["a"], a)
