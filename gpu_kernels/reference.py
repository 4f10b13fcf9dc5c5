"""numpy twins of every GPU kernel: the test oracle and Concordia's CPU path.

Each function here has the same name, arguments and result as its CuPy
launcher in `gpu.py`; given the same inputs the two produce the same bytes.
Regions are C-contiguous arrays of any dtype, seen as bytes and cut into pages
of `page_bytes` (a positive multiple of 64); a region's last page may be short
and counts as zero-padded wherever a page is hashed or checksummed
(docs/internals.md, "WAL record layout").

The record written by `stage_page_batch` is a page batch exactly as
`concordia.wal.format.encode_page_batch_into` writes it; the layout constants
are repeated here from docs/internals.md so the kernels and their twins keep
their own account of the bytes, and a test holds the two encoders equal.
Page CRCs come from `concordia.wal.pagecrc` (many pages per call, the GIL
released; the `crc32c` package where the native helper is absent): these
functions are the CPU checkpoint path, and one package call per page cost
more than the hashing itself.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
from crc32c import crc32c as _crc32c

from concordia.wal import pagecrc as _pagecrc

from .errors import KernelInputError

# --- record layout (docs/internals.md, "WAL record layout") -----------------
HEADER_BYTES = 64
RECORD_ALIGN = 64
TYPE_PAGE_BATCH = 0x01
NO_REGION = 0xFFFFFFFF
MAX_PAGE_BYTES = 1 << 26
# length, type, flags, reserved, region_id, lsn, epoch, salt, body_crc, count,
# page_bytes, aux, reserved, header_crc
HEADER = struct.Struct("<QBBHIQQIIIIQII")
assert HEADER.size == HEADER_BYTES

# --- staging cursor: u64 words shared by every record written into one extent
CURSOR_USED = 0      # next free byte of the extent (a multiple of 64)
CURSOR_RECORDS = 1   # records written
CURSOR_REFUSED = 2   # records that did not fit and were not written
CURSOR_WORDS = 4     # word 3 is reserved

# --- CRC32C (Castagnoli, reflected) ------------------------------------------
POLY = 0x82F63B78

# --- page fingerprint constants (gpu_kernels/fingerprint.cu uses the same) ----
FP_K1 = 0x9E3779B97F4A7C15
FP_K2 = 0xBF58476D1CE4E5B9
FP_M1 = 0xBF58476D1CE4E5B9
FP_M2 = 0x94D049BB133111EB
FP_SHIFT = 29

_CHUNK_BYTES = 32 << 20  # bytes compared / hashed per numpy pass (bounds temporaries)
_U64 = np.uint64


def align64(n: int) -> int:
    return (n + 63) & ~63


def page_batch_length(count: int, page_bytes: int) -> int:
    """Bytes of a page-batch record holding `count` pages."""
    return HEADER_BYTES + align64(8 * count) + count * page_bytes


def payload_offset(count: int) -> int:
    """Offset of the first page's payload from the record start."""
    return HEADER_BYTES + align64(8 * count)


