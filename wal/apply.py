"""The CPU applier: carry out a `Plan` into numpy arrays or `.npy` files.

Every page is checked against the CRC stored beside it in its record before it
is copied, and every region against the digest its commit (or its base
snapshot's catalog entry) states, so a restore either returns exact state or
raises `CorruptionError` naming the record (`segment N @ 0xOFFSET`, LSN, page).

A region is rebuilt in destination order, a chunk of pages (`chunk_bytes`) at
a time: one call of `pagecrc.gather_page_crcs` copies every page of the chunk
from wherever its last writer's record lies in the log mapping straight into
place and hashes each page in the same pass, and the CRCs are compared with the
stored ones.  So each byte is read from the log once, written once, and the
bytes checked are the bytes restored.  (Where the compiled helper is not
available, the copy is one numpy gather of 64-byte blocks, record payloads
being 64-byte aligned, and each destination page is then hashed from cache by
one `crc32c` call.)  Chunks are independent and run on a small thread pool
(the helper and numpy's gather release the GIL; the package's CRC calls are
asked to release it when threads share the work).  Sources that do not lie in
one buffer (plans built from loose arrays) are copied per record through a
small per-thread buffer instead.  The GPU applier (scatter on
the device) lives with the GPU kernels.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from crc32c import crc32c as _crc32c

from concordia.root_error import Hint
from concordia.wal import pagecrc as _pagecrc
from concordia.wal.errors import AbsentRegionError, CorruptionError, UsageError, WalError
from concordia.wal.planner import Plan, RegionPlan
from concordia.wal.reader import PROGRESS_STEP  # progress is told at most this often, as the scanner tells it

#: pages of one record copied per task
DEFAULT_CHUNK_BYTES = 1 << 20



def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def page_crcs(pages: np.ndarray, *, release_gil: bool = False) -> np.ndarray:
    """CRC32C of each row of a C-contiguous (k, page_bytes) uint8 array (see
    pagecrc.page_crcs; release_gil matters only on the package path)."""
    return _pagecrc.page_crcs(pages, release_gil=release_gil)


_page_crcs = page_crcs


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


def _as_items(pages: np.ndarray) -> np.ndarray:
    """A (k, page_bytes) C-contiguous uint8 array seen as k items of one page
    each, so numpy gathers and scatters whole pages with one memcpy per page."""
    return pages.reshape(-1).view(np.dtype((np.void, pages.shape[1])))


_scratch = threading.local()


def _scratch_pages(n: int, pb: int) -> np.ndarray:
    """A per-thread (n, pb) buffer, reused across chunks so it stays in cache."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[1] != pb or buf.shape[0] < n:
        buf = _scratch.buf = np.empty((n, pb), dtype=np.uint8)
    return buf[:n]


def page_offset(batch, row: int, page_bytes: int) -> int:
    """Where page `row` of record `batch` lies in its segment (the payload is
    the record's last bytes, FORMAT.md §6)."""
    return batch.offset + (batch.length - batch.page_ids.size * page_bytes) + int(row) * page_bytes


def bad_page(region: str, batch, row: int, page_id: int, page_bytes: int, stored: int,
             computed: int) -> CorruptionError:
    """The one diagnostic of a page whose CRC32C is not the one its record
    stores (FORMAT.md §6): every applier (host, device, compaction's fold)
    raises it in these words, at the page's own offset."""
    return CorruptionError(
        f"page CRC mismatch for page {int(page_id)} of region {region!r} in record lsn {batch.lsn}, "
        f"stored 0x{int(stored):08x}, computed 0x{int(computed):08x}",
        where=f"segment {batch.segment} @ {page_offset(batch, row, page_bytes):#x}")


def check_pages(region: str, batch, rows: np.ndarray, page_ids: np.ndarray, page_bytes: int, stored: np.ndarray,
                computed: np.ndarray) -> None:
    """The one page check of pages `rows` of record `batch` (page numbers
    `page_ids` of the region): `bad_page` for the first whose computed CRC32C
    differs from the stored one."""
    bad = np.flatnonzero(computed != stored)
    if bad.size:
        i = int(bad[0])
        raise bad_page(region, batch, rows[i], page_ids[i], page_bytes, stored[i], computed[i])


