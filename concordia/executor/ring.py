"""The task ring: fixed-size task and completion slots over one byte buffer.

The same bytes are read and written by the host (numpy views) and by the consumer:
a CPU thread (`cpu.CpuExecutor`) over ordinary memory, or the persistent kernel
(`gpu_kernels/executor.cu`) over mapped pinned host memory.  This module owns the
layout and the pure protocol steps; it does no waiting and starts nothing.

Layout (all integers little-endian; `C` = capacity, a power of two)::

    ring := header[256] task_slot[C] completion_slot[C]

Header, 256 bytes; each 64-byte line has exactly one writer:

    off  type  field          writer
    0    u32   magic          formatter   0x474E5258 ("XRNG")
    4    u16   version        formatter   1
    6    u16   task_bytes     formatter   128
    8    u32   capacity       formatter   power of two, 2 .. 2**20
    12   u16   comp_bytes     formatter   64
    14   u16   reserved       0
    16   u64   reserved       0 .. byte 64
    64   u64   head           host        tasks published (task n is published when head > n)
    72   u64   stop_sent      host        1 once STOP was published (host bookkeeping)
    128  u64   tail           consumer    tasks completed (completion n is valid when tail > n)
    136  u32   state          consumer    ConsumerState
    140  u32   executor_id    consumer    id of the executor instance that wrote `state`
    144  u64   polls          consumer    tasks taken by the current instance (liveness)
    152  u32   instance       consumer    launch number of the running instance (lazy relaunch)
    192  ...   reserved       0

Task slot n % C, 128 bytes (task n is the n-th task ever published, from 0):

    0    u64   seq        n + 1; written last, after the body: it publishes the slot
    8    u16   op         Op
    10   u16   flags      0
    12   u32   region     region id, 0xFFFFFFFF for none
    16   u64   tag        the submitter's cookie, echoed in the completion
    24   u64   arg[13]    op-specific (see `Op`)

Completion slot n % C, 64 bytes, written by the consumer:

    0    u64   seq        n + 1; written after the body, before `tail`
    8    u16   op         echo
    10   u16   status     Status
    12   u32   executor_id
    16   u64   tag        echo
    24   u64   pages      pages found (CHECKPOINT) / applied (SCATTER)
    32   u64   bytes      bytes written
    40   u64   lsn_first  first LSN written (or 0)
    48   u64   lsn_last   one past the last LSN written (or 0)
    56   u32   region     echo
    60   u32   reserved   0

Protocol (one writer per index; no read-modify-write across host and device):

1. The host may publish task n only when ``n - reaped < C``, where ``reaped`` is its
   own count of completions read back; so neither a task slot nor a completion
   slot is reused before the host has read its completion (back-pressure).
2. Publishing writes the body, then ``seq = n + 1``, then ``head = n + 1``.
3. The consumer takes task n when the slot's ``seq == n + 1`` (where ``n = tail``),
   runs it, writes the completion body, then its ``seq``, then ``tail = n + 1``.
4. QUIESCE and STOP complete like any task, then the consumer writes ``state``
   (QUIESCED / STOPPED) and exits; a new consumer resumes at ``tail``.  Only one
   consumer runs at a time (a thread joins its predecessor; kernel launches on
   one stream run in order).  An instance launched lazily (not as a resume)
   that finds QUIESCED, STOPPED or FAULT leaves without touching the ring.
5. A consumer that idles past its interval writes ``state = IDLE_EXIT``, fences,
   and checks the next slot once more before exiting; the host, after
   publishing, fences and reads ``state``: if it is not RUNNING, it launches a
   consumer (Dekker's handshake: at least one side sees the other, so no task
   is left without a consumer; an extra launch queues behind and idles out).

Memory ordering: stores are made in the order above.  On x86 (TSO) stores are
seen in program order and loads are not reordered with loads, so numpy stores
and loads suffice for both sides of the CPU executor; the two store->load
fences of step 5 are a lock acquire (a locked instruction, a full fence).  On the
GPU the consumer reads ``seq`` with ``ld.acquire.sys``, writes the completion with
volatile stores, ``__threadfence_system()``, then ``tail`` with ``st.release.sys``;
the host is x86 with the ring in coherent (not write-combined) pinned memory.
"""

from __future__ import annotations

import enum
import mmap
from dataclasses import dataclass

import numpy as np

from .errors import ProtocolError, RingLayoutError

MAGIC = 0x474E5258  # b"XRNG" little-endian
VERSION = 1
HEADER_BYTES = 256
TASK_BYTES = 128
COMP_BYTES = 64
N_ARGS = 13
MAX_CAPACITY = 1 << 20

