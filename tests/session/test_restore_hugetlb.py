"""The device restore on huge-page logs: which restores it pins in pieces
ahead of the copy engine (CPU), and a restore from a hugetlb log equal to the
host applier's (GPU).  Skipped with the reason where no hugetlbfs with free
pages can be had."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from concordia.devmem import open_backend
from concordia.restore.device import pins_ahead, register_piece


@pytest.fixture
def huge_dir(hugetlb_mount):
    d = os.path.join(hugetlb_mount, uuid.uuid4().hex[:12])
    os.mkdir(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_large_restores_copy_small_ones_pin_on_huge_and_4k_pages_alike(huge_dir, tmp_path):
    from concordia.restore.device import PIN_SMALL_BYTES

    with open_backend(f"hugetlb:{huge_dir}/log", size=4 << 20, create=True) as b:
        # hugetlb copied a large restore faster than it pinned it (recovery.md, twenty-second section)
        assert not pins_ahead(b, "auto") and pins_ahead(b, "pin") and not pins_ahead(b, "copy")
        assert pins_ahead(b, "auto", PIN_SMALL_BYTES) and not pins_ahead(b, "auto", PIN_SMALL_BYTES + 1)
        assert register_piece(b) % b.alignment == 0
    name = f"concordia-test-{uuid.uuid4().hex[:10]}"
    with open_backend(f"shm:{name}", size=1 << 20, create=True) as b:
        try:
            assert not pins_ahead(b, "auto") and pins_ahead(b, "pin")
            # a small restore pins what it reads rather than allocate pinned buffers for it
            assert pins_ahead(b, "auto", PIN_SMALL_BYTES) and not pins_ahead(b, "auto", PIN_SMALL_BYTES + 1)
            assert not pins_ahead(b, "copy", 1)
        finally:
            os.unlink(b.path)
    with open_backend(f"file:{tmp_path}/log", size=1 << 20, create=True) as b:
        assert not pins_ahead(b, "auto", 1) and not pins_ahead(b, "pin")   # page cache: not pinnable


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [64 << 10, 32 << 20])
def test_device_restore_from_hugetlb_pins_ahead(huge_dir, chunk_bytes):
    from concordia.restore.device import apply_plan_cupy
    from concordia.wal import Log
    from concordia.wal.apply import apply_plan_numpy
    from concordia.wal.planner import plan

    from .test_restore_gpu import _same
    from .test_restore_transfer import _history

    spec = f"hugetlb:{huge_dir}/log"
    _history(spec)
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        p = plan(log)
        st = {}
        got = apply_plan_cupy(log, p, chunk_bytes=chunk_bytes, stats=st)   # read="auto"
        _same(got, apply_plan_numpy(log, p))
        assert "pinned ahead" in st["via"], st
    finally:
        log.close()


@pytest.mark.gpu
def test_a_device_recovery_from_hugetlb_names_where_all_its_time_went(huge_dir):
    """Session.recover on the device pipeline from a huge-page log: its phases
    name what no other phase names ("other"), so together they are the
    recovery's whole time; the pieces pinned ahead stay pinned with the log."""
    from concordia import Session

    from .test_restore_transfer import _history

    spec = f"hugetlb:{huge_dir}/log"
    _history(spec)
    with Session(spec, create=False) as s:
        s.recover(device="cupy")
        st = s.last_recovery
    ph = st.phases
    assert list(ph)[:3] == ["open", "targets", "plan"] and {"other", "present"} <= set(ph), ph
    assert all(p["s"] >= 0 for p in ph.values())
    inside = sum(p["s"] for k, p in ph.items() if k not in ("open", "targets"))
    assert abs(inside - (st.plan_ms + st.restore_ms) / 1e3) < 1e-5, (inside, st.plan_ms, st.restore_ms)
    parts = ph["alloc"]["parts"]   # the allocation's own parts, inside it
    assert set(parts) == {"staging", "regions", "page_tables", "kernels"}, parts
    assert sum(parts.values()) <= ph["alloc"]["s"] + 1e-6, (parts, ph["alloc"])
