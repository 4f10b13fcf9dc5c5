"""A recovery read ahead: a fresh process opens its log and restores the
latest epoch into memory of its own while it builds its model, so that the
recovery it asks for once the model is there only copies.

    p = concordia.prefetch("shm:agent-7", device="cupy")  # concordia/prefetching.py: a thread opens and reads
    model = load_model(); cache = StaticCache(...)         # meanwhile
    s = p.session()                                       # the open Session (waits for the open only)
    guard = protect(s, cache, model)                      # waits for the read to end
    state = restore(s, guard)                             # device-to-device copies into the tensors

What it reads.  Every region of the log at `target` ("latest": the last
epoch the log's open decided), through `restore.run.restore` as any
recovery does: the same plan, the same page and digest checks, the same
decision (FORMAT.md §11).  Its arrays are its own: on the device pipeline
with device="cupy" (memory from the driver, given back once used), else the
host applier's.  So it holds a second copy of the state until it is used.

When it is used.  The session's first call after `session()` waits for the
read to end: nothing reads or writes the log beside it.  A `recover` of the
same epoch (target "latest" or that epoch's number, no mode), while the log's
last committed epoch is still the one it read, takes its arrays: targets on
the side it read to (device or host) get a copy each (on the device, one
launch for many: `restore.run.into_targets`), in their streams' order, only
once every region asked for is known to have state there
(`absent` decides as a recovery from the log does); new arrays asked for are
its own, handed over.  Anything else (another epoch, a log committed to
since, targets on the other side or another GPU, a read that failed) is a
recovery from the log, as without it, and `RecoveryStats.phases
["read_ahead"]` says it was not used and why.  A read that failed is no
error of its own: the recovery from the log meets what it met and decides
it as the log does.  Its arrays are dropped once a recovery took them or
passed them over, and when the session closes.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from concordia.restore import run as restore_run


#: a read ahead makes the page fingerprints of regions of at most this many bytes
#: (an adapter's, a token buffer's): they take 8 bytes of memory a page (1/32 of a
#: KV region of 256-byte pages), and only some detectors start from them
SEED_FPS_BYTES = 64 << 20


class Seeds:
    """What a region's detector starts from after a recovery (`Session.recover`
    into the registered arrays: the page CRC table the next checkpoint's delta
    continues from, and the page fingerprints of a fingerprinting detector),
    made from a read ahead's arrays on its thread while the caller builds:
    once `take` copied an array into its target, they are the target's, and
    the caller's recovery does not hash 173 regions again (a launch each, or
    two).  Each is for the log's page size, on the side the read went to.
    `Seeds()`: none (every region's tables are made by the caller)."""

    def __init__(self, on_gpu: bool = False, held: dict | None = None):
        self.on_gpu = on_gpu
        self.held = {} if held is None else held   # name -> (page bytes, CRC table, fingerprints or None)

    @classmethod
    def of(cls, arrays: dict, infos: dict, on_gpu: bool) -> "Seeds":
        from concordia.gpu_kernels import reference as ref

        todo = []
        for name, a in arrays.items():
            info = infos.get(name)
            flat = a.reshape(-1).view("u1")
            if info is None or (on_gpu and flat.data.ptr % 16):
                continue   # the page kernels read 16 bytes at a time: the caller hashes it, as without a read ahead
            todo.append((name, flat, int(info.page_bytes), flat.size <= SEED_FPS_BYTES))
        if on_gpu:
            return cls(True, _on_device(todo))
        return cls(False, {name: (pb, ref.crc32c_pages(flat, page_bytes=pb),
                                  ref.fingerprint_pages(flat, page_bytes=pb) if small else None)
                           for name, flat, pb, small in todo})

    def only(self, names) -> "Seeds":
        """Those of the regions `names` (the ones a recovery copied)."""
        return Seeds(self.on_gpu, {n: self.held[n] for n in names if n in self.held})

    def _of(self, r) -> tuple:
        """(page bytes, CRC table, fingerprints) of region `r`, or Nones where its detector may not start
        from them: another page size than the log's, the other side, or device memory the page kernels
        cannot read (not 16-byte aligned), as `staging.page_crcs` asks."""
        got = self.held.get(r.name)
        if got is None or got[0] != r.page_bytes or r.on_gpu != self.on_gpu or (r.on_gpu and not r.device_aligned):
            return None, None, None
        return got

    def crcs(self, r, otherwise):
        """Region `r`'s page CRC table, or `otherwise(r)` (the caller makes it, `staging.page_crcs`)."""
        got = self._of(r)[1]
        return otherwise(r) if got is None else got

    def fps(self, r):
        """Region `r`'s page fingerprints, or None (its detector makes them if it needs them)."""
        return self._of(r)[2]


def _on_device(todo: list) -> dict:
    """{name: (page bytes, CRC table, fingerprints or None)} of `todo` ([(name,
    flat device bytes, page bytes, with fingerprints)]), hashed on the read
    ahead's stream.  Their arrays come from the default stream's arena of
    CuPy's pool, as the tables the caller makes do (the read's stream ends
    with the read; a block freed back into the arena of a stream that is gone
    stays there, for a later stream given the same handle).  That arena's
    blocks are handed out in the default stream's order, so the read's stream
    first waits for what the default stream has queued (work that may still
    use a block just freed there), then hashes."""
    from concordia.gpu_kernels import gpu, reference as ref
    from concordia.gpu_kernels.jit import require_cupy

    cp = require_cupy()
    made = []
    with cp.cuda.Stream.null:   # the arena only: the kernels run on the read's stream
        for name, flat, pb, small in todo:
            n = ref.num_pages(int(flat.size), pb)
            made.append((name, flat, pb, cp.empty(n, cp.uint32), cp.empty(n, cp.uint64) if small else None))
        queued = cp.cuda.Event(disable_timing=True)
        queued.record()
    cp.cuda.get_current_stream().wait_event(queued)
    return {name: (pb, gpu.crc32c_pages(flat, page_bytes=pb, out=crc),
                   None if fp is None else gpu.fingerprint_pages(flat, page_bytes=pb, out=fp))
            for name, flat, pb, crc, fp in made}


def _copy_ready() -> None:
    """Load the batched copy's kernel here, on the read's thread: `take` copies with it, and a fresh
    process's first launch of a kernel loads its module (a millisecond or more of the caller's clock)."""
    from concordia.gpu_kernels import gpu

    with contextlib.suppress(Exception):   # where it cannot load, the caller's copy meets the same, and says so
        gpu.copy_spans_ready()


class ReadAhead:
    """One read of a log's epoch into arrays of its own, on the thread that
    calls `run`; `take` hands it to one recovery."""

    def __init__(self, device: bool, target="latest", gpu: int | None = None):
        self.device, self.target, self.gpu = bool(device), target, gpu
        self.got = None        # restore_run.Restored, until taken or dropped
        self.error: str | None = None
        self.epoch_seen: int | None = None  # the log's last committed epoch when it read
        self.done = threading.Event()
        #: where its own time went, in seconds ("open_s" when `prefetch` opened the session)
        self.times: dict = {}
        self.read_phases: dict | None = None  # the read's restore, phase by phase (`restore.run.phases_of`)
        self.why_not: str | None = None     # why the last recovery did not use it
        self.dropped: str | None = None     # why its arrays were let go unused
        self.used = False
        self.device_id: int | None = None
        self.seeds = Seeds()   # of its arrays, until taken or dropped
        self.pool_added = 0    # the free bytes the read left in CuPy's pool (`restore_run.into_targets`)
        self.taken = Seeds()   # of the arrays the last recovery copied (`take_seeds`)

    def run(self, log, registration=None) -> None:
        """The read (on the calling thread).  On the device it runs on a
        non-blocking stream of its own, on GPU `gpu` (CUDA's current one of
        this thread when None: the first visible), so that it does not wait
        for the caller's work on the legacy default stream (a model's build)."""
        t = time.perf_counter()
        try:
            self.epoch_seen = int(log.last_committed_epoch or 0)
            with contextlib.ExitStack() as on:
                if self.device:
                    from concordia.gpu_kernels.jit import require_cupy

                    cp = require_cupy()
                    if self.gpu is not None:
                        on.enter_context(cp.cuda.Device(self.gpu))
                    self.device_id = cp.cuda.Device().id
                    stream = on.enter_context(cp.cuda.Stream(non_blocking=True))
                pool_before = restore_run.pool_free_bytes() if self.device else 0
                t_restore = time.perf_counter()
                self.got = restore_run.restore(log, self.target, device=self.device, registration=registration,
                                               absent="keep", own_new=True)
                restore_s = time.perf_counter() - t_restore
                t_seeds = time.perf_counter()
                try:
                    self.seeds = Seeds.of(self.got.arrays, log.regions, self.device)
                except Exception:  # the caller's recovery hashes what has none, as without a read ahead
                    self.seeds = Seeds()
                if self.device and len(self.got.arrays) >= restore_run.BATCHED_COPIES:
                    t_kernel = time.perf_counter()
                    _copy_ready()
                    self.times["copy_kernel_s"] = time.perf_counter() - t_kernel
                    t_seeds += self.times["copy_kernel_s"]
                if self.device:
                    stream.synchronize()  # its arrays (and seeds) are whole before any other thread reads them
                    # the free blocks the read left in CuPy's pool (its temporaries), not the caller's meanwhile
                    self.pool_added = max(0, restore_run.pool_free_bytes() - pool_before)
                self.times["seeds_s"] = time.perf_counter() - t_seeds
        except BaseException as exc:  # the recovery from the log meets it again and decides (module doc)
            self.got, self.seeds = None, Seeds()
            self.error = f"{type(exc).__name__}: {_line(exc)}"
        else:
            try:  # the read's own phases (plan, alloc, transfer, ...), as a recovery from the log reports them
                self.read_phases = restore_run.phases_of(self.got, restore_s)
            except Exception:  # a report, never the reason a read that succeeded goes unused
                self.read_phases = None
        finally:
            self.times["read_s"] = time.perf_counter() - t
            try:
                self._follow(log)
            finally:
                self.done.set()

    def _follow(self, log) -> None:
        """Walk a read-only log past its last commit here (`Log.moved_on`), so that the recovery's own
        refresh reads on from where this walk stopped; its answer is the refresh's to act on."""
        if log.writable:
            return
        t = time.perf_counter()
        with contextlib.suppress(Exception):
            log.moved_on()
            self.times["follow_s"] = time.perf_counter() - t

    def fail(self, why: str) -> None:
        self.error = why
        self.done.set()

    def wait(self) -> None:
        """Wait for the read to end (the seconds the caller waited add up in "waited_s")."""
        if self.done.is_set():
            return
        t = time.perf_counter()
        self.done.wait()
        self.times["waited_s"] = self.times.get("waited_s", 0.0) + time.perf_counter() - t

    def close(self) -> None:
        self.drop("the session closed")

    def drop(self, why: str) -> None:
        """Let its arrays go (a second copy of the state) once no recovery
        can use them; a later recovery is told `why`."""
        self.wait()
        if self.got is not None:
            self.got, self.dropped = None, why
        self.seeds = self.taken = Seeds()

    def _why_not(self, log, target, mode, want, views: dict, gpu: bool) -> str | None:
        if self.error is not None:
            return f"the read ahead failed ({self.error})"
        if self.got is None:
            return f"its arrays were let go ({self.dropped})" if self.dropped else "its arrays were used already"
        epoch = int(self.got.plan.epoch)
        if mode is not None:
            return f"mode={mode!r} was asked for"
        if int(log.last_committed_epoch or 0) != self.epoch_seen:   # (a region added since came with a commit)
            return (f"the log was committed to since it read (epoch {self.epoch_seen}, "
                    f"now {log.last_committed_epoch})")
        if not (target == self.target and not isinstance(target, bool)) and self._epoch(target) != epoch:
            return f"epoch {target!r} was asked for, it read {epoch}"
        sides = {xp is not np for _, xp in views.values()}
        fresh = any(n not in views for n in (self.got.plan.regions if want is None else want))  # new arrays
        if (views and sides != {self.device}) or (fresh and gpu != self.device):
            return f"it read to the {'device' if self.device else 'host'}, the recovery asks for the other side"
        if self.device and any(v.device.id != self.device_id for v, xp in views.values()):
            return f"it read to cuda:{self.device_id}, a target is on another GPU"
        return None

    def _epoch(self, target) -> int | None:
        """The epoch `target` names as of the read ("latest" and None: the log's last then), None for another kind."""
        if target is None or (isinstance(target, str) and target == "latest"):
            return self.epoch_seen
        if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
            return int(target)
        return None

    def take(self, log, target, mode, want, views: dict, gpu: bool, absent: str, order=None):
        """A recovery's `restore_run.Restored` from the read ahead, or None
        (`why_not` says why) for the recovery to read the log.  Its arrays go
        either way: copied into `views` (after the work `order` names:
        `restore_run.into_targets`) and dropped, or handed over."""
        self.wait()
        self.taken = Seeds()
        why = self.why_not = self._why_not(log, target, mode, want, views, gpu)
        if why is not None:
            self.used = False   # this recovery's: a later one says why it did not use it
            if self.got is not None:  # passed over: the recovery reads the log, and the copy of the state goes
                self.got, self.dropped = None, "a recovery before passed it over"
            self.seeds = Seeds()
            return None
        got, plan = self.got, self.got.plan
        names = list(plan.regions) if want is None else list(want)
        # before any write, and before it is used up: a refusal leaves it for the call that follows
        kept = restore_run.absent_regions(plan, names, absent, where=str(log.backend.where))
        self.got, self.used = None, True
        names = [n for n in names if n not in kept]
        dev, host = restore_run.split_targets(views, names)
        held = {n: got.arrays[n] for n in names if n in got.arrays}
        t = time.perf_counter()
        nbytes = sum(int(held[n].nbytes) for n in (*dev, *host) if n in held)
        # the seeds of what is not copied go before the copies give the pool's free blocks back
        seeds, self.seeds = self.seeds.only(held), Seeds()
        parts: dict = {}
        written = restore_run.into_targets(dev, host, held, self.device, order, parts,
                                           pool_free=max(0, restore_run.pool_free_bytes() - self.pool_added))
        self.taken = seeds.only(written)
        if self.device and written and held:
            # arrays handed over beside targets written: copies in CuPy's pool, so that the read's one
            # block of memory (`restore.device._zeroed_arrays`) goes back with the arrays copied from
            held = {n: a.copy() for n, a in held.items()}
        t_release = time.perf_counter()
        via = {n: got.via[n] for n in (*held, *written) if n in got.via}
        got = None   # the read's arrays go now (their block's free is this phase's)
        if parts:
            parts["release_s"] = time.perf_counter() - t_release
        arrays = {**held, **written}
        stats = {"read_ahead": self.phase(), "copy_s": time.perf_counter() - t, "copy_bytes": nbytes,
                 "copy_parts": parts}
        # planned on its thread (its time is in the read ahead's phase): none of this call's
        return restore_run.Restored(arrays, plan, 0.0, time.perf_counter() - t, via, stats, kept)

    def take_seeds(self) -> Seeds:
        """The seeds of the targets the last `take` wrote, once (then none)."""
        out, self.taken = self.taken, Seeds()
        return out

    def phase(self) -> dict:
        """What `RecoveryStats.phases["read_ahead"]` says of it."""
        out = {"s": float(self.times.get("waited_s", 0.0)), "used": self.used, "why_not": self.why_not,
               "device": self.device, "epoch_seen": self.epoch_seen}
        out.update({k: float(v) for k, v in self.times.items() if k != "waited_s"})
        if self.read_phases is not None:
            out["read"] = self.read_phases
        return out


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
