"""Restore a recovery plan straight into device arrays (CuPy).

Kept apart from the checkpoint path so the two can change independently;
`restore.run.restore` (behind `Session.recover`, the standby and
`concordia-wal bench recover`) comes here for device targets.

The restore is one pipeline over the whole plan, not a loop over records:

1. `transfer_plan` (numpy only) lays every page the plan reads, in log order,
   into chunks of at most `chunk_bytes`: each chunk is a few contiguous log
   ranges ("copies", merged across records when the bytes between them are
   small) and, for each page, where it lands in the chunk's staging buffer.
2. Host side, a pool of threads fills pinned buffers from the log with
   `preadv` on the log's descriptor (no page faults on a fresh mapping; the
   kernel copies from the page cache or tmpfs), or with memory copies for
   tiers without one.  A log already registered with CUDA (a live session's)
   is read by the copy engine straight from its mapping instead.
3. Device side, the copy engine moves each chunk into one of a few device
   staging slots while the scatter kernel (`scatter.cu`) checks the pages of
   the previous chunk against their stored CRC32C and writes them into the
   region: one launch per region and chunk, no host synchronisation until the
   end, when the mismatch flags of every page are read once and each region's
   digest is compared with its commit.

`apply_transfer_numpy` runs the same transfer plan with the numpy twin of the
scatter kernel, so the chunking and the fill are tested where no GPU exists.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from concordia.root_error import ConcordiaError

#: bytes between two pages in the log that are copied along rather than
#: starting a new copy (record headers and tables between payloads are small)
MERGE_GAP = 256 << 10
#: a copy starts on this boundary of its staging buffer
STAGE_ALIGN = 256
#: one piece of host work (a preadv or a memory copy)
PIECE_BYTES = 4 << 20
#: pinned host buffers and device staging slots in flight
HOST_BUFFERS = 4
DEVICE_SLOTS = 3
DEFAULT_CHUNK_BYTES = 32 << 20
#: a layout over at most this many runs finds its chunks with `bisect` on lists,
#: above it with numpy's searches (`_chunk_starts`)
LIST_SEARCH_RUNS = 1 << 16
#: registering: pieces of the log pinned for the copy engine, and threads pinning them
REGISTER_PIECE = 64 << 20
REGISTER_THREADS = int(os.environ.get("CONCORDIA_REGISTER_THREADS", 0)) or 8
#: a restore of at most this many bytes pins the pieces it reads on any mapping
#: CUDA can pin (`pins_ahead`); 0 copies every such restore through pinned buffers;
#: None: the environment's value was no whole number (refused where it is used)
PIN_SMALL_BYTES = os.environ.get("CONCORDIA_PIN_SMALL_BYTES", "").strip()
PIN_SMALL_BYTES = int(PIN_SMALL_BYTES) if PIN_SMALL_BYTES.isdigit() else (1 << 30 if not PIN_SMALL_BYTES else None)
#: the way a large restore (beyond PIN_SMALL_BYTES) with read="auto" takes: "" (the tier's own:
#: pinned ahead on device DAX in huge pages, copied elsewhere), or "pin" or "copy" (`pins_ahead`)
READ_LARGE = os.environ.get("CONCORDIA_RESTORE_READ", "").strip().lower()
#: how the pinned host buffers are made: "alloc" (cudaHostAlloc) or "register" (anonymous memory,
#: cudaHostRegister); see `_host_buffers`.  "alloc" stays the default until "register" has run on a GPU.
HOST_BUFFER_HOW = os.environ.get("CONCORDIA_HOST_BUFFERS", "alloc").strip().lower()
#: host threads filling the pinned buffers (one copies a few GB/s; the bus takes 50)
COPY_THREADS = int(os.environ.get("CONCORDIA_RESTORE_THREADS", 0)) or min(12, max(2, os.cpu_count() or 2))


@dataclass
class Transfer:
    """Where every page of a plan travels: log -> chunk staging -> region.

    The plan is held as runs: pages of one record whose rows and page ids both
    follow on (a base is a few runs, whatever its page count), so laying out a
    restore costs per run, not per page; the per-page tables the scatter
    kernel reads are expanded from the runs where they are used (`page_tables`,
    on the device for the device pipeline).

    Pages are ordered by chunk, then region, then log offset; chunk c holds
    pages [page_lo[c], page_lo[c + 1]), its copies are copies[c] (rows of
    log offset, bytes, staging offset) and it uses used[c] staging bytes."""

    regions: list                  # RegionPlan, in the order run_region refers to
    chunk_bytes: int
    run_region: np.ndarray         # int32 per run
    run_id: np.ndarray             # int64 per run: its first page id
    run_crc: np.ndarray            # int64 per run: its first page's index into `crc_table`
    run_stage: np.ndarray          # int64 per run: its first page's offset within its chunk
    run_pb: np.ndarray             # int64 per run: its region's page bytes
    run_count: np.ndarray          # int64 per run: its pages
    run_source: np.ndarray         # int64 per run: index into `sources` (for naming a bad page)
    crc_table: np.ndarray          # uint32: the stored CRC tables of the records read, one after another
    sources: list                  # (region name, Source)
    page_lo: np.ndarray            # int64 per chunk + 1
    copies: list = field(default_factory=list)
    used: list = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return len(self.copies)

    @property
    def pages(self) -> int:
        return int(self.run_count.sum())

    @property
    def bytes_copied(self) -> int:
        return int(sum(int(c[:, 1].sum()) for c in self.copies if c.size))

    def page_tables(self, xp=np) -> tuple:
        """(stage_off uint64, page_ids uint32, crcs uint32) per page, expanded
        from the runs with array module `xp`: numpy (`reference.expand_runs`),
        or cupy, where the runs and CRC tables go over and one kernel expands
        them on the device (`gpu.expand_runs`, its twin)."""
        args = (self.run_first, self.run_stage, self.run_pb, self.run_id, self.run_crc, self.crc_table, self.pages)
        if xp is np:
            from concordia.gpu_kernels import reference as ref

            return ref.expand_runs(*args)
        from concordia.gpu_kernels import gpu

        return gpu.expand_runs(*args, page_bytes=self.regions[int(self.run_region[0])].region.page_bytes
                               if self.pages else 64)

    @functools.cached_property
    def run_first(self) -> np.ndarray:
        """int64 per run: the index of its first page."""
        return np.cumsum(self.run_count) - self.run_count

    def run_of(self, k: int) -> tuple[int, int]:
        """(run, page within it) of page k."""
        r = int(np.searchsorted(self.run_first, k, side="right")) - 1
        return r, k - int(self.run_first[r])

    def region_slices(self, c: int):
        """(region index, lo, hi) page ranges of chunk c, one per region in it."""
        lo, hi = int(self.page_lo[c]), int(self.page_lo[c + 1])
        if lo == hi:
            return []
        first = self.run_first
        r0, r1 = np.searchsorted(first, [lo, hi])  # the runs of the chunk (no run crosses a chunk's end)
        ri = self.run_region[r0:r1]
        cut = np.flatnonzero(ri[1:] != ri[:-1]) + 1
        starts = np.concatenate(([0], cut)) + r0
        ends = np.append(starts[1:], r1)
        at = np.append(first, hi)
        return [(int(self.run_region[s]), int(at[s]), int(at[e])) for s, e in zip(starts, ends)]


def _runs(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Indices where a run of a source starts: its rows and page ids both step
    by one within a run (a record taken whole, `planner.ascending`, is one run
    that `transfer_plan` lays out without asking)."""
    if rows.size < 2:
        return np.zeros(rows.size, np.int64)
    brk = (np.diff(rows) != 1) | (np.diff(ids) != 1)
    return np.concatenate(([0], np.flatnonzero(brk) + 1))