def digest_mismatch(region: str, epoch: int, stated: int, restored: int) -> CorruptionError:
    """The one diagnostic of a region whose restored pages do not hash to the
    digest its commit (or its base's catalog entry) states (FORMAT.md §5.4)."""
    return CorruptionError(f"region {region!r} at epoch {epoch}: digest mismatch, "
                           f"stated 0x{int(stated):08x}, restored 0x{int(restored):08x}",
                           hint="the log's records disagree with its commit records")


def absent_names(plan: Plan, regions=None) -> list:
    """The names among `regions` (None: every region of the plan) with no
    state at the plan's epoch: registered after it (`RegionPlan.absent`), or
    named by the log's open but held by no commit (a descriptor after the
    last commit, a live writer's: the plan has no such region and did not
    give it up, `Plan.dropped`); restoring either would leave its target as
    it was, unsaid, or a new array of zeros."""
    if regions is None:
        return [n for n, rp in plan.regions.items() if rp.absent]
    given_up = {n for d in plan.dropped for n in (d.gave_up_regions or ())}
    return [n for n in regions if (plan.regions[n].absent if n in plan.regions else n not in given_up)]


def check_present(plan: Plan, regions=None, *, where: str | None = None) -> None:
    """The one refusal of a region with no state at its plan's epoch
    (`absent_names`) among `regions` (None: every region of the plan): one
    line naming the first and the epoch, and the others, raised before
    anything is written.  Every applier and every recover path calls it, so
    such a region is never restored as zeros, nor left as it was unsaid."""
    names = absent_names(plan, regions)
    if not names:
        return
    rp, more = plan.regions.get(names[0]), names[1:]
    first = rp.first_epoch if rp is not None else None
    text = (rp.absent_reason() if rp is not None else
            f"region {names[0]!r} has no state at epoch {plan.epoch} (no committed epoch holds it yet)")
    text += f"; and {len(more)} more: {', '.join(map(repr, more))}" if more else ""
    raise AbsentRegionError(text, where=where, hint=Hint(
        api="pass absent='keep' to leave it as it is" + (f", or recover epoch {first} or later" if first else ""),
        cli=f"restore --epoch {first} or later" if first else "a checkpoint must write it first"))


def check_digest(region: str, epoch: int, stated: int | None, restored: int) -> None:
    """The one digest check: the digest of the restored region's page CRCs
    against the stated one (None: nothing stated, nothing to check)."""
    if stated is not None and int(restored) != int(stated):
        raise digest_mismatch(region, epoch, stated, restored)


def _copy_chunk(rp: RegionPlan, dst: np.ndarray, crcs: np.ndarray, src_batch, rows, pids, check: bool,
                release_gil: bool = False):
    """Verify the pages `rows` of one record, then copy them to page numbers `pids`
    of the flat uint8 buffer `dst` (whose last page may be short).

    One pass over the source per page: scattered rows are first gathered into a
    small per-thread buffer (which stays in cache), their CRCs computed there,
    then scattered to the destination; a run of consecutive rows is checked in
    place and copied slice to slice while it is still in cache.  Either way the
    bytes checked are exactly the bytes copied."""
    pb = rp.region.page_bytes
    payload = src_batch.payload
    if payload is None:
        raise WalError(f"record at lsn {src_batch.lsn} carries no payload view", hint="plan from an open log")
    if not rows.size:
        return
    count = payload.shape[0]
    full = dst.size // pb
    # np.take / np.put below run with mode="clip", which would hide a bad index
    if rows.size != pids.size or int(rows.min()) < 0 or int(rows.max()) >= count \
            or int(pids.min()) < 0 or int(pids.max()) > full - (dst.size == full * pb):
        raise WalError(f"plan source of record lsn {src_batch.lsn} names rows or pages out of range",
                       hint="the plan does not belong to this log")
    stored = np.asarray(src_batch.page_crcs)[rows]
    if not payload.flags.c_contiguous:
        payload = np.ascontiguousarray(payload)
    if _run_of(rows):
        src = payload[int(rows[0]):int(rows[-1]) + 1]
    else:
        src = _scratch_pages(rows.size, pb)
        np.take(_as_items(payload), rows, out=_as_items(src), mode="clip")
    if check:
        check_pages(rp.name, src_batch, rows, pids, pb, stored, page_crcs(src, release_gil=release_gil))
    crcs[pids] = stored
    if int(pids[-1]) >= full:  # the region's short last page
        dst[full * pb:] = src[-1, : dst.size - full * pb]
        src, pids = src[:-1], pids[:-1]
        if not pids.size:
            return
    pages = dst[: full * pb].reshape(full, pb)
    if _run_of(pids):
        np.copyto(pages[int(pids[0]):int(pids[-1]) + 1], src)
    else:
        np.put(_as_items(pages), pids, _as_items(np.ascontiguousarray(src)), mode="clip")


