"""Retention's BASE records written by the page kernels (`checkpoint.bases.
BaseStager`): on the numpy twins here, the same records as the host path
writes, byte for byte; a stager that fails hands the record, and every later
one, back to the host without losing or changing any."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint.bases import BaseStager
from concordia.checkpoint.host import HostKernels
from concordia.wal.planner import scan

MiB = 1 << 20


def _base_batches(log) -> list:
    """Every BASE page batch the log holds now: LSN, epoch, region, page ids, page CRCs, pages."""
    return [(b.lsn, b.epoch, b.region_id, b.page_ids.tolist(), b.page_crcs.tobytes(), bytes(b.payload))
            for b in scan(log).batches if b.base]


def _run(path: str, stager=None, epochs: int = 80, every: int = 10) -> tuple:
    """A scripted session whose retention bases its regions many times over:
    (the BASE batches seen every `every` checkpoints, its retention counts,
    the state recovered, the state written).  `stager`: the retention's base
    stager, or None for the host path."""
    a = np.zeros((64, 1024), np.uint32)        # 256 KiB
    b = np.zeros(10_000, np.uint8)             # a short last page
    seen = []
    with Session(path, size=8 * MiB, segment_size=1 * MiB, overwrite=True, staging="mapped") as s:
        s.register("a", a)
        s.register("b", b)
        s.retention.base_stager = stager
        for e in range(1, epochs + 1):
            a[(e * 13) % 64, e % 1024] = e
            a[(e * 29) % 64, (e * 3) % 1024] = e + 1
            b[(e * 977) % b.size] = e % 251
            s.checkpoint()
            if e % every == 0:
                seen.append(_base_batches(s.log))
        counts = dict(s.retention.counts)
        got = s.recover()
        got = {k: np.array(v) for k, v in got.items()}
    return seen, counts, got, {"a": a, "b": b}


def test_the_twin_stager_writes_the_records_the_host_writes(shm_log):
    stager = BaseStager(HostKernels())
    want, want_counts, _, _ = _run(shm_log)
    got, counts, state, written = _run(shm_log, stager)
    assert counts["jobs"] >= 3 and counts["bases"] >= 3 and counts.get("errors", 0) == 0, counts
    assert counts == want_counts
    assert stager.error is None and stager.records > 0
    assert sum(len(x) for x in got) > 0 and got == want
    for k in written:
        assert np.array_equal(state[k], written[k]), k


class _FailsAt(HostKernels):
    """Host kernels whose `stage` writes half a record, then fails, at its nth call."""

    def __init__(self, n: int):
        super().__init__()
        self.calls, self.n = 0, n

    def stage(self, r, ids, dst, cursor, crcs, **kw):
        self.calls += 1
        if self.calls == self.n:
            dst[:dst.size // 2] = 0xAB
            raise RuntimeError("the device went away")
        super().stage(r, ids, dst, cursor, crcs, **kw)


def test_a_stager_that_fails_hands_the_record_back_to_the_host(shm_log):
    stager = BaseStager(_FailsAt(3))
    want, want_counts, _, _ = _run(shm_log)
    got, counts, state, written = _run(shm_log, stager)
    assert stager.error == "RuntimeError: the device went away" and stager.records == 2
    assert counts == want_counts and got == want
    for k in written:
        assert np.array_equal(state[k], written[k]), k


class _WrongEpoch(HostKernels):
    """Host kernels that write a whole, valid page batch, of the wrong epoch."""

    def stage(self, r, ids, dst, cursor, crcs, **kw):
        super().stage(r, ids, dst, cursor, crcs, **{**kw, "epoch": kw["epoch"] + 1})


def test_a_record_not_the_one_asked_for_is_written_again_by_the_host(shm_log):
    stager = BaseStager(_WrongEpoch())
    want, want_counts, _, _ = _run(shm_log)
    got, counts, _, _ = _run(shm_log, stager)
    assert stager.records == 0 and "the staged BASE record of region" in stager.error and "has header" in stager.error
    assert counts == want_counts and got == want


def test_the_retention_says_who_writes_its_bases(shm_log):
    with Session(shm_log, size=8 * MiB, segment_size=1 * MiB, overwrite=True, staging="mapped") as s:
        assert s.retention.base_staging is None  # no device writes this log: the host does
        s.retention.base_stager = BaseStager(HostKernels())
        assert s.retention.base_staging == {"kernels": "cpu", "records": 0, "error": None}


@pytest.mark.gpu
def test_the_device_stager_writes_the_records_the_host_writes(shm_log):
    """On the device: retention's job copies of device regions, pinned, are
    read by the staging kernel and written into the log mapping; the BASE
    records equal the host path's."""
    import cupy as cp

    from concordia import retention

    def run(device: bool):
        a = cp.zeros((2048, 1024), cp.uint32)  # 8 MiB: a pinned kept copy
        seen = []
        with Session(shm_log, size=96 * MiB, segment_size=8 * MiB, overwrite=True, executor="host") as s:
            s.register("a", a)
            s.checkpoint()
            if not device:
                s.retention.base_stager = BaseStager(_Refuses())
            for e in range(1, 61):
                # 64 pages an epoch: the chain passes its bound (2 MiB) every few epochs
                a[(e * 64) % 2048:(e * 64) % 2048 + 64, e % 1024] = e
                s.checkpoint()
                if e % 10 == 0:
                    seen.append(_base_batches(s.log))
            staging = s.retention.base_staging
            counts = dict(s.retention.counts)
            got = cp.asnumpy(s.recover()["a"])
            assert np.array_equal(got, cp.asnumpy(a))
        return seen, staging, counts

    assert retention.PIN_COPY_BYTES <= 8 * MiB
    on_device, staging, counts = run(True)
    on_host, _, host_counts = run(False)
    assert counts["jobs"] >= 2 and counts.get("errors", 0) == 0 and counts == host_counts, (counts, host_counts)
    assert staging["kernels"] == "gpu" and staging["error"] is None and staging["records"] > 0, staging
    assert sum(len(x) for x in on_device) > 0 and on_device == on_host


class _Refuses(HostKernels):
    """Kernels that never stage: every BASE record is written by the host."""

    def stage(self, *args, **kw):
        raise RuntimeError("host path")


def test_a_base_record_that_fails_leaves_the_writer_going(shm_log):
    """A BASE record whose pages cannot be read (the image's source fails)
    raises that failure and closes its reservation with a pad record: the
    session checkpoints on, closes, and a reader sees neither a record nor
    damage there."""
    from concordia.wal.snapshot import write_base_slices

    a = np.zeros((64, 1024), np.uint32)
    with Session(shm_log, size=8 * MiB, segment_size=1 * MiB, overwrite=True) as s:
        s.register("a", a)
        s.checkpoint()

        def source(lo, hi):
            raise MemoryError("the image went away")

        with pytest.raises(MemoryError, match="the image went away"):
            next(write_base_slices(s.log, s.log.regions["a"], source, s.epoch, chunk_bytes=64 << 10))
        assert not s.log.appender.outstanding
        a[3, 5] = 7
        assert s.checkpoint().pages["a"] == 1
        assert np.array_equal(s.recover()["a"], a)
    with Session(shm_log, create=False) as r:
        assert np.array_equal(r.recover()["a"], a)
        assert not [b for b in scan(r.log).batches if b.base] and not scan(r.log).damage
