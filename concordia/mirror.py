"""A hot standby's state: a log followed as its writer appends it, each
committed epoch applied as it arrives (`Mirror`), as a database hot standby
replays its WAL.

The protocol.  A `wal.reader.Follower` hands over the records appended since
the last `poll()`, in LSN order, none twice, each page of the batches the
mirror will apply (the epochs after the one it holds) checked against its
stored CRC on arrival (the scanner's page check) and never again; the log
before that epoch and retention's BASE copies, which it never applies, are
read record by record without hashing their pages.  A page
batch of an epoch not committed yet is kept aside (its page ids, CRCs and
bytes copied out of the mapping, which a later segment reuse may overwrite).
When that epoch's commit arrives, the batches the commit counts (those from
its `first_lsn` on: an epoch begun again after a failed attempt leaves the
failed attempt's batches before it) are applied to the mirror's arrays, the
page CRC tables follow, and every region the commit names is held to the
digest it states; only then does `epoch` move.  So between polls the mirror
always equals a committed epoch, whatever the writer was doing when it died:
what follows its last commit was never applied, and a takeover that cuts it
(`Log.open(writable=True)`) changes nothing the mirror holds.

What is not applied: BASE page batches and catalog records (retention's
copies of state the mirror has had since their epoch), pads.  A region
record adds a region (zeros until its pages come).  Each commit names the
commit before it: when the next epoch's commit does not name the one the
mirror holds, or fewer of its records arrived than it counts, the writer's
retention freed segments before the mirror read them; then, and when the log
was formatted again, the mirror starts again from the log as it is
(`resync`: a restore of the last committed epoch, followed from the log's
start, the epochs it holds passed over), and says so in `resyncs` and
`last_gap`.

`device=True` keeps the arrays on the GPU (CuPy): the restore goes there
(through the standby's registered mapping when it has one), the page CRC
tables stay on the host, and a committed epoch's pages, kept aside on the
host, are copied over and scattered into place as its commit arrives, in
the current stream's order.  The numpy mirror is its CPU twin: the same
protocol and bookkeeping, the pages written by numpy.  `Standby(follow=True)`
keeps a mirror while it waits and takes over from it.
"""

from __future__ import annotations

import time

import numpy as np

from concordia.wal import format as F
from concordia.wal.errors import CorruptionError, WalError
from concordia.wal.reader import _DMG, _REC, Follower, Found, record_kind


_new_tuple = tuple.__new__   # as wal.format uses it: a NamedTuple made without its constructor's frame

#: reads of the log as it is, for a resync, before damage is taken for damage:
#: beside a live writer, one read can pass a record it has reserved but not
#: yet written and then meet the records written after it
RESYNC_TRIES = 8


class _Gap(Exception):
    """A commit's link to the one before skips a commit the mirror never read."""