BLOCK = 64  # record payloads start 64-byte aligned (FORMAT.md), so a page is whole blocks


def _root(a: np.ndarray) -> np.ndarray:
    """The outermost ndarray a view was taken from (for a real log: the
    backend mapping every record payload lies in)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _gather_map(rp: RegionPlan):
    """(root, offsets, stored, owner, rows) for a region whose sources all lie
    in one C-contiguous buffer, 64-byte aligned: for every region page, the byte
    offset of its source page in `root` (-1 for a zero page), its stored CRC,
    and which source / row it comes from (for naming a damaged page).  None when
    the sources do not share such a buffer (then pages are copied per source)."""
    r = rp.region
    pb = r.page_bytes
    if not rp.sources or pb % BLOCK:
        return None
    roots = {}
    for s in rp.sources:
        pay = s.batch.payload
        if not isinstance(pay, np.ndarray) or not pay.flags.c_contiguous or pay.dtype != np.uint8:
            return None
        root = _root(pay)
        roots[id(root)] = root
        if len(roots) > 1 or not root.flags.c_contiguous:
            return None
    root = roots.popitem()[1]
    base = root.ctypes.data
    offsets = np.full(r.pages, -1, dtype=np.int64)
    stored = np.zeros(r.pages, dtype=np.uint32)
    owner = np.full(r.pages, -1, dtype=np.int32)
    rows_of = np.zeros(r.pages, dtype=np.int64)
    for i, s in enumerate(rp.sources):
        pay = s.batch.payload
        off = pay.ctypes.data - base
        if off < 0 or off % BLOCK or off + pay.nbytes > root.nbytes:
            return None
        check_source(s.batch, s.rows, s.page_ids, r.pages)
        offsets[s.page_ids] = off + s.rows.astype(np.int64) * pb
        stored[s.page_ids] = np.asarray(s.batch.page_crcs)[s.rows]
        owner[s.page_ids] = i
        rows_of[s.page_ids] = s.rows
    return root, offsets, stored, owner, rows_of


def check_source(batch, rows, pids, pages: int) -> None:
    """Rows within the record, page numbers within the region (the gathers below
    run with mode="clip", which would otherwise hide a bad index)."""
    count = batch.payload.shape[0]
    if rows.size != pids.size or (rows.size and (int(rows.min()) < 0 or int(rows.max()) >= count
                                                 or int(pids.min()) < 0 or int(pids.max()) >= pages)):
        raise WalError(f"plan source of record lsn {batch.lsn} names rows or pages out of range",
                       hint="the plan does not belong to this log")


def _gather_pages(rp: RegionPlan, gm, dst: np.ndarray, crcs: np.ndarray, lo: int, hi: int, check: bool,
                  release_gil: bool) -> None:
    """Region pages [lo, hi) (all whole pages of `dst`) in page order: one gather
    of 64-byte blocks from wherever each page lies in the log straight into the
    destination (one copy, destination written sequentially), then the CRC of
    each destination page while it is still in cache, against the CRC stored
    in its record."""
    root, offsets, stored, owner, rows_of = gm
    pb = rp.region.page_bytes
    off = offsets[lo:hi]
    have = off >= 0
    if not have.any():
        return  # zero pages: the destination starts zero
    got = _pagecrc.gather_page_crcs(dst[lo * pb:hi * pb], root.reshape(-1).view(np.uint8), off, pb,
                                    release_gil=release_gil, crcs=check)
    exp = stored[lo:hi]
    if check:
        bad = np.flatnonzero((got != exp) & have)
        if bad.size:  # the first bad page, named with its own record
            i = int(bad[0])
            raise bad_page(rp.name, rp.sources[int(owner[lo + i])].batch, rows_of[lo + i], lo + i, pb, exp[i], got[i])
    crcs[lo:hi][have] = exp[have]


def _region_jobs(rp: RegionPlan, dst: np.ndarray, crcs: np.ndarray, check: bool, chunk_bytes: int,
                 release_gil: bool) -> list:
    """The work of restoring one region into the flat uint8 buffer `dst` (whose
    last page may be short), as independent jobs."""
    pb = rp.region.page_bytes
    gm = _gather_map(rp)
    if gm is None:  # sources in separate buffers: per source, gathered through a small buffer
        return [lambda s=s, rows=rows, pids=pids: _copy_chunk(rp, dst, crcs, s.batch, rows, pids, check,
                                                              release_gil)
                for s, rows, pids in _chunks(rp, chunk_bytes)]
    full = dst.size // pb
    per = max(1, chunk_bytes // pb)
    jobs = [lambda lo=lo: _gather_pages(rp, gm, dst, crcs, lo, min(full, lo + per), check, release_gil)
            for lo in range(0, full, per)]
    if full < rp.region.pages and gm[1][full] >= 0:  # the short last page, from its record
        s = rp.sources[int(gm[3][full])]
        row = gm[4][full:full + 1]
        jobs.append(lambda: _copy_chunk(rp, dst, crcs, s.batch, row, np.array([full]), check))
    return jobs


def _finish_region(rp: RegionPlan, crcs: np.ndarray, check: bool) -> None:
    pb = rp.region.page_bytes
    if rp.zero_page_ids.size:
        crcs[rp.zero_page_ids] = _crc32c(bytes(pb))
    if check and rp.digest is not None:
        from concordia.wal.format import region_digest

        check_digest(rp.name, rp.epoch, rp.digest, region_digest(crcs))


def _run(jobs, threads: int, done=None):
    """Run `jobs`; done(k), if given, is called in this thread as the first k
    jobs have finished."""
    if threads <= 1 or len(jobs) <= 1:
        for k, j in enumerate(jobs, 1):
            j()
            if done is not None:
                done(k)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for k, f in enumerate([pool.submit(j) for j in jobs], 1):
            f.result()
            if done is not None:
                done(k)


def _zero_pages(rp: RegionPlan, dst: np.ndarray) -> None:
    """Zero the pages nobody wrote (for a destination that does not start zero)."""
    pb = rp.region.page_bytes
    ids = rp.zero_page_ids
    if not ids.size:
        return
    full = dst.size // pb
    whole = ids[ids < full]
    if whole.size:
        np.put(_as_items(dst[: full * pb].reshape(full, pb)), whole, np.zeros(1, np.dtype((np.void, pb))))
    if ids[-1] >= full:
        dst[full * pb:] = 0


def _target(name: str, r, arr) -> np.ndarray:
    """The flat uint8 bytes of a caller's array for region `r`, checked."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(r.dtype) or arr.shape != tuple(r.shape) \
            or not arr.flags.c_contiguous or not arr.flags.writeable:
        got = (f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__)
        raise UsageError(f"out[{name!r}] must be a writable C-contiguous {np.dtype(r.dtype)} array of shape "
                         f"{tuple(r.shape)}, not {got}")
    return arr.reshape(-1).view(np.uint8)


