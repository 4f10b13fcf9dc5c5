"""RECOVER on the device: a recovery's pages applied by a persistent kernel.

Where a Session has a resident executor (`Session(executor="resident")`), a
recovery onto the device is one RECOVER task on the task ring of a
persistent kernel (gpu_kernels/executor.cu built with CX_RECOVER;
`RingRecovery`): the kernel of the session's device epochs where they run,
else an `OwnKernel` the resident executor keeps for the session's later
recoveries:

1. the caller's thread plans from the log's metadata and lays the plan out
   as runs (`runs_of`: pages of one record whose rows and page ids follow
   on, with their log offsets and stored CRCs), and makes the recovery's own
   device arrays (zeroed, every page whole);
2. the kernel's control warp takes the task and launches one warp a page:
   the page crosses the bus once, from the log mapping (registered with
   CUDA by the session's checkpoint path, else the pieces the plan reads
   pinned ahead and kept pinned with the log: `restore.device`) into its
   region's array, and its CRC32C is computed there and held to the stored
   one (`executor.recover`);
3. once the task completed, the host reads the damaged-page flags once,
   checks each region's digest on the device (`restore.device.checked_arrays`)
   and hands the arrays to `restore.run`, which copies them into the targets:
   damage leaves every target as it was, as on the caller's pipeline.

A recovery that cannot take the ring (a log CUDA cannot map, CuPy without a
device, a module that cannot load while another persistent kernel is
resident: `RingRecovery.why_not`) takes the caller's pipeline
(`restore.device.apply_plan_cupy`) and says why in its stats (`ring_why`).

`apply_plan_ring_host` runs the same descriptor through a CPU executor's
RECOVER handler (`executor.cpu.recover_handler`, the kernel's numpy twin)
over host memory: the protocol and the twin, where no GPU exists.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from concordia.executor.recover import RECOVER_DESC, RUN, runs_table
from concordia.executor.ring import Op, Status
from concordia.root_error import ConcordiaError

#: the transfer layout's chunk for a ring recovery: one chunk, the whole plan
ONE_CHUNK = 1 << 62
#: what a recovery's stats say of the way it took (`via`)
VIA = "persistent kernel (RECOVER task) from the log mapping"
#: engines whose kernel faulted, and the device buffers a task of theirs was given: a child grid that
#: outran its timeout may still write them, so they stay allocated and registered for the process's life
_ABANDONED: list = []
#: one engine made at a time for a holder (`engine_for`)
_MAKING = threading.Lock()


def runs_of(tr) -> np.ndarray:
    """The `RUN` rows of a one-chunk transfer layout `tr`
    (`restore.device.transfer_plan` with ONE_CHUNK): each run's log offset
    from the chunk's copies (log offset, bytes, staging offset)."""
    if not tr.pages:
        return np.zeros(0, RUN)
    if tr.chunks != 1:
        raise ValueError(f"a ring recovery's layout is one chunk, not {tr.chunks}")
    copies = tr.copies[0]
    at = copies[:, 2]
    k = np.searchsorted(at, tr.run_stage, side="right") - 1
    off = copies[k, 0] + (tr.run_stage - at[k])
    return runs_table(tr.run_first, off, tr.run_id, tr.run_crc, tr.run_pb, tr.run_region)


def describe(**fields) -> np.ndarray:
    """One `RECOVER_DESC` (a numpy record of one element) of its fields by name
    (addresses and counts: log, log_bytes, runs, n_runs, pages, crc_table,
    n_crcs, regions, n_regions, bad), every one of them given."""
    if set(fields) != set(RECOVER_DESC.names):
        raise TypeError(f"a RECOVER descriptor names {sorted(RECOVER_DESC.names)}, not {sorted(fields)}")
    d = np.zeros(1, RECOVER_DESC)
    for name, v in fields.items():
        d[name] = int(v)
    return d


def _layout(log, plan, regions):
    from concordia.restore.device import transfer_plan

    tr = transfer_plan(log, plan, regions=regions, chunk_bytes=ONE_CHUNK)
    return tr, runs_of(tr)


def _damaged(log, tr, bad: np.ndarray):
    """The CorruptionError naming the first damaged page (`restore.device`'s words for it)."""
    from concordia.restore.device import _bad_page_in_log

    return _bad_page_in_log(log, tr, int(np.flatnonzero(bad)[0]))