def _span(a: np.ndarray) -> tuple[int, int]:
    """(least, greatest) of a source's rows or page ids; ends only, for `planner.ascending`'s."""
    from concordia.wal.planner import is_ascending

    return (int(a[0]), int(a[-1])) if is_ascending(a) else (int(a.min()), int(a.max()))


def _chunk_starts(first, first_end, pos, pb, cnt, n: int, chunk_bytes: int) -> np.ndarray:
    """The first page of each chunk and n after the last (`transfer_plan`):
    greedy, two searches over the runs a chunk.  Over a few runs (regions
    restored whole) the searches are Python's `bisect` on lists: numpy's
    searchsorted lets go of the GIL at every call, and beside a thread running
    Python (a read ahead beside a model's build, `concordia.prefetch`) each
    call waits up to a switch interval to get it back: a 30 GB restore in 32 MiB
    chunks made 1,800 of them (its layout took 4.3 s beside the build, 0.15 s
    alone on an H100)."""
    if first.size <= LIST_SEARCH_RUNS:
        first, first_end, pos, pb, cnt = (a.tolist() for a in (first, first_end, pos, pb, cnt))
        right = bisect.bisect_right
    else:
        def right(a, x):
            return int(np.searchsorted(a, x, side="right"))
    page_lo = [0]
    while page_lo[-1] < n:
        p0 = page_lo[-1]
        q = right(first, p0) - 1
        limit = int(pos[q] + (p0 - first[q]) * pb[q]) + chunk_bytes
        j = right(first_end, limit) - 1  # the last run whose first page fits
        fit = int(first[j]) + min(int(cnt[j]), (limit - int(pos[j])) // int(pb[j])) if j >= 0 else 0
        page_lo.append(max(fit, p0 + 1))
    return np.asarray(page_lo, np.int64)


def transfer_plan(log, plan, *, regions=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Transfer:
    """Lay out every page `plan` reads into staging chunks (see the module doc)."""
    from concordia.gpu_kernels import reference as ref
    from concordia.wal.apply import check_source
    from concordia.wal.planner import is_ascending

    rps = [rp for name, rp in plan.regions.items() if regions is None or name in regions]
    # per run: region, log offset, page id, row, page bytes, pages, source; rows and ids checked per source
    keys = ("region", "off", "id", "crc", "pb", "count", "source")
    cols = {k: [] for k in keys}
    # a source that takes a record whole (`planner.ascending` rows and ids) is one run:
    # its figures as numbers, not arrays (a KV base of 256-byte pages has thousands)
    whole = {k: [] for k in keys}
    tables, srcs, table_at = [], [], 0
    for i, rp in enumerate(rps):
        pb = rp.region.page_bytes
        chunk_bytes = max(chunk_bytes, pb)
        for s in rp.sources:
            count = int(s.batch.page_ids.size)
            base = s.batch.offset + ref.payload_offset(count)
            rows, ids = s.rows, s.page_ids
            if rows.size and rows.size == ids.size and is_ascending(rows) and is_ascending(ids):
                r_lo, i_lo, n = int(rows[0]), int(ids[0]), int(rows.size)
                if r_lo + n > count or i_lo + n > rp.pages:
                    check_source(s.batch, rows, ids, rp.pages)  # names the bad source as the host applier does
                for k, v in zip(keys, (i, base + r_lo * pb, i_lo, table_at + r_lo, pb, n, len(srcs))):
                    whole[k].append(v)
            else:
                rows = np.asarray(rows, np.int64)
                ids = np.asarray(ids, np.int64)
                (r_lo, r_hi), (i_lo, i_hi) = ((_span(rows), _span(ids)) if rows.size and rows.size == ids.size
                                              else ((0, -1), (0, -1)))
                if rows.size != ids.size or r_lo < 0 or r_hi >= count or i_lo < 0 or i_hi >= rp.pages:
                    check_source(s.batch, rows, ids, rp.pages)  # names the bad source as the host applier does
                st = _runs(rows, ids)
                cols["region"].append(np.full(st.size, i, np.int64))
                cols["off"].append(base + rows[st] * pb)
                cols["id"].append(ids[st])
                cols["crc"].append(table_at + rows[st])
                cols["pb"].append(np.full(st.size, pb, np.int64))
                cols["count"].append(np.diff(np.append(st, rows.size)))
                cols["source"].append(np.full(st.size, len(srcs), np.int64))
            tables.append(np.asarray(s.batch.page_crcs, np.uint32))
            table_at += count
            srcs.append((rp.name, s))
    r = {k: np.concatenate(v + [np.asarray(whole[k], np.int64)]).astype(np.int64) for k, v in cols.items()}
    # one copy that keeps the GIL (np.concatenate lets go of it for each table, and beside a busy
    # thread each waits up to a switch interval to get it back: a 30 GB log's tables are hundreds)
    crc_table = np.frombuffer(b"".join([memoryview(np.ascontiguousarray(t)).cast("B") for t in tables]), np.uint32)
    order = np.argsort(r["off"], kind="stable")
    r = {k: v[order] for k, v in r.items()}
    off, pb, cnt = r["off"], r["pb"], r["count"]
    R = off.size
    if R == 0:
        z = np.zeros(0, np.int64)
        return Transfer(regions=rps, chunk_bytes=int(chunk_bytes), run_region=z.astype(np.int32), run_id=z,
                        run_crc=z, run_stage=z, run_pb=z, run_count=z, run_source=z, crc_table=crc_table,
                        sources=srcs, page_lo=np.zeros(1, np.int64))
    ln = cnt * pb  # bytes of each run
    # A run continues the copy of the one before it when it starts at most
    # MERGE_GAP bytes after that one ends (and never overlaps it); runs not
    # 16-byte aligned in the log each start their own copy.
    new = np.ones(R, bool)
    if R > 1:
        gap = off[1:] - (off[:-1] + ln[:-1])
        new[1:] = (gap < 0) | (gap > MERGE_GAP) | (off[1:] % 16 != 0)
    # Positions in one virtual staging stream: copies back to back, each from
    # a STAGE_ALIGN boundary; inside a copy the log layout is kept.
    copy_id = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], R)
    copy_lo = off[starts]
    copy_len = off[ends - 1] + ln[ends - 1] - copy_lo
    slot = -(-copy_len // STAGE_ALIGN) * STAGE_ALIGN
    copy_pos = np.cumsum(slot) - slot
    pos = copy_pos[copy_id] + (off - copy_lo[copy_id])  # of each run's first page
    # Chunks: greedy over pages; a chunk starting at page p0 holds the pages
    # whose stream end lies within chunk_bytes of p0's position (one search per
    # chunk, over the runs: within a run the pages' ends step by its page bytes).
    first = np.cumsum(cnt) - cnt  # each run's first page
    n = int(cnt.sum())
    first_end = pos + pb
    page_lo = _chunk_starts(first, first_end, pos, pb, cnt, n, chunk_bytes)
    # runs cut where a chunk begins inside them
    cuts = page_lo[1:-1]
    # (sorted arrays both: searches, not np.isin or np.unique, whose first call imports numpy.ma, 0.08 s)
    at = np.minimum(np.searchsorted(first, cuts), first.size - 1)
    cuts = cuts[first[at] != cuts]
    if cuts.size:
        rr = np.searchsorted(first, cuts, side="right") - 1  # the run each cut falls in
        k = cuts - first[rr]
        # each piece runs to the next cut in its run, or to the run's end; the head keeps its start
        later = np.append(rr[1:] == rr[:-1], False)
        tail = {"region": r["region"][rr], "off": off[rr] + k * pb[rr], "id": r["id"][rr] + k,
                "crc": r["crc"][rr] + k, "pb": pb[rr], "source": r["source"][rr],
                "count": np.where(later, np.append(cuts[1:], 0), first[rr] + cnt[rr]) - cuts}
        head = rr[np.append(True, rr[1:] != rr[:-1])]   # rr ascends: its distinct runs
        cnt = cnt.copy()
        cnt[head] = cuts[np.searchsorted(rr, head)] - first[head]
        r["count"] = cnt
        r = {key: np.insert(v, rr + 1, tail[key]) for key, v in r.items()}
        new = np.insert(new, rr + 1, True)
        off, pb, cnt = r["off"], r["pb"], r["count"]
        R = off.size
        first = np.cumsum(cnt) - cnt
    ln = cnt * pb
    chunk_of = np.searchsorted(page_lo, first, side="right") - 1  # per run
    starts_c = np.zeros(R, bool)
    starts_c[np.searchsorted(first, page_lo[:-1])] = True
    fresh = new | starts_c  # runs that start a copy: a new copy, or a chunk's first run
    cs = np.flatnonzero(fresh)
    ce = np.append(cs[1:], R)
    lo = off[cs]
    clen = off[ce - 1] + ln[ce - 1] - lo
    cslot = -(-clen // STAGE_ALIGN) * STAGE_ALIGN
    ahead = np.cumsum(cslot) - cslot  # staging bytes before each copy, counted from the first chunk
    chunk_copy0 = np.searchsorted(cs, np.searchsorted(first, page_lo[:-1]))  # each chunk's first copy
    cpos = ahead - ahead[chunk_copy0][chunk_of[cs]]
    kc = np.cumsum(fresh) - 1  # the copy of each run
    stage = cpos[kc] + (off - lo[kc])
    table = np.stack([lo, clen, cpos], axis=1).astype(np.int64)
    copies = np.split(table, chunk_copy0[1:])
    last = np.append(chunk_copy0[1:], cs.size) - 1
    used = (cpos[last] + clen[last]).tolist()
    # within each chunk: runs grouped by region (one scatter launch per region), log order kept
    regroup = np.lexsort((np.arange(R), r["region"], chunk_of))
    g = {key: v[regroup] for key, v in r.items()}
    return Transfer(regions=rps, chunk_bytes=int(chunk_bytes), run_region=g["region"].astype(np.int32),
                    run_id=g["id"], run_crc=g["crc"], run_stage=stage[regroup], run_pb=g["pb"],
                    run_count=g["count"], run_source=g["source"], crc_table=crc_table, sources=srcs,
                    page_lo=page_lo, copies=copies, used=used)


# --- host side: filling a staging buffer from the log -----------------------


def _source_of(log):
    """(fd, array, owned) to read log bytes from: a descriptor of the file the
    log maps, when it is a regular file (shm, file, pmem tiers: `preadv` then
    copies from the page cache without faulting the mapping in), else None and
    the mapping itself.  owned: the caller closes fd."""
    from concordia.devmem.tiers import FileBackedBackend

    backend = log.backend
    # a fault-injecting image or a memory tier has no file whose bytes are the mapping's
    path = (backend.path if isinstance(backend, FileBackedBackend) and backend.kind != "devdax"
            and hasattr(os, "preadv") else None)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None, backend.array, False
        if os.fstat(fd).st_size >= backend.size:
            return fd, backend.array, True
        os.close(fd)
    return None, backend.array, False


def _pieces(copies: np.ndarray):
    """Split a chunk's copies into pieces of at most PIECE_BYTES."""
    out = []
    for lo, n, at in copies.tolist():
        for k in range(0, n, PIECE_BYTES):
            m = min(PIECE_BYTES, n - k)
            out.append((lo + k, m, at + k))
    return out


def _read_piece(fd, arr, host: np.ndarray, lo: int, n: int, at: int) -> None:
    dst = host[at:at + n]
    if fd is None:
        np.copyto(dst, arr[lo:lo + n])
        return
    mv = memoryview(dst)
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[done:]], lo + done)
        if got <= 0:
            from concordia.wal.errors import WalError

            raise WalError(f"the log ended at 0x{lo + done:x} while reading {n} bytes from 0x{lo:x}",
                           hint="the log was truncated after it was opened")
        done += got


