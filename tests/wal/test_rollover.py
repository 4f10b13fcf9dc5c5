"""A commit on a one-sync (msync) log writes the next segment's header and
persists it with its own sync, so the roll over that follows writes only the
superblock (FORMAT.md §3.4 order kept: header persisted, then superblock, then
records).  The header left in a free segment is a state a crash could always
leave; these tests check the roll over, the fallback when the prepared segment
is no longer the one to take, and crash images taken while one is prepared."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import MemoryBackend, open_backend
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.planner import plan
from concordia.wal.errors import LogFullError
from concordia.wal.volume import Volume

PB = 4096
MiB = 1 << 20


def _write(log, rid, state, epochs, rng, first=1):
    for e in range(first, first + epochs):
        ids = np.arange(0, 96, dtype=np.uint32)
        state[ids] = rng.integers(0, 256, (ids.size, PB), dtype=np.uint8)
        log.appender.append_page_batch(e, rid, ids, state[ids])
        log.appender.commit(e)


def test_roll_over_after_a_commit_makes_one_sync(tmp_path):
    log = Log.create(open_backend(f"file:{tmp_path}/log", size=8 * MiB, create=True), segment_size=MiB)
    assert log.appender.one_sync
    rid = log.define_region("r", np.uint8, (128 * PB,), PB, "opaque")
    state = np.zeros((128, PB), np.uint8)
    rng = np.random.default_rng(1)
    calls = []
    persist = log.backend.persist
    vol = log.volume
    take = vol.take_segment

    def counting_take(after, *, prepared=None):
        seen = len(calls)
        seg = take(after, prepared=prepared)
        calls_in_take.append((prepared is not None, len(calls) - seen))
        return seg

    calls_in_take = []
    log.backend.persist = lambda off, n: (calls.append((off, n)), persist(off, n))[1]
    vol.take_segment = counting_take
    _write(log, rid, state, 12, rng)  # 384 KiB an epoch through 1 MiB segments
    assert len(calls_in_take) >= 3
    assert all(n == 1 for was_prepared, n in calls_in_take if was_prepared)  # the superblock only
    assert sum(was_prepared for was_prepared, _ in calls_in_take) >= 3
    assert log.verify()["ok"]
    log.close()
    again = Log.open(f"file:{tmp_path}/log")
    assert again.last_committed_epoch == 12 and not again.volume.adopted
    assert apply_plan_numpy(again, plan(again))["r"].tobytes() == state.tobytes()
    again.close()


def test_crash_with_a_prepared_header_recovers_every_commit(tmp_path):
    """The image of the file right after a commit (everything persisted, the next
    segment's header among it): the free segment with that header is adopted
    (it holds no record), every epoch is restored, and a writer cuts it again."""
    log = Log.create(open_backend(f"file:{tmp_path}/log", size=8 * MiB, create=True), segment_size=MiB)
    rid = log.define_region("r", np.uint8, (128 * PB,), PB, "opaque")
    state = np.zeros((128, PB), np.uint8)
    _write(log, rid, state, 4, np.random.default_rng(2))
    prepared = log.appender._prepared
    assert prepared is not None  # kept only once the commit's sync returned
    image = bytes(log.backend.array)
    log.close()
    got = Log.open(MemoryBackend.from_bytes(image))
    assert [s.index for s in got.volume.adopted] == [prepared.index]
    assert got.last_committed_epoch == 4
    assert apply_plan_numpy(got, plan(got))["r"].tobytes() == state.tobytes()
    w = Log.open(MemoryBackend.from_bytes(image), writable=True)
    off = w.volume.segment_offset(prepared.index)
    assert not w.backend.array[off:off + F.SEGMENT_HEADER_SIZE].any()  # cut: freed and zeroed
    _write(w, rid, state, 6, np.random.default_rng(3), first=5)
    assert w.verify()["ok"] and w.last_committed_epoch == 10
    assert apply_plan_numpy(w, plan(w))["r"].tobytes() == state.tobytes()


def test_a_prepared_header_that_is_no_longer_next_is_zeroed():
    vol = Volume.create(open_backend("memory:", size=5 * MiB), segment_size=MiB)
    assert vol.superblock.segment_count == 4
    segs = []
    for _ in range(4):
        segs.append(vol.take_segment(segs[-1] if segs else None))
    vol.free_segments([2])
    prepared = vol.prepare_segment(segs[3])  # after 3: 0 and 1 live, so 2
    assert prepared.index == 2
    vol.backend.persist(prepared.offset, F.SEGMENT_HEADER_SIZE + F.RECORD_HEADER_SIZE)
    vol.free_segments([0])  # now 0 is the next one cyclically after 3
    taken = vol.take_segment(segs[3], prepared=prepared)
    assert taken.index == 0 and taken.seq == segs[3].seq + 1
    assert not vol.backend.array[prepared.offset:prepared.offset + F.SEGMENT_HEADER_SIZE].any()
    again = Volume.open(MemoryBackend.from_bytes(bytes(vol.backend.array)))
    assert not again.adopted
    assert [s.index for s in again.live_segments()] == [1, 3, 0]


def test_a_prepared_header_still_next_is_taken_as_it_is():
    vol = Volume.create(open_backend("memory:", size=6 * MiB), segment_size=MiB)
    first = vol.take_segment(None)
    prepared = vol.prepare_segment(first)
    vol.backend.persist(prepared.offset, F.SEGMENT_HEADER_SIZE + F.RECORD_HEADER_SIZE)
    taken = vol.take_segment(first, prepared=prepared)
    assert taken == prepared
    assert vol.check_segment_header(taken, first) is None
    # a header someone overwrote since is not trusted: written again
    other = vol.prepare_segment(taken)
    vol.backend.array[other.offset + 100] ^= 1
    again = vol.take_segment(taken, prepared=other)
    assert again.index == other.index and again.header_crc != other.header_crc
    assert vol.check_segment_header(again, taken) is None


def test_no_prepared_header_when_every_segment_is_live():
    vol = Volume.create(open_backend("memory:", size=5 * MiB), segment_size=MiB)
    segs = [vol.take_segment(None)]
    for _ in range(3):
        segs.append(vol.take_segment(segs[-1]))
    with pytest.raises(LogFullError):
        vol.take_segment(segs[-1])
    assert vol.prepare_segment(segs[-1]) is None


def test_a_clean_close_withdraws_the_prepared_header(tmp_path):
    log = Log.create(open_backend(f"file:{tmp_path}/log", size=8 * MiB, create=True), segment_size=MiB)
    rid = log.define_region("r", np.uint8, (128 * PB,), PB, "opaque")
    state = np.zeros((128, PB), np.uint8)
    _write(log, rid, state, 3, np.random.default_rng(4))
    prepared = log.appender._prepared
    assert prepared is not None
    log.close()
    again = Log.open(f"file:{tmp_path}/log")
    assert not again.volume.adopted and again.last_committed_epoch == 3
    assert not again.backend.array[prepared.offset:prepared.offset + F.SEGMENT_HEADER_SIZE].any()
    again.close()
