"""`Log.decide`: a writable open's decision made before the lock (a standby
does it while its primary exits), taken by `Log.open(decided=)` only when the
log is still as it was read, and made again otherwise."""

from __future__ import annotations

import numpy as np

from concordia import Session
from concordia.devmem import open_backend
from concordia.wal import Log


def _write(path: str, epochs: int, a: np.ndarray, create: bool) -> None:
    kw = {"size": 4 << 20, "segment_size": 1 << 20} if create else {"create": False}
    with Session(path, **kw) as s:
        s.register("a", a)
        if not create:
            s.recover(into="registered")
        for _ in range(epochs):
            a[s.epoch % 4, :] += 1
            s.checkpoint()


def _last(path: str) -> int:
    log = Log.open(path, writable=False)
    try:
        return int(log.last_committed_epoch)
    finally:
        log.close()


def test_an_open_takes_a_decision_made_before_its_lock_while_the_log_holds(tmp_path, monkeypatch):
    import concordia.wal.log as L

    path = f"file:{tmp_path / 'log'}"
    _write(path, 3, np.zeros((4, 1024), np.uint32), create=True)
    with open_backend(path) as b:
        d = Log.decide(b, holds=lambda: True)
        decided = []
        real = L.recover
        monkeypatch.setattr(L, "recover", lambda *a, **k: decided.append(1) or real(*a, **k))
        log = Log.open(b, writable=True, check_pages="last", decided=d)
        try:
            assert log.last_committed_epoch == 3 and log.open_stats["decided_before_s"] > 0
            assert not decided   # the open did not decide the log again
        finally:
            log.close()
        monkeypatch.undo()
    _write(path, 1, np.zeros((4, 1024), np.uint32), create=False)   # writable as any open leaves it
    assert _last(path) == 4


def test_a_decision_the_log_has_moved_past_is_made_again(tmp_path):
    """A writer committed after the decision (another standby took over first,
    say): `holds()` says so, and the open decides the log as it is now."""
    path = f"file:{tmp_path / 'log'}"
    a = np.zeros((4, 1024), np.uint32)
    _write(path, 3, a, create=True)
    with open_backend(path) as b:
        asked = []
        d = Log.decide(b, holds=lambda: asked.append(1) or False)
        assert d.res.cut is not None
        _write(path, 2, a, create=False)   # epochs 4 and 5, committed by another writer
        log = Log.open(b, writable=True, check_pages="last", decided=d)
        try:
            assert asked and log.last_committed_epoch == 5 and "decided_before_s" not in log.open_stats
        finally:
            log.close()
