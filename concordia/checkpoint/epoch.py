"""The epoch runner: one checkpoint of every region of a `RegionSet`, from the
producers' streams to the commit.

A checkpoint is one epoch: for every region the dirty pages are found
(`detect`), staged as page-batch records into reserved log space, persisted,
and then one commit record carries every region's digest.  The first
checkpoint of a region in a log writes all its pages (as ordinary page batches
of that epoch: the BASE flag of FORMAT.md §12 belongs to base snapshots listed
in a catalog, which compaction writes).  An epoch without its commit never
reaches a region, so a crash at any point leaves the state of the previous
commit.

Where the pages go (`staging=`, `CheckpointStats.via` says which path each
region took):

    gpu-mapped  CuPy regions on a log the GPU can address (shm, devdax, pinned,
                memory): the mapping is registered with CUDA once and kept; the
                kernels detect, checksum and write page-batch records straight
                into extents the appender granted (zero copy)
    gpu-ring    CuPy regions on other tiers (file, pmem): the same records are
                written into a pinned staging ring and copied into each extent
                with one memcpy while the GPU stages the next
    host        numpy regions, and CuPy regions when anything the device path
                needs is missing: pages are gathered and encoded on the CPU
    cpu-mapped, cpu-ring   the extent pipeline driven by the numpy twins
                (staging="mapped" / "ring" on numpy regions)

Once every region takes the same mapped pipeline and has a base, an epoch is
one table pass (`table`, `device.DeviceTablePass`, `host.HostTablePass`): one
detection launch per detector group over a region table, one staging pass of
every record into one extent, one wait, one commit
(`CheckpointStats.table_pass`).

Every path writes the same record bytes for the same state.  The device path
reads the device back twice per checkpoint at most: the dirty-page counts (to
size the extents) and, after staging, the extents' cursors with the region
digests (computed on the device from a per-page CRC table kept there).  On a
mapped log it reads once when each region's dirty pages fit an extent reserved
before its detector ran (as many pages as its last checkpoint found, at most
32): the detector lists the pages and one `stage_delta` launch writes the
record, the CRC table and the moved digest (`device.DeviceKernels.delta`).

The runner caches its routes, stagers and table pass between checkpoints,
keyed on `RegionSet.version`; the commit is a callable the session hands in
(`commit(appender, epoch, digests)`), so this module never sees the session.

Deferred epochs (`run(wait=False)`, `settle`).  A table pass can be split in
two: `launch` queues detection and staging on the device in the producers'
stream order and returns; `complete` waits, checks and finishes the extent,
and the commit follows.  With wait=False the runner launches, orders the
producers' next writes after the pass (on the device, no host wait) and
returns statistics that say `pending`; the session's next call settles it.
The extent is reserved at the epoch's upper bound (every page of the rows a
device detector scans, the pages listed now of the others: `bound`), so the
records always fit and no second staging, which would read the regions after
the producers moved on, is ever needed; the appender gives its unused end
back (`finish_extent(trim=True)`), so the log holds what a waiting epoch
writes.  An epoch whose bound is large (a region scanned whole by a detector
of many pages) is waited for as before.  A crash before the commit leaves
the epoch before it, as a crash inside a waiting checkpoint does.

Where written bytes need no persist call (shared memory, huge pages: the
backend's `persist_path` is "none"), the pass commits the epoch itself: the
commit record follows its records in the same extent (table.cu's
`table_commit`, the twin `table.write_commit`), written after a system-scope
fence once the records are, so the epoch is durable when the device has run
the pass, with no host step; `settle` checks that record and takes it on
(`Appender.adopt_commit`).  On file and pmem tiers the host commits at
`settle`, after its persist call.  The statistics say `pending` until the
session has taken the commit on, whoever wrote it.

A log too full to take the epoch (`on_full`, `ON_FULL`): "raise" lets the
appender's LogFullError out (the detectors have advanced by then, so every
region's next checkpoint writes it whole: `RegionSet.lose`).  "coalesce"
first asks whether the log can take the epoch (`room`): the free space (the
rest of the segment being written and the free segments) against the
reservations the epoch makes, for the full image of every region when that
fits, else for an upper bound of its pages that reads nothing (the positions
a static cache names, every page of the other regions), else for the pages
the detectors find without advancing, and whether
what is left is enough for the session's retention to go on with (a callable
handed in, `left`).  When it is not, nothing is detected, staged or
committed, no epoch number is taken and the statistics say `coalesced`: the
pages stay dirty and the next checkpoint carries them.
"""

