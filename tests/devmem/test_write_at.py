"""FileBackend.write_at: pwritev into the file under the mapping."""

from __future__ import annotations

import os

import numpy as np
import pytest

from concordia.devmem import open_backend
from concordia.devmem.errors import BackendClosedError, OutOfRangeError, ReadOnlyError


def test_writes_are_seen_through_the_view_and_survive_reopen(tmp_path):
    path = tmp_path / "log"
    b = open_backend(f"file:{path}", size=1 << 20, create=True)
    rng = np.random.default_rng(1)
    b.array[:] = 0xAA
    b.persist(0, b.size)  # the pages are now write-protected in the mapping: the case write_at avoids
    parts = [rng.integers(0, 256, 100, dtype=np.uint8), bytes(rng.integers(0, 256, 5000, dtype=np.uint8)),
             rng.integers(0, 256, (3, 4096), dtype=np.uint8)]
    want = np.concatenate([np.frombuffer(memoryview(p).cast("B"), np.uint8) for p in parts])
    b.write_at(4000, parts)
    assert b.array[4000:4000 + want.size].tobytes() == want.tobytes()  # coherent with the mapping at once
    assert b.array[3999] == 0xAA and b.array[4000 + want.size] == 0xAA
    b.persist(4000, want.size)
    b.close()
    with open(path, "rb") as f:
        f.seek(4000)
        assert f.read(want.size) == want.tobytes()


def test_bad_ranges_read_only_and_closed(tmp_path):
    path = tmp_path / "log"
    b = open_backend(f"file:{path}", size=64 << 10, create=True)
    with pytest.raises(OutOfRangeError):
        b.write_at(b.size - 10, [bytes(11)])
    with pytest.raises(OutOfRangeError):
        b.write_at(-1, [b"x"])
    b.write_at(5, [])  # nothing to write
    b.close()
    with pytest.raises(BackendClosedError):
        b.write_at(0, [b"x"])
    r = open_backend(f"file:{path}", readonly=True)
    with pytest.raises(ReadOnlyError):
        r.write_at(0, [b"x"])
    r.close()


def test_the_descriptor_goes_with_the_backend(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        open_backend(f"file:{tmp_path}/l{i}", size=64 << 10, create=True).close()
    assert len(os.listdir("/proc/self/fd")) == before
