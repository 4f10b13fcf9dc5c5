"""The RECOVER task's descriptor and its numpy twin.

A RECOVER task (executor.cu built with CX_RECOVER; `Op.RECOVER`) names one
descriptor (`RECOVER_DESC`): the pages a recovery plan reads, as runs
(`RUN`: pages of one record whose log rows and page ids both follow on, the
transfer layout of `restore.device`), the stored CRC32C of each page (one
table, each run's first page at its `crc` index), and each region's array
(`base`, `bytes`: a recovery's own arrays, every page whole).  Page k of the
plan belongs to the last run whose `first` is at most k.  The handler copies
each page from the log mapping (`log`: the address of its byte 0) to page
`id` of its region, computes the page's CRC32C from what it wrote and sets
`bad[k]` where it differs from the stored one; the completion counts the
pages applied, the bytes read and (as lsn_first) the pages damaged.  The caller's targets are written by
the host afterwards, from these arrays, only once every page and digest
checked out (`restore.ring`).

`apply_runs` is the handler's twin on numpy arrays; `cpu.recover_handler`
runs it over raw host addresses, as the device handler reads device
addresses, for the CPU executor (`cpu.numpy_operators`).
"""

from __future__ import annotations

import numpy as np

#: executor.cu: struct cx_recover_run
RUN = np.dtype([(name, "<u8") for name in ("first", "off", "id", "crc", "page_bytes", "region")])

#: executor.cu: struct cx_recover_desc
RECOVER_DESC = np.dtype([(name, "<u8") for name in (
    "log", "log_bytes", "runs", "n_runs", "pages", "crc_table", "n_crcs", "regions", "n_regions", "bad")])


def runs_table(first, off, page_id, crc, page_bytes, region) -> np.ndarray:
    """The `RUN` rows of a recovery's runs (one value a run in each argument, ascending `first`)."""
    out = np.empty(len(first), RUN)
    for name, col in zip(RUN.names, (first, off, page_id, crc, page_bytes, region)):
        out[name] = np.asarray(col, np.int64)
    return out


def counts(runs: np.ndarray, pages: int) -> np.ndarray:
    """Pages of each run (its `first` to the next run's, the last to `pages`)."""
    return np.diff(np.append(runs["first"].astype(np.int64), pages))


def out_of_bounds(runs: np.ndarray, pages: int, log_bytes: int, region_bytes, log_at: int = 0,
                  region_at=None, n_crcs: int | None = None) -> bool:
    """Whether a run reads past the log, writes past its region (`region_bytes`
    a region) or reads past the CRC table (`n_crcs` entries), a page size is
    not a multiple of 16 below 2^31, a source or region is not 16-byte
    aligned (`log_at`, `region_at`: the addresses of the log's byte 0 and of
    each region), or the runs do not tile pages 0..pages-1 (first pages from
    0, rising strictly below `pages`).  The twin refuses such a descriptor
    whole (BAD_ARGS) and writes nothing; the kernel refuses it too: the
    tiling and the regions' alignment before launching (`recover_refused`),
    the rest page by page, the other pages landing in the recovery's own
    arrays, never a target."""
    if region_at is not None and any(int(r) % 16 for r in region_at):
        return True
    if not runs.size:
        return pages != 0
    first = runs["first"].astype(np.int64)
    n = counts(runs, pages)
    pb = runs["page_bytes"].astype(np.uint64)
    region = runs["region"].astype(np.uint64)
    if (first[0] != 0 or (n <= 0).any() or (pb == 0).any() or (pb % 16).any() or (pb >= 1 << 31).any()
            or int(region.max()) >= len(region_bytes)):
        return True
    pb, region = pb.astype(np.int64), region.astype(np.int64)
    off, ids = runs["off"].astype(object), runs["id"].astype(object)   # (Python integers: no overflow)
    crc = runs["crc"].astype(object)
    ends = [(i + c) * b for i, c, b in zip(ids, n.tolist(), pb.tolist())]
    if any(o + c * b > log_bytes for o, c, b in zip(off, n.tolist(), pb.tolist())):
        return True
    if any(e > int(region_bytes[g]) for e, g in zip(ends, region.tolist())):
        return True
    if n_crcs is not None and any(k + c > n_crcs for k, c in zip(crc, n.tolist())):
        return True
    return any((int(log_at) + int(o)) % 16 for o in off)


def apply_runs(log: np.ndarray, runs: np.ndarray, crc_table: np.ndarray, regions: list, bad: np.ndarray) -> tuple:
    """The RECOVER handler on numpy: each run's pages from `log` (uint8, the
    mapping from byte 0) into `regions` (uint8 arrays, whole pages, indexed
    by the runs' `region`), each page's CRC32C computed from what was written
    and held to `crc_table`; `bad` (uint8 a page) says which differed.
    Returns (pages applied, bytes read, pages damaged), as the completion
    does; None, with nothing written, for runs `out_of_bounds` refuses."""
    from concordia.gpu_kernels import reference as ref

    if out_of_bounds(runs, bad.size, log.size, [r.size for r in regions], log.ctypes.data,
                     [r.ctypes.data for r in regions], crc_table.size):
        return None
    applied = read = damaged = 0
    for r, n in zip(runs.tolist(), counts(runs, bad.size).tolist()):
        first, off, pid, crc, pb, region = (int(v) for v in r)
        dst = regions[region][pid * pb:(pid + n) * pb]
        dst[:] = log[off:off + n * pb]
        wrong = (ref.crc32c_pages(dst, page_bytes=pb) != crc_table[crc:crc + n]).astype(np.uint8)
        bad[first:first + n] = wrong
        damaged += int(wrong.sum())
        applied += n - int(wrong.sum())
        read += n * pb
    return applied, read, damaged
