"""A read-only Log hands its open-time walk to the planner once, and the plan is
the one a fresh walk gives."""

from __future__ import annotations

from concordia.devmem import MemoryBackend
from concordia.wal import Log
from concordia.wal.planner import plan, scan

from .helpers import build_log, image


def _plans_equal(a, b):
    assert a.to_json() == b.to_json()


def test_read_only_open_walk_is_reused_once(monkeypatch):
    log, model, rid = build_log(epochs=12)
    img = bytes(image(log.backend))
    ro = Log.open(MemoryBackend.from_bytes(img), writable=False, check_pages=False)
    assert ro._result.walk is not None

    import concordia.wal.reader as reader

    walks = []
    real = reader.Scanner.items

    def counting(self, res):
        walks.append(1)
        return real(self, res)

    monkeypatch.setattr(reader.Scanner, "items", counting)
    first = plan(ro)
    assert walks == [] and ro._result.walk is None  # handed over, not kept
    second = plan(ro)
    assert walks == [1]
    _plans_equal(first, second)


def test_walk_not_reused_when_page_checks_differ_or_writable():
    log, model, rid = build_log(epochs=5)
    img = bytes(image(log.backend))
    checked = Log.open(MemoryBackend.from_bytes(img), writable=False, check_pages=True)
    h = scan(checked, check_pages=False)  # the open checked pages; this scan must not
    assert checked._result.walk is not None and h.batches
    rw = Log.open(MemoryBackend.from_bytes(img), writable=True, check_pages=False)
    assert rw._result.walk is None  # a writable log keeps no walk
    assert plan(rw).to_json() == plan(Log.open(MemoryBackend.from_bytes(img), writable=False)).to_json()
