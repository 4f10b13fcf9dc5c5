"""`Session`: the public API that protects a program's GPU (or host) state.

    s = Session("shm:agent-7")                    # open, or create, a log on any tier
    s.register("kv", kv, kind="kv", page_bytes=4096, block_tables=bt, seq_lens=lens)
    s.register("adapter", lora, kind="adapter")
    s.checkpoint()                                # one durable epoch across all regions
    ...
    arrays = Session("shm:agent-7").recover()     # {name: array} as of the last commit

The session is a facade over the rooms that do the work:

    regions      what is protected: `RegionSet` (the regions, their baselines,
                 the next epoch), arrays in and out, stream order
    checkpoint   the epoch runner (`checkpoint.epoch.EpochRunner`): detection,
                 staging on the host or the device, the region table pass
    restore      the one recover entry (`restore.run`): target checks, the plan,
                 the host or device applier
    retention    automatic bases and compaction after each commit
    executor     who runs an epoch: the caller's thread, or the resident executor (its
                 thread, or the persistent kernel: `checkpoint.arena_route`)

Regions keep their framework and dtype: a bfloat16 or float8 torch tensor is registered as it is (the log
names its logical dtype beside the byte layout) and `recover()` hands back a torch tensor of that dtype.  A
checkpoint is ordered after each region's producer stream and a recovery into device tensors before their
later work (`regions.streams.StreamOrder`).

Bad input raises a one-line `SessionError` subclass before anything is written.
"""

from __future__ import annotations

import collections
import time

from concordia.checkpoint import detect
from concordia.checkpoint.arena_route import ArenaRoute, handler_why_not
from concordia.checkpoint.baseline import adopted
from concordia.checkpoint.epoch import STAGING, EpochRunner
from concordia.checkpoint.staging import page_crcs
from concordia.checkpoint.stats import CheckpointStats, CheckpointTotals
from concordia.executor.resident import EXECUTORS, decide_auto, start_executor
from concordia.policy import Policy
from concordia.regions.errors import SessionClosedError, SessionError
from concordia.regions.region import Region
from concordia.regions.registry import RegionSet
from concordia.restore import run as restore_run
from concordia.restore.ahead import Seeds
from concordia.restore.run import RecoveryStats
from concordia.retention import Retention
from concordia.root_error import ConcordiaError
from concordia.session_log import open_log as _open_log, open_read_only as _open_read_only, writable as _writable
from concordia.session_register import enroll

#: how many checkpoints' statistics `Session.checkpoints` keeps (the newest); a
#: long run's memory stays flat, and `Session.checkpoint_totals` counts them all
CHECKPOINTS_KEPT = 256


