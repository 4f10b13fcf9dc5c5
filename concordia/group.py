"""A coordinated epoch over one log per rank (tensor-parallel groups).

    g = GroupSession(rank, world, f"file:ckpt/rank{rank}.log", comm=dist.group.WORLD)
    g.register("kv", kv_shard, kind="kv")
    ...
    e = g.checkpoint()          # every rank has committed epoch e when this returns
    ...
    G = group_epoch([f"file:ckpt/rank{r}.log" for r in range(world)])   # no communicator

Each rank protects its own state in its own log through one `Session`.  An
epoch counts for the group only when every rank's log commits it; epochs carry
the same number on every rank.

Protocol
--------
Numbering.  When a group forms (the constructor, `rejoin`) the ranks agree on
the next epoch number: an all-reduce MAX of each log's next free epoch (above
its last commit and above any epoch with records but no commit).  Every
checkpoint then takes that number and the next one the number after, on every
rank.  A number a log has used is never used again in that log, so an epoch one
rank committed alone (it ran ahead when a peer died) stays an orphan: no later
epoch of the group shares its number.

Checkpoint.  `checkpoint()` commits the agreed epoch locally (durable in this
rank's log when `Session.checkpoint` returns) and then all-reduces MIN of the
epoch just committed.  When it returns epoch e, every rank has committed e: a
rank that failed before its commit never reaches the collective, which then
raises on the others (the collective's timeout, or gloo's and NCCL's error when
a peer's connection closes).  A rank may assume, after it returns, that the
group can always be restored to e or to a later group epoch, never to an
earlier one.

Group epoch.  The newest epoch committed by every rank.  Without a
communicator, `group_epoch(logs)` opens each rank's log read-only and takes the
newest epoch in the intersection of their commits (the last commits alone are
not enough: an orphan can be one rank's last commit).  With one, `agree()`
finds the same epoch by rounds of all-reduce MIN: each rank offers the newest
epoch its log commits at or below the current candidate, until no rank lowers
it.

Recovery.  After a rank dies the survivors see the collective fail, abort and
destroy their process group, and form a new one with the replacement (a fresh
rendezvous: `torch.distributed.init_process_group` on a new store).  Then every
rank calls `rejoin(comm, ...)`:

  - the replacement (a fresh process) restores all its regions from its rank's
    log at the group epoch G, in place into the arrays it registered;
  - a survivor keeps its memory as it is when its state is that of G: its last
    commit is G and it has not written its regions since (the caller says so
    with `changed=False`).  A survivor that is ahead (it committed an epoch
    above G, or wrote its regions after its last commit) is rolled back from
    its own log at G, in place; the next checkpoint continues from there as a
    delta.
  - the ranks agree on the next epoch number (above every number any of them
    used) and go on; the caller resumes its work from G (the step it keeps in a
    region of its own).

What survives and what is redone: the survivors' state is never reloaded
unless it is ahead of G; the work of epochs above G is redone from G by every
rank, and comes out bit-identical when the step is deterministic (the tensor
parallel decode in `concordia.demo.tp` sums the ranks' partial results in rank
order).
"""

from __future__ import annotations

import dataclasses
import time

from concordia.regions.errors import NothingToRecoverError, SessionError

__all__ = ["GroupSession", "RejoinStats", "group_epoch", "committed_epochs"]


def committed_epochs(log) -> list[int]:
    """Epochs a log commits, oldest first.  `log`: a log name (opened
    read-only and closed again) or an open `concordia.wal.Log`."""
    from concordia.wal import Log

    if isinstance(log, Log):
        return [c.epoch for c in log.commits]
    with Log.open(log, writable=False, check_pages=False) as lg:
        return [c.epoch for c in lg.commits]


def group_epoch(logs) -> int:
    """The newest epoch every rank's log commits (0 when they share none).
    Reads each log read-only; needs no communicator."""
    common = None
    for log in logs:
        eps = set(committed_epochs(log))
        common = eps if common is None else common & eps
    return max(common) if common else 0


@dataclasses.dataclass
class RejoinStats:
    epoch: int            # the group epoch everyone is now at
    restored: bool        # this rank's regions were rewritten from its log
    why: str              # "replacement", "ahead", "kept"
    agree_ms: float
    restore_ms: float


