"""A fresh process's recovery says where its time went (`RecoveryStats.phases`):
the log's open, the checks of the targets, the plan, the pass that reads, checks and writes the pages,
with the bytes and the rate of that pass, and the wait for the host's checks
of the pages no applier read; later recoveries of the same session leave the
open out."""

from __future__ import annotations

import json

import numpy as np

from concordia import Session

from .state import LOG_SIZE, SEGMENT


def test_a_fresh_recovery_reports_open_plan_and_the_check_copy_pass(file_log):
    a = np.arange(64 * 1024, dtype=np.uint32)
    with Session(file_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("a", a)
        s.checkpoint()
        a[:1024] += 1
        s.checkpoint()
    with Session(file_log, create=False) as s:
        got = s.recover()
        st = s.last_recovery
        # the first checkpoint's record is read in part (its first 4 KiB page is the delta's): the
        # host checks its pages beside the applier, and the recovery waits for them at the end
        assert list(st.phases) == ["open", "targets", "plan", "check_copy", "check_wait", "present"]
        assert all(p["s"] >= 0 for p in st.phases.values()) and st.phases["check_wait"]["overlapped_s"] > 0
        assert st.phases["check_copy"]["bytes"] == st.bytes > 0 and st.phases["check_copy"]["GBps"] > 0
        assert abs(st.phases["plan"]["s"] * 1e3 - st.plan_ms) < 1e-6
        # the targets are checked before the plan's clock starts; the rest is the recovery's time
        assert sum(p["s"] for k, p in st.phases.items() if k not in ("open", "targets")) <= \
            (st.plan_ms + st.restore_ms) / 1e3 + 1e-6
        np.testing.assert_array_equal(got["a"], a)
        json.dumps(st.to_json())
        s.recover()
        assert "open" not in s.last_recovery.phases and "check_copy" in s.last_recovery.phases
