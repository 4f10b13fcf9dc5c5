"""Shared fixtures.  GPU tests carry the `gpu` marker and skip, with the reason,
where CuPy or a CUDA device is missing.

Files in /dev/shm outlive the test run that makes them (16 MiB each for a
session's log), so none may be left: a name a test makes there carries this
run's process id (`shm_test_name`), and `no_shm_file_left_behind` fails the
run when one is still there at its end (removing it), whatever test made it.
Other runs of the suite on the same machine use other ids, so what they do
never counts here."""

from __future__ import annotations

import functools
import os
import signal
import uuid

import pytest

SHM_DIR = "/dev/shm"

# A run started in the background by a shell without job control inherits
# SIGINT ignored, and so would every child it starts: the Ctrl-C tests would
# see no interrupt and `dump --follow` would never stop.  A handler here (not
# an ignore) is reset to the default in every child at exec, as under a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def shm_test_name(what: str = "") -> str:
    """A new name for a test's file in /dev/shm: `concordia-test-[WHAT-]PID-HEX`."""
    return "-".join(["concordia-test", *([what] if what else []), str(os.getpid()), uuid.uuid4().hex[:12]])


def _this_runs_shm_files() -> set[str]:
    """Names in /dev/shm of this run's tests: `concordia-test-...` with this
    process's id as one of its dash-separated words."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return set()
    pid = str(os.getpid())
    return {n for n in names if n.startswith("concordia-test-") and pid in n.split("-")}


@pytest.fixture(scope="session", autouse=True)
def no_shm_file_left_behind():
    """The whole run leaves nothing of its own in /dev/shm: what is left at the
    end is named, removed, and fails the run."""
    before = _this_runs_shm_files()
    yield
    left = sorted(_this_runs_shm_files() - before)
    for name in left:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
    if left:
        pytest.fail(f"the test run left {len(left)} file(s) in {SHM_DIR}: {', '.join(left)}", pytrace=False)


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except Exception as exc:  # ImportError or a broken CUDA install
        return f"CuPy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device ({exc})"
    if n < 1:
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hugetlb_mount():
    """A directory on a hugetlbfs with free 2 MiB pages (set up as root and put
    back afterwards, see tests/hugepages.py); skips with the reason where none
    can be had."""
    from tests.hugepages import hugetlbfs

    with hugetlbfs() as (where, why):
        if where is None:
            pytest.skip(f"hugetlb tier: {why}")
        yield where
