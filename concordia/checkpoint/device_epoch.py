"""The device's EPOCH handler from the host: a session's epoch run by the
persistent kernel (gpu_kernels/executor.cu built with CX_EPOCH) into an
arena of the log (concordia/checkpoint/arena.py), with no host step.

    epochs = DeviceEpochs(session)      # CuPy regions, one device table pass, a shm or hugetlb log
    c = epochs.epoch()                  # one EPOCH task: the completion the kernel wrote
    session.settle()                    # the arena's epochs taken on, as a CPU consumer's are

What runs where.  The host builds, once per arena, a descriptor
(`EPOCH_DESC`, the kernel's `cx_epoch_desc`) of the session's region table
and the table pass's device buffers (`checkpoint.device.DeviceTablePass`),
the arena (its extent's device address in the registered log mapping, LSN,
length, salt) and the arena's words (`arena.WORDS`, in mapped host memory:
the kernel moves them on, the host reads them).  An EPOCH task names the
descriptor; the control warp checks the room and launches the epoch: a
table of at most SMALL_PAGES pages as one block that runs the table pass's
device functions (detection per group, plan, stage, finalize, commit)
between its barriers, a larger one as one driver thread that launches the
pass's kernels in order on its own stream; it waits for the last of them.  An
epoch whose records fit the engine's snapshot (device memory, at most
SNAPSHOT_MAX_BYTES) is staged there first, at HBM speed, then copied into the
arena: its commit is claimed once it is staged (every region read), and a
trigger's gate goes then, so the producer's next step runs while the records
cross the bus, their headers are written and the commit stored.  The arena's
bytes are the same either way (`snapshot_epochs` counts those staged so).  The
completion says what the epoch wrote (pages, record bytes, the LSN of its
first record and of its commit): `epoch_on_device`.

The device trigger (`trigger`, `step_gate`, `fired`).  The producer queues
`step_gate` on its stream after each decode step: the step is counted in
stream order and, at each multiple of the armed N, held there.  Armed by an
EPOCH task with every = N, the control warp, between polls of the ring, runs
the epoch once a step holds, logs (epoch, count) in mapped memory and lets
go: an epoch at every N-th step, however far ahead the producer has queued,
while the caller's thread does anything at all, a pure-Python loop holding
the GIL included.  An arena with no room misses epochs (counted in its
words) until the host opens another; the host takes an arena on only after
`pause` (the session's settle calls it: `EpochRunner.arena_pause`), and
`rotate` moves an armed trigger onto a new one.

What the kernel can take: every row's dirty pages found on the device
(shadow copies, fingerprints, and static caches by positions from the
caller's device words: `arena.why_not`), at most `MAX_PAGE_SIZES` page
sizes among the scanned rows (the shadow and fingerprint kernels are
specialised by the page size: the module is built with one of each for the
table's sizes, `compile_defines`; a positions row reads its own), at most
`MAX_GROUPS` detection groups (`why_not`: four sizes of both detectors
already make eight).  A region of a new page size registered later changes
the regions: the route closes the engine and builds another, its module built
for the sizes then.  The kernel refuses, before it launches anything, a
descriptor naming a size its module lacks (executor.cu: epoch_refused).

CuPy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import numpy as np

from concordia.checkpoint import arena as arena_mod
from concordia.checkpoint.table import DET_FINGERPRINT, DET_SHADOW

from concordia.executor.errors import ExecutorError
from concordia.executor.cpu import _FENCE  # the host's store->load fence (ring.py step 5)
from concordia.executor.step_trigger import AHEAD_MAX, GATE_WORDS, SNAPSHOT_MAX_BYTES, is_fault

#: detection launches a descriptor holds (executor.cu: CX_MAX_GROUPS)
MAX_GROUPS = 8

GROUP = np.dtype([("rows", "<u8"), ("row_first", "<u8"), ("n_rows", "<u8"), ("pages", "<u8"),
                  ("detector", "<u8"), ("page_bytes", "<u8")])

#: page sizes of shadow and fingerprint rows one EPOCH module detects (executor.cu: PAGE_BYTES and
#: CX_PAGE_BYTES_1..3)
MAX_PAGE_SIZES = 4

#: executor.cu: struct cx_epoch_desc
EPOCH_DESC = np.dtype([(name, "<u8") for name in (
    "table", "n_rows", "flags", "total_pages", "ids", "recs", "max_records", "plan", "digests", "order",
    "mail_plan", "mail_counts", "mail_offsets",
    "arena", "arena_lsn", "arena_bytes", "salt", "bound", "commit_length", "words",
    "stage_blocks", "finalize_blocks", "n_groups", "fired", "fired_cap", "stamps",
    "small_pages", "snap", "snap_bytes", "snapped")]
    + [("groups", GROUP, (MAX_GROUPS,))])

#: a table of at most this many pages runs its epoch as one block of the
#: table pass's device functions (executor.cu: cx_epoch_small), in one launch;
#: a larger one as the pass's own kernels launched in order by a driver thread
SMALL_PAGES = 1024

# SNAPSHOT_MAX_BYTES (step_trigger's): the most device memory an engine keeps as its snapshot (executor.cu:
# via_snapshot); the name is this module's too, read at each engine's making (`bench model`'s held row sets it 0)

#: the phase stamps a descriptor may ask for (executor.cu: CX_STAMPS), in the
#: order the epoch takes them; each phase runs from the stamp before it
STAMPS = ("launch", "driver", "detect", "plan", "stage", "finalize", "commit", "close", "waited")

#: (epoch, count) pairs a trigger's log holds (executor.cu: trigger_poll)
FIRED_CAP = 4096



def why_not(tpass, backend) -> str | None:
    """Why the epochs of `tpass` (a table pass) cannot be run by the device's
    EPOCH handler on a log on `backend`, or None when they can."""
    from concordia.executor.persistent import host_order_why

    why = host_order_why()  # before anything is compiled or pinned for a ring this host cannot run
    if why is not None:
        return why
    if getattr(tpass, "label", "") != "gpu-mapped":
        return "the regions take no device table pass (CuPy regions, one mapped staging path)"
    why = arena_mod.why_not(tpass.table, backend)
    if why is not None:
        return why
    sizes = scanned_page_sizes(tpass.table)
    if len(sizes) > MAX_PAGE_SIZES:
        return (f"the regions scanned by shadow copies or fingerprints have {len(sizes)} page sizes; the EPOCH "
                f"handler is built for at most {MAX_PAGE_SIZES}")
    if len(tpass.groups) > MAX_GROUPS:
        return f"{len(tpass.groups)} detection groups; the EPOCH handler takes {MAX_GROUPS}"
    return None


def scanned_page_sizes(table) -> list:
    """The page sizes of the rows a shadow or fingerprint detector scans: the
    EPOCH handler's module is specialised for each (`compile_defines`);
    positions rows read their page size from the table."""
    e = table.entries
    scanned = (e["detector"] == DET_SHADOW) | (e["detector"] == DET_FINGERPRINT)
    return sorted(set(e["page_bytes"][scanned].tolist()))


def module_page_sizes(table) -> tuple[int, ...]:
    """The page sizes the EPOCH handler's module is built with for `table`:
    its scanned rows' (`scanned_page_sizes`), or its first row's when none is
    scanned (PAGE_BYTES is always defined)."""
    sizes = scanned_page_sizes(table)
    return tuple(int(b) for b in sizes) if sizes else (int(table.entries["page_bytes"][0]),)


def compile_defines(page_sizes) -> tuple[str, ...]:
    """The -D options of the executor module with the EPOCH handler, its
    detection built for `page_sizes` (one page size, or up to MAX_PAGE_SIZES
    of them): PAGE_BYTES the first, CX_PAGE_BYTES_1.. the others."""
    sizes = (int(page_sizes),) if isinstance(page_sizes, (int, np.integer)) else tuple(int(b) for b in page_sizes)
    if not 1 <= len(sizes) <= MAX_PAGE_SIZES or len(set(sizes)) != len(sizes):
        raise ValueError(f"an EPOCH module is built for 1 to {MAX_PAGE_SIZES} distinct page sizes, not {sizes}")
    return (("-DCX_EPOCH", f"-DPAGE_BYTES={sizes[0]}")
            + tuple(f"-DCX_PAGE_BYTES_{i}={b}" for i, b in enumerate(sizes[1:], 1)))


def describe(tpass, ar, arena_ptr: int, words_ptr: int, fired_ptr: int = 0, stamps_ptr: int = 0,
             small_pages: int = SMALL_PAGES, snap: tuple = (0, 0, 0)) -> np.ndarray:
    """The descriptor of `tpass` (a DeviceTablePass) epochs into the arena `ar`
    (an `arena.Arena`) whose first byte the device addresses at `arena_ptr`,
    whose words at `words_ptr`, with a trigger's log at `fired_ptr`, the
    phase stamps at `stamps_ptr` (0: none), the one-block path for tables
    of at most `small_pages` pages (0: never) and the snapshot `snap`
    (device pointer, bytes, the mapped u64 counting its epochs; 0s: none):
    one EPOCH_DESC row."""
    t = tpass.table
    d = np.zeros(1, EPOCH_DESC)
    r = d[0]
    mail = tpass.mail_dev.data.ptr
    r["table"], r["n_rows"] = tpass.d_table.data.ptr, len(t)
    r["flags"], r["total_pages"] = tpass.flags.data.ptr, t.total_pages
    r["ids"], r["recs"], r["max_records"] = tpass.ids.data.ptr, tpass.recs.data.ptr, t.max_records
    r["plan"], r["digests"], r["order"] = tpass.plan.data.ptr, tpass.d_digests.data.ptr, tpass.d_order.data.ptr
    r["mail_plan"], r["mail_counts"], r["mail_offsets"] = mail, mail + 64, mail + tpass._at_offsets
    r["arena"], r["arena_lsn"], r["arena_bytes"], r["salt"] = arena_ptr, ar.ext.lsn, ar.ext.length, ar.ext.salt
    r["bound"], r["commit_length"], r["words"] = ar.bound, t.commit_length, words_ptr
    r["stage_blocks"] = tpass.stage_grid[0]
    r["finalize_blocks"] = tpass.finalize_grid[0]
    r["n_groups"] = len(tpass.groups)
    r["fired"], r["fired_cap"] = fired_ptr, FIRED_CAP if fired_ptr else 0
    r["stamps"], r["small_pages"] = stamps_ptr, small_pages
    r["snap"], r["snap_bytes"], r["snapped"] = snap
    for i, (fn, rows, first, n_rows, pages) in enumerate(tpass.groups):
        g = r["groups"][i]
        g["rows"], g["row_first"], g["n_rows"], g["pages"] = rows.data.ptr, first.data.ptr, int(n_rows), pages
        g["detector"] = int(tpass.group_detectors[i])
        g["page_bytes"] = int(tpass.group_page_bytes[i])
    return d


#: engines whose kernel did not finish when stopped (`DeviceEpochs._abandon`), kept for good
_ABANDONED: list = []


class DeviceEpochs:
    """A session's epochs run by the persistent kernel (module doc).  The
    session's regions are CuPy arrays in one device table pass, its log on a
    tier whose writes need no persist call; the session's first epoch has
    committed (the regions have bases).  `close()` stops the kernel and takes
    the arena's epochs on.  stamps: each epoch stamps its phases (`phases()`),
    at the cost of a one-thread launch between them on the driver's path.
    small_pages: the largest table run as one block (SMALL_PAGES; 0: never).
    idle_s: the kernel leaves after this long without a task (the next task
    launches it again), unless a trigger is armed.  snapshot_max: the most
    device memory the snapshot takes (SNAPSHOT_MAX_BYTES; 0: none, every
    epoch staged straight into its arena with the gate held)."""

    def __init__(self, session, *, child_timeout_s: float = 20.0, stamps: bool = False,
                 small_pages: int = SMALL_PAGES, idle_s: float = 1.0, snapshot_max: int | None = None):
        from concordia.executor.host import Submitter
        from concordia.executor.persistent import ExecutorModule, GpuExecutor, GpuRing, MappedHostBuffer, require_cupy
        from concordia.executor.ring import ConsumerState, Op, Status

        cp = require_cupy()
        self.cp, self.session, self.Op, self.Status, self.ConsumerState = cp, session, Op, Status, ConsumerState
        session.settle()
        runner = session.runner
        tpass = runner.table_pass(session.log)
        why = "no table pass" if tpass is None else why_not(tpass, session.log.backend)
        if why is not None:
            raise ExecutorError(f"the device cannot take this session's epochs: {why}", where="device epochs")
        self.tpass = tpass
        #: the page sizes the module's detection is built for (the table's scanned rows')
        self.page_sizes = module_page_sizes(tpass.table)
        # RECOVER beside EPOCH: a resident session's device recoveries are tasks of this kernel (`recover_task`)
        self.module = ExecutorModule(child=True, ops=(Op.EPOCH, Op.RECOVER),
                                     extra_options=compile_defines(self.page_sizes) + ("-DCX_RECOVER",)).load()
        self.words = MappedHostBuffer(arena_mod.WORDS.itemsize, where="arena words")
        self.log = MappedHostBuffer(8 * (2 + 2 * FIRED_CAP), where="trigger log")
        self.log.array[:] = 0
        #: the steps the producer has queued (`mark_queued`): an armed kernel stays for those not yet run
        self.queued = MappedHostBuffer(8, where="queued steps")
        self.queued.array[:] = 0
        self._queued64, self._log64 = self.queued.array.view(np.uint64), self.log.array.view(np.uint64)
        self.stamps = MappedHostBuffer(8 * len(STAMPS), where="phase stamps") if stamps else None
        self.small_pages = int(small_pages)
        self.snapshot_max = SNAPSHOT_MAX_BYTES if snapshot_max is None else int(snapshot_max)
        #: the epochs staged through the snapshot (`snapshot_epochs`), counted by the device
        self.snapped = MappedHostBuffer(8, where="snapshot epochs")
        self.snapped.array[:] = 0
        self.snap = None  # the snapshot (CuPy uint8) the open arena's descriptor names
        self.snapshot_why: str | None = None  # why the open arena's epochs have none (out of device memory)
        #: which path the epochs take: one block ("small") or the driver's launches ("driver")
        self.path = "small" if tpass.table.total_pages <= self.small_pages else "driver"
        #: the descriptors handed to the kernel that it may still read: the open arena's and the one
        #: before (`_open` comes after the kernel let go of the older ones: a pause or a task returned)
        self.descs: list = []
        self.armed = None       # (every, counter, gate, skip) of the trigger armed, kept while it is paused
        self.kernel_armed = False  # whether the kernel's trigger writes the open arena now
        self.fired_kept: list = []  # the trigger's epochs moved out of its log at each arena swap
        self.last = None            # the completion of the last EPOCH task (`epoch`)
        self.closed_status = None   # once closed: the trigger's status then (its log is gone)
        self.gring = GpuRing(64, where="device epochs ring")
        self.executor = GpuExecutor(self.gring, self.module, child_timeout_s=child_timeout_s, lifetime_s=600.0,
                                    idle_s=idle_s)
        self.submitter = Submitter(self.gring.ring, self.executor)
        self.d_desc = None
        self._upload = cp.cuda.Stream(non_blocking=True)  # the stream descriptors go to the device on (`_open`)
        self.arena = None  # the arena `d_desc` describes
        try:
            self._open()
        except BaseException:  # no task was submitted: the kernel never ran, only the buffers go
            self._release()
            raise

    def _open(self) -> None:
        """An arena for the next epochs, its words in mapped memory, its descriptor on the device."""
        s, runner = self.session, self.session.runner
        words = self.words.array.view(arena_mod.WORDS)
        # the rest of a segment only where it holds the epochs a trigger keeps room for (`ArenaRoute.rotate`)
        ar = arena_mod.Arena(s.log.appender, self.tpass.table,
                             max(runner.regions.next_epoch, s.log.appender.next_epoch), words=words,
                             reason="device epoch", label=self.tpass.label, least=AHEAD_MAX)
        runner.arena = ar
        runner.arenas += 1
        runner.arena_pause = self.pause  # the session takes the arena on only once the kernel writes it no more
        self.arena = ar
        ptr = self.tpass.registration.device_ptr + ar.ext.offset
        desc = describe(self.tpass, ar, ptr, self.words.ptr, self.log.ptr,
                        self.stamps.ptr if self.stamps is not None else 0, self.small_pages, self._snapshot(ar))
        # on a stream of its own, not the caller's current one: an arena swap inside a producer's
        # step would otherwise wait there for every step it has queued (the legacy default stream
        # waits for all others), and the host, which feeds a compiled decode, would stall with it
        with self._upload:
            self.d_desc = self.cp.asarray(desc.view(np.uint8))
        # a swap each few steps: not one kept per swap for the run (each with the snapshot it names)
        self.descs = self.descs[-1:] + [(self.d_desc, self.snap)]
        self._upload.synchronize()
        if self.armed is not None:  # the trigger goes on into the new arena
            self._arm(*self.armed)

    def _snapshot(self, ar) -> tuple:
        """(device pointer, bytes, counter) of the snapshot for the arena `ar`:
        room for its `bound` record bytes, at most `snapshot_max`; the one
        before is kept while it holds as many (an arena's bound moves with
        the epochs' sizes), else another is made.  (0, 0, 0): none."""
        want = min(int(ar.bound), self.snapshot_max)
        if want <= 0:
            self.snap = None
            return (0, 0, 0)
        if self.snap is None or self.snap.size < want:
            try:
                self.snap = self.cp.empty(-(-want // 256) * 256, self.cp.uint8)  # the kernel reads the one before
            except self.cp.cuda.memory.OutOfMemoryError:  # the epochs go straight into the arena, the gate held
                self.snap = None
                self.snapshot_why = f"no device memory for a snapshot of {want} bytes"
                return (0, 0, 0)
        self.snapshot_why = None
        return (self.snap.data.ptr, self.snap.size, self.snapped.ptr)

    @property
    def snapshot_epochs(self) -> int:
        """The epochs staged through the snapshot so far (the device counts them)."""
        if self.closed_status is not None:
            return self._snapped_kept
        return int(self.snapped.array.view(np.uint64)[0])

    def epoch(self, timeout: float = 30.0):
        """One EPOCH task; its completion (`Completion`: op, status, pages,
        bytes, lsn0 = the epoch's first record, lsn1 = its commit).  An arena
        with no room is taken on first (the host's part) and another opened."""
        self.ensure_arena()
        self.last = self.submitter.call(self.Op.EPOCH, args=(self.d_desc.data.ptr,), timeout=timeout)
        return self.last

    def recover_task(self, desc_ptr: int, timeout: float = 60.0):
        """One RECOVER task (`restore.ring`: a recovery's pages from the log
        mapping into device arrays, checked there) between this kernel's
        epochs; its completion."""
        return self.submitter.call(self.Op.RECOVER, args=(int(desc_ptr),), timeout=timeout)

    # -- as an engine of the resident executor's arena route (checkpoint/arena_route.py) --
    via = "device-epoch"
    where = "caller"

    def take(self) -> int | None:
        """One EPOCH task; the record bytes it wrote, or None when the arena
        lost the epoch (status LOST: its records did not fit what was left;
        arena.py).  ExecutorError: it failed."""
        c = self.epoch()
        if c.status == self.Status.LOST:
            return None
        if c.status != 0:
            raise ExecutorError(f"the device's EPOCH task failed with status {c.status.name}", where="device epoch")
        return int(c.bytes)

    def counts(self) -> np.ndarray:
        """Each table row's pages in the last epoch (the pass's mailbox)."""
        return self.tpass.last_counts

    def ensure_arena(self) -> None:
        """An open arena with room for the next epoch: one with no room is
        taken on first (the host's part) and another opened.  Raises what
        reserving it raises (LogFullError: no free segment; ValueError: the
        rest of a segment cannot hold one epoch)."""
        ar = self.session.runner.arena
        if ar is not None and ar.lost:  # taken on: every region's next checkpoint is whole, on the session's path
            self.session.settle()
            raise ExecutorError(f"epoch {ar.lost} did not fit what its arena had left; the regions' next "
                                "checkpoint is whole", where="device epochs", hint="make DeviceEpochs again after it")
        if ar is None or ar is not self.arena or not ar.room:
            self.session.settle()
            self._open()

    # -- the device trigger ------------------------------------------------------
    def trigger(self, every: int, counter, gate, skip: int = 0):
        """Arm the trigger (executor.cu: trigger_poll): an epoch every `every`
        counts of `counter` (a CuPy uint64 word the producer's `step_gate`
        raises on its stream) at the point `gate` (GATE_WORDS CuPy uint32) holds
        the producer at; no host thread takes part.  A step held at a count up
        to `skip` is let go with no epoch (the caller took it).  Stopped by
        `close()`."""
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or not 0 < every < 1 << 32:
            raise ExecutorError(f"a trigger's every must be a whole number in [1, 2**32), not {every!r}",
                                where="device trigger")
        if gate.size < GATE_WORDS or gate.dtype != np.uint32:
            raise ExecutorError(f"a trigger's gate is {GATE_WORDS} uint32 words, not {gate.size} of {gate.dtype}",
                                where="device trigger")
        if gate.data.ptr % 8 or not gate.flags.c_contiguous:  # words 4..5 and 6..7 are u64s
            raise ExecutorError("a trigger's gate must be contiguous and 8-byte aligned", where="device trigger")
        # the arrays of a trigger armed before live until the kernel has let go of them (arming again
        # releases the old gate, a device write to it)
        before, self.armed = self.armed, (int(every), counter, gate, int(skip))
        try:
            if self.session.runner.arena is not self.arena:  # the session took it on: armed on a new one
                self._open()
                return None
            return self._arm(*self.armed)
        finally:
            del before

    def _arm(self, every, counter, gate, skip):
        self._log64[1] = 0  # what stopped a trigger before is not this one's
        c = self.submitter.call(self.Op.EPOCH, args=(self.d_desc.data.ptr, every, counter.data.ptr, gate.data.ptr,
                                                     self.queued.ptr, skip), timeout=30.0)
        if c.status != 0:
            raise ExecutorError(f"arming the trigger failed with status {c.status.name}", where="device trigger")
        self.kernel_armed = True
        return c

    def pause(self) -> None:
        """The kernel's trigger let go of the open arena (its gate released),
        to be armed again on the next one (`_open`); nothing when not armed."""
        if not self.kernel_armed:
            return
        self.kernel_armed = False
        c = self.submitter.call(self.Op.EPOCH, args=(0, 1, 0, 0), timeout=30.0)
        if c.status != 0:
            raise ExecutorError(f"disarming the trigger failed with status {c.status.name}", where="device trigger")

    def skip_through(self, count: int) -> None:
        """An armed trigger, when armed again, lets the steps held at counts
        up to `count` go with no epoch (their epochs were the host's own)."""
        if self.armed is not None:
            self.armed = self.armed[:3] + (int(count),)

    def disarm(self) -> None:
        """Stop the trigger (its gate let go): the arena is written no more."""
        self.armed = None
        self.pause()

    @property
    def last_count(self) -> int:
        """The step count of the trigger's last epoch (0: none yet)."""
        n = self.fired_logged
        if n:
            return self._pair(n - 1)[1]
        return int(self.fired_kept[-1][1]) if self.fired_kept else 0

    def rotate(self) -> None:
        """The armed trigger onto a new arena: disarmed (the kernel writes the
        old one no more), the old one taken on by the session, another opened
        and the trigger armed on it.  Steps between pass their gate with no
        epoch: the next epoch holds what they changed."""
        self.pause()
        self._keep_fired()
        ar = self.session.runner.arena
        lost = ar is not None and ar.lost
        self.session.settle()
        if lost:
            self.armed = None
            raise ExecutorError(f"epoch {lost} did not fit what its arena had left; the regions' next checkpoint "
                                "is whole", where="device trigger", hint="arm the trigger again after it")
        self._open()

    #: how long a step holds at its gate for an epoch not taken before it goes on with none
    GATE_TIMEOUT_NS = np.uint64(10 * 10**9)

    def step_gate(self, counter, gate) -> None:
        """The producer's part, after each step, on its current stream: the
        step counted in stream order; held there while the trigger's epoch runs."""
        self.module.functions["cx_step_gate"]((1,), (1,), (counter, gate, self.GATE_TIMEOUT_NS))

    def mark_queued(self, steps: int) -> None:
        """The producer has queued `steps` step gates in all (the counter's
        value once its stream has run them): the kernel stays while some have
        not run, however long its stream takes to reach them.  Fenced before
        the caller reads the trigger's log (the handshake of executor.cu's
        trigger_stays: the kernel sees the step coming, or the host sees it
        leaving)."""
        self._queued64[0] = steps
        with _FENCE:
            pass

    def fired(self) -> list:
        """The trigger's epochs so far: [(epoch, count)] in order."""
        if self.closed_status is not None:
            return list(self.fired_kept)
        return self.fired_kept + self._logged()

    def _logged(self) -> list:
        """The (epoch, count) pairs in the trigger's log now."""
        log = self._log64
        return [tuple(p) for p in log[2:2 + 2 * int(log[0])].reshape(-1, 2).tolist()]

    def _pair(self, i: int) -> tuple[int, int]:
        """The i-th (epoch, count) pair of the trigger's log (words 2 + 2i, 3 + 2i)."""
        return int(self._log64[2 + 2 * i]), int(self._log64[3 + 2 * i])

    def _keep_fired(self) -> None:
        """With the trigger paused: its log's epochs kept here, the log emptied
        (it holds FIRED_CAP of them)."""
        self.fired_kept += self._logged()
        self._log64[0] = 0

    def phases(self) -> dict:
        """The last epoch's phases in µs ({phase: µs since the stamp before},
        over STAMPS[1:]), when made with stamps=True."""
        if self.stamps is None:
            raise ExecutorError("phases need DeviceEpochs(..., stamps=True)", where="device epochs")
        t = self.stamps.array.view(np.uint64).astype(np.int64)
        return {name: round((int(t[i + 1]) - int(t[i])) / 1e3, 2) for i, name in enumerate(STAMPS[1:])}

    @property
    def fired_logged(self) -> int:
        """The (epoch, count) pairs in the trigger's log now (it holds FIRED_CAP)."""
        return 0 if self.closed_status is not None else int(self._log64[0])

    @property
    def trigger_status(self) -> int:
        """The status that stopped the trigger (0: none)."""
        if self.closed_status is not None:
            return self.closed_status
        return int(self._log64[1])

    #: how long `close` waits for the kernel (and an epoch's child grid) to finish
    JOIN_S = 10.0

    @property
    def faulted(self) -> bool:
        """Whether the kernel stopped on a fault: its ring says so, or its
        trigger's status is one (`step_trigger.is_fault`)."""
        return self.gring.ring.state == self.ConsumerState.FAULT or is_fault(self.trigger_status)

    def close(self) -> None:
        try:
            if self.gring.ring.state != self.ConsumerState.FAULT:  # a faulted kernel left: its ring takes no STOP
                self.submitter.stop(self.JOIN_S)
        finally:
            gone = self.executor.join(self.JOIN_S)
            self.kernel_armed = False  # the kernel left: its trigger let go of the gate
            if self.session.runner.arena_pause == self.pause:
                self.session.runner.arena_pause = None
            self._keep_fired()  # what the trigger's log held stays readable (`fired`)
            self._snapped_kept = self.snapshot_epochs  # the count outlives its mapped word
            if not gone:
                self._abandon()
            self.snap, self.descs, self.d_desc = None, [], None  # the kernel left: its device buffers go
            self.closed_status = self.trigger_status
            self.session.settle()
            self._release()

    def _abandon(self) -> None:
        """The kernel, or an epoch's child grid after a timeout, still runs and
        may still write into the arena: nothing of it is taken on and no byte
        of the log after it is written again (the writer stops, as after a
        crash: reopening the log keeps every commit whole on the media); the
        mapped buffers it uses stay registered."""
        exc = ExecutorError(f"the persistent kernel did not finish within {self.JOIN_S:.0f} s of being stopped: "
                            "the log writer stops (reopen the log: every epoch committed before is kept)",
                            where="device epochs")
        self.session.log.appender.stop_after("device epoch", exc)
        runner = self.session.runner
        if runner.arena is self.arena:  # not taken on: that would pad over bytes the kernel may still write
            runner.arena = None
        runner.lose()
        status = self.trigger_status
        self.closed_status = status if is_fault(status) else int(self.Status.TIMEOUT)
        _ABANDONED.append(self)  # its mapped buffers and descriptors stay registered and alive for the kernel
        raise exc

    def _release(self) -> None:
        self.gring.close()
        self.words.close()
        self.log.close()
        self.queued.close()
        self.snapped.close()
        if self.stamps is not None:
            self.stamps.close()
