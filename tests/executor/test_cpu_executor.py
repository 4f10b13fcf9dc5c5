"""The CPU executor speaking the ring protocol: volume with wrap-around,
back-pressure, idle exit and lazy relaunch, STOP while busy, hot swap under
load, the watchdog, handler failures and the numpy handlers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from concordia.executor.cpu import CpuExecutor, OperatorTable, host_view, numpy_operators
from concordia.executor.errors import (ExecutorError, ExecutorStalledError, ExecutorStoppedError,
                                       RingFullError)
from concordia.executor.host import Submitter, Watchdog
from concordia.executor.ring import ConsumerState, Op, Result, Ring, Status

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """on_reap callback: keeps (tag, executor, op, status) of every completion."""

    def __init__(self):
        self.parts = []

    def __call__(self, comps):
        self.parts.append(comps[["tag", "executor_id", "op", "status", "seq"]].copy())

    def all(self):
        return np.concatenate(self.parts) if self.parts else np.empty(0)


def counting_table(counts: np.ndarray, delay_s: float = 0.0, hold=None):
    """APPEND_LOG counts its tag; `hold`: (tag, threading.Event): that task waits for the event."""
    def count(task):
        counts[task.tag] += 1
        if delay_s:
            time.sleep(delay_s)
        if hold is not None and task.tag == hold[0]:
            hold[1].wait(60)
        return Result(Status.OK, pages=1, bytes=task.args[0])
    return OperatorTable({Op.APPEND_LOG: count})


def test_a_million_pings_through_the_thread_wrap_around():
    ring = Ring.allocate(256)
    rec = Recorder()
    sub = Submitter(ring, CpuExecutor(ring), on_reap=rec)
    n = 1_000_000
    tags = np.arange(n, dtype=np.uint64)
    first, count = sub.submit_batch(np.full(n, Op.PING), tags=tags, timeout=60)
    sub.drain(60)
    assert (first, count) == (1, n)
    got = rec.all()
    assert np.array_equal(got["seq"], np.arange(1, n + 1, dtype=np.uint64))
    assert np.array_equal(got["tag"], tags)
    assert sub.completed == n and sub.failed == 0
    assert ring.head == ring.tail == n
    assert sub.stop().op == Op.STOP


def test_handlers_run_once_each_with_wrap_around():
    ring = Ring.allocate(64)
    counts = np.zeros(100_000, np.int64)
    sub = Submitter(ring, CpuExecutor(ring, counting_table(counts)))
    for lo in range(0, counts.size, 5000):
        for t in range(lo, lo + 5000):
            sub.submit(Op.APPEND_LOG, tag=t, args=(t,), keep=False)
    sub.drain(30)
    assert (counts == 1).all()
    assert sub.failed == 0
    sub.stop()


def test_back_pressure_when_the_ring_is_full():
    ring = Ring.allocate(8)
    sub = Submitter(ring)                    # no consumer yet
    seqs = [sub.try_submit(Op.PING) for _ in range(8)]
    assert seqs == list(range(1, 9))
    assert sub.try_submit(Op.PING) is None
    with pytest.raises(RingFullError, match=r"ring full \(8 slots, 8 pending\)"):
        sub.submit(Op.PING, timeout=0.05)
    sub.consumer = CpuExecutor(ring)
    sub.launch()
    assert [sub.wait(s, 5).seq for s in seqs] == seqs
    assert sub.try_submit(Op.PING) == 9      # room again once completions were read
    sub.stop()


def test_a_waiting_quiesce_takes_the_next_free_slot_before_a_producer():
    """A producer that keeps the ring full must not starve QUIESCE (a swap
    under load): while QUIESCE waits for room, other tasks are refused."""
    ring = Ring.allocate(8)
    sub = Submitter(ring)                    # no consumer yet: the ring stays full
    seqs = [sub.try_submit(Op.PING) for _ in range(8)]
    got = []
    th = threading.Thread(target=lambda: got.append(sub.submit(Op.QUIESCE, timeout=10)))
    th.start()
    t0 = time.monotonic()
    while not sub._control_waiting and time.monotonic() - t0 < 60:
        time.sleep(1e-3)
    assert sub._control_waiting == 1
    sub.consumer = CpuExecutor(ring)
    sub.launch()
    while th.is_alive() and time.monotonic() - t0 < 60:   # a producer racing for every freed slot
        sub.try_submit(Op.PING, keep=False)
    th.join(60)
    # QUIESCE has the first slot freed (task 9): a producer's task that came first would have it
    assert got == [9] and sub._control_waiting == 0
    assert [sub.wait(s, 60).seq for s in seqs] == seqs
    assert sub.wait(9, 60).op == Op.QUIESCE
    assert sub.consumer.join(60) and ring.state == ConsumerState.QUIESCED


def _consume_inline(ring: Ring) -> None:
    """Complete every published task from the calling thread (a consumer that
    needs no GIL of its own, as the GPU executor)."""
    n = ring.tail
    k = ring.available(n, ring.capacity)
    if k:
        idx, ops, regions, tags, _ = ring.take(n, k)
        z = np.zeros(k, np.uint64)
        ring.complete(n, idx, 7, ops, regions, tags, np.zeros(k, np.uint16), z, z, z, z)


def test_a_producer_that_never_blocks_lets_other_threads_run():
    """On the GPU the consumer needs no GIL, so a producer thread never blocks;
    it drops and retakes the GIL inside numpy on every reap, which restarts a
    waiting thread's timed wait, and a swap thread ran only after the producer
    had finished.  Here the switch interval is raised to 100 s, so that the
    forced switch cannot help, and the producer completes its own tasks (no
    consumer thread) until this thread has woken from eight short sleeps.
    The submitter's periodic sleep must let a sleeping thread back in while
    the producer runs: without it this thread would wait for the forced
    switch (100 s), past the producer's own end (60 s), which the test sees
    as the producer ending by its deadline rather than by this thread's stop.
    (Without that sleep this machine's waiter often wins the race for a
    dropped GIL anyway; on the H200 it did not.)"""
    import sys

    ring = Ring.allocate(256)
    sub = Submitter(ring)
    stop, produced = threading.Event(), []

    def produce():
        t, deadline = 0, time.monotonic() + 60.0
        while not stop.is_set() and time.monotonic() < deadline:
            if ring.pending() >= ring.capacity // 2:
                _consume_inline(ring)
            sub.submit(Op.PING, tag=t, keep=False, timeout=5)
            t += 1
        produced.append((t, stop.is_set()))

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        th = threading.Thread(target=produce)
        th.start()
        for _ in range(8):
            time.sleep(0.005)
        stop.set()
        th.join(120)
    finally:
        sys.setswitchinterval(old)
    assert produced, "the producer did not end"
    submitted, stopped = produced[0]
    assert submitted > 0
    assert stopped, "this thread woke only after the producer's deadline: the producer never let it in"


def test_other_submits_are_held_back_during_a_swap_and_proceed_after():
    ring = Ring.allocate(16)
    sub = Submitter(ring, CpuExecutor(ring))
    sub._hold(+1)                            # as swap() and stop() do
    assert sub.try_submit(Op.PING) is None
    with pytest.raises(RingFullError, match="held back for 0.05 s behind a swap or STOP"):
        sub.submit(Op.PING, timeout=0.05)
    got = []
    th = threading.Thread(target=lambda: got.append(sub.submit(Op.PING, timeout=10)))
    th.start()
    time.sleep(0.05)
    assert not got and ring.head == 0        # blocked on the gate, nothing published
    sub._hold(-1)
    th.join(5)
    assert got == [1] and sub.wait(1, 5).ok
    sub.stop()


def test_a_blocked_submit_proceeds_when_the_consumer_catches_up():
    ring = Ring.allocate(4)
    gate = threading.Event()
    table = OperatorTable({Op.APPEND_LOG: lambda t: (gate.wait(60), Result())[1]})
    sub = Submitter(ring, CpuExecutor(ring, table))
    for i in range(4):
        sub.submit(Op.APPEND_LOG, tag=i)
    threading.Timer(0.1, gate.set).start()
    seq = sub.submit(Op.PING, timeout=60)    # waits for room
    assert gate.is_set()                     # room came only once the held tasks could finish
    assert sub.wait(seq, 60).ok
    sub.stop()


def test_idle_exit_and_lazy_relaunch():
    ring = Ring.allocate(16)
    ex = CpuExecutor(ring, idle_exit_s=0.01)
    sub = Submitter(ring, ex)
    assert sub.call(Op.PING, tag=5).tag == 5
    assert ex.join(60)
    assert ring.state == ConsumerState.IDLE_EXIT
    assert sub.call(Op.PING, tag=6).tag == 6
    assert sub.launches == 2
    # Submits spaced around the idle interval race the exit handshake; none may be stranded.
    rng = np.random.default_rng(3)
    for i in range(150):
        time.sleep(float(rng.uniform(0, 0.02)))
        assert sub.call(Op.PING, tag=i, timeout=5).tag == i
    assert ex.instances == sub.launches >= 3
    sub.stop()


def test_stop_while_busy_finishes_what_is_ahead_and_refuses_more():
    ring = Ring.allocate(64)
    counts = np.zeros(300, np.int64)
    last = threading.Event()
    ex = CpuExecutor(ring, counting_table(counts, delay_s=0.0005, hold=(299, last)))
    sub = Submitter(ring, ex)
    for t in range(300):
        sub.submit(Op.APPEND_LOG, tag=t, args=(t,), keep=False, timeout=60)
    assert ring.tail < 300                   # still busy: the last task waits for `last`
    threading.Timer(0.05, last.set).start()  # STOP is published behind it either way
    c = sub.stop(timeout=60)
    assert c.seq == 301 and c.ok
    assert (counts == 1).all()
    assert ring.state == ConsumerState.STOPPED and not ex.is_resident()
    with pytest.raises(ExecutorStoppedError, match="PING submitted after STOP"):
        sub.submit(Op.PING)
    assert sub.stop() is None


def test_tasks_behind_stop_are_not_taken():
    ring = Ring.allocate(16)
    ring.publish(Op.PING)
    ring.publish(Op.STOP)
    ring.publish(Op.PING)                    # a raw publish behind STOP
    ex = CpuExecutor(ring)
    sub = Submitter(ring, ex)
    sub.launch()
    assert ex.join(5)
    assert ring.tail == 2 and ring.state == ConsumerState.STOPPED
    with pytest.raises(ExecutorStoppedError, match="1 task\\(s\\) not taken"):
        sub.wait_tail(3, timeout=5)


def test_swap_under_load_loses_and_repeats_nothing():
    ring = Ring.allocate(128)
    n = 60_000
    counts = np.zeros(n, np.int64)
    rec = Recorder()
    first = CpuExecutor(ring, counting_table(counts), idle_exit_s=0.005)
    sub = Submitter(ring, first, on_reap=rec)
    done = threading.Event()

    def produce():
        for t in range(n):
            sub.submit(Op.APPEND_LOG, tag=t, args=(t,), keep=False, timeout=20)
        done.set()

    prod = threading.Thread(target=produce)
    prod.start()
    reports = []
    executors = [first]
    while not done.is_set() and len(reports) < 12:
        time.sleep(0.01)
        nxt = CpuExecutor(ring, counting_table(counts), idle_exit_s=0.005 if len(reports) % 2 else None)
        reports.append(sub.swap(nxt, timeout=20))
        executors.append(nxt)
    prod.join(30)
    sub.drain(30)
    assert len(reports) >= 3
    assert (counts == 1).all(), "a task was lost or ran twice"
    got = rec.all()
    work = got[got["op"] == Op.APPEND_LOG]
    assert np.array_equal(np.sort(work["tag"]), np.arange(n, dtype=np.uint64))
    # Completions of each executor form one contiguous run, in swap order.
    ids = got["executor_id"]
    runs = [int(ids[0])] + [int(b) for a, b in zip(ids[:-1], ids[1:]) if a != b]
    assert runs == [e.executor_id for e in executors][: len(runs)]
    quiesces = got[got["op"] == Op.QUIESCE]
    assert len(quiesces) == len(reports)
    for r in reports:
        assert 0 <= r.gap_s < 60 and r.old_executor != r.new_executor
    sub.stop()


def test_watchdog_catches_a_stalled_consumer():
    ring = Ring.allocate(16)
    gate = threading.Event()
    table = OperatorTable({Op.APPEND_LOG: lambda t: (gate.wait(10), Result())[1]})
    ex = CpuExecutor(ring, table)
    sub = Submitter(ring, ex, stall_deadline_s=0.2)
    t0 = time.monotonic()
    seq = sub.submit(Op.APPEND_LOG)
    sub.submit(Op.PING)
    with pytest.raises(ExecutorStalledError, match=r"slot 0 \(task 1\): no task completed for .* with 2 pending; "
                                                   r"next is APPEND_LOG, consumer running"):
        sub.wait(seq, timeout=60)
    assert time.monotonic() - t0 >= 0.2     # the stall clock started at the first submit, after t0
    gate.set()
    sub.watchdog.deadline_s = 5.0           # the stall is over: let the handler finish
    assert sub.wait(seq, 5).ok
    sub.stop()


def test_watchdog_thread_reports_once():
    ring = Ring.allocate(4)
    ring.publish(Op.PING)                     # nobody consumes it
    seen = []
    wd = Watchdog(ring, 0.05)
    wd.start(seen.append, interval_s=0.01)
    t0 = time.monotonic()
    while not seen and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    time.sleep(0.1)                           # ten more checks: none reports again
    wd.stop()
    assert len(seen) == 1 and isinstance(seen[0], ExecutorStalledError)
    assert "consumer never_ran" in str(seen[0])


def test_watchdog_bookkeeping_with_a_fake_clock():
    ring = Ring.allocate(4)
    now = [0.0]
    wd = Watchdog(ring, 1.0, clock=lambda: now[0])
    ring.publish(Op.PING)
    now[0] = 0.9
    assert wd.check() is None
    now[0] = 1.1
    assert isinstance(wd.check(), ExecutorStalledError)
    ring.complete_one(0, 1, Op.PING, 0, 0, Result())   # progress resets the clock
    ring.publish(Op.PING)
    assert wd.check() is None
    now[0] = 2.0
    assert wd.check() is None
    now[0] = 2.2
    assert wd.check() is not None
    with pytest.raises(ExecutorError, match="not positive"):
        Watchdog(ring, 0)


def test_handler_failures_are_statuses_not_dead_consumers():
    ring = Ring.allocate(8)

    def boom(task):
        raise ValueError("bad page")

    ex = CpuExecutor(ring, OperatorTable({Op.CHECKPOINT: boom, Op.SCATTER: lambda t: "not a result"}))
    sub = Submitter(ring, ex)
    assert sub.call(Op.CHECKPOINT).status == Status.HANDLER_ERROR
    assert sub.call(Op.SCATTER).status == Status.HANDLER_ERROR
    assert sub.call(Op.APPEND_LOG).status == Status.UNSUPPORTED_OP
    assert sub.call(Op.PING).ok
    assert sub.failed == 3 and "ValueError: bad page" in ex.errors[0]
    with pytest.raises(ExecutorError, match="built in"):
        OperatorTable({Op.PING: boom})
    sub.stop()


def test_an_aborted_consumer_faults_the_ring():
    ring = Ring.allocate(8)
    ex = CpuExecutor(ring)
    sub = Submitter(ring, ex)
    sub.call(Op.PING)
    assert ex.abort(5)
    assert ring.state == ConsumerState.FAULT
    with pytest.raises(ExecutorError, match="faulted"):
        sub.submit(Op.PING)


def test_numpy_handlers_checkpoint_append_scatter():
    rng = np.random.default_rng(7)
    pb, npages = 256, 40
    nbytes = pb * npages - 64                   # a partial last page
    region = rng.integers(0, 256, nbytes, dtype=np.uint8)
    shadow = region.copy()
    dirty = np.sort(rng.choice(npages, 9, replace=False))
    for p in dirty:
        region[p * pb] ^= 0x5A
    out = np.zeros((npages, pb), np.uint8)
    ids = np.zeros(npages, np.uint32)
    ring = Ring.allocate(8)
    sub = Submitter(ring, CpuExecutor(ring, numpy_operators()))
    a = lambda x: x.ctypes.data  # noqa: E731
    c = sub.call(Op.CHECKPOINT, region=3, args=(a(region), a(shadow), a(out), a(ids), nbytes, pb, 1000))
    assert c.ok and c.pages == 9 and c.bytes == 9 * pb and (c.lsn_first, c.lsn_last) == (1000, 1000 + 9 * pb)
    assert c.region == 3
    assert np.array_equal(ids[:9], dirty)
    padded = np.concatenate([region, np.zeros(64, np.uint8)]).reshape(npages, pb)
    assert np.array_equal(out[:9], padded[dirty])
    assert np.array_equal(shadow, region)
    assert sub.call(Op.CHECKPOINT, args=(a(region), a(shadow), a(out), a(ids), nbytes, pb, 0)).pages == 0
    # SCATTER the dirty pages into a stale copy
    stale = region.copy()
    for p in dirty:
        stale[p * pb] ^= 0x5A
    c = sub.call(Op.SCATTER, args=(a(stale), a(out), a(ids), 9, pb, nbytes, 17))
    assert c.ok and c.pages == 9 and c.lsn_first == 17
    assert np.array_equal(stale, region)
    bad = sub.call(Op.SCATTER, args=(a(stale), a(out), a(np.array([npages], np.uint32)), 1, pb, nbytes, 0))
    assert bad.status == Status.BAD_ARGS
    # APPEND_LOG
    log = np.zeros(4096, np.uint8)
    c = sub.call(Op.APPEND_LOG, args=(a(log), a(region), 4096, 64))
    assert c.ok and c.bytes == 4096 and (c.lsn_first, c.lsn_last) == (64, 64 + 4096)
    assert np.array_equal(log, region[:4096])
    with pytest.raises(ExecutorError, match="bad buffer address"):
        host_view(0, 8)
    sub.stop()


def test_an_unknown_op_completes_as_unsupported():
    ring = Ring.allocate(4)
    sub = Submitter(ring, CpuExecutor(ring))
    c = sub.call(99)
    assert c.status == Status.UNSUPPORTED_OP and c.op == 99
    sub.stop()