from __future__ import annotations

import collections
import contextlib
import time

import numpy as np

from concordia.checkpoint import arena, detect
from concordia.checkpoint.device import DeviceKernels
from concordia.checkpoint.host import HostKernels, HostTablePass
from concordia.checkpoint.staging import Stager, register_mapping, stage_region
from concordia.checkpoint.stats import CheckpointStats
from concordia.checkpoint.table import RegionTable, records_bytes
from concordia.gpu_kernels import reference as ref
from concordia.regions.arrays import storage_of, to_host
from concordia.regions.errors import SessionError
from concordia.regions.registry import RegionSet
from concordia.regions.streams import StreamOrder
from concordia.wal.errors import LogFullError

STAGING = ("auto", "mapped", "ring", "host")
#: what a checkpoint does when the log cannot take its epoch now (module doc)
ON_FULL = ("raise", "coalesce")


class EpochRunner:
    """Runs the epochs of one session's regions (module doc).

    staging: "auto", "mapped", "ring" or "host".  commit: called with the
    appender, the epoch and the region digests once every record is
    persisted.  table_for_host: stage host regions by the extent pipeline (and
    so the region table) even under staging="auto" (a resident executor)."""

    def __init__(self, regions: RegionSet, staging: str, commit, *, table_for_host: bool = False):
        if staging not in STAGING:
            raise SessionError(f"unknown staging {staging!r} (use {', '.join(STAGING)})")
        self.regions = regions
        self.staging = staging
        self.commit = commit
        self.table_for_host = table_for_host
        self.stagers: dict[str, Stager | None] = {}
        #: why the device path is not used (None while it is, or was never needed)
        self.gpu_fallback: str | None = None
        #: how many region checkpoints took each path
        self.paths: collections.Counter = collections.Counter()
        self._producers = None  # (version, one region per producer stream key, order), see stream_order
        self._routes: tuple | None = None   # (version, routes)
        self._table: tuple | None = None    # (version, table pass or None)
        self._whole: tuple | None = None    # (version, record bytes of every region written whole)
        self._asked: str | None = None      # on_full of the call whose epoch another thread runs (`asking`)
        #: record bytes the last committed epoch wrote (what a table pass guesses for the next)
        self.last_log_bytes = 0
        #: the epoch queued by run(wait=False) and not yet committed:
        #: (launched pass, table pass, its CheckpointStats, appender), or None
        self.pending = None
        #: the arena a trigger's epochs are committed into, or None (`open_arena`); how many were opened
        self.arena = None
        self.arenas = 0
        #: arenas closed by an epoch that did not fit (`arena.Arena.lost`)
        self.arenas_lost = 0
        #: what stops the open arena's writer before it is taken on (the device's trigger), or None
        self.arena_pause = None
        #: record bytes the last epoch an arena lost needed, and the arenas lost in a row (0, 0: none since
        #: an arena's epoch was taken on): the tables made after it size their arenas for it
        #: (`RegionTable.arena_hint`), so that a table made again after the loss (every region whole
        #: next) does not lose its next epoch the same way
        self.arena_hint = 0
        self.arena_losses = 0

    @property
    def registration(self):
        """The CUDA registration of the log mapping the device stager keeps (a
        recovery reads the log through it), or None."""
        return getattr(self.stagers.get("gpu"), "registration", None)

    def base_stager(self):
        """A `bases.BaseStager` on the device kernels of a log mapping the
        device writes (retention's BASE records from pinned copies), or None."""
        st = self.stagers.get("gpu")
        if st is None or st.registration is None:
            return None
        from concordia.checkpoint.bases import BaseStager

        return BaseStager(st.kernels, st.registration)

    def close(self) -> None:
        for st in self.stagers.values():
            if st is not None:
                st.close()
        self.stagers.clear()
        # the caches list regions, and regions hold the caller's arrays
        self._producers = self._routes = self._table = self._whole = None

    def forget_table(self) -> None:
        """The regions' baselines are replaced from outside (a recovery into the
        registered arrays): the table pass is made again."""
        self._table = None

    def lose(self) -> None:
        """After a failed checkpoint: every region's next checkpoint writes it whole."""
        self._table = None
        self.regions.lose()

    # -- epochs a consumer commits itself (arena.py) ---------------------------------
    def open_arena(self, log, reason: str = "trigger") -> str | None:
        """Reserve an arena for a trigger's epochs (`arena.Arena`); returns
        why there is none (the epochs then go through the session), or None.
        The caller holds the regions' lock and has settled any pending epoch."""
        if self.arena is not None:
            return None
        tp = self.table_pass(log)
        if tp is None:
            return ("the regions take no single table pass (every region on one mapped staging path, "
                    "each with its first epoch committed)")
        if not isinstance(tp, HostTablePass):
            return ("a device table's epochs take the device's EPOCH handler (checkpoint.device_epoch), "
                    "not this consumer's arena: they go through the session")
        why = arena.why_not(tp.table, log.appender.backend)
        if why is None:
            try:
                self.arena = arena.Arena(log.appender, tp.table,
                                         max(self.regions.next_epoch, log.appender.next_epoch), reason=reason)
                self.arenas += 1
            except ValueError as exc:  # an epoch larger than the arena a segment leaves
                why = str(exc)
            except LogFullError:  # the next arena is tried at the next epoch, after retention ran
                why = "the log has no room for an arena now (no free segment)"
        return why

    def arena_for(self, log, reason: str, settle) -> str | None:
        """An open arena with room for the next epoch, or why there is none:
        a full one is taken on first (`settle`, the session's: the appender
        and retention take its epochs on) and another opened (`open_arena`).
        The caller holds the regions' lock."""
        if self.arena is not None and not self.arena.room:
            settle()
        if self.arena is not None:
            return None
        if self.pending is not None:
            return "an epoch of checkpoint(wait=False) is pending"
        return self.open_arena(log, reason)

    def arena_epoch(self) -> int:
        """The last epoch committed in the open arena and not yet taken on (0: none)."""
        a = self.arena
        return a.word("last_epoch") if a is not None and a.word("epochs") else 0

    def arena_take(self, *, snapshot=None, release=None) -> int | None:
        """One epoch into the open arena (the consumer's); its number, or None
        when the arena had no room for it (counted as missed) or lost it
        (`arena.lost`: the next settle makes every region's next checkpoint whole).
        snapshot, release: a trigger's (`Arena.take`)."""
        tp = self._table[1]
        if not tp.table.unchanged():
            for r in self.regions:
                r.check_unchanged()  # before anything is written
        try:
            return self.arena.take(tp, snapshot=snapshot, release=release)
        except BaseException:
            self.lose()
            raise

    def adopt_arena(self, log) -> list:
        """Take the open arena's epochs on (`Arena.adopt`) and close it: the
        statistics of each (the arena's reason, taken by the resident
        executor), in order.  A failure, or an epoch the arena lost (its
        detectors moved on, nothing written), makes every region's next
        checkpoint whole."""
        with self.regions.lock:
            pause, self.arena_pause = self.arena_pause, None
            if pause is not None and self.arena is not None:
                pause()   # the kernel's trigger writes this arena no more
            a, self.arena = self.arena, None
            if a is None:
                return []
            try:
                got = a.adopt(log.appender)
            except BaseException:
                self.lose()
                raise
            finally:
                self.regions.next_epoch = max(self.regions.next_epoch, a.word("last_epoch") + 1)
            if a.lost:
                self.arena_hint = self._lost_bytes(a.table)
                self.arena_losses = 1 if got else self.arena_losses + 1
                self.lose()
                self.arenas_lost += 1
            elif got:
                self.arena_hint = self.arena_losses = 0
        t = a.table
        if a.digests is not None:  # the table's digests are its last commit's (a GPU consumer kept them on the device)
            t.digests[:] = [a.digests[int(rid)] for rid in t.entries["region_id"].tolist()]
        out = []
        for epoch, first, commit, counts, log_bytes in got:
            st = a.given.pop(epoch, None)
            if st is None:
                st = CheckpointStats.of_table(epoch, a.reason, t.names, counts, a.label,
                                              int(counts @ t.page_bytes), log_bytes, 0.0, 0.0, 0.0, 0)
            st.executor = "resident"
            st.log_at = (first, commit)
            out.append(st)
            self.paths[a.label] += len(t.names)
        if out:
            self.last_log_bytes = int(out[-1].log_bytes)
            t.last_bytes = max(int(st.log_bytes) for st in out)  # a device consumer's epochs: the next arena's size
        return out

    def _lost_bytes(self, table) -> int:
        """The record bytes of the epoch the open arena lost, from each row's
        pages its table pass counted (the device's mailbox, the twin's plan)."""
        tp = self._table[1] if self._table is not None else None
        if tp is None or tp.table is not table:
            return self.arena_hint
        return records_bytes(table, tp.last_counts)

    # -- one epoch ---------------------------------------------------------------
    @contextlib.contextmanager
    def asking(self, on_full: str):
        """`on_full` for the epoch run on another thread for the caller inside
        the block (the resident executor's consumer calls `Session.checkpoint`
        again, with the default)."""
        check_on_full(on_full)
        self._asked = on_full
        try:
            yield
        finally:
            self._asked = None

    def run(self, log, *, reason: str, stream=None, on_full: str = "raise", left=None,
            wait: bool = True) -> CheckpointStats:
        """Checkpoint every region into `log` (writable) as the next epoch; the
        caller has run the session's before-checkpoint hooks and settled any
        pending epoch (`settle`).  on_full: what a log too full for the epoch
        does (module doc); left: with "coalesce", whether the space the epoch
        would leave (a `wal.compaction.Space`) is enough to go on with (the
        session's retention: `Retention.room`).  wait=False: a table pass
        whose epoch has a small upper bound is only queued (module doc,
        "Deferred epochs"); the statistics say `pending` until `settle`."""
        check_on_full(on_full)
        if not isinstance(wait, bool):
            raise SessionError(f"wait must be True or False, not {wait!r}", where="checkpoint")
        on_full = self._asked or on_full
        if self.pending is not None or self.arena is not None:
            raise SessionError("an epoch is still pending: settle() it first", where="checkpoint")
        try:
            stats = self._run(log, reason, stream, on_full, left, wait)
        except LogFullError:
            if on_full != "coalesce":
                raise
            # the room was there when asked (`room`) and was not at a roll over:
            # the abort path has made every region's next checkpoint whole
            # (`lose`), which carries every page the detectors passed
            return CheckpointStats.of_coalesced(reason)
        if not stats.coalesced and not stats.pending:
            self.last_log_bytes = int(stats.log_bytes)
        return stats

    def settle(self) -> CheckpointStats | None:
        """Wait for the pending epoch (if any), finish its extent and commit
        it; its statistics (the object `run` returned) are filled in place and
        returned.  A failure makes every region's next checkpoint whole."""
        if self.pending is None:
            return None
        launched, table, stats, app, order = self.pending
        self.pending = None
        done = self._finish_table(app, table, launched, stats.epoch, stats.reason, order)
        stats.settle(done)
        self.last_log_bytes = int(stats.log_bytes)
        return stats

    def _run(self, log, reason: str, stream, on_full: str, left, wait: bool = True) -> CheckpointStats:
        regions = self.regions
        table = self.table_pass(log)
        if table is None or not table.table.unchanged():
            for r in regions:
                r.check_unchanged()  # before anything is written
        order = self.stream_order(stream)
        order.after_producers()
        if on_full == "coalesce":
            t0 = time.perf_counter()
            if not self.room(log, left):
                order.before_later_work()
                return CheckpointStats.of_coalesced(reason, (time.perf_counter() - t0) * 1e3)
        epoch = regions.take_epoch(log.appender.next_epoch)
        if table is not None:
            try:
                launched = table.launch(log.appender, epoch, defer=not wait,
                                        commit=not wait and log.appender.backend.persist_path == "none")
            except BaseException:
                order.before_later_work()
                self.lose()
                raise
            if launched.deferred:  # the producers' next writes wait, on the device, for the pass
                order.before_later_work()
                stats = CheckpointStats.of_pending(epoch, reason, (launched.t1 - launched.t0) * 1e3)
                self.pending = (launched, table, stats, log.appender, order)
                return stats
            try:
                return self._finish_table(log.appender, table, launched, epoch, reason, order)
            finally:
                order.before_later_work()  # the producers write on only after the pass read the regions
        regions.changed()  # the paths below may replace CRC tables and detector state
        try:
            stats = self._run_paths(log, epoch, reason, order)
        except BaseException:
            self.lose()
            raise
        for name in stats.base:  # a region written whole now has a baseline for its detector
            detect.reset(regions[name])
        order.before_later_work()  # the detectors' copies are taken before the producers write on
        self.paths.update(stats.via.values())
        return stats

    def _run_paths(self, log, epoch: int, reason: str, order: StreamOrder) -> CheckpointStats:
        """The epoch region by region: the host path, then each extent pipeline."""
        app = log.appender
        pages, nbytes, log_bytes, via = {}, 0, 0, {}
        detect_s = stage_s = 0.0
        reads = 0
        routes = self.route(log)
        base = [r.name for r in self.regions if r.crcs is None]
        for r in routes[None]:
            t0 = time.perf_counter()
            is_base = r.crcs is None
            ids = detect.dirty_pages(r, advance=True)
            t1 = time.perf_counter()
            if is_base:
                self.regions.start_base(r, np.zeros(r.pages, np.uint32))
            elif not isinstance(r.crcs, np.ndarray):
                self.regions.keep_table(r, to_host(r.crcs))  # the region left the device path
            lb = stage_region(app, r, ids, epoch)
            if ids.size or r.digest is None:
                self.regions.staged(r, ref.region_digest(r.crcs))
            t2 = time.perf_counter()
            detect_s += t1 - t0
            stage_s += t2 - t1
            pages[r.name] = int(ids.size)
            nbytes += int(ids.size) * r.page_bytes
            log_bytes += lb
            via[r.name] = "host"
        for key in ("gpu", "cpu"):
            if routes.get(key):
                st = self.stagers[key]
                got = st.run(app, self.regions, routes[key], epoch)
                detect_s += got["detect_s"]
                stage_s += got["stage_s"]
                reads += got["device_reads"]
                log_bytes += got["log_bytes"]
                for r in routes[key]:
                    n = got["pages"][r.name]
                    pages[r.name] = n
                    nbytes += n * r.page_bytes
                    via[r.name] = st.label
        pages = {name: pages[name] for name in self.regions.names}
        order.verify()
        t3 = time.perf_counter()
        self.commit(app, epoch, {r.id: r.digest for r in self.regions})
        commit_s = time.perf_counter() - t3
        return CheckpointStats(epoch, reason, pages, base, nbytes, log_bytes,
                               detect_s * 1e3, stage_s * 1e3, commit_s * 1e3, via, reads)

    def _finish_table(self, app, table, launched, epoch: int, reason: str, order: StreamOrder) -> CheckpointStats:
        """The epoch a table pass launched (one detection launch per detector
        group, one staging pass into one extent), waited for, finished and
        committed: no Python per region beyond building the statistics."""
        try:
            got = table.complete(app, launched, verify=order.verify)
            t3 = time.perf_counter()
            if got.commit_lsn:  # the pass committed the epoch: its record is checked and taken on
                app.adopt_commit(epoch, got.commit_lsn)
            else:
                self.commit(app, epoch, table.table.commit_digests())
            commit_s = time.perf_counter() - t3
        except BaseException:
            self.lose()
            raise
        names = table.table.names
        counts = got.counts
        self.paths[table.label] += len(names)
        return CheckpointStats.of_table(epoch, reason, names, counts, table.label,
                                        int(counts @ table.table.page_bytes), int(got.log_bytes),
                                        got.detect_s * 1e3, got.stage_s * 1e3, commit_s * 1e3, got.device_reads)

    # -- room in the log -----------------------------------------------------------
    def room(self, log, enough=None) -> bool:
        """Whether `log` can take this epoch now, leaving space that `enough`
        (None: any) accepts (module doc; `enough(left, whole)`: the space left
        and the names of the regions the epoch writes whole, known only for
        the pages found, else empty): its free space against the
        reservations the epoch makes, for the full image of every region first
        (kept between checkpoints), else for an upper bound of its pages that
        reads nothing (`detect.most_pages`: the positions a static cache names,
        every page of other regions), else for the pages the detectors find
        now without advancing (a second detection pass, a device read per
        region on the GPU: made only when the log is that full)."""
        from concordia.wal.compaction import free_space

        space = free_space(log)
        version = self.regions.version
        if self._whole is None or self._whole[0] != version:
            self._whole = (version, self.reservations(log, space.capacity, pages="whole"))
        n = len(self.regions)
        for plan in (self._whole[1], "most", "found"):
            whole = set() if plan == "found" else None
            if isinstance(plan, str):
                plan = self.reservations(log, space.capacity, pages=plan, whole=whole)
            left = space_after(space, plan, self.last_log_bytes, n)
            # an epoch of no page (its commit record alone) takes nothing retention needs; the
            # regions the pages found write whole need no base after it (their records are one)
            if left is not None and (enough is None or not any(plan)
                                     or enough(left, whole or ())):
                return True
        return False

    def reservations(self, log, capacity: int, *, pages: str, whole: set | None = None) -> tuple:
        """(record bytes the host path reserves one by one, extent bytes the
        extent pipelines reserve) of this epoch, in the order they are made,
        for `pages`: "whole" (every page of every region), "most" (an upper
        bound that reads nothing, `detect.most_pages`) or "found" (the pages
        each detector finds now, not advanced); `capacity`: the bytes a
        segment holds; whole: a set given the names of the regions the epoch
        would write whole."""
        from concordia.checkpoint.staging import EXTENT_BYTES, plan_extents, record_lengths

        count = {"whole": lambda r: r.pages, "most": detect.most_pages,
                 "found": lambda r: int(detect.dirty_pages(r, advance=False).size)}[pages]
        routes = self.route(log)
        records, batches = [], []
        for key, regions in routes.items():
            into = records if key is None else batches
            for r in regions:
                n = count(r)
                if n:
                    into.extend(record_lengths(r.page_bytes, n, capacity))
                    if whole is not None and n >= r.pages:
                        whole.add(r.name)
        extents = []
        if batches:  # packed as the extent pipeline packs them (`Stager.run`)
            cap = min(max([EXTENT_BYTES] + batches), capacity)
            extents = [sum(e) for e in plan_extents(batches, cap, length=int)]
        return records, extents

    def stream_order(self, stream) -> StreamOrder:
        """The producer streams of this checkpoint (`StreamOrder.for_checkpoint`),
        from one representative region per framework, device and given stream,
        chosen again only when the regions change: no Python per region.  A
        representative stands for its group while it is as registered; one
        given new storage since (a tensor moved to the host, say) may not, and
        every region's stream is taken then.
        A StreamOrder given as `stream` is the order itself (`HeldOrder`)."""
        if isinstance(stream, StreamOrder):
            return stream
        cached = self._producers
        if cached is None or cached[0] != self.regions.version:
            reps, seen = [], set()
            for r in self.regions:
                if not r.on_gpu:
                    continue
                # a tensor's device as registered (`storage_of`: PyTorch's object, no name made a region), so
                # the representatives are the same whenever they are chosen
                key = (("given", id(r.stream)) if r.stream is not None else ("torch", r.storage[3])
                       if r.framework == "torch" else
                       (type(r.owner).__module__.split(".")[0], str(getattr(r.owner, "device", ""))))
                if key not in seen:
                    seen.add(key)
                    reps.append(r)
            # no device region and no stream given: no order to keep, and nothing to look up
            cached = self._producers = (self.regions.version, reps, StreamOrder([]) if not reps else None)
        if stream is None and cached[2] is not None:
            return cached[2]
        reps = cached[1]
        if any(storage_of(r.owner) != r.storage for r in reps):
            reps = self.regions
        return StreamOrder.for_checkpoint(reps, stream)

    # -- routes and the table pass -----------------------------------------------
    def table_pass(self, log):
        """The table pass that checkpoints every region this epoch, or None:
        one is made when every region takes the same extent pipeline in
        "mapped" mode and has a base in the log, and kept until the regions
        change.  Otherwise the per-region paths run."""
        cached = self._table
        version = self.regions.version
        if cached is not None and cached[0] == version:
            return cached[1]
        if cached is not None and cached[1] is not None:
            cached[1].hand_back()  # the regions' digests and detectors, for whichever path runs next
        tp = None
        regions = list(self.regions)
        routes = self.route(log)
        for key in ("gpu", "cpu"):
            st = self.stagers.get(key)
            if (st is not None and len(routes[key]) == len(regions) and st.mode == "mapped"
                    and all(r.crcs is not None and r.digest is not None for r in regions)):
                tp = st.kernels.table_pass(RegionTable(regions, log.appender.segment_capacity), self.regions,
                                           st.registration, st)
                tp.table.arena_hint, tp.table.arena_losses = self.arena_hint, self.arena_losses
        self._table = (self.regions.version, tp)
        return tp

    def route(self, log) -> dict:
        """{None: host-path regions, "gpu": ..., "cpu": ...} for this checkpoint
        (kept while the regions do not change)."""
        if self._routes is not None and self._routes[0] == self.regions.version:
            return self._routes[1]
        out: dict = {None: [], "gpu": [], "cpu": []}
        for r in self.regions:
            key = None
            if self.staging != "host":
                if r.on_gpu:
                    st = self._stager("gpu", log)
                    if st is not None and r.device_aligned and st.kernels.prepare(r):
                        key = "gpu"
                    elif st is not None and self.gpu_fallback is None:
                        self.gpu_fallback = (f"region {r.name!r}: " + ("not 16-byte aligned" if not r.device_aligned
                                                                        else st.kernels.failed))
                elif self.staging in ("mapped", "ring") or self.table_for_host:
                    key = "cpu"
                    self._stager("cpu", log)
            out[key].append(r)
        self._routes = (self.regions.version, out)
        return out

    def _stager(self, key: str, log):
        """The extent pipeline for device ("gpu") or host ("cpu") regions, made
        once: a device one registers the log mapping with CUDA here and keeps it."""
        if key in self.stagers:
            return self.stagers[key]
        st = None
        if key == "cpu":
            st = Stager(HostKernels(), "ring" if self.staging == "ring" else "mapped", None)
        else:
            try:
                kernels = DeviceKernels()
            except Exception as exc:  # CuPy, CUDA or the kernel sources missing
                if self.staging != "auto":
                    raise SessionError(f"staging={self.staging!r} needs the GPU kernels: {exc}") from None
                self.gpu_fallback = f"GPU kernels unavailable ({type(exc).__name__}: {exc})"
            else:
                reg, why = None, None
                if self.staging in ("auto", "mapped"):
                    reg, why = register_mapping(log.backend)
                    if reg is None and self.staging == "mapped":
                        raise SessionError(f"staging='mapped' needs a log the GPU can address: {why}",
                                           where=str(log.backend.where), hint="use staging='ring' or 'auto'")
                st = Stager(kernels, "mapped" if reg is not None else "ring", reg)
                st.why_ring = why
        self.stagers[key] = st
        return st


def check_on_full(on_full) -> None:
    if on_full not in ON_FULL:
        raise SessionError(f"on_full must be {' or '.join(map(repr, ON_FULL))}, not {on_full!r}",
                           where="checkpoint")


def space_after(space, reservations: tuple, last: int, regions: int):
    """The space (a `wal.compaction.Space`) the epoch's `reservations`
    (`EpochRunner.reservations`) leave of `space` at the most, or None when
    they may not fit.  The appender places each reservation where the last
    ended, in a fresh segment when it does not fit the rest of that one
    (`Space.after` follows it), and so do they here, with an extent of the
    last epoch's `last` bytes first where an extent pipeline runs (a pass
    reserves one sized by the last epoch's records, padding when they grew)
    and the commit record at the end."""
    from concordia.wal import format as fmt

    records, extents = reservations
    lengths = ([min(int(last), space.capacity)] if extents and last else []) + list(records) + list(extents)
    lengths.append(fmt.record_length(fmt.COMMIT_BODY_SIZE + fmt.COMMIT_DIGEST_SIZE * regions))
    return space.after(fmt.align64(x) for x in lengths)