_POOLS: dict = {}  # threads -> ThreadPoolExecutor


def _pool(threads: int | None = None):
    n = threads or COPY_THREADS
    if n not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor

        _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="concordia-restore")
    return _POOLS[n]


def _fill(fd, arr, host: np.ndarray, copies: np.ndarray, threads: int | None = None) -> list:
    """Queue the reads that fill `host` with one chunk on `threads` reader
    threads (default COPY_THREADS); returns their futures."""
    pool = _pool(threads)
    return [pool.submit(_read_piece, fd, arr, host, lo, n, at) for lo, n, at in _pieces(copies)]


def _wait(futures) -> None:
    for f in futures:
        f.result()


# --- the numpy twin -------------------------------------------------------------


def apply_transfer_numpy(log, tr: Transfer, into: dict | None = None) -> dict:
    """Run transfer plan `tr` on the host: each chunk read into one staging
    buffer exactly as the device path reads it, its pages checked and applied
    by the numpy twin of the scatter kernel.  Returns {name: array}; raises
    CorruptionError on the first mismatching page.  (Digests are left to the
    caller; `wal.apply` checks them for the host path proper.)  into: {name:
    numpy array of the region's layout} restored in place, as `restore`'s
    device targets are: staged in new arrays and copied over only once every
    page has checked out, so damage leaves them as they were."""
    fd, arr, owned = _source_of(log)
    try:
        return _apply_transfer_numpy(tr, fd, arr, into or {})
    finally:
        if owned:
            os.close(fd)


