"""The CuPy driver of the extent pipeline (`_DeviceKernels`): detection,
compaction, staging, CRC tables and digests queued on the current stream, with
results read back through small pinned mailboxes."""

from __future__ import annotations

import dataclasses

import numpy as np

from concordia.checkpoint import staging
from concordia.errors import SessionError
from concordia.gpu_kernels import reference as ref
from concordia.regions import Region


class _DeviceKernels:
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
        elif r.detect == "fingerprint" or (r.detect == "stores" and r.check_every):  # stores: its cross-check
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
            if r.launch_detect(gpu, flags):
                if counts is None:
                    counts = self._counts(len(regions))
                # compacted on the device at once; only the counts come back
                gpu.launch_compact(flags, ids, counts[len(pending):len(pending) + 1])
                pending.append((len(out), ids))
                out.append(None)
            else:  # block tables / slot versions: scanned on the host
                found = r.dirty_pages(advance=True)
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

    def delta(self, app, regions, epoch: int, registration) -> tuple[dict, dict]:
        """Detect and stage a checkpoint of each region in `regions` with one
        host wait for all of them: an extent sized for as many pages as the
        region's last checkpoint found (at most DELTA_MAX_PAGES; none after a
        clean one) is reserved before its detector runs, and `stage_delta`
        writes the record there when the pages fit it, with the CRC table and
        digest updated on the device.  Returns ({name: (pages, record bytes)} of
        the regions done, {name: pages} of those found too many pages for their
        extent: their flags wait in `_buffers` for `detect(known=...)`)."""
        gpu = self.gpu
        host, base = self._delta_mail(len(regions))
        jobs = []
        try:
            for j, r in enumerate(regions):
                st = self._delta_state(r)
                r.crcs = self.table(r.crcs)
                ext = app.reserve_extent(ref.page_batch_length(st.guess, r.page_bytes)) if st.guess else None
                jobs.append([r, st, ext])
                flags, _ = self._buffers(r)
                st.armed = True  # the list count is nonzero until stage_delta runs
                r.launch_detect(gpu, flags, found=st.found)
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
                    r.digest = digest
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


@dataclasses.dataclass
class _DeltaState:
    """A region's page list for `_DeviceKernels.delta`: (list, count) on the
    device, the pages its next extent is sized for, and whether the count may
    be nonzero (a detector queued without the stage_delta that resets it)."""

    found: tuple
    guess: int
    armed: bool = False
