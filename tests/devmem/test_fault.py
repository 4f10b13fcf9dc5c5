"""The fault-injecting backend: what a power loss leaves behind."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import FaultInjectingBackend, MemoryBackend, open_backend
from concordia.devmem.errors import InjectedFaultError


@pytest.fixture
def fb():
    b = FaultInjectingBackend(open_backend("memory:", size=8192))
    yield b
    b.close()


def test_only_persisted_ranges_keep_new_bytes(fb):
    fb.view[0:8] = b"AAAAAAAA"
    fb.persist(0, 4)
    fb.view[100:104] = b"BBBB"
    image = fb.crash()
    assert image[:8] == b"AAAA\0\0\0\0"
    assert image[100:104] == b"\0\0\0\0"
    assert fb.unpersisted_ranges() == [(4, 4), (100, 4)]


def test_unpersisted_overwrite_reverts_to_last_persisted_value(fb):
    fb.view[0:4] = b"old!"
    fb.persist(0, 4)
    fb.view[0:4] = b"new?"
    assert fb.crash()[:4] == b"old!"
    assert fb.crash("keep")[:4] == b"new?"


def test_flush_counts_only_after_drain_and_with_the_bytes_it_saw(fb):
    fb.view[0:4] = b"one."
    fb.flush(0, 4)
    assert fb.crash()[:4] == b"\0\0\0\0"          # flushed, not drained
    fb.view[0:4] = b"two."                         # stored after the flush
    fb.drain()
    assert fb.crash()[:4] == b"one."


def test_contents_at_wrap_time_count_as_persisted():
    inner = MemoryBackend.from_bytes(b"x" * 128)
    with FaultInjectingBackend(inner) as fb:
        fb.view[0] = ord("y")
        assert fb.crash() == b"x" * 128


def test_torn_crash_mixes_old_and_new_words_reproducibly(fb):
    fb.view[0:4096] = b"\xff" * 4096
    a, b = fb.crash("torn", seed=7), fb.crash("torn", seed=7)
    assert a == b
    words = np.frombuffer(a[:4096], dtype=np.uint64)
    assert set(np.unique(words).tolist()) == {0, 0xFFFFFFFFFFFFFFFF}   # never inside a word
    with pytest.raises(ValueError):
        fb.crash("melt")


def test_crash_backend_and_crash_in_place(fb):
    fb.view[0:4] = b"keep"
    fb.persist(0, 4)
    fb.view[8:12] = b"lose"
    with fb.crash_backend() as again:
        assert bytes(again.view[:12]) == b"keep" + b"\0" * 8
        assert again.kind == "memory" and again.size == fb.size
    fb.crash_in_place()
    assert bytes(fb.inner.view[:12]) == b"keep" + b"\0" * 8
    assert fb.unpersisted_ranges() == []


def test_injected_persist_failure(fb):
    fb.fail_persist_after = 1
    fb.view[0:2] = b"ok"
    fb.persist(0, 2)
    fb.view[2:4] = b"no"
    with pytest.raises(InjectedFaultError) as ei:
        fb.persist(2, 2)
    assert "\n" not in str(ei.value)
    assert fb.crash()[:4] == b"ok\0\0"


def test_wraps_a_file_and_mirrors_its_capabilities(tmp_path):
    inner = open_backend(f"file:{tmp_path / 'log'}", size=1 << 16, create=True)
    with FaultInjectingBackend(inner) as fb:
        assert (fb.kind, fb.size, fb.durable, fb.persist_path) == ("file", 1 << 16, True, "msync")
        fb.array[:10] = 1
        fb.persist(0, 5)
        assert fb.crash()[:10] == b"\x01" * 5 + b"\0" * 5
    assert inner.closed


def test_the_wrapper_takes_the_writer_lock_of_the_file_under_it(tmp_path):
    from concordia.devmem.errors import LockedError

    fb = FaultInjectingBackend(open_backend(f"file:{tmp_path / 'log'}", size=1 << 20, create=True))
    fb.lock()
    assert fb.locked and fb.inner.locked
    other = open_backend(f"file:{tmp_path / 'log'}")
    with pytest.raises(LockedError):
        other.lock()
    fb.close()
    other.lock()
    assert other.locked
    other.close()