def apply_plan_ring_host(log, plan, *, regions=None, submitter=None, timeout: float = 60.0) -> dict:
    """The ring recovery on the host: the same layout and descriptor over host
    memory, run by the RECOVER handler of a CPU executor
    (`executor.cpu.numpy_operators`; `submitter`: a `Submitter` of one, else
    one made for this call and stopped after it).  Returns {name: numpy
    array of the region's layout dtype and shape}; damage is the
    CorruptionError the host applier raises."""
    from concordia.executor.cpu import CpuExecutor, numpy_operators
    from concordia.executor.host import Submitter
    from concordia.executor.ring import Ring
    from concordia.restore.device import checked_arrays
    from concordia.wal.apply import check_present

    check_present(plan, regions)
    tr, runs = _layout(log, plan, regions)
    outs = [np.zeros(rp.region.pages * rp.region.page_bytes, np.uint8) for rp in tr.regions]
    table = np.array([[o.ctypes.data, o.size] for o in outs], np.uint64).reshape(-1, 2)
    crcs = np.ascontiguousarray(tr.crc_table, np.uint32)
    bad = np.zeros(max(tr.pages, 1), np.uint8)
    src = log.backend.array
    desc = describe(log=src.ctypes.data, log_bytes=src.size, runs=runs.ctypes.data, n_runs=runs.size, pages=tr.pages,
                    crc_table=crcs.ctypes.data, n_crcs=crcs.size, regions=table.ctypes.data, n_regions=len(outs),
                    bad=bad.ctypes.data)
    own = submitter is None
    if own:
        ring = Ring.allocate(8)
        submitter = Submitter(ring, CpuExecutor(ring, numpy_operators(), idle_exit_s=1.0))
    try:
        c = submitter.call(Op.RECOVER, args=(desc.ctypes.data,), timeout=timeout)
    finally:
        if own:
            submitter.stop()
    _check_completion(c, tr)
    if c.lsn_first:
        raise _damaged(log, tr, bad[:tr.pages])
    return checked_arrays(tr, outs)


def _check_completion(c, tr) -> None:
    """Refuse a RECOVER completion that is not OK, or counted other pages than the layout's."""
    from concordia.executor.errors import ExecutorError

    if c.status != Status.OK:
        raise ExecutorError(f"the RECOVER task failed with status {Status(c.status).name}", where="recovery ring")
    if c.pages + c.lsn_first != tr.pages:
        raise ExecutorError(f"the RECOVER task counted {c.pages + c.lsn_first} pages of {tr.pages}",
                            where="recovery ring")


