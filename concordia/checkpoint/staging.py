"""Staging a checkpoint's records into log space: how dirty pages are cut into
page-batch records (`plan_batches`), how records are packed into extents
(`plan_extents`), the host path that writes one region's records with the
appender (`stage_region`), and the extent pipeline (`Stager`) that drives
either kernel set (`device.DeviceKernels`, `host.HostKernels`) through
reserve, stage at a cursor, finish from the cursor."""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from concordia.gpu_kernels import reference as ref
from concordia.regions.arrays import to_host
from concordia.regions.errors import SessionError
from concordia.regions.region import Region
from concordia.root_error import ConcordiaError

#: most payload bytes in one page-batch record; smaller segments cut smaller
#: records (header, page table, CRC table and payload must fit the segment: batch_pages)
MAX_BATCH_BYTES = 8 << 20
#: the extent pipeline packs a checkpoint's records into extents of at most this
#: many bytes (a larger record gets one of its own); the staging ring holds two
EXTENT_BYTES = 16 << 20


def page_crc_table(view, offset: int, count: int) -> np.ndarray:
    """The page CRC table (u32 per page) of the page-batch record of `count`
    pages at view[offset:] (FORMAT.md §6)."""
    from concordia.wal import format as fmt

    lo = offset + fmt.page_batch_crcs_offset(count)
    return view[lo:lo + 4 * count].view("<u4")


def gather_pages(region: Region, ids: np.ndarray) -> np.ndarray:
    """Host uint8 [len(ids), page_bytes] copy of the listed pages (last page zero-padded)."""
    pb, flat, xp = region.page_bytes, region.flat, region.xp
    full = region.nbytes // pb
    out = np.zeros((ids.size, pb), np.uint8)
    body = ids[ids < full]
    if body.size:
        rows = flat[:full * pb].reshape(full, pb)
        if xp is np:
            np.take(rows, body, axis=0, out=out[:body.size])
        else:
            out[:body.size] = xp.take(rows, xp.asarray(body.astype(np.int64)), axis=0).get()
    if body.size < ids.size:  # the short last page
        tail = flat[full * pb:]
        out[-1, :tail.size] = to_host(tail)
    return out


def stage_region(app, r: Region, ids: np.ndarray, epoch: int) -> int:
    """Write the listed pages as page-batch records of `epoch`, with the
    appender; fill their CRCs into r.crcs (a host table the caller gave the
    region).  Returns record bytes written."""
    from concordia.wal import format as fmt

    if ids.size == 0:
        return 0
    flags = 0  # a full first write is part of its epoch, not a catalogued base (FORMAT.md §12.1)
    written = 0
    for b in plan_batches(r, int(ids.size), app.segment_capacity):
        chunk, length = ids[b.lo:b.hi], b.length
        with app.record(length) as res:  # released if the record fails: the next commit goes on
            if r.on_gpu:
                pages = gather_pages(r, chunk)
                fmt.encode_page_batch_into(res.view, lsn=res.lsn, epoch=epoch, region_id=r.id, salt=res.salt,
                                           page_ids=chunk, pages=pages, page_bytes=r.page_bytes, flags=flags)
            else:
                cursor = ref.new_cursor()
                ref.stage_page_batch(r.flat, chunk, res.view, cursor, page_bytes=r.page_bytes, base_lsn=res.lsn,
                                     epoch=epoch, region_id=r.id, salt=res.salt, flags=flags)
            r.crcs[chunk] = page_crc_table(res.view, 0, int(chunk.size))
        written += length
    return written


@dataclasses.dataclass
class Batch:
    """One page-batch record of a checkpoint: dirty ids [lo, hi) of `region`."""

    region: Region
    lo: int
    hi: int
    length: int


