"""What a checkpoint did (`CheckpointStats`) and what a session's checkpoints
did together (`CheckpointTotals`)."""

from __future__ import annotations

import copy
import dataclasses


class CheckpointStats:
    """What one checkpoint did.  Times in milliseconds.

    epoch, reason
    pages          region name -> pages written
    base           regions written whole (first checkpoint in this log)
    bytes          payload bytes written
    log_bytes      record bytes written (headers and tables included)
    detect_ms, stage_ms, commit_ms
    via            region name -> path (module docstring)
    device_reads   host waits on the device in the extent pipeline
    table_pass     one pass over the region table took every region (checkpoint package)
    executor       "host" (the caller's thread ran the epoch) or "resident" (the
                   session's executor did: `concordia.executor.resident`)
    coalesced      the log could not take the epoch now and the checkpoint was
                   asked to coalesce (`Session.checkpoint(on_full="coalesce")`):
                   nothing was written or committed, `epoch` is None, `pages`
                   and `base` are empty, and the pages stay dirty, so the next
                   checkpoint that commits carries them (`to_json` has the
                   key only then)
    pending        the epoch was queued on the device and not yet waited for
                   (`Session.checkpoint(wait=False)`): `epoch` is its number,
                   the other fields are zero until the session commits it (its
                   next call), when they are filled in place and this turns
                   False (`to_json` has the key only while True)

    A table pass hands over its names and per-region counts (`of_table`):
    `pages` and `via` are built from them when first read, so a checkpoint
    of many regions does no Python per region for its statistics."""

    _FIELDS = ("epoch", "reason", "pages", "base", "bytes", "log_bytes", "detect_ms", "stage_ms", "commit_ms",
               "via", "device_reads", "table_pass", "executor", "coalesced")
    __slots__ = ("epoch", "reason", "_pages", "base", "bytes", "log_bytes", "detect_ms", "stage_ms", "commit_ms",
                 "_via", "device_reads", "table_pass", "executor", "coalesced", "_lazy", "pending", "log_at",
                 "listed")

    def __init__(self, epoch: int, reason: str, pages: dict, base: list, bytes: int, log_bytes: int,
                 detect_ms: float, stage_ms: float, commit_ms: float, via: dict | None = None,
                 device_reads: int = 0, table_pass: bool = False):
        self.epoch, self.reason, self._pages, self.base = epoch, reason, pages, base
        self.bytes, self.log_bytes = bytes, log_bytes
        self.detect_ms, self.stage_ms, self.commit_ms = detect_ms, stage_ms, commit_ms
        self._via = {} if via is None else via
        self.device_reads, self.table_pass = device_reads, table_pass
        self.executor = "host"
        self.coalesced = False
        self._lazy = None
        self.pending = False
        #: (LSN where the epoch's records begin, LSN of its commit) when the
        #: session took on a commit written before the appender's last one
        #: (an arena's: checkpoint/arena.py), else None (the appender's last)
        self.log_at = None
        #: already in `Session.checkpoints` when the session takes its epoch on
        #: (an arena epoch of the resident executor's route, listed when it returned)
        self.listed = False

    @classmethod
    def of_table(cls, epoch, reason, names, counts, label, nbytes, log_bytes, detect_ms, stage_ms, commit_ms,
                  device_reads) -> "CheckpointStats":
        """The statistics of a table pass: `names` (kept, never changed) and
        `counts` (an integer array of the pass, one per name) become `pages`
        and `via` (every region `label`) when first read."""
        st = cls(epoch, reason, None, [], nbytes, log_bytes, detect_ms, stage_ms, commit_ms, None, device_reads, True)
        st._via = None
        st._lazy = (names, counts, label)
        return st

    @classmethod
    def of_coalesced(cls, reason: str, detect_ms: float = 0.0) -> "CheckpointStats":
        """The statistics of a checkpoint that coalesced: no epoch, nothing written."""
        st = cls(None, reason, {}, [], 0, 0, detect_ms, 0.0, 0.0)
        st.coalesced = True
        return st

    @classmethod
    def of_pending(cls, epoch: int, reason: str, detect_ms: float) -> "CheckpointStats":
        """The statistics of an epoch queued on the device, filled by `settle`."""
        st = cls(epoch, reason, {}, [], 0, 0, detect_ms, 0.0, 0.0, None, 0, True)
        st.pending = True
        return st

    def settle(self, done: "CheckpointStats") -> None:
        """The queued epoch committed: take what its pass did (`done`)."""
        for f in self.__slots__:
            setattr(self, f, getattr(done, f))
        self.pending = False

    def _build(self) -> None:
        names, counts, label = self._lazy
        self._pages = dict(zip(names, counts.tolist()))
        self._via = dict.fromkeys(names, label)
        self._lazy = None

    @property
    def pages(self) -> dict:
        if self._lazy is not None:
            self._build()
        return self._pages

    @pages.setter
    def pages(self, value: dict) -> None:
        if self._lazy is not None:
            self._build()
        self._pages = value

    @property
    def via(self) -> dict:
        if self._lazy is not None:
            self._build()
        return self._via

    @via.setter
    def via(self, value: dict) -> None:
        if self._lazy is not None:
            self._build()
        self._via = value

    def page_counts(self) -> tuple | None:
        """(names, counts) of a table pass (a list, and an integer array of the
        pages each region wrote) without building `pages`; None otherwise."""
        return None if self._lazy is None else self._lazy[:2]

    @property
    def total_ms(self) -> float:
        return self.detect_ms + self.stage_ms + self.commit_ms

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._FIELDS)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None

    def __repr__(self) -> str:
        return "CheckpointStats(" + ", ".join(f"{f}={v!r}" for f, v in zip(self._FIELDS, self._values())) + ")"

    def to_json(self) -> dict:
        """Every field and total_ms; "coalesced" only for a checkpoint that
        coalesced (the keys of one that committed stay as they were)."""
        d = {f: copy.deepcopy(v) for f, v in zip(self._FIELDS, self._values()) if f != "coalesced" or v}
        if self.pending:
            d["pending"] = True
        d["total_ms"] = self.total_ms
        return d


@dataclasses.dataclass
class CheckpointTotals:
    """Every checkpoint of a session, summed (`Session.checkpoint_totals`):
    how many committed, payload bytes and record bytes written, and how many
    coalesced instead (`CheckpointStats.coalesced`: not in `count`)."""

    count: int = 0
    bytes: int = 0
    log_bytes: int = 0
    coalesced: int = 0

    def add(self, stats: CheckpointStats) -> None:
        if stats.coalesced:
            self.coalesced += 1
            return
        self.count += 1
        self.bytes += stats.bytes
        self.log_bytes += stats.log_bytes