class OwnKernel:
    """A persistent kernel of a session's device recoveries' own, for where no
    device epoch engine runs: its module (executor.cu with CX_RECOVER), ring
    and executor, made once and kept (`ResidentExecutor.device_recovery`),
    resident only while a task runs: launched for it, made to leave with
    QUIESCE once it completed, so that no module load elsewhere meets it
    resident.  It takes RECOVER tasks as `DeviceEpochs.recover_task` does."""

    JOIN_S = 10.0

    def __init__(self, *, child_timeout_s: float = 60.0):
        from concordia.executor.host import Submitter
        from concordia.executor.persistent import ExecutorModule, GpuExecutor, GpuRing

        self.module = ExecutorModule(child=True, ops=(Op.RECOVER,), extra_options=("-DCX_RECOVER",)).load()
        self.gring = GpuRing(16, where="recovery ring")
        self.executor = GpuExecutor(self.gring, self.module, child_timeout_s=child_timeout_s, idle_s=1.0,
                                    lifetime_s=600.0, sm_carveout=0)
        # the host gives a task up only after the kernel would have given its child grid up
        self.submitter = Submitter(self.gring.ring, self.executor, stall_deadline_s=child_timeout_s + self.JOIN_S)
        self.closed = False
        #: a task timed out or the kernel faulted or would not leave: it takes no task again
        self.faulted = False
        self._lock = threading.Lock()   # one task at a time: its launch, call and QUIESCE together

    def recover_task(self, desc_ptr: int, timeout: float):
        """One RECOVER task of the descriptor at device address `desc_ptr`; its completion."""
        from concordia.executor.errors import ExecutorError
        from concordia.executor.ring import ConsumerState

        with self._lock:
            if self.closed or self.faulted:
                raise ExecutorError("this recovery kernel is closed or faulted", where="recovery ring")
            if self.gring.ring.state == ConsumerState.QUIESCED:   # it left after the last task
                self.submitter.launch()
            try:
                return self.submitter.call(Op.RECOVER, args=(desc_ptr,), timeout=timeout)
            except ExecutorError:
                self.faulted = True
                raise
            finally:
                if self.gring.ring.state == ConsumerState.FAULT:
                    self.faulted = True
                elif not self.faulted:
                    try:
                        self.submitter.quiesce(self.JOIN_S)
                    except ExecutorError:   # (the task's own outcome stands; the kernel takes no task again)
                        self.faulted = True

    def close(self) -> None:
        """Let the ring go once the kernel left; a kernel that faulted keeps it
        registered (`_ABANDONED`): a child grid may still run.  Waits for a
        task in flight."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.faulted or not self.executor.join(self.JOIN_S):
                _ABANDONED.append(self)
                return
            self.gring.close()


class RingRecovery:
    """A session's device recoveries as RECOVER tasks of a persistent kernel
    (module doc): `kernel`, the session's device epoch engine
    (`checkpoint.device_epoch.DeviceEpochs`, whose module carries the RECOVER
    handler beside EPOCH, its task run between its epochs), else an
    `OwnKernel` made here (closed by `close()`)."""

    TASK_S = 70.0   # the most a RECOVER task is waited for

    def __init__(self, *, kernel=None):
        from concordia.executor.persistent import require_cupy

        self.cp = require_cupy()
        self.own = kernel is None
        self.kernel = OwnKernel() if kernel is None else kernel
        self.device = self.kernel.gring.scratch.device.id   # the device the kernel runs on

    @property
    def faulted(self) -> bool:
        return bool(self.kernel.faulted)

    def close(self) -> None:
        if self.own:
            self.kernel.close()

    def run(self, desc_ptr: int):
        """One RECOVER task of the descriptor at device address `desc_ptr`; its completion."""
        return self.kernel.recover_task(desc_ptr, self.TASK_S)

    def apply(self, log, plan, *, regions=None, stats: dict | None = None, registration=None,
              own_memory=()) -> dict:
        """`restore.device.apply_plan_cupy` as one RECOVER task: {name: CuPy
        array of the region's layout dtype and shape}, every page checked
        against its CRC32C and every region's digest against its commit
        (CorruptionError naming the page or region otherwise); None, with
        nothing written and `stats["ring_why"]` saying why, where the driver
        would not pin the log's mapping (the caller's pipeline copies it).  `stats`
        receives the phases `restore.run.phases_of` reads (layout_s, alloc_s,
        scatter_s: the task and the allocations, verify_s) and `via`."""
        from concordia.executor.errors import ExecutorError
        from concordia.gpu_kernels import gpu
        from concordia.restore.device import _zeroed_arrays, checked_arrays
        from concordia.wal.apply import check_present

        cp = self.cp
        if cp.cuda.Device().id != self.device:
            raise ExecutorError(f"the recovery ring is on cuda:{self.device}, the recovery on "
                                f"cuda:{cp.cuda.Device().id}", where="recovery ring")
        check_present(plan, regions)
        st = stats if stats is not None else {}
        st.update(register_s=0.0, scatter_s=0.0, verify_s=0.0, via=VIA)
        t0 = time.perf_counter()
        tr, runs = _layout(log, plan, regions)
        st["layout_s"] = time.perf_counter() - t0
        st.update(chunks=tr.chunks, pages=tr.pages, bytes_copied=tr.pages and int(runs_bytes(runs, tr.pages)))
        base = self._source(log, registration, tr, st)
        if base is None:   # (st["ring_why"] says why)
            return None
        t1 = time.perf_counter()
        out = _zeroed_arrays(cp, gpu, [rp.region.pages * rp.region.page_bytes for rp in tr.regions],
                             [rp.name in own_memory for rp in tr.regions])
        if tr.pages:
            table = np.array([[a.data.ptr, a.nbytes] for a in out], np.uint64).reshape(-1, 2)
            d_runs, d_crcs, d_table = cp.asarray(runs.view(np.uint8)), cp.asarray(tr.crc_table), cp.asarray(table)
            d_bad = cp.zeros(tr.pages, cp.uint8)
            desc = describe(log=base, log_bytes=log.backend.size, runs=d_runs.data.ptr, n_runs=runs.size,
                            pages=tr.pages, crc_table=d_crcs.data.ptr, n_crcs=d_crcs.size, regions=d_table.data.ptr,
                            n_regions=len(out), bad=d_bad.data.ptr)
            d_desc = cp.asarray(desc.view(np.uint8))
            cp.cuda.get_current_stream().synchronize()   # the arrays and tables exist before the kernel uses them
            st["alloc_s"] = time.perf_counter() - t1
            c = None
            try:
                c = self.run(d_desc.data.ptr)
                _check_completion(c, tr)
            except BaseException:
                # no completion (the host gave up, or an interrupt), a child grid that timed out, or a
                # faulted kernel: a child may still read the descriptor and write the arrays, so none of
                # them goes back to the pool
                if c is None or c.status == Status.TIMEOUT or self.faulted:
                    _ABANDONED.append((out, d_runs, d_crcs, d_table, d_bad, d_desc))
                raise
            if c.lsn_first:
                raise _damaged(log, tr, d_bad.get())
        else:
            cp.cuda.get_current_stream().synchronize()
            st["alloc_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        st["scatter_s"] = t2 - t1
        result = checked_arrays(tr, out)
        st["verify_s"] = time.perf_counter() - t2
        return result

    def _source(self, log, registration, tr, st) -> int | None:
        """The device address of the log mapping's byte 0, every piece the
        plan reads registered with CUDA: the session's registration, a
        pinned tier's own, or the pieces pinned ahead (kept with the log);
        None where the driver would not pin them (`st["ring_why"]`)."""
        if registration is not None:
            return int(registration.device_ptr)
        backend = log.backend
        if backend.kind == "pinned" or not tr.pages:
            return int(backend.address)
        from concordia.restore.device import _PinRefused, _RegisterAhead, pieces_read, register_piece

        piece = register_piece(backend)
        t = time.perf_counter()
        ahead = _RegisterAhead(self.cp, backend, pieces_read(tr, piece), piece)
        try:
            ahead.ready(0)
        except _PinRefused as exc:
            from concordia.restore.device import _PIN_REFUSED

            _PIN_REFUSED.add(backend)   # the pipeline copies it, without trying to pin it again
            st["ring_why"] = f"the log mapping could not be pinned: {exc}"
            return None
        finally:
            st["register_wait_s"], st["pin_stop_s"] = ahead.wait_s, ahead.close()
            st["pins_kept"] = ahead.kept
        st["register_s"] = time.perf_counter() - t
        return int(backend.address)


def runs_bytes(runs: np.ndarray, pages: int) -> int:
    """Bytes the runs read from the log."""
    from concordia.executor.recover import counts

    return int((counts(runs, pages) * runs["page_bytes"].astype(np.int64)).sum())


def why_not(log) -> str | None:
    """Why a device recovery of `log` cannot take the ring, or None."""
    if not log.backend.gpu_mappable:
        return f"a {log.backend.kind} log cannot be mapped for the GPU"
    return None


def attempt(ring, log, plan, st: dict, **apply) -> dict | None:
    """`RingRecovery.apply` of the engine `ring()` gives (`restore.run.ring_of`),
    its figures into `st`; None, with `st["ring_why"]` saying why, where there
    is no engine or its task failed (the caller's pipeline takes the
    recovery then, its figures alone in `st`).  Damage is raised as ever."""
    from concordia.executor.errors import ExecutorError

    engine, why = ring()
    if engine is None:
        st["ring_why"] = why
        return None
    own = {}
    try:
        got = engine.apply(log, plan, stats=own, **apply)
    except ExecutorError as exc:
        got, own = None, {"ring_why": f"the RECOVER task failed: {exc}"}
    if got is None:
        st["ring_why"] = own.get("ring_why", "")
        return None
    st.update(own)
    return got


def engine_for(holder, log) -> tuple:
    """(a RingRecovery for a device recovery of the session whose resident
    executor is `holder`, or None, why not): on the kernel of the session's
    device epochs where it runs (`holder.epoch_kernel()`), else on an
    `OwnKernel` made at the first recovery and kept by `holder` (made again
    after one that faulted).  A kernel on another device than the recovery's
    refuses the task (`RingRecovery.apply`), and the pipeline takes it."""
    why = why_not(log)
    if why is not None:
        return None, why
    try:
        kernel = holder.epoch_kernel()
        if kernel is None:
            with _MAKING:
                kernel = holder.device_recovery
                if kernel is None or kernel.closed or kernel.faulted:
                    if kernel is not None:
                        kernel.close()
                    kernel = holder.device_recovery = OwnKernel()
        return RingRecovery(kernel=kernel), None
    except ConcordiaError as exc:   # no CuPy or device, a module refused while another kernel is resident
        return None, f"{type(exc).__name__}: {exc}"