def _apply_transfer_numpy(tr: Transfer, fd, arr, into: dict) -> dict:
    from concordia.gpu_kernels import reference as ref

    out = {rp.name: np.zeros(rp.region.pages * rp.region.page_bytes, np.uint8) for rp in tr.regions}
    host = np.empty(tr.chunk_bytes + 4096, np.uint8)
    stage_off, page_ids, crcs = tr.page_tables(np)
    for c in range(tr.chunks):
        _wait(_fill(fd, arr, host, tr.copies[c]))
        for i, lo, hi in tr.region_slices(c):
            rp = tr.regions[i]
            bad = ref.scatter_pages(host, stage_off[lo:hi], page_ids[lo:hi], out[rp.name],
                                    page_bytes=rp.region.page_bytes, expected_crcs=crcs[lo:hi])
            if bad.size:
                k = lo + int(bad[0])
                at = int(stage_off[k])
                raise _bad_page(tr, k, host[at:at + rp.region.page_bytes])
    for name, a in into.items():   # every page checked out: now the targets
        a.reshape(-1).view(np.uint8)[...] = out[name][:a.nbytes]
    return {rp.name: into[rp.name] if rp.name in into else
            out[rp.name][:rp.region.nbytes].view(np.dtype(rp.region.dtype)).reshape(rp.region.shape)
            for rp in tr.regions}


def _page_of(tr: Transfer, k: int):
    """(region name, source, row in its record, page id, page bytes) of page k."""
    r, j = tr.run_of(k)
    name, src = tr.sources[int(tr.run_source[r])]
    pid = int(tr.run_id[r]) + j
    row = int(np.asarray(src.rows)[np.flatnonzero(np.asarray(src.page_ids) == pid)[0]])
    return name, src, row, pid, tr.regions[int(tr.run_region[r])].region.page_bytes


def _bad_page(tr: Transfer, k: int, page: np.ndarray):
    """The host applier's diagnostic (`wal.apply.bad_page`: the same words at
    the same offset) for page k of the transfer, whose bytes as read from the
    log are `page`."""
    from crc32c import crc32c

    from concordia.wal.apply import bad_page

    name, src, row, pid, pb = _page_of(tr, k)
    r, j = tr.run_of(k)
    return bad_page(name, src.batch, row, pid, pb, int(tr.crc_table[int(tr.run_crc[r]) + j]),
                    crc32c(np.ascontiguousarray(page).data))


def _bad_page_in_log(log, tr: Transfer, k: int):
    """`_bad_page` for page k found bad on the device: its bytes read again
    from the log on the host (the staging slots it passed through are reused)."""
    from concordia.wal.apply import page_offset

    _, src, row, _, pb = _page_of(tr, k)
    page = np.empty(pb, np.uint8)
    fd, arr, owned = _source_of(log)
    try:
        _wait(_fill(fd, arr, page, np.array([[page_offset(src.batch, row, pb), pb, 0]], np.int64)))
    finally:
        if owned:
            os.close(fd)
    return _bad_page(tr, k, page)


# --- the device pipeline --------------------------------------------------------

_STAGING: dict = {}
_HOSTS: dict = {}
#: the slots, streams and pinned buffers above are one set a process: one pipeline runs at a time (a read
#: ahead's thread, `restore.ahead`, beside another session's recovery would share them)
_PIPELINE = threading.RLock()


def _one_at_a_time(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _PIPELINE:
            return fn(*args, **kwargs)
    return run


def _staging(cp, chunk_bytes: int):
    """Device slots and two streams for chunks of `chunk_bytes`, kept between
    restores."""
    key = (cp.cuda.Device().id, chunk_bytes)
    if key not in _STAGING:
        _STAGING.clear()
        size = chunk_bytes + 4096
        slots = [cp.empty(size, cp.uint8) for _ in range(DEVICE_SLOTS)]
        _STAGING[key] = (slots, cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True))
    return _STAGING[key]


def _host_buffers(cp, chunk_bytes: int) -> list:
    """Pinned host buffers for chunks of `chunk_bytes`, kept between restores;
    only a restore the host reads for asks for them (one the copy engine reads
    from the mapping does not).  Each is CUDA's own pinned allocation, which
    took 37 ms for each 32 MiB buffer in a fresh process on the H200 machine
    (0.15 s of a 1 GiB restore), or with HOST_BUFFER_HOW = "register"
    anonymous memory pinned by cudaHostRegister (`_RegisteredBuffer`; CUDA's
    allocation where the driver refuses)."""
    if HOST_BUFFER_HOW not in ("register", "alloc"):
        from concordia.wal.errors import UsageError

        raise UsageError(f"CONCORDIA_HOST_BUFFERS={HOST_BUFFER_HOW!r} is neither register nor alloc",
                         where="the environment")
    key = (cp.cuda.Device().id, chunk_bytes, HOST_BUFFER_HOW)
    if key not in _HOSTS:
        _HOSTS.clear()
        size = chunk_bytes + 4096
        hosts = []
        how = HOST_BUFFER_HOW
        for _ in range(HOST_BUFFERS):
            if how == "register":
                try:
                    buf = _RegisteredBuffer(size)
                    hosts.append((buf.array, buf))
                    continue
                except ConcordiaError:   # the driver will not register host memory here: CUDA allocates it
                    how = "alloc"
            mem = cp.cuda.alloc_pinned_memory(size)
            hosts.append((np.frombuffer(mem, np.uint8, size), mem))
        _HOSTS[key] = hosts
    return _HOSTS[key]


