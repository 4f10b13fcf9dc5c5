"""The hugetlb tier: a log file on a hugetlbfs mount, mapped in huge pages
(2 MiB, or 1 GiB on a mount with `pagesize=1G`).

Why a tier of its own: the kernel pins a mapping for the GPU page by page, so
`cudaHostRegister` of a hugetlbfs mapping runs some 3.5 times faster than of a
`/dev/shm` one of 4 KiB pages (47 against 13.4 GB/s for 8 GiB on the H200
machine), so a small restore pins the pieces it reads before the copy engine
reads them (a large one copies: pinning bound a 10 GiB restore's transfer to
half the copy's rate, docs/results/recovery.md).  Like shm, the file outlives the process that wrote it (not a reboot),
nothing needs persisting for that, and the GPU can write it once registered.

What hugetlbfs imposes, and how the tier meets it:
  * every length is a whole number of huge pages: a size asked for is rounded
    up to the page size of the mount (`statfs` block size), which is also the
    tier's alignment;
  * the pages come from the pool the administrator reserved
    (`/proc/sys/vm/nr_hugepages`, `scripts/hugepages.sh setup`); a new log is
    checked against the free pages before anything is created, and
    `fallocate` then takes them, so a store never faults on a missing page;
  * hugetlbfs has no write(2): bytes go through the mapping only.

A plain path on a hugetlbfs mount is detected as this tier; `hugetlb:NAME`
(no slash) names a file on the mount `CONCORDIA_HUGETLB_DIR` names, else on
the first hugetlbfs mount of this process's mount table.
"""

from __future__ import annotations

import os

from .backend import mount_of
from .errors import BadSpecError, DevmemError
from .tiers import SharedPagesBackend

__all__ = ["HugetlbBackend", "mounts", "default_mount", "page_size_of", "free_pages",
           "round_up", "ENV_DIR"]

#: the f_type statfs reports for hugetlbfs
HUGETLBFS_MAGIC = 0x958458F6
ENV_DIR = "CONCORDIA_HUGETLB_DIR"
SYSFS_HUGEPAGES = "/sys/kernel/mm/hugepages"
SETUP_HINT = "reserve huge pages and mount hugetlbfs first (scripts/hugepages.sh setup, as root)"


def _mount_table() -> list[tuple[str, str]]:
    """(mount point, fstype) of every mount of this process, in table order."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and rfields:
                    out.append((fields[4].replace("\\040", " "), rfields[0]))
    except OSError:
        pass
    return out


def mounts() -> list[str]:
    """Mount points of every hugetlbfs in this process's mount table."""
    return [point for point, fstype in _mount_table() if fstype == "hugetlbfs"]




def default_mount() -> str | None:
    """Where `hugetlb:NAME` puts its file: $CONCORDIA_HUGETLB_DIR, else the
    first hugetlbfs mount (None when there is none)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return env
    found = mounts()
    return found[0] if found else None


def resolve(rest: str) -> str:
    """The absolute path a `hugetlb:` spec names (a bare NAME goes to the
    default mount).  Raises BadSpecError when a bare name has no mount to go to."""
    if "/" in rest:
        return os.path.abspath(rest)
    where = default_mount()
    if where is None:
        raise BadSpecError("no hugetlbfs is mounted to put the log in", where=f"hugetlb:{rest}",
                           hint=SETUP_HINT + f", or name a path (hugetlb:/mnt/huge/{rest})")
    return os.path.join(os.path.abspath(where), rest)


def page_size_of(path: str) -> int:
    """The huge page size of the hugetlbfs holding `path` (the file, or the
    directory it would be created in).  Raises BadSpecError when that file
    system is not hugetlbfs."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        raise DevmemError(f"cannot look at the file system: {exc.strerror}", where=path) from None
    mount = mount_of(probe)
    fstype = mount[0] if mount else None
    if fstype != "hugetlbfs":
        raise BadSpecError(f"not on a hugetlbfs mount (on {fstype or 'an unknown file system'})",
                           where=path, hint=SETUP_HINT)
    return int(st.f_bsize)


def round_up(size: int, page: int) -> int:
    return -(-int(size) // page) * page


def free_pages(page: int, path: str | None = None) -> int:
    """Huge pages of `page` bytes a new file could take now: the pool's free
    pages less those reserved by existing mappings, and no more than the
    mount's own `size=` limit allows when it has one."""
    base = os.path.join(SYSFS_HUGEPAGES, f"hugepages-{page // 1024}kB")

    def read(name):
        try:
            with open(os.path.join(base, name)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return 0

    n = max(0, read("free_hugepages") - read("resv_hugepages"))
    if path is not None:
        try:
            st = os.statvfs(path if os.path.isdir(path) else os.path.dirname(path))
            if 0 < st.f_blocks < (1 << 63):   # no size= limit: hugetlbfs reports 0 (or -1)
                n = min(n, int(st.f_bavail))
        except OSError:
            pass
    return n


class HugetlbBackend(SharedPagesBackend):
    """A file on a hugetlbfs mount.  Survives a process crash (the pages stay
    with the file), not a reboot; persist orders nothing.  GPU-mappable, and
    pinned several times faster than a 4 KiB-page mapping."""

    kind = "hugetlb"

    def __init__(self, path, mapping, opened, readonly, alignment):
        super().__init__(path, mapping, opened, readonly, alignment)
        self.page_size = alignment

    @classmethod
    def open(cls, path, *, size=None, create=False, readonly=False, **kw):
        """As every file tier, but `size` is rounded up to the mount's huge page
        size, and a log to be created is checked against the free huge pages
        first (nothing is created when they do not suffice)."""
        page = page_size_of(path)
        if size is not None and size > 0:
            size = round_up(size, page)
        if create and size is not None and not os.path.exists(path):
            need, have = size // page, free_pages(page, path)
            if need > have:
                raise DevmemError(f"a log of {size} bytes needs {need} huge pages of {page >> 10} KiB, "
                                  f"{have} are free", where=path,
                                  hint="reserve more (scripts/hugepages.sh setup GIB) or choose a "
                                       "smaller size")
        return super().open(path, size=size, create=create, readonly=readonly, alignment=page, **kw)

    def info(self):
        d = super().info()
        d["page_size"] = self.page_size
        return d
