"""CRC32C of many pages in one call.

A page batch carries one CRC32C per page (FORMAT.md §6.2).  Hashing a record's
pages with one `crc32c` package call each costs about 0.2 µs of call overhead
per page above the hash itself, as much again as hashing a 4 KiB page, so the
log's CPU paths (append, restore, verify) spend half their time in calls.
`_pagecrc.c` hashes all pages of a record in one call (three pages at a time on
the SSE4.2 `crc32` instruction), and can copy each page while hashing it, so a
restore reads the log once and checks exactly the bytes it writes.  It also
finds the records a producer laid back to back by their length words
(`walk_lengths`: an arena's thousands of records in one call, not a loop a
record).

The C file is compiled with the system C compiler on first use into
`$XDG_CACHE_HOME/concordia` (default `~/.cache/concordia`), named by the hash of
its source (written to a temporary name, then renamed: concurrent builders never
see half a library), and called through cffi's ABI mode, which releases the GIL
around every call.  Whenever that is not possible (no compiler, a CPU without
SSE4.2, a failed build, a cache folder that cannot be written, or
`CONCORDIA_PAGECRC=off` in the environment) the same functions run on the
`crc32c` package with identical results.  `BACKEND` says which path is in use
("sse4.2" or "crc32c") and `REASON` why the fallback was taken.  On a CPU with
AVX-512 VPCLMULQDQ the helper hashes pages of 256 bytes or more by carry-less
multiplication (folding) instead of the `crc32` instruction, three to four
times faster; `KERNEL` says which ("vpclmulqdq" or "crc32", None on the
package path), and `CONCORDIA_PAGECRC=crc32` keeps the helper on `crc32`.

Every function takes uint8 numpy arrays whose rows are pages (`span_crcs`: one
flat array and the spans of it to hash) and returns (or fills) a uint32 array
of CRCs; the C code trusts its arguments, so all shapes, strides and offsets
are checked here first.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import platform
import shutil
import struct
import subprocess
import tempfile

import numpy as np
from crc32c import crc32c as _crc32c

from .errors import UsageError

#: records `walk_lengths` finds in one call of the helper (then it calls again from there)
WALK_CHUNK = 4096

#: a header's length word (FORMAT.md §5.1: its first eight bytes)
_LENGTH = struct.Struct("<Q")

#: a record's header bytes (FORMAT.md §5.1; format.RECORD_HEADER_SIZE, whose
#: module imports this one, holds the two equal)
HEADER = 64

SOURCE = pathlib.Path(__file__).with_name("_pagecrc.c")
ENV = "CONCORDIA_PAGECRC"

#: below this many pages one package call per page is cheaper than one call into
#: the library (cffi's call costs about four single-page package calls)
MIN_NATIVE_PAGES = 4
#: ... unless the pages are this large in all: then the call's cost is nothing
#: beside the hashing, which the helper does faster
MIN_NATIVE_BYTES = 16 << 10
#: `span_crcs` on the `crc32` kernel hashes spans of this many bytes or more with
#: the package, which runs three chains of the instruction where the helper runs one
SPAN_PACKAGE_BYTES = 64 << 10


def _use_native(count: int, pb: int) -> bool:
    return _lib is not None and pb > 0 and (count >= MIN_NATIVE_PAGES or count * pb >= MIN_NATIVE_BYTES)

_CDEF = """
int concordia_pagecrc_supported(void);
int concordia_pagecrc_vector(int enable);
void concordia_page_crcs(const void *base, int64_t stride, int64_t count, int64_t page_bytes, void *out);
int64_t concordia_page_batch_tables(const void *pages, int64_t stride, int64_t count, int64_t page_bytes,
                                    const void *ids, int ids_are_i64, void *tables);
int64_t concordia_copy_page_batch(void *tables, int64_t tables_bytes, void *payload, const void *pages,
                                  int64_t stride, int64_t count, int64_t page_bytes, const void *ids, int ids_are_i64);
void concordia_copy_page_crcs(void *dst, const void *src, const void *offsets, int64_t src_stride,
                              int64_t count, int64_t page_bytes, void *out);