def batch_pages(page_bytes: int, capacity: int, where: str | None = None) -> int:
    """Most pages of one page-batch record: MAX_BATCH_BYTES of payload, fewer
    where the whole record (header, tables, payload) would not fit `capacity`,
    the bytes one segment holds (`Appender.segment_capacity`)."""
    from concordia.wal import format as fmt

    per = min(max(1, MAX_BATCH_BYTES // page_bytes), fmt.page_batch_max_pages(capacity, page_bytes))
    if per < 1:
        raise SessionError(f"a page of {page_bytes} bytes does not fit a log segment ({capacity} bytes usable)",
                           where=where, hint="use smaller pages or a log with larger segments")
    return per


def plan_batches(region: Region, count: int, capacity: int | None = None) -> list[Batch]:
    """The records `count` dirty pages of `region` become (as the host path
    cuts them), each at most `capacity` bytes long (the segment's
    `Appender.segment_capacity`; None: MAX_BATCH_BYTES of payload only)."""
    per = _per_batch(region.page_bytes, capacity)
    return [Batch(region, lo, min(count, lo + per), n)
            for lo, n in zip(range(0, count, per), record_lengths(region.page_bytes, count, capacity))]


def _per_batch(page_bytes: int, capacity: int | None) -> int:
    return max(1, MAX_BATCH_BYTES // page_bytes) if capacity is None else batch_pages(page_bytes, capacity)


def record_lengths(page_bytes: int, count: int, capacity: int | None = None) -> tuple:
    """The lengths of the records `plan_batches` cuts `count` pages of
    `page_bytes` into (`_lengths`, kept)."""
    return _lengths(page_bytes, count, _per_batch(page_bytes, capacity))


@functools.lru_cache(maxsize=1 << 12)
def _lengths(page_bytes: int, count: int, per: int) -> tuple:
    """The lengths of `count` pages cut `per` to a record, kept: a
    checkpoint that may coalesce plans every region at each call
    (`EpochRunner.room`), and the counts repeat."""
    from concordia.wal import format as fmt

    return tuple(fmt.page_batch_length(min(count, lo + per) - lo, page_bytes) for lo in range(0, count, per))


def plan_extents(batches: list, cap: int, length=lambda b: b.length) -> list[list]:
    """Pack records, in order, into extents of at most `cap` bytes (a larger
    record gets an extent of its own); `length(record)` is its bytes (a
    `Batch`, or `length=int` for bare lengths)."""
    out: list[list] = []
    cur: list = []
    used = 0
    for b in batches:
        n = length(b)
        if cur and used + n > cap:
            out.append(cur)
            cur, used = [], 0
        cur.append(b)
        used += n
    if cur:
        out.append(cur)
    return out


def register_mapping(backend):
    """(registration, None) for a mapping CUDA will pin, else (None, why)."""
    from concordia.devmem import cuda_host

    if not backend.gpu_mappable:
        return None, f"{backend.kind} mappings cannot be pinned for the GPU"
    try:
        return cuda_host.register(backend), None
    except ConcordiaError as exc:
        return None, str(exc)


def page_crcs(r: Region):
    """The page CRC table of a region's current contents, where the region lives."""
    if r.on_gpu:
        try:
            from concordia.gpu_kernels import gpu

            if r.device_aligned:
                return gpu.crc32c_pages(r.flat, page_bytes=r.page_bytes)
        except Exception:  # no kernels: the host computes it (the host path converts as needed)
            pass
        return ref.crc32c_pages(to_host(r.flat), page_bytes=r.page_bytes)
    return ref.crc32c_pages(r.flat, page_bytes=r.page_bytes)


class Stager:
    """Stages the page batches of many regions into extents reserved from the
    appender, with one device cursor per extent (the kernels claim their own
    space in it; no host round trip per record), then finishes the extents
    from the cursors and leaves the region digests for the commit.

    mode "mapped": the kernels write the extents in the log mapping itself
    (`registration` makes it addressable), all extents in one round.
    mode "ring": one extent per round, staged into one half of a pinned ring
    while the host copies the previous round out of the other half."""

    def __init__(self, kernels, mode: str, registration):
        self.kernels = kernels
        self.mode = mode
        self.registration = registration
        self.why_ring: str | None = None
        self._ring: list = [None, None]

    @property
    def label(self) -> str:
        return f"{self.kernels.name}-{self.mode}"

    def close(self) -> None:
        self._ring = [None, None]
        if self.registration is not None:
            self.registration.unregister()
            self.registration = None

    def _slot(self, slot: int, nbytes: int):
        buf = self._ring[slot]
        if buf is None or buf[0].size < nbytes:
            buf = self._ring[slot] = self.kernels.staging_buffer(max(nbytes, EXTENT_BYTES))
        return buf

    def run(self, app, owner, regions: list[Region], epoch: int, found=None) -> dict:
        """Detect, stage and finish one epoch's records of `regions`; each
        region's CRC table and digest are set through `owner` (the
        `RegionSet`).  The caller commits.  found: [(ids, count)] per region
        when its detector already ran (a table pass)."""
        k = self.kernels
        reads0 = k.reads
        if found is None:  # a table pass that hands over its pages has ordered itself
            k.order_after_producer()
        t0 = time.perf_counter()
        done, known = {}, None
        if found is None and self.mode == "mapped" and hasattr(k, "delta"):
            quick = [r for r in regions if k.delta_ready(r)]
            if quick:
                done, known = k.delta(app, owner, quick, epoch, self.registration)
                if not known and len(done) == len(regions):  # every region done in one wait
                    t1 = time.perf_counter()
                    return {"pages": {r.name: done[r.name][0] for r in regions},
                            "log_bytes": sum(b for _, b in done.values()), "detect_s": t1 - t0, "stage_s": 0.0,
                            "device_reads": k.reads - reads0}
                regions = [r for r in regions if r.name not in done]
        if found is None:
            found = k.detect(regions, known)
        t1 = time.perf_counter()
        ids, staged, batches = {}, {}, []
        for r, (rid, n) in zip(regions, found):
            if r.crcs is None:
                owner.start_base(r, k.zeros_u32(r.pages))
            else:
                owner.keep_table(r, k.table(r.crcs))
            if n:
                ids[r.name] = rid
                staged[r.name] = k.empty_u32(n)
                batches += plan_batches(r, n, app.segment_capacity)
        cap = min(max([EXTENT_BYTES] + [b.length for b in batches]), app.segment_capacity)
        extents = plan_extents(batches, cap)
        sizes = [sum(b.length for b in e) for e in extents]
        want_digest = [r for r in regions if r.name in staged or r.digest is None]
        if self.mode == "mapped":
            rounds = [list(range(len(extents)))]
        else:
            rounds = [[e] for e in range(len(extents))] or [[]]
        if not extents and not want_digest:
            rounds = []  # a clean epoch: nothing to stage, every digest known
        cursors = k.cursors(max(1, len(extents)))
        digests = k.empty_u32(max(1, len(want_digest)))
        opened: dict = {}
        got_digests = None
        try:
            prev = None
            for i, round_ in enumerate(rounds):
                slot = i % 2
                for e in round_:
                    ext = app.reserve_extent(sizes[e])
                    opened[e] = ext
                    if self.mode == "mapped":
                        dst = k.mapped_view(self.registration, ext)
                    else:
                        dst = self._slot(slot, sizes[e])[1][:sizes[e]]
                    for b in extents[e]:
                        r = b.region
                        k.stage(r, ids[r.name][b.lo:b.hi], dst, cursors[e], staged[r.name][b.lo:b.hi],
                                base_lsn=ext.lsn, epoch=epoch, region_id=r.id, salt=ext.salt)
                fetch = [cursors[round_[0]:round_[-1] + 1]] if round_ else []
                if i == len(rounds) - 1:  # the CRC tables and digests follow the last records
                    for j, r in enumerate(want_digest):
                        if r.name in staged:
                            k.update(r.crcs, ids[r.name], staged[r.name])
                        k.digest_into(r.crcs, digests[j:j + 1])
                    fetch.append(digests)
                handle = k.fetch(slot, fetch)
                if prev is not None:
                    self._finish(app, extents, sizes, opened, *prev)
                prev = (round_, slot, handle)
            if prev is not None:
                got_digests = self._finish(app, extents, sizes, opened, *prev)[-1]
        except BaseException:
            self._abort(app, opened)
            raise
        for j, r in enumerate(want_digest):
            owner.staged(r, got_digests[j])
        t2 = time.perf_counter()
        pages = {name: n for name, (n, _) in done.items()}
        pages.update({r.name: int(n) for r, (_, n) in zip(regions, found)})
        return {"pages": pages, "log_bytes": sum(sizes) + sum(b for _, b in done.values()),
                "detect_s": t1 - t0, "stage_s": t2 - t1, "device_reads": k.reads - reads0}

    def _finish(self, app, extents, sizes, opened, round_, slot, handle) -> list:
        """Wait for one round, check its cursors, copy ring halves into their
        extents and finish them.  Returns the fetched arrays."""
        got = self.kernels.wait(handle)
        if round_:
            cur = got[0].reshape(-1, 4)
            for j, e in enumerate(round_):
                used, records, refused = (int(x) for x in cur[j, :3])
                ext = opened[e]
                if refused or used != sizes[e] or records != len(extents[e]):
                    raise SessionError(f"staging wrote {records} records in {used} bytes ({refused} refused), "
                                       f"expected {len(extents[e])} in {sizes[e]}",
                                       where=f"segment {ext.segment} @ {ext.offset:#x}")
                if self.mode == "ring":
                    np.copyto(ext.view[:used], self._ring[slot][0][:used])
                app.finish_extent(ext, used, records)
                del opened[e]
        return got

    def _abort(self, app, opened) -> None:
        """Close the extents of a failed checkpoint as padding, so the appender
        can go on (their epoch never commits)."""
        try:
            self.kernels.sync()  # nothing may still be writing into the mapping
        except Exception:
            pass
        for ext in opened.values():
            try:
                app.finish_extent(ext, 0, 0)
            except Exception:
                pass
        opened.clear()