OFF_MAGIC = 0
OFF_VERSION = 4
OFF_TASK_BYTES = 6
OFF_CAPACITY = 8
OFF_COMP_BYTES = 12
OFF_HEAD = 64
OFF_STOP_SENT = 72
OFF_TAIL = 128
OFF_STATE = 136
OFF_EXECUTOR_ID = 140
OFF_POLLS = 144
OFF_INSTANCE = 152

NO_REGION = 0xFFFFFFFF


class Op(enum.IntEnum):
    """Task op codes (the same numbers in `executor.cu`).

    Arguments (``arg[i]``), addresses are device addresses on the GPU and host
    addresses on the CPU executor:

    PING        none; the completion echoes the tag.
    CHECKPOINT  0 src, 1 shadow, 2 out pages, 3 out page ids (u32), 4 nbytes,
                5 page_bytes, 6 base LSN.  Changed pages are copied to `out` (in
                any order, their ids beside them) and into `shadow`.
    APPEND_LOG  0 dst, 1 src, 2 nbytes, 3 LSN of the first byte.
    SCATTER     0 dst region, 1 src pages, 2 page ids (u32), 3 count, 4 page_bytes,
                5 region nbytes, 6 plan chunk number (echoed as lsn_first).
    QUIESCE     none; the consumer exits after completing it (hot swap).
    STOP        none; the consumer exits after completing it (shutdown).
    EPOCH       0 epoch descriptor (its key in the resident session's table on
                the CPU executor).  One checkpoint of a Session: detection and
                staging over its region table, then the commit (by the consumer
                on tiers it can write, else handed to the host); the completion
                carries the pages found and the record bytes written.
                (`concordia.executor.resident`.)  On the GPU (executor.cu built
                with CX_EPOCH) the device address of an epoch descriptor
                (`checkpoint.device_epoch.EPOCH_DESC`): the table pass into the
                session's arena, its commit included; lsn_first / lsn_last are
                the epoch's first record and its commit.
    RECOVER     0 recovery descriptor: a Session's recovery, run by the consumer.
                On the GPU (executor.cu built with CX_RECOVER) and the CPU
                executor's numpy handlers, the address of a
                `recover.RECOVER_DESC`: a recovery's pages copied from the log
                mapping into its own arrays, each checked against its stored
                CRC32C; pages = pages applied, bytes = bytes read, lsn_first =
                pages damaged (restore/ring.py).
    """

    PING = 1
    CHECKPOINT = 2
    APPEND_LOG = 3
    SCATTER = 4  # pages to their ids in a region (the device step of a restore)
    QUIESCE = 5
    STOP = 6
    EPOCH = 7    # one Session checkpoint (concordia.executor.resident)
    RECOVER = 8  # one Session recovery (concordia.executor.resident)


CONTROL_OPS = frozenset({Op.QUIESCE, Op.STOP})


def op_or_int(code: int):
    """Op for known codes; the bare number for others (a completion of an
    unknown op carries UNSUPPORTED_OP and must still be readable)."""
    return Op(code) if code in Op._value2member_map_ else code


class Status(enum.IntEnum):
    OK = 0
    UNSUPPORTED_OP = 1
    BAD_ARGS = 2
    LAUNCH_FAILED = 3
    TIMEOUT = 4
    HANDLER_ERROR = 5
    NO_ROOM = 6  # EPOCH on the device: its arena has no room for an epoch's bound, or lost one (nothing detected)
    LOST = 7     # EPOCH on the device: its records did not fit what the arena had left (detected, nothing written)


class ConsumerState(enum.IntEnum):
    NEVER_RAN = 0
    RUNNING = 1
    IDLE_EXIT = 2
    QUIESCED = 3
    STOPPED = 4
    FAULT = 5
    LIFETIME_EXIT = 6


TASK_DTYPE = np.dtype(
    {
        "names": ["seq", "op", "flags", "region", "tag", "args"],
        "formats": ["<u8", "<u2", "<u2", "<u4", "<u8", ("<u8", (N_ARGS,))],
        "offsets": [0, 8, 10, 12, 16, 24],
        "itemsize": TASK_BYTES,
    }
)

