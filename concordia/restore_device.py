"""Restore a recovery plan straight into device arrays (CuPy).

Kept apart from the Session so the checkpoint path and the restore path can
change independently; `Session.recover(on_device=True)` and
`concordia-wal bench recover` both come here."""

from __future__ import annotations

import time

import numpy as np

from concordia.errors import ConcordiaError


def apply_plan_cupy(log, plan, *, regions=None, chunk_bytes: int = 64 << 20, stats: dict | None = None,
                    registration=None) -> dict:
    """Restore the regions of `plan` straight into new CuPy arrays.

    GPU-mappable logs (shm, pinned, memory) are registered with CUDA and the
    scatter kernel reads every page from the mapping itself (one pass over the
    bus, each page's CRC32C checked on the device).  Other tiers go through two
    pinned bounce buffers: the host copies a chunk of payload into one while the
    previous chunk crosses the bus and is scattered.  Each region's digest is
    then recomputed on the device and compared with its commit.
    `stats`, when given, receives register/scatter/verify seconds.
    `registration`: the mapping's live registration (a session's checkpoint
    path keeps one), used as is and left registered."""
    import cupy as cp

    from concordia.devmem import cuda_host
    from concordia.gpu_kernels import gpu
    from concordia.wal import format as fmt
    from concordia.wal.errors import CorruptionError

    st = stats if stats is not None else {}
    st.update(register_s=0.0, scatter_s=0.0, verify_s=0.0, via="")
    out, plans = {}, [rp for name, rp in plan.regions.items() if regions is None or name in regions]
    backend = log.backend
    t0 = time.perf_counter()
    reg = registration
    if reg is None and backend.gpu_mappable:
        try:
            reg = cuda_host.register(backend)
        except ConcordiaError:
            reg = None
    st["register_s"] = time.perf_counter() - t0
    st["via"] = "registered mapping" if reg is not None else "pinned bounce buffers"
    try:
        t1 = time.perf_counter()
        for rp in plans:
            r = rp.region
            pb = r.page_bytes
            dst = cp.zeros(r.nbytes, cp.uint8)
            for src in rp.sources:
                b = src.batch
                base_off = b.offset + fmt.page_batch_payload_offset(int(b.page_ids.size))
                rows = np.asarray(src.rows, np.int64)
                pids = np.asarray(src.page_ids)
                crcs = np.asarray(b.page_crcs)[rows]
                if reg is not None:
                    offs = (base_off + rows * pb).astype(np.uint64)
                    bad = gpu.scatter_pages(reg.as_cupy(), offs, pids, dst, page_bytes=pb, expected_crcs=crcs)
                    _raise_bad(bad, pids, rp, b)
                else:
                    _bounce(backend.array, base_off, rows, pids, crcs, dst, pb, chunk_bytes, rp, b)
            cp.cuda.get_current_stream().synchronize()
            out[rp.name] = dst
        t2 = time.perf_counter()
        st["scatter_s"] = t2 - t1
        for rp in plans:
            if rp.digest is not None:
                got = gpu.region_digest(gpu.crc32c_pages(out[rp.name], page_bytes=rp.region.page_bytes))
                if got != rp.digest:
                    raise CorruptionError(f"region {rp.name!r} restored with digest 0x{got:08x}, its commit "
                                          f"states 0x{rp.digest:08x}", where=f"epoch {rp.epoch}")
        st["verify_s"] = time.perf_counter() - t2
    finally:
        if reg is not None and reg is not registration:
            reg.unregister()
    return {name: a.view(np.dtype(rp.region.dtype)).reshape(rp.region.shape)
            for (name, a), rp in zip(out.items(), plans)}


def _raise_bad(bad, pids, rp, batch):
    if int(bad.size):
        from concordia.wal.errors import CorruptionError

        i = int(bad[0].get())
        raise CorruptionError(f"page CRC mismatch for page {int(pids[i])} of region {rp.name!r} in record "
                              f"lsn {batch.lsn}", where=f"segment {batch.segment} @ {batch.offset:#x}")


_BOUNCE: dict = {}
_COPY_POOL: list = []
#: host threads that copy log payload into the pinned bounce buffers (one
#: thread copies a few GB/s, faulting the log mapping in as it goes; the bus
#: takes over 50)
COPY_THREADS = 8


def _parallel_copy(dst: np.ndarray, src) -> None:
    """np.copyto in slices on a small thread pool (numpy drops the GIL while copying)."""
    n = int(dst.size)
    if n < (16 << 20) or COPY_THREADS < 2:
        np.copyto(dst, src)
        return
    if not _COPY_POOL:
        from concurrent.futures import ThreadPoolExecutor

        _COPY_POOL.append(ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="concordia-copy"))
    per = -(-n // COPY_THREADS)
    step = -(-per // 4096) * 4096

    def part(lo):
        np.copyto(dst[lo:lo + step], src[lo:lo + step])

    for f in [_COPY_POOL[0].submit(part, lo) for lo in range(0, n, step)]:
        f.result()


def _bounce(arr, base_off, rows, pids, crcs, dst, pb, chunk_bytes, rp, batch):
    """Payload rows -> pinned buffer (host copy) -> device staging -> scatter,
    alternating two buffers so one chunk's copy overlaps the previous transfer."""
    import cupy as cp

    from concordia.gpu_kernels import gpu

    per = max(1, chunk_bytes // pb)
    key = (per * pb,)
    if key not in _BOUNCE:
        _BOUNCE.clear()
        _BOUNCE[key] = [(gpu.pinned_buffer(per * pb)[0], cp.empty(per * pb, cp.uint8), cp.cuda.Stream(non_blocking=True),
                         None) for _ in range(2)]
    bufs = _BOUNCE[key]
    found = []  # checked once at the end: reading a result's size would synchronise every chunk
    for n, lo in enumerate(range(0, rows.size, per)):
        host, dev, stream, ev = bufs[n % 2]
        if ev is not None:
            ev.synchronize()  # this buffer's previous transfer and scatter are done
        r = rows[lo:lo + per]
        k = r.size
        if int(r[-1]) - int(r[0]) + 1 == k:  # consecutive rows: one memcpy, split over threads
            s0 = base_off + int(r[0]) * pb
            _parallel_copy(host[:k * pb], arr[s0:s0 + k * pb])
        else:
            src = arr[base_off:base_off + (int(r[-1]) + 1) * pb].reshape(-1, pb)
            np.take(src, r, axis=0, out=host[:k * pb].reshape(k, pb))
        with stream:
            dev[:k * pb].set(host[:k * pb], stream=stream)
            offs = cp.arange(k, dtype=cp.uint64) * cp.uint64(pb)
            bad = gpu.scatter_pages(dev[:k * pb], offs, pids[lo:lo + per], dst, page_bytes=pb,
                                    expected_crcs=crcs[lo:lo + per])
            ev = stream.record()
        bufs[n % 2] = (host, dev, stream, ev)
        found.append((bad, lo))
    for host, dev, stream, ev in bufs:
        if ev is not None:
            ev.synchronize()
    for bad, lo in found:
        _raise_bad(bad, pids[lo:lo + per], rp, batch)
