"""Whether the log can take an epoch (`EpochRunner.room`, asked by every
checkpoint that may coalesce, as generate()'s does): once the full image no
longer fits, an upper bound of the epoch's pages that reads nothing
(`detect.most_pages`) answers before a second detection pass would (a device
read per region on the GPU)."""

from __future__ import annotations

import numpy as np

from concordia import Session
from concordia.checkpoint import detect
from concordia.checkpoint.epoch import space_after
from concordia.wal.compaction import free_space

MiB = 1 << 20
SEGMENT = 1 * MiB


def _register(s: Session):
    """A static cache by positions (4 MiB, rows of 256 bytes) and a small
    adapter rewritten whole at each step; (cache, adapter, length)."""
    kv = np.zeros((8, 2, 1024, 128), np.uint16)
    ad = np.zeros(16 << 10, np.uint8)
    length = [0]
    s.register("kv", kv, kind="kv", detect="positions", page_bytes=256, length=lambda: length[0])
    s.register("ad", ad, detect="fingerprint")
    return kv, ad, length


def _step(kv, ad, length, t: int, adapter: bool = True) -> None:
    pos = (t - 1) % 1024  # step t writes position t - 1 of every row
    kv[:, :, pos, :] = t % 251 + 1
    length[0] = pos + 1
    if adapter:
        ad[:] = t % 251 + 1


def _whole_state_fits(s: Session) -> bool:
    """Whether `room` would take the epoch on its first plan (the full image)."""
    space = free_space(s.log)
    plan = s.runner.reservations(s.log, space.capacity, pages="whole")
    left = space_after(space, plan, s.runner.last_log_bytes, len(s.regions))
    return left is not None and s.retention.room(left)


def _sums(plan) -> int:
    records, extents = plan
    return sum(records) + sum(extents)


def test_the_bound_holds_every_page_the_next_checkpoint_takes(shm_log):
    with Session(shm_log, size=32 * MiB, segment_size=SEGMENT, overwrite=True) as s:
        kv, ad, length = _register(s)
        s.checkpoint()
        cap = s.log.appender.segment_capacity
        for t in range(1, 40):
            _step(kv, ad, length, t, adapter=t % 3 != 0)  # every third step leaves the adapter
            found = {r.name: int(detect.dirty_pages(r, advance=False).size) for r in s.region_set}
            most = {r.name: detect.most_pages(r) for r in s.region_set}
            assert most["kv"] == found["kv"] == 8 * 2  # one position of every row: the bound is exact
            assert most["ad"] == s.region_set["ad"].pages == found["ad"] + (found["ad"] == 0) * 4
            assert _sums(s.runner.reservations(s.log, cap, pages="most")) >= \
                _sums(s.runner.reservations(s.log, cap, pages="found"))
            st = s.checkpoint()
            assert st.pages == found
        length[0] = 3  # the length went down: the cache started over, named whole
        assert detect.most_pages(s.region_set["kv"]) == s.region_set["kv"].pages


def test_room_reads_no_region_when_the_bound_fits(shm_log, monkeypatch):
    # A log of about four states, every step checkpointed as generate() does,
    # until the full image no longer fits: the next checkpoints are judged by
    # the bound, with no second detection pass, and commit.
    with Session(shm_log, size=17 * SEGMENT, segment_size=SEGMENT, overwrite=True) as s:
        kv, ad, length = _register(s)
        s.checkpoint()
        t = 0
        for t in range(1, 2_000):
            _step(kv, ad, length, t)
            assert not s.checkpoint(on_full="coalesce").coalesced, t
            if t >= 100 and not _whole_state_fits(s):
                break
        assert t < 1_999, "the log never filled past a checkpoint of the whole state"
        looked = []
        real = detect.dirty_pages

        def counted(r, *, advance):
            if not advance:
                looked.append(r.name)
            return real(r, advance=advance)

        monkeypatch.setattr(detect, "dirty_pages", counted)
        for t in range(t + 1, t + 6):
            _step(kv, ad, length, t)
            st = s.checkpoint(on_full="coalesce")
            assert not st.coalesced and st.pages["kv"] == 16, (t, st)
        assert looked == []
        got = s.recover()
        assert np.array_equal(got["kv"], kv) and np.array_equal(got["ad"], ad)