COMP_DTYPE = np.dtype(
    {
        "names": ["seq", "op", "status", "executor_id", "tag", "pages", "bytes",
                  "lsn_first", "lsn_last", "region"],
        "formats": ["<u8", "<u2", "<u2", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u4"],
        "offsets": [0, 8, 10, 12, 16, 24, 32, 40, 48, 56],
        "itemsize": COMP_BYTES,
    }
)


def ring_bytes(capacity: int) -> int:
    """Bytes a ring of `capacity` slots occupies."""
    return HEADER_BYTES + capacity * (TASK_BYTES + COMP_BYTES)


@dataclass(frozen=True)
class Completion:
    """One completion as the host read it back."""

    seq: int          # task number + 1
    op: int           # an Op, or the bare code of an unknown op
    status: Status
    executor_id: int
    tag: int
    pages: int
    bytes: int
    lsn_first: int
    lsn_last: int
    region: int

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclass(frozen=True)
class Result:
    """What a handler returns; the consumer turns it into a completion."""

    status: Status = Status.OK
    pages: int = 0
    bytes: int = 0
    lsn_first: int = 0
    lsn_last: int = 0


@dataclass(frozen=True)
class TaskView:
    """One task as a consumer read it."""

    seq: int
    op: int
    flags: int
    region: int
    tag: int
    args: tuple


class Ring:
    """Typed views over a ring buffer.  Holds no state beyond the buffer, except
    the host's `reaped` count, which only the host side uses."""

    def __init__(self, buf, *, where: str = "ring"):
        raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raw = raw.reshape(-1).view(np.uint8)
        self.where = where
        if raw.nbytes < HEADER_BYTES:
            raise RingLayoutError(f"buffer of {raw.nbytes} bytes is smaller than a ring header",
                                  where=where)
        if raw.ctypes.data % 64:
            raise RingLayoutError("ring buffer is not 64-byte aligned", where=where)
        hdr32 = raw[:HEADER_BYTES].view("<u4")
        hdr16 = raw[:HEADER_BYTES].view("<u2")
        magic, cap = int(hdr32[0]), int(hdr32[OFF_CAPACITY // 4])
        if magic != MAGIC:
            raise RingLayoutError(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x}",
                                  where=where, hint="format it with Ring.format")
        version = int(hdr16[OFF_VERSION // 2])
        tb, cb = int(hdr16[OFF_TASK_BYTES // 2]), int(hdr16[OFF_COMP_BYTES // 2])
        if version != VERSION or tb != TASK_BYTES or cb != COMP_BYTES:
            raise RingLayoutError(
                f"version {version} slots {tb}/{cb} bytes, expected {VERSION} {TASK_BYTES}/{COMP_BYTES}",
                where=where)
        _check_capacity(cap, where)
        if raw.nbytes < ring_bytes(cap):
            raise RingLayoutError(f"buffer of {raw.nbytes} bytes holds no ring of {cap} slots "
                                  f"({ring_bytes(cap)} bytes)", where=where)
        self.raw = raw[: ring_bytes(cap)]
        self.capacity = cap
        self.mask = cap - 1
        self.hdr64 = self.raw[:HEADER_BYTES].view("<u8")
        self.hdr32 = self.raw[:HEADER_BYTES].view("<u4")
        t0 = HEADER_BYTES
        c0 = t0 + cap * TASK_BYTES
        self.tasks = self.raw[t0:c0].view(TASK_DTYPE)
        self.comps = self.raw[c0:c0 + cap * COMP_BYTES].view(COMP_DTYPE)
        # Field views made once: indexing them costs a fraction of a field lookup.
        self.t_seq, self.t_op, self.t_flags = self.tasks["seq"], self.tasks["op"], self.tasks["flags"]
        self.t_region, self.t_tag, self.t_args = self.tasks["region"], self.tasks["tag"], self.tasks["args"]
        self.c_seq, self.c_op, self.c_status = self.comps["seq"], self.comps["op"], self.comps["status"]
        self.c_exec, self.c_tag, self.c_pages = self.comps["executor_id"], self.comps["tag"], self.comps["pages"]
        self.c_bytes, self.c_lsn0, self.c_lsn1 = self.comps["bytes"], self.comps["lsn_first"], self.comps["lsn_last"]
        self.c_region = self.comps["region"]
        self.reaped = int(self.tail)  # host side: completions read back so far

    # -- creation ------------------------------------------------------------

    @classmethod
    def allocate(cls, capacity: int, *, where: str = "ring") -> "Ring":
        """A formatted ring in fresh page-aligned anonymous memory (CPU executor,
        tests); the GPU executor registers such memory with CUDA."""
        _check_capacity(capacity, where)
        mm = mmap.mmap(-1, ring_bytes(capacity))
        ring = cls.format(np.frombuffer(mm, dtype=np.uint8), capacity, where=where)
        ring._mmap = mm   # keeps the mapping alive as long as the views
        return ring

    @classmethod
    def format(cls, buf, capacity: int, *, where: str = "ring") -> "Ring":
        """Write an empty ring of `capacity` slots into `buf` (zeroing it) and
        return its views.  No consumer may be running on the buffer."""
        _check_capacity(capacity, where)
        raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        need = ring_bytes(capacity)
        if raw.nbytes < need:
            raise RingLayoutError(f"buffer of {raw.nbytes} bytes is too small for {capacity} slots "
                                  f"({need} bytes)", where=where)
        raw[:need] = 0
        h32 = raw[:HEADER_BYTES].view("<u4")
        h16 = raw[:HEADER_BYTES].view("<u2")
        h32[OFF_CAPACITY // 4] = capacity
        h16[OFF_VERSION // 2] = VERSION
        h16[OFF_TASK_BYTES // 2] = TASK_BYTES
        h16[OFF_COMP_BYTES // 2] = COMP_BYTES
        h32[OFF_MAGIC // 4] = MAGIC  # last: a half-formatted buffer is not a ring
        return cls(raw, where=where)

    # -- shared indices --------------------------------------------------------

    @property
    def head(self) -> int:
        return int(self.hdr64[OFF_HEAD // 8])

    @property
    def tail(self) -> int:
        return int(self.hdr64[OFF_TAIL // 8])

    @property
    def state(self) -> ConsumerState:
        return ConsumerState(int(self.hdr32[OFF_STATE // 4]))

    @property
    def executor_id(self) -> int:
        return int(self.hdr32[OFF_EXECUTOR_ID // 4])

    @property
    def instance(self) -> int:
        return int(self.hdr32[OFF_INSTANCE // 4])

    @property
    def stop_sent(self) -> bool:
        return bool(self.hdr64[OFF_STOP_SENT // 8])

    def pending(self) -> int:
        return self.head - self.tail

    def slot_where(self, n: int) -> str:
        return f"{self.where} slot {n & self.mask} (task {n + 1})"

    # -- host side -----------------------------------------------------------

    def free_slots(self) -> int:
        return self.capacity - (self.head - self.reaped)

    def publish(self, op: int, *, region: int = NO_REGION, tag: int = 0, args=(), flags: int = 0) -> int:
        """Write one task into the next slot and publish it; returns its seq
        (task number + 1).  The caller checked `free_slots() > 0`."""
        n = int(self.hdr64[OFF_HEAD // 8])
        if n - self.reaped >= self.capacity:
            raise ProtocolError("publish into a full ring", where=self.slot_where(n))
        i = n & self.mask
        self.t_op[i] = op
        self.t_flags[i] = flags
        self.t_region[i] = region
        self.t_tag[i] = tag
        a = self.t_args[i]
        a[:] = 0
        if len(args):
            if len(args) > N_ARGS:
                raise ProtocolError(f"{len(args)} arguments, a slot holds {N_ARGS}", where=self.slot_where(n))
            a[: len(args)] = args
        self.t_seq[i] = n + 1                 # publishes the slot
        self.hdr64[OFF_HEAD // 8] = n + 1
        if op == Op.STOP:
            self.hdr64[OFF_STOP_SENT // 8] = 1
        return n + 1

    def publish_batch(self, ops, *, tags=None, regions=None, args=None) -> tuple[int, int]:
        """Publish len(ops) tasks at once (bodies first, then every seq, then
        head).  Returns (first seq, count).  The caller checked the room."""
        ops = np.asarray(ops, dtype="<u2")
        k = int(ops.size)
        n = int(self.hdr64[OFF_HEAD // 8])
        if k == 0:
            return n + 1, 0
        if n + k - self.reaped > self.capacity:
            raise ProtocolError(f"batch of {k} does not fit ({self.free_slots()} free)",
                                where=self.slot_where(n))
        idx = (np.arange(n, n + k, dtype=np.uint64) & np.uint64(self.mask)).astype(np.intp)
        self.t_op[idx] = ops
        self.t_flags[idx] = 0
        self.t_region[idx] = NO_REGION if regions is None else regions
        self.t_tag[idx] = 0 if tags is None else tags
        self.t_args[idx] = 0 if args is None else args
        self.t_seq[idx] = np.arange(n + 1, n + k + 1, dtype=np.uint64)
        self.hdr64[OFF_HEAD // 8] = n + k
        if np.any(ops == Op.STOP):
            self.hdr64[OFF_STOP_SENT // 8] = 1
        return n + 1, k

    def reap_range(self) -> tuple[int, int]:
        """Completions ready to read: task numbers [reaped, tail)."""
        return self.reaped, int(self.hdr64[OFF_TAIL // 8])

    def read_completion(self, n: int) -> Completion:
        i = n & self.mask
        seq = int(self.c_seq[i])
        if seq != n + 1:
            raise ProtocolError(f"completion seq {seq}, expected {n + 1}", where=self.slot_where(n))
        return Completion(seq, op_or_int(int(self.c_op[i])), Status(int(self.c_status[i])), int(self.c_exec[i]),
                          int(self.c_tag[i]), int(self.c_pages[i]), int(self.c_bytes[i]),
                          int(self.c_lsn0[i]), int(self.c_lsn1[i]), int(self.c_region[i]))

    def completions(self, lo: int, hi: int) -> np.ndarray:
        """A copy of completions [lo, hi) (hi - lo <= capacity), seqs checked."""
        if hi <= lo:
            return np.empty(0, dtype=COMP_DTYPE)
        a, b = lo & self.mask, hi & self.mask
        if a < b:
            out = self.comps[a:b].copy()
        else:  # wraps (or spans the whole ring)
            out = np.concatenate([self.comps[a:], self.comps[:b]])
        want = np.arange(lo + 1, hi + 1, dtype=np.uint64)
        bad = np.flatnonzero(out["seq"] != want)
        if bad.size:
            n = lo + int(bad[0])
            raise ProtocolError(f"completion seq {int(out['seq'][bad[0]])}, expected {n + 1}",
                                where=self.slot_where(n))
        return out

    # -- consumer side -------------------------------------------------------

    def consumer_begin(self, executor_id: int, instance: int) -> int:
        """A consumer instance starts: claims the state line, returns tail."""
        self.hdr32[OFF_EXECUTOR_ID // 4] = executor_id
        self.hdr32[OFF_INSTANCE // 4] = instance
        self.hdr64[OFF_POLLS // 8] = 0
        self.hdr32[OFF_STATE // 4] = ConsumerState.RUNNING
        return int(self.hdr64[OFF_TAIL // 8])

    def set_state(self, state: ConsumerState) -> None:
        self.hdr32[OFF_STATE // 4] = state

    def available(self, n: int, limit: int) -> int:
        """How many tasks from task n on are published (at most `limit`)."""
        h = int(self.hdr64[OFF_HEAD // 8])
        return max(0, min(h - n, limit))

    def take(self, n: int, k: int):
        """Read tasks [n, n+k) as column lists (k <= capacity), seqs checked.
        Returns (ops, regions, tags, args) as numpy arrays (copies)."""
        idx = (np.arange(n, n + k, dtype=np.uint64) & np.uint64(self.mask)).astype(np.intp)
        seqs = self.t_seq[idx]
        want = np.arange(n + 1, n + k + 1, dtype=np.uint64)
        bad = np.flatnonzero(seqs != want)
        if bad.size:
            m = n + int(bad[0])
            raise ProtocolError(f"task seq {int(seqs[bad[0]])}, expected {m + 1}", where=self.slot_where(m))
        return idx, self.t_op[idx], self.t_region[idx], self.t_tag[idx], self.t_args[idx]

    def complete(self, n: int, idx, executor_id: int, ops, regions, tags, status, pages, nbytes, lsn0, lsn1) -> None:
        """Write completions for tasks [n, n + len(idx)) and advance tail."""
        k = len(idx)
        self.c_op[idx] = ops
        self.c_status[idx] = status
        self.c_exec[idx] = executor_id
        self.c_tag[idx] = tags
        self.c_pages[idx] = pages
        self.c_bytes[idx] = nbytes
        self.c_lsn0[idx] = lsn0
        self.c_lsn1[idx] = lsn1
        self.c_region[idx] = regions
        self.c_seq[idx] = np.arange(n + 1, n + k + 1, dtype=np.uint64)
        self.hdr64[OFF_TAIL // 8] = n + k
        self.hdr64[OFF_POLLS // 8] += k

    def complete_one(self, n: int, executor_id: int, op: int, region: int, tag: int, r: Result) -> None:
        """Write the completion of task n and advance tail (scalar stores)."""
        i = n & self.mask
        self.c_op[i] = op
        self.c_status[i] = r.status
        self.c_exec[i] = executor_id
        self.c_tag[i] = tag
        self.c_pages[i] = r.pages
        self.c_bytes[i] = r.bytes
        self.c_lsn0[i] = r.lsn_first
        self.c_lsn1[i] = r.lsn_last
        self.c_region[i] = region
        self.c_seq[i] = n + 1
        self.hdr64[OFF_TAIL // 8] = n + 1
        self.hdr64[OFF_POLLS // 8] += 1


def _check_capacity(cap: int, where: str) -> None:
    if cap < 2 or cap > MAX_CAPACITY or cap & (cap - 1):
        raise RingLayoutError(f"capacity {cap} is not a power of two in [2, {MAX_CAPACITY}]", where=where)
