"""One conformance test class for every memory tier: each tier subclasses
`BackendConformance` and says how to make (and reopen) one."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from concordia.devmem import Backend, Survives
from concordia.devmem.errors import BackendClosedError, OutOfRangeError

SIZE = 1 << 20


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class BackendConformance:
    """Subclasses set `kind`, `gpu_mappable`, the expected `persist_path` values,
    and implement `make(tmp_path, size)`; tiers with a path also `reopen`."""

    kind: str = "?"
    gpu_mappable: bool = False
    persist_paths: tuple[str, ...] = ("msync",)
    survives_at_least = Survives.GPU_LOSS
    size = SIZE
    creates_files = True

    def make(self, tmp_path, size) -> Backend:
        raise NotImplementedError

    def reopen(self, tmp_path, backend) -> Backend | None:
        """Open the same log again (no size, no create); None for volatile tiers."""
        return None

    @pytest.fixture
    def backend(self, tmp_path):
        b = self.make(tmp_path, self.size)
        yield b
        b.close()

    def test_capabilities(self, backend):
        assert backend.kind == self.kind
        assert backend.size == self.size
        a = backend.alignment
        assert a > 0 and a & (a - 1) == 0 and backend.size % a == 0
        assert isinstance(backend.survives, Survives)
        assert backend.survives >= self.survives_at_least
        assert backend.durable == (backend.survives >= Survives.HOST_CRASH)
        assert backend.gpu_mappable is self.gpu_mappable
        assert backend.persist_path in self.persist_paths
        assert isinstance(backend.is_pmem, bool)
        assert backend.is_pmem == (backend.persist_path == "libpmem")
        info = backend.info()
        assert info["kind"] == self.kind and info["persist_path"] == backend.persist_path
        json.dumps(info)

    def test_view_and_array_are_the_same_bytes(self, backend):
        v, arr = backend.view, backend.array
        assert len(v) == backend.size and not v.readonly
        assert arr.dtype == np.uint8 and arr.shape == (backend.size,) and arr.flags.writeable
        assert arr.ctypes.data == backend.address
        v[0:4] = b"\x01\x02\x03\x04"
        assert arr[:4].tolist() == [1, 2, 3, 4]
        arr[-3:] = 7
        assert bytes(v[-3:]) == b"\x07\x07\x07"

    def test_persist_flush_drain_over_the_whole_range(self, backend):
        data = pattern(backend.size, 1)
        backend.array[:] = data
        backend.persist(0, 0)
        backend.persist(0, backend.size)
        backend.persist(backend.size - 1, 1)
        backend.persist(12345, 777)            # unaligned ranges are the backend's problem
        backend.flush(100, 5000)
        backend.flush(backend.size - 64, 64)
        backend.drain()
        assert np.array_equal(backend.array, data)

    @pytest.mark.parametrize("off,n", [(-1, 1), (0, -1), (0, 1), (-4, 8)])
    def test_out_of_range_is_refused(self, backend, off, n):
        if (off, n) in ((0, 1), (-4, 8)):
            off += backend.size          # relative to the end: just past it, straddling it
        with pytest.raises(OutOfRangeError) as ei:
            backend.persist(off, n)
        assert "\n" not in str(ei.value)
        with pytest.raises(OutOfRangeError):
            backend.flush(off, n)

    def test_close_is_final_and_idempotent(self, tmp_path):
        with self.make(tmp_path, self.size) as b:
            b.view[0] = 9
        assert b.closed
        b.close()
        for use in (lambda: b.view, lambda: b.array, lambda: b.persist(0, 1), b.drain):
            with pytest.raises(BackendClosedError):
                use()

    def test_at_close_runs_first_and_once(self, tmp_path):
        b = self.make(tmp_path, self.size)
        seen = []
        b.at_close(lambda: seen.append(b.closed))   # the pins of a restore are given back here
        b.at_close(lambda: seen.append("second"))
        b.close()
        b.close()
        assert seen == [False, "second"]   # before the mapping went, each once

    def test_close_with_a_live_view_keeps_that_view_valid(self, tmp_path):
        b = self.make(tmp_path, self.size)
        keep = b.array[4096:8192]
        keep[:] = 5
        b.close()
        assert int(keep.sum()) == 5 * 4096    # still mapped: freed when `keep` goes
        del keep

    def test_persisted_bytes_are_there_on_reopen(self, tmp_path):
        b = self.make(tmp_path, self.size)
        data = pattern(self.size, 2)
        b.array[:] = data
        b.persist(0, self.size)
        b.close()
        again = self.reopen(tmp_path, b)
        if again is None:
            assert b.survives < Survives.PROCESS_CRASH or self.kind == "pinned"
            return
        with again:
            assert again.size == self.size
            assert np.array_equal(again.array, data)

    def test_created_file_is_0600_whatever_the_umask(self, tmp_path):
        if not self.creates_files:
            return
        for mask in (0o000, 0o077, 0o777):
            old = os.umask(mask)
            try:
                b = self.make(tmp_path / f"u{mask:o}", self.size)
            finally:
                os.umask(old)
            with b:
                assert stat.S_IMODE(os.stat(b.path).st_mode) == 0o600
                assert os.stat(b.path).st_uid == os.geteuid()
