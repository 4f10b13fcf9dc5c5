"""The appender: hands out space in the current segment (straight views into
backend memory, the bytes GPU kernels fill in place), persists what was
written, and makes epochs durable by the commit protocol (FORMAT.md §10):

    records persisted  ->  commit record written  ->  commit record persisted

One appender per volume, one thread.  A reservation is a promise: `commit`
refuses while any reservation is neither persisted nor finished, because a
commit must never precede a record it could depend on.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import numpy as np
from crc32c import crc32c as _crc32c

from . import format as F
from . import pagecrc as _pagecrc
from .errors import CorruptionError, LogFullError, RecordTooLargeError, UsageError, WalError, WriterStoppedError
from .volume import SegmentInfo, Volume

_ids = itertools.count(1)


_ZERO_HEADER = bytes(F.RECORD_HEADER_SIZE)

#: written bytes between two `start_writeback` calls on a page-cache file: large enough
#: that the call (some 20-40 µs in a virtual machine) is rare, small enough that the
#: device is busy while the epoch is still being written
WRITEBACK_BYTES = 1 << 20


def _page_rows(pages, count: int, page_bytes: int):
    """`pages` as a C-contiguous (count, page_bytes) uint8 array without a copy,
    or None when it is not one (the encoder then copies and checks it)."""
    if not isinstance(pages, np.ndarray) or not pages.flags.c_contiguous or pages.nbytes != count * page_bytes:
        return None
    return pages.reshape(-1).view(np.uint8).reshape(count, page_bytes)


@dataclass
class Reservation:
    """Space for one record (or, as an Extent, many) in backend memory.

    view:    writable uint8 array over exactly the reserved bytes (no copy)
    offset:  absolute offset of view[0] in the backend mapping
    lsn:     LSN of view[0]; a record at view[k] has lsn + k
    salt:    the segment's salt, to be written into each record header
    segment: physical segment index
    """

    view: np.ndarray
    offset: int
    lsn: int
    salt: int
    segment: int
    length: int
    id: int = 0
    extent: bool = False


class Extent(Reservation):
    pass


class Appender:
    def __init__(self, vol: Volume, *, segment: SegmentInfo | None, pos: int | None,
                 last_committed_epoch: int = 0, last_commit_lsn: int = 0):
        self.vol = vol
        self.backend = vol.backend
        self.seg = segment
        self.pos = pos  # absolute offset of the next free byte in self.seg
        self.outstanding: dict[int, Reservation] = {}
        self.stats: dict[int, list] = {}  # epoch -> [records, bytes, first_lsn]
        self.last_committed_epoch = last_committed_epoch
        self.last_commit_lsn = last_commit_lsn
        self._pmem = self.backend.persist_path == "libpmem"
        #: one sync per commit (records and commit record together, the commit flagged
        #: ONE_SYNC) where a sync costs a device round trip: msync tiers
        self.one_sync = self.backend.persist_path == "msync"
        #: why the writer stopped (a sync or roll over failed), or None: after a
        #: failed sync what reached the media is unknown (the kernel may have
        #: dropped the pages it could not write and report the next sync clean),
        #: so nothing more is appended; a reopen recovers what is whole
        self.stopped: str | None = None
        self._dirty: list[list[int]] = []  # [start, end) ranges to persist at the next commit
        #: page-cache files: CPU-encoded records go in with pwritev from the caller's
        #: pages (no page fault per page after each msync); the mapping stays for reads
        self._write_at = getattr(self.backend, "write_at", None)
        self.on_write = None  # called after every record write (the Log's rescan flag)
        self._heads: dict[int, np.ndarray] = {}  # page count -> reused header+tables buffer
        #: page-cache files: start writing records to the device every WRITEBACK_BYTES
        #: while later ones are still being hashed and written, so the commit's sync
        #: waits only for the tail of the epoch (`FileBackend.start_writeback`)
        self._start_writeback = getattr(self.backend, "start_writeback", None) if self.one_sync else None
        self.writeback_bytes = WRITEBACK_BYTES
        self._kicked = 0  # offset up to which writeback of the last dirty range was started
        #: the next segment's header, written by a commit and persisted by its sync
        #: (`Volume.prepare_segment`), so that the roll over needs one sync, not two;
        #: set only once that sync has returned
        self._prepared: SegmentInfo | None = None

    # -- space --------------------------------------------------------------------
    def _check_running(self) -> None:
        if self.stopped is not None:
            raise WriterStoppedError(f"the log writer stopped after {self.stopped}", where=self.backend.where,
                                     hint="reopen the log: recovery keeps every commit that is whole on the media")

    def stop_after(self, what: str, exc: BaseException) -> None:
        """Stop the writer as a failed write does (WriterStoppedError from
        here on): a producer that may still write into an extent it was given
        (a device that did not finish) leaves the log as a crash would."""
        self._stop(what, exc)

    def _stop(self, what: str, exc: BaseException) -> None:
        one = exc.one_line() if hasattr(exc, "one_line") else f"{type(exc).__name__}: {exc}"
        self.stopped = f"a failed {what} ({one})"

    def _persist(self, off: int, n: int) -> None:
        try:
            self.backend.persist(off, n)
        except Exception as exc:
            self._stop("sync", exc)
            raise

    @property
    def segment_capacity(self) -> int:
        """The largest record (or extent) one segment holds."""
        return self.vol.segment_bytes - F.SEGMENT_HEADER_SIZE

    @property
    def segment_rest(self) -> int:
        """Bytes a reservation can take now without rolling over (0 before the first segment)."""
        return 0 if self.seg is None else self.seg.offset + self.seg.nbytes - self.pos

    def _roll(self) -> None:
        old = self.seg
        if old is not None and self.pos + F.RECORD_HEADER_SIZE <= old.offset + old.nbytes:
            # an explicit end marker: the old segment's data ends here (with pwritev on a
            # page-cache file: a store would fault on a page under writeback)
            if self._write_at is not None:
                self._write_at(self.pos, [_ZERO_HEADER])
            else:
                F.record_header_bytes(self.backend.array, self.pos)[:] = 0
            if self.one_sync and not self._pmem:
                # made durable by the next commit's one sync with the records before it:
                # until then the slot reads zero or stale, a clean end either way
                # (FORMAT.md §10.1), and a sync of its own costs a device round trip
                self._defer(self.pos, 64)
            else:
                self.backend.persist(self.pos, 64)
        prepared, self._prepared = self._prepared, None
        self.seg = self.vol.take_segment(old, prepared=prepared)
        self.pos = self.seg.offset + F.SEGMENT_HEADER_SIZE

    def _space(self, nbytes: int) -> int:
        """Offset of `nbytes` (a multiple of 64) taken at the write position,
        rolling over first when they do not fit the current segment."""
        self._check_running()
        n = nbytes
        if n <= 0:
            raise UsageError(f"cannot reserve {nbytes} bytes")
        if n > self.segment_capacity:
            raise RecordTooLargeError(f"{n} bytes do not fit one segment ({self.segment_capacity} usable)",
                                      hint="split the batch or create the log with larger segments")
        if self.seg is None or self.pos + n > self.seg.offset + self.seg.nbytes:
            try:
                self._roll()
            except LogFullError:
                raise
            except Exception as exc:
                self._stop("roll over", exc)
                raise
        off = self.pos
        self.pos += n
        return off

    def _next_slot_free(self) -> bool:
        """Whether a header slot follows the write position in the current segment."""
        return self.pos + F.RECORD_HEADER_SIZE <= self.seg.offset + self.seg.nbytes

    def _take(self, nbytes: int, cls, zero_next: bool = True) -> Reservation:
        n = F.align64(int(nbytes))
        off = self._space(n)
        seg = self.seg
        if zero_next and self._next_slot_free():
            # the header slot after this reservation starts zero, so that after a crash
            # the data ends cleanly there even in a recycled segment full of stale bytes
            F.record_header_bytes(self.backend.array, self.pos)[:] = 0
        res = cls(self.backend.array[off:off + n], off, seg.lsn(off), seg.salt,
                  seg.index, n, next(_ids), cls is Extent)
        self.outstanding[res.id] = res
        return res

    def reserve(self, nbytes: int) -> Reservation:
        """Space for one record of `nbytes` (rounded up to 64).  Fill res.view with
        the record (header lsn = res.lsn, salt = res.salt), then `persist(res)`."""
        return self._take(nbytes, Reservation)

    def reserve_extent(self, nbytes: int) -> Extent:
        """Space for many records written back to back by a producer (e.g. a GPU
        kernel); close it with `finish_extent`."""
        return self._take(nbytes, Extent)

    # -- making written records durable ----------------------------------------------
    def _account(self, res: Reservation, used: int | None, records: int | None) -> int:
        """Walk the record headers written into `res`, check them (a producer bug is
        caught here, not at recovery) and count them per epoch.  Returns the bytes used."""
        mv = memoryview(res.view)
        limit = res.length if used is None else used
        if limit % 64 or not 0 <= limit <= res.length:
            raise UsageError(f"used bytes {used} must be a multiple of 64 within the {res.length}-byte reservation")
        pos, n = 0, 0
        unpack = F.RECORD_HEADER.unpack_from
        while pos < limit:
            h = unpack(mv, pos)
            if h[0] == 0 and used is None:
                break
            problem = F.check_record_header_bytes(mv, pos)
            if problem is None and (h[5] != res.lsn + pos or h[7] != res.salt):
                problem = (f"record header names lsn 0x{h[5]:x} salt 0x{h[7]:08x}, "
                           f"expected lsn 0x{res.lsn + pos:x} salt 0x{res.salt:08x}")
            if problem is None and pos + h[0] > limit:
                problem = f"record of {h[0]} bytes overruns the {limit} bytes used"
            if problem:
                raise UsageError(f"invalid record written into a reservation: {problem}",
                                 where=f"segment {res.segment} @ 0x{res.offset + pos:x}")
            if F.counted_in_epoch(h[1], h[2]):
                self._count(h[6], h[0], h[5])
            pos += h[0]
            n += 1
        if records is not None and records != n:
            raise UsageError(f"extent holds {n} records, producer said {records}",
                             where=f"segment {res.segment} @ 0x{res.offset:x}")
        return pos

    def _account_at(self, res: Reservation, used: int, records: int, offsets, checked=None) -> int:
        """`_account` for records at known offsets: the headers are gathered and
        checked as arrays, and must tile [0, used) exactly as a walk would.
        checked: those headers as `format.record_headers_at` returned them for
        `res`, every one passing (the caller's own walk): not gathered and
        checked again; the tiling and the counts are still this call's."""
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        if used % 64 or not 0 <= used <= res.length:
            raise UsageError(f"used bytes {used} must be a multiple of 64 within the {res.length}-byte reservation")
        if offs.size != records:
            raise UsageError(f"extent holds {offs.size} records, producer said {records}",
                             where=f"segment {res.segment} @ 0x{res.offset:x}")
        if offs.size == 0:
            if used:
                raise UsageError(f"extent names no record in {used} used bytes",
                                 where=f"segment {res.segment} @ 0x{res.offset:x}")
            return 0
        if offs[0] != 0 or offs[-1] + F.RECORD_HEADER_SIZE > used:
            raise UsageError("record offsets do not start at 0 and lie within the bytes used",
                             where=f"segment {res.segment} @ 0x{res.offset:x}")
        if checked is not None:  # the caller's checks, tied to this extent: its offsets, LSNs and salt
            if len(checked) != offs.size:
                raise UsageError(f"{len(checked)} checked headers for {offs.size} records",
                                 where=f"segment {res.segment} @ 0x{res.offset:x}")
            h = checked
            ok = (h["lsn"] == np.uint64(res.lsn) + offs.astype(np.uint64)) & (h["salt"] == res.salt)
        else:
            h, ok = F.record_headers_at(res.view, offs, res.lsn, res.salt)
        length = h["length"].astype(np.int64)
        ends = np.append(offs[1:], used)
        bad = ~ok | (offs + length != ends)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            pos = int(offs[i])
            problem = F.check_record_header_bytes(memoryview(res.view), pos)
            if problem is None and (int(h["lsn"][i]) != res.lsn + pos or int(h["salt"][i]) != res.salt):
                problem = (f"record header names lsn 0x{int(h['lsn'][i]):x} salt 0x{int(h['salt'][i]):08x}, "
                           f"expected lsn 0x{res.lsn + pos:x} salt 0x{res.salt:08x}")
            if problem is None:
                problem = f"record of {int(length[i])} bytes does not end where the next begins (0x{int(ends[i]):x})"
            raise UsageError(f"invalid record written into a reservation: {problem}",
                             where=f"segment {res.segment} @ 0x{res.offset + pos:x}")
        counted = F.counted_in_epoch_mask(h["type"], h["flags"])
        # each epoch's records, bytes and first LSN, one pass for all (an arena holds many epochs)
        epochs, at, which = np.unique(h["epoch"][counted], return_index=True, return_inverse=True)
        counts = np.bincount(which, minlength=epochs.size)
        sums = np.zeros(epochs.size, np.int64)
        np.add.at(sums, which, length[counted])
        firsts = h["lsn"][counted][at]   # each epoch's first record in the extent (np.unique's first index)
        for epoch, n, nbytes, first in zip(epochs.tolist(), counts.tolist(), sums.tolist(), firsts.tolist()):
            st = self.stats.get(epoch)
            if st is None:
                self.stats[epoch] = [n, nbytes, first]
            else:
                st[0] += n
                st[1] += nbytes
        return used

    def _count(self, epoch, length, lsn):
        st = self.stats.get(epoch)
        if st is None:
            self.stats[epoch] = [1, length, lsn]
        else:
            st[0] += 1
            st[1] += length

    def _pad(self, res: Reservation, used: int) -> None:
        if used < res.length:
            F.encode_pad_header_into(F.record_header_bytes(res.view, used), length=res.length - used,
                                     lsn=res.lsn + used, epoch=0, salt=res.salt)

    def persist(self, res: Reservation) -> None:
        """The records written into `res` become durable before this returns.
        Unused space at its end is covered by a pad record."""
        self._check_running()
        if self.outstanding.pop(res.id, None) is None:
            raise UsageError("reservation already persisted or not from this appender")
        used = self._account(res, None, None)
        self._pad(res, used)
        self._persist(res.offset, res.length)
        self._wrote()

    def release(self, res: Reservation) -> None:
        """Close `res` with nothing in it after the record meant for it failed:
        whatever was half written stops being a record and one pad record
        covers the space, made durable as `persist` does.  An open reservation
        refuses every later commit and the log's close."""
        F.record_header_bytes(res.view, 0)[:] = 0
        self.persist(res)

    @contextlib.contextmanager
    def record(self, nbytes: int):
        """`reserve(nbytes)` for one record written in the block: persisted
        when the block ends, released (`release`) when it raises, the
        block's failure being the one raised."""
        res = self.reserve(nbytes)
        try:
            yield res
        except BaseException:
            with contextlib.suppress(Exception):
                self.release(res)
            raise
        self.persist(res)

    def finish_extent(self, ext: Extent, used_bytes: int, records: int | None, offsets=None, *,
                      trim: bool = False, checked=None) -> None:
        """The producer wrote `records` records (None: as many as the walk
        finds) into the first `used_bytes` of `ext`; check, pad the rest,
        persist.  offsets: where the producer says
        its records start (ascending, from 0): their headers are then checked
        all at once instead of walked one by one (the same checks); checked:
        their headers as the caller gathered and checked them already
        (`format.record_headers_at`, every one passing), not read again.
        trim: when nothing was taken after `ext`, give its unused end back
        instead of padding it (a producer that reserved an upper bound), so
        the log holds what an extent of `used_bytes` would have held
        (FORMAT.md §10, step 3)."""
        self._check_running()
        if self.outstanding.pop(ext.id, None) is None:
            raise UsageError("extent already finished or not from this appender")
        if offsets is None or records is None or records <= 8:  # a few headers: the walk costs less
            used = self._account(ext, F.align64(used_bytes), records)
        else:
            used = self._account_at(ext, F.align64(used_bytes), records, offsets, checked)
        if trim and used < ext.length and self.seg is not None and self.seg.index == ext.segment \
                and self.pos == ext.offset + ext.length:
            self.pos = ext.offset + used
            if self._next_slot_free():  # a clean end after the records, as a reservation leaves one
                F.record_header_bytes(self.backend.array, self.pos)[:] = 0
            if used:
                self._persist(ext.offset, used)
        else:
            self._pad(ext, used)
            self._persist(ext.offset, ext.length)
        self._wrote()

    def _wrote(self):
        if self.on_write is not None:
            self.on_write()

    # -- CPU convenience ----------------------------------------------------------------
    def append_page_batch(self, epoch: int, region_id: int, page_ids, pages, *, page_bytes: int | None = None,
                          base: bool = False, page_crcs=None) -> int:
        """Encode and append one page batch; returns its LSN.  `pages` is a
        (count, page_bytes) uint8 array (or any array of count * page_bytes bytes
        with page_bytes given).  The record is durable no later than the next
        `commit` (flushed now on pmem, persisted with the commit elsewhere)."""
        if epoch <= self.last_committed_epoch and not base:
            raise UsageError(f"epoch {epoch} is already committed (last {self.last_committed_epoch})")
        ids = np.asarray(page_ids)
        count = int(ids.size)
        if page_bytes is None:
            if not isinstance(pages, np.ndarray) or pages.ndim != 2:
                raise UsageError("pass page_bytes, or pages as a (count, page_bytes) array")
            page_bytes = int(pages.shape[1]) * pages.itemsize
        F.check_page_batch_shape(count, page_bytes)  # before any space is taken
        length = F.page_batch_length(count, page_bytes)
        src = _page_rows(pages, count, page_bytes)
        flags = F.FLAG_BASE if base else 0
        if self._write_at is not None and src is not None:
            # the checks come before space is taken; the tables go first, so the
            # source pages are hashed now
            head = self._head_buffer(count)
            tables = head[F.RECORD_HEADER_SIZE:F.RECORD_HEADER_SIZE + 8 * count]
            body_crc = None
            if page_crcs is None:
                # ids checked, tables filled and hashed in one call of the helper
                body_crc = _pagecrc.page_batch_tables(src, ids, tables)
            if body_crc is None:  # the checked path, which names any problem
                F.check_page_batch_ids(ids, count)
                F.page_batch_tables_into(tables, ids, F.page_crcs_of(src) if page_crcs is None else page_crcs,
                                         count)
                body_crc = _crc32c(tables)
            off = self._space(length)
            lsn = self.seg.lsn(off)
            F.encode_record_header_into(head, length=length, type=F.REC_PAGE_BATCH, lsn=lsn, epoch=epoch,
                                        region_id=region_id, salt=self.seg.salt, body_crc=body_crc,
                                        count=count, page_bytes=page_bytes, flags=flags)
            self._write_record(off, head, src)
        else:
            # into the mapping: with page_crcs None each page is hashed as it is copied
            off = self._space(length)
            seg = self.seg
            if self._next_slot_free():
                F.record_header_bytes(self.backend.array, self.pos)[:] = 0  # (see _take)
            view = self.backend.array[off:off + length]
            lsn = seg.lsn(off)
            body_crc = None
            if page_crcs is None and src is not None:
                # ids checked, pages copied and hashed, tables filled: one call of the helper
                body_crc = _pagecrc.copy_page_batch(view, src, ids, F.page_batch_payload_offset(count))
            try:
                if body_crc is not None:
                    F.encode_record_header_into(view, length=length, type=F.REC_PAGE_BATCH, lsn=lsn, epoch=epoch,
                                                region_id=region_id, salt=seg.salt, body_crc=body_crc,
                                                count=count, page_bytes=page_bytes, flags=flags)
                else:
                    F.encode_page_batch_into(view, lsn=lsn, epoch=epoch, region_id=region_id, salt=seg.salt,
                                             page_ids=ids, pages=pages if src is None else src,
                                             page_bytes=page_bytes, flags=flags, page_crcs=page_crcs)
            except BaseException:
                # bad input found before the header was written: its slot still holds
                # zeros, so the space is free again and no hole is left behind
                self.pos = off
                raise
        if not base:  # BASE batches are outside epoch accounting (V-N1)
            self._count(epoch, length, lsn)
        self._defer(off, length)
        self._wrote()
        return lsn

    def _head_buffer(self, count: int) -> np.ndarray:
        head = self._heads.get(count)
        if head is None:
            if len(self._heads) > 64:
                self._heads.clear()
            head = self._heads[count] = np.zeros(F.page_batch_payload_offset(count), dtype=np.uint8)
        return head

    def _write_record(self, off: int, head, payload: np.ndarray | None = None) -> None:
        """Store the record that `_space` placed at `off` with pwritev: `head`,
        then the rows of `payload` (in writeback steps when it is large), then
        a zero header slot when one follows (see _take).  A failed write frees
        the space again: no valid record was written there."""
        tail = [_ZERO_HEADER] if self._next_slot_free() else []
        try:
            if payload is None:
                self._write_at(off, [head, *tail])
            elif self._start_writeback is not None and payload.nbytes >= 2 * self.writeback_bytes:
                self._write_in_steps(off, head, payload, tail)
            else:
                self._write_at(off, [head, payload, *tail])
        except BaseException:
            self.pos = off
            raise

    def _write_in_steps(self, offset: int, head, src: np.ndarray, tail) -> None:
        """A record larger than two writeback steps goes in with one pwritev per
        step, writeback of each step started as soon as it is written (the
        device writes step k while step k+1 is copied); the last step is left to
        the next record or the commit's sync."""
        rows = max(1, self.writeback_bytes // src.shape[1])
        parts = [head]
        for k in range(0, src.shape[0], rows):
            parts.append(src[k:k + rows])
            if k + rows >= src.shape[0]:
                parts += tail
            end = offset + sum(memoryview(p).nbytes for p in parts)
            self._write_at(offset, parts)
            if k + rows < src.shape[0]:
                self._kick(offset, end)
                self._kicked = end
            offset, parts = end, []

    def append_record(self, *, type: int, epoch: int, body, region_id: int = F.NO_REGION, flags: int = 0,
                      aux: int = 0, page_bytes: int = 0, persist: bool = True) -> int:
        """Append one generic-body record (FORMAT.md §5.3; e.g. snapshot records)
        and persist it now (or with the next commit when persist=False); returns its LSN."""
        body = memoryview(body).cast("B")
        length = F.record_length(len(body))
        if self._write_at is not None:
            # encoded aside and stored with pwritev like page batches: a store through the
            # mapping would fault on the page the last sync left write-protected
            off = self._space(length)
            lsn, salt, dst = self.seg.lsn(off), self.seg.salt, bytearray(length)
        else:
            res = self._take(length, Reservation)
            del self.outstanding[res.id]
            off, lsn, salt, dst = res.offset, res.lsn, res.salt, res.view
        try:
            F.encode_record_into(dst, type=type, lsn=lsn, epoch=epoch, salt=salt, body=body,
                                 region_id=region_id, flags=flags, aux=aux, page_bytes=page_bytes)
        except BaseException:
            # a half-written header in the mapping would end the segment's data for a
            # reader here, before the records appended after it: zeros, and the space
            # is free again, no hole left behind (one encoded aside never reached it)
            if self._write_at is None:
                F.record_header_bytes(dst, 0)[:] = 0
            self.pos = off
            raise
        if self._write_at is not None:
            self._write_record(off, dst)
        if F.counted_in_epoch(type, flags):
            self._count(epoch, length, lsn)
        if persist:
            self._persist(off, length)
        else:
            self._defer(off, length)
        self._wrote()
        return lsn

    def _defer(self, off: int, n: int) -> None:
        if self._pmem:
            self.backend.flush(off, n)  # cache lines still hot; drained at commit
            self._dirty.append([off, off + n])
            return
        d = self._dirty
        if d and d[-1][1] == off:
            d[-1][1] = off + n
        else:
            d.append([off, off + n])
            if not off <= self._kicked <= off + n:  # else _write_in_steps started part of it
                self._kicked = off
        if self._start_writeback is not None:
            start, end = self._kicked, d[-1][1]
            if end - start >= self.writeback_bytes:
                self._kick(start, end)
                self._kicked = end

    def _kick(self, start: int, end: int) -> None:
        """Start writeback of [start, end) now, in this thread: measured against
        a thread of its own making the call beside the appends, this was faster
        (0.84 against 0.76 of the ceiling for 1 MiB records on two shared cores)."""
        self._start_writeback(start, end - start)

    def sync(self) -> None:
        """Persist every record appended so far (what commit does first).  Called
        on its own (as when the log is closed), it also withdraws a prepared
        segment header (zeroed, persisted by the same sync), so that a log closed
        cleanly leaves no header in a free segment for the next open to adopt."""
        self._check_running()
        if self._prepared is not None:
            off = self._prepared.offset
            self.vol.zero_header(self._prepared.index, persist=False)
            self._dirty.append([off, off + F.SEGMENT_HEADER_SIZE])
            self._prepared = None
        self._sync()

    def _sync(self) -> None:
        if self._pmem:
            if self._dirty:
                try:
                    self.backend.drain()
                except Exception as exc:
                    self._stop("drain", exc)
                    raise
        elif self.one_sync and len(self._dirty) > 1:
            # records on both sides of a segment boundary: one sync over the span (the
            # pages between are clean, or segment headers already durable) instead of
            # a device round trip per range
            start = min(r[0] for r in self._dirty)
            self._persist(start, max(r[1] for r in self._dirty) - start)
        else:
            for start, end in self._dirty:
                self._persist(start, end - start)
        self._dirty.clear()
        self._kicked = 0

    # -- commit ---------------------------------------------------------------------------
    def commit(self, epoch: int, digests: dict | None = None) -> int:
        """Make `epoch` durable: persist its records, then write and persist its
        commit record (record count, bytes, region digests).  Returns the commit's LSN.
        When this returns, recovery will restore the epoch.  A commit whose
        write fails can be retried; one whose sync fails stops the writer
        (WriterStoppedError from then on): its commit record may or may not be
        on the media, and a second one for the same epoch would make the log
        unreadable there."""
        self._check_running()
        if self.outstanding:
            raise UsageError(f"commit of epoch {epoch} with {len(self.outstanding)} reservations not yet "
                             "persisted or finished", hint="persist or finish them first")
        if epoch <= self.last_committed_epoch:
            raise UsageError(f"epoch {epoch} does not follow the last committed epoch {self.last_committed_epoch}")
        # the counts stay until the commit is in: a commit that fails can be retried
        count, nbytes, first = self.stats.get(epoch, (0, 0, 0))
        body = F.encode_commit_body(count, nbytes, first, digests or {})
        if self.one_sync and not self._pmem:
            # FORMAT.md §10 step 4b: one sync covers the records and the commit; a crash
            # inside it leaves a last commit whose records do not all verify (V-C4),
            # which the reader treats as not committed
            lsn = self.append_record(type=F.REC_COMMIT, epoch=epoch, body=body, aux=self.last_commit_lsn,
                                     flags=F.FLAG_ONE_SYNC, persist=False)
            prepared = None
            if self._prepared is None and self.seg is not None:
                # the next segment's header rides on this sync (one ordered sync fewer at
                # the roll over: header persisted, then superblock, as FORMAT.md §3.4 says)
                try:
                    prepared = self.vol.prepare_segment(self.seg)
                except Exception:
                    # only a head start: the roll over writes and persists the header
                    # itself, and a header in a free segment holds no record (§3.4)
                    prepared = None
                if prepared is not None:
                    self._dirty.append([prepared.offset, prepared.offset + F.SEGMENT_HEADER_SIZE
                                        + F.RECORD_HEADER_SIZE])
            self._sync()
            if prepared is not None:
                self._prepared = prepared
        else:
            self._sync()
            lsn = self.append_record(type=F.REC_COMMIT, epoch=epoch, body=body, aux=self.last_commit_lsn)
        self.stats.pop(epoch, None)
        self.last_committed_epoch = epoch
        self.last_commit_lsn = lsn
        return lsn

    def adopt_commit(self, epoch: int, lsn: int) -> F.CommitInfo:
        """Take as this writer's own the commit record of `epoch` that a
        producer wrote at `lsn`, right after the epoch's records, into an
        extent already finished (`finish_extent`): a pass that commits its
        own epoch (a GPU kernel, no host step between).  Only where written
        bytes need no persist call: there the record was durable when written,
        as a commit's is once `commit` returns (FORMAT.md §10, 4c).  The record is checked as
        `commit` would have written it (type, epoch, LSN, previous commit,
        the epoch's record count, bytes and first LSN as the finished extents
        counted them; V-C1..V-C4), so a producer bug is refused here with
        nothing adopted, not found at recovery.  Returns the record as checked
        (its digests: the regions' state at that commit)."""
        self._check_running()
        where = f"commit of epoch {epoch} @ lsn 0x{lsn:x}"
        if self.backend.persist_path != "none":
            raise UsageError(f"a commit written by a producer is adopted only where writes need no persist call, "
                             f"not on a {self.backend.persist_path} tier", where=where)
        if self.outstanding:
            raise UsageError(f"commit of epoch {epoch} adopted with {len(self.outstanding)} reservations not yet "
                             "persisted or finished", where=where, hint="finish them first")
        if epoch <= self.last_committed_epoch:
            raise UsageError(f"epoch {epoch} does not follow the last committed epoch {self.last_committed_epoch}",
                             where=where)
        seg = self.seg
        if seg is None or not seg.base_lsn <= lsn < seg.lsn(self.pos):
            raise UsageError("no record of the segment being written lies at that LSN", where=where)
        off = seg.offset + (lsn - seg.base_lsn)
        buf = self.backend.array
        try:
            h = F.decode_record_header(buf, off, where=where)
            if off + h.length > self.pos:
                raise CorruptionError(f"a record of {h.length} bytes runs past the bytes written", where=where)
            body = F.generic_body(buf, h, off)
            info = F.decode_commit_body(body, h)
        except (CorruptionError, WalError) as exc:
            raise UsageError(f"invalid commit record written by a producer: {exc}", where=where) from None
        count, nbytes, first = self.stats.get(epoch, (0, 0, 0))
        want = {"type": (h.type, F.REC_COMMIT), "flags": (h.flags, 0), "body_crc": (h.body_crc, _crc32c(body)),
                "epoch": (h.epoch, epoch),
                "lsn": (h.lsn, lsn), "salt": (h.salt, seg.salt), "aux": (h.aux, self.last_commit_lsn),
                "record_count": (info.record_count, count), "record_bytes": (info.record_bytes, nbytes),
                "first_lsn": (info.first_lsn, first)}
        wrong = [f"{k} {got:#x}, expected {exp:#x}" for k, (got, exp) in want.items() if got != exp]
        if wrong:
            raise UsageError(f"invalid commit record written by a producer: {'; '.join(wrong)}", where=where)
        self.stats.pop(epoch, None)
        self.last_committed_epoch = epoch
        self.last_commit_lsn = lsn
        self._wrote()
        return info

    @property
    def next_epoch(self) -> int:
        """The lowest epoch a new epoch may take: above the last committed one
        and above every epoch with records appended but not committed (they stay
        in the log; a commit of the same number would count them in)."""
        return max([self.last_committed_epoch, *self.stats]) + 1

    @property
    def write_lsn(self) -> int:
        """LSN of the next byte to be reserved."""
        if self.seg is None:
            return self.vol.superblock.next_lsn
        return self.seg.lsn(self.pos)


__all__ = ["Appender", "Reservation", "Extent"]