def apply_plan_numpy(log, plan: Plan, *, check: bool = True, threads: int | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, regions=None, out: dict | None = None) -> dict:
    """Restore every region of `plan` into a new numpy array of the region's
    dtype and shape; returns {name: array}.  Pages are CRC-checked and each
    region's digest compared with its commit unless check=False.  `log` keeps
    the mapping the plan's records point into alive; it is not otherwise used.

    out: {name: array} restores those regions into the caller's arrays instead
    (C-contiguous, the region's dtype and shape; e.g. the live buffers of a
    restarted process), which are returned as they are.  A region with no
    state at the plan's epoch is refused first (`check_present`)."""
    threads = default_threads() if threads is None else max(1, int(threads))
    out = dict(out or {})
    unknown = sorted(set(out) - set(plan.regions))
    if unknown:
        raise UsageError(f"out names regions the plan does not hold: {', '.join(map(repr, unknown))}")
    check_present(plan, regions)
    result, crcs, jobs = {}, {}, []
    for name, rp in plan.regions.items():
        if regions is not None and name not in regions:
            continue
        r = rp.region
        if name in out:
            flat = _target(name, r, out[name])
            _zero_pages(rp, flat)
            result[name] = out[name]
        else:
            flat = np.zeros(r.pages * r.page_bytes, dtype=np.uint8)
            result[name] = flat[: r.nbytes].view(np.dtype(r.dtype)).reshape(r.shape)
        crcs[name] = np.zeros(r.pages, dtype=np.uint32)
        jobs += _region_jobs(rp, flat, crcs[name], check, chunk_bytes, threads > 1)
    _run(jobs, threads)
    for name, rp in plan.regions.items():
        if name in crcs:
            _finish_region(rp, crcs[name], check)
    return result


