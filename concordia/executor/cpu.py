"""The CPU executor: a thread that consumes the task ring exactly as the
persistent kernel does, dispatching through an operator table.

It runs everywhere (CI has no GPU), so the protocol — wrap-around,
back-pressure, idle exit and lazy relaunch, QUIESCE / STOP, hot swap — is
tested on it.  Handlers are Python callables ``handler(task: TaskView) -> Result``;
`numpy_operators()` gives real CHECKPOINT / APPEND_LOG / SCATTER / RECOVER handlers over
host memory addressed the way the GPU handlers are (raw addresses in the args).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

import numpy as np

from .errors import ExecutorError
from .recover import RECOVER_DESC, RUN, apply_runs, out_of_bounds
from .ring import CONTROL_OPS, ConsumerState, Op, Result, Ring, Status, TaskView

_FENCE = threading.Lock()      # acquire = a locked instruction = a full fence on x86
_IDS = itertools.count(1)


class OperatorTable:
    """op code -> handler.  PING, QUIESCE and STOP are built into every
    consumer; the table holds the rest."""

    def __init__(self, handlers=None):
        self._handlers: dict[int, object] = {}
        for op, fn in (handlers or {}).items():
            self.register(op, fn)

    def register(self, op: int, fn) -> None:
        op = int(op)
        if op in (Op.PING, Op.QUIESCE, Op.STOP):
            raise ExecutorError(f"{Op(op).name} is built in and cannot be replaced", where="operator table")
        if not callable(fn):
            raise ExecutorError(f"handler for op {op} is not callable", where="operator table")
        self._handlers[op] = fn

    def get(self, op: int):
        return self._handlers.get(op)

    def ops(self) -> list[int]:
        return sorted(self._handlers)


class CpuExecutor:
    """One consumer of a ring, run on threads (one at a time).

    idle_exit_s: leave after this long without a task (the host relaunches on
    the next submit); None stays until QUIESCE / STOP.  max_batch bounds how
    many published tasks are taken per look at the ring."""

    kind = "cpu"
    host_busy_spins = 0   # the host waiter yields the GIL at once

    def __init__(self, ring: Ring, table: OperatorTable | None = None, *, executor_id: int | None = None,
                 idle_exit_s: float | None = None, max_batch: int = 1024):
        self.ring = ring
        self.table = table or OperatorTable()
        self.executor_id = next(_IDS) if executor_id is None else executor_id
        self.idle_exit_s = idle_exit_s
        self.max_batch = max(1, min(max_batch, ring.capacity))
        self._thread: threading.Thread | None = None
        self._abort = threading.Event()
        self.errors: list[str] = []    # handler exceptions, one line each
        self.instances = 0
        #: called on the consumer's thread whenever it finds no task (a device-side
        #: trigger: `resident.ResidentExecutor.poll`); returns True when it did work
        self.on_idle = None
        #: a threading.Event the host sets after publishing (None: sleep between polls);
        #: idle_wait_max_s bounds one wait between two polls of an idle ring
        self.wake = None
        self.idle_wait_max_s = 1e-3
        #: polls of an idle ring before the consumer starts yielding the GIL
        #: (0: at once, so that a host thread waiting for the GIL gets it)
        self.idle_spins = 64

    # -- consumer interface (see host.py) ---------------------------------------

    def prepare(self) -> None:
        """Nothing to load on the CPU."""

    def launch(self, instance: int, resume: bool = False) -> None:
        prev = self._thread
        t = threading.Thread(target=self._run, args=(prev, instance, resume),
                             name=f"cpu-executor-{self.executor_id}.{instance}", daemon=True)
        self._thread = t
        self.instances += 1
        t.start()

    def is_resident(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.is_resident()

    def abort(self, timeout: float = 5.0) -> bool:
        """Make the running instance leave at the next slot boundary (state
        FAULT): for tearing down a consumer whose host gave up on it."""
        self._abort.set()
        return self.join(timeout)

    # -- the loop --------------------------------------------------------------

    def _run(self, prev: threading.Thread | None, instance: int, resume: bool) -> None:
        if prev is not None:
            prev.join()   # instances never overlap (as kernels on one stream)
        ring = self.ring
        if not resume and ring.state in _FINAL:
            return        # a lazy launch queued behind a QUIESCE / STOP: not ours to run
        n = ring.consumer_begin(self.executor_id, instance)
        idle_since = time.monotonic()
        spins = 0
        while True:
            if self._abort.is_set():
                ring.set_state(ConsumerState.FAULT)
                return
            k = ring.available(n, self.max_batch)
            if k == 0:
                hook = self.on_idle
                if hook is not None and hook():  # a trigger of the consumer's own ran an epoch
                    idle_since = time.monotonic()
                    spins = 0
                    continue
                spins += 1
                if spins > self.idle_spins:
                    delay = 0 if spins < 512 else min(self.idle_wait_max_s, 1e-6 * (spins - 511))
                    wake = self.wake
                    if wake is not None and delay:
                        if wake.wait(delay):   # a host that publishes sets it: no wait for the sleep to end
                            wake.clear()
                    else:
                        time.sleep(delay)
                if self.idle_exit_s is not None and time.monotonic() - idle_since > self.idle_exit_s:
                    ring.set_state(ConsumerState.IDLE_EXIT)
                    with _FENCE:
                        pass
                    if ring.available(n, 1) == 0:
                        return
                    ring.set_state(ConsumerState.RUNNING)
                continue
            spins = 0
            n, exit_state = self._run_batch(n, k)
            idle_since = time.monotonic()
            if exit_state is not None:
                ring.set_state(exit_state)
                return

    def _run_batch(self, n: int, k: int):
        ring = self.ring
        idx, ops, regions, tags, args = ring.take(n, k)
        ctrl = np.flatnonzero((ops == Op.QUIESCE) | (ops == Op.STOP))
        if ctrl.size:               # stop at the first control task, inclusive
            k = int(ctrl[0]) + 1
            idx, ops, regions, tags, args = idx[:k], ops[:k], regions[:k], tags[:k], args[:k]
        plain = ops[:-1] if ctrl.size else ops
        if np.all(plain == Op.PING):
            z = np.zeros(k, dtype=np.uint64)
            ring.complete(n, idx, self.executor_id, ops, regions, tags, 0, z, z, z, z)
        else:
            # One completion per task so a slow handler does not hold back the ones before it.
            oplist, reglist, taglist = ops.tolist(), regions.tolist(), tags.tolist()
            for j in range(k):
                op = oplist[j]
                if op in CONTROL_OPS or op == Op.PING:
                    r = _OK
                else:
                    r = self._dispatch(TaskView(n + j + 1, op, 0, reglist[j], taglist[j], tuple(args[j].tolist())))
                ring.complete_one(n + j, self.executor_id, op, reglist[j], taglist[j], r)
        exit_state = None
        if ctrl.size:
            exit_state = ConsumerState.QUIESCED if ops[-1] == Op.QUIESCE else ConsumerState.STOPPED
        return n + k, exit_state

    def _dispatch(self, task: TaskView) -> Result:
        fn = self.table.get(task.op)
        if fn is None:
            return Result(Status.UNSUPPORTED_OP)
        try:
            r = fn(task)
        except Exception as exc:  # a handler failure is a completion status, not a dead consumer
            self.errors.append(f"task {task.seq} op {task.op}: {type(exc).__name__}: {exc}")
            return Result(Status.HANDLER_ERROR)
        return r if isinstance(r, Result) else Result(Status.HANDLER_ERROR)


_OK = Result()
_FINAL = (ConsumerState.QUIESCED, ConsumerState.STOPPED, ConsumerState.FAULT)


# -- numpy handlers over raw host addresses (the CPU twin of executor.cu) -------------

def host_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of host memory at `addr`."""
    if addr == 0 or nbytes < 0:
        raise ExecutorError(f"bad buffer address 0x{addr:x} / {nbytes} bytes", where="cpu handler")
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def checkpoint_handler(task: TaskView) -> Result:
    """CHECKPOINT: pages of src that differ from shadow are copied to out (in
    page order here; the GPU may use any order) with their ids, and into shadow."""
    src, shadow, out, out_ids, nbytes, page_bytes, lsn = task.args[:7]
    if page_bytes == 0 or nbytes == 0:
        return Result(Status.BAD_ARGS)
    npages = -(-nbytes // page_bytes)
    pad = npages * page_bytes - nbytes
    s = host_view(src, nbytes)
    sh = host_view(shadow, nbytes)
    if pad:
        s = np.concatenate([s, np.zeros(pad, np.uint8)])
        shp = np.concatenate([sh, np.zeros(pad, np.uint8)])
    else:
        shp = sh
    dirty = np.flatnonzero((s.reshape(npages, page_bytes) != shp.reshape(npages, page_bytes)).any(axis=1))
    m = int(dirty.size)
    if m:
        o = host_view(out, m * page_bytes).reshape(m, page_bytes)
        o[:] = s.reshape(npages, page_bytes)[dirty]
        host_view(out_ids, 4 * m).view("<u4")[:] = dirty
        sh[:] = s[:nbytes]
    written = m * page_bytes
    return Result(Status.OK, m, written, lsn, lsn + written)


def append_log_handler(task: TaskView) -> Result:
    """APPEND_LOG: copy nbytes from src to dst."""
    dst, src, nbytes, lsn = task.args[:4]
    host_view(dst, nbytes)[:] = host_view(src, nbytes)
    return Result(Status.OK, 0, nbytes, lsn, lsn + nbytes)


def scatter_handler(task: TaskView) -> Result:
    """SCATTER: scatter `count` pages from src to their ids in dst."""
    dst, src, ids, count, page_bytes, region_bytes, chunk = task.args[:7]
    if page_bytes == 0:
        return Result(Status.BAD_ARGS)
    page_ids = host_view(ids, 4 * count).view("<u4").astype(np.int64)
    if count and int(page_ids.max()) * page_bytes >= region_bytes:
        return Result(Status.BAD_ARGS)
    d = host_view(dst, region_bytes)
    s = host_view(src, count * page_bytes).reshape(count, page_bytes)
    for j, p in enumerate(page_ids.tolist()):
        lo = p * page_bytes
        hi = min(lo + page_bytes, region_bytes)
        d[lo:hi] = s[j, : hi - lo]
    return Result(Status.OK, count, count * page_bytes, chunk, chunk)


def recover_handler(task) -> Result:
    """RECOVER over raw host addresses (the CPU executor's, `cpu.numpy_operators`):
    args[0] is the address of a `RECOVER_DESC`; the completion carries the
    pages applied, the bytes read and (as lsn_first) the pages damaged."""
    addr = int(task.args[0])
    if addr == 0 or addr % 8:
        return Result(Status.BAD_ARGS)
    d = host_view(addr, RECOVER_DESC.itemsize).view(RECOVER_DESC)[0]
    n_runs, pages, n_regions = int(d["n_runs"]), int(d["pages"]), int(d["n_regions"])
    runs = host_view(int(d["runs"]), n_runs * RUN.itemsize).view(RUN) if n_runs else np.zeros(0, RUN)
    table = (host_view(int(d["regions"]), 16 * n_regions).view("<u8").reshape(-1, 2) if n_regions
             else np.zeros((0, 2), np.uint64))
    n_crcs = int(d["n_crcs"])
    if out_of_bounds(runs, pages, int(d["log_bytes"]), table[:, 1].tolist(), int(d["log"]), table[:, 0].tolist(),
                     n_crcs):
        return Result(Status.BAD_ARGS)
    regions = [host_view(int(base), int(nbytes)) for base, nbytes in table.tolist()]
    crc_table = host_view(int(d["crc_table"]), 4 * n_crcs).view("<u4") if n_crcs else np.zeros(0, np.uint32)
    bad = host_view(int(d["bad"]), pages) if pages else np.zeros(0, np.uint8)
    log = host_view(int(d["log"]), int(d["log_bytes"])) if int(d["log_bytes"]) else np.zeros(0, np.uint8)
    applied, read, damaged = apply_runs(log, runs, crc_table, regions, bad)
    return Result(Status.OK, applied, read, damaged, 0)


def numpy_operators() -> OperatorTable:
    """The operator table of the CPU executor's real handlers."""
    return OperatorTable({Op.CHECKPOINT: checkpoint_handler, Op.APPEND_LOG: append_log_handler,
                          Op.SCATTER: scatter_handler, Op.RECOVER: recover_handler})
