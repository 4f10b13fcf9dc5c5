"""The numpy twins behind the extent pipeline (`HostKernels`): the same calls
as `device.DeviceKernels`, on numpy arrays, results ready at once."""

from __future__ import annotations

import time

import numpy as np

from concordia.checkpoint import detect
from concordia.checkpoint.staging import page_crc_table
from concordia.gpu_kernels import reference as ref
from concordia.regions.arrays import to_host
from concordia.regions.region import Region


class HostKernels:
    """The numpy twins behind the same pipeline (numpy regions with staging=
    "mapped" or "ring"): "device" arrays are numpy arrays and results are ready
    at once."""

    name = "cpu"
    xp = np
    failed = None

    def __init__(self):
        self.reads = 0

    def prepare(self, r: Region) -> bool:
        return True

    def detect(self, regions, known=None) -> list:
        out = []
        for r in regions:
            ids = detect.dirty_pages(r, advance=True)
            out.append((ids, int(ids.size)))
        return out

    def empty_u32(self, n):
        return np.empty(n, np.uint32)

    def zeros_u32(self, n):
        return np.zeros(n, np.uint32)

    def cursors(self, n):
        return np.zeros((n, 4), np.uint64)

    def table(self, crcs):
        return to_host(crcs)

    def stage(self, r: Region, ids, dst, cursor, crcs, **kw) -> None:
        off = int(cursor[ref.CURSOR_USED])
        ref.stage_page_batch(r.flat, ids, dst, cursor, page_bytes=r.page_bytes, **kw)
        if int(cursor[ref.CURSOR_USED]) != off:  # written, not refused: its CRC table
            n = int(ids.size)
            crcs[:] = page_crc_table(dst, off, n)

    def mapped_view(self, registration, ext):
        return ext.view

    def staging_buffer(self, nbytes: int):
        buf = np.zeros(nbytes, np.uint8)
        return buf, buf

    def update(self, table, ids, crcs) -> None:
        table[ids] = crcs

    def digest_into(self, table, out) -> None:
        out[0] = ref.region_digest(table)

    def fetch(self, slot: int, arrays: list):
        return [np.array(a) for a in arrays]

    def wait(self, handle) -> list:
        return handle

    def sync(self) -> None:
        pass

    def order_after_producer(self, producer=None) -> None:
        """Host arrays: the caller's writes are done when it calls checkpoint()."""

    def table_pass(self, table, owner, registration=None, stager=None):
        """The pass that checkpoints every row of `table` at once (mapped mode)."""
        return HostTablePass(table, owner, stager)


