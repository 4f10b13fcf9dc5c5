"""`Session.checkpoints` keeps the newest CHECKPOINTS_KEPT statistics, not a
long run's whole history; `Session.checkpoint_totals` counts every one."""

from __future__ import annotations

import numpy as np

from concordia import Session
from concordia.checkpoint.stats import CheckpointTotals
from concordia.session import CHECKPOINTS_KEPT


def test_the_history_is_bounded_and_the_totals_count_every_checkpoint(tmp_path):
    a = np.zeros(4096, np.uint8)
    n = CHECKPOINTS_KEPT + 44
    returned = []
    with Session(f"file:{tmp_path / 'h.log'}", size=16 << 20) as s:
        s.register("a", a)
        for i in range(n):
            a[i] += 1
            returned.append(s.checkpoint())
        assert s.checkpoints.maxlen == CHECKPOINTS_KEPT and len(s.checkpoints) == CHECKPOINTS_KEPT
        # the newest, oldest first, the very objects checkpoint() returned
        assert list(s.checkpoints) == returned[-CHECKPOINTS_KEPT:]
        assert [c.epoch for c in s.checkpoints] == list(range(n - CHECKPOINTS_KEPT + 1, n + 1))
        assert s.checkpoint_totals == CheckpointTotals(count=n, bytes=sum(c.bytes for c in returned),
                                                       log_bytes=sum(c.log_bytes for c in returned))
        assert s.checkpoint_totals.bytes > sum(c.bytes for c in s.checkpoints)  # what the deque forgot
