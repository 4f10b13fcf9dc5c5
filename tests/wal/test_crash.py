"""Crash consistency: truncation at every byte of the last records, and a
fault-injecting backend that drops everything unpersisted at each persist
boundary (and tears it word by word)."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.devmem import FaultInjectingBackend, MemoryBackend, open_backend
from concordia.wal import Log, RecoveryMode
from concordia.wal import format as F
from concordia.wal.errors import CorruptionError, TornTailError, UsageError

from .helpers import MiB, Model, build_log, image, reopen, replay


def _small_model():
    return Model(npages=16, page_bytes=256, batches=1, per_batch=1)


def test_truncate_at_every_byte_of_the_last_records():
    """The last epoch is one 384-byte page batch and a 128-byte commit; cut the
    log at every byte of them (what follows the cut reads as zero, as in a
    preallocated log) and reopen: epoch N-1 exactly, or epoch N when whole."""
    model = _small_model()
    log, model, rid = build_log(epochs=5, size=3 * MiB, model=model)
    n = 6
    lsn = log.appender.append_page_batch(n, rid, *model.epoch_batches(n)[0])
    log.appender.commit(n, {rid: model.digest(n)})
    recs = list(log.records())
    start = next(r for r in recs if r.lsn == lsn).offset
    end = recs[-1].offset + recs[-1].length
    assert end - start == 384 + 128
    full = image(log.backend)
    scratch = MemoryBackend.from_bytes(bytes(full))  # reused: cheaper than a mapping per cut
    for cut in range(start, end + 1):
        img = bytearray(full)
        img[cut:end] = bytes(end - cut)
        scratch.array[start:end] = np.frombuffer(img, np.uint8)[start:end]
        dropped = []
        got = Log.open(scratch, writable=False, reporter=dropped.append)
        whole = bytes(full[cut:end]) == bytes(end - cut)  # only zero padding was cut
        want = n if whole else n - 1
        assert got.last_committed_epoch == want, cut
        assert (replay(got, model.npages, model.page_bytes) == model.state_after(want)).all()
        if whole:
            assert dropped == []
        # absolute mode: a partial record is a torn tail, a clean cut is not an error
        if not whole and cut not in (start, start + 384):
            with pytest.raises(TornTailError):
                Log.open(scratch, writable=False, mode=RecoveryMode.ABSOLUTE)
        if cut % 97 == 0 or cut in (start, start + 8, start + 384, end - 1):
            # reopening for writing cuts the tail and the log goes on
            w = reopen(img, writable=True)
            model.write_epoch(w, rid, want + 1)
            again = Log.open(w.backend, writable=False, mode=RecoveryMode.ABSOLUTE)
            assert again.last_committed_epoch == want + 1
            assert (replay(again, model.npages, model.page_bytes) == model.state_after(want + 1)).all()


class Recorder(FaultInjectingBackend):
    """Takes a crash image after every persist / drain (each persist boundary)."""

    def __init__(self, inner, modes):
        super().__init__(inner)
        self.modes = modes
        self.images = []
        self.committed = 0  # epochs whose commit returned, as the writer says

    def _snap(self):
        for m in self.modes:
            self.images.append((self.committed, m, self.crash(m, seed=len(self.images))))

    def _persist(self, offset, length):
        self._snap()  # before: what a crash just before this persist leaves
        super()._persist(offset, length)
        self._snap()

    def _drain(self):
        super()._drain()
        self._snap()


@pytest.mark.parametrize("one_sync", [False, True], ids=["two-phase", "one-sync"])
@pytest.mark.parametrize("modes", [("drop",), ("torn",)])
def test_fault_injection_at_every_persist_boundary(modes, one_sync):
    model = Model(npages=32, page_bytes=4096, batches=2, per_batch=8)
    fb = Recorder(open_backend("memory:", size=4 * MiB), ())
    log = Log.create(fb, segment_size=MiB)
    rid = log.define_region("r", np.uint8, (32 * 4096,), 4096, "kv")
    fb.modes = modes  # crash points from here on: the log exists
    log.appender.one_sync = one_sync  # the commit protocol of msync tiers (FORMAT.md §10)
    for e in range(1, 25):  # 64 KiB per epoch: rolls over segments
        model.write_epoch(log, rid, e)
        fb.committed = e
    assert len(log.volume.live_segments()) >= 2
    assert len(fb.images) > 40
    for committed, mode, img in fb.images:
        got = reopen(img, writable=False)
        e = got.last_committed_epoch
        # every epoch whose commit returned is there; at most the one in flight more
        assert committed <= e <= committed + 1, (committed, e, mode)
        assert not any(r.epoch > e for r in got.records())
        assert (replay(got, model.npages, model.page_bytes) == model.state_after(e)).all()
        assert [c.digests[rid] for c in got.commits] == [model.digest(k) for k in range(1, e + 1)]
        assert not [d for d in got.dropped if d.kind == "corrupt"], got.dropped
        if one_sync:
            assert all(c.lsn for c in got.commits)
        # checking only the last one-sync commit's pages (what a Session's open
        # does) finds the same committed state at every crash point
        last = reopen(img, writable=False, check_pages="last")
        assert last.last_committed_epoch == e, (committed, e, mode)
        assert (replay(last, model.npages, model.page_bytes) == model.state_after(e)).all()
        assert not [d for d in last.dropped if d.kind == "corrupt"], last.dropped


def _five_epochs(one_sync: bool, damaged_epoch: int):
    """A log of five epochs written with or without one-sync commits, its image
    and the first page batch of `damaged_epoch` (to damage in the image)."""
    model = Model(npages=32, page_bytes=4096, batches=2, per_batch=8)
    log = Log.create(open_backend("memory:", size=4 * MiB), segment_size=MiB)
    rid = log.define_region("r", np.uint8, (32 * 4096,), 4096, "kv")
    log.appender.one_sync = one_sync
    for e in range(1, 6):
        model.write_epoch(log, rid, e)
    rec = [r for r in log.records() if r.epoch == damaged_epoch and r.kind == F.REC_PAGE_BATCH][0]
    return model, log, rid, image(log.backend), rec


def test_one_sync_commit_whose_records_did_not_all_land_is_torn_not_corrupt():
    """A sync that wrote the commit record's page but not all the records' pages:
    on a one-sync log the last epoch is simply not committed; a two-phase log
    cannot get there, so the same bytes there are corruption."""
    for one_sync in (True, False):
        model, log, rid, img, rec = _five_epochs(one_sync, damaged_epoch=5)
        img[rec.offset + rec.length - 4096:rec.offset + rec.length] = bytes(4096)  # a page never written
        if not one_sync:
            with pytest.raises(CorruptionError, match="page CRC mismatch"):
                reopen(img, writable=False)
            continue
        dropped = []
        got = reopen(img, writable=False, reporter=dropped.append)
        assert got.last_committed_epoch == 4
        assert (replay(got, model.npages, model.page_bytes) == model.state_after(4)).all()
        assert any(d.kind == "torn" and "one sync" in d.reason for d in dropped)
        # the same call when only the last commit's pages are checked
        last = reopen(img, writable=False, check_pages="last")
        assert last.last_committed_epoch == 4 and any(d.kind == "torn" for d in last.dropped)
        with pytest.raises(TornTailError):
            reopen(img, writable=False, mode=RecoveryMode.ABSOLUTE)
        w = reopen(img, writable=True)  # the cut drops epoch 5; writing goes on
        model.write_epoch(w, rid, 5)
        assert Log.open(w.backend, writable=False, mode=RecoveryMode.ABSOLUTE).last_committed_epoch == 5


def test_checking_only_the_last_commits_pages_leaves_earlier_damage_to_the_reader():
    # check_pages="last" (a Session's open) checks the pages of the last
    # one-sync commit only: damage in an earlier epoch's page is not found at
    # open (a full check refuses the log for writing there); the applier,
    # which checks every page it copies, names it when a recovery reads it
    model, log, rid, img, rec = _five_epochs(True, damaged_epoch=2)
    img[rec.offset + rec.length - 100] ^= 0x20
    with pytest.raises(CorruptionError, match="page CRC mismatch"):
        reopen(img, writable=True)
    w = reopen(img, writable=True, check_pages="last")
    assert w.last_committed_epoch == 5
    from concordia.wal.apply import apply_plan_numpy
    from concordia.wal.planner import plan

    with pytest.raises(CorruptionError, match="page"):
        apply_plan_numpy(w, plan(w, target=2))
    with pytest.raises(UsageError, match="check_pages"):
        reopen(img, writable=False, check_pages="some")



def test_the_last_commits_pages_are_checked_alike_on_several_threads(monkeypatch):
    # the threaded check of the last commit's pages (large commits) finds the
    # same torn page as the serial one, and passes an intact log alike
    from concordia.wal import reader

    monkeypatch.setattr(reader, "PARALLEL_CHECK_BYTES", 1)
    monkeypatch.setattr(reader, "CHECK_THREADS", 4)
    model, log, rid, img, rec = _five_epochs(True, damaged_epoch=5)
    intact = reopen(bytearray(img), writable=False, check_pages="last")
    assert intact.last_committed_epoch == 5 and not intact.dropped
    img[rec.offset + rec.length - 4096:rec.offset + rec.length] = bytes(4096)  # a page never written
    last = reopen(img, writable=False, check_pages="last")
    assert last.last_committed_epoch == 4 and any(d.kind == "torn" for d in last.dropped)
    assert (replay(last, model.npages, model.page_bytes) == model.state_after(4)).all()
