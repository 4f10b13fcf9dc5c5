"""A Log hands its open-time walk to the planner once (a writable one up to its
cut, the planner walking on from there), and the plan is the one a fresh walk
gives."""

from __future__ import annotations

import numpy as np

from concordia.devmem import MemoryBackend
from concordia.wal import Log
from concordia.wal.planner import plan, scan

from .helpers import build_log, image


def _plans_equal(a, b):
    assert a.to_json() == b.to_json()


def _count_walks(monkeypatch):
    import concordia.wal.reader as reader

    walks = []
    real = reader.Scanner.items

    def counting(self, res=None, *, from_lsn=0):
        walks.append(from_lsn)
        return real(self, res, from_lsn=from_lsn)

    monkeypatch.setattr(reader.Scanner, "items", counting)
    return walks


def test_read_only_open_walk_is_reused_once(monkeypatch):
    log, model, rid = build_log(epochs=12)
    img = bytes(image(log.backend))
    ro = Log.open(MemoryBackend.from_bytes(img), writable=False, check_pages=False)
    assert ro._result.walk is not None
    walks = _count_walks(monkeypatch)
    first = plan(ro, check_pages=False)
    assert walks == [] and ro._result.walk is None  # handed over, not kept
    second = plan(ro, check_pages=False)
    assert walks == [0]
    _plans_equal(first, second)


def test_walk_not_reused_when_page_checks_differ_or_writable():
    log, model, rid = build_log(epochs=5)
    img = bytes(image(log.backend))
    checked = Log.open(MemoryBackend.from_bytes(img), writable=False, check_pages=True)
    h = scan(checked, check_pages=False)  # a walk with page checks answers one without them
    assert checked._result.walk is None and h.batches
    rw = Log.open(MemoryBackend.from_bytes(img), writable=True, check_pages=False)
    h = scan(rw, check_pages=True)  # pages unchecked before the cut: this scan must walk it all
    assert rw._result.walk is not None and h.batches
    assert plan(rw).to_json() == plan(Log.open(MemoryBackend.from_bytes(img), writable=False)).to_json()


def _fresh_plan(log, **kw):
    """The plan of a read-only open of `log`'s bytes as they are now."""
    return plan(Log.open(MemoryBackend.from_bytes(bytes(image(log.backend))), writable=False), **kw).to_json()


def test_writable_open_hands_its_walk_up_to_the_cut(monkeypatch):
    # a log whose writer died after appending an uncommitted epoch and a region
    # descriptor: the writable open cuts them (the descriptor is written again),
    # the session appends a region and an epoch, and the plan made from the
    # open's walk plus a walk from the cut equals a fresh walk's, for each check
    for check in (False, "last", True):
        log, model, rid = build_log(epochs=9)
        for ids, pages in model.epoch_batches(10):
            log.appender.append_page_batch(10, rid, ids, pages)   # no commit
        log.define_region("late", np.uint8, (8 * 4096,), 4096, "opaque")
        img = bytes(image(log.backend))
        rw = Log.open(MemoryBackend.from_bytes(img), writable=True, check_pages=check)
        assert rw.last_committed_epoch == 9 and rw._result.walk_end_lsn is not None
        assert "late" in rw.regions  # written again after the cut
        rw.define_region("new", np.uint8, (4 * 4096,), 4096, "opaque")
        model.write_epoch(rw, rid, 10)
        cut = rw._result.walk_end_lsn
        walks = _count_walks(monkeypatch)
        cp = check is True  # the open's walk answers a scan checking pages only if it checked them
        got = plan(rw, check_pages=cp).to_json()
        assert walks == [cut] and cut > 0  # walked from the cut only
        monkeypatch.undo()
        assert got == _fresh_plan(rw, check_pages=cp)
        assert plan(rw, target=9, check_pages=cp).to_json() == _fresh_plan(rw, target=9, check_pages=cp)


def test_no_hand_over_once_the_oldest_lsn_moved(monkeypatch):
    # compaction raises oldest_lsn (records below it are reclaimed): a walk made
    # before it would list them, so the planner walks afresh, from the start
    log, model, rid = build_log(epochs=6)
    rw = Log.open(MemoryBackend.from_bytes(bytes(image(log.backend))), writable=True, check_pages=False)
    rw._result.walk_oldest_lsn += 64  # as if compaction had moved it since the open
    walks = _count_walks(monkeypatch)
    got = plan(rw).to_json()
    assert walks == [0]
    monkeypatch.undo()
    assert got == _fresh_plan(rw)
