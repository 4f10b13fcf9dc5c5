"""A hugetlbfs with free 2 MiB pages for the tests of the hugetlb tier, or the
reason there is none.

In order: a mount named by $CONCORDIA_HUGETLB_DIR or an existing hugetlbfs
mount with enough free pages is used as it is; else, as root, the pool is
grown by the pages the tests need (`/proc/sys/vm/nr_hugepages`) and a private
hugetlbfs is mounted in a temporary directory; at the end both are put back.
The pool is changed by a difference under a file lock, so that test processes
running side by side (pytest -n) each give back exactly what they took.  CI
(no root, no pool) skips with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile

from concordia.devmem import hugetlb

PAGE = 2 << 20
NR = "/proc/sys/vm/nr_hugepages"
LOCK = os.path.join(tempfile.gettempdir(), "concordia-test-hugepages.lock")


def _read_nr() -> int:
    with open(NR) as f:
        return int(f.read().strip())


@contextlib.contextmanager
def _pool_lock():
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _existing(pages: int) -> str | None:
    cands = [os.environ[hugetlb.ENV_DIR]] if os.environ.get(hugetlb.ENV_DIR) else hugetlb.mounts()
    for d in cands:
        try:
            if (os.path.isdir(d) and os.access(d, os.W_OK) and hugetlb.page_size_of(d) == PAGE
                    and hugetlb.free_pages(PAGE, d) >= pages):
                return d
        except Exception:
            continue
    return None


@contextlib.contextmanager
def hugetlbfs(pages: int = 32):
    """Yield (directory on a hugetlbfs with `pages` free 2 MiB pages, None), or
    (None, why not)."""
    d = _existing(pages)
    if d is not None:
        yield d, None
        return
    if os.geteuid() != 0:
        yield None, "no hugetlbfs with free 2 MiB pages is mounted, and not root to set one up (scripts/hugepages.sh setup)"
        return
    if not os.path.exists(NR) or not os.access(NR, os.W_OK):
        yield None, f"{NR} cannot be written here (no huge page pool to grow)"
        return
    mnt = tempfile.mkdtemp(prefix="concordia-test-huge-")
    grown = 0
    mounted = False
    try:
        with _pool_lock():
            before = _read_nr()
            try:
                with open(NR, "w") as f:
                    f.write(str(before + pages))
            except OSError as exc:
                yield_reason = f"cannot grow the huge page pool: {exc.strerror}"
            else:
                grown = _read_nr() - before   # the kernel gives what it can find
                yield_reason = None if grown >= pages else (
                    f"the kernel found {grown} of the {pages} huge pages asked for")
        if yield_reason is None:
            r = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", mnt],
                               capture_output=True, text=True)
            mounted = r.returncode == 0
            if not mounted:
                yield_reason = f"mount -t hugetlbfs failed: {(r.stderr or r.stdout).strip()}"
        if yield_reason is None and hugetlb.free_pages(PAGE, mnt) < pages:
            yield_reason = "the huge pages were taken by another process meanwhile"
        yield (None, yield_reason) if yield_reason else (mnt, None)
    finally:
        if mounted:
            subprocess.run(["umount", mnt], capture_output=True)
        if grown > 0:
            with _pool_lock():
                with open(NR, "w") as f:
                    f.write(str(max(0, _read_nr() - grown)))
        os.rmdir(mnt)
