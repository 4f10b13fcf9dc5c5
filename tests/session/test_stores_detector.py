"""The `stores` detector's bookkeeping on the host: what the store tracker
marked, the fingerprint cross-check that finds what it missed, and the refusal
once the region is no longer tracked.  The tracker itself runs on the GPU
(tests/session/test_gpu.py); here a bitmap in host memory stands in for its
device bitmap, set as an instrumented kernel's stores would set it."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import instrument
from concordia.checkpoint import detect
from concordia.errors import SessionError
from concordia.instrument.runtime import bitmap_pages
from concordia.regions.arrays import adapt, storage_of
from concordia.regions.region import Region

PB = 4096


class HostBitmap:
    """TrackedRegion's interface over a host bitmap."""

    def __init__(self, pages):
        self.pages = pages
        self.words = np.zeros(-(-pages // 32), np.uint32)

    def mark(self, page):
        self.words[page // 32] |= np.uint32(1 << (page % 32))

    def dirty_pages(self):
        return bitmap_pages(self.words, self.pages)

    def clear(self):
        self.words[:] = 0


def _region(tracked, check_every):
    arr, xp, owner = adapt(np.zeros(64 * PB, np.uint8), "region 'r'")
    r = Region(name="r", kind="opaque", page_bytes=PB, array=arr, xp=xp, owner=owner,
               storage=storage_of(owner), detect="stores", hints={}, tracked=tracked, check_every=check_every)
    r.crcs = np.zeros(r.pages, np.uint32)   # a base is committed
    detect.reset(r)
    return r, arr


def test_tracked_pages_are_logged_and_a_missed_page_is_found_at_the_cross_check(monkeypatch):
    bm = HostBitmap(64)
    monkeypatch.setattr(instrument, "is_tracked", lambda region: region is bm)
    r, arr = _region(bm, check_every=3)
    for step, pages in enumerate(([1, 2], [40], [2, 63], [7], [8, 9], [10])):
        for p in pages:
            arr[p * PB + step] ^= 0xFF
            bm.mark(p)
        if step == 3:
            arr[30 * PB] ^= 0xFF              # a write the tracker did not see
        assert detect.dirty_pages(r, advance=False).tolist() == sorted(pages)   # a peek changes nothing
        got = detect.dirty_pages(r, advance=True).tolist()
        want = sorted(pages + [30]) if step == 5 else sorted(pages)   # found at the 2nd cross-check
        assert got == want, (step, got)
        assert bm.dirty_pages().size == 0
    assert r.missed_pages == 1


def test_without_cross_checks_only_the_tracker_is_asked(monkeypatch):
    bm = HostBitmap(64)
    monkeypatch.setattr(instrument, "is_tracked", lambda region: True)
    r, arr = _region(bm, check_every=0)
    assert r.fps is None
    arr[5 * PB] ^= 1
    for _ in range(10):
        assert detect.dirty_pages(r, advance=True).size == 0    # unseen, and nothing looks
    assert r.missed_pages == 0


def test_a_region_no_longer_tracked_is_refused_in_one_line():
    r, _ = _region(HostBitmap(64), check_every=2)    # instrumentation is not enabled here
    with pytest.raises(SessionError) as info:
        detect.dirty_pages(r, advance=True)
    msg = info.value.one_line()
    assert "\n" not in msg and msg.startswith("region 'r':") and "no longer tracks" in msg
