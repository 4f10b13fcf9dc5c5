"""The ring layout and the pure protocol steps, without threads."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.executor import ring as R
from concordia.executor.errors import ProtocolError, RingLayoutError
from concordia.executor.ring import COMP_DTYPE, TASK_DTYPE, Op, Ring, Status


def test_layout_matches_the_docstring():
    assert TASK_DTYPE.itemsize == R.TASK_BYTES == 128
    assert COMP_DTYPE.itemsize == R.COMP_BYTES == 64
    assert [TASK_DTYPE.fields[f][1] for f in ("seq", "op", "flags", "region", "tag", "args")] == [0, 8, 10, 12, 16, 24]
    assert 24 + 8 * R.N_ARGS == R.TASK_BYTES
    assert [COMP_DTYPE.fields[f][1] for f in COMP_DTYPE.names] == [0, 8, 10, 12, 16, 24, 32, 40, 48, 56]
    # one writer per 64-byte line: host line (head), consumer line (tail, state, ...)
    assert R.OFF_HEAD // 64 == R.OFF_STOP_SENT // 64 == 1
    assert {o // 64 for o in (R.OFF_TAIL, R.OFF_STATE, R.OFF_EXECUTOR_ID, R.OFF_POLLS, R.OFF_INSTANCE)} == {2}
    assert R.ring_bytes(8) == 256 + 8 * 192


def test_the_cuda_source_uses_the_same_numbers():
    src = (R.__file__.rsplit("/", 3)[0] + "/gpu_kernels/executor.cu")
    text = open(src).read()
    for name, value in [("CX_HDR_BYTES", R.HEADER_BYTES), ("CX_TASK_BYTES", R.TASK_BYTES),
                        ("CX_COMP_BYTES", R.COMP_BYTES), ("CX_OFF_TAIL", R.OFF_TAIL), ("CX_OFF_STATE", R.OFF_STATE),
                        ("CX_OFF_EXECUTOR_ID", R.OFF_EXECUTOR_ID), ("CX_OFF_POLLS", R.OFF_POLLS),
                        ("CX_OFF_INSTANCE", R.OFF_INSTANCE)] + \
            [(f"OP_{op.name}", int(op)) for op in Op] + \
            [(f"ST_{st.name}", int(st)) for st in Status if st != Status.HANDLER_ERROR] + \
            [(f"CS_{cs.name}", int(cs)) for cs in R.ConsumerState if cs != R.ConsumerState.NEVER_RAN]:
        assert f"#define {name} {value}\n" in text, name


def test_format_and_attach():
    r = Ring.allocate(16)
    assert (r.capacity, r.head, r.tail, r.state) == (16, 0, 0, R.ConsumerState.NEVER_RAN)
    again = Ring(r.raw)
    assert again.capacity == 16


@pytest.mark.parametrize("cap", [0, 1, 3, 12, R.MAX_CAPACITY * 2])
def test_bad_capacity(cap):
    with pytest.raises(RingLayoutError, match="power of two"):
        Ring.allocate(cap)


def test_bad_buffers():
    r = Ring.allocate(4)
    r.raw[0] ^= 0xFF
    with pytest.raises(RingLayoutError, match="bad magic"):
        Ring(r.raw)
    with pytest.raises(RingLayoutError, match="smaller than a ring header"):
        Ring(np.zeros(64, np.uint8))
    r2 = Ring.allocate(8)
    with pytest.raises(RingLayoutError, match="holds no ring"):
        Ring(r2.raw[: R.ring_bytes(4)])
    with pytest.raises(RingLayoutError, match="64-byte aligned"):
        Ring(r2.raw[8:])


def _consume(ring: Ring, n: int, k: int, executor_id: int = 9):
    idx, ops, regions, tags, args = ring.take(n, k)
    z = np.zeros(k, np.uint64)
    ring.complete(n, idx, executor_id, ops, regions, tags, 0, args[:, 0], z, z, z)
    return n + k


def test_a_million_tasks_wrap_around_a_small_ring():
    """Pure protocol, no threads: 2**20 tasks through 64 slots (16384 wraps),
    batches of varying size; every completion echoes its own task."""
    ring = Ring.allocate(64)
    rng = np.random.default_rng(1)
    total, n_host, n_cons, seen = 1 << 20, 0, 0, 0
    while seen < total:
        room = min(ring.free_slots(), total - n_host)
        if room:
            k = int(rng.integers(1, room + 1))
            tags = np.arange(n_host, n_host + k, dtype=np.uint64)
            args = np.zeros((k, R.N_ARGS), np.uint64)
            args[:, 0] = tags * 3
            first, cnt = ring.publish_batch(np.full(k, Op.PING), tags=tags, args=args)
            assert (first, cnt) == (n_host + 1, k)
            n_host += k
        avail = ring.available(n_cons, 64)
        if avail:
            n_cons = _consume(ring, n_cons, int(rng.integers(1, avail + 1)))
        lo, hi = ring.reap_range()
        comps = ring.completions(lo, hi)
        assert np.array_equal(comps["tag"], np.arange(lo, hi, dtype=np.uint64))
        assert np.array_equal(comps["pages"], comps["tag"] * 3)
        ring.reaped = hi
        seen = hi
    assert ring.head == ring.tail == total


def test_publish_refuses_a_full_ring_and_seq_mismatch_is_caught():
    ring = Ring.allocate(4)
    for i in range(4):
        ring.publish(Op.PING, tag=i)
    with pytest.raises(ProtocolError, match="full ring"):
        ring.publish(Op.PING)
    with pytest.raises(ProtocolError, match="does not fit"):
        ring.publish_batch([Op.PING])
    ring.t_seq[2] = 99      # a torn publish
    with pytest.raises(ProtocolError, match=r"slot 2 \(task 3\): task seq 99, expected 3"):
        ring.take(0, 4)
    _consume(ring, 0, 2)
    ring.c_seq[1] = 7
    with pytest.raises(ProtocolError, match="completion seq 7, expected 2"):
        ring.completions(0, 2)


def test_too_many_arguments():
    ring = Ring.allocate(4)
    with pytest.raises(ProtocolError, match="a slot holds 13"):
        ring.publish(Op.CHECKPOINT, args=tuple(range(14)))


def test_the_gpu_ring_is_refused_in_one_line_on_a_host_whose_stores_it_cannot_order(monkeypatch):
    # the protocol with the device relies on an x86 host's store order (module doc):
    # on a weakly ordered host the device could read a task's seq before its body
    from concordia.executor import persistent

    assert persistent.host_order_why("x86_64") is None and persistent.host_order_why("AMD64") is None
    why = persistent.host_order_why("aarch64")
    assert "\n" not in why and "x86 host's store order" in why and "aarch64" in why
    monkeypatch.setattr(persistent.platform, "machine", lambda: "aarch64")
    with pytest.raises(persistent.ExecutorError) as info:
        persistent.GpuRing(4)  # before CuPy is asked for: the same line with or without a GPU
    assert "aarch64" in info.value.one_line() and "\n" not in info.value.one_line()
    # the device's EPOCH handler is refused as early, before its module is compiled or buffers pinned
    from concordia.checkpoint.device_epoch import why_not

    assert why_not(None, None) == why
