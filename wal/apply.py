"""The CPU applier: carry out a `Plan` into numpy arrays or `.npy` files.

Every page is checked against the CRC stored beside it in its record before it
is copied, and every region against the digest its commit (or its base
snapshot's catalog entry) states, so a restore either returns exact state or
raises `CorruptionError` naming the record (`segment N @ 0xOFFSET`, LSN, page).

Work is cut into chunks of about `chunk_bytes` of pages from one record and run
on a small thread pool: numpy's fancy-index copy and the `crc32c` package both
release the GIL on large buffers, so independent chunks overlap.  The GPU
applier (scatter on the device) lives with the GPU kernels.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from crc32c import crc32c as _crc32c

from concordia.wal.errors import CorruptionError, WalError
from concordia.wal.planner import Plan, RegionPlan

#: pages of one record copied per task
DEFAULT_CHUNK_BYTES = 4 << 20


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _page_crcs(src: np.ndarray) -> np.ndarray:
    """CRC32C of each row of a (k, page_bytes) uint8 array."""
    k, pb = src.shape
    mv = memoryview(np.ascontiguousarray(src)).cast("B")
    return np.fromiter((_crc32c(mv[i:i + pb]) for i in range(0, k * pb, pb)), dtype=np.uint32, count=k)


def _run_of(idx: np.ndarray) -> bool:
    """True when idx is a run of consecutive integers (then a slice does)."""
    return idx.size > 0 and int(idx[-1]) - int(idx[0]) + 1 == idx.size


def take_rows(payload: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows of a record's payload: a view when they are consecutive (the common
    case: a record's pages are mostly all still current), else a gathered copy."""
    if _run_of(rows):
        return payload[int(rows[0]):int(rows[-1]) + 1]
    return payload[rows]