class _RegisteredBuffer:
    """`size` bytes of anonymous memory pinned with cudaHostRegister (mapped,
    portable), unpinned when dropped."""

    def __init__(self, size: int):
        import mmap

        from concordia.devmem import cuda_host

        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_DONTFORK"):   # a forked child never shares these pages copy-on-write
            self.mapping.madvise(mmap.MADV_DONTFORK)
        self.array = np.frombuffer(self.mapping, np.uint8, size)
        addr = self.array.ctypes.data
        cuda_host.pin(addr, size, where="a restore's host buffer")
        weakref.finalize(self, cuda_host.unpin, addr).atexit = False


def _direct_source(log, registration, st):
    """Device-visible address of the log's byte 0 when the copy engine can read
    the mapping itself: a registration the caller keeps (a live session's) or a
    pinned tier.  None otherwise (then the host reads the log into pinned
    buffers: registering a whole log at recovery pins every page, ~0.25 s/GiB)."""
    if registration is not None:
        return registration.device_ptr, None
    if log.backend.kind == "pinned":
        from concordia.devmem import cuda_host

        t0 = time.perf_counter()
        try:
            reg = cuda_host.register(log.backend)
        except ConcordiaError:
            return None, None
        st["register_s"] = time.perf_counter() - t0
        return reg.device_ptr, reg
    return None, None


class _PinRefused(Exception):
    """The driver would not pin a piece of the mapping (a page-cache file, a
    read-only mapping on an old driver): the restore copies instead."""