class HostTablePass:
    """The numpy twin of `device.DeviceTablePass`: the same table, dirty
    pages, plan and records, region by region where the device works in one
    launch.
    Regions are numpy arrays whose CRC tables (`Region.crcs`) are numpy."""

    label = "cpu-mapped"  # the mapped path: records written in the log mapping itself

    def __init__(self, table, owner, stager=None):
        self.table = table
        self.owner = owner    # the RegionSet
        self.stager = stager  # stages an epoch larger than a segment region by region
        self.last_counts = np.zeros(len(table), np.int64)  # each row's pages in the last `plan_epoch`

    def dirty(self) -> np.ndarray:
        """The epoch's dirty pages (sorted page-space ids, int64), every
        detector advanced (group by group, as the device launches them).
        Positions rows (DET_POSITIONS: their length read from its word,
        table.cu's table_positions) name the same pages as when the host lists
        them.  Each row's pages are found, never scanned for: a decode step
        costs its new pages, not the cache's (as on the device)."""
        from concordia.checkpoint.table import DET_LISTED, DET_POSITIONS

        t = self.table
        first = t.entries["first_page"]
        parts = []
        for (det, _), rows in t.groups.items():
            if det in (DET_LISTED, DET_POSITIONS):  # listed on the host as the device pass lists them
                parts.append(detect.listed_pages([t.regions[i] for i in rows.tolist()], first[rows]).astype(np.int64))
                continue
            for i in rows.tolist():
                parts.append(int(first[i]) + detect.dirty_pages(t.regions[i], advance=True).astype(np.int64))
        if not parts:
            return np.zeros(0, np.int64)
        # rows hold disjoint pages, each row's mostly in order: a merge of sorted runs, a page named twice
        # (a listing may repeat one) kept once, as a flag would keep it
        ids = np.sort(np.concatenate(parts), kind="stable")
        if ids.size > 1:
            keep = np.empty(ids.size, bool)
            keep[0] = True
            np.not_equal(ids[1:], ids[:-1], out=keep[1:])
            if not keep.all():
                ids = ids[keep]
        return ids

    def hand_back(self) -> None:
        """Another path runs next: the regions take their digests from the table."""
        self.table.write_back(self.owner)

    def launch(self, app, epoch: int, *, defer: bool = False, commit: bool = False):
        """Detect, plan and stage the epoch's records into one extent, left
        unfinished for `complete` (the device pass's protocol: here the
        records are written by the time this returns, so any launch may be
        deferred when asked).  An epoch larger than a segment is staged region
        by region and finished here.  commit (with defer): write the epoch's
        commit record after its records as well (`table.write_commit`, the
        twin of table.cu's table_commit); `Launched.committed` says so."""
        from concordia.checkpoint.table import Launched, TableResult, abandon, write_commit

        t = self.table
        e = t.entries
        t0 = time.perf_counter()
        ids, counts, recs, used = self._detect_and_plan()
        t1 = time.perf_counter()
        if used > app.segment_capacity and self.stager is not None:
            starts = np.cumsum(counts) - counts
            first = e["first_page"].astype(np.int64)
            found = [((ids[s:s + c] - f).astype(np.uint32), int(c))
                     for s, c, f in zip(starts.tolist(), counts.tolist(), first.tolist())]
            t.write_back(self.owner)
            got = self.stager.run(app, self.owner, t.regions, epoch, found=found)
            t.digests[:] = [r.digest for r in t.regions]
            return Launched(None, epoch, t0, t1, time.perf_counter(), defer, counts=counts, recs=recs, used=used,
                            done=TableResult(counts, got["log_bytes"], t1 - t0, time.perf_counter() - t1, 0))
        ext = None
        commit = commit and defer
        if used or commit:
            ext = app.reserve_extent(used + (t.commit_length if commit else 0))
            try:
                self._stage(ext.view, ids, recs, lsn=ext.lsn, salt=ext.salt, epoch=epoch)
                if commit:
                    self._digests(counts)
                    write_commit(t, ext.view, used, int(recs.size), lsn=ext.lsn, epoch=epoch, salt=ext.salt,
                                 prev_commit=app.last_commit_lsn)
            except BaseException:
                abandon(app, ext)
                raise
        return Launched(ext, epoch, t0, t1, time.perf_counter(), defer, commit, counts=counts, recs=recs, used=used)

    def _detect_and_plan(self):
        """(the epoch's sorted dirty pages, each row's count, its records, their bytes):
        every detector advanced (`detect`), the records laid out (`table.plan_records`)."""
        from concordia.checkpoint.table import counts_of, plan_bytes, plan_records

        t = self.table
        ids = self.dirty()
        counts = counts_of(t.entries, ids, t.total_pages)
        recs = plan_records(t.entries, counts)
        return ids, counts, recs, plan_bytes(recs)

    def _stage(self, view, ids, recs, *, lsn: int, salt: int, epoch: int) -> None:
        """The records of the plan `recs` into `view` (byte 0 at LSN `lsn`),
        each page's CRC into its region's table."""
        t = self.table
        cursor = ref.new_cursor()
        first = t.entries["first_page"].astype(np.int64)
        for rec in recs.tolist():  # (lo, offset, length, region, count)
            lo, off, _, row, n = rec
            r = t.regions[row]
            local = (ids[lo:lo + n] - first[row]).astype(np.uint32)
            cursor[ref.CURSOR_USED] = off
            ref.stage_page_batch(r.flat, local, view, cursor, page_bytes=r.page_bytes,
                                 base_lsn=lsn, epoch=epoch, region_id=r.id, salt=salt)
            r.crcs[local] = page_crc_table(view, off, n)

    def plan_epoch(self) -> tuple:
        """An arena epoch's first half (`Arena.take`), with no appender: the
        detectors moved on and the records laid out; (ids, counts, records,
        their bytes), for `write_epoch`.  Records and commit that do not fit
        the arena are not written (as table.cu's plan says `fits` 0; the arena
        calls the epoch lost)."""
        plan = self._detect_and_plan()
        self.last_counts = plan[1]  # each row's pages (the device pass's mailbox counts)
        return plan

    def write_epoch(self, plan: tuple, view, *, lsn: int, salt: int, epoch: int, prev_commit: int) -> int:
        """An arena epoch's second half: the planned records and then the
        commit record after them (`table.write_commit`) into `view` (byte 0
        at LSN `lsn`, room checked by the caller); the record bytes before
        the commit."""
        from concordia.checkpoint.table import write_commit

        t = self.table
        ids, counts, recs, used = plan
        self._stage(view, ids, recs, lsn=lsn, salt=salt, epoch=epoch)
        self._digests(counts)
        write_commit(t, view, used, int(recs.size), lsn=lsn, epoch=epoch, salt=salt, prev_commit=prev_commit)
        t.last_bytes = used
        return used

    def _digests(self, counts) -> None:
        t = self.table
        for i in np.flatnonzero(counts).tolist():
            t.digests[i] = ref.region_digest(t.regions[i].crcs)

    def complete(self, app, got, verify=None):
        """Finish the launched epoch's extent; the table's digests follow.
        verify(): as the device pass's `complete` takes it."""
        from concordia.checkpoint.table import TableResult, abandon

        if got.done is not None:
            return got.done
        t = self.table
        tc = time.perf_counter()
        commit_lsn = 0
        if got.ext is not None:
            offsets, records, used = got.recs["offset"], int(got.recs.size), got.used
            if got.committed:  # the commit record the launch wrote is the extent's last record
                offsets, records, used = np.append(offsets, used), records + 1, used + t.commit_length
                commit_lsn = got.ext.lsn + got.used
            try:
                if verify is not None:
                    verify()
                app.finish_extent(got.ext, used, records, offsets=offsets, trim=got.committed)
            except BaseException:
                abandon(app, got.ext)
                raise
            if not got.committed:
                self._digests(got.counts)
        t.last_bytes = got.used
        return TableResult(got.counts, got.used, got.t1 - got.t0, (got.t2 - got.t1) + (time.perf_counter() - tc), 0,
                           commit_lsn)
