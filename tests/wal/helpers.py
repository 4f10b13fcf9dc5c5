"""Shared builders for the WAL tests: a deterministic writer whose every epoch
can be recomputed, a replay that restores a region from a log (the test's own
applier, independent of wal.apply), and byte-poking helpers."""

from __future__ import annotations

import os
import signal
import struct
import time

import crcmod.predefined
import numpy as np

from concordia.devmem import MemoryBackend, open_backend
from concordia.wal import Log
from concordia.wal import format as F

crc_ref = crcmod.predefined.mkCrcFun("crc-32c")

MiB = 1 << 20


def commit_pages(log, e, pages=8, page_bytes=4096):
    """Epoch `e` of region 0: its first `pages` pages, each filled with e % 256, committed."""
    ids = np.arange(pages, dtype=np.uint32)
    log.appender.append_page_batch(e, 0, ids, np.full((pages, page_bytes), e % 256, np.uint8))
    return log.appender.commit(e, digests={0: 0})


class Model:
    """A region of `npages` pages; epoch e writes pages chosen by a seed of e."""

    def __init__(self, npages=64, page_bytes=4096, batches=3, per_batch=4, seed=0):
        self.npages, self.page_bytes = npages, page_bytes
        self.batches, self.per_batch, self.seed = batches, per_batch, seed
        self.state = np.zeros((npages, page_bytes), np.uint8)
        self.history = {0: self.state.copy()}

    def epoch_batches(self, e):
        rng = np.random.default_rng((self.seed, e))
        k = self.batches * self.per_batch
        ids = np.sort(rng.choice(self.npages, k, replace=False))
        pages = rng.integers(0, 256, (k, self.page_bytes), dtype=np.uint8)
        return [(ids[i:i + self.per_batch], pages[i:i + self.per_batch]) for i in range(0, k, self.per_batch)]

    def state_after(self, e):
        while max(self.history) < e:
            n = max(self.history) + 1
            s = self.history[n - 1].copy()
            for ids, pages in self.epoch_batches(n):
                s[ids] = pages
            self.history[n] = s
        return self.history[e]

    def digest(self, e):
        return F.region_digest(F.page_crcs_of(self.state_after(e)))

    def write_epoch(self, log, rid, e):
        for ids, pages in self.epoch_batches(e):
            log.appender.append_page_batch(e, rid, ids, pages)
        return log.appender.commit(e, {rid: self.digest(e)})


def build_log(backend=None, *, epochs=60, size=8 * MiB, segment=MiB, model=None, **kw):
    backend = backend if backend is not None else open_backend("memory:", size=size)
    model = model or Model(**kw)
    log = Log.create(backend, segment_size=segment)
    rid = log.define_region("r", np.uint8, (model.npages * model.page_bytes,), model.page_bytes, "opaque")
    for e in range(1, epochs + 1):
        model.write_epoch(log, rid, e)
    return log, model, rid


def replay(log, npages, page_bytes, rid=0):
    """Restore region `rid` from the committed records of `log`."""
    state = np.zeros((npages, page_bytes), np.uint8)
    for rec in log.records():
        if rec.kind == F.REC_PAGE_BATCH and rec.region_id == rid:
            pb = rec.page_batch()
            state[pb.page_ids] = pb.payload
    return state


def image(backend) -> bytearray:
    return bytearray(backend.array.tobytes())


def reopen(img, **kw):
    return Log.open(MemoryBackend.from_bytes(bytes(img)), **kw)


def fix_header_crc(img, off):
    struct.pack_into("<I", img, off + 60, crc_ref(bytes(img[off:off + 60])))


def fix_segment_crc(img, off):
    struct.pack_into("<I", img, off + 252, crc_ref(bytes(img[off:off + 252])))


def kill_writer_after(spec, model, delay, *, region=0, prepare=None, from_writing=False, mid_epoch=False):
    """Fork a writer that commits epoch after epoch of `model` into `spec`,
    SIGKILL it after `delay` seconds, and return the epochs whose commit had
    returned (the writer reports an epoch only after `commit` came back).
    `prepare(log)` tunes the writer's log before it starts.  With
    `from_writing` the delay counts from the moment the writer has opened the
    log and starts its first epoch, so that on a loaded machine (where fork
    and open can take longer than the delay) the kill still lands among the
    writes rather than before them.  With `mid_epoch` the kill lands inside an
    epoch by construction, however slow the machine: the writer commits one
    epoch, appends the next one's records, says so and waits there."""
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(r)
        os.close(ready_r)
        try:
            log = Log.open(spec, writable=True)
            if prepare is not None:
                prepare(log)
            e = log.last_committed_epoch + 1
            os.write(ready_w, b"w")
            if mid_epoch:
                model.write_epoch(log, region, e)
                os.write(w, struct.pack("<Q", e))
                for ids, pages in model.epoch_batches(e + 1):   # its records, no commit
                    log.appender.append_page_batch(e + 1, region, ids, pages)
                os.write(ready_w, b"m")
                time.sleep(3600)
            os.close(ready_w)
            while True:
                model.write_epoch(log, region, e)
                os.write(w, struct.pack("<Q", e))
                e += 1
        except BaseException:
            os._exit(3)
    os.close(w)
    os.close(ready_w)
    if from_writing or mid_epoch:
        os.read(ready_r, 1)  # b"" when the writer died before it started: the assert below says so
    if mid_epoch:
        os.read(ready_r, 1)  # its next epoch's records are written, its commit is not
    else:
        time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(ready_r)  # open until the writer is gone, so that its one byte never meets a closed pipe
    assert os.WIFSIGNALED(status), f"writer ended by itself (status {status})"
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    return struct.unpack(f"<{len(data) // 8}Q", data[:len(data) // 8 * 8])
