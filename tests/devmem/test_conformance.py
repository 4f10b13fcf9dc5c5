"""Every tier runs the same conformance class (see conformance.py)."""

from __future__ import annotations

import hashlib
import os

import pytest

from concordia.devmem import Survives, open_backend
from concordia.devmem import libpmem as libpmem_mod

from .conformance import BackendConformance

needs_libpmem = pytest.mark.skipif(not libpmem_mod.available(),
                                   reason="libpmem1 is not installed (scripts/setup.sh installs it)")


def _dir(tmp_path):
    os.makedirs(tmp_path, exist_ok=True)
    return tmp_path


class TestFile(BackendConformance):
    kind = "file"
    survives_at_least = Survives.HOST_CRASH

    def make(self, tmp_path, size):
        return open_backend(f"file:{_dir(tmp_path) / 'log'}", size=size, create=True)

    def reopen(self, tmp_path, b):
        return open_backend(f"file:{b.path}")


class TestShm(BackendConformance):
    kind = "shm"
    gpu_mappable = True
    persist_paths = ("none",)
    survives_at_least = Survives.PROCESS_CRASH

    @pytest.fixture(autouse=True)
    def _cleanup(self):
        self.made = []
        yield
        for p in self.made:
            if os.path.exists(p):
                os.unlink(p)

    def make(self, tmp_path, size):
        name = "concordia-test-" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16]
        b = open_backend(f"shm:{name}", size=size, create=True)
        self.made.append(b.path)
        return b

    def reopen(self, tmp_path, b):
        return open_backend(f"shm:{os.path.basename(b.path)}")


class _Anonymous(BackendConformance):
    """A volatile tier with no path: the spec is its kind alone."""

    gpu_mappable = True
    persist_paths = ("none",)
    creates_files = False

    def make(self, tmp_path, size):
        return open_backend(f"{self.kind}:", size=size)


class TestMemory(_Anonymous):
    kind = "memory"


class _Forced:
    """libpmem told to take a plain file for pmem (PMEM_IS_PMEM_FORCE=1), so
    persistence is user-space flushing.  libpmem reads the variable when it is
    loaded: these classes run in a child process (test_forced_pmem.py)."""

    libpmem = "require"
    persist_paths = ("libpmem",)
    survives_at_least = Survives.POWER_LOSS

    @pytest.fixture(autouse=True)
    def _only_when_forced(self):
        if os.environ.get("PMEM_IS_PMEM_FORCE") != "1":
            pytest.skip("runs in a child process with PMEM_IS_PMEM_FORCE=1 (test_forced_pmem.py)")


class _Pmem(BackendConformance):
    kind = "pmem"
    survives_at_least = Survives.HOST_CRASH
    libpmem = "auto"

    def make(self, tmp_path, size):
        return open_backend(f"pmem:{_dir(tmp_path) / 'log'}", size=size, create=True,
                            libpmem=self.libpmem)

    def reopen(self, tmp_path, b):
        return open_backend(f"pmem:{b.path}", libpmem=self.libpmem)


@needs_libpmem
class TestPmemWithLibpmem(_Pmem):
    libpmem = "require"
    persist_paths = ("libpmem", "msync")

    def test_mapped_through_libpmem(self, backend):
        assert backend.mapped_by == "libpmem"


class TestPmemWithoutLibpmem(_Pmem):
    libpmem = "off"

    def test_mapped_through_mmap(self, backend):
        assert backend.mapped_by == "mmap" and not backend.is_pmem


@needs_libpmem
class TestPmemForced(_Forced, _Pmem):
    """pmem on a plain file that libpmem takes for pmem (see _Forced)."""

    def test_is_pmem_honestly_reported(self, backend):
        assert backend.is_pmem and backend.persist_path == "libpmem"


class _DevDaxEmulated(BackendConformance):
    """Device DAX with a regular file standing in for /dev/daxX.Y (CI has none)."""

    kind = "devdax"
    size = 4 << 20              # two 2 MiB alignment units
    survives_at_least = Survives.HOST_CRASH
    libpmem = "auto"
    creates_files = False       # a device is never created

    def make(self, tmp_path, size):
        from concordia.devmem.devdax import DevDaxBackend
        path = _dir(tmp_path) / "dax-standin"
        with open(path, "wb") as f:
            f.truncate(size)
        os.chmod(path, 0o600)
        return DevDaxBackend.emulate(str(path), alignment=2 << 20, libpmem=self.libpmem)

    def reopen(self, tmp_path, b):
        from concordia.devmem.devdax import DevDaxBackend
        return DevDaxBackend.emulate(b.path, alignment=2 << 20, libpmem=self.libpmem)

    def test_whole_device_and_geometry(self, backend):
        assert backend.emulated and backend.geometry == (self.size, 2 << 20)
        assert backend.info()["device_size"] == self.size


@needs_libpmem
class TestDevDaxEmulatedWithLibpmem(_DevDaxEmulated):
    libpmem = "require"
    persist_paths = ("libpmem", "msync")


class TestDevDaxEmulatedWithoutLibpmem(_DevDaxEmulated):
    libpmem = "off"


@needs_libpmem
class TestDevDaxEmulatedForced(_Forced, _DevDaxEmulated):
    """As TestPmemForced: runs in a child with PMEM_IS_PMEM_FORCE=1."""


@pytest.mark.gpu
class TestPinned(_Anonymous):
    kind = "pinned"


class TestFileWithLibpmemRequired(TestFile):
    """The file tier maps with mmap whatever libpmem does; asking for libpmem only
    checks that it loads."""

    @pytest.fixture(autouse=True)
    def _needs(self):
        if not libpmem_mod.available():
            pytest.skip("libpmem1 is not installed")

    def make(self, tmp_path, size):
        return open_backend(f"file:{_dir(tmp_path) / 'log'}", size=size, create=True,
                            libpmem="require")

    def test_still_msync(self, backend):
        assert backend.mapped_by == "mmap" and backend.persist_path == "msync"


class TestShmWithoutLibpmem(TestShm):
    def make(self, tmp_path, size):
        name = "concordia-test-nolib-" + hashlib.sha1(str(tmp_path).encode()).hexdigest()[:16]
        b = open_backend(f"shm:{name}", size=size, create=True, libpmem="off")
        self.made.append(b.path)
        return b


class TestHugetlb(BackendConformance):
    """A file on a hugetlbfs mount (2 MiB pages): skipped, with the reason,
    where no hugetlbfs with free pages can be had (tests/hugepages.py)."""

    kind = "hugetlb"
    gpu_mappable = True
    persist_paths = ("none",)
    survives_at_least = Survives.PROCESS_CRASH
    size = 4 << 20              # two huge pages

    @pytest.fixture(autouse=True)
    def _mount(self, hugetlb_mount):
        # each test's files in a directory of its own, removed afterwards: the
        # pages of a hugetlbfs file stay taken until it is unlinked
        import shutil
        import uuid

        self.root = os.path.join(hugetlb_mount, uuid.uuid4().hex[:12])
        os.mkdir(self.root)
        yield
        shutil.rmtree(self.root, ignore_errors=True)

    def make(self, tmp_path, size):
        d = os.path.join(self.root, hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12])
        os.makedirs(d, exist_ok=True)
        return open_backend(os.path.join(d, "log"), size=size, create=True)   # detected: a plain path

    def reopen(self, tmp_path, b):
        return open_backend(f"hugetlb:{b.path}")

    def test_alignment_is_the_huge_page(self, backend):
        assert backend.alignment == 2 << 20 and backend.info()["page_size"] == 2 << 20