def _chunks(rp: RegionPlan, chunk_bytes: int):
    per = max(1, chunk_bytes // max(1, rp.region.page_bytes))
    for s in rp.sources:
        for i in range(0, s.rows.size, per):
            yield s, s.rows[i:i + per], s.page_ids[i:i + per]


def _row_crcs(payload: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """CRC32C of the given rows of a record's (count, page_bytes) payload, read
    in place (no gathered copy)."""
    pb = payload.shape[1]
    mv = memoryview(payload.reshape(-1)) if payload.flags.c_contiguous else None
    if mv is None:
        return _page_crcs(payload[rows])
    return np.fromiter((_crc32c(mv[r * pb:(r + 1) * pb]) for r in rows.tolist()), dtype=np.uint32,
                       count=rows.size)


def _copy_chunk(rp: RegionPlan, dst: np.ndarray, crcs: np.ndarray, src_batch, rows, pids, check: bool):
    """Verify the pages `rows` of one record, then copy them to page numbers `pids`
    of the flat uint8 buffer `dst` (whose last page may be short).  Long runs
    (consecutive rows to consecutive pages) go slice to slice; scattered pages
    through one gather/scatter."""
    pb = rp.region.page_bytes
    payload = src_batch.payload
    if payload is None:
        raise WalError(f"record at lsn {src_batch.lsn} carries no payload view", hint="plan from an open log")
    stored = np.asarray(src_batch.page_crcs)[rows]
    if check:
        got = _row_crcs(payload, rows)
        bad = np.flatnonzero(got != stored)
        if bad.size:
            i = int(bad[0])
            off = src_batch.offset + (src_batch.length - src_batch.page_ids.size * pb) + int(rows[i]) * pb
            raise CorruptionError(
                f"page CRC mismatch for page {int(pids[i])} of region {rp.name!r} in record lsn "
                f"{src_batch.lsn}, stored 0x{int(stored[i]):08x}, computed 0x{int(got[i]):08x}",
                where=f"segment {src_batch.segment} @ {off:#x}",
            )
    crcs[pids] = stored
    full = dst.size // pb
    pages = dst[: full * pb].reshape(full, pb)
    if pids.size and int(pids[-1]) >= full:  # the region's short last page
        dst[full * pb:] = payload[int(rows[-1]), : dst.size - full * pb]
        rows, pids = rows[:-1], pids[:-1]
    if not pids.size:
        return
    brk = np.flatnonzero((np.diff(rows) != 1) | (np.diff(pids) != 1)) + 1
    if brk.size * 16 > rows.size:  # short runs: one fancy gather/scatter
        pages[pids] = payload[rows]
        return
    starts = np.concatenate(([0], brk)).tolist()
    ends = np.concatenate((brk, [rows.size])).tolist()
    for s0, e0 in zip(starts, ends):
        r0, p0, n = int(rows[s0]), int(pids[s0]), e0 - s0
        pages[p0:p0 + n] = payload[r0:r0 + n]


def _finish_region(rp: RegionPlan, crcs: np.ndarray, check: bool) -> None:
    pb = rp.region.page_bytes
    if rp.zero_page_ids.size:
        crcs[rp.zero_page_ids] = _crc32c(bytes(pb))
    if check and rp.digest is not None:
        from concordia.wal.format import region_digest

        got = region_digest(crcs)
        if got != rp.digest:
            raise CorruptionError(
                f"region {rp.name!r} at epoch {rp.epoch}: digest mismatch, "
                f"stated 0x{rp.digest:08x}, restored 0x{got:08x}",
                hint="the log's records disagree with its commit records",
            )


def _run(jobs, threads: int):
    if threads <= 1 or len(jobs) <= 1:
        for j in jobs:
            j()
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


def apply_plan_numpy(log, plan: Plan, *, check: bool = True, threads: int | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, regions=None) -> dict:
    """Restore every region of `plan` into a new numpy array of the region's
    dtype and shape; returns {name: array}.  Pages are CRC-checked and each
    region's digest compared with its commit unless check=False.  `log` keeps
    the mapping the plan's records point into alive; it is not otherwise used."""
    threads = default_threads() if threads is None else max(1, int(threads))
    out, flats, crcs, jobs = {}, {}, {}, []
    for name, rp in plan.regions.items():
        if regions is not None and name not in regions:
            continue
        r = rp.region
        flat = np.zeros(r.pages * r.page_bytes, dtype=np.uint8)
        flats[name] = flat
        crcs[name] = np.zeros(r.pages, dtype=np.uint32)
        out[name] = flat[: r.nbytes].view(np.dtype(r.dtype)).reshape(r.shape)
        for s, rows, pids in _chunks(rp, chunk_bytes):
            jobs.append(lambda rp=rp, flat=flat, c=crcs[name], s=s, rows=rows, pids=pids:
                        _copy_chunk(rp, flat, c, s.batch, rows, pids, check))
    _run(jobs, threads)
    for name, rp in plan.regions.items():
        if name in flats:
            _finish_region(rp, crcs[name], check)
    return out


def restore_region_npy(log, plan: Plan, region: str, path, *, check: bool = True,
                       threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """Write region `region` of `plan` to a `.npy` file at `path` (dtype and
    shape from the region descriptor), streaming: memory use is a few chunks,
    not the region.  Returns the path written."""
    if region not in plan.regions:
        raise WalError(f"plan has no region {region!r}", hint="regions: " + ", ".join(sorted(plan.regions)))
    rp = plan.regions[region]
    r = rp.region
    threads = default_threads() if threads is None else max(1, int(threads))
    path = os.fspath(path)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.dtype(r.dtype), shape=tuple(r.shape))
    try:
        flat = mm.reshape(-1).view(np.uint8) if mm.size else np.zeros(0, np.uint8)
        crcs = np.zeros(r.pages, dtype=np.uint32)
        jobs = [lambda s=s, rows=rows, pids=pids: _copy_chunk(rp, flat, crcs, s.batch, rows, pids, check)
                for s, rows, pids in _chunks(rp, chunk_bytes)]
        _run(jobs, threads)  # zero pages: open_memmap's file starts zero-filled
        _finish_region(rp, crcs, check)
        mm.flush()
    except BaseException:
        del mm
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    del mm
    return path


__all__ = ["apply_plan_numpy", "restore_region_npy", "default_threads", "DEFAULT_CHUNK_BYTES"]
