"""The host side of the task ring: submitting with back-pressure, waiting with
deadlines, lazy relaunch of an idle consumer, the watchdog, shutdown and hot swap.

A consumer (`cpu.CpuExecutor`, `gpu.GpuExecutor`) is anything with::

    executor_id: int
    launch(instance, resume)
                          start an instance; it runs only after the previous one exited;
                          unless `resume`, an instance that finds the ring QUIESCED,
                          STOPPED or FAULT leaves at once (a lazy launch that lost a race)
    is_resident() -> bool an instance is running or queued
    join(timeout) -> bool wait (bounded) until no instance is resident
    prepare()             load what the consumer needs; called only while none is resident

Every wait here is bounded: a deadline, the watchdog's stall deadline, or both.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from .errors import (ExecutorError, ExecutorStalledError, ExecutorStoppedError,
                     RingFullError)
from .ring import (HEADER_BYTES, NO_REGION, OFF_HEAD, OFF_INSTANCE, OFF_STATE, OFF_STOP_SENT, OFF_TAIL,
                   TASK_BYTES, Completion, ConsumerState, Op, Ring, Status, op_or_int)

# States after which a new instance may be launched on the next submit.
_RELAUNCHABLE = (ConsumerState.NEVER_RAN, ConsumerState.IDLE_EXIT, ConsumerState.LIFETIME_EXIT)
_RELAUNCHABLE_INT = frozenset(int(s) for s in _RELAUNCHABLE)
_PING = int(Op.PING)
_CONTROL = frozenset((int(Op.QUIESCE), int(Op.STOP)))
_BUSY_SPINS = 4000  # polls before a waiter starts yielding the CPU (a GPU consumer needs no GIL)
# CPython hands the GIL to a waiting thread only when the holder blocks, or when
# a switch interval passes with no hand-over at all; a holder that drops and
# retakes the GIL without blocking restarts the waiter's wait each time.  A
# thread that publishes into a ring drained by a GPU never blocks, and starved
# a swap thread for seconds on the H200.  So a publishing thread sleeps for real
# for FAIR_SLEEP_S once every FAIR_EVERY_S (about 2 % of its time).
FAIR_EVERY_S = 0.005
FAIR_SLEEP_S = 1e-4


class Watchdog:
    """Detects a stalled consumer: tasks pending while `tail` has not moved for
    longer than `deadline_s`.  `check()` is pure bookkeeping over the ring (the
    clock is injectable); `start()` runs it on a thread and reports by callback."""

    def __init__(self, ring: Ring, deadline_s: float = 10.0, *, clock=time.monotonic):
        if deadline_s <= 0:
            raise ExecutorError(f"watchdog deadline {deadline_s} s is not positive", where=ring.where)
        self.ring = ring
        self.deadline_s = deadline_s
        self.clock = clock
        self._tail = ring.tail
        self._since = clock()
        self._thread = None
        self._halt = threading.Event()
        self.reported: ExecutorStalledError | None = None

    def touch(self) -> None:
        """Work arrives at an empty ring: the stall clock starts now."""
        self._tail, self._since = self.ring.tail, self.clock()

    def check(self, now: float | None = None) -> ExecutorStalledError | None:
        """The stall, if the consumer is stalled now; else None."""
        now = self.clock() if now is None else now
        tail, head = self.ring.tail, self.ring.head
        if tail != self._tail or head == tail:
            self._tail, self._since = tail, now
            return None
        idle = now - self._since
        if idle <= self.deadline_s:
            return None
        r = self.ring
        i = tail & r.mask
        op = int(r.t_op[i])
        name = Op(op).name if op in Op._value2member_map_ else f"op {op}"
        return ExecutorStalledError(
            f"no task completed for {idle:.3f} s with {head - tail} pending; next is {name}, "
            f"consumer {r.state.name.lower()} (executor {r.executor_id}, instance {r.instance})",
            where=r.slot_where(tail), hint="a handler hangs or the consumer died; stop and relaunch it")

    def start(self, on_stall, interval_s: float | None = None) -> None:
        """Check every `interval_s` on a daemon thread; call `on_stall(err)` once."""
        interval_s = interval_s or self.deadline_s / 4

        def loop():
            while not self._halt.wait(interval_s):
                err = self.check()
                if err is not None:
                    self.reported = err
                    on_stall(err)
                    return

        self._thread = threading.Thread(target=loop, name="executor-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


@dataclass(frozen=True)
class SwapReport:
    """Timings of one hot swap, seconds, as the host saw them."""

    quiesce_s: float      # QUIESCE published -> its completion read back
    handover_s: float     # completion read -> new consumer launched (old one gone, new one prepared)
    gap_s: float          # QUIESCE completion read -> first completion of the new consumer read
    first_seq: int        # seq of the new consumer's first completed task
    old_executor: int
    new_executor: int

    def to_json(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Submitter:
    """Publishes tasks into a ring and reads their completions back.

    Thread-safe: publishing and reaping hold one lock (whose acquire is also the
    store->load fence of the relaunch handshake, ring.py step 5)."""

    def __init__(self, ring: Ring, consumer=None, *, stall_deadline_s: float = 10.0, on_reap=None):
        self.ring = ring
        self.consumer = consumer
        self.watchdog = Watchdog(ring, stall_deadline_s)
        self.on_reap = on_reap          # called with each reaped batch (structured array copy)
        self._lock = threading.RLock()
        self._wanted: dict[int, Completion | None] = {}
        self._instance = ring.instance
        self.completed = 0
        self.failed = 0                 # completions whose status was not OK
        self._control_waiting = 0       # QUIESCE / STOP submits waiting for room (they go first)
        # While a swap or STOP is under way, other tasks wait on _gate (blocked,
        # off the GIL) instead of competing with it for slots, the lock and the GIL.
        self._held = 0                  # swaps / STOPs under way
        self._gate = threading.Condition(threading.Lock())
        self._swap_lock = threading.Lock()
        self.fair_every_s = FAIR_EVERY_S
        self._last_yield = time.monotonic()
        self.launches = 0
        # A CPU consumer needs the GIL the waiter holds while it spins: yield at once.
        self._busy = getattr(consumer, "host_busy_spins", _BUSY_SPINS)

    # -- publishing ------------------------------------------------------------

    def try_submit(self, op: int, *, region: int = NO_REGION, tag: int = 0, args=(), keep: bool = True) -> int | None:
        """Publish one task if there is room now; its seq, or None when full
        (also while a QUIESCE or STOP waits for room or a swap is under way:
        control tasks go first)."""
        if (self._control_waiting or self._held) and op not in _CONTROL:
            return None
        seq = self._publish_now(op, region=region, tag=tag, args=args, keep=keep)
        if seq is not None:
            self._fair_yield()
        return seq

    def _publish_now(self, op: int, *, region: int = NO_REGION, tag: int = 0, args=(), keep: bool = True):
        with self._lock:
            self._check_open(op)
            if self.ring.free_slots() <= 0:
                self._reap_locked()
                if self.ring.free_slots() <= 0:
                    return None
            if self.ring.head == self.ring.tail:
                self.watchdog.touch()
            seq = self.ring.publish(op, region=region, tag=tag, args=args)
            if keep:
                self._wanted[seq] = None
            self._after_publish()
            return seq

    def _fair_yield(self) -> None:
        """Sleep briefly if this submitter has not blocked for `fair_every_s`
        (see FAIR_EVERY_S): lets a waiting thread take the GIL."""
        now = time.monotonic()
        if now - self._last_yield > self.fair_every_s:
            time.sleep(FAIR_SLEEP_S)
            self._last_yield = time.monotonic()

    def _wait_gate(self, deadline) -> None:
        """Block (off the GIL) while a swap or STOP holds other tasks back."""
        with self._gate:
            while self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._gate.wait(0.05 if left is None else min(left, 0.05))
        self._last_yield = time.monotonic()

    def _hold(self, delta: int) -> None:
        with self._gate:
            self._held += delta
            if not self._held:
                self._gate.notify_all()

    def submit(self, op: int, *, region: int = NO_REGION, tag: int = 0, args=(), keep: bool = True,
               timeout: float | None = 10.0) -> int:
        """Publish one task, waiting for room up to `timeout` seconds (None: the
        watchdog alone bounds the wait).  Raises RingFullError after the timeout."""
        seq = self.try_submit(op, region=region, tag=tag, args=args, keep=keep)
        if seq is not None:
            return seq
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        r = self.ring
        control = op in _CONTROL
        if control:
            with self._lock:
                self._control_waiting += 1
        try:
            while True:
                if self._held and not control:
                    self._wait_gate(deadline)
                # Full ring: wait without the lock, so that a producer spinning
                # here cannot keep other threads (a swap, a waiter) from it.
                elif r.head - r.tail < r.capacity or control:
                    seq = self.try_submit(op, region=region, tag=tag, args=args, keep=keep)
                    if seq is not None:
                        return seq
                if deadline is not None and time.monotonic() > deadline:
                    if self._held and not control:
                        raise RingFullError(f"held back for {timeout} s behind a swap or STOP",
                                            where=r.slot_where(r.head))
                    raise RingFullError(f"ring full ({r.capacity} slots, {r.pending()} pending) for {timeout} s",
                                        where=r.slot_where(r.head), hint="the consumer is slower than the producer")
                spins = self._pause(spins)
        finally:
            if control:
                with self._lock:
                    self._control_waiting -= 1

    def submit_batch(self, ops, *, tags=None, timeout: float | None = 10.0) -> tuple[int, int]:
        """Publish many tasks (no arguments) as fast as room allows; their
        completions are counted, not kept.  Returns (first seq, count)."""
        ops = np.asarray(ops, dtype="<u2")
        tags = None if tags is None else np.asarray(tags, dtype="<u8")
        first, done, spins = None, 0, 0
        deadline = None if timeout is None else time.monotonic() + timeout
        r = self.ring
        while done < ops.size:
            if self._held:
                self._wait_gate(deadline)
            # Full, or a QUIESCE / STOP waits for room: wait without the lock.
            elif not self._control_waiting and r.head - r.tail < r.capacity:
                with self._lock:
                    self._check_open(int(ops[done]))
                    self._reap_locked()
                    room = min(r.free_slots(), ops.size - done)
                    if room > 0:
                        if r.head == r.tail:
                            self.watchdog.touch()
                        s, k = r.publish_batch(ops[done:done + room],
                                               tags=None if tags is None else tags[done:done + room])
                        first = s if first is None else first
                        done += k
                        self._after_publish()
                if room > 0:            # sleep, if due, outside the lock
                    self._fair_yield()
                    spins = 0
                    continue
            if deadline is not None and time.monotonic() > deadline:
                raise RingFullError(f"ring full for {timeout} s after {done} of {ops.size} tasks",
                                    where=self.ring.slot_where(self.ring.head))
            spins = self._pause(spins)
        return (first or self.ring.head + 1), int(ops.size)

    def _check_open(self, op: int) -> None:
        r = self.ring
        if r.hdr64[OFF_STOP_SENT // 8]:
            raise ExecutorStoppedError(f"{Op(op).name if op in Op._value2member_map_ else op} "
                                       f"submitted after STOP", where=r.slot_where(r.head))
        if r.hdr32[OFF_STATE // 4] == ConsumerState.FAULT:
            raise ExecutorError("the consumer faulted; no task is taken", where=r.slot_where(r.tail))

    def _after_publish(self) -> None:
        """Relaunch an idle consumer (called with the lock held: the acquire
        fenced the stores that published the task before this load)."""
        c = self.consumer
        if c is None:
            return
        r = self.ring
        if r.hdr32[OFF_STATE // 4] in _RELAUNCHABLE_INT and r.hdr32[OFF_INSTANCE // 4] >= self._instance:
            self._launch_locked()

    def _launch_locked(self, resume: bool = False) -> None:
        self._instance += 1
        self.launches += 1
        self.consumer.launch(self._instance, resume)

    def launch(self) -> None:
        """Start the consumer now (instead of lazily on the first submit), also
        after QUIESCE.  The caller knows no instance of it is running."""
        with self._lock:
            self._instance = max(self._instance, self.ring.instance)
            self._launch_locked(resume=True)

    def ping(self, timeout: float = 1.0) -> float:
        """One PING round trip on the shortest host path; returns its seconds.
        Used to measure latency.  The same protocol steps as `publish` (body,
        then seq, then head; ring.py step 2) and the same relaunch check as
        `_after_publish`, made with plain word stores and loads on memoryviews
        (a fraction of a numpy scalar access); completions are reaped only when
        room runs short or after the clock stopped."""
        r = self.ring
        w64, w32, w16 = self._words()
        mask, cap = r.mask, r.capacity
        head_w, tail_w = OFF_HEAD // 8, OFF_TAIL // 8
        t0 = time.perf_counter()
        with self._lock:
            n = w64[head_w]
            if n - r.reaped >= cap - 1:
                self._reap_locked()
            if n - r.reaped >= cap or w64[OFF_STOP_SENT // 8]:
                raise RingFullError("no room for a PING", where=r.slot_where(n))
            slot = (HEADER_BYTES + (n & mask) * TASK_BYTES) // 8
            w16[(slot + 1) * 4] = _PING                # op
            w64[slot + 2] = n                           # tag
            w64[slot] = n + 1                           # seq: publishes the slot
            w64[head_w] = n + 1
            if self.consumer is not None and w32[OFF_STATE // 4] in _RELAUNCHABLE_INT \
                    and w32[OFF_INSTANCE // 4] >= self._instance:
                self._launch_locked()
        spins, busy = 0, self._busy
        while w64[tail_w] <= n:
            spins += 1
            if spins > busy:
                self._pause(spins)
                if spins & 0xFFF == 0:
                    self._check_progress(t0 + timeout, f"ping {n + 1}")
        dt = time.perf_counter() - t0
        with self._lock:
            self._reap_locked()
        return dt

    def _words(self):
        """u64 / u32 / u16 memoryviews over the whole ring (made once)."""
        w = self.__dict__.get("_word_views")
        if w is None or w[3] is not self.ring:
            mv = memoryview(self.ring.raw)
            w = self._word_views = (mv.cast("Q"), mv.cast("I"), mv.cast("H"), self.ring)
        return w[:3]

    # -- completions -----------------------------------------------------------

    def reap(self) -> int:
        """Read back every completion that is ready; returns how many."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        r = self.ring
        lo, hi = r.reap_range()
        if hi <= lo:
            return 0
        if hi - lo == 1 and self.on_reap is None:
            c = r.read_completion(lo)
            if c.seq in self._wanted:
                self._wanted[c.seq] = c
            self.failed += c.status != Status.OK
        else:
            comps = r.completions(lo, hi)
            if self.on_reap is not None:
                self.on_reap(comps)
            self.failed += int(np.count_nonzero(comps["status"]))
            if self._wanted:
                for seq in range(lo + 1, hi + 1):
                    if seq in self._wanted:
                        self._wanted[seq] = _completion(comps[seq - lo - 1])
        r.reaped = hi
        self.completed += hi - lo
        return hi - lo

    def wait(self, seq: int, timeout: float | None = 10.0) -> Completion:
        """The completion of task `seq` (submitted with keep=True).  Bounded by
        `timeout` (ExecutorError) and by the watchdog (ExecutorStalledError)."""
        if seq not in self._wanted:
            raise ExecutorError(f"task {seq} was not submitted with keep=True or was already waited on",
                                where=self.ring.where)
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while True:
            with self._lock:
                c = self._wanted.get(seq)
                if c is None:
                    self._reap_locked()
                    c = self._wanted.get(seq)
                if c is not None:
                    del self._wanted[seq]
                    return c
            spins = self._pause(spins)
            if spins % 64 == 0:
                self._check_progress(deadline, f"task {seq}")

    def wait_tail(self, seq: int, timeout: float | None = 10.0) -> None:
        """Wait until every task up to `seq` has completed (and reap them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while self.ring.tail < seq:
            spins = self._pause(spins)
            if spins % 64 == 0:
                self._check_progress(deadline, f"tasks up to {seq}")
        self.reap()

    def drain(self, timeout: float | None = 10.0) -> None:
        """Wait until every published task has completed."""
        self.wait_tail(self.ring.head, timeout)

    def call(self, op: int, *, region: int = NO_REGION, tag: int = 0, args=(), timeout: float = 10.0) -> Completion:
        """Submit one task and wait for its completion."""
        return self.wait(self.submit(op, region=region, tag=tag, args=args, timeout=timeout), timeout)

    def _pause(self, spins: int) -> int:
        """Spin, then yield, then sleep: a waiter must neither add latency to a
        fast consumer nor starve a CPU consumer that needs the GIL."""
        if spins >= self._busy:
            k = spins - self._busy
            time.sleep(0 if k < 50 else 5e-5 if k < 250 else 5e-4)
            if k >= 50:
                self._last_yield = time.monotonic()
        return spins + 1

    def _check_progress(self, deadline, what: str) -> None:
        r = self.ring
        st = r.state
        if st == ConsumerState.FAULT:
            raise ExecutorError(f"the consumer faulted while waiting for {what}", where=r.slot_where(r.tail))
        if st == ConsumerState.STOPPED and r.tail < r.head:
            raise ExecutorStoppedError(f"consumer stopped with {r.head - r.tail} task(s) not taken, "
                                       f"waiting for {what}", where=r.slot_where(r.tail))
        # Safety net for the relaunch handshake: pending work, nobody resident.
        if (self.consumer is not None and r.tail < r.head
                and st in _RELAUNCHABLE and not self.consumer.is_resident()):
            with self._lock:
                self._instance = max(self._instance, r.instance)
                self._launch_locked()
        err = self.watchdog.check()
        if err is not None:
            raise err
        if deadline is not None and time.monotonic() > deadline:
            raise ExecutorError(f"timed out waiting for {what} ({r.head - r.tail} pending, consumer "
                                f"{st.name.lower()})", where=r.slot_where(r.tail))

    # -- shutdown and hot swap -------------------------------------------------

    def _control(self, op: Op, timeout: float) -> Completion:
        """Publish a control task (STOP, QUIESCE) ahead of the tasks it holds
        back, and wait for its completion."""
        self._hold(+1)
        try:
            seq = self.submit(op, timeout=timeout)
        finally:
            self._hold(-1)
        return self.wait(seq, timeout)

    def stop(self, timeout: float = 10.0) -> Completion | None:
        """Publish STOP behind everything pending, wait for it and for the
        consumer to exit.  Returns STOP's completion (None if already stopped).
        Other tasks are held back until STOP is published (then refused)."""
        if self.ring.stop_sent:
            return None
        c = self._control(Op.STOP, timeout)
        if self.consumer is not None and not self.consumer.join(timeout):
            raise ExecutorError(f"consumer did not exit within {timeout} s after STOP", where=self.ring.where)
        return c

    def quiesce(self, timeout: float = 10.0) -> Completion | None:
        """Make the consumer stop at a slot boundary and wait until it has left
        (None if it already had); `launch()` resumes it, `swap()` replaces it.
        Other tasks are held back until QUIESCE is published (then they queue)."""
        if self.ring.state == ConsumerState.QUIESCED and not (self.consumer and self.consumer.is_resident()):
            return None
        c = self._control(Op.QUIESCE, timeout)
        if c.status != Status.OK:
            raise ExecutorError(f"QUIESCE failed with status {c.status.name}", where=self.ring.slot_where(c.seq - 1))
        if self.consumer is not None and not self.consumer.join(timeout):
            raise ExecutorError(f"consumer did not leave within {timeout} s after QUIESCE", where=self.ring.where)
        return c

    def swap(self, new_consumer, timeout: float = 10.0) -> SwapReport:
        """Hand the ring from the current consumer to `new_consumer` with no task
        lost or run twice: QUIESCE makes the old one stop at a slot boundary (it
        completes QUIESCE, then exits); the new one resumes at `tail`.  Tasks
        already queued behind QUIESCE wait in the ring; other threads' submits
        are held back (blocked, off the GIL) from the start of the swap until
        the new consumer has completed its first task, so that a saturating
        producer cannot stretch the handover."""
        old = self.consumer
        if old is None:
            raise ExecutorError("no consumer to swap from; launch one first", where=self.ring.where)
        with self._swap_lock:
            self._hold(+1)
            try:
                t0 = time.perf_counter()
                # Lazy relaunches while QUIESCE is pending are still right (someone must
                # take it); once taken, state QUIESCED allows none, and an instance
                # launched lazily before that leaves at once (see launch's `resume`).
                self.quiesce(timeout)
                t1 = time.perf_counter()
                seq = self.ring.tail          # the new consumer's first task is number `seq` (seq + 1)
                new_consumer.prepare()
                with self._lock:
                    self.consumer = new_consumer
                    self._busy = getattr(new_consumer, "host_busy_spins", _BUSY_SPINS)
                    self._instance = max(self._instance, self.ring.instance)
                    self._launch_locked(resume=True)
                t2 = time.perf_counter()
                probe = None
                if self.ring.head == seq:   # nothing queued behind QUIESCE: probe with a PING
                    probe = self._publish_now(Op.PING)   # past the hold; the ring is empty
                self.wait_tail(seq + 1, timeout)
                t3 = time.perf_counter()
            finally:
                self._hold(-1)
        if probe is not None:
            self.wait(probe, timeout)
        return SwapReport(t1 - t0, t2 - t1, t3 - t1, seq + 1, old.executor_id, new_consumer.executor_id)


def _completion(row) -> Completion:
    return Completion(int(row["seq"]), op_or_int(int(row["op"])), Status(int(row["status"])), int(row["executor_id"]),
                      int(row["tag"]), int(row["pages"]), int(row["bytes"]), int(row["lsn_first"]),
                      int(row["lsn_last"]), int(row["region"]))
