"""CuPy launchers of the page kernels: the same functions, arguments and
results as `reference.py`, on device arrays.

Regions, shadows and record buffers are CuPy arrays; a host mapping registered
with CUDA (or pinned memory) is used through `device_buffer(ptr, nbytes)`
(under unified addressing a mapped registration has the same address on the
device).  Page lists are device uint32 arrays, sorted and unique as the
detectors produce them.  Launches go to the current stream; the launchers that
return a page list synchronise once to learn its length, the staging launcher
never does (the extent's cursor, on the device, says where records went).

The `launch_*` functions are the bare kernels with caller-provided outputs,
for benchmarks and for work queued without any host synchronisation.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from . import jit
from . import reference as ref
from .errors import KernelInputError

THREADS = 256
WARPS_PER_BLOCK = THREADS // 32


def _cp():
    return jit.require_cupy()


@functools.lru_cache(maxsize=8)
def _sm_count(device_id: int) -> int:
    cp = _cp()
    return int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def warp_grid(items: int) -> tuple[int]:
    """Blocks for one warp per item, capped at a few waves (kernels grid-stride)."""
    cp = _cp()
    cap = _sm_count(cp.cuda.Device().id) * 16
    return (max(1, min(-(-items // WARPS_PER_BLOCK), cap)),)


def _bytes_of(a, what: str):
    cp = _cp()
    if not isinstance(a, cp.ndarray):
        raise KernelInputError(f"{what} must be a CuPy array, got {type(a).__name__}", where=what)
    if not a.flags.c_contiguous:
        raise KernelInputError(f"{what} must be C-contiguous", where=what)
    return a.reshape(-1).view(cp.uint8)


def _u32(a, what: str):
    cp = _cp()
    a = cp.asarray(a)
    if a.dtype != cp.uint32:
        a = a.astype(cp.uint32)
    return cp.ascontiguousarray(a.reshape(-1))


#: (event, host array) of each `upload` whose copy may still read its host array
_UPLOADS: collections.deque = collections.deque()


def upload(host: np.ndarray):
    """A CuPy copy of the small host array `host`, queued on CuPy's current
    stream straight from its pageable memory.  cp.asarray of a numpy array
    takes a buffer from CuPy's pinned pool instead (cudaHostAlloc in a fresh
    process, a block of each size): a cost a recovery's one table should not
    pay.  CUDA says only that a copy from pageable memory may be synchronous
    with the host, so the host array is held until an event behind its copy
    has passed (`_UPLOADS`, let go at later uploads)."""
    cp = _cp()
    while _UPLOADS and _UPLOADS[0][0].done:
        _UPLOADS.popleft()
    host = np.require(host, requirements="C")
    out = cp.empty(host.shape, host.dtype)
    if host.nbytes:
        stream = cp.cuda.get_current_stream()
        out.data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)
        _UPLOADS.append((stream.record(), host))
    return out


def _null():
    return np.uint64(0)


def _aligned(a, n: int, what: str):
    if a.data.ptr % n:
        raise KernelInputError(f"{what} is not {n}-byte aligned", where=what)


def device_buffer(ptr: int, nbytes: int, owner=None):
    """A uint8 CuPy array over `nbytes` at `ptr`: device memory, pinned memory
    or a host mapping registered with CUDA (same address under unified
    addressing).  `owner` is kept alive with the array."""
    cp = _cp()
    mem = cp.cuda.UnownedMemory(int(ptr), int(nbytes), owner, cp.cuda.Device().id)
    return cp.ndarray((int(nbytes),), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))


def pinned_buffer(nbytes: int):
    """(numpy view, device view) of a fresh pinned host buffer, for a staging
    ring or for tests: the GPU writes the device view, the host reads numpy."""
    cp = _cp()
    mem = cp.cuda.alloc_pinned_memory(int(nbytes))
    host = np.frombuffer(mem, np.uint8, int(nbytes))
    return host, device_buffer(mem.ptr, nbytes, mem)


# --- dirty detection ---------------------------------------------------------


def _found(found):
    """Kernel arguments of an optional (list, count) page list (see launch_shadow_diff)."""
    if found is None:
        return _null(), _null(), np.uint32(0)
    lst, count = found
    return lst, count, np.uint32(lst.size)


def launch_shadow_diff(r, s, flags, *, page_bytes: int, update: bool = True, found=None) -> None:
    """found: optional (list, count) device uint32 arrays; each dirty page's id
    is also appended to `list` (the first list.size of them, in no order) and
    counted in count[0] (which must start at zero): what `launch_stage_delta`
    takes."""
    n = ref.num_pages(r.size, page_bytes)
    k = jit.function("shadow_diff", "shadow_diff", {"PAGE_BYTES": page_bytes})
    k(warp_grid(n), (THREADS,), (r, s, flags, np.uint64(n), np.uint64(r.size), np.int32(bool(update)),
                                  *_found(found)))


def shadow_diff(region, shadow, *, page_bytes: int, update: bool = True):
    """Sorted uint32 ids of the pages of `region` that differ from `shadow`;
    with `update` the shadow takes those pages.  See reference.shadow_diff."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r, s = _bytes_of(region, "region"), _bytes_of(shadow, "shadow")
    if r.size != s.size:
        raise KernelInputError(f"shadow has {s.size} bytes, region {r.size}", where="shadow")
    _aligned(r, 16, "region"), _aligned(s, 16, "shadow")
    flags = cp.empty(ref.num_pages(r.size, pb), cp.uint8)
    if flags.size:
        launch_shadow_diff(r, s, flags, page_bytes=pb, update=update)
    return cp.flatnonzero(flags).astype(cp.uint32)


