"""The hugetlb tier beyond the conformance class: naming, rounding, the free
page check, surviving a crashed writer.  Skipped, with the reason, where no
hugetlbfs with free pages can be had (CI); here as root the tests reserve a
few pages and put the setting back (tests/hugepages.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from concordia.devmem import hugetlb, open_backend, parse_spec
from concordia.devmem.errors import BadSpecError, DevmemError

MIB = 1 << 20


@pytest.fixture
def where(hugetlb_mount):
    d = os.path.join(hugetlb_mount, uuid.uuid4().hex[:12])
    os.mkdir(d)
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def test_a_plain_path_on_hugetlbfs_is_detected(where):
    assert parse_spec(os.path.join(where, "log")).kind == "hugetlb"
    assert parse_spec(f"hugetlb:{where}/log").path == os.path.join(where, "log")


def test_a_bare_name_goes_to_the_default_mount(where, monkeypatch):
    monkeypatch.setenv(hugetlb.ENV_DIR, where)
    assert parse_spec("hugetlb:x").path == os.path.join(where, "x")


def test_a_bare_name_without_any_mount_is_one_line(monkeypatch):
    monkeypatch.delenv(hugetlb.ENV_DIR, raising=False)
    monkeypatch.setattr(hugetlb, "mounts", lambda: [])
    with pytest.raises(BadSpecError) as ei:
        parse_spec("hugetlb:x")
    assert "no hugetlbfs is mounted" in str(ei.value) and "\n" not in str(ei.value)


def test_hugetlb_prefix_off_hugetlbfs_is_refused(tmp_path):
    with pytest.raises(BadSpecError) as ei:
        open_backend(f"hugetlb:{tmp_path}/log", size=2 * MIB, create=True)
    assert "not on a hugetlbfs mount" in str(ei.value)
    assert not os.path.exists(tmp_path / "log")


def test_sizes_round_up_to_the_huge_page(where):
    with open_backend(f"hugetlb:{where}/log", size=3 * MIB + 5, create=True) as b:
        assert b.size == 4 * MIB and b.alignment == 2 * MIB
    assert os.stat(f"{where}/log").st_size == 4 * MIB
    with open_backend(f"{where}/log") as b:   # reopened: the file's length
        assert b.size == 4 * MIB


def test_more_than_the_free_pages_is_refused_before_creating(where):
    free = hugetlb.free_pages(2 * MIB, where)
    with pytest.raises(DevmemError) as ei:
        open_backend(f"hugetlb:{where}/big", size=(free + 1) * 2 * MIB, create=True)
    assert "huge pages" in str(ei.value) and "free" in str(ei.value)
    assert not os.path.exists(f"{where}/big")


def test_bytes_outlive_a_killed_writer(where):
    """Like shm: a writer SIGKILLed after storing leaves its bytes in the file."""
    path = f"{where}/crash"
    child = textwrap.dedent(f"""
        import os, sys, numpy as np
        from concordia.devmem import open_backend
        b = open_backend({path!r}, size=4 << 20, create=True)
        b.array[:] = np.arange(b.size, dtype=np.uint64).astype(np.uint8)
        b.persist(0, b.size)
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        os.kill(os.getpid(), 9)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and r.stdout == "ready\n", r.stderr
    with open_backend(path, readonly=True) as b:
        assert b.kind == "hugetlb"
        assert np.array_equal(b.array, np.arange(b.size, dtype=np.uint64).astype(np.uint8))


def test_a_log_on_hugetlb(where):
    """The WAL writes and recovers on the tier like on shm."""
    from concordia.wal import Log

    spec = f"hugetlb:{where}/wal"
    with Log.create(spec, size=8 * MIB, segment_size=2 * MIB) as log:
        rid = log.define_region("r", "uint8", (8192,), 4096, "opaque")
        pages = np.arange(8192, dtype=np.uint8).reshape(2, 4096)
        log.appender.append_page_batch(1, rid, np.array([0, 1], np.uint32), pages)
        log.appender.commit(1)
    with Log.open(spec, writable=False) as log:
        assert log.last_committed_epoch == 1 and log.backend.kind == "hugetlb"