class GroupSession:
    """One rank's `Session`, its checkpoints coordinated with the other ranks.

    rank, world: this rank and the group size.  log: this rank's log (anything
    `Session` takes).  comm: a `torch.distributed` process group (None: the
    default group; the group must be initialised before the first
    checkpoint).  Other keywords go to `Session`.
    """

    def __init__(self, rank: int, world: int, log, *, comm=None, **session_kw):
        from concordia.session import Session

        if not (0 <= rank < world):
            raise SessionError(f"rank {rank} is not in a group of {world}")
        self.rank, self.world = rank, world
        self.session = Session(log, **session_kw)
        self.comm = comm
        self._next: int | None = None
        #: the newest epoch every rank has committed, as this rank knows it
        self.group_epoch = 0

    # ------------------------------------------------------------ passthrough
    def register(self, *a, **kw):
        return self.session.register(*a, **kw)

    def register_all(self, regions):
        return self.session.register_all(regions)

    @property
    def epoch(self) -> int:
        """This rank's last committed epoch (may be ahead of the group's)."""
        return self.session.epoch

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ collectives
    def _reduce(self, values, op):
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        if dist.get_backend(self.comm) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=op, group=self.comm)
        return [int(v) for v in t.cpu().tolist()]

    def _local_next(self) -> int:
        s = self.session
        return max(s.region_set.next_epoch, s.log.appender.next_epoch)

    def _agree_next(self) -> None:
        import torch.distributed as dist

        self._next = self._reduce([self._local_next()], dist.ReduceOp.MAX)[0]

    # ------------------------------------------------------------ checkpoint
    def checkpoint(self, **kw) -> int:
        """Commit the group's next epoch in this rank's log, then wait for every
        rank to have committed it; returns it (the new group epoch).  A peer that
        died makes the collective raise (RuntimeError from torch.distributed)."""
        import torch.distributed as dist

        epoch = self.commit_alone(**kw)
        got = self._reduce([epoch], dist.ReduceOp.MIN)[0]
        if got != epoch:
            raise SessionError(f"rank {self.rank}: epoch {epoch} committed here, the group reached {got}")
        self.group_epoch = epoch
        return epoch

    def commit_alone(self, **kw) -> int:
        """Commit the group's next epoch in this rank's log, without the
        collective that tells the group (`checkpoint` is this and then the
        collective; a rank that dies between the two leaves an epoch only it
        committed, which the crash tests make on purpose)."""
        if self._next is None:
            self._agree_next()
        epoch = self._next
        local = self._local_next()
        if local > epoch:
            raise SessionError(f"rank {self.rank}: the log's next epoch {local} is above the group's {epoch}",
                               hint="call rejoin() so that the ranks agree on the numbering again")
        self.session.region_set.next_epoch = epoch  # the session takes max(this, the log's next), == epoch here
        stats = self.session.checkpoint(**kw)
        if stats.epoch != epoch:
            raise SessionError(f"rank {self.rank}: committed epoch {stats.epoch}, the group's is {epoch}")
        self._next = epoch + 1
        return epoch

    # ------------------------------------------------------------ recovery
    def agree(self, comm=None) -> int:
        """The newest epoch every rank's log commits, found over `comm` (rounds of
        all-reduce MIN; the same answer as `group_epoch` over the logs)."""
        import torch.distributed as dist

        if comm is not None:
            self.comm = comm
        mine = committed_epochs(self.session.log)
        cand, prev = max(mine, default=0), None
        while True:  # every rank sees the same sequence of results: the same number of rounds
            offer = max((e for e in mine if e <= cand), default=0)
            got = self._reduce([offer], dist.ReduceOp.MIN)[0]
            if got == prev:
                return got
            cand = prev = got

    def rejoin(self, comm=None, *, replacement: bool = False, changed: bool = False) -> RejoinStats:
        """Bring this rank to the group epoch after the group re-formed on `comm`
        (module docstring, Recovery).  replacement: this process starts from its
        rank's log.  changed: a survivor wrote its regions after its last commit."""
        t0 = time.perf_counter()
        G = self.agree(comm)
        t1 = time.perf_counter()
        if G == 0:
            raise NothingToRecoverError(f"rank {self.rank}: the ranks' logs share no committed epoch")
        if replacement:
            why = "replacement"
        elif changed or self.session.epoch != G:
            why = "ahead"
        else:
            why = "kept"
        if why != "kept":
            self.session.recover(G, into="registered")
        t2 = time.perf_counter()
        self._agree_next()
        self.group_epoch = G
        return RejoinStats(G, why != "kept", why, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