def launch_fingerprint(r, fps, flags=None, *, page_bytes: int, update: bool = True, found=None) -> None:
    """found: as for launch_shadow_diff (needs flags)."""
    n = ref.num_pages(r.size, page_bytes)
    k = jit.function("fingerprint", "fingerprint", {"PAGE_BYTES": page_bytes})
    k(warp_grid(n), (THREADS,), (r, fps, _null() if flags is None else flags, np.uint64(n),
                                  np.uint64(r.size), np.int32(bool(update)), *_found(found)))


def fingerprint_pages(region, *, page_bytes: int, out=None):
    """uint64 fingerprint per page (see reference.fingerprint_pages)."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    _aligned(r, 16, "region")
    n = ref.num_pages(r.size, pb)
    if out is None:
        out = cp.empty(n, cp.uint64)
    elif out.shape != (n,) or out.dtype != cp.uint64:
        raise KernelInputError(f"out must be uint64[{n}]", where="fingerprints")
    if n:
        launch_fingerprint(r, out, page_bytes=pb)
    return out


def fingerprint_dirty(region, fingerprints, *, page_bytes: int, update: bool = True):
    """Sorted uint32 ids of pages whose fingerprint moved (see reference)."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    _aligned(r, 16, "region")
    n = ref.num_pages(r.size, pb)
    if fingerprints.shape != (n,) or fingerprints.dtype != cp.uint64:
        raise KernelInputError(f"fingerprints must be uint64[{n}]", where="fingerprints")
    flags = cp.empty(n, cp.uint8)
    if n:
        launch_fingerprint(r, fingerprints, flags, page_bytes=pb, update=update)
    return cp.flatnonzero(flags).astype(cp.uint32)