class Mirror:
    """The state of the log behind `backend` (an open Backend, shared with
    its owner: the mirror never closes it) at its last committed epoch,
    kept current by `poll()` (module doc)."""

    def __init__(self, backend, *, device: bool = False, registration=None):
        self.backend = backend
        self.device = device
        self.registration = registration   # the mapping's CUDA registration, read by the device restore
        self._cp = None
        if device:
            from concordia.gpu_kernels import jit

            self._cp = jit.require_cupy()
        self.arrays: dict = {}      # name -> array (the region's layout dtype and shape)
        self.epoch = 0              # the committed epoch the arrays hold
        self.resyncs = -1           # restores from the log as it is (the first is the start)
        self.epochs_applied = 0
        self.pages_applied = 0
        self.last_gap: str | None = None
        self.last_poll: dict | None = None   # the last poll's phases (`poll`)
        self.stale = False          # records read and not applied (`settled`): never polled again
        self.resync()

    # -- starting (again) ---------------------------------------------------------
    def resync(self) -> None:
        """Restore the log's last committed epoch as it is now, and follow it
        from just past that epoch's commit (the restore's own walk of the log
        stands for the follower's up to there), or, when that walk was not
        kept, from the log's start, passing over what the epoch holds."""
        from concordia.restore.run import restore
        from concordia.wal import Log

        for attempt in range(RESYNC_TRIES):
            try:
                log = Log.open(self.backend, writable=False, check_pages=False)   # not closed: it closes the backend
                done = log.walk_through_commit()   # before the plan takes the walk over
                whole = done is not None
                if done is None and log.last_committed_epoch:
                    # a walk too long to keep (`walk_kept`): the follower still starts
                    # past the commit (a takeover's open then walks the log itself)
                    c = log.last_commit_record()
                    done = None if c is None else ([], c)
                # a region registered but not yet checkpointed has no state at the epoch:
                # zeros here, until its first (whole) epoch comes
                got = (restore(log, device=self.device, registration=self.registration, absent="keep")
                       if log.last_committed_epoch else None)
            except CorruptionError:   # a read beside a live writer met a record it had reserved, not yet written
                if attempt == RESYNC_TRIES - 1:
                    raise
                continue
            named = {info.name for info in log.regions.values()}
            if got is None or set(got.arrays) <= named:
                break
            # a region defined after the open and restored by the later plan: read again
            if attempt == RESYNC_TRIES - 1:
                raise WalError(f"regions {sorted(set(got.arrays) - named)} keep appearing under the read",
                               where=str(self.backend.where))
        epoch = int(got.plan.epoch) if got is not None else 0   # the plan's: the writer may have gone on since the open
        arrays = got.arrays if got is not None else {}
        self._info = {info.id: info for info in log.regions.values()}
        self.arrays, self._flat, self._crcs = {}, {}, {}
        for rid, info in self._info.items():
            a = arrays.get(info.name)
            self._adopt(info, self._zeros(info) if a is None else self._xp.ascontiguousarray(a))
        self.epoch = epoch
        self._pending: list = []
        self._staged: dict = {}   # region id -> [(page ids, payload rows)] of epochs applied, not yet written
        self._last_commit: int | None = None   # the LSN of the last commit read (each names the one before)
        # the open's walk through the commit of the epoch restored, when it kept one: the
        # follower starts past that commit instead of walking the log again from its start
        # (at 40 GiB a first poll took seconds, and a primary dying then waited for it)
        if got is None or (done is not None and int(done[1].header.epoch) != epoch):
            done = None
        # pages are checked on arrival for the batches the mirror will apply: those of
        # epochs after the one it holds (the log before it, BASE copies: read, not hashed)
        self.follower = Follower(self.backend, check_pages=self._applies,
                                 after=None if done is None else done[1])
        self._cuts = 0
        # (segment index, seq) -> every item the follower returned of that segment: a
        # takeover's open starts from them (`walked`); None once a cut made them stale
        self._walked: dict | None = {} if done is None or whole else None
        if done is not None:
            self.follower.uuid = log.volume.uuid   # a log formatted again since is seen at the first poll
            self._keep_walk(done[0])   # as if the follower had returned them
            self._last_commit = int(done[1].header.lsn)
        self.resyncs += 1

    def _applies(self, h) -> bool:
        """Whether a record (its header) is one `_take` keeps for an epoch: the
        follower checks the pages of such page batches, and of no others."""
        return F.counted_in_epoch(h.type, h.flags) and h.epoch > self.epoch

    @property
    def _xp(self):
        return np if self._cp is None else self._cp

    def _zeros(self, info: F.RegionInfo):
        return self._xp.zeros(info.shape, np.dtype(info.dtype))

    def _adopt(self, info: F.RegionInfo, a) -> None:
        """Region `info` holds `a` now: its page CRC table (on the host) from its bytes."""
        from concordia.gpu_kernels import reference as ref

        flat = a.reshape(-1).view(np.uint8)
        self.arrays[info.name] = a
        self._flat[info.id] = flat
        if not info.pages:
            crcs = np.zeros(0, np.uint32)
        elif self._cp is None:
            crcs = ref.crc32c_pages(flat, page_bytes=info.page_bytes)
        else:
            from concordia.gpu_kernels import gpu

            crcs = self._cp.asnumpy(gpu.crc32c_pages(flat, page_bytes=info.page_bytes))
        self._crcs[info.id] = crcs

    # -- following ----------------------------------------------------------------
    def poll(self) -> int:
        """Apply every epoch committed since the last poll; returns the
        epoch the mirror holds.  Raises CorruptionError when the log holds
        damage the writer has left behind (the mirror keeps its last epoch)."""
        if self.stale:
            raise WalError("this mirror read records it did not apply (an early takeover's check): "
                           "it is not polled again", where=str(self.backend.where))
        t0, before, resyncs = time.perf_counter(), self.epochs_applied, self.resyncs
        try:
            items = self.follower.poll()
        except WalError:   # formatted again under the follower
            self.resync()
            return self.epoch
        t1 = time.perf_counter()
        if self.follower.cuts != self._cuts:   # the writer reopened the log: what followed its commit is gone
            self._cuts = self.follower.cuts
            self._pending.clear()
            self._walked = None
        self._keep_walk(items)
        try:
            for it in items:
                if it[0] == _DMG:
                    raise CorruptionError(f"the followed log holds damage: {it.reason}",
                                          where=it.seg.where(it.offset))
                try:
                    self._take(it)
                except _Gap as gap:   # a commit was not read (its segment freed first): start again
                    self.last_gap = str(gap)
                    self._staged.clear()
                    self.resync()
                    return self.epoch
        finally:
            t2 = time.perf_counter()
            self._write_staged()   # the epochs applied before damage, too: the arrays hold self.epoch
            # where a poll's time went (a standby reports the one running when its primary died)
            self.last_poll = {"read_s": t1 - t0, "apply_s": t2 - t1, "write_s": time.perf_counter() - t2,
                              "items": len(items), "epochs": self.epochs_applied - before,
                              "resynced": self.resyncs != resyncs}
        return self.epoch

    def settled(self) -> bool:
        """Whether the log holds nothing past what the mirror has read: an
        early takeover asks this once its arrays are handed on (they are read
        by the caller then, so nothing more is applied to them).  What the
        follower finds is kept for the walk (`walked` stays the walk of the log
        up to where the follower stands) and leaves the mirror stale:
        `poll()` refuses afterwards."""
        items = self.follower.poll()
        if self.follower.cuts != self._cuts:
            self._walked = None
            self.stale = True
            return False
        self._keep_walk(items)
        if items:
            self.stale = True
        return not items

    def _keep_walk(self, items: list) -> None:
        """Keep the items of the segments still live (retention frees the rest)."""
        if self._walked is None:
            return
        if any(it[0] == _DMG for it in items):   # damage: a takeover's open walks the log itself
            self._walked = None
            return
        for it in items:
            self._walked.setdefault((it.seg.index, it.seg.seq), []).append(it)
        if self.follower.volume is not None:
            live = {(sg.index, sg.seq) for sg in self.follower.volume.live_segments()}
            for key in [k for k in self._walked if k not in live]:
                del self._walked[key]

    def walked(self, vol) -> tuple | None:
        """For `Log.open(walked=)`: (items, lsn) where items are what a walk of
        `vol` (`Scanner.items`) returns of its live segments up to `lsn`: the
        records the follower returned of each segment it has read, up to where
        it stands (every byte before that is final: the writer appends, and a
        cut or a freed segment makes the walk stale), the same incarnation and
        header chain as `vol` lists now, those below its oldest LSN left out.
        `lsn` is a record boundary, inside the segment the follower stands in
        when it has read part of one (the open walks that one on from there).
        None when the first live segment is not among them, or after a cut."""
        if self._walked is None:
            return None
        oldest, at = vol.superblock.oldest_lsn, self.follower.lsn
        out, upto, prev = [], None, None
        for sg in vol.live_segments():
            got = self._walked.get((sg.index, sg.seq))
            if sg.base_lsn >= at or not got or got[0].seg != sg or vol.check_segment_header(sg, prev):
                break
            standing = sg.end_lsn > at   # the segment the follower stands in: its records before that point
            if standing:
                got = [it for it in got if it.header.lsn + it.header.length <= at]
            # each item again with `vol`'s own segment (recover tells a walk's segments apart by
            # identity): records only (`_keep_walk`), each made as the walk makes it;
            # tuple.__new__ is Found's constructor without its frame, a third of _replace's cost
            out.extend([_new_tuple(Found, (_REC, sg, it.offset, it.header)) for it in got if it.header.lsn >= oldest])
            if standing:
                upto = at
                break
            upto, prev = sg.end_lsn, sg
        return None if upto is None else (out, upto)

    def _take(self, it) -> None:
        h = it.header
        kind = record_kind(h.type)
        if kind == F.REC_REGION:
            if h.region_id not in self._info:
                body = F.record_body(self.backend.view, it.offset, h.count)
                info = F.decode_region_body(body, h.region_id, h.page_bytes)
                self._info[info.id] = info
                self._adopt(info, self._zeros(info))
            return
        if kind == F.REC_COMMIT:
            body = F.record_body(self.backend.view, it.offset, h.count)
            info = F.decode_commit_body(body, h)
            if info.epoch < self.epoch:
                return   # history: the mirror holds a later epoch
            if info.epoch > self.epoch:
                # each commit names the one before: the mirror applies an epoch only
                # right after the one it holds (none held: the log's first commit)
                if (self._last_commit is None and self.epoch) or (
                        self._last_commit is not None and info.prev_commit_lsn != self._last_commit):
                    raise _Gap(f"epoch {info.epoch}'s commit (lsn 0x{info.lsn:x}) does not follow the commit of "
                               f"epoch {self.epoch}, which the mirror holds")
                self._apply(info)
            self._last_commit = info.lsn   # the commit of the epoch the mirror holds
            return
        if not self._applies(h):
            return   # BASE batches (retention's copies), catalog, pads; epochs the mirror holds already
        lsn = it.seg.lsn(it.offset)
        if kind == F.REC_PAGE_BATCH:
            b = F.decode_page_batch(self.backend.array, it.offset, check_pages=False)   # checked on arrival
            self._pending.append((lsn, int(h.epoch), int(h.region_id), np.array(b.page_ids),
                                  np.array(b.page_crcs), np.array(b.payload)))
        else:   # a type this version only counts (ignorable): it holds nothing of the state
            self._pending.append((lsn, int(h.epoch), int(h.region_id), None, None, None))

    def _apply(self, commit: F.CommitInfo) -> None:
        mine = [p for p in self._pending if p[1] == commit.epoch and p[0] >= commit.first_lsn]
        if len(mine) != commit.record_count:   # records of the epoch in a segment freed before it was read
            raise _Gap(f"epoch {commit.epoch}'s commit counts {commit.record_count} records, {len(mine)} were read")
        # the epoch is checked on the CRC tables first; its pages are written with the
        # rest of the poll's epochs (`_write_staged`), or, when it fails, not at all
        writes, undo = [], []
        try:
            for _, _, rid, ids, crcs, payload in mine:
                if ids is None:
                    continue
                info = self._info.get(rid)
                if info is None:
                    raise CorruptionError(f"epoch {commit.epoch} writes region {rid}, which no region record "
                                          f"defines", where=f"commit lsn 0x{commit.lsn:x}")
                undo.append((rid, ids, self._crcs[rid][ids]))
                self._crcs[rid][ids] = crcs
                writes.append((rid, ids, payload))
            touched = {rid for rid, _, _ in writes}
            for rid, want in commit.digests.items():   # the regions untouched keep the digest checked before
                if rid in touched and F.region_digest(self._crcs[rid]) != want:
                    raise CorruptionError(f"region {self._info[rid].name!r} differs from the digest epoch "
                                          f"{commit.epoch} states after its pages were applied",
                                          where=f"commit lsn 0x{commit.lsn:x}")
        except CorruptionError:
            for rid, ids, before in reversed(undo):
                self._crcs[rid][ids] = before
            raise
        for rid, ids, payload in writes:
            self._staged.setdefault(rid, []).append((ids, payload))
            self.pages_applied += int(ids.size)
        self._pending = [p for p in self._pending if p[1] > commit.epoch]
        self.epoch = int(commit.epoch)
        self.epochs_applied += 1

    def _write_staged(self) -> None:
        """Write the pages of the epochs applied since the last write, one
        scatter a region: a page written by several of them once, as the
        latest wrote it (a poll that applies hundreds of epochs of a
        primary checkpointing every step costs one transfer, not hundreds)."""
        staged, self._staged = self._staged, {}
        for rid, parts in staged.items():
            info = self._info[rid]
            if len(parts) == 1:
                ids, rows = parts[0]
            else:
                # each page's last write, found on the page ids alone; only those rows are
                # gathered (joining every epoch's rows first copied all of them once more:
                # most of a poll that caught up 2,000 one-page epochs)
                ids = np.concatenate([i for i, _ in parts])
                last, at = np.unique(ids[::-1], return_index=True)
                pos = ids.size - 1 - at                                  # where each lies in `ids`
                sizes = np.array([i.size for i, _ in parts], np.int64)
                ends = np.cumsum(sizes)
                part = np.searchsorted(ends, pos, side="right")          # the epoch's part it came from
                row = pos - (ends - sizes)[part]                          # and its row there
                rows = np.empty((last.size, info.page_bytes), np.uint8)
                order = np.argsort(part, kind="stable")             # the pages, part by part
                ks, first = np.unique(part[order], return_index=True)
                for k, sel in zip(ks.tolist(), np.split(order, first[1:])):
                    i, r = parts[k]
                    rows[sel] = r.reshape(i.size, info.page_bytes)[row[sel]]
                ids = last
            self._write_pages(info, ids, rows)

    def _write_pages(self, info: F.RegionInfo, ids: np.ndarray, payload: np.ndarray) -> None:
        """The pages `ids` (host arrays, checked on arrival) into the region:
        the page scatter (`scatter_pages`) of the restore, its numpy twin here,
        its kernel on the device after one copy of the pages over."""
        from concordia.gpu_kernels import gpu, reference as ref

        pb = info.page_bytes
        offsets = np.arange(ids.size, dtype=np.int64) * pb
        if self._cp is None:
            ref.scatter_pages(payload.reshape(-1), offsets, ids, self._flat[info.id], page_bytes=pb)
        else:
            cp = self._cp
            gpu.scatter_pages(cp.asarray(payload).reshape(-1), cp.asarray(offsets), cp.asarray(ids),
                              self._flat[info.id], page_bytes=pb)

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "epochs_applied": self.epochs_applied, "pages_applied": self.pages_applied,
                "resyncs": self.resyncs, "regions": len(self.arrays), "lsn": self.follower.lsn}