def num_pages(nbytes: int, page_bytes: int) -> int:
    return -(-nbytes // page_bytes)


# --- GF(2) arithmetic behind CRC combination (the GPU kernels do the same) ----


def gf2_multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC32C polynomial, both in reflected bit order."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a &= ~m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def _x8_pow2() -> tuple[int, ...]:
    """x^(8 * 2^i) modulo the polynomial (reflected) for i = 0..63, each the square of the one before."""
    powers = [1 << 23]  # x^8
    for _ in range(63):
        powers.append(gf2_multmodp(powers[-1], powers[-1]))
    return tuple(powers)


#: common.cuh's X8_POW2: the powers xpow8n multiplies in, one a set bit of n
X8_POW2 = _x8_pow2()


def xpow8n(n: int) -> int:
    """x^(8n) modulo the polynomial (reflected): the operator that shifts a raw
    CRC register over n zero bytes (as common.cuh computes it), n in [0, 2^64)."""
    result, i = 1 << 31, 0  # x^0
    while n:
        if n & 1:
            result = gf2_multmodp(result, X8_POW2[i])
        n >>= 1
        i += 1
    return result


def crc32c_shift(raw: int, nbytes: int) -> int:
    """Raw CRC register after feeding `nbytes` zero bytes."""
    return gf2_multmodp(xpow8n(nbytes), raw)


@functools.lru_cache(maxsize=1)
def crc32c_table() -> np.ndarray:
    """The byte-wise table of the reflected CRC32C (256 x u32)."""
    t = np.zeros(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        t[i] = c
    return t


def crc32c_raw(data, raw: int = 0) -> int:
    """The CRC register fed with `data` from `raw`, no pre- or post-inversion."""
    t = crc32c_table()
    for b in bytes(data):
        raw = int(t[(raw ^ b) & 0xFF]) ^ (raw >> 8)
    return raw


def split_crc32c(data, parts: int) -> int:
    """CRC32C of `data` computed the way the kernels do: cut into `parts`
    slices of a multiple of 16 bytes, a raw CRC per slice, each slice's register
    shifted over the bytes after it and XOR-ed, then the initial value's shift
    and the final inversion applied.  Equal to `crc32c(data)`."""
    data = bytes(data)
    n = len(data)
    step = 16 * -(-n // (16 * parts))
    acc = 0
    for i in range(parts):
        lo, hi = min(i * step, n), min((i + 1) * step, n)
        acc ^= crc32c_shift(crc32c_raw(data[lo:hi]), n - hi)
    return (acc ^ crc32c_shift(0xFFFFFFFF, n)) ^ 0xFFFFFFFF


def crc32c(data, value: int = 0) -> int:
    return _crc32c(data, value)


# --- argument checks ---------------------------------------------------------


def _bytes_of(a, what: str) -> np.ndarray:
    """A C-contiguous array seen as a flat uint8 view (no copy)."""
    a = np.asarray(a) if not isinstance(a, np.ndarray) else a
    if not a.flags.c_contiguous:
        raise KernelInputError(f"{what} must be C-contiguous", where=what,
                               hint="pass the array itself, not a strided view")
    return a.reshape(-1).view(np.uint8)


def check_page_bytes(page_bytes: int) -> int:
    """`page_bytes` as an int, or a one-line KernelInputError: a positive multiple
    of 64 up to MAX_PAGE_BYTES (what every kernel and twin takes)."""
    page_bytes = int(page_bytes)
    if page_bytes <= 0 or page_bytes % 64 or page_bytes > MAX_PAGE_BYTES:
        raise KernelInputError(f"page_bytes {page_bytes} is not a positive multiple of 64 "
                               f"up to {MAX_PAGE_BYTES}", where="page_bytes")
    return page_bytes


def _check_page_ids(page_ids, npages: int, *, strict: bool = True) -> np.ndarray:
    ids = np.asarray(page_ids)
    if ids.ndim != 1:
        raise KernelInputError("page_ids must be one-dimensional", where="page_ids")
    if ids.size and (ids.min() < 0 or ids.max() >= npages):
        raise KernelInputError(f"page id out of range [0, {npages})", where="page_ids")
    if strict and ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
        raise KernelInputError("page ids are not strictly increasing", where="page_ids")
    return ids.astype(np.uint32, copy=False)


# --- dirty detection ---------------------------------------------------------


def shadow_diff(region, shadow, *, page_bytes: int, update: bool = True) -> np.ndarray:
    """Pages of `region` that differ from `shadow` (same byte size), as sorted
    uint32 page ids; with `update` the shadow takes the region's bytes of those
    pages, so the next call reports only later changes."""
    pb = check_page_bytes(page_bytes)
    r, s = _bytes_of(region, "region"), _bytes_of(shadow, "shadow")
    if r.size != s.size:
        raise KernelInputError(f"shadow has {s.size} bytes, region {r.size}", where="shadow")
    full = r.size // pb
    words = pb // 8
    step = max(1, _CHUNK_BYTES // pb)
    found = []
    for p0 in range(0, full, step):
        p1 = min(full, p0 + step)
        a = r[p0 * pb:p1 * pb].view(np.uint64).reshape(-1, words)
        b = s[p0 * pb:p1 * pb].view(np.uint64).reshape(-1, words)
        d = np.flatnonzero((a != b).any(axis=1))
        if d.size:
            if update:
                b[d] = a[d]
            found.append(d + p0)
    if r.size % pb:
        lo = full * pb
        if not np.array_equal(r[lo:], s[lo:]):
            if update:
                s[lo:] = r[lo:]
            found.append(np.array([full]))
    if not found:
        return np.zeros(0, np.uint32)
    return np.concatenate(found).astype(np.uint32)


@functools.lru_cache(maxsize=16)
def _fp_salt(words: int) -> np.ndarray:
    # word index j mixed into each word so that moving data within a page shows
    return np.arange(words, dtype=_U64) * _U64(FP_K1)


def _fmix64(z: np.ndarray) -> np.ndarray:
    z ^= z >> _U64(30)
    z *= _U64(FP_M1)
    z ^= z >> _U64(27)
    z *= _U64(FP_M2)
    z ^= z >> _U64(31)
    return z


def _fp_rows(rows: np.ndarray, pb: int) -> np.ndarray:
    x = rows ^ _fp_salt(pb // 8)
    x *= _U64(FP_K2)
    x ^= x >> _U64(FP_SHIFT)
    h = x.sum(axis=1, dtype=_U64)
    h ^= _U64(pb)
    return _fmix64(h)


def fingerprint_pages(region, *, page_bytes: int, out=None) -> np.ndarray:
    """A 64-bit fingerprint of every page (uint64 per page, 8 bytes per page:
    0.2% of a 4 KiB-paged region).  For words w_j of a page (little-endian u64,
    the last page zero-padded): x_j = (w_j ^ j*K1) * K2, x_j ^= x_j >> 29,
    fp = fmix64(sum_j x_j mod 2^64 ^ page_bytes).  Each x_j is a bijection of
    w_j, so a change confined to one word always changes the fingerprint."""
    pb = check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    n = num_pages(r.size, pb)
    if out is None:
        out = np.empty(n, _U64)
    elif out.shape != (n,) or out.dtype != _U64:
        raise KernelInputError(f"out must be uint64[{n}]", where="fingerprints")
    full = r.size // pb
    step = max(1, _CHUNK_BYTES // pb)
    for p0 in range(0, full, step):
        p1 = min(full, p0 + step)
        out[p0:p1] = _fp_rows(r[p0 * pb:p1 * pb].view(np.uint64).reshape(-1, pb // 8), pb)
    if full < n:
        last = np.zeros(pb, np.uint8)
        last[:r.size - full * pb] = r[full * pb:]
        out[full] = _fp_rows(last.view(np.uint64).reshape(1, -1), pb)[0]
    return out


def fingerprint_dirty(region, fingerprints, *, page_bytes: int, update: bool = True) -> np.ndarray:
    """Pages whose fingerprint differs from `fingerprints` (uint64 per page),
    as sorted uint32 ids; with `update` the stored fingerprints are refreshed."""
    pb = check_page_bytes(page_bytes)
    n = num_pages(_bytes_of(region, "region").size, pb)
    if fingerprints.shape != (n,) or fingerprints.dtype != _U64:
        raise KernelInputError(f"fingerprints must be uint64[{n}]", where="fingerprints")
    new = fingerprint_pages(region, page_bytes=pb)
    d = np.flatnonzero(new != fingerprints)
    if update:
        fingerprints[d] = new[d]
    return d.astype(np.uint32)


def expand_ranges(starts, counts) -> np.ndarray:
    """The integers [starts[i], starts[i] + counts[i]) of every range, in order,
    without a Python loop (int64): how page ranges become page ids."""
    starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def kv_layout(*, block_size: int, kv_heads: int, head_dim: int, dtype_bytes: int,
              num_blocks: int, num_layers: int = 1) -> dict:
    """Byte geometry of a PagedAttention cache [layers][num_blocks, 2,
    block_size, kv_heads, head_dim]: token, half-block (K or V), block and layer
    strides."""
    token = kv_heads * head_dim * dtype_bytes
    half = block_size * token
    block = 2 * half
    return {"token": token, "half": half, "block": block, "layer": num_blocks * block,
            "nbytes": num_layers * num_blocks * block}


def kv_dirty_blocks(block_tables, seq_lens, ckpt_lens, *, block_size: int, kv_heads: int,
                    head_dim: int, dtype_bytes: int, page_bytes: int, num_blocks: int,
                    num_layers: int = 1, advance: bool = True) -> np.ndarray:
    """Pages of a paged KV cache written since the last checkpoint, from the
    block tables alone (cost follows the new tokens, not the cache size).

    block_tables: int32 [seqs, max_blocks] physical block per logical block
    (negative = none); seq_lens: int32 [seqs] tokens held now; ckpt_lens: int32
    [seqs] tokens held at the last checkpoint (a sequence now shorter than that
    was replaced and counts from token 0).  New tokens [start, seq_len) of every
    sequence dirty the pages holding their K and V slots in every layer.
    Returns sorted unique uint32 page ids of the cache region; with `advance`
    ckpt_lens takes seq_lens.  Entries naming a block outside [0, num_blocks) or
    a logical block past the table are an error."""
    pb = check_page_bytes(page_bytes)
    geo = kv_layout(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes, num_blocks=num_blocks, num_layers=num_layers)
    bt = np.asarray(block_tables)
    lens = np.asarray(seq_lens).astype(np.int64)
    prev = np.asarray(ckpt_lens).astype(np.int64)
    if bt.ndim != 2 or lens.shape != (bt.shape[0],) or prev.shape != lens.shape:
        raise KernelInputError("block_tables must be [seqs, max_blocks], seq_lens and "
                               "ckpt_lens [seqs]", where="kv_dirty_blocks")
    start = np.where(lens >= prev, prev, 0)
    active = np.flatnonzero(lens > start)
    if not active.size:
        ids = np.zeros(0, np.uint32)
    else:
        # one row per (sequence, logical block) its new tokens touch, and the
        # token range [t0, t1) of that block they cover
        a, b = start[active], lens[active]
        first = a // block_size
        n = (b - 1) // block_size - first + 1
        seq = np.repeat(active, n)
        lb = expand_ranges(first, n)
        base = lb * block_size
        t0 = np.maximum(np.repeat(a, n), base) - base
        t1 = np.minimum(np.repeat(b, n), base + block_size) - base
        if lb.max() >= bt.shape[1]:
            raise KernelInputError(f"a sequence holds more tokens than its {bt.shape[1]} "
                                   "table entries cover", where="kv_dirty_blocks")
        phys = bt[seq, lb].astype(np.int64)
        if phys.max() >= num_blocks:
            raise KernelInputError(f"block table names block {int(phys.max())} of "
                                   f"{num_blocks}", where="kv_dirty_blocks")
        keep = phys >= 0
        phys, t0, t1 = phys[keep], t0[keep], t1[keep]
        layer = np.arange(num_layers, dtype=np.int64)[:, None, None] * geo["layer"]
        half = np.arange(2, dtype=np.int64)[None, :, None] * geo["half"]
        lo = (layer + half + (phys * geo["block"] + t0 * geo["token"])[None, None, :]).ravel()
        hi = lo + np.broadcast_to((t1 - t0) * geo["token"], (num_layers, 2, phys.size)).ravel()
        first = lo // pb
        ids = np.unique(expand_ranges(first, (hi - 1) // pb - first + 1)).astype(np.uint32)
    if advance:
        ckpt_lens[...] = seq_lens
    return ids


def adapter_dirty_pages(slot_versions, seen_versions, *, pages_per_slot: int, num_pages: int,
                        advance: bool = True) -> np.ndarray:
    """Pages of an adapter region whose slot's version counter moved.

    The adapter region holds `len(slot_versions)` slots (one LoRA adapter or
    one layer's A/B pair each) of `pages_per_slot` pages; whoever writes a slot
    bumps its counter.  Returns sorted uint32 page ids of every slot whose
    version differs from `seen_versions`; with `advance` those are updated.
    Cost follows the number of slots and changed pages, not the region size."""
    v, seen = np.asarray(slot_versions), np.asarray(seen_versions)
    if v.shape != seen.shape or v.ndim != 1:
        raise KernelInputError("slot_versions and seen_versions must be equal 1-D arrays",
                               where="adapter_dirty_pages")
    changed = np.flatnonzero(v != seen)
    if changed.size and (changed.max() * pages_per_slot >= num_pages):
        raise KernelInputError(f"slot {int(changed.max())} starts past page {num_pages}",
                               where="adapter_dirty_pages")
    lo = changed * pages_per_slot
    hi = np.minimum(lo + pages_per_slot, num_pages)
    if advance:
        seen_versions[changed] = v[changed]
    return expand_ranges(lo, hi - lo).astype(np.uint32)


# --- checksums ---------------------------------------------------------------


def _page(r: np.ndarray, pb: int, p: int):
    lo = p * pb
    if lo + pb <= r.size:
        return r[lo:lo + pb]
    page = np.zeros(pb, np.uint8)
    page[:r.size - lo] = r[lo:]
    return page


def crc32c_pages(region, page_ids=None, *, page_bytes: int) -> np.ndarray:
    """CRC32C of each listed page (all pages when page_ids is None), the last
    page zero-padded: uint32 array in the order of page_ids."""
    pb = check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    n = num_pages(r.size, pb)
    ids = None if page_ids is None else _check_page_ids(page_ids, n, strict=False)
    full = r.size // pb
    rows = r[:full * pb].reshape(full, pb)
    if ids is None:
        out = np.empty(n, np.uint32)
        _pagecrc.page_crcs(rows, out[:full])
        if n > full:  # the short last page, zero-padded
            out[full] = _crc32c(_page(r, pb, full))
        return out
    out = np.empty(ids.size, np.uint32)
    whole = ids < full
    if whole.all():
        return _pagecrc.page_crcs(rows[ids], out)   # a copy of the listed pages only
    out[whole] = _pagecrc.page_crcs(rows[ids[whole]])
    out[~whole] = _crc32c(_page(r, pb, full))
    return out


def region_digest(page_crcs) -> int:
    """CRC32C over the little-endian u32 array of a region's page CRCs."""
    return _crc32c(np.ascontiguousarray(page_crcs, dtype="<u4").tobytes())


# --- staging -----------------------------------------------------------------


def new_cursor(used: int = 0) -> np.ndarray:
    """A staging cursor over an empty extent (see CURSOR_*)."""
    c = np.zeros(CURSOR_WORDS, _U64)
    c[CURSOR_USED] = used
    return c


def encode_header(*, length: int, lsn: int, epoch: int, region_id: int, salt: int, body_crc: int,
                  count: int, page_bytes: int, flags: int = 0) -> bytes:
    head = HEADER.pack(length, TYPE_PAGE_BATCH, flags, 0, region_id, lsn, epoch, salt,
                       body_crc, count, page_bytes, 0, 0, 0)
    return head[:60] + struct.pack("<I", _crc32c(head[:60]))


def stage_page_batch(region, page_ids, dst, cursor, *, page_bytes: int, base_lsn: int, epoch: int,
                     region_id: int, salt: int, flags: int = 0) -> int:
    """Write one page-batch record of the listed pages (sorted, unique) into
    `dst` at the cursor, and advance the cursor.

    dst is the granted extent (uint8, in backend memory or a staging buffer);
    the record goes at byte cursor[CURSOR_USED] and its LSN is base_lsn plus
    that offset.  A record that does not fit is not written: cursor[CURSOR_REFUSED]
    counts it.  Returns the record's length (written or not)."""
    pb = check_page_bytes(page_bytes)
    r = _bytes_of(region, "region")
    n = num_pages(r.size, pb)
    ids = _check_page_ids(page_ids, n)
    count = ids.size
    if count == 0:
        raise KernelInputError("a page batch needs at least one page", where="page_ids")
    length = page_batch_length(count, pb)
    off = int(cursor[CURSOR_USED])
    if off % RECORD_ALIGN:
        raise KernelInputError(f"cursor {off} is not 64-byte aligned", where="cursor")
    if off + length > dst.size:
        cursor[CURSOR_REFUSED] += 1
        return length
    rec = dst[off:off + length]
    tables = rec[HEADER_BYTES:HEADER_BYTES + 8 * count]
    tables[:4 * count].view("<u4")[:] = ids
    pay = payload_offset(count)
    rec[HEADER_BYTES + 8 * count:pay] = 0
    payload = rec[pay:].reshape(count, pb)
    full = r.size // pb
    crcs = tables[4 * count:].view("<u4")
    # copy each page into the payload and hash it in the same pass; only the
    # region's last page can be short, and then it is the last id
    whole = count if int(ids[-1]) < full else count - 1
    if whole:
        offsets = ids[:whole].astype(np.int64) * pb
        crcs[:whole] = _pagecrc.gather_page_crcs(payload[:whole].reshape(-1), r, offsets, pb)
    if whole < count:
        payload[-1] = _page(r, pb, int(ids[-1]))
        crcs[-1] = _crc32c(payload[-1])
    rec[:HEADER_BYTES] = np.frombuffer(encode_header(
        length=length, lsn=base_lsn + off, epoch=epoch, region_id=region_id, salt=salt,
        body_crc=_crc32c(tables), count=count, page_bytes=pb, flags=flags), np.uint8)
    cursor[CURSOR_USED] = off + length
    cursor[CURSOR_RECORDS] += 1
    return length


#: most pages `stage_delta` stages (one warp each in one block of 1024 threads)
DELTA_MAX_PAGES = 32


def stage_delta(region, dirty_ids, dst, table, digest: int, *, page_bytes: int, cap_pages: int, base_lsn: int,
                epoch: int, region_id: int, salt: int, flags: int = 0):
    """A checkpoint of a few dirty pages in one step: `dirty_ids` (distinct,
    any order, as a detector lists them) become one page-batch record at
    dst[0] when there are 1..min(cap_pages, DELTA_MAX_PAGES) of them and the
    record fits `dst`; the region's page CRC table `table` takes their CRCs
    and the digest follows it.  Otherwise nothing is written and the table is
    left alone.  Returns (pages found, bytes written, records written, region
    digest after the call); `digest` is the table's digest before it."""
    ids = np.sort(np.asarray(dirty_ids, np.uint32))
    count = int(ids.size)
    length = page_batch_length(count, page_bytes) if count else 0
    if not 0 < count <= min(int(cap_pages), DELTA_MAX_PAGES) or length > _bytes_of(dst, "dst").size:
        return count, 0, 0, int(digest)
    stage_page_batch(region, ids, dst, new_cursor(), page_bytes=page_bytes, base_lsn=base_lsn, epoch=epoch,
                     region_id=region_id, salt=salt, flags=flags)
    old = table[ids].copy()
    table[ids] = dst[HEADER_BYTES + 4 * count:HEADER_BYTES + 8 * count].view("<u4")
    # moved by the changed words alone, as the kernel does (no pass over the table)
    return count, length, 1, region_digest_moved(digest, table.size, ids, old, table[ids])


def region_digest_moved(digest: int, num_pages: int, page_ids, old_crcs, new_crcs) -> int:
    """The region digest after page CRCs `old_crcs` at `page_ids` became
    `new_crcs`, from the digest before, without reading the table: CRC32C is
    affine, so a word changing by d moves the digest by the raw CRC of d shifted
    over the bytes after the word (what stage_delta does on the device)."""
    for p, a, b in zip(np.asarray(page_ids).tolist(), np.asarray(old_crcs).tolist(), np.asarray(new_crcs).tolist()):
        d = int(a) ^ int(b)
        if d:
            digest ^= crc32c_shift(crc32c_raw(struct.pack("<I", d)), 4 * (num_pages - 1 - int(p)))
    return int(digest)


def record_payload_offsets(record_offset: int, count: int, page_bytes: int, positions=None) -> np.ndarray:
    """Byte offsets (uint64) of the payload of pages `positions` (all when None)
    of a page-batch record of `count` pages starting at `record_offset`: the
    `src_offsets` argument of `scatter_pages`."""
    pos = np.arange(count, dtype=_U64) if positions is None else np.asarray(positions, _U64)
    return _U64(record_offset + payload_offset(count)) + pos * _U64(page_bytes)


# --- recovery ------------------------------------------------------------------


def scatter_pages(src, src_offsets, page_ids, region, *, page_bytes: int,
                  expected_crcs=None) -> np.ndarray:
    """Copy page i of the log bytes `src` (at src_offsets[i], page_bytes long)
    into page page_ids[i] of `region` (the last page truncated to the region).

    With expected_crcs every source page is checked first; pages whose CRC32C
    differs are not applied.  Returns the sorted positions i that mismatched
    (int64).  page_ids must be unique (order is free)."""
    pb = check_page_bytes(page_bytes)
    s = _bytes_of(src, "src")
    r = _bytes_of(region, "region")
    n = num_pages(r.size, pb)
    ids = _check_page_ids(page_ids, n, strict=False)
    offs = np.asarray(src_offsets, dtype=np.int64)
    if offs.shape != ids.shape:
        raise KernelInputError("src_offsets and page_ids differ in length", where="src_offsets")
    if offs.size and (offs.min() < 0 or offs.max() + pb > s.size):
        raise KernelInputError("a source page lies outside the log bytes", where="src_offsets")
    if not ids.size:
        return np.zeros(0, np.int64)
    # every source page gathered in one copy (rows of a window view: no index array per byte)
    pages = np.lib.stride_tricks.sliding_window_view(s, pb)[offs]
    ok = np.ones(ids.size, bool)
    if expected_crcs is not None:
        ok = _pagecrc.page_crcs(pages) == np.asarray(expected_crcs, np.uint32)
    full = r.size // pb
    whole = ok & (ids < full)
    r[:full * pb].reshape(full, pb)[ids[whole]] = pages[whole]
    for i in np.flatnonzero(ok & (ids >= full)).tolist():   # the short last page, truncated to the region
        r[full * pb:] = pages[i, :r.size - full * pb]
    return np.flatnonzero(~ok).astype(np.int64)


def check_runs(first, run_crc, crc_table, n: int) -> np.ndarray:
    """`first` as int64, or a one-line KernelInputError: runs that do not start
    at page 0 and ascend, or CRC indices past the end of `crc_table`."""
    first = np.asarray(first, np.int64)
    if n == 0:
        return first
    if first.size == 0 or first[0] != 0 or first[-1] > n or (first.size > 1 and np.any(np.diff(first) < 0)):
        raise KernelInputError("run firsts must start at 0 and ascend within the pages", where="first")
    ends = np.append(first[1:], n) - first   # each run's pages
    last = np.asarray(run_crc, np.int64) + ends
    if np.any(np.asarray(run_crc, np.int64) < 0) or (last.size and int(last.max()) > np.asarray(crc_table).size):
        raise KernelInputError("a run's CRCs lie past the end of the CRC table", where="run_crc")
    return first


def expand_runs(first, run_stage, run_pb, run_id, run_crc, crc_table, n: int) -> tuple:
    """(stage uint64, ids uint32, crcs uint32) for pages 0..n-1 laid out as
    runs: page k belongs to the last run r with first[r] <= k (firsts
    ascending, first[0] == 0) and, with j = k - first[r], lands at staging
    offset run_stage[r] + j * run_pb[r] as page id run_id[r] + j (mod 2**32),
    its stored CRC being crc_table[run_crc[r] + j].  The int64 run arrays are
    one entry per run."""
    first = check_runs(first, run_crc, crc_table, n)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.uint32)
    k = np.arange(n, dtype=np.int64)
    run = np.searchsorted(first, k, side="right") - 1
    j = k - first[run]
    stage = (np.asarray(run_stage, np.int64)[run] + j * np.asarray(run_pb, np.int64)[run]).astype(np.uint64)
    ids = (np.asarray(run_id, np.int64)[run] + j).astype(np.uint32)
    crcs = np.asarray(crc_table, np.uint32)[np.asarray(run_crc, np.int64)[run] + j]
    return stage, ids, crcs


# --- holds (gpu.launch_hold and its kind): a producer stream held at one point ---
# words[0]: holds arrived, words[1]: the newest release, words[2]: waits that
# gave up after their timeout.  A twin does not wait: `released` / `arrived`
# say whether the device's wait would end now, and `timed_out` gives the word
# the device writes when it does not.
HOLD_ARRIVED, HOLD_RELEASE, HOLD_BROKEN = 0, 1, 2


#: the most bytes one row of a batched copy moves (one block of `copy_spans` a row)
COPY_PIECE = 1 << 20


def span_rows(sizes, piece: int = COPY_PIECE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(span, offset, bytes) of each row the spans of `sizes` bytes are cut into,
    at most `piece` bytes a row, in order (int64 arrays; an empty span has none)."""
    if piece <= 0:
        raise KernelInputError(f"a piece of {piece} bytes", where="piece")
    sizes = np.asarray(sizes, np.int64).reshape(-1)
    counts = -(-sizes // piece)
    span = np.repeat(np.arange(sizes.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    offset = (np.arange(span.size, dtype=np.int64) - np.repeat(first, counts)) * piece
    return span, offset, np.minimum(piece, sizes[span] - offset)


def copy_pairs(pairs, what: str = "pairs") -> list:
    """[(src bytes, dst bytes)] of `pairs` ([(src, dst)] arrays of equal byte
    sizes, each C-contiguous), or a one-line KernelInputError naming the pair."""
    out = []
    for i, (src, dst) in enumerate(pairs):
        a, b = _bytes_of(src, f"{what}[{i}] source"), _bytes_of(dst, f"{what}[{i}] target")
        if a.size != b.size:
            raise KernelInputError(f"{what}[{i}]: {a.size} bytes into {b.size}", where=what)
        out.append((a, b))
    return out


def copy_spans(pairs, *, piece: int = COPY_PIECE) -> None:
    """Copy every (src, dst) pair of `pairs` (C-contiguous arrays of equal byte
    sizes, none overlapping another's target), row by row as the kernel cuts
    them (`span_rows`)."""
    flat = copy_pairs(pairs)
    span, offset, nbytes = span_rows([a.size for a, _ in flat], piece)
    for i, o, n in zip(span.tolist(), offset.tolist(), nbytes.tolist()):
        a, b = flat[i]
        b[o:o + n] = a[o:o + n]


def hold_stream(words, seq: int, *, timed_out: bool = False) -> None:
    """The hold's effect on `words` (uint64[3]): it arrives, and either its
    release came (words[1] >= seq) or its wait timed out (broken)."""
    words[HOLD_ARRIVED] += _U64(1)
    if words[HOLD_RELEASE] < _U64(seq) and timed_out:
        words[HOLD_BROKEN] += _U64(1)


def await_holds(words, arrivals: int, *, timed_out: bool = False) -> None:
    """The wait for `arrivals` holds: broken when they had not arrived and it timed out."""
    if words[HOLD_ARRIVED] < _U64(arrivals) and timed_out:
        words[HOLD_BROKEN] += _U64(1)


def release_holds(words, seq: int) -> None:
    words[HOLD_RELEASE] = max(words[HOLD_RELEASE], _U64(seq))