def kv_dirty_blocks(block_tables, seq_lens, ckpt_lens, *, block_size: int, kv_heads: int,
                    head_dim: int, dtype_bytes: int, page_bytes: int, num_blocks: int,
                    num_layers: int = 1, advance: bool = True):
    """Sorted unique uint32 page ids of a paged KV cache dirtied by the tokens
    added since the last checkpoint (see reference.kv_dirty_blocks).  One warp
    per sequence: the cost follows the new tokens, not the cache size."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    for a, what in ((block_tables, "block_tables"), (seq_lens, "seq_lens"), (ckpt_lens, "ckpt_lens")):
        if not isinstance(a, cp.ndarray) or a.dtype != cp.int32 or not a.flags.c_contiguous:
            raise KernelInputError(f"{what} must be a C-contiguous int32 CuPy array", where=what)
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],) or ckpt_lens.shape != seq_lens.shape:
        raise KernelInputError("block_tables must be [seqs, max_blocks], seq_lens and "
                               "ckpt_lens [seqs]", where="kv_dirty_blocks")
    geo = ref.kv_layout(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                        dtype_bytes=dtype_bytes, num_blocks=num_blocks, num_layers=num_layers)
    name, defines = jit.kv_spec(page_bytes=pb, block_size=block_size, kv_heads=kv_heads,
                                head_dim=head_dim, dtype_bytes=dtype_bytes)
    k = jit.function(name, "kv_scan", defines)
    seqs, max_blocks = block_tables.shape
    cap = max(1024, 8 * seqs * num_layers)
    while True:
        out = cp.empty(cap, cp.uint32)
        counters = cp.zeros(2, cp.uint32)
        if seqs:
            k(warp_grid(seqs), (THREADS,), (block_tables, np.int32(max_blocks), seq_lens, ckpt_lens,
                                             np.int32(seqs), np.int32(num_blocks), np.int32(num_layers),
                                             np.uint64(geo["layer"]), out, np.uint32(cap), counters))
        count, bad = (int(x) for x in counters.get())
        if bad:
            raise KernelInputError(f"{bad} block-table entries name a block outside "
                                   f"[0, {num_blocks}) or lie past the table", where="kv_dirty_blocks")
        if count <= cap:
            break
        cap = count
    ids = cp.unique(out[:count]).astype(cp.uint32)
    if advance:
        ckpt_lens[...] = seq_lens
    return ids


def adapter_dirty_pages(slot_versions, seen_versions, *, pages_per_slot: int, num_pages: int,
                        advance: bool = True):
    """Sorted uint32 page ids of adapter slots whose version moved (see
    reference.adapter_dirty_pages).  Versions are 8-byte integer CuPy arrays."""
    cp = _cp()
    v, seen = slot_versions, seen_versions
    if (not isinstance(v, cp.ndarray) or not isinstance(seen, cp.ndarray) or v.shape != seen.shape
            or v.ndim != 1 or v.dtype.itemsize != 8 or seen.dtype.itemsize != 8):
        raise KernelInputError("slot_versions and seen_versions must be equal 1-D 8-byte "
                               "integer CuPy arrays", where="adapter_dirty_pages")
    cap = max(1, min(v.size * int(pages_per_slot), int(num_pages)))
    out = cp.empty(cap, cp.uint32)
    counters = cp.zeros(2, cp.uint32)
    if v.size:
        k = jit.function("kv_scan", "adapter_scan", {})
        blocks = max(1, min(-(-v.size // THREADS), 1024))
        k((blocks,), (THREADS,), (v, seen, np.int32(v.size), np.uint32(pages_per_slot),
                                  np.uint32(num_pages), out, np.uint32(cap), counters))
    count, bad = (int(x) for x in counters.get())
    if bad:
        raise KernelInputError(f"{bad} changed slots start past page {num_pages}",
                               where="adapter_dirty_pages")
    ids = cp.sort(out[:count])
    if advance:
        seen[...] = v
    return ids


# --- checksums ---------------------------------------------------------------


def crc32c_pages(region, page_ids=None, *, page_bytes: int, out=None):
    """uint32 CRC32C of each listed page (all when None), last page zero-padded."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    _aligned(r, 16, "region")
    ids = None if page_ids is None else _u32(page_ids, "page_ids")
    count = ref.num_pages(r.size, pb) if ids is None else ids.size
    if out is None:
        out = cp.empty(count, cp.uint32)
    if count:
        k = jit.function("crc32c", "crc32c_pages", {"PAGE_BYTES": pb})
        k(warp_grid(count), (THREADS,), (r, _null() if ids is None else ids, np.uint64(count),
                                          np.uint64(r.size), out))
    return out


def region_digest(page_crcs) -> int:
    """CRC32C over the little-endian u32 array of a region's page CRCs."""
    cp = _cp()
    crcs = _u32(page_crcs, "page_crcs")
    out = cp.empty(1, cp.uint32)
    k = jit.function("crc32c", "crc32c_words", {})
    k((1,), (1024,), (crcs, np.uint64(crcs.size), out))
    return int(out.get()[0])