class Session:
    """Protects registered arrays by checkpointing them into one log.

    log: a log name (``file:PATH``, ``shm:NAME``, ``pmem:PATH``, ``dax:/dev/daxX.Y``,
    a plain path), a `devmem` backend, or an open `concordia.wal.Log`.
    create: format a new log when the target holds none.  overwrite: format
    even when it holds one (its contents are lost).  size / segment_size: of a
    new log.  policy: when `step()` checkpoints (a `Policy`).  staging: how
    pages reach the log ("auto", "mapped", "ring", "host"; see
    `concordia.checkpoint.epoch`): "auto" stages CuPy regions on the device
    (zero copy where the tier allows it) and numpy regions on the host.

    Read-only recovery: with create=False a named log is opened without the
    writer lock and nothing is cut, so `recover()` works beside a live writer
    and beside other readers (the uncommitted tail is left for the next writer
    to cut); the first write (`checkpoint`, or `register` of a region the log
    does not hold) takes the lock and opens the log for writing then.
    readonly=True never writes (a standby, a second reader): `checkpoint`
    refuses, and each `recover()` reads the log afresh (`refresh`), so it
    returns the newest epoch committed when it is called.

    executor: who runs an epoch.  "host": the caller's thread.  "resident":
    the session's executor (`concordia.executor.resident`): each
    `checkpoint()` is one EPOCH task on its task ring, each `recover()` of a
    host session one RECOVER task, and `session.resident.trigger(...)`
    checkpoints every N steps or instrumented launches with no call from the
    caller's thread.  "auto" (the default) runs the first epoch on the
    caller's thread, then takes "resident" where the device's EPOCH handler
    takes the regions' epochs (a CuPy session on shm, hugetlb or memory),
    else "host" for good (`executor_info["why"]`).

        s = Session("shm:agent-7", executor="resident")
        s.register("state", a); s.checkpoint()   # stats.executor == "resident"
    """

    def __init__(self, log, *, create: bool = True, size: int | None = None,
                 segment_size: int | None = None, policy: Policy | None = None,
                 overwrite: bool = False, staging: str = "auto", readonly: bool = False,
                 executor: str = "auto"):
        if staging not in STAGING:
            raise SessionError(f"unknown staging {staging!r} (use {', '.join(STAGING)})")
        if executor not in EXECUTORS:
            raise SessionError(f"unknown executor {executor!r} (use {', '.join(EXECUTORS)})")
        if readonly and (create or overwrite):
            raise SessionError("a read-only session opens an existing log: pass create=False",
                               where=str(log), hint="Session(log, create=False, readonly=True)")
        self.resident = None
        #: a read of the log ahead of the first recovery (`concordia.prefetch`): every call waits for it
        self.ahead = None
        self._closed = False
        self.readonly = readonly
        self.policy = policy or Policy()
        self._target = log
        t_open = time.perf_counter()
        self.log, self._owns_log = _open_log(log, create=create, size=size, segment_size=segment_size,
                                             overwrite=overwrite, readonly=readonly)
        #: the log's open (map, scan, recover its state): the first recovery's "open" phase
        self._open_s: float | None = time.perf_counter() - t_open
        #: the regions, their baselines and the epochs this session has tried
        self.region_set = RegionSet(next_epoch=int(self.log.last_committed_epoch or 0) + 1)
        self.runner = EpochRunner(self.region_set, staging, self._commit, table_for_host=executor == "resident")
        #: the newest CHECKPOINTS_KEPT checkpoints' statistics (the totals: checkpoint_totals)
        self.checkpoints: collections.deque[CheckpointStats] = collections.deque(maxlen=CHECKPOINTS_KEPT)
        self.checkpoint_totals = CheckpointTotals()
        self.last_recovery: RecoveryStats | None = None
        #: automatic bases and compaction under the policy (concordia.retention)
        self.retention = Retention(self, self.region_set, self.policy)
        self.checkpoint_hooks: list = []  # before_checkpoint()
        #: `resident`: the executor behind the session (None: the caller's thread
        #: runs every epoch); `executor_info`: which path epochs take, and why
        try:
            self.resident, self.executor_info = start_executor(self, self.region_set, executor, ArenaRoute)
        except BaseException:
            if self._owns_log:
                self.log.close()
            raise

    def _commit(self, app, epoch: int, digests) -> None:
        if self.resident is not None:
            self.resident.commit(app, epoch, digests)
        else:
            app.commit(epoch, digests=digests)

    @property
    def staging(self) -> str:
        return self.runner.staging

    @property
    def gpu_fallback(self) -> str | None:  # why the device path is not used (None while it is)
        return self.runner.gpu_fallback

    @property
    def paths(self) -> collections.Counter:  # how many region checkpoints took each path
        return self.runner.paths

    # ------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Close the log (when this session opened it); registered arrays and committed epochs stay as they are.
        The session lets go of its regions and `before_checkpoint` hooks: a closed session still in scope holds
        none of the caller's arrays (a 30 GB cache is freed when the caller drops it, not at a collection)."""
        if self._closed:
            return
        if self.ahead is not None:  # its thread reads the log until it ends (interrupted: the session stays open)
            self.ahead.close()
        try:
            if self.resident is not None:  # no trigger epoch after this: its arena is taken on by `settle`
                self.resident.close()
            self.settle()  # a pending epoch commits before the log closes
        finally:
            self._closed = True
            self._close_rest()

    def _close_rest(self) -> None:
        for r in self.region_set:
            r.untrack()
        self.region_set.release()
        self.checkpoint_hooks.clear()  # an integration's hook holds its guard, and the guard this session
        self.runner.close()
        if self._owns_log:
            self.log.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, doing: str) -> None:
        if self._closed:
            raise SessionClosedError(f"cannot {doing}: the session is closed",
                                     hint="open a new Session on the same log")
        if self.ahead is not None:  # nothing reads or writes the log beside the read ahead
            self.ahead.wait()

    @property
    def epoch(self) -> int:
        """The last committed epoch of the log (0 when none), one in an arena not yet taken on included."""
        return max(int(self.log.last_committed_epoch or 0), self.runner.arena_epoch())

    @property
    def regions(self) -> dict[str, Region]:
        return self.region_set.as_dict()

    # ------------------------------------------------------------ register
    def register(self, name: str, array, kind: str = "opaque", page_bytes: int = 4096, *,
                 detect: str = "auto", block_tables=None, seq_lens=None, block_stamp=None,
                 seq_ids=None, slot_versions=None, pages_per_slot: int | None = None, length=None,
                 check_every: int | None = None, stream=None) -> Region:
        """Protect `array` (numpy, CuPy, a PyTorch tensor, or a DLPack array) as
        region `name`.  The array must stay the same object and be updated in
        place; its shape, dtype and storage are checked at every checkpoint (a
        tensor freed, resized or moved since is refused, naming the region).
        Any fixed-size dtype of numpy, ml_dtypes, CuPy or PyTorch is taken as
        it is (bfloat16, float8_e4m3fn, float8_e5m2, bool, complex, ...): the
        log records its name beside the byte layout, and what it was
        registered as, so that `recover()` hands back the same.

        stream: the CUDA stream that writes the array (a torch.cuda.Stream, a
        CuPy stream or a cudaStream_t).  A checkpoint captures the array as of
        the call in that stream's order; without it, in the order of the
        framework's current stream at the checkpoint (PyTorch's current stream
        of the tensor's device, CuPy's current stream; see `checkpoint`).

        kind="kv" with block_tables and seq_lens (live arrays, [seqs, max_blocks]
        and [seqs]) scans the block tables instead of diffing the cache; add
        block_stamp (per-block counter the caller raises on every write) so
        blocks freed between checkpoints are seen, and seq_ids (per-slot
        sequence id) so a slot handed to a new sequence is seen.
        kind="adapter" with slot_versions (a counter per slot the caller bumps
        on every write) and pages_per_slot scans versions instead of diffing.
        detect="stores" (a device array, `concordia.instrument` enabled with
        track_stores=True before the writing kernels were compiled) takes the
        pages the store tracker marked instead of scanning; every `check_every`
        checkpoints (0: never) a fingerprint diff adds any changed page the
        tracker did not see (writes by kernels that are not instrumented, such
        as precompiled library kernels, and copies) and counts it in the
        region's `missed_pages` (default 8).
        detect="positions" (kind="kv" with length=: "auto" takes it): a static
        cache [..., max_len, row] written at positions [length at the last
        checkpoint, length now) of each row, length= a callable or one-element
        array of the positions holding data; all of it when the length went down
        or seq_ids= (an id, or a callable) changed; page_bytes: one row
        (`regions.region.position_page_bytes`); check_every defaults to 0.
        """
        self._check_open(f"register region {name!r}")
        self.settle()
        return enroll(self, [dict(name=name, array=array, kind=kind, page_bytes=page_bytes, detect=detect,
                                  block_tables=block_tables, seq_lens=seq_lens, block_stamp=block_stamp,
                                  seq_ids=seq_ids, slot_versions=slot_versions, pages_per_slot=pages_per_slot,
                                  length=length, check_every=check_every, stream=stream)], self._writer)[0]

    def register_all(self, regions) -> list[Region]:
        """Register several regions in one call, all or none: `regions` is a
        list of dicts of `register`'s arguments ({"name": ..., "array": ...,
        "kind": ..., ...}).  Each is checked, and the log's room for one image
        of them all, before any is registered; an error (naming its region)
        registers none (a descriptor written for the log before a later
        failure, a rare I/O error, stays there, uncommitted until the next
        commit, as a failed `register`'s would).  A model's regions in one
        call settle and check the log's room once (`concordia.session_register`)."""
        self._check_open("register regions")
        if isinstance(regions, dict):
            raise SessionError("register_all takes a list of dicts, one a region, not one dict",
                               hint='register_all([{"name": "kv", "array": kv}, ...])')
        self.settle()
        return enroll(self, list(regions), self._writer)

    # ------------------------------------------------------------ checkpoint
    def step(self, n: int = 1) -> CheckpointStats | None:
        """Count `n` steps of the caller's loop and checkpoint when the policy says so."""
        self._check_open("step")
        self.policy.note_step(n)
        return self.maybe_checkpoint()

    def maybe_checkpoint(self) -> CheckpointStats | None:
        """Checkpoint if a trigger of the policy fires (steps, time, dirty bytes)."""
        self._check_open("checkpoint")
        dirty = self.dirty_bytes() if self.policy.needs_dirty_bytes else None
        reason = self.policy.due(dirty)
        return self.checkpoint(reason=reason) if reason else None

    def dirty_bytes(self) -> int:
        """Bytes a checkpoint taken now would write (detectors are not advanced)."""
        self._check_open("measure dirty bytes")
        self.settle()
        with self.region_set.lock:  # not while a resident trigger's epoch advances the detectors
            for r in self.region_set:   # a tensor freed or reallocated since is refused, as a checkpoint refuses it
                r.check_unchanged()
            return sum(int(detect.dirty_pages(r, advance=False).size) * r.page_bytes for r in self.region_set)

    def before_checkpoint(self, fn) -> None:
        """Call `fn()` at the start of every checkpoint, before any region is read or ordered against its
        producer stream: for state an integration mirrors into a registered array (the host-side counters of a
        framework's cache), queued on the caller's current stream."""
        if not callable(fn):
            raise SessionError(f"before_checkpoint takes a callable, not {fn!r}")
        self.checkpoint_hooks.append(fn)

    def settle(self) -> CheckpointStats | None:
        """Commit the epoch a `checkpoint(wait=False)` left pending, waiting
        for its device work (done long since, as a rule); returns its
        statistics (the object that call returned, now filled), or None when
        nothing was pending.  Every call that reads or writes the log, or changes the regions, settles first; so
        does `close`.  A trigger's epochs committed in an arena (checkpoint/arena.py) are taken on first."""
        with self.region_set.lock:  # not beside a trigger's epoch on the consumer, which may open another arena
            for stats in self.runner.adopt_arena(self.log):
                if not stats.listed:  # a resident route's epoch was listed when checkpoint() returned it
                    self.checkpoints.append(stats)
                self.checkpoint_totals.add(stats)
                self.retention.after_commit(stats, moved=True)
        stats = self.runner.settle()
        if stats is not None:
            self.checkpoint_totals.add(stats)
            self.retention.after_commit(stats, moved=True)
        return stats

    def checkpoint(self, *, reason: str = "manual", stream=None, on_full: str = "raise",
                   wait: bool = True) -> CheckpointStats:
        """One durable epoch across every registered region; returns what it wrote.

        on_full: when the log cannot take the epoch now, "raise" (LogFullError;
        every region's next checkpoint is then whole) or "coalesce": nothing is
        written, the pages stay dirty for the next checkpoint, retention frees
        what it can, and the stats say `coalesced` (epoch None; a
        LogPressureWarning once per run of them; `checkpoint.epoch`).

        wait=False: a pending epoch: when every region takes one device table
        pass and the epoch's records have a small upper bound (the pages of
        the device-scanned regions and those listed now: a decode step), the
        epoch is queued on the device in stream order and this returns
        without waiting for it; the statistics say `pending` and are filled
        when the session's next call commits it (`settle`).  A crash before
        then leaves the epoch before it.  Otherwise the checkpoint completes
        as with wait=True.

        Stream order: every region is captured as of this call in its producer's stream order (`stream`,
        else the stream given at `register`, else the framework's current stream now), with events only:
        see `regions.streams.StreamOrder`."""
        self._check_open("checkpoint")
        if self.resident is not None and not self.resident.inside():
            with self.runner.asking(on_full):  # for the epoch the executor runs by calling back in
                stats = self.resident.checkpoint(reason=reason, stream=stream)
            self.policy.reset()  # (an arena epoch does not call back in)
            return stats
        if not len(self.region_set):
            raise SessionError("nothing to checkpoint: no region is registered")
        self._writer("checkpoint")
        self.settle()
        for fn in self.checkpoint_hooks:
            fn()
        stats = self.runner.run(self.log, reason=reason, stream=stream, on_full=on_full, left=self.retention.room,
                                wait=wait)
        self.policy.reset()
        self.checkpoints.append(stats)
        if stats.pending:  # committed by the next call; retention takes its copies now, while they are its state
            self.retention.launched(stats.epoch)
            return stats
        self.checkpoint_totals.add(stats)
        if not self.executor_info["decided"] and stats.epoch is not None:  # "auto": its first epoch is in
            self.resident, self.executor_info = decide_auto(self, self.region_set, ArenaRoute, handler_why_not,
                                                            stats.epoch)
        self.retention.after_commit(stats)  # bases and compaction, one bounded slice (or a coalesced one's push)
        return stats

    # ------------------------------------------------------------ recover
    def recover(self, target="latest", *, into=None, device: str | None = None, mode=None,
                regions=None, absent: str = "refuse") -> dict:
        """Rebuild regions as of `target` ("latest" or an epoch number).

        into=None: new arrays of each region's logical dtype, as it was
        registered: PyTorch tensors for regions registered as tensors (when
        torch is importable), else numpy arrays (ml_dtypes for bfloat16 and
        float8); on the GPU with device="cupy" (CuPy arrays, or CUDA tensors).
        into="registered": into this session's registered arrays, in place; the
        next checkpoint then continues from the recovered epoch as a delta.
        into={name: array}: into the given arrays or tensors, in place.  Device
        arrays and CUDA tensors are restored on the device pipeline straight
        into their memory (no host round trip; page CRCs and region digests
        checked on the device); a corruption found midway raises and leaves
        them partly restored.  Host arrays are restored aside, then copied.

        Targets must match the log's regions exactly (logical dtype, shape, C
        contiguity, on CuPy's current device when on a GPU; device= when given):
        every target is checked before anything is written, and a mismatch is
        a one-line RecoverMismatchError naming the region (`restore.run`).
        absent="refuse": a region with no state at the epoch (registered after it) is a one-line
        AbsentRegionError before anything is written; "keep" leaves its target untouched (a new
        array: leaves it out) and lists it in `last_recovery.kept`.

        A read ahead (`concordia.prefetch`) of this epoch is copied from instead of the log (`restore.ahead`).

        Stream order: the copy into a device target runs after the work queued on its stream before the
        call (a registered region's register stream=, else PyTorch's current stream of its device or CuPy's)
        and before the work queued there after it (events recorded and waited on, no host wait).
        """
        self._check_open("recover")
        self.settle()
        ex = self.resident
        if ex is not None and not ex.inside() and ex.routes_recover(device, into):
            return ex.recover(target, into=into, device=device, mode=mode, regions=regions, absent=absent)
        if self.readonly:
            self.refresh()
        if into is not None and not (into == "registered" or isinstance(into, dict)):
            raise SessionError("into must be None, 'registered' or a {name: array} dict")
        restore_run.on_device(device)  # an unknown device is refused before anything else
        targets = adapted = order = None
        if into == "registered":
            if not len(self.region_set):
                raise SessionError("recover(into='registered') with no region registered")
            targets = {r.name: r.owner for r in self.region_set}
            adapted = {r.name: v for r in self.region_set if (v := r.unchanged_view()) is not None}
            # in each region's producer stream (as its checkpoints): the copies and the reads below come first
            order = self.runner.stream_order(None)
        elif into is not None:
            targets = dict(into)
        out, self.last_recovery = restore_run.recover(self.log, target, targets=targets, device=device, mode=mode,
                                                      regions=regions, registration=self.runner.registration,
                                                      absent=absent, ahead=self.ahead, adapted=adapted, order=order,
                                                      ring=restore_run.ring_of(ex, self.log))
        if self._open_s is not None and self.ahead is None:  # a fresh process's recovery: its open is part of it
            self.last_recovery.phases = {"open": {"s": self._open_s}, **self.last_recovery.phases}
        self._open_s = None  # (a read ahead's open ran on its thread: in its phase)
        seeds = self.ahead.take_seeds() if self.ahead is not None else Seeds()  # a read ahead hashed what it copied
        if into == "registered":
            # a region's deltas continue from what it was restored to only when that is the log's latest epoch
            # (after an older one, or skip_corrupt's fallback, the next checkpoint writes every page), and only
            # where it was restored: one not asked for, kept or given up holds what the log may not
            last, infos = int(self.log.last_committed_epoch or 0), self.log.regions
            epochs = self.last_recovery.epochs
            with restore_run.ordered_after(order):   # the copies' later work waits for them, even on a failure here
                self._continue_from({r.name: seeds.crcs(r, page_crcs) for r in self.region_set
                                     if epochs.get(r.name) == last and r.page_bytes == infos[r.name].page_bytes}, seeds)
        return out

    def adopt(self, epoch: int) -> dict:
        """Continue as deltas from arrays that hold the log's latest epoch (a standby's `Takeover.arrays`),
        each held to the log's digest first (`checkpoint.baseline.adopted`); returns {name: how}."""
        self._check_open("adopt an epoch")
        self.settle()
        tables, how = adopted(self.log, self.region_set, epoch, where=str(self.log_name))
        self._continue_from(tables)
        return how

    def _continue_from(self, tables: dict, seeds=None) -> None:   # the CRC tables to continue from (none: whole)
        self.runner.forget_table()  # the CRC tables and digests are replaced below
        self.region_set.recovered(tables)
        for r in self.region_set:  # seeds: of what a read ahead copied in (its bytes, whatever the epoch)
            detect.reset(r, recovered=True, fps=None if seeds is None else seeds.fps(r))

    def refresh(self) -> int:
        """Read a log opened read-only afresh, so that epochs committed since by its writer are seen; returns
        the last committed epoch.  A writable session's log is its own and always current."""
        self._check_open("refresh")
        self.settle()
        if not self.log.writable and self._owns_log and self.log.moved_on():
            old = self.log
            self.log = _open_read_only(self._target)
            old.close()
        return self.epoch

    def _writer(self, doing: str):  # the log, writable (`session_log.writable`)
        return _writable(self, doing, owns=self._owns_log, target=self._target)

    @property
    def log_name(self) -> str:
        return self.log.backend.where


__all__ = ["Session", "Policy", "CheckpointStats", "RecoveryStats", "ConcordiaError", "STAGING"]