def restore_region_npy(log, plan: Plan, region: str, path, *, check: bool = True,
                       threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       progress=None, replace: bool = True, inputs=()) -> str:
    """Write region `region` of `plan` to a `.npy` file at `path` (dtype and
    shape from the region descriptor), streaming: memory use is a few chunks,
    not the region.  Returns the path written.

    The file is complete or absent (devmem.outfile.OutputFile): written to a
    temporary file beside `path` whose blocks are reserved first (a full disk
    is an error before the first byte), its pages and digest checked, its
    header read back, fsynced, and only then renamed over `path`.  A failure
    leaves `path` as it was.  replace=False refuses an existing `path`;
    `inputs` are paths the output must not be (the log's file): refused
    before anything is written.

    progress(done_bytes, total_bytes), if given, is called from this thread
    as chunks land (at most every PROGRESS_STEP bytes, and once at the end);
    total is the region's bytes, done an estimate from the chunks finished."""
    import io
    import mmap

    from concordia.devmem.outfile import OutputFile

    if region not in plan.regions:
        raise WalError(f"plan has no region {region!r}", hint="regions: " + ", ".join(sorted(plan.regions)))
    check_present(plan, [region])  # before the output is touched
    rp = plan.regions[region]
    r = rp.region
    threads = default_threads() if threads is None else max(1, int(threads))
    path = os.fspath(path)
    dtype, shape = np.dtype(r.dtype), tuple(r.shape)
    head = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(head, d)
    except ValueError:  # a header over 64 KiB
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, d)
    header = head.getvalue()
    total = len(header) + r.nbytes
    with OutputFile(path, replace=replace, size=total, inputs=inputs) as out:
        out.write(header, 0)
        crcs = np.zeros(r.pages, dtype=np.uint32)
        if r.nbytes:
            mm = mmap.mmap(out.fd, total)
            try:
                flat = np.frombuffer(mm, dtype=np.uint8, count=r.nbytes, offset=len(header))
                jobs = _region_jobs(rp, flat, crcs, check, chunk_bytes, threads > 1)
                _run(jobs, threads, _progress_of_jobs(progress, len(jobs), r.nbytes))
                # zero pages: the reserved file reads as zero where nothing was written
                mm.flush()
            finally:
                jobs = flat = None
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still held (by a traceback): unmapped when it goes
        _finish_region(rp, crcs, check)
        _check_npy_header(out.fd, dtype, shape, len(header), path)
        if progress is not None:
            progress(r.nbytes, r.nbytes)
        out.commit(expect_size=total)
    return path


def _check_npy_header(fd: int, dtype, shape, header_len: int, where: str) -> None:
    """Read the written header back: what a loader will see must be the region."""
    with open(os.dup(fd), "rb") as f:
        f.seek(0)
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        got_shape, fortran, got_dtype = read(f)
        if tuple(got_shape) != tuple(shape) or got_dtype != dtype or fortran or f.tell() != header_len:
            raise WalError(f"the .npy header reads back as {got_dtype}{list(got_shape)}, "
                           f"not {dtype}{list(shape)}", where=where)


def _progress_of_jobs(progress, jobs: int, total: int):
    """A `_run` done(k) callback telling `progress` a share of `total` bytes,
    no more often than every PROGRESS_STEP bytes (jobs are chunks of about
    equal size)."""
    if progress is None or not jobs:
        return None
    shown = [0]

    def done(k: int) -> None:
        now = total * k // jobs
        if now - shown[0] >= PROGRESS_STEP:
            shown[0] = now
            progress(now, total)

    return done


__all__ = ["apply_plan_numpy", "restore_region_npy", "check_present", "default_threads", "DEFAULT_CHUNK_BYTES"]