void concordia_fold_crcs(const void *crcs, int64_t rows, int64_t count, const void *z, void *out);
void concordia_span_crcs(const void *base, const void *offsets, const void *lengths, int64_t count, void *out);
int64_t concordia_walk_lengths(const void *base, int64_t start, int64_t used, int64_t min_len, int64_t align,
                               void *out, int64_t cap, void *headers, void *end);
"""


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "concordia"


def _build() -> pathlib.Path:
    """Path of the compiled library, building it if needed; raises OSError or
    RuntimeError when it cannot be built."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:16]
    out = cache_dir() / f"libconcordia_pagecrc-{tag}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    except OSError:  # a home without a writable cache: a per-user folder in the temporary one
        out = pathlib.Path(tempfile.gettempdir()) / f"concordia-{os.getuid()}" / out.name
        if out.exists():
            return out
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    try:
        res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError("build failed: " + " ".join((res.stderr or res.stdout).split())[:200])
        from concordia.devmem.dirsync import publish

        publish(tmp, out)  # synced and renamed whole: never a torn helper under the cached name
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    """(ffi, lib) of the compiled helper, or (None, reason)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false", "crc32c"):
        return None, f"{ENV}={os.environ[ENV]}"
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None, f"not an x86 CPU ({platform.machine()})"
    try:
        import cffi

        path = _build()
        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        lib = ffi.dlopen(str(path))
        if not lib.concordia_pagecrc_supported():
            return None, "the CPU lacks SSE4.2"
        return ffi, lib
    except Exception as e:  # any failure: the package path, never a broken import
        return None, f"{type(e).__name__}: {e}"[:200]


_ffi, _lib = _load()
if _ffi is None:
    BACKEND, REASON = "crc32c", _lib
    KERNEL = None
    _lib = None
else:
    BACKEND, REASON = "sse4.2", ""
    _want_fold = os.environ.get(ENV, "").strip().lower() not in ("crc32", "sse4.2")
    KERNEL = "vpclmulqdq" if _lib.concordia_pagecrc_vector(int(_want_fold)) else "crc32"
    _buf = _ffi.from_buffer
    _page_crcs_c = _lib.concordia_page_crcs
    _tables_c = _lib.concordia_page_batch_tables
    _copy_batch_c = _lib.concordia_copy_page_batch
    _copy_c = _lib.concordia_copy_page_crcs
    _fold_c = _lib.concordia_fold_crcs
    _spans_c = _lib.concordia_span_crcs
    _walk_c = _lib.concordia_walk_lengths
    _NULL = _ffi.NULL


def native() -> bool:
    """True when the compiled helper is in use."""
    return _lib is not None


def use_folding(enable: bool) -> bool:
    """Ask the helper to hash by folding (True) or on the `crc32` instruction
    (False), for every later call in this process; returns whether folding is
    in use now (never without the helper or without AVX-512 VPCLMULQDQ).  Both
    give the same CRCs; tests and benchmarks compare them."""
    global KERNEL
    if _lib is None:
        return False
    on = bool(_lib.concordia_pagecrc_vector(int(bool(enable))))
    KERNEL = "vpclmulqdq" if on else "crc32"
    return on


# -- argument checks (the C code trusts what it is given) ---------------------------


def _rows(pages, what: str) -> np.ndarray:
    """`pages` as a 2-D uint8 array whose rows are contiguous bytes."""
    if not isinstance(pages, np.ndarray):
        pages = np.frombuffer(pages, dtype=np.uint8).reshape(1, -1)
    if pages.ndim != 2:
        raise UsageError(f"{what} must be a 2-D array of pages, not of shape {pages.shape}")
    if pages.shape[1] > 1 and pages.strides[1] != pages.itemsize:
        pages = np.ascontiguousarray(pages)
    if pages.dtype != np.uint8:  # rows of any dtype hash as their bytes
        pages = pages.view(np.uint8) if pages.shape[1] else pages.astype(np.uint8)
    return pages


def _out(out, count: int) -> np.ndarray:
    if out is None:
        return np.empty(count, dtype=np.uint32)
    if not isinstance(out, np.ndarray) or out.dtype != np.uint32 or out.shape != (count,) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise UsageError(f"out must be a writable contiguous uint32 array of {count} CRCs")
    return out


def _dst(dst, count: int, page_bytes: int) -> np.ndarray:
    if not isinstance(dst, np.ndarray) or dst.dtype != np.uint8 or dst.nbytes != count * page_bytes \
            or not dst.flags.c_contiguous or not dst.flags.writeable:
        raise UsageError(f"destination must be a writable C-contiguous uint8 array of {count} x {page_bytes} bytes")
    return dst


def _ptr(a: np.ndarray):
    """A cffi pointer to a[0, 0] of a 2-D array with contiguous rows (any row stride)."""
    if a.flags.c_contiguous:
        return _buf(a)
    return _ffi.cast("void *", a.__array_interface__["data"][0])


# -- the package path (also the oracle the tests compare the helper with) ------------


def pure_page_crcs(pages: np.ndarray, out=None, *, release_gil: bool = False) -> np.ndarray:
    """page_crcs on the `crc32c` package: one call per page driven by `map`."""
    pages = _rows(pages, "pages")
    count = pages.shape[0]
    out = _out(out, count)
    if release_gil:
        calls = map(_crc32c, pages, itertools.repeat(0), itertools.repeat(1))
    else:
        calls = map(_crc32c, pages)
    out[:] = np.fromiter(calls, dtype=np.uint32, count=count)
    return out


def pure_span_crcs(base: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, out=None, *,
                   release_gil: bool = False) -> np.ndarray:
    """span_crcs on the `crc32c` package: one call per span."""
    base, offsets, lengths = _spans(base, offsets, lengths)
    out = _out(out, offsets.size)
    mv, mode = memoryview(base), (1 if release_gil else -1)
    out[:] = np.fromiter((_crc32c(mv[o:o + n], 0, mode) for o, n in zip(offsets.tolist(), lengths.tolist())),
                         dtype=np.uint32, count=offsets.size)
    return out


def _spans(base, offsets, lengths) -> tuple:
    """`span_crcs`'s arguments checked: a 1-D contiguous uint8 base, and int64
    offsets and lengths of one size whose spans lie inside it."""
    if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != np.uint8 or not base.flags.c_contiguous:
        raise UsageError("span_crcs needs a 1-D C-contiguous uint8 array to hash spans of")
    offsets, lengths = np.asarray(offsets), np.asarray(lengths)
    for a in (offsets, lengths):
        if a.size and a.dtype.kind not in "iu":
            raise UsageError(f"span_crcs: offsets and lengths must be integers, not {a.dtype}")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if offsets.shape != lengths.shape or offsets.ndim != 1:
        raise UsageError(f"span_crcs: {offsets.size} offsets and {lengths.size} lengths")
    # each bound on its own, so that no sum can wrap past the int64 range
    if offsets.size and (offsets.min() < 0 or lengths.min() < 0 or lengths.max() > base.size
                         or (offsets > base.size - lengths).any()):
        raise UsageError(f"span_crcs: a span lies outside the {base.size} bytes given")
    return base, offsets, lengths


# -- the public functions ----------------------------------------------------------------


def span_crcs(base: np.ndarray, offsets, lengths, out=None) -> np.ndarray:
    """CRC32C of each span [offsets[i], offsets[i] + lengths[i]) of `base` (a
    1-D C-contiguous uint8 array), as a uint32 array (`out` when given): many
    records' payloads in one call, the GIL released while it hashes (the
    package path makes one call per span)."""
    if _lib is None:
        return pure_span_crcs(base, offsets, lengths, out, release_gil=True)
    base, offsets, lengths = _spans(base, offsets, lengths)
    out = _out(out, offsets.size)
    # on the crc32 instruction the helper hashes a span on one chain: the package's three chains
    # take a large one faster (it lets go of the GIL for them too)
    big = np.flatnonzero(lengths >= SPAN_PACKAGE_BYTES) if KERNEL != "vpclmulqdq" else np.empty(0, np.int64)
    if big.size:
        done = pure_span_crcs(base, offsets[big], lengths[big], release_gil=True)
        lengths = lengths.copy()
        lengths[big] = 0
    if offsets.size:
        _spans_c(_buf(base), _buf(offsets), _buf(lengths), offsets.size, _buf(out, require_writable=True))
    if big.size:
        out[big] = done
    return out


def walk_lengths(view: np.ndarray, used: int, *, headers: bool = False):
    """The offsets (int64) of the records laid back to back from byte 0 of
    `view` (a 1-D C-contiguous uint8 array), found by each header's length
    word (FORMAT.md §5.1, its first eight bytes) up to `used` bytes: the walk
    stops before a length under HEADER, not a multiple of HEADER, or running
    past `used`.  The headers' own checks are the caller's.  headers: also
    return their bytes, (offsets, an (n, HEADER) uint8 array), copied as the
    walk meets them (`format.record_headers_at(rows=)` checks them there).
    A call of the helper a WALK_CHUNK records; without it, a loop here with
    the same result."""
    if not isinstance(view, np.ndarray) or view.ndim != 1 or view.dtype != np.uint8 or not view.flags.c_contiguous:
        raise UsageError("walk_lengths takes a 1-D C-contiguous uint8 array")
    used = min(int(used), view.size)
    if _lib is None or used < HEADER:
        offs = pure_walk_lengths(view, used)
        return (offs, view[offs[:, None] + np.arange(HEADER)]) if headers else offs
    offs, heads, start, base = [], [], 0, _buf(view)
    end = np.zeros(1, np.int64)
    while True:  # a few thousand records a call: room for them, not for every 64 bytes of `used`
        cap = min(WALK_CHUNK, (used - start) // HEADER)
        out = np.empty(cap, np.int64)
        rows = np.empty((cap, HEADER), np.uint8) if headers else None
        n = _walk_c(base, start, used, HEADER, HEADER, _buf(out, require_writable=True), cap,
                    _buf(rows, require_writable=True) if headers else _NULL, _buf(end, require_writable=True))
        offs.append(out[:n])
        if headers:
            heads.append(rows[:n])
        if n < cap or n == 0:
            break
        start = int(end[0])  # where the helper stopped: the next record, its length word not read again here
    return (np.concatenate(offs), np.concatenate(heads)) if headers else np.concatenate(offs)


def pure_walk_lengths(view: np.ndarray, used: int) -> np.ndarray:
    """`walk_lengths` in Python (no helper), the offsets alone."""
    used = min(int(used), view.size)
    mv, offs, pos = memoryview(view).cast("B"), [], 0
    length_at = _LENGTH.unpack_from
    while pos + 8 <= used:
        n = length_at(mv, pos)[0]
        if n < HEADER or n % HEADER or n > used - pos:
            break
        offs.append(pos)
        pos += n
    return np.asarray(offs, np.int64)


def page_crcs(pages, out=None, *, release_gil: bool = False) -> np.ndarray:
    """CRC32C of each row of a 2-D uint8 array of pages (rows contiguous, any row
    stride), as a uint32 array (`out` when given).  release_gil asks the package
    path to let other threads run while it hashes (the helper always does)."""
    pages = _rows(pages, "pages")
    count, pb = pages.shape
    if not _use_native(count, pb):
        return pure_page_crcs(pages, out, release_gil=release_gil)
    out = _out(out, count)
    if pb:
        _page_crcs_c(_ptr(pages), pages.strides[0], count, pb, _buf(out, require_writable=True))
    else:
        out[:] = 0
    return out


def page_batch_tables(pages: np.ndarray, ids: np.ndarray, tables: np.ndarray):
    """The page id and page CRC tables of a page batch (FORMAT.md §6.1) written
    into `tables` (a C-contiguous uint8 array of 8 * count bytes) in one call of
    the helper, which also checks the ids; returns the CRC32C of the tables (the
    record header's body CRC), or None when the ids are not strictly increasing
    u32 values or the helper cannot take these arguments (the caller then takes
    the checked path, which names the problem).

    pages: C-contiguous (count, page_bytes) uint8; ids: count uint32 or int64."""
    count = ids.size
    if (_lib is None or ids.dtype not in (np.uint32, np.int64) or not ids.flags.c_contiguous
            or pages.ndim != 2 or pages.shape[0] != count or pages.dtype != np.uint8
            or not pages.flags.c_contiguous or tables.nbytes != 8 * count or count == 0):
        return None
    crc = _tables_c(_buf(pages), pages.strides[0], count, pages.shape[1], _buf(ids), int(ids.dtype == np.int64),
                    _buf(tables, require_writable=True))
    return crc if crc >= 0 else None


def copy_page_batch(record: np.ndarray, pages: np.ndarray, ids: np.ndarray, payload_offset: int):
    """`page_batch_tables` for a record written in place: `record` is the
    record's bytes (a writable C-contiguous uint8 array, header first), its
    tables and their zero padding are written, and the pages are copied to its
    payload at `payload_offset`, each hashed as it is copied.  Returns the
    tables' CRC32C, or None like `page_batch_tables`: then the header slot and
    the payload are untouched (the ids table may hold part of the ids)."""
    count = ids.size
    if (_lib is None or ids.dtype not in (np.uint32, np.int64) or not ids.flags.c_contiguous
            or pages.ndim != 2 or pages.shape[0] != count or pages.dtype != np.uint8
            or not pages.flags.c_contiguous or count == 0 or not pages.shape[1]
            or record.dtype != np.uint8 or not record.flags.c_contiguous
            or payload_offset < HEADER + 8 * count or record.nbytes != payload_offset + pages.nbytes):
        return None
    buf = _buf(record, require_writable=True)
    crc = _copy_batch_c(buf + HEADER, payload_offset - HEADER, buf + payload_offset, _buf(pages), pages.strides[0], count,
                        pages.shape[1], _buf(ids), int(ids.dtype == np.int64))
    return crc if crc >= 0 else None


def copy_page_crcs(dst, src, out=None, *, release_gil: bool = False) -> np.ndarray:
    """Copy the pages of `src` (a 2-D uint8 array, rows contiguous) into `dst` (a
    C-contiguous uint8 array of the same number of bytes, not overlapping `src`)
    and return the CRC32C of each page copied, hashed in the same pass.  With
    the helper, a copy of at least SPLIT_BYTES is shared by a few threads
    (`split`), each taking a run of whole pages: the same bytes and CRCs."""
    src = _rows(src, "source pages")
    count, pb = src.shape
    dst = _dst(dst, count, pb)
    if not _use_native(count, pb):
        np.copyto(dst.reshape(count, pb), src)
        return pure_page_crcs(dst.reshape(count, pb), out, release_gil=release_gil)
    out = _out(out, count)
    flat = dst.reshape(-1)

    def part(lo: int, hi: int) -> None:
        _copy_c(_buf(flat[lo * pb:hi * pb], require_writable=True), _ptr(src[lo:hi]), _NULL, src.strides[0],
                hi - lo, pb, _buf(out[lo:hi], require_writable=True))

    split(part, count, pb)
    return out


#: a copy-and-hash of at least this many bytes is shared by threads (`split`)
SPLIT_BYTES = 4 << 20
#: the least each thread takes
SPLIT_PART_BYTES = 1 << 20
#: the most threads one copy uses (fewer on a machine with fewer cores)
SPLIT_THREADS = 8
_pool = None


def split(part, count: int, page_bytes: int) -> None:
    """Run part(lo, hi) over [0, count) pages: at once below SPLIT_BYTES or on
    one core, else in runs of whole pages on a few threads (the helper
    releases the GIL), the first run on the caller's thread.  Returns when
    every run has; the first failure is raised."""
    global _pool
    nbytes = count * page_bytes
    # most copies are small: those never ask for the core count (a system call each time)
    threads = 1 if nbytes < SPLIT_BYTES else min(SPLIT_THREADS, os.cpu_count() or 1, nbytes // SPLIT_PART_BYTES)
    if threads < 2:
        part(0, count)
        return
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(max_workers=SPLIT_THREADS - 1, thread_name_prefix="concordia-pagecrc")
    bounds = [count * i // threads for i in range(threads + 1)]
    futures = [_pool.submit(part, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    try:
        part(bounds[0], bounds[1])
    finally:
        for f in futures:
            f.result()


def _forget_pool() -> None:
    """A forked child has no threads: it starts a pool of its own when it needs one."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


BLOCK = 64


def gather_page_crcs(dst, root, offsets, page_bytes: int, out=None, *, release_gil: bool = False,
                     crcs: bool = True):
    """Page i of `dst` (a C-contiguous uint8 array of len(offsets) pages) is
    copied from root[offsets[i]:offsets[i] + page_bytes], or zero-filled where
    offsets[i] is negative; returns the CRC32C of each page written (of a zero
    page where it was zero-filled).  `root` is a C-contiguous uint8 array (e.g.
    a whole log mapping) that no destination page overlaps.  With crcs=False
    the package path only copies and returns None (the helper hashes anyway:
    it costs nearly nothing beside the copy)."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    count = offsets.size
    pb = int(page_bytes)
    dst = _dst(dst, count, pb)
    if not isinstance(root, np.ndarray) or root.dtype != np.uint8 or not root.flags.c_contiguous:
        raise UsageError("the source of a gather must be a C-contiguous uint8 array")
    if count and pb and int(offsets.max()) > root.nbytes - pb:
        raise UsageError(f"a gather offset runs past the {root.nbytes}-byte source")
    if _use_native(count, pb):
        out = _out(out, count)
        _copy_c(_buf(dst, require_writable=True), _buf(root), _buf(offsets), 0, count, pb,
                _buf(out, require_writable=True))
        return out
    pages = dst.reshape(count, pb)
    have = offsets >= 0
    if pb % BLOCK == 0 and root.nbytes >= BLOCK and not (offsets[have] % BLOCK).any():
        # one numpy gather of 64-byte blocks (payloads are 64-byte aligned)
        per = pb // BLOCK
        blocks = (np.where(have, offsets, 0) // BLOCK)[:, None] + np.arange(per, dtype=np.int64)
        src = root.reshape(-1)[: root.nbytes // BLOCK * BLOCK].view(np.dtype((np.void, BLOCK)))
        np.take(src, blocks.reshape(-1), out=dst.reshape(-1).view(np.dtype((np.void, BLOCK))), mode="clip")
    else:
        for i in np.flatnonzero(have):
            o = int(offsets[i])
            pages[i] = root[o:o + pb]
    zero = np.flatnonzero(~have)
    if zero.size:
        pages[zero] = 0
    return pure_page_crcs(pages, out, release_gil=release_gil) if crcs else None


__all__ = ["BACKEND", "REASON", "native", "page_crcs", "copy_page_crcs", "gather_page_crcs", "pure_page_crcs"]


def fold_crcs(crcs: np.ndarray, shift_tables: np.ndarray) -> np.ndarray | None:
    """Each row of `crcs` (a C-contiguous (rows, count) uint32 array of the
    CRCs of pages of one length) folded into the CRC of the row's pages laid
    end to end, in one call of the helper: acc = Z(acc) ^ crc from acc = 0,
    where `shift_tables` ((4, 256) uint32, format's zero-shift tables for the
    page length) is Z.  None when the helper is not loaded (the caller folds
    on numpy: format.fold_page_crcs_numpy, the same values)."""
    if _lib is None:
        return None
    if (not isinstance(crcs, np.ndarray) or crcs.dtype != np.uint32 or crcs.ndim != 2
            or not crcs.flags.c_contiguous):
        raise UsageError("crcs must be a C-contiguous 2-D uint32 array")
    z = np.ascontiguousarray(shift_tables, dtype=np.uint32)
    if z.shape != (4, 256):
        raise UsageError("shift_tables must be 4 x 256 uint32")
    rows, count = crcs.shape
    out = np.zeros(rows, np.uint32)
    if rows and count:
        _fold_c(_buf(crcs), rows, count, _buf(z), _buf(out, require_writable=True))
    return out
