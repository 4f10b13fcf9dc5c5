"""`Session`: the public API that protects a program's GPU (or host) state.

    s = Session("shm:agent-7")                    # open, or create, a log on any tier
    s.register("kv", kv, kind="kv", page_bytes=4096, block_tables=bt, seq_lens=lens)
    s.register("adapter", lora, kind="adapter")
    s.checkpoint()                                # one durable epoch across all regions
    ...
    arrays = Session("shm:agent-7").recover()     # {name: array} as of the last commit

A checkpoint is one epoch: for every region the dirty pages are found (see
`concordia.regions`), staged as page-batch records into reserved log space,
persisted, and then one commit record carries every region's digest.  The first
checkpoint of a region in a log writes all its pages (as ordinary page batches
of that epoch: the BASE flag of FORMAT.md §12 belongs to base snapshots listed
in a catalog, which compaction writes).  An
epoch without its commit never reaches a region, so a crash at any point leaves
the state of the previous commit.

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
one table pass (`concordia.checkpoint`): one detection launch per detector
group over a region table, one staging pass of every record into one extent,
one wait, one commit (`CheckpointStats.table_pass`).

Every path writes the same record bytes for the same state.  The device path
reads the device back twice per checkpoint at most: the dirty-page counts (to
size the extents) and, after staging, the extents' cursors with the region
digests (computed on the device from a per-page CRC table kept there).  On a
mapped log it reads once when each region's dirty pages fit an extent reserved
before its detector ran (as many pages as its last checkpoint found, at most
32): the detector lists the pages and one `stage_delta` launch writes the
record, the CRC table and the moved digest (`_DeviceKernels.delta`).

Regions keep their framework and dtype: a bfloat16 or float8 torch tensor is
registered as it is (the log names its logical dtype beside the byte layout)
and `recover()` hands back a torch tensor of that dtype.  A checkpoint is
ordered after each region's producer stream and a recovery into device
tensors before their later work (`regions.StreamOrder`, `checkpoint`).

Bad input raises a one-line `SessionError` subclass before anything is written.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time

import numpy as np

from concordia.errors import (ConcordiaError, DuplicateRegionError, InstrumentError, NotALogError,
                              NothingToRecoverError, PathNotFoundError, RecoverMismatchError, RegionMismatchError,
                              SessionClosedError, SessionError, UnknownRegionError, UnsupportedArrayError)
from concordia.gpu_kernels import reference as ref
from concordia.policy import Policy
from concordia.checkpoint.device import _DeviceKernels
from concordia.checkpoint.host import _HostKernels
from concordia.checkpoint.staging import _page_crcs, _register, _Stager, _stage_region, batch_pages
from concordia.checkpoint.table import RegionTable
from concordia.executor.resident import EXECUTORS, start_executor
from concordia.regions import (DETECTORS, KINDS, KvGeometry, Region, StreamOrder, adapt, logical_of, numpy_dtype,
                               present, storage_of, to_host, torch_dtype)
from concordia.retention import Retention

DEFAULT_SIZE = 256 << 20
STAGING = ("auto", "mapped", "ring", "host")
#: how many checkpoints' statistics `Session.checkpoints` keeps (the newest); a
#: long run's memory stays flat, and `Session.checkpoint_totals` counts them all
CHECKPOINTS_KEPT = 256


class CheckpointStats:
    """What one checkpoint did.  Times in milliseconds.

    epoch, reason
    pages          region name -> pages written
    base           regions written whole (first checkpoint in this log)
    bytes          payload bytes written
    log_bytes      record bytes written (headers and tables included)
    detect_ms, stage_ms, commit_ms
    via            region name -> path (module docstring)
    device_reads   host waits on the device in the extent pipeline
    table_pass     one pass over the region table took every region (checkpoint package)
    executor       "host" (the caller's thread ran the epoch) or "resident" (the
                   session's executor did: `concordia.executor.resident`)

    A table pass hands over its names and per-region counts (`_of_table`):
    `pages` and `via` are built from them when first read, so a checkpoint
    of many regions does no Python per region for its statistics."""

    _FIELDS = ("epoch", "reason", "pages", "base", "bytes", "log_bytes", "detect_ms", "stage_ms", "commit_ms",
               "via", "device_reads", "table_pass", "executor")
    __slots__ = ("epoch", "reason", "_pages", "base", "bytes", "log_bytes", "detect_ms", "stage_ms", "commit_ms",
                 "_via", "device_reads", "table_pass", "executor", "_lazy")

    def __init__(self, epoch: int, reason: str, pages: dict, base: list, bytes: int, log_bytes: int,
                 detect_ms: float, stage_ms: float, commit_ms: float, via: dict | None = None,
                 device_reads: int = 0, table_pass: bool = False):
        self.epoch, self.reason, self._pages, self.base = epoch, reason, pages, base
        self.bytes, self.log_bytes = bytes, log_bytes
        self.detect_ms, self.stage_ms, self.commit_ms = detect_ms, stage_ms, commit_ms
        self._via = {} if via is None else via
        self.device_reads, self.table_pass = device_reads, table_pass
        self.executor = "host"
        self._lazy = None

    @classmethod
    def _of_table(cls, epoch, reason, names, counts, label, nbytes, log_bytes, detect_ms, stage_ms, commit_ms,
                  device_reads) -> "CheckpointStats":
        """The statistics of a table pass: `names` (kept, never changed) and
        `counts` (an integer array of the pass, one per name) become `pages`
        and `via` (every region `label`) when first read."""
        st = cls(epoch, reason, None, [], nbytes, log_bytes, detect_ms, stage_ms, commit_ms, None, device_reads, True)
        st._via = None
        st._lazy = (names, counts, label)
        return st

    def _build(self) -> None:
        names, counts, label = self._lazy
        self._pages = dict(zip(names, counts.tolist()))
        self._via = dict.fromkeys(names, label)
        self._lazy = None

    @property
    def pages(self) -> dict:
        if self._lazy is not None:
            self._build()
        return self._pages

    @pages.setter
    def pages(self, value: dict) -> None:
        if self._lazy is not None:
            self._build()
        self._pages = value

    @property
    def via(self) -> dict:
        if self._lazy is not None:
            self._build()
        return self._via

    @via.setter
    def via(self, value: dict) -> None:
        if self._lazy is not None:
            self._build()
        self._via = value

    def page_counts(self) -> tuple | None:
        """(names, counts) of a table pass (a list, and an integer array of the
        pages each region wrote) without building `pages`; None otherwise."""
        return None if self._lazy is None else self._lazy[:2]

    @property
    def total_ms(self) -> float:
        return self.detect_ms + self.stage_ms + self.commit_ms

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._FIELDS)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None

    def __repr__(self) -> str:
        return "CheckpointStats(" + ", ".join(f"{f}={v!r}" for f, v in zip(self._FIELDS, self._values())) + ")"

    def to_json(self) -> dict:
        import copy

        d = {f: copy.deepcopy(v) for f, v in zip(self._FIELDS, self._values())}
        d["total_ms"] = self.total_ms
        return d


@dataclasses.dataclass
class CheckpointTotals:
    """Every checkpoint of a session, summed (`Session.checkpoint_totals`):
    how many, payload bytes and record bytes written."""

    count: int = 0
    bytes: int = 0
    log_bytes: int = 0

    def add(self, stats: CheckpointStats) -> None:
        self.count += 1
        self.bytes += stats.bytes
        self.log_bytes += stats.log_bytes


@dataclasses.dataclass
class RecoveryStats:
    epoch: int
    plan_ms: float
    restore_ms: float
    bytes: int             # payload bytes read from the log
    pages: int
    regions: dict          # name -> bytes of the region
    dropped: list
    via: dict = dataclasses.field(default_factory=dict)  # name -> "device pipeline" | "host"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _wal():
    from concordia import wal
    from concordia.wal import Log

    return wal, Log


class Session:
    """Protects registered arrays by checkpointing them into one log.

    log: a log name (``file:PATH``, ``shm:NAME``, ``pmem:PATH``, ``dax:/dev/daxX.Y``,
    a plain path), a `devmem` backend, or an open `concordia.wal.Log`.
    create: format a new log when the target holds none.  overwrite: format
    even when it holds one (its contents are lost).  size / segment_size: of a
    new log.  policy: when `step()` checkpoints (a `Policy`).  staging: how
    pages reach the log ("auto", "mapped", "ring", "host"; see the module
    docstring): "auto" stages CuPy regions on the device (zero copy where the
    tier allows it) and numpy regions on the host.

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
    caller's thread.  "auto" (the default) takes "host" until a measured win
    of the resident path is recorded (`executor_info["why"]`).

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
        self.resident = None
        self.staging = staging
        self._stagers: dict[str, _Stager | None] = {}
        #: why the device path is not used (None while it is, or was never needed)
        self.gpu_fallback: str | None = None
        #: how many region checkpoints took each path
        self.paths: collections.Counter = collections.Counter()
        self.policy = policy or Policy()
        self._regions: dict[str, Region] = {}
        #: raised whenever the regions or their checkpoint state change other than by
        #: a table pass: the cached routes and region table are rebuilt
        self._version = 0
        self._producers = None  # (version, one region per producer stream key), see _stream_order
        self._routes: tuple | None = None   # (version, routes)
        self._table: tuple | None = None    # (version, table pass or None)
        self._closed = False
        if readonly and (create or overwrite):
            raise SessionError("a read-only session opens an existing log: pass create=False",
                               where=str(log), hint="Session(log, create=False, readonly=True)")
        self.readonly = readonly
        self._target = log
        self.log, self._owns_log = _open_log(log, create=create, size=size, segment_size=segment_size,
                                             overwrite=overwrite, readonly=readonly)
        # epochs this session has tried; the appender knows those any writer
        # of the log has (a failed checkpoint's records stay in the log)
        self._next_epoch = self.epoch + 1
        #: the newest CHECKPOINTS_KEPT checkpoints' statistics, oldest first (a bounded
        #: deque, not the whole history: the totals are in checkpoint_totals)
        self.checkpoints: collections.deque[CheckpointStats] = collections.deque(maxlen=CHECKPOINTS_KEPT)
        self.checkpoint_totals = CheckpointTotals()
        self.last_recovery: RecoveryStats | None = None
        #: automatic bases and compaction under the policy (concordia.retention)
        self.retention = Retention(self, self.policy)
        self._before_checkpoint: list = []
        #: `resident`: the executor behind the session (None: the caller's thread
        #: runs every epoch); `executor_info`: which path epochs take, and why
        self.resident, self.executor_info = start_executor(self, executor)

    def _exclusive(self):
        """Held while the regions change: a resident executor's trigger may be
        running an epoch over them on its own thread."""
        return self.resident.lock if self.resident is not None else contextlib.nullcontext()

    def _commit(self, app, epoch: int, digests) -> None:
        if self.resident is not None:
            self.resident.commit(app, epoch, digests)
        else:
            app.commit(epoch, digests=digests)

    # ------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Close the log (when this session opened it).  Registered arrays are
        left as they are; committed epochs stay in the log."""
        if self._closed:
            return
        if self.resident is not None:
            self.resident.close()
        self._closed = True
        for r in self._regions.values():
            self._untrack(r)
        for st in self._stagers.values():
            if st is not None:
                st.close()
        self._stagers.clear()
        if self._owns_log:
            self.log.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, doing: str) -> None:
        if self._closed:
            raise SessionClosedError(f"cannot {doing}: the session is closed",
                                     hint="open a new Session on the same log")

    @property
    def epoch(self) -> int:
        """The last committed epoch of the log (0 when none)."""
        return int(self.log.last_committed_epoch or 0)

    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    # ------------------------------------------------------------ register
    def register(self, name: str, array, kind: str = "opaque", page_bytes: int = 4096, *,
                 detect: str = "auto", block_tables=None, seq_lens=None, block_stamp=None,
                 seq_ids=None, slot_versions=None, pages_per_slot: int | None = None,
                 check_every: int = 8, stream=None) -> Region:
        """Protect `array` (numpy, CuPy, or a PyTorch tensor through DLPack) as
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
        region's `missed_pages`.
        """
        self._check_open(f"register region {name!r}")
        where = f"region {name!r}"
        if not isinstance(name, str) or not name or len(name) > 255:
            raise SessionError("a region name is a non-empty string of at most 255 characters",
                               where=f"region {name!r}")
        if kind not in KINDS:
            raise SessionError(f"unknown kind {kind!r} (use {', '.join(KINDS)})", where=where)
        if detect not in DETECTORS:
            raise SessionError(f"unknown detector {detect!r} (use {', '.join(DETECTORS)})", where=where)
        if not isinstance(page_bytes, (int, np.integer)) or page_bytes <= 0 or page_bytes % 64:
            raise SessionError(f"page_bytes must be a positive multiple of 64, not {page_bytes!r}",
                               where=where)
        batch_pages(int(page_bytes), _segment_capacity(self.log), where)  # one page must fit a record
        if name in self._regions:
            raise DuplicateRegionError("a region of this name is already registered", where=where)
        arr, xp, owner = adapt(array, where)
        if not arr.flags.c_contiguous:
            raise UnsupportedArrayError("the array is not C-contiguous", where=where,
                                        hint="protect the contiguous base array")
        if arr.nbytes == 0:
            raise UnsupportedArrayError("the array is empty", where=where)
        if arr.dtype.kind not in "biufc":
            raise UnsupportedArrayError(f"dtype {arr.dtype} cannot be logged", where=where)
        logical, framework = logical_of(owner)

        hints: dict = {}
        if detect == "auto":
            if kind == "kv" and block_tables is not None and seq_lens is not None:
                detect = "blocks"
            elif kind == "adapter" and slot_versions is not None:
                detect = "versions"
            else:
                detect = "shadow"
        if detect == "blocks":
            if block_tables is None or seq_lens is None:
                raise SessionError("the block-table scanner needs block_tables and seq_lens", where=where)
            hints.update(block_tables=block_tables, seq_lens=seq_lens, block_stamp=block_stamp,
                         seq_ids=seq_ids, geometry=KvGeometry.of(arr.shape, arr.dtype.itemsize, where))
        if detect == "versions":
            if slot_versions is None or not pages_per_slot:
                raise SessionError("the version scanner needs slot_versions and pages_per_slot",
                                   where=where)
            hints.update(slot_versions=slot_versions, pages_per_slot=int(pages_per_slot))
        if detect == "stores":
            if xp is np:
                raise SessionError("the store tracker sees writes by GPU kernels: detect='stores' needs a device array",
                                   where=where, hint="use detect='shadow' or 'fingerprint' for a host array")
            if isinstance(check_every, bool) or not isinstance(check_every, (int, np.integer)) or check_every < 0:
                raise SessionError(f"check_every must be a whole number >= 0, not {check_every!r}", where=where)

        self.retention.check_capacity(name, arr.nbytes, int(page_bytes))
        region = Region(name=name, kind=kind, page_bytes=int(page_bytes), array=arr, xp=xp, owner=owner,
                        storage=storage_of(owner), detect=detect, hints=hints, logical=logical,
                        framework=framework, stream=stream)
        if stream is not None:
            StreamOrder.of([(owner, stream)])  # refuse a stream of an unknown kind now
        info = self.log.regions.get(name)
        if info is not None:
            _check_same(info, region)
        if detect == "stores":
            from concordia import instrument

            try:
                region.tracked = instrument.track(name, arr, int(page_bytes))
            except InstrumentError as exc:
                raise SessionError(f"the store tracker cannot take this region: {exc.message}", where=where,
                                   hint="call concordia.instrument.enable(track_stores=True) before the kernels "
                                        "that write the array are compiled") from None
            region.check_every = int(check_every)
        if info is not None:
            region.id = int(info.id)
        else:
            try:
                self._writer(f"register region {name!r}")  # the log lacks it: a descriptor is written
                region.id = int(self.log.define_region(name, arr.dtype.str, region.shape, region.page_bytes, kind,
                                                       logical=logical, framework=framework))
            except BaseException:
                self._untrack(region)
                raise
        if self.resident is not None:  # a new kind's handler is in the table before an epoch can see the region
            self.resident.region_added(region)
        with self._exclusive():
            self._regions[name] = region
            self._version += 1
        return region

    @staticmethod
    def _untrack(region: Region) -> None:
        if region.tracked is not None:
            from concordia import instrument

            instrument.untrack(region.tracked)
            region.tracked = None

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
        with self._exclusive():  # not while a resident trigger's epoch advances the detectors
            return sum(int(r.dirty_pages(advance=False).size) * r.page_bytes for r in self._regions.values())

    def before_checkpoint(self, fn) -> None:
        """Call `fn()` at the start of every checkpoint, before any region is
        read or ordered against its producer stream: for state an integration
        mirrors into a registered array (the host-side counters of a
        framework's cache), queued on the caller's current stream."""
        if not callable(fn):
            raise SessionError(f"before_checkpoint takes a callable, not {fn!r}")
        self._before_checkpoint.append(fn)

    def checkpoint(self, *, reason: str = "manual", stream=None) -> CheckpointStats:
        """One durable epoch across every registered region; returns what it wrote.

        Stream order: every region is captured as of this call in its
        producer's stream order, the producer being `stream` (for every
        region) when given, else the stream given at `register`, else the
        framework's current stream now: PyTorch's current stream of the
        tensor's device for a torch tensor, CuPy's current stream for a CuPy
        array.  So a write queued on a side stream just before the call, inside
        `with torch.cuda.stream(side):`, is in the epoch without any
        synchronise.  It is done with events (`regions.StreamOrder`): no
        device-wide synchronise, and the producer streams wait for the
        checkpoint's device work before their later work runs."""
        self._check_open("checkpoint")
        if self.resident is not None and not self.resident.inside():
            return self.resident.checkpoint(reason=reason, stream=stream)
        if not self._regions:
            raise SessionError("nothing to checkpoint: no region is registered")
        self._writer("checkpoint")
        for fn in self._before_checkpoint:
            fn()
        table = self._table_pass()
        if table is None or not table.table.unchanged():
            for r in self._regions.values():
                r.check_unchanged()  # before anything is written
        order = self._stream_order(stream)
        order.after_producers()
        epoch = max(self._next_epoch, self.log.appender.next_epoch)
        self._next_epoch = epoch + 1  # never reused, even if this epoch fails
        if table is not None:
            try:
                return self._checkpoint_table(table, epoch, reason)
            finally:
                order.before_later_work()  # the producers write on only after the pass read the regions
        self._version += 1  # the paths below may replace CRC tables and detector state
        app = self.log.appender
        pages, base, nbytes, log_bytes, via = {}, [], 0, 0, {}
        detect_s = stage_s = 0.0
        reads = 0
        routes = self._route()
        try:
            base = [r.name for r in self._regions.values() if r.crcs is None]
            for r in routes[None]:
                t0 = time.perf_counter()
                is_base = r.crcs is None
                ids = r.dirty_pages(advance=True)
                t1 = time.perf_counter()
                if is_base:
                    r.crcs = np.zeros(r.pages, np.uint32)
                elif not isinstance(r.crcs, np.ndarray):
                    r.crcs = to_host(r.crcs)  # the region left the device path
                lb = _stage_region(app, r, ids, epoch, is_base)
                if ids.size or r.digest is None:
                    r.digest = ref.region_digest(r.crcs)
                t2 = time.perf_counter()
                detect_s += t1 - t0
                stage_s += t2 - t1
                pages[r.name] = int(ids.size)
                nbytes += int(ids.size) * r.page_bytes
                log_bytes += lb
                via[r.name] = "host"
            for key in ("gpu", "cpu"):
                if routes.get(key):
                    st = self._stagers[key]
                    got = st.run(app, routes[key], epoch)
                    detect_s += got["detect_s"]
                    stage_s += got["stage_s"]
                    reads += got["device_reads"]
                    log_bytes += got["log_bytes"]
                    for r in routes[key]:
                        n = got["pages"][r.name]
                        pages[r.name] = n
                        nbytes += n * r.page_bytes
                        via[r.name] = st.label
            pages = {name: pages[name] for name in self._regions}
            t3 = time.perf_counter()
            digests = {r.id: r.digest for r in self._regions.values()}
            self._commit(app, epoch, digests)
            commit_s = time.perf_counter() - t3
        except BaseException:
            self._lose_baselines()
            raise
        if base:  # a region written whole now has a baseline for its detector
            for name in base:
                self._regions[name].reset_detectors()
        order.before_later_work()  # the detectors' copies are taken before the producers write on
        self.policy.reset()
        stats = CheckpointStats(epoch, reason, pages, base, nbytes, log_bytes,
                                detect_s * 1e3, stage_s * 1e3, commit_s * 1e3, via, reads)
        self.paths.update(via.values())
        self.checkpoints.append(stats)
        self.checkpoint_totals.add(stats)
        self.retention.after_commit(stats)  # bases and compaction, one bounded slice
        return stats

    def _checkpoint_table(self, table, epoch: int, reason: str) -> CheckpointStats:
        """One epoch by a table pass: one detection launch per detector group,
        one staging pass into one extent, one wait, one commit (no Python per
        region beyond building the statistics)."""
        app = self.log.appender
        try:
            got = table.run(app, epoch)
            t3 = time.perf_counter()
            self._commit(app, epoch, table.table.commit_digests())
            commit_s = time.perf_counter() - t3
        except BaseException:
            self._lose_baselines()
            raise
        self.policy.reset()
        names = table.table.names
        counts = got.counts
        stats = CheckpointStats._of_table(epoch, reason, names, counts, table.label,
                                          int(counts @ table.table.page_bytes), int(got.log_bytes),
                                          got.detect_s * 1e3, got.stage_s * 1e3, commit_s * 1e3, got.device_reads)
        self.paths[table.label] += len(names)
        self.checkpoints.append(stats)
        self.checkpoint_totals.add(stats)
        self.retention.after_commit(stats)  # bases and compaction, one bounded slice
        return stats

    def _stream_order(self, stream) -> StreamOrder:
        """The producer streams of this checkpoint (`StreamOrder.for_checkpoint`),
        from one representative region per framework, device and given stream,
        chosen again only when the regions change: no Python per region."""
        cached = self._producers
        if cached is None or cached[0] != self._version:
            reps, seen = [], set()
            for r in self._regions.values():
                if not r.on_gpu:
                    continue
                key = (("given", id(r.stream)) if r.stream is not None else
                       (type(r.owner).__module__.split(".")[0], str(getattr(r.owner, "device", ""))))
                if key not in seen:
                    seen.add(key)
                    reps.append(r)
            # no device region and no stream given: no order to keep, and nothing to look up
            cached = self._producers = (self._version, reps, StreamOrder([]) if not reps else None)
        if stream is None and cached[2] is not None:
            return cached[2]
        return StreamOrder.for_checkpoint(cached[1], stream)

    def _lose_baselines(self) -> None:
        """After a failed checkpoint: the detectors may have advanced past pages
        that never got committed, so the next checkpoint of every region is a
        full base again."""
        self._table = None
        self._version += 1
        for r in self._regions.values():
            r.crcs = None
            r.digest = None

    # ------------------------------------------------------------ staging paths
    def _table_pass(self):
        """The table pass that checkpoints every region this epoch, or None:
        one is made when every region takes the same extent pipeline in
        "mapped" mode and has a base in the log, and kept until the regions
        change.  Otherwise the per-region paths below run."""
        cached = self._table
        if cached is not None and cached[0] == self._version:
            return cached[1]
        if cached is not None and cached[1] is not None:
            cached[1].table.write_back()  # the regions' digests, for whichever path runs next
        tp = None
        regions = list(self._regions.values())
        routes = self._route()
        for key in ("gpu", "cpu"):
            st = self._stagers.get(key)
            if (st is not None and len(routes[key]) == len(regions) and st.mode == "mapped"
                    and all(r.crcs is not None and r.digest is not None for r in regions)):
                tp = st.kernels.table_pass(RegionTable(regions, self.log.appender.segment_capacity), st.registration, st)
        self._table = (self._version, tp)
        return tp

    def _route(self) -> dict:
        """{None: host-path regions, "gpu": ..., "cpu": ...} for this checkpoint
        (kept while the regions do not change)."""
        if self._routes is not None and self._routes[0] == self._version:
            return self._routes[1]
        out = self._route_now()
        self._routes = (self._version, out)
        return out

    def _route_now(self) -> dict:
        out: dict = {None: [], "gpu": [], "cpu": []}
        for r in self._regions.values():
            key = None
            if self.staging != "host":
                if r.on_gpu:
                    st = self._stager("gpu")
                    if st is not None and r.device_aligned and st.kernels.prepare(r):
                        key = "gpu"
                    elif st is not None and self.gpu_fallback is None:
                        self.gpu_fallback = (f"region {r.name!r}: " + ("not 16-byte aligned" if not r.device_aligned
                                                                        else st.kernels.failed))
                elif self.staging in ("mapped", "ring") or self.resident is not None:
                    key = "cpu"  # a resident executor stages host regions by the region table too
                    self._stager("cpu")
            out[key].append(r)
        return out

    def _stager(self, key: str):
        """The extent pipeline for device ("gpu") or host ("cpu") regions, made
        once: a device one registers the log mapping with CUDA here and keeps it."""
        if key in self._stagers:
            return self._stagers[key]
        backend = self.log.backend
        st = None
        if key == "cpu":
            st = _Stager(_HostKernels(), "ring" if self.staging == "ring" else "mapped", None)
        else:
            try:
                kernels = _DeviceKernels()
            except Exception as exc:  # CuPy, CUDA or the kernel sources missing
                if self.staging != "auto":
                    raise SessionError(f"staging={self.staging!r} needs the GPU kernels: {exc}") from None
                self.gpu_fallback = f"GPU kernels unavailable ({type(exc).__name__}: {exc})"
            else:
                reg, why = None, None
                if self.staging in ("auto", "mapped"):
                    reg, why = _register(backend)
                    if reg is None and self.staging == "mapped":
                        raise SessionError(f"staging='mapped' needs a log the GPU can address: {why}",
                                           where=str(self.log_name), hint="use staging='ring' or 'auto'")
                st = _Stager(kernels, "mapped" if reg is not None else "ring", reg)
                st.why_ring = why
        self._stagers[key] = st
        return st

    # ------------------------------------------------------------ recover
    def recover(self, target="latest", *, into=None, device: str | None = None, mode=None,
                regions=None) -> dict:
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
        a one-line RecoverMismatchError naming the region.

        Stream order: the restore into a device target runs after the work
        queued on that target's current stream before the call (PyTorch's
        current stream of its device, CuPy's current stream) and before the
        work queued there after it (an event recorded on Concordia's stream,
        waited on by that stream).
        """
        self._check_open("recover")
        ex = self.resident
        if ex is not None and not ex.inside() and ex.routes_recover(device, into):
            return ex.recover(target, into=into, device=device, mode=mode, regions=regions)
        if self.readonly:
            self.refresh()
        if into is not None and not (into == "registered" or isinstance(into, dict)):
            raise SessionError("into must be None, 'registered' or a {name: array} dict")
        if device not in (None, "numpy", "cpu", "cupy", "cuda"):
            raise SessionError(f"unknown device {device!r} (use numpy or cupy)")
        targets = self._recover_targets(into)
        want = regions if regions is not None else (list(targets) if targets is not None else None)
        if want is not None:
            missing = [n for n in want if n not in self.log.regions]
            if missing:
                raise UnknownRegionError(f"the log holds no region {missing[0]!r} "
                                         f"(it holds {sorted(self.log.regions)})", where=str(self.log_name))
        on_device = device in ("cupy", "cuda")
        views = {}
        if targets is not None:  # check every target before restoring anything
            targets = {n: a for n, a in targets.items() if want is None or n in want}
            for name, arr in targets.items():
                views[name] = _check_target(self.log.regions[name], name, arr, device)
        for name in (want if want is not None else self.log.regions):
            if name not in views:
                _check_presentable(self.log.regions[name], name, on_device)
        if not self.log.last_committed_epoch:
            raise NothingToRecoverError("the log holds no committed epoch", where=str(self.log_name))
        t0 = time.perf_counter()
        st = self._stagers.get("gpu")
        registration = getattr(st, "registration", None)
        plan, plan_s = _plan(self.log, target, mode)
        out, via = {}, {}
        if targets is None:
            arrays = _apply(self.log, plan, want, on_device=on_device, registration=registration)
            via = {n: "device pipeline" if on_device else "host" for n in arrays}
            for name, a in arrays.items():
                out[name] = present(a, self.log.regions[name], device=on_device, where=f"region {name!r}")
        else:
            dev = {n: v for n, (v, xp) in views.items() if xp is not np}
            host = {n: v for n, (v, xp) in views.items() if xp is np}
            arrays = {}
            if dev:
                order = StreamOrder.of([(targets[n], None) for n in dev])
                order.after_producers()
                arrays.update(_apply(self.log, plan, list(dev), on_device=True, registration=registration, into=dev))
                order.before_later_work()
                via.update((n, "device pipeline") for n in dev)
            if host:
                for name, a in _apply(self.log, plan, list(host)).items():
                    host[name][...] = a
                    arrays[name] = a
                    via[name] = "host"
            out = {n: targets[n] for n in views}
            rest = [n for n in (want or []) if n not in views]  # regions= beyond the targets: new arrays
            if rest:
                for name, a in _apply(self.log, plan, rest, on_device=on_device, registration=registration).items():
                    arrays[name] = a
                    out[name] = present(a, self.log.regions[name], device=on_device, where=f"region {name!r}")
                    via[name] = "device pipeline" if on_device else "host"
        if into == "registered":
            self._table = None  # the CRC tables and digests are replaced below
            self._version += 1
            # deltas continue from the recovered state only when it is the log's
            # latest: after an older epoch the next checkpoint writes every page
            latest = int(plan.epoch) == int(self.log.last_committed_epoch or 0)
            for name, r in self._regions.items():
                r.crcs = _page_crcs(r) if latest and r.page_bytes == self.log.regions[name].page_bytes else None
                r.digest = None
                r.reset_detectors()
        t2 = time.perf_counter()
        self.last_recovery = RecoveryStats(
            epoch=int(plan.epoch), plan_ms=plan_s * 1e3, restore_ms=(t2 - t0 - plan_s) * 1e3,
            bytes=int(plan.bytes_to_read), pages=int(sum(rp.pages_read for rp in plan.regions.values())),
            regions={n: int(a.nbytes) for n, a in arrays.items()},
            dropped=[d.to_json() for d in plan.dropped], via=via)
        return out

    def refresh(self) -> int:
        """Read a log opened read-only afresh, so that epochs committed since by
        its writer are seen; returns the last committed epoch.  A writable
        session's log is its own and always current."""
        self._check_open("refresh")
        if not self.log.writable and self._owns_log:
            old = self.log
            self.log = _open_read_only(self._target)
            old.close()
        return self.epoch

    def _writer(self, doing: str):
        """The log, writable: a session on a log opened read-only (create=False)
        takes the writer lock and opens it for writing now (which cuts the
        uncommitted tail).  When a writer committed in between, the regions'
        CRC tables no longer describe the log's state: their next checkpoint
        writes them whole."""
        if self.log.writable:
            return self.log
        if self.readonly or not self._owns_log:
            raise SessionError(f"cannot {doing}: the log was opened read-only",
                               where=str(self.log_name),
                               hint="open it with Session(log, create=False) to write" if self.readonly
                               else "pass a Log opened with writable=True")
        _, Log = _wal()
        old = self.log
        seen = (old.last_committed_epoch, old.commits[-1].lsn if old.commits else 0)
        self.log = Log.open(self._target, writable=True, check_pages="last")
        old.close()
        self._version += 1  # cached routes and region table belong to the old open
        if (self.log.last_committed_epoch, self.log.appender.last_commit_lsn) != seen:
            for r in self._regions.values():
                r.crcs = None
                r.digest = None
        self._next_epoch = max(self._next_epoch, self.epoch + 1)
        return self.log

    def _recover_targets(self, into):
        if into is None:
            return None
        if into == "registered":
            if not self._regions:
                raise SessionError("recover(into='registered') with no region registered")
            return {n: r.owner for n, r in self._regions.items()}
        return dict(into)

    @property
    def log_name(self) -> str:
        return self.log.backend.where


# ---------------------------------------------------------------- helpers
def _open_read_only(log):
    """The read-only recovery path: no writer lock, nothing cut (a writer may be
    appending right now: `Log.open(live=True)`), and nothing refused at open
    (refuse=False): any log the command lines can read opens, and `recover`
    decides in the mode it is given, as they do."""
    _, Log = _wal()
    return Log.open(log, writable=False, check_pages="last", live=True, refuse=False)


def _open_log(log, *, create, size, segment_size, overwrite, readonly=False):
    """(Log, owned): open the named log, or create it where allowed.  With
    create=False a named log is opened read-only (Session's docstring), and
    nothing is ever created: a name that holds no log is refused in one line
    (PathNotFoundError, NotALogError)."""
    wal, Log = _wal()
    if isinstance(log, Log):
        if readonly and log.writable:
            raise SessionError("readonly=True with a Log opened for writing", hint="pass the log's name")
        return log, False
    named = isinstance(log, (str, os.PathLike))
    if readonly and not named:
        raise SessionError("readonly=True needs a log name", where=str(log))
    if overwrite and not create:
        raise SessionError("overwrite=True formats a new log, create=False opens an existing one",
                           where=str(log), hint="pass one of them")
    kw = {} if segment_size is None else {"segment_size": segment_size}
    # the tier as the opener reads the name: a file called `memory` is a file,
    # not the memory tier (formatting it unasked would destroy what it holds)
    from concordia.devmem import parse_spec
    from concordia.wal.volume import VOLATILE_KINDS

    volatile = named and parse_spec(log).kind in VOLATILE_KINDS
    if volatile and not create:
        raise NotALogError("holds no log: a log in this process's memory is made by this process",
                           where=log, hint="pass create=True to make one")
    if overwrite or volatile:  # a volatile tier holds nothing before this process made it
        return Log.create(log, size=size or DEFAULT_SIZE, overwrite=True, **kw), True
    if not create and named:  # recovery reads: the writer lock waits for the first write
        return _open_read_only(log), True
    try:
        # page payloads are checked at open only where V-C4 needs them (the last
        # one-sync commit's records): every page a recovery reads is checked
        # where it lands, and checking all of them here read the whole log
        # first (about 6 GB/s on one core)
        return Log.open(log, writable=True, check_pages="last"), True
    except (PathNotFoundError, NotALogError):
        if not create:
            raise
    # a target holding anything that is not a log (a file of the user's) is
    # refused and left as it is (TargetNotEmptyError), not formatted
    from concordia.wal.volume import check_format_target

    check_format_target(log, hint="pass overwrite=True to format it anyway")
    return Log.create(log, size=size or DEFAULT_SIZE, overwrite=True, **kw), True


def _segment_capacity(log) -> int:
    """The longest record one segment of `log` holds (Appender.segment_capacity)."""
    from concordia.wal import format as fmt

    return log.volume.segment_bytes - fmt.SEGMENT_HEADER_SIZE


def _check_same(info, r: Region) -> None:
    """A region already in the log must be the same region."""
    diffs = []
    if info.logical_dtype != r.logical_dtype or np.dtype(info.dtype) != r.dtype:
        diffs.append(f"dtype {info.logical_dtype} vs {r.logical_dtype}")
    if tuple(info.shape) != r.shape:
        diffs.append(f"shape {list(info.shape)} vs {list(r.shape)}")
    if int(info.page_bytes) != r.page_bytes:
        diffs.append(f"page_bytes {info.page_bytes} vs {r.page_bytes}")
    if info.kind != r.kind:
        diffs.append(f"kind {info.kind} vs {r.kind}")
    if diffs:
        raise RegionMismatchError("the log already holds this region with other attributes (log vs array: "
                                  + "; ".join(diffs) + ")", where=f"region {r.name!r}",
                                  hint="use another log or another region name")


def _dtype_name(obj) -> str:
    """The logical dtype name of an array or tensor ("bfloat16", "float32")."""
    if type(obj).__module__.split(".")[0] == "torch":
        return str(obj.dtype).split(".", 1)[1]
    return np.dtype(obj.dtype).name


def _check_target(info, name, arr, device=None):
    """(layout view, xp) of a recover target, or a one-line RecoverMismatchError
    naming the region: another logical dtype, shape or device, or a view that
    is not C-contiguous.  Nothing is written here."""
    where = f"region {name!r}"
    kind = "tensor" if type(arr).__module__.split(".")[0] == "torch" else "array"
    got = _dtype_name(arr) if hasattr(arr, "dtype") else None
    if got is not None and got != info.logical_dtype:
        raise RecoverMismatchError(f"cannot recover {info.logical_dtype} data into a {got} {kind}", where=where)
    shape = tuple(int(n) for n in arr.shape) if hasattr(arr, "shape") else None
    if shape is not None and shape != tuple(info.shape):
        raise RecoverMismatchError(f"cannot recover shape {list(info.shape)} into shape {list(shape)}", where=where)
    contiguous = (arr.is_contiguous() if kind == "tensor" else
                  getattr(getattr(arr, "flags", None), "c_contiguous", True))
    if not contiguous:
        raise RecoverMismatchError(f"the target {kind} is not C-contiguous (a view?)", where=where,
                                   hint="recover into the contiguous base, or into a new array and copy")
    a, xp, _ = adapt(arr, where)
    if np.dtype(a.dtype) != np.dtype(info.dtype) or tuple(a.shape) != tuple(info.shape):
        raise RecoverMismatchError(f"cannot recover {info.dtype}{list(info.shape)} bytes into "
                                   f"{a.dtype}{list(a.shape)}", where=where)
    if not a.flags.c_contiguous:
        raise RecoverMismatchError(f"the target {kind} is not C-contiguous", where=where)
    on_gpu = xp is not np
    if device is not None and on_gpu != (device in ("cupy", "cuda")):
        raise RecoverMismatchError(f"the target {kind} is on {'a GPU' if on_gpu else 'the host'}, device={device!r} "
                                   f"was asked for", where=where)
    if on_gpu:
        here = xp.cuda.Device().id
        if a.device.id != here:
            raise RecoverMismatchError(f"the target {kind} is on cuda:{a.device.id}, the restore runs on cuda:{here}",
                                       where=where, hint="call recover inside cupy.cuda.Device(n) of the targets")
    return a, xp


def _check_presentable(info, name, on_device: bool) -> None:
    """Refuse, before anything is restored, a region whose logical dtype this
    build cannot hand back (one line naming the region)."""
    from concordia.regions import _torch

    where = f"region {name!r}"
    size = np.dtype(info.dtype).itemsize
    if info.framework == "torch" and _torch() is not None:
        torch_dtype(info.logical_dtype, where, size)
        return
    if not info.logical:  # the layout is the logical dtype
        return
    numpy_dtype(info.logical_dtype, where, size)
    if on_device:
        raise UnsupportedArrayError(f"CuPy has no {info.logical_dtype} arrays: restore it as a PyTorch tensor or "
                                    "on the host", where=where)


def _plan(log, target, mode):
    """(plan, seconds) from the recovery planner."""
    from concordia.wal.planner import plan as make_plan

    kw = {} if mode is None else {"mode": mode}
    t0 = time.perf_counter()
    p = make_plan(log, target=target, **kw)
    return p, time.perf_counter() - t0


def _apply(log, p, regions, *, on_device: bool = False, registration=None, into=None) -> dict:
    """Apply plan `p` to `regions` on the host (new numpy arrays of each
    layout), or on the device pipeline (new CuPy arrays, or straight into the
    CuPy views in `into`)."""
    if on_device:
        from concordia.restore_device import apply_plan_cupy

        return apply_plan_cupy(log, p, regions=regions, registration=registration, into=into)
    from concordia.wal.apply import apply_plan_numpy

    return apply_plan_numpy(log, p, regions=regions)


__all__ = ["Session", "Policy", "CheckpointStats", "RecoveryStats", "ConcordiaError", "STAGING"]
