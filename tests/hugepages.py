"""A hugetlbfs with free 2 MiB pages for the tests of the hugetlb tier, or the
reason there is none.

In order: a mount named by $CONCORDIA_HUGETLB_DIR or an existing hugetlbfs
mount with enough free pages is used as it is; else, as root, the pool is
grown by the pages the tests need (`/proc/sys/vm/nr_hugepages`) and a private
hugetlbfs is mounted in a temporary directory; at the end both are put back.
The pool is changed by a difference under a file lock, so that test processes
running side by side (pytest -n) each give back exactly what they took.  A
test process killed outright (SIGKILL, SIGTERM) cannot put anything back: its
mount is named after its pid with the pages it added beside it, and the next
set-up gives back what a dead process left.  CI (no root, no pool) skips with
the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import glob
import os
import subprocess
import tempfile

from concordia.devmem import hugetlb

PAGE = 2 << 20
NR = "/proc/sys/vm/nr_hugepages"
LOCK = os.path.join(tempfile.gettempdir(), "concordia-test-hugepages.lock")
PREFIX = os.path.join(tempfile.gettempdir(), "concordia-test-huge-")


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


def _give_back_left_over() -> None:
    """Unmount and give back what test processes that died without their
    teardown left (caller holds the pool lock)."""
    for note in glob.glob(PREFIX + "*.pages"):
        mnt = note[:-len(".pages")]
        try:
            pid = int(os.path.basename(mnt)[len(os.path.basename(PREFIX)):].split("-")[0])
            os.kill(pid, 0)
            continue            # its owner still runs
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        if os.path.ismount(mnt):
            for f in glob.glob(os.path.join(glob.escape(mnt), "**"), recursive=True):
                if os.path.isfile(f):
                    os.unlink(f)
            if subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
                continue        # still in use: leave it for a later set-up
        with open(note) as f:
            grown = int(f.read().strip() or 0)
        with open(NR, "w") as f:
            f.write(str(max(0, _read_nr() - grown)))
        os.unlink(note)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


def _existing(pages: int) -> str | None:
    cands = [os.environ[hugetlb.ENV_DIR]] if os.environ.get(hugetlb.ENV_DIR) else hugetlb.mounts()
    for d in cands:
        if d.startswith(PREFIX):
            continue    # another test process's own: it unmounts it when it ends
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
    mnt = tempfile.mkdtemp(prefix=f"{os.path.basename(PREFIX)}{os.getpid()}-")
    note = mnt + ".pages"
    grown = 0
    mounted = False
    try:
        with _pool_lock():
            _give_back_left_over()
            before = _read_nr()
            try:
                with open(NR, "w") as f:
                    f.write(str(before + pages))
            except OSError as exc:
                yield_reason = f"cannot grow the huge page pool: {exc.strerror}"
            else:
                grown = _read_nr() - before   # the kernel gives what it can find
                with open(note, "w") as f:
                    f.write(str(grown))
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
            # a log still mapped there keeps the mount busy: mappings only cycles hold go first,
            # and one still held detaches (lazily) rather than fail the run's last test
            gc.collect()
            if subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", mnt], capture_output=True)
        if grown > 0:
            with _pool_lock():
                with open(NR, "w") as f:
                    f.write(str(max(0, _read_nr() - grown)))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(note)
        os.rmdir(mnt)
