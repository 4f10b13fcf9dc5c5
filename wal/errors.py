"""Errors of the write-ahead log.

Every corruption names where it is (`segment N @ 0xOFFSET`, the offset inside
the backend mapping) and what was expected, so a person can find the bytes.
Which of them a command line reports as "problems found in the data" (exit 1)
is mapped in the command line (`concordia.tools.common.PROBLEMS_FOUND`).
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class WalError(ConcordiaError):
    """Something about a log is wrong or was used wrongly."""


class CorruptionError(WalError):
    """Bytes on media fail a validity condition of FORMAT.md."""


class TornTailError(CorruptionError):
    """The end of the log holds a partly written record (ABSOLUTE mode refuses it)."""


class ChainError(CorruptionError):
    """A segment's header does not name the segment before it (FORMAT.md §4, V-S5)."""


class SuperblockError(CorruptionError):
    """Neither superblock slot is valid."""


class NotALogError(WalError):
    """The target holds no Concordia volume (no superblock magic)."""


class TargetNotEmptyError(WalError):
    """Formatting would destroy what the target holds (a log, or any nonzero
    byte): refused, and the target left as it was, unless overwriting is asked for."""


class FormatVersionError(WalError):
    """The volume needs a major version or an incompatible feature this code lacks."""


class ReadOnlyFeatureError(FormatVersionError):
    """The volume carries a ro-compat feature this code lacks: it may be read, not written."""


class LogFullError(WalError):
    """No free segment is left to roll over into (compaction reclaims segments)."""


class RecordTooLargeError(WalError):
    """A record cannot fit in one segment."""


class PlanError(WalError):
    """The target cannot be planned (not committed, older than retention, no such region)."""


class AbsentRegionError(PlanError):
    """A region asked for has no state at the recovery's epoch: nothing of it is
    committed at or before it (it was registered later).  Refused, rather than
    restored as zeros, before anything is written."""


class RegionError(WalError):
    """A region is unknown, or defined twice with different attributes."""


class UsageError(WalError):
    """An API was called out of order (e.g. commit with reservations unfinished)."""


class WriterStoppedError(WalError):
    """A sync (or a roll over) failed earlier: what reached the media is unknown,
    so the writer refuses to append anything more; reopening the log recovers
    every commit that is whole on the media."""


__all__ = [
    "WalError",
    "CorruptionError",
    "TornTailError",
    "ChainError",
    "SuperblockError",
    "NotALogError",
    "TargetNotEmptyError",
    "FormatVersionError",
    "ReadOnlyFeatureError",
    "LogFullError",
    "RecordTooLargeError",
    "PlanError",
    "AbsentRegionError",
    "RegionError",
    "UsageError",
    "WriterStoppedError",
]
