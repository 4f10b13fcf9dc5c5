"""The CuPy driver of the extent pipeline (`DeviceKernels`): detection,
compaction, staging, CRC tables and digests queued on the current stream, with
results read back through small pinned mailboxes."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from concordia.checkpoint import detect, staging
from concordia.gpu_kernels import reference as ref
from concordia.regions.errors import SessionError
from concordia.regions.region import Region


class DeviceKernels:
    """The CuPy side of the extent pipeline.  Work is queued on the current
    stream; results come back through small pinned mailboxes, each read after
    synchronising that stream only (never the whole device)."""

    name = "gpu"

    def __init__(self):
        import cupy as cp

        from concordia.gpu_kernels import gpu, jit

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        self.cp, self.gpu, self.jit = cp, gpu, jit
        self.xp = cp
        self.reads = 0
        self.failed: str | None = None
        self._ready: dict[tuple, bool] = {}
        self._mail: list = [None, None]
        self._bufs: dict = {}
        self._count_buf = None
        self._delta: dict = {}
        self._delta_box = None
        self._scratch = None

    def prepare(self, r: Region) -> bool:
        """Compile the kernels `r` needs now (not midway through a checkpoint)."""
        quick = (r.page_bytes, r.detect)
        got = self._ready.get(quick)
        if got is not None:
            return got
        d = {"PAGE_BYTES": r.page_bytes}
        specs = [("stage", d), ("crc32c", d), ("crc32c", {})]
        if r.detect == "shadow":
            specs.append(("shadow_diff", d))
        elif r.detect == "fingerprint" or (r.detect in ("stores", "positions") and r.check_every):  # cross-checks
            specs.append(("fingerprint", d))
        key = tuple((name, tuple(sorted(x.items()))) for name, x in specs)
        if key not in self._ready:
            try:
                self.jit.precompile(specs)
                self.gpu.precompile_helpers()
                self._ready[key] = True
            except Exception as exc:
                self.failed = f"kernels for {r.page_bytes}-byte pages unavailable ({type(exc).__name__}: {exc})"
                self._ready[key] = False
        self._ready[quick] = self._ready[key]
        return self._ready[key]

    @property
    def stream(self):
        return self.cp.cuda.get_current_stream()

    def detect(self, regions, known=None) -> list:
        """[(device ids, count)] per region; one read of every flag detector's
        count.  known: {name: count} of regions whose detector already ran
        (`delta`) and left its flags: those are only compacted."""
        cp, gpu = self.cp, self.gpu
        out, pending = [], []
        counts = None
        for r in regions:
            if known and r.name in known:
                flags, ids = self._buffers(r)
                if self._scratch is None:
                    self._scratch = cp.empty(1, cp.uint64)
                gpu.launch_compact(flags, ids, self._scratch)  # the count is known
                n = known[r.name]
                out.append((ids[:n], n))
                continue
            if r.crcs is None or r.detect == "all":
                out.append((cp.arange(r.pages, dtype=cp.uint32), r.pages))
                continue
            flags, ids = self._buffers(r)
            if detect.launch(r, gpu, flags):
                if counts is None:
                    counts = self._counts(len(regions))
                # compacted on the device at once; only the counts come back
                gpu.launch_compact(flags, ids, counts[len(pending):len(pending) + 1])
                pending.append((len(out), ids))
                out.append(None)
            else:  # block tables / slot versions: scanned on the host
                found = detect.dirty_pages(r, advance=True)
                out.append((cp.asarray(found), int(found.size)))
        if pending:
            got = self.wait(self.fetch(0, [counts[:len(pending)]]))[0]
            for (i, ids), n in zip(pending, got):
                out[i] = (ids[:int(n)], int(n))
        return out

    # -- a few dirty pages: one launch after the detector, one wait ---------------
    def delta_ready(self, r: Region) -> bool:
        """Whether `delta` can take `r` this checkpoint: a device detector, a
        base in the log, the digest of its CRC table known."""
        return r.flags_detector and r.crcs is not None and r.digest is not None and r.pages < 0xFFFFFFFF

    def delta(self, app, owner, regions, epoch: int, registration) -> tuple[dict, dict]:
        """Detect and stage a checkpoint of each region in `regions` with one
        host wait for all of them: an extent sized for as many pages as the
        region's last checkpoint found (at most DELTA_MAX_PAGES; none after a
        clean one) is reserved before its detector runs, and `stage_delta`
        writes the record there when the pages fit it, with the CRC table and
        digest updated on the device.  Returns ({name: (pages, record bytes)} of
        the regions done, {name: pages} of those found too many pages for their
        extent: their flags wait in `_buffers` for `detect(known=...)`).  Each
        region's table and digest are set through `owner` (the `RegionSet`)."""
        gpu = self.gpu
        host, base = self._delta_mail(len(regions))
        jobs = []
        try:
            for j, r in enumerate(regions):
                st = self._delta_state(r)
                owner.keep_table(r, self.table(r.crcs))
                ext = app.reserve_extent(ref.page_batch_length(st.guess, r.page_bytes)) if st.guess else None
                jobs.append([r, st, ext])
                flags, _ = self._buffers(r)
                st.armed = True  # the list count is nonzero until stage_delta runs
                detect.launch(r, gpu, flags, found=st.found)
                gpu.launch_stage_delta(r.flat, st.found, st.guess,
                                       registration.device_ptr + ext.offset if ext else 0, ext.length if ext else 0,
                                       r.crcs, r.digest, base + 64 * j, page_bytes=r.page_bytes,
                                       base_lsn=ext.lsn if ext else 0, epoch=epoch, region_id=r.id,
                                       salt=ext.salt if ext else 0)
                st.armed = False
            self.stream.synchronize()
            self.reads += 1
            done, refused = {}, {}
            for j, job in enumerate(jobs):
                r, st, ext = job
                count, used, records, digest, seen = (int(x) for x in host[8 * j:8 * j + 5])
                if seen != epoch:
                    raise SessionError(f"the device did not report epoch {epoch} (mailbox says {seen})",
                                       where=f"region {r.name!r}")
                if ext is not None:
                    job[2] = None
                    app.finish_extent(ext, used, records)  # the unused rest becomes padding
                cap = self.delta_cap(r, app.segment_capacity)
                st.guess = count if count <= cap else 0
                if records:
                    owner.staged(r, digest)
                    done[r.name] = (count, used)
                elif count:
                    refused[r.name] = count
                else:
                    done[r.name] = (0, 0)
            return done, refused
        except BaseException:
            try:
                self.sync()
            except Exception:
                pass
            for r, st, ext in jobs:
                if st.armed:
                    st.found[1].fill(0)
                    st.armed = False
                if ext is not None:
                    try:
                        app.finish_extent(ext, 0, 0)
                    except Exception:
                        pass
            raise

    def delta_cap(self, r: Region, capacity: int | None = None) -> int:
        """Most pages `delta` stages for `r` in one record (as plan_batches cuts
        them for a segment of `capacity` bytes; None: the size of the page list)."""
        per = (max(1, staging.MAX_BATCH_BYTES // r.page_bytes) if capacity is None
               else staging.batch_pages(r.page_bytes, capacity))
        return min(self.gpu.DELTA_MAX_PAGES, per)

    def _delta_state(self, r: Region):
        key = (r.name, r.pages)
        st = self._delta.get(key)
        if st is None:
            cp = self.cp
            cap = self.delta_cap(r)
            st = self._delta[key] = _DeltaState((cp.empty(cap, cp.uint32), cp.zeros(1, cp.uint32)), 1)
        return st

    def _delta_mail(self, n: int):
        """(host uint64 view, device address) of 64 pinned bytes per region."""
        box = self._delta_box
        if box is None or box[0].size < 64 * n:
            box = self._delta_box = self.gpu.pinned_buffer(max(4096, 64 * n))
        return box[0].view(np.uint64), box[1].data.ptr

    def _buffers(self, r: Region):
        """The flag and page-id buffers of a region, made once (the page list
        of one checkpoint is consumed before the next overwrites it)."""
        key = (r.name, r.pages)
        got = self._bufs.get(key)
        if got is None:
            got = self._bufs[key] = (self.cp.empty(r.pages, self.cp.uint8), self.cp.empty(r.pages, self.cp.uint32))
        return got

    def _counts(self, n: int):
        if self._count_buf is None or self._count_buf.size < n:
            self._count_buf = self.cp.empty(max(n, 8), self.cp.uint64)
        return self._count_buf

    def empty_u32(self, n):
        return self.cp.empty(n, self.cp.uint32)

    def zeros_u32(self, n):
        return self.cp.zeros(n, self.cp.uint32)

    def cursors(self, n):
        return self.cp.zeros((n, 4), self.cp.uint64)

    def table(self, crcs):
        return crcs if isinstance(crcs, self.cp.ndarray) else self.cp.asarray(crcs)

    def stage(self, r: Region, ids, dst, cursor, crcs, **kw) -> None:
        self.gpu.stage_page_batch(r.flat, ids, dst, cursor, page_bytes=r.page_bytes, crcs=crcs, **kw)

    def mapped_view(self, registration, ext):
        return self.gpu.device_buffer(registration.device_ptr + ext.offset, ext.length, registration)

    def staging_buffer(self, nbytes: int):
        return self.gpu.pinned_buffer(nbytes)

    def update(self, table, ids, crcs) -> None:
        if ids.dtype != self.cp.uint32:
            ids = ids.astype(self.cp.uint32)
        self.gpu.launch_scatter_u32(table, ids, crcs, int(ids.size))

    def digest_into(self, table, out) -> None:
        self.gpu.launch_region_digest(table, out)

    def fetch(self, slot: int, arrays: list):
        """Queue copies of small device arrays into mailbox `slot`; `wait` reads them."""
        cp = self.cp
        sizes = [-(-int(a.nbytes) // 8) * 8 for a in arrays]
        need = max(64, sum(sizes))
        box = self._mail[slot]
        if box is None or box[0].size < need:
            box = self._mail[slot] = self.gpu.pinned_buffer(max(need, 4096))
        host = box[0]
        stream = self.stream
        views, off = [], 0
        for a, n in zip(arrays, sizes):
            a = cp.ascontiguousarray(a)
            if a.nbytes:
                cp.cuda.runtime.memcpyAsync(host.ctypes.data + off, a.data.ptr, a.nbytes, 2, stream.ptr)
            views.append(host[off:off + a.nbytes].view(a.dtype).reshape(a.shape))
            off += n
        return stream.record(), views

    def wait(self, handle) -> list:
        event, views = handle
        event.synchronize()
        self.reads += 1
        return [v.copy() for v in views]

    def sync(self) -> None:
        self.stream.synchronize()

    def order_after_producer(self, producer=None) -> None:
        """Every device checkpoint starts here (see the module function)."""
        order_after_producer(self.stream, producer)

    def table_pass(self, table, owner, registration, stager=None):
        """The pass that checkpoints every row of `table` at once into the
        registered mapping, or None when the table cannot take it (more than
        2^32 pages in all, or its kernels failed to load)."""
        if registration is None or table.total_pages >= 0xFFFFFFFF:
            return None
        try:
            specs = [("table", {})] + [("table", {"PAGE_BYTES": pb}) for _, pb in table.groups]
            self.jit.precompile(specs)
        except Exception as exc:
            self.failed = f"table kernels unavailable ({type(exc).__name__}: {exc})"
            return None
        return DeviceTablePass(self, table, owner, registration, stager)


def positions_states(cp, table, rows):
    """The detector states (table.POSITIONS) of a table's positions rows
    `rows`, on the device, from what their regions hold: the addresses of
    their words, the length and sequence id of their last epoch."""
    from concordia.checkpoint.table import POSITIONS, positions_words

    host = np.zeros(max(1, rows.size), POSITIONS)
    for k, i in enumerate(rows.tolist()):
        r = table.regions[i]
        length, seq = positions_words(r)
        g = r.hints["positions"]
        h = host[k]
        h["length"], h["seq"] = length.data.ptr, 0 if seq is None else seq.data.ptr
        h["last"] = int(r.length_prev)
        h["last_seq"] = 0 if r.seq_prev is None else int(np.asarray(r.seq_prev).reshape(-1)[0])
        h["max_len"], h["row_bytes"] = g.max_len, g.row_bytes
    return cp.asarray(host.view(np.uint8))


def positions_back(table, rows, states) -> None:
    """The regions of a table's positions rows take their detectors' state
    back from the device (another path runs next): the length and sequence
    id of the last epoch, as the host's positions detector keeps them."""
    from concordia.checkpoint.table import POSITIONS

    if not rows.size:
        return
    host = states.get().view(POSITIONS)
    for k, i in enumerate(rows.tolist()):
        r = table.regions[i]
        last = int(host[k]["last"])
        # a length the device saw out of range: past max_len, so that the region is named whole next
        r.length_prev = last if last >= 0 else r.hints["positions"].max_len + 1
        if r.hints.get("seq_ids") is not None:
            r.seq_prev = np.array([host[k]["last_seq"]], np.int64)


@dataclasses.dataclass
class _DeltaState:
    """A region's page list for `DeviceKernels.delta`: (list, count) on the
    device, the pages its next extent is sized for, and whether the count may
    be nonzero (a detector queued without the stage_delta that resets it)."""

    found: tuple
    guess: int
    armed: bool = False


#: the largest epoch (record bytes, upper bound) a deferred table pass reserves for
DEFER_BYTES = 64 << 20


def order_after_producer(stream, producer=None) -> None:
    """The one ordering point of a device checkpoint: work queued on `stream`
    after this call runs after the producer's writes to the regions.  The
    kernels run on the current CuPy stream, so writes queued on it before the
    checkpoint are ordered already; `producer` (a CuPy stream or event, e.g.
    the framework's stream) adds a wait on the device for its work so far."""
    if producer is None:
        return
    event = producer.record() if hasattr(producer, "record") else producer
    stream.wait_event(event)


class DeviceTablePass:
    """One checkpoint of every row of a `table.RegionTable` on the device
    (gpu_kernels/table.cu): a detection launch per detector group, the plan,
    staging and finalizing launches into one extent of the registered log
    mapping, one wait on the stream, then the host checks the extent's
    headers against its own plan (numpy, no loop over regions) and finishes
    it.  The extent is sized by the last epoch's records; when they grew, the
    plan says so and the records are staged again into an extent of the size
    it gives (a second wait).  An epoch that needs more than a segment is
    staged by the per-region extent pipeline from the same dirty pages.

    Results come back through one pinned buffer the kernels write (the plan,
    each row's page count) and one copy (the digests)."""

    label = "gpu-mapped"  # the mapped path: records written in the log mapping itself

    def __init__(self, kernels, table, owner, registration, stager):
        from concordia.checkpoint.table import DET_FINGERPRINT, DET_LISTED, DET_POSITIONS, POSITIONS

        cp, gpu, jit = kernels.cp, kernels.gpu, kernels.jit
        self.k, self.table, self.owner, self.registration, self.stager = kernels, table, owner, registration, stager
        e = table.entries.copy()
        #: the detector states of the positions rows (table.POSITIONS), on the device, and their rows
        self.positions_rows = np.flatnonzero(e["detector"] == DET_POSITIONS)
        self.positions = positions_states(cp, table, self.positions_rows)
        for i, r in enumerate(table.regions):  # once per table, not per checkpoint
            if not isinstance(r.crcs, cp.ndarray) or r.crcs.dtype != cp.uint32 or r.crcs.size != r.pages:
                owner.keep_table(r, cp.ascontiguousarray(cp.asarray(r.crcs, dtype=cp.uint32)))
            state = r.shadow if r.detect == "shadow" else r.fps if r.detect == "fingerprint" else None
            e["base"][i] = r.flat.data.ptr
            e["nbytes"][i] = r.nbytes
            e["crc_table"][i] = r.crcs.data.ptr
            e["state"][i] = state.data.ptr if state is not None else 0
        for k, i in enumerate(self.positions_rows.tolist()):
            e["state"][i] = self.positions.data.ptr + POSITIONS.itemsize * k
        self.entries = e
        self.d_table = cp.asarray(e.view(np.uint8))
        self.groups = []  # (kernel, rows, row_first, n_rows, pages)
        self.group_detectors = []  # each group's detector code (the device EPOCH handler's descriptor)
        self.group_page_bytes = []  # ... and its rows' page size
        for (det, pb), rows in table.groups.items():
            if det == DET_LISTED:
                continue
            self.group_detectors.append(det)
            self.group_page_bytes.append(int(pb))
            pages = e["pages"][rows].astype(np.uint64)
            first = np.concatenate([np.zeros(1, np.uint64), np.cumsum(pages, dtype=np.uint64)])
            if det == DET_POSITIONS:  # page size read from the table: one kernel for every size
                fn = jit.function("table", "table_positions", {})
            else:
                fn = jit.function("table", "table_fingerprint" if det == DET_FINGERPRINT else "table_shadow",
                                  {"PAGE_BYTES": pb})
            self.groups.append((fn, cp.asarray(rows), cp.asarray(first), np.uint32(rows.size), int(first[-1])))
        self.listed = table.listed()
        self.marked = None  # page-space ids of listed rows flagged at the last checkpoint (device u64)
        self._pin = None          # pinned staging of the listed ids (`_to_device`)
        self._dev = [None, None]  # the two device buffers of listed ids
        self._side = 0
        n, total = len(table), table.total_pages
        self.flags = cp.zeros(max(64, total), cp.uint8)
        self.ids = cp.empty(max(1, total), cp.uint32)
        self.recs = cp.empty(max(1, table.max_records) * 32, cp.uint8)
        self.plan = cp.zeros(4, cp.uint64)
        self.d_digests = cp.asarray(table.digests)
        # mail: the plan, each row's count and digest, each record's offset
        self._at_offsets = -(-(64 + 8 * n) // 64) * 64
        self.mail_host, self.mail_dev = gpu.pinned_buffer(max(4096, self._at_offsets + 8 * max(1, table.max_records)))
        self.mail_plan = self.mail_host[:32].view(np.uint64)
        self.mail_counts = self.mail_host[64:64 + 4 * n].view(np.uint32)
        self.mail_digests = self.mail_host[64 + 4 * n:64 + 8 * n].view(np.uint32)
        self.mail_offsets = self.mail_host[self._at_offsets:self._at_offsets + 8 * max(1, table.max_records)].view(
            np.uint64)
        self.fn = {name: jit.function("table", name, {}) for name in
                   ("table_mark", "table_plan", "table_stage", "table_finalize", "table_commit")}
        self.d_order = cp.asarray(table.commit_order)
        self.stage_grid = gpu.warp_grid(max(1, total))
        self.finalize_grid = gpu.warp_grid(max(1, table.max_records))

    @property
    def last_counts(self) -> np.ndarray:
        """Each row's pages in the last epoch planned (the mailbox's counts;
        the host pass's `last_counts`), an epoch its arena lost included."""
        return self.mail_counts.astype(np.int64)

    def hand_back(self) -> None:
        """Another path runs next: the regions take their digests from the
        table and their positions detectors' state from the device."""
        positions_back(self.table, self.positions_rows, self.positions)
        self.table.write_back(self.owner)

    def _mark_listed(self) -> np.ndarray:
        """Flags of the rows whose pages the host lists: last time's cleared,
        this time's set; returns this time's page-space ids (host).  The ids go
        to the device through a pinned buffer by a copy queued on the stream:
        a copy from pageable memory would wait for the work queued before it
        (the producer's step), and a deferred checkpoint must not."""
        t = self.table
        host = detect.listed_pages([t.regions[i] for i in self.listed.tolist()], t.entries["first_page"][self.listed])
        now = self._to_device(host)
        mark = self.fn["table_mark"]
        for ids, value in ((self.marked, 0), (now, 1)):
            if ids is not None and ids.size:
                mark((max(1, min(-(-int(ids.size) // 256), 1024)),), (256,),
                     (self.flags, ids, np.uint64(ids.size), np.uint32(value)))
        self.marked = now
        return host

    def _to_device(self, host: np.ndarray):
        """`host` (uint64 ids) in one of two device buffers (the other holds
        the ids the last checkpoint marked), copied from a pinned buffer on
        the stream.  The pinned buffer is written again only after the stream
        was synchronised (every pass waits before the next one starts)."""
        cp, n = self.k.cp, int(host.size)
        if n == 0:
            return cp.zeros(0, cp.uint64)
        if self._pin is None or self._pin.size < n:
            size = max(512, 2 * n)
            self._pin = self.k.gpu.pinned_buffer(8 * size)[0].view(np.uint64)
        self._side ^= 1
        dev = self._dev[self._side]
        if dev is None or dev.size < n:
            dev = self._dev[self._side] = cp.empty(max(512, 2 * n), cp.uint64)
        self._pin[:n] = host
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, self._pin.ctypes.data, 8 * n, 1, self.k.stream.ptr)
        return dev[:n]

    def bound(self, listed: np.ndarray) -> int:
        """Record bytes this epoch cannot exceed: every page of the rows a
        device detector scans, and the pages listed now of the others.  A
        positions row whose length is a device word (DET_POSITIONS) counts
        every page: reading the word would wait for the producer's queued
        steps, so a large cache by words is not deferred (`launch`)."""
        from concordia.checkpoint.table import DET_LISTED, counts_of, records_bytes

        t = self.table
        e = t.entries
        most = e["pages"].astype(np.int64)
        if self.listed.size:
            got = counts_of(e, np.sort(listed.astype(np.int64)), t.total_pages)
            most = np.where(e["detector"] == DET_LISTED, got, most)
        return records_bytes(t, most)

    def _stage(self, ext, epoch: int, prev_commit: int | None = None) -> None:
        """Queue the plan, staging and finalizing of the epoch into `ext`, and
        the digests' copy; with `prev_commit` (the LSN of the log's last
        commit), its commit record after the records (`table_commit`: the
        plan is given the extent less that record)."""
        cp, t = self.k.cp, self.table
        dst = self.registration.device_ptr + ext.offset
        room = ext.length - (t.commit_length if prev_commit is not None else 0)
        self.fn["table_plan"]((1,), (1024,), (
            self.d_table, np.uint32(len(t)), self.flags, self.ids, self.recs,
            np.uint64(t.max_records), np.uint64(room), self.plan,
            np.uint64(self.mail_dev.data.ptr), np.uint64(self.mail_dev.data.ptr + 64),
            np.uint64(self.mail_dev.data.ptr + self._at_offsets)))
        self.fn["table_stage"](self.stage_grid, (256,), (
            self.d_table, self.ids, self.recs, self.plan, np.uint64(dst), self.d_digests))
        self.fn["table_finalize"](self.finalize_grid, (256,), (
            self.d_table, self.ids, self.recs, self.plan, np.uint64(dst), np.uint64(ext.lsn), np.uint64(epoch),
            np.uint32(ext.salt)))
        if prev_commit is not None:
            self.fn["table_commit"]((1,), (32,), (
                self.d_table, self.d_order, np.uint32(len(t)), self.d_digests, self.plan, np.uint64(dst),
                np.uint64(ext.length), np.uint64(ext.lsn), np.uint64(epoch), np.uint32(ext.salt),
                np.uint64(prev_commit)))
        stream = self.k.stream
        cp.cuda.runtime.memcpyAsync(self.mail_host.ctypes.data + 64 + 4 * len(t), self.d_digests.data.ptr,
                                    4 * len(t), 2, stream.ptr)

    def _wait(self, event=None):
        """Wait for the queued pass: for `event` (recorded after its last
        launch) when given, so that a deferred epoch completed after the
        producer queued its next step waits for the pass alone, not for that
        step; else for the stream."""
        (event or self.k.stream).synchronize()
        self.k.reads += 1
        fits, nbytes, records, pages = (int(x) for x in self.mail_plan)
        return fits, nbytes, records

    def launch(self, app, epoch: int, *, defer: bool = False, commit: bool = False):
        """Queue the epoch's detection and staging.  defer: size the extent by
        the epoch's upper bound (`bound`) when that is at most `DEFER_BYTES`
        and a quarter of a segment (the end of a segment too short for it is
        left unused), so that `complete` never stages again and
        can come after the producers moved on; `Launched.deferred` says
        whether it was (else `complete` must follow before they write).
        commit: a deferred epoch's commit record is queued too
        (`table_commit`): the device commits the epoch, no host step between
        (`Launched.committed`)."""
        from concordia.checkpoint.table import DET_POSITIONS, Launched

        t = self.table
        reads0 = self.k.reads
        self.k.order_after_producer()
        t0 = time.perf_counter()
        for (fn, rows, first, n_rows, pages), det in zip(self.groups, self.group_detectors):
            if det == DET_POSITIONS:  # a warp a row (eight a block): no page is read
                fn((max(1, min(-(-int(n_rows) // 8), 65535)),), (256,), (self.d_table, rows, n_rows))
            else:
                fn(self.k.gpu.warp_grid(pages), (256,), (self.d_table, rows, first, n_rows, self.flags))
        listed = self._mark_listed() if self.listed.size else np.zeros(0, np.uint64)
        t1 = time.perf_counter()
        size, deferred = max(64, t.last_bytes), False
        if defer:
            most = self.bound(listed)
            if most <= min(DEFER_BYTES, app.segment_capacity // 4):
                size, deferred = max(64, most), True
        committed = commit and deferred
        if committed:
            size = most + t.commit_length
        ext = app.reserve_extent(size)
        try:
            self._stage(ext, epoch, app.last_commit_lsn if committed else None)
            event = self.k.stream.record() if deferred else None
        except BaseException:
            self._abandon(app, ext)
            raise
        return Launched(ext, epoch, t0, t1, time.perf_counter(), deferred, committed, reads0=reads0, event=event)

    def complete(self, app, got, verify=None):
        """Wait for the launched epoch, stage it again into a larger extent
        when its records outgrew the first (not for a deferred one: its extent
        is an upper bound), finish the extent; the caller commits.  verify():
        called once the pass has read the regions, before the extent is
        finished; what it raises abandons the extent (`HeldOrder.verify`)."""
        from concordia.checkpoint.table import TableResult

        t, ext, epoch = self.table, got.ext, got.epoch
        tc = time.perf_counter()
        try:
            fits, used, records = self._wait(got.event)
            if not fits:
                if got.deferred:
                    raise SessionError(f"the epoch's records ({used} bytes) exceed the bound of {ext.length} bytes "
                                       "its extent was reserved for", where=f"segment {ext.segment} @ {ext.offset:#x}")
                app.finish_extent(ext, 0, 0)  # padding: the records grew past the last epoch's
                ext = None
                if used > app.segment_capacity:
                    return self._by_region(app, epoch, got.t0, got.t1, got.reads0)
                ext = app.reserve_extent(used)
                self._stage(ext, epoch)
                fits, used, records = self._wait()
                if not fits:
                    raise SessionError(f"the table plan of {used} bytes does not fit the {ext.length}-byte extent "
                                       "reserved for it", where=f"segment {ext.segment} @ {ext.offset:#x}")
            if verify is not None:
                verify()
            counts = self.last_counts
            offsets, finished, commit_lsn = self.mail_offsets[:records].copy(), used, 0
            if got.committed:  # the commit record the device wrote is the extent's last record
                commit_lsn = ext.lsn + used
                offsets = np.append(offsets, np.uint64(used))
                finished = used + t.commit_length
            # the appender checks every header the offsets name and that they tile the bytes finished
            app.finish_extent(ext, finished, offsets.size, offsets=offsets, trim=got.deferred)
            ext = None
        except BaseException:
            self._abandon(app, ext)
            raise
        np.copyto(t.digests, self.mail_digests)
        t.last_bytes = used or t.last_bytes
        # staging: the launch's queueing and this wait and finish, not the time between them
        return TableResult(counts, used, got.t1 - got.t0, (got.t2 - got.t1) + (time.perf_counter() - tc),
                           self.k.reads - got.reads0, commit_lsn)

    def _abandon(self, app, ext) -> None:
        from concordia.checkpoint.table import abandon

        try:
            self.k.sync()  # nothing may still be writing into the mapping
        except Exception:
            pass
        abandon(app, ext)

    def _by_region(self, app, epoch: int, t0: float, t1: float, reads0: int):
        """An epoch larger than a segment: the per-region extent pipeline stages
        the pages the table's detectors found (the plan compacted them)."""
        from concordia.checkpoint.table import TableResult

        cp, t = self.k.cp, self.table
        counts = self.last_counts
        starts = np.cumsum(counts) - counts
        first = t.entries["first_page"].astype(np.int64)
        found = [((self.ids[s:s + c].astype(cp.int64) - int(f)).astype(cp.uint32), int(c))
                 for s, c, f in zip(starts.tolist(), counts.tolist(), first.tolist())]
        t.write_back(self.owner)
        got = self.stager.run(app, self.owner, t.regions, epoch, found=found)
        t.digests[:] = [r.digest for r in t.regions]
        self.d_digests.set(t.digests)
        return TableResult(counts, got["log_bytes"], t1 - t0, time.perf_counter() - t1, self.k.reads - reads0)
