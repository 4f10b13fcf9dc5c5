"""What a log commits, and what recovery of it restores: the one decision
(FORMAT.md §11.1, rules R-D1..R-D8) that every consumer reports in its own
words: `Log.open` and `Session.recover` (through `reader.recover` and the
planner), `concordia-wal verify`, `info`, `dump`, `recover --plan`,
`restore`, `compact` and `snapshot`.

Two layers, each a single function:

* `reader.recover` walks the log and settles, record by record, what is a
  torn tail and what is corruption, which commits count (V-C2..V-C4, the
  dropped ONE_SYNC commit of §10.4b), which records lie below `oldest_lsn`,
  and which page batches disagree with their region descriptor (R-P1);
* `planner.plan_history`, over a `History` built from that result (never
  from a walk of its own), decides which records each region's recovery
  applies at a target in a mode, with the base-snapshot fallback of V-K2.

`decide()` runs both and turns the answer into an `Outcome`: the epoch
recovery restores (per region), why it refuses, the problems that count in
the mode, and the exit code every command line uses for it (R-D8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .modes import CLI_MODES, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, MODES, RecoveryMode, counts


@dataclass
class Outcome:
    """What recovery of a log in a mode restores, as every consumer reports it.

    epoch: the epoch every asked region restores to (the newest a region
    reaches, for SKIP_CORRUPT), None when recovery refuses (`error` says why)
    or nothing is committed.  last_commit: the newest committed epoch of the
    log.  regions: {name: epoch or None (given up, or absent at its epoch:
    `absent`)}.  problems: the reader's Dropped
    ranges that count in the mode (R-D7).  plan / history: the planner's
    objects, for a consumer that goes on to restore."""

    mode: RecoveryMode
    epoch: int | None
    last_commit: int
    regions: dict = field(default_factory=dict)
    error: str | None = None
    problems: list = field(default_factory=list)
    dropped: list = field(default_factory=list)  # every Dropped range the reader reported
    plan: object = None
    history: object = None
    exception: object = None  # what the planner raised, when it refused

    def raise_usage(self) -> None:
        """Re-raise a refusal that is about what was asked (a target never
        committed, a region that does not exist: exit 2), not about damage."""
        from .planner import PlanError

        if isinstance(self.exception, PlanError) and not self.problems:
            raise self.exception

    @property
    def complete(self) -> bool:
        """Every asked region restores the last commit (or the asked target)."""
        want = self.target_epoch
        return (self.error is None and self.epoch is not None and bool(self.regions) and
                all(e == want for e in self.regions.values()))

    @property
    def absent(self) -> list:
        """The planned regions with no state at their epoch (`RegionPlan.absent`):
        a restore refuses them, so the outcome is incomplete (exit 1)."""
        return list(self.plan.absent.values()) if self.plan is not None else []

    @property
    def target_epoch(self) -> int | None:
        p = self.plan
        if p is not None and isinstance(p.target, int):
            return p.target
        return self.last_commit or None

    @property
    def exit_code(self) -> int:
        """R-D8: 0 only when nothing that counts was found and every asked
        region restores its target; 1 otherwise."""
        if self.problems or self.error is not None:
            return EXIT_PROBLEMS
        if self.last_commit == 0 and not self.regions:
            return EXIT_OK  # an empty log restores what it holds: nothing
        return EXIT_OK if self.complete else EXIT_PROBLEMS

    def to_json(self) -> dict:
        return {"mode": self.mode.value, "epoch": self.epoch, "last_commit": self.last_commit,
                "regions": dict(self.regions), "error": self.error,
                "problems": len(self.problems), "exit_code": self.exit_code}


def decide(log, mode=None, *, target="latest", regions=None, check_pages: bool = True,
           progress=None, walk: list | None = None, history=None, payload: bool = False) -> Outcome:
    """The decision for `log` (an open Log or Volume) in `mode` at `target`.
    Never raises for damage: a refusal is `Outcome.error`.  check_pages=True
    (the default, and what every command line uses) checks every page CRC
    before deciding, so the planner's fallback and the applier meet the same
    damage (R-D5).  `history`: a History already scanned with the same
    check_pages (it holds the reader's result)."""
    from .errors import ConcordiaError
    from .planner import plan_history, scan

    mode = RecoveryMode.parse(mode)
    h = history if history is not None else scan(log, payload=payload, check_pages=check_pages,
                                                 progress=progress, walk=walk)
    res = h.result
    dropped = list(res.dropped) if res is not None else []
    problems = [d for d in dropped if counts(d.kind, mode)]
    last = res.last_committed_epoch if res is not None else max(h.commits, default=0)
    out = Outcome(mode, None, last, problems=problems, dropped=dropped, history=h)
    past = h.floor_past_last()
    if past is not None:
        out.error = past
        return out
    if not h.committed_epochs() and target in (None, "latest") and not problems:
        return out  # nothing committed, nothing damaged: recovery restores nothing, cleanly
    try:
        p = plan_history(h, target, mode, regions=regions)
    except ConcordiaError as exc:
        out.error = exc.one_line()
        out.exception = exc
        return out
    out.plan = p
    # a region with no state at its epoch (registered after it) restores nothing: None, as a given-up one
    out.regions = {n: None if rp.absent else rp.epoch for n, rp in p.regions.items()}
    asked = list(regions) if regions is not None else [r.name for r in h.regions.values()]
    for n in asked:
        out.regions.setdefault(n, None)
    reached = [e for e in out.regions.values() if e is not None]
    if mode is RecoveryMode.SKIP_CORRUPT:
        out.epoch = max(reached) if reached else None
    else:
        out.epoch = p.epoch or None
    # a region left None (SKIP_CORRUPT: nothing of it is whole) makes the outcome incomplete (exit 1)
    return out


__all__ = ["RecoveryMode", "MODES", "CLI_MODES", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE",
           "counts", "Outcome", "decide"]
