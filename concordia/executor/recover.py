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
    if region_at is not None and (np.asarray(region_at, np.uint64) % 16).any():
        return True
    if not runs.size:
        return pages != 0
    # the kernel's checks (recover_refused, then cx_recover's for each page j < n of a run) in its
    # unsigned arithmetic, a run at a time: n <= (L - off) / pb for j < (L - off) / pb, and so on
    u = np.uint64
    first, pb, region = runs["first"], runs["page_bytes"], runs["region"]
    if (first[0] != 0 or (first[1:] <= first[:-1]).any() or first[-1] >= u(pages) or (pb == 0).any()
            or (pb % 16).any() or (pb >= u(1 << 31)).any() or (region >= u(len(region_bytes))).any()):
        return True
    n = counts(runs, pages).astype(u)
    off, ids, crc = runs["off"], runs["id"], runs["crc"]
    with np.errstate(over="ignore"):   # (a wrapped difference is masked where its operand is out of range)
        room = np.where(off <= u(log_bytes), (u(log_bytes) - off) // pb, u(0))
        fit = np.asarray(region_bytes, u)[region.astype(np.intp)] // pb
        crcs = u(n_crcs if n_crcs is not None else 1 << 63)
        return bool((off > u(log_bytes)).any() or (n > room).any() or (ids >= fit).any()
                    or (n > np.where(ids < fit, fit - ids, u(0))).any() or (crc >= crcs).any()
                    or (n > np.where(crc < crcs, crcs - crc, u(0))).any() or ((u(log_at) + off) % u(16)).any())


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