def expand_runs(first, run_stage, run_pb, run_id, run_crc, crc_table, n: int, *, page_bytes: int) -> tuple:
    """(stage uint64, ids uint32, crcs uint32) CuPy arrays of pages 0..n-1 laid
    out as runs (see reference.expand_runs), expanded on the device in one
    launch; the runs and `crc_table` may be host or device arrays.  The kernel
    is taken from the scatter module of `page_bytes` (the one the restore loads)."""
    cp = _cp()
    if n == 0:
        return cp.zeros(0, cp.uint64), cp.zeros(0, cp.uint32), cp.zeros(0, cp.uint32)
    if all(isinstance(a, np.ndarray) for a in (first, run_crc, crc_table)):   # the twin's checks, on the host
        ref.check_runs(first, run_crc, crc_table, n)
    runs = [cp.asarray(a, dtype=cp.int64) for a in (first, run_stage, run_pb, run_id, run_crc)]
    table = cp.asarray(crc_table, dtype=cp.uint32)
    stage, ids, crcs = cp.empty(n, cp.uint64), cp.empty(n, cp.uint32), cp.empty(n, cp.uint32)
    k = jit.function("scatter", "expand_runs", {"PAGE_BYTES": ref.check_page_bytes(page_bytes)})
    blocks = max(1, min(-(-n // THREADS), 4096))
    k((blocks,), (THREADS,), (*runs, np.uint64(runs[0].size), table, np.uint64(n), stage, ids, crcs))
    return stage, ids, crcs


def region_digests(page_crcs: list) -> list[int]:
    """region_digest of each array of page CRCs, queued together and read back
    in one copy (one host synchronisation for every region of a restore)."""
    cp = _cp()
    if not page_crcs:
        return []
    out = cp.empty(len(page_crcs), cp.uint32)
    for i, c in enumerate(page_crcs):
        launch_region_digest(c, out[i:i + 1])
    return [int(x) for x in out.get()]


# --- staging -----------------------------------------------------------------


def new_cursor(used: int = 0):
    """A staging cursor (u64[4] on the device) over an empty extent."""
    cp = _cp()
    return cp.asarray(ref.new_cursor(used))


def stage_page_batch(region, page_ids, dst, cursor, *, page_bytes: int, base_lsn: int, epoch: int,
                     region_id: int, salt: int, flags: int = 0, crcs=None):
    """Queue one page-batch record of the listed pages into `dst` at the
    device cursor; returns the record's length.  No host synchronisation: the
    GPU claims its space (cursor[CURSOR_USED]; a record that does not fit is
    counted in cursor[CURSOR_REFUSED] and not written) and writes the index
    table, CRC table, payload and, last, the header.  `crcs` (device uint32
    [count]) receives the page CRCs when given.  See reference.stage_page_batch
    for the bytes; page_ids must be sorted and unique (the detectors' output)."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    _aligned(r, 16, "region")
    ids = _u32(page_ids, "page_ids")
    d = _bytes_of(dst, "dst")
    _aligned(d, 64, "dst")
    if not isinstance(cursor, cp.ndarray) or cursor.dtype != cp.uint64 or cursor.size < ref.CURSOR_WORDS:
        raise KernelInputError("cursor must be a device uint64[4] (gpu.new_cursor)", where="cursor")
    count = ids.size
    if count == 0:
        raise KernelInputError("a page batch needs at least one page", where="page_ids")
    length = ref.page_batch_length(count, pb)
    if crcs is None:
        crcs = cp.empty(count, cp.uint32)
    slot = cp.empty(1, cp.uint64)
    defines = {"PAGE_BYTES": pb}
    jit.function("stage", "stage_alloc", defines)(
        (1,), (1,), (cursor, np.uint64(d.size), np.uint64(length), slot))
    jit.function("stage", "stage_payload", defines)(
        warp_grid(count), (THREADS,),
        (r, ids, np.uint64(count), np.uint64(r.size), d, slot, crcs))
    jit.function("stage", "stage_finalize", defines)(
        (1,), (THREADS,),
        (ids, crcs, np.uint64(count), d, slot, np.uint64(length), np.uint64(base_lsn),
         np.uint64(epoch), np.uint32(region_id), np.uint32(salt), np.uint32(flags)))
    return length


# --- recovery ----------------------------------------------------------------


def scatter_pages(src, src_offsets, page_ids, region, *, page_bytes: int, expected_crcs=None):
    """Apply pages from log bytes `src` into `region`, checking each page's
    CRC32C first when expected_crcs is given; returns the sorted positions
    (int64, on the device) that mismatched and were not applied.  See
    reference.scatter_pages; src offsets must be 16-byte aligned."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    s = _bytes_of(src, "src")
    r = _bytes_of(region, "region")
    _aligned(s, 16, "src"), _aligned(r, 16, "region")
    ids = _u32(page_ids, "page_ids")
    offs = cp.ascontiguousarray(cp.asarray(src_offsets, dtype=cp.uint64).reshape(-1))
    if offs.size != ids.size:
        raise KernelInputError("src_offsets and page_ids differ in length", where="src_offsets")
    count = ids.size
    bad = cp.zeros(count, cp.uint8)
    if count:
        n = ref.num_pages(r.size, pb)
        if bool((offs % 16 != 0).any()) or int(offs.max()) + pb > s.size:
            raise KernelInputError("a source page is unaligned or lies outside the log bytes",
                                   where="src_offsets")
        if int(ids.max()) >= n:
            raise KernelInputError(f"page id out of range [0, {n})", where="page_ids")
        exp = _null() if expected_crcs is None else _u32(expected_crcs, "expected_crcs")
        k = jit.function("scatter", "scatter_pages", {"PAGE_BYTES": pb})
        k(warp_grid(count), (THREADS,), (s, offs, ids, exp, np.uint64(count), r, np.uint64(r.size), bad))
    return cp.flatnonzero(bad)


# --- checkpoint pipeline helpers (queued work, no host synchronisation) --------


def dirty_positions(flags):
    """(positions, count) of a per-page flag array from a `launch_*` detector:
    the inclusive running count of set flags (int64) and, as a 0-d device
    array, their number.  Nothing is synchronised; the caller fetches the
    counts of every region at once, then calls `compact_flags`."""
    cp = _cp()
    pos = cp.cumsum(flags, dtype=cp.int64)
    return pos, pos[-1:].reshape(()) if flags.size else cp.zeros((), cp.int64)


def compact_flags(flags, positions, count: int):
    """Sorted uint32 ids of the set flags, given `dirty_positions` and the
    count (known on the host).  Queued without synchronising: unlike
    `cupy.flatnonzero`, which reads the count back itself."""
    cp = _cp()
    if count == 0:
        return cp.empty(0, cp.uint32)
    # set flags land at 1..count; every clear flag writes the discarded slot 0
    slot = cp.where(flags != 0, positions, 0)
    out = cp.empty(int(count) + 1, cp.uint32)
    out[slot] = cp.arange(flags.size, dtype=cp.uint32)
    return out[1:]


def copy_spans(pairs, *, piece: int = ref.COPY_PIECE) -> None:
    """Copy every (src, dst) pair of device arrays in one launch on CuPy's
    current stream: each pair checked (CuPy arrays, C-contiguous, of equal
    byte sizes; a one-line KernelInputError naming the pair), then
    `copy_checked_spans`.  Twin: reference.copy_spans (same rows, same bytes)."""
    cp = _cp()
    for i, pair in enumerate(pairs):
        for a, what in zip(pair, ("source", "target")):
            if not isinstance(a, cp.ndarray):
                raise KernelInputError(f"pairs[{i}] {what} must be a CuPy array, got {type(a).__name__}",
                                       where=f"pairs[{i}] {what}")
            if not a.flags.c_contiguous:
                raise KernelInputError(f"pairs[{i}] {what} must be C-contiguous", where=f"pairs[{i}] {what}")
        if pair[0].nbytes != pair[1].nbytes:
            raise KernelInputError(f"pairs[{i}]: {pair[0].nbytes} bytes into {pair[1].nbytes}", where="pairs")
    copy_checked_spans(pairs, piece=piece)


def copy_checked_spans(pairs, *, piece: int = ref.COPY_PIECE) -> None:
    """`copy_spans` of pairs its caller checked already (a restore's targets
    are checked against the log, its arrays made to their size): one launch
    (one row table copied there first), what one cudaMemcpyAsync a pair
    does without a driver call a pair.  A pair whose two addresses are not
    both 16-byte aligned (the kernel would copy it a byte at a time) is
    copied by the copy engine instead, on the same stream.
    KernelCompileError, with nothing queued, where the kernel cannot be built."""
    # addresses and sizes only: a flat view of each array would cost more than the copies' driver calls
    # this launch replaces (a CuPy view is microseconds; a model has hundreds of tensors)
    _queue_copies([(a.data.ptr, b.data.ptr) for a, b in pairs], [a.nbytes for a, _ in pairs], piece,
                  lambda: jit.function("copy", "copy_spans"))


def copy_plan(ptrs, sizes, piece: int = ref.COPY_PIECE) -> tuple[np.ndarray, np.ndarray, int]:
    """How the copies of `sizes[i]` bytes from address ptrs[i][0] to
    ptrs[i][1] are made: ([(source, target, bytes)] uint64 of the pairs the
    copy engine takes, whose two addresses are not both 16-byte aligned;
    the batched copy's row table, uint64, every row's source address, then
    every row's target address, then every row's bytes (`copy_spans`' rows,
    `ref.span_rows`); its row count).  Empty pairs are in neither.  Numpy
    only: the host's half of `copy_checked_spans` and `copy_addresses`."""
    ptrs = np.asarray(ptrs, np.uint64).reshape(-1, 2)
    sizes = np.asarray(sizes, np.int64).reshape(-1)
    if len(ptrs) != len(sizes):
        raise KernelInputError(f"{len(ptrs)} address pairs and {len(sizes)} sizes", where="sizes")
    some = sizes > 0
    odd = ((ptrs[:, 0] | ptrs[:, 1]) & np.uint64(15)) != 0
    engine = np.column_stack([ptrs[some & odd], sizes[some & odd].astype(np.uint64)])
    keep = some & ~odd
    span, offset, nbytes = ref.span_rows(sizes[keep], piece)
    ends = ptrs[keep][span] + offset.astype(np.uint64)[:, None]
    return engine, np.concatenate([ends[:, 0], ends[:, 1], nbytes.astype(np.uint64)]), int(span.size)


def _queue_copies(ptrs, sizes, piece: int, kernel) -> None:
    """Queue `copy_plan`'s copies on CuPy's current stream: the batched
    copy's kernel asked for first (`kernel()`, where there are rows: a
    KernelCompileError leaves nothing queued), then a cudaMemcpyAsync for
    each of the copy engine's pairs, then one launch over the rows."""
    cp = _cp()
    engine, table, rows = copy_plan(ptrs, sizes, piece)
    k = kernel() if rows else None
    stream = cp.cuda.get_current_stream()
    for src, dst, n in engine.tolist():
        cp.cuda.runtime.memcpyAsync(dst, src, n, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    if k is not None:
        k((max(1, min(rows, _sm_count(cp.cuda.Device().id) * 16)),), (THREADS,), (upload(table), np.uint64(rows)))


def copy_addresses(pairs, sizes, *, piece: int = ref.COPY_PIECE) -> bool:
    """Copy sizes[i] bytes from device address pairs[i][0] to pairs[i][1]
    (ints; none overlapping another's target), on CuPy's current stream and
    device, in one launch of `copy_spans` where that kernel is loaded there
    already (a read ahead loads it: `copy_spans_ready`).  Pairs whose two
    addresses are not both 16-byte aligned go by the copy engine.  False,
    with nothing queued, where the kernel is not loaded: its first load
    costs more than the copies it would save, and the caller copies as it
    would have.  For a caller whose arrays are not CuPy's (a framework's
    tensors): no wrapper an array.  Twin: reference.copy_spans of the same
    bytes."""
    if len(pairs) != len(sizes):
        raise KernelInputError(f"{len(pairs)} address pairs and {len(sizes)} sizes", where="sizes")
    if not jit.is_loaded("copy"):
        return False
    _queue_copies(pairs, sizes, piece, lambda: jit.function("copy", "copy_spans"))
    return True


def copy_engine(pairs) -> None:
    """Copy every (src, dst) pair of C-contiguous device arrays of equal byte
    sizes with the copy engine, one cudaMemcpyAsync a pair, on CuPy's current
    stream: `copy_spans`' misaligned pairs, and every pair where its kernel
    cannot be built."""
    if not pairs:
        return
    stream = _cp().cuda.get_current_stream()
    for a, b in pairs:
        b.data.copy_from_device_async(a.data, int(a.nbytes), stream)


def copy_spans_ready() -> None:
    """Load `copy_spans` on this device now (a thread that reads ahead does,
    so that the recovery's first batched copy pays no module load)."""
    jit.function("copy", "copy_spans")


def launch_region_digest(page_crcs, out) -> None:
    """Queue `region_digest(page_crcs)` into out[0] (device uint32) without
    synchronising; the checkpoint reads every region's digest in one fetch."""
    crcs = _u32(page_crcs, "page_crcs")
    if crcs.size == 0:
        raise KernelInputError("a region digest needs at least one page CRC", where="page_crcs")
    k = jit.function("crc32c", "crc32c_words", {})
    k((1,), (1024,), (crcs, np.uint64(crcs.size), out))


# --- fixed-cost helpers for the checkpoint path (one launch each, no sync) -----

_HELPERS_SOURCE = r"""
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

// Sorted ids of the set flags and their number, in one launch of one block:
// tiles of 64 flags per thread, a block-wide exclusive scan of the per-thread
// counts, then each thread writes its ids in order.
extern "C" __global__ void __launch_bounds__(1024)
compact_flags(const u8* __restrict__ flags, u64 n, u32* __restrict__ ids, u64* __restrict__ count) {
    __shared__ u32 warp_sums[32];
    __shared__ u64 base;
    const u32 t = threadIdx.x, lane = t & 31, w = t >> 5, warps = blockDim.x >> 5;
    if (t == 0) base = 0;
    __syncthreads();
    for (u64 tile = 0; tile < n; tile += (u64)blockDim.x * 64) {
        const u64 lo = tile + (u64)t * 64;
        u64 bits = 0;
        if (lo + 64 <= n) {
            const uint4* p = reinterpret_cast<const uint4*>(flags + lo);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 v = p[q];
                const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if ((words[k] >> (8 * b)) & 0xFFu) bits |= 1ull << (16 * q + 4 * k + b);
            }
        } else {
            for (int k = 0; k < 64; ++k)
                if (lo + k < n && flags[lo + k]) bits |= 1ull << k;
        }
        const u32 mine = __popcll(bits);
        u32 incl = mine;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 x = __shfl_up_sync(0xFFFFFFFFu, incl, d);
            if (lane >= d) incl += x;
        }
        if (lane == 31) warp_sums[w] = incl;
        __syncthreads();
        if (w == 0) {
            u32 s = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const u32 x = __shfl_up_sync(0xFFFFFFFFu, s, d);
                if (lane >= d) s += x;
            }
            warp_sums[lane] = s;  // inclusive over warps
        }
        __syncthreads();
        u64 off = base + (w ? warp_sums[w - 1] : 0) + (incl - mine);
        while (bits) {
            const int k = __ffsll((long long)bits) - 1;
            ids[off++] = (u32)(lo + k);
            bits &= bits - 1;
        }
        __syncthreads();
        if (t == 0) base += warp_sums[warps - 1];
        __syncthreads();
    }
    if (t == 0) count[0] = base;
}

// Holds (concordia.regions.streams.Holds): words[0] counts the holds that have
// arrived, words[1] is the newest release, words[2] counts the waits that gave
// up after their timeout.  One thread each; a hold is one launch, so it is one
// point in its stream's order.
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 load_word(const u64* w) { return *reinterpret_cast<const volatile u64*>(w); }

// A producer stream stops here until release `seq` (or the timeout: broken).
extern "C" __global__ void hold_stream(u64* words, u64 seq, u64 timeout_ns) {
    atomicAdd(&words[0], 1ull);
    __threadfence_system();
    const u64 t0 = now_ns();
    while (load_word(&words[1]) < seq) {
        if (now_ns() - t0 > timeout_ns) {
            atomicAdd(&words[2], 1ull);
            return;
        }
        __nanosleep(1000);
    }
}

// Concordia's stream waits here until `arrivals` holds have arrived (or the timeout: broken).
extern "C" __global__ void await_holds(u64* words, u64 arrivals, u64 timeout_ns) {
    const u64 t0 = now_ns();
    while (load_word(&words[0]) < arrivals) {
        if (now_ns() - t0 > timeout_ns) {
            atomicAdd(&words[2], 1ull);
            return;
        }
        __nanosleep(1000);
    }
    __threadfence_system();
}

// Every hold up to `seq` goes on.
extern "C" __global__ void release_holds(u64* words, u64 seq) {
    __threadfence_system();
    atomicMax(&words[1], seq);
}

// table[ids[i]] = values[i] for i < n
extern "C" __global__ void scatter_u32(u32* __restrict__ table, const u32* __restrict__ ids,
                                       const u32* __restrict__ values, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        table[ids[i]] = values[i];
}
"""

_helpers: dict = {}


def _helper(kernel: str):
    cp = _cp()
    key = (cp.cuda.Device().id, kernel)
    fn = _helpers.get(key)
    if fn is None:
        mod = _helpers.get(key[0])
        if mod is None:
            mod = _helpers[key[0]] = cp.RawModule(code=_HELPERS_SOURCE, options=jit.NVRTC_OPTIONS)
        fn = _helpers[key] = mod.get_function(kernel)
    return fn


def precompile_helpers() -> None:
    """Load the checkpoint path's helper kernels now (not midway through a checkpoint)."""
    _helper("compact_flags")
    _helper("scatter_u32")


HOLD_KERNELS = ("hold_stream", "await_holds", "release_holds")


def launch_hold(words, seq: int, timeout_ns: int) -> None:
    """Queue on the current stream: count an arrival in words[0], then wait
    until words[1] >= seq; after timeout_ns, go on and count words[2] += 1
    (`reference.hold_stream`).  `words`: device uint64[3]."""
    _helper("hold_stream")((1,), (1,), (words, np.uint64(seq), np.uint64(timeout_ns)))


def launch_await_holds(words, arrivals: int, timeout_ns: int) -> None:
    """Queue on the current stream: wait until words[0] >= arrivals; after
    timeout_ns, go on and count words[2] += 1 (`reference.await_holds`)."""
    _helper("await_holds")((1,), (1,), (words, np.uint64(arrivals), np.uint64(timeout_ns)))


def launch_release_holds(words, seq: int) -> None:
    """Queue on the current stream: words[1] = max(words[1], seq) (`reference.release_holds`)."""
    _helper("release_holds")((1,), (1,), (words, np.uint64(seq)))


def launch_compact(flags, ids, count) -> None:
    """Queue: ids[:k] = sorted positions of the k set flags, count[0] = k
    (device uint64).  One launch of one block, no synchronisation; `ids` must
    hold as many uint32 as there are flags (k is not known in advance)."""
    n = int(flags.size)
    _helper("compact_flags")((1,), (1024,), (flags, np.uint64(n), ids, count))


def launch_scatter_u32(table, ids, values, count: int) -> None:
    """Queue table[ids[i]] = values[i] for i < count (device uint32 arrays)."""
    if count:
        blocks = max(1, min(-(-count // THREADS), 1024))
        _helper("scatter_u32")((blocks,), (THREADS,), (table, ids, values, np.uint64(count)))


def launch_stage(region, ids, count: int, dst_ptr: int, dst_bytes: int, cursor, slot, crcs, *, page_bytes: int,
                 base_lsn: int, epoch: int, region_id: int, salt: int, flags: int = 0) -> int:
    """`stage_page_batch` without its checks and allocations: `region` is the
    flat uint8 region, `ids` a device uint32 array whose first `count` entries
    are the pages, `dst_ptr` the device address of the extent (`dst_bytes`
    long, 64-byte aligned), `slot` a device uint64[1] for the record's offset.
    Returns the record's length."""
    length = ref.page_batch_length(count, page_bytes)
    defines = {"PAGE_BYTES": page_bytes}
    dst = np.uint64(dst_ptr)
    jit.function("stage", "stage_alloc", defines)((1,), (1,), (cursor, np.uint64(dst_bytes), np.uint64(length), slot))
    jit.function("stage", "stage_payload", defines)(
        warp_grid(count), (THREADS,), (region, ids, np.uint64(count), np.uint64(region.size), dst, slot, crcs))
    jit.function("stage", "stage_finalize", defines)(
        (1,), (THREADS,),
        (ids, crcs, np.uint64(count), dst, slot, np.uint64(length), np.uint64(base_lsn),
         np.uint64(epoch), np.uint32(region_id), np.uint32(salt), np.uint32(flags)))
    return length


# --- one launch for a few dirty pages ------------------------------------------

DELTA_THREADS = 1024   # stage.cu's DELTA_THREADS: one warp per page, one block
DELTA_MAX_PAGES = ref.DELTA_MAX_PAGES


def launch_stage_delta(region, found, cap_pages: int, dst_ptr: int, dst_bytes: int, table, digest: int,
                       mail_ptr: int, *, page_bytes: int, base_lsn: int, epoch: int, region_id: int,
                       salt: int, flags: int = 0) -> None:
    """Queue `stage_delta` (stage.cu) without checks or synchronisation:
    `region` the flat uint8 region, `found` the (list, count) a detector
    filled, `dst_ptr` the device address of an extent of `dst_bytes` (0 for
    none), `table` the region's device page CRC table and `digest` its digest,
    `mail_ptr` the device address of 5 u64 of pinned host memory that receive
    pages found, bytes and records written, the new digest, then `epoch`."""
    lst, count = found
    jit.function("stage", "stage_delta", {"PAGE_BYTES": page_bytes})(
        (1,), (DELTA_THREADS,),
        (region, np.uint64(region.size), np.uint64(table.size), lst, count, np.uint32(cap_pages),
         np.uint64(dst_ptr), np.uint64(dst_bytes), np.uint64(base_lsn), np.uint64(epoch), np.uint32(region_id),
         np.uint32(salt), np.uint32(flags), table, np.uint32(digest), np.uint64(mail_ptr)))


def stage_delta(region, dirty_ids, dst, table, digest: int, *, page_bytes: int, cap_pages: int, base_lsn: int,
                epoch: int, region_id: int, salt: int, flags: int = 0):
    """Checked `launch_stage_delta` with the twin's arguments and result (see
    reference.stage_delta): `dirty_ids` the detector's list in any order
    (device uint32), `dst` a device or pinned buffer, `table` updated in place.
    Returns (pages found, bytes written, records written, digest)."""
    cp = _cp()
    pb = ref.check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    _aligned(r, 16, "region")
    d = _bytes_of(dst, "dst")
    _aligned(d, 64, "dst")
    ids = _u32(dirty_ids, "dirty_ids")
    if table.dtype != cp.uint32 or table.size != ref.num_pages(r.size, pb):
        raise KernelInputError(f"table must be uint32[{ref.num_pages(r.size, pb)}]", where="table")
    lst = cp.empty(max(1, int(cap_pages)), cp.uint32)
    lst[:min(ids.size, lst.size)] = ids[:lst.size]
    count = cp.full(1, ids.size, cp.uint32)
    host, mail = pinned_buffer(64)
    launch_stage_delta(r, (lst, count), cap_pages, d.data.ptr, d.size, table, digest, mail.data.ptr,
                       page_bytes=pb, base_lsn=base_lsn, epoch=epoch, region_id=region_id, salt=salt, flags=flags)
    cp.cuda.get_current_stream().synchronize()
    words = host.view(np.uint64)
    if int(count.get()[0]) != 0 or int(words[4]) != epoch:
        raise KernelInputError("stage_delta did not report back", where="stage_delta")
    return int(words[0]), int(words[1]), int(words[2]), int(words[3])