def pieces_read(tr: Transfer, piece: int) -> tuple[list, list]:
    """(the pieces of `piece` bytes each chunk of `tr` reads, sorted; every
    piece once, in the order the chunks first read them)."""
    per_chunk, order, seen = [], [], set()
    for c in range(tr.chunks):
        ks = set()
        for lo, n, _ in tr.copies[c].tolist():
            ks.update(range(lo // piece, (lo + n - 1) // piece + 1))
        per_chunk.append(sorted(ks))
        for k in per_chunk[-1]:
            if k not in seen:
                seen.add(k)
                order.append(k)
    return per_chunk, order


def piece_bytes(backend, k: int, piece: int) -> int:
    """Bytes of piece k of `backend`'s mapping (the last may be short)."""
    return min(piece, backend.size - k * piece)


def bytes_to_pin(backend, pieces: list, piece: int) -> int:
    """Bytes a restore reading `pieces` (`pieces_read`'s order) would pin: those not kept pinned already."""
    from concordia.devmem import cuda_host

    kept = cuda_host.kept_pins(backend)
    sizes = ((backend.address + k * piece, piece_bytes(backend, k, piece)) for k in pieces)
    return sum(n for addr, n in sizes if kept.get(addr) != n)


#: mappings whose pieces the driver would not pin: their restores copy from then on
_PIN_REFUSED = weakref.WeakSet()


def _filled_by(fd) -> str:
    """The `via` of a restore that reads the log into pinned buffers (`_source_of`'s fd, or its array)."""
    return f"pinned buffers filled by {'preadv' if fd is not None else 'memory copies'}"


class _RegisterAhead:
    """Pin the pieces of the log mapping a transfer reads, on a pool of threads,
    in the order the pipeline needs them, so the copy engine reads the log
    itself while later pieces are still being pinned.  Pinning a whole log
    first costs ~0.2-0.4 s/GiB on one thread before the first byte moves;
    pieces in parallel overlap it with the transfer.  The pieces stay pinned
    with the mapping (`cuda_host.keep_pinned`: given back when the log closes),
    and a piece an earlier restore pinned is not pinned again."""

    def __init__(self, cp, backend, pieces: tuple, piece: int):
        """pieces: `pieces_read(tr, piece)` of the transfer."""
        from concurrent.futures import Future, ThreadPoolExecutor

        from concordia.devmem import cuda_host

        self.cp = cp
        self.backend = backend
        self.read_only = bool(backend.readonly)
        self.device = cp.cuda.Device().id
        self.piece = piece
        kept = cuda_host.kept_pins(backend)
        self.per_chunk, order = pieces
        self.done = {}
        for k in order:
            if kept.get(backend.address + k * piece) == piece_bytes(backend, k, piece):
                self.done[k] = Future()
                self.done[k].set_result(k)
        self.kept = len(self.done)
        self.pool = ThreadPoolExecutor(max_workers=REGISTER_THREADS, thread_name_prefix="concordia-register")
        self.done.update({k: self.pool.submit(self._register, k) for k in order if k not in self.done})
        self.wait_s = 0.0

    def _register(self, k: int) -> int:
        from concordia.devmem import cuda_host

        self.cp.cuda.Device(self.device).use()
        addr, n = self.backend.address + k * self.piece, piece_bytes(self.backend, k, self.piece)
        cuda_host.pin(addr, n, read_only=self.read_only, where=f"log piece @ {k * self.piece:#x}")
        cuda_host.keep_pinned(self.backend, addr, n)
        return k

    def ready(self, c: int) -> None:
        """Block until every piece chunk c reads is pinned (raises what pinning raised)."""
        t0 = time.perf_counter()
        for k in self.per_chunk[c]:
            try:
                self.done[k].result()
            except Exception as exc:
                raise _PinRefused(f"{type(exc).__name__}: {exc}") from exc
        self.wait_s += time.perf_counter() - t0

    def close(self) -> float:
        """Stop pinning: pieces not started are left, those started end (kept
        pinned with the mapping); returns the seconds it took."""
        t0 = time.perf_counter()
        for f in self.done.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        return time.perf_counter() - t0


def pins_ahead(backend, read: str, nbytes: int | None = None) -> bool:
    """Whether a restore without a live registration pins the log's mapping in
    pieces ahead of the copy engine (`_RegisterAhead`) rather than copying it
    into pinned buffers on host threads.  read="pin" asks for it on any
    mapping CUDA can pin; read="auto" takes it for device DAX in huge pages
    (not measured on a GPU yet), not for hugetlbfs files, whose 10 GiB restore
    was bound by pinning (0.47 s of transfer on an H100, against 0.24-0.26 s
    copying, docs/results/recovery.md), nor for 4 KiB-page mappings (/dev/shm
    pinned at ~13 GB/s, copied at 42); and for a restore
    that would pin at most PIN_SMALL_BYTES (`nbytes`: the pieces it reads not
    pinned already, `bytes_to_pin`) on any mapping CUDA can pin, which spares
    it the pinned host buffers (HOST_BUFFERS of a chunk: 128 MiB, which took
    0.09-0.15 s to allocate with cudaHostAlloc in a fresh process on the H200
    machine, for a restore whose copy takes 0.03 s).  CONCORDIA_RESTORE_READ
    ("pin" or "copy", READ_LARGE) names the way of a larger read="auto"
    restore on any mapping CUDA can pin, where it is set."""
    if not backend.gpu_mappable or read == "copy":
        return False
    if PIN_SMALL_BYTES is None:   # the environment named no whole number of bytes
        from concordia.wal.errors import UsageError

        raise UsageError(f"CONCORDIA_PIN_SMALL_BYTES={os.environ.get('CONCORDIA_PIN_SMALL_BYTES')!r} is not a "
                         "whole number of bytes", where="the environment")
    if read == "pin" or (nbytes is not None and nbytes <= PIN_SMALL_BYTES):
        return True
    if READ_LARGE:   # CONCORDIA_RESTORE_READ names the way of a large restore
        if READ_LARGE not in ("pin", "copy"):
            from concordia.wal.errors import UsageError

            raise UsageError(f"CONCORDIA_RESTORE_READ={READ_LARGE!r} is neither pin nor copy",
                             where="the environment")
        return READ_LARGE == "pin"
    # hugetlb copies: pinning 10 GiB of it held the transfer to 0.47 s, copying took 0.24-0.26 s
    # (H100, docs/results/recovery.md, twenty-second section); device DAX is not measured yet
    return backend.kind == "devdax" and backend.alignment >= 2 << 20


def register_piece(backend) -> int:
    """Bytes pinned per piece: REGISTER_PIECE, a whole number of the mapping's
    pages (a 1 GiB-page hugetlbfs pins a page at a time)."""
    a = max(4096, int(backend.alignment))
    return max(a, REGISTER_PIECE // a * a)


#: cudaErrorMemoryAllocation (CuPy's runtime module names no such constant)
CUDA_ERROR_MEMORY_ALLOCATION = 2


#: where each array of one block of memory of their own starts (a multiple of this): the page
#: kernels read 16 bytes at a time, and CuPy's pool aligns its blocks to 512
OWN_ALIGN = 512


#: cudaDevAttrMemoryPoolsSupported: the device allocates in stream order (cudaMallocAsync)
MEMORY_POOLS_SUPPORTED = 115


class OwnBlock:
    """One block of device memory of a restore's own (`_zeroed_arrays`),
    given back to the driver once every array carved from it is dropped.
    Allocated in stream order (cudaMallocAsync, `in_order`) where the device
    has memory pools and its pool gives freed memory back to the driver at
    the next synchronisation (a release threshold of 0, CUDA's default), so
    that it can be freed in stream order too: behind the reads of it queued
    last on the stream `free_after` names (`restore.run.into_targets`' copies
    into the targets), without a host wait for them, where cudaFree waits
    for all of the device's work.  Else, and where no such stream was named
    (arrays of it handed to a caller, a restore that failed midway), it is
    freed after the device's work, as cudaFree frees cudaMalloc's memory
    (cudaFree does not wait for the reads of cudaMallocAsync's: the device
    is synchronised first)."""

    def __init__(self, cp, nbytes: int, stream):
        rt = cp.cuda.runtime
        self.rt, self.ptr, self.stream, self.device = rt, 0, None, cp.cuda.Device().id
        self.in_order = _frees_in_order(rt, self.device)
        self.ptr = rt.mallocAsync(nbytes, stream.ptr) if self.in_order else rt.malloc(nbytes)

    def free_after(self, stream) -> bool:
        """Free it on `stream`, behind the work queued there; False where it
        was not allocated in stream order.  The caller vouches that every
        other use of the whole block has ended or is queued there too: the
        restore that wrote it waited for its own streams, and `ReadAhead.take`
        copies what it hands over on the same stream before the block goes."""
        if self.in_order:
            self.stream = stream
        return self.in_order

    def __del__(self):
        if not self.ptr:
            return
        ptr, self.ptr = self.ptr, 0
        try:
            if self.stream is not None:
                self.rt.freeAsync(ptr, self.stream.ptr)
                return
            if self.in_order:
                here = self.rt.getDevice()
                self.rt.setDevice(self.device)
                try:
                    self.rt.deviceSynchronize()
                finally:
                    self.rt.setDevice(here)
            self.rt.free(ptr)   # (cudaMalloc's memory: cudaFree waits for the device's work itself)
        except Exception:   # a device already in an error state, or the interpreter's exit
            pass


#: cudaMemPoolAttrReleaseThreshold: the bytes a memory pool keeps from the driver past a synchronisation
POOL_RELEASE_THRESHOLD = 4


def _frees_in_order(rt, device: int) -> bool:
    """Whether a block on `device` is allocated and freed in stream order:
    the device has memory pools, and the pool cudaMallocAsync takes from
    gives freed memory back to the driver (a threshold of 0, unless another
    library raised it); else cudaMalloc and cudaFree, as before."""
    try:
        if not rt.deviceGetAttribute(MEMORY_POOLS_SUPPORTED, device):
            return False
        pool = rt.deviceGetMemPool(device)
        return int(rt.memPoolGetAttribute(pool, POOL_RELEASE_THRESHOLD)) == 0
    except Exception:   # a CuPy without these calls, or a driver that refuses them: the old way
        return False


def free_after(arrays, stream) -> bool:
    """Free the blocks of their own (`OwnBlock`) of `arrays` on `stream`,
    behind the reads of them queued there; False where one has memory of
    another kind, which the caller waits for before dropping it.  An empty
    array reads nothing (and comes from CuPy's pool)."""
    ok = True
    for a in arrays:
        if not a.nbytes:
            continue
        owner = getattr(a.data.mem, "_owner", None)
        ok = isinstance(owner, OwnBlock) and owner.free_after(stream) and ok
    return ok


def _zeroed_arrays(cp, gpu, sizes: list, own: list) -> list:
    """Zeroed uint8 device arrays of `sizes` bytes: from CuPy's pool, or, where
    `own` says so, carved from one block of memory of their own from the
    driver (`OwnBlock`), freed once every array of it is dropped (one free,
    not one an array: a recovery that copies 173 arrays into its targets and
    drops them paid 3 ms of frees, on an H100).  When the driver has no
    room, the pool's free blocks are given back first, as the pool itself
    does."""
    out = [None if o and n else cp.zeros(n, cp.uint8) for n, o in zip(sizes, own)]
    starts, total = [], 0
    for n, o in zip(sizes, own):
        starts.append(total)
        if o and n:
            total += -(-int(n) // OWN_ALIGN) * OWN_ALIGN
    if not total:
        return out
    rt, pool, stream = cp.cuda.runtime, cp.get_default_memory_pool(), cp.cuda.get_current_stream()
    try:
        mem = OwnBlock(cp, total, stream)
    except rt.CUDARuntimeError as exc:  # the driver's malloc: no pool retry of its own
        if exc.status != CUDA_ERROR_MEMORY_ALLOCATION:
            raise
        pool.free_all_blocks()
        try:
            mem = OwnBlock(cp, total, stream)
        except rt.CUDARuntimeError as again:  # the pool's own words for it, as cp.zeros would say
            if again.status != CUDA_ERROR_MEMORY_ALLOCATION:
                raise
            raise cp.cuda.memory.OutOfMemoryError(total, pool.total_bytes(), 0) from None
    # (the caller waits for this stream before any other uses the arrays)
    rt.memsetAsync(mem.ptr, 0, total, stream.ptr)
    for i, (n, o) in enumerate(zip(sizes, own)):
        if o and n:
            out[i] = gpu.device_buffer(mem.ptr + starts[i], n, mem)
    return out


def checked_arrays(tr: Transfer, out: list) -> dict:
    """{name: array of the region's dtype and shape} of the arrays `out` (one a
    region of `tr`, every page whole) once each region's digest matches its
    commit (CorruptionError naming the region otherwise).  Device arrays'
    digests are computed on the device and read back together (one
    synchronisation, not one a region); numpy arrays' by the kernels' twins."""
    from concordia.wal.apply import check_digest

    flats = [dst[:rp.region.nbytes] for rp, dst in zip(tr.regions, out)]
    checked = [(rp, flat) for rp, flat in zip(tr.regions, flats) if rp.digest is not None]
    if all(isinstance(flat, np.ndarray) for _, flat in checked):
        from concordia.gpu_kernels import reference as ref

        digests = [ref.region_digest(ref.crc32c_pages(flat, page_bytes=rp.region.page_bytes)) for rp, flat in checked]
    else:
        from concordia.gpu_kernels import gpu

        digests = gpu.region_digests([gpu.crc32c_pages(flat, page_bytes=rp.region.page_bytes)
                                      for rp, flat in checked])
    for (rp, _), digest in zip(checked, digests):   # the host applier's check, on the device's digest
        check_digest(rp.name, rp.epoch, rp.digest, digest)
    return {rp.name: flat.view(np.dtype(rp.region.dtype)).reshape(rp.region.shape)
            for rp, flat in zip(tr.regions, flats)}


@_one_at_a_time
def apply_plan_cupy(log, plan, *, regions=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, stats: dict | None = None,
                    registration=None, read: str = "auto", own_memory=()) -> dict:
    """Restore the regions of `plan` straight into new CuPy arrays (see the
    module doc for the pipeline; `restore.run.restore` copies them into a
    caller's targets once everything checked out).  The restore runs on
    CuPy's current stream and the pipeline's own, after what the current
    stream holds at the call.  Every page's CRC32C is checked on the device
    before it is applied and each region's digest is recomputed on the device
    and compared with its commit; any mismatch raises CorruptionError naming the
    page and its record.
    `stats`, when given, receives seconds per stage (layout_s, register_s,
    staging_alloc_s, scatter_s: the whole pipeline including staging_alloc_s,
    verify_s), the path taken (`via`) and counts.
    `registration`: the mapping's live registration (a session's checkpoint
    path keeps one), read by the copy engine directly and left registered.
    read: how the log reaches the device without such a registration:
    "copy" reads it into pinned buffers on host threads (preadv); "pin" pins
    the pieces of the mapping the plan reads, ahead of the copy engine, on
    several threads (shm and other mappings CUDA can pin), falling back to
    "copy" where the driver refuses; "auto" pins ahead for device DAX in
    huge pages and for restores of at most PIN_SMALL_BYTES, and copies
    otherwise (`pins_ahead`): copying 10 GiB was measured faster from
    /dev/shm (H200) and from hugetlbfs (H100) (docs/results/recover.md,
    recovery.md).
    own_memory: the names of regions whose arrays get memory of their own
    from the driver, not from CuPy's pool: one block for them all, given back
    to the driver once every one of them is dropped (a caller that copies
    them into its targets and drops them: a pool's block shared with a later
    allocation could not be given back)."""
    from concordia.gpu_kernels import gpu, jit
    from concordia.wal.apply import check_present

    cp = jit.require_cupy()  # one line naming why, where CuPy or CUDA is missing
    check_present(plan, regions)  # a region with no state at the epoch: refused, never zeroed on the device

    st = stats if stats is not None else {}
    st.update(register_s=0.0, scatter_s=0.0, verify_s=0.0, via="")
    t0 = time.perf_counter()
    tr = transfer_plan(log, plan, regions=regions, chunk_bytes=chunk_bytes)
    st["layout_s"] = time.perf_counter() - t0
    st.update(chunks=tr.chunks, pages=tr.pages, bytes_copied=tr.bytes_copied)
    if read not in ("auto", "pin", "copy"):
        from concordia.wal.errors import UsageError

        raise UsageError(f"unknown read mode {read!r} (use auto, pin or copy)", where="apply_plan_cupy")
    direct, own_reg = _direct_source(log, registration, st)
    # pieces pinned ahead of the copy engine: pinning starts once the allocations
    # below are made (their driver calls waited behind the pinning threads' before)
    piece = register_piece(log.backend)
    could = direct is None and tr.pages and read != "copy" and log.backend.gpu_mappable
    pieces = pieces_read(tr, piece) if could and log.backend not in _PIN_REFUSED else None
    pin = pieces is not None and pins_ahead(log.backend, read, bytes_to_pin(log.backend, pieces[1], piece))
    if pin:
        direct = log.backend.address
    ahead = None
    fd, arr, owned = (None, None, False) if direct is not None else _source_of(log)
    st["via"] = ("copy engine from pieces pinned ahead" if pin else
                 "copy engine from the registered mapping" if direct is not None else _filled_by(fd))
    try:
        t1 = time.perf_counter()
        slots, copy_stream, stream = _staging(cp, tr.chunk_bytes)
        hosts = _host_buffers(cp, tr.chunk_bytes) if direct is None else []
        sync = cp.cuda.get_current_stream().synchronize
        # the allocation's parts, each to its end on the device (a fresh process pays them all)
        parts = st["alloc_parts"] = {"staging": time.perf_counter() - t1}  # 0 when kept from an earlier restore
        st["staging_alloc_s"] = parts["staging"]
        t = time.perf_counter()
        out = _zeroed_arrays(cp, gpu, [rp.region.pages * rp.region.page_bytes for rp in tr.regions],
                             [rp.name in own_memory for rp in tr.regions])
        sync()
        parts["regions"] = time.perf_counter() - t
        if tr.pages:
            t = time.perf_counter()
            kernels = {rp.region.page_bytes: jit.function("scatter", "scatter_pages",
                                                          {"PAGE_BYTES": rp.region.page_bytes})
                       for rp in tr.regions}
            parts["kernels"] = time.perf_counter() - t
            t = time.perf_counter()
            offs_d, ids_d, crcs_d = tr.page_tables(cp)  # expanded from the runs on the device
            bad_d = cp.zeros(tr.pages, cp.uint8)
            sync()  # the arrays above exist before other streams use them
            parts["page_tables"] = time.perf_counter() - t
            st["alloc_s"] = time.perf_counter() - t1  # staging, zeroed regions, page tables on the device
            if pin:
                ahead = _RegisterAhead(cp, log.backend, pieces, piece)
                st["pins_kept"] = ahead.kept
            try:
                _pipeline(cp, gpu, tr, direct, fd, arr, hosts, slots, copy_stream, stream, out,
                          (offs_d, ids_d, crcs_d, bad_d), kernels, st, ahead,
                          piece=registration.piece if registration is not None else None)
            except _PinRefused as exc:
                # the driver would not pin this mapping (a page-cache file, say): copy instead
                st["pin_refused"] = str(exc)
                _PIN_REFUSED.add(log.backend)
                st["register_wait_s"], st["pin_stop_s"] = ahead.wait_s, ahead.close()
                ahead, direct = None, None
                hosts = _host_buffers(cp, tr.chunk_bytes)
                fd, arr, owned = _source_of(log)
                st["via"] = _filled_by(fd)
                for a in out:
                    a.fill(0)
                bad_d.fill(0)
                cp.cuda.get_current_stream().synchronize()
                _pipeline(cp, gpu, tr, None, fd, arr, hosts, slots, copy_stream, stream, out,
                          (offs_d, ids_d, crcs_d, bad_d), kernels, st, None)
            stream.synchronize()
            bad = np.flatnonzero(bad_d.get())   # a byte a page, read once (no search kernel to load)
            if bad.size:
                raise _bad_page_in_log(log, tr, int(bad[0]))
        t2 = time.perf_counter()
        st["scatter_s"] = t2 - t1
        result = checked_arrays(tr, out)
        st["verify_s"] = time.perf_counter() - t2
        return result
    finally:
        if ahead is not None:
            st["register_wait_s"], st["pin_stop_s"] = ahead.wait_s, ahead.close()
        if own_reg is not None:
            own_reg.unregister()
        if owned:
            os.close(fd)


def _pipeline(cp, gpu, tr, direct, fd, arr, hosts, slots, copy_stream, stream, out, dev_arrays, kernels, st,
              ahead=None, piece=None):
    """Chunks through host buffers (or straight from a registered mapping), the
    copy engine and the scatter kernel, overlapped; see the module doc.
    st receives the seconds the loop waited for host reads (fill_wait_s: the
    host side is the bottleneck) and for transfers (copy_wait_s: the bus is)."""
    rt = cp.cuda.runtime
    offs_d, ids_d, crcs_d, bad_d = dev_arrays
    C, H, D = tr.chunks, len(hosts), len(slots)
    copied = [None] * C
    scattered = [None] * C
    fills = {}
    fill_wait = copy_wait = 0.0
    if direct is None:
        for j in range(min(H, C)):
            fills[j] = _fill(fd, arr, hosts[j % H][0], tr.copies[j])
    try:
        for j in range(C):
            slot = slots[j % D]
            if j >= D:
                copy_stream.wait_event(scattered[j - D])  # the slot's previous chunk is applied
            if direct is None:
                w0 = time.perf_counter()
                _wait(fills.pop(j))
                fill_wait += time.perf_counter() - w0
                host = hosts[j % H][0]
                rt.memcpyAsync(slot.data.ptr, host.ctypes.data, tr.used[j], rt.memcpyHostToDevice, copy_stream.ptr)
            else:
                if ahead is not None:
                    ahead.ready(j)
                for lo, n, at in tr.copies[j].tolist():
                    # one copy reads within one registration: pieces pinned apart are split at their ends
                    step = ahead.piece if ahead is not None else (piece or n)
                    while n:
                        m = min(n, step - lo % step)
                        rt.memcpyAsync(slot.data.ptr + at, direct + lo, m, rt.memcpyDefault, copy_stream.ptr)
                        lo, n, at = lo + m, n - m, at + m
            copied[j] = copy_stream.record()
            stream.wait_event(copied[j])
            with stream:
                for i, lo, hi in tr.region_slices(j):
                    dst = out[i]
                    kernels[tr.regions[i].region.page_bytes](
                        gpu.warp_grid(hi - lo), (gpu.THREADS,),
                        (slot, offs_d[lo:hi], ids_d[lo:hi], crcs_d[lo:hi], np.uint64(hi - lo), dst,
                         np.uint64(tr.regions[i].region.nbytes), bad_d[lo:hi]))
            scattered[j] = stream.record()
            # host buffer (j-1) % H is free once chunk j-1 crossed the bus
            k = j - 1 + H
            if direct is None and j >= 1 and k < C:
                w0 = time.perf_counter()
                copied[j - 1].synchronize()
                copy_wait += time.perf_counter() - w0
                fills[k] = _fill(fd, arr, hosts[k % H][0], tr.copies[k])
        st.update(fill_wait_s=fill_wait, copy_wait_s=copy_wait)
    finally:
        for fs in fills.values():  # an error above: let queued reads finish before the buffers are reused
            for f in fs:
                f.cancel()
            for f in fs:
                if not f.cancelled():
                    try:
                        f.result()
                    except Exception:
                        pass
        copy_stream.synchronize()
        stream.synchronize()
