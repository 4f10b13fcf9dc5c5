"""The recovery modes (FORMAT.md §11): the one mode type the library, the
planner and the command lines use, and what counts as a problem in each
(R-D7) and the exit codes (R-D8).  Kept apart from `decide`, which runs the
reader and the planner, so that both of those can use the type."""

from __future__ import annotations

import enum

from concordia.root_error import Hint


class RecoveryMode(enum.Enum):
    """What a reader does with damaged ranges (FORMAT.md §11; RocksDB's WAL
    recovery modes).  The one mode type: the library, the planner and the
    command lines (`cli`, with dashes) all use it."""

    TOLERATE_TAIL = "tolerate_tail"  # drop a torn tail; corruption before a commit is an error
    ABSOLUTE = "absolute"  # any damage is an error
    POINT_IN_TIME = "point_in_time"  # stop at the first damage, drop the rest
    SKIP_CORRUPT = "skip_corrupt"  # skip damaged ranges, keep reading

    @property
    def cli(self) -> str:
        """The command lines' spelling (`tolerate-tail`)."""
        return self.value.replace("_", "-")

    @property
    def refusal_hint(self) -> Hint:
        """The hint of every refusal of damage in this mode (the reader's and
        the planner's), naming the mode as the interface in use spells it:
        `mode='point_in_time'` for a Python caller, `--mode point-in-time` at
        a command line."""
        if self is RecoveryMode.ABSOLUTE:
            return Hint(api="mode='absolute' accepts no damage", cli="--mode absolute accepts no damage")
        return Hint(api="recover with mode='point_in_time' or 'skip_corrupt' to fall back",
                    cli="use --mode point-in-time or --mode skip-corrupt to fall back")

    @classmethod
    def parse(cls, value) -> "RecoveryMode":
        """A member from a member, its value, its name or its command-line
        spelling (any case, '-' or '_'); None is the default, TOLERATE_TAIL."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls.TOLERATE_TAIL
        key = str(getattr(value, "value", value)).strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            from .errors import UsageError
            raise UsageError(f"unknown recovery mode {value!r}; use one of "
                             f"{', '.join(m.value for m in cls)}") from None


_ALIASES = {"tolerate": "tolerate_tail", "tail": "tolerate_tail", "pit": "point_in_time",
            "point": "point_in_time", "skip": "skip_corrupt", "skip_any_corrupted": "skip_corrupt"}

#: the modes' values, and as the command lines spell them
MODES = tuple(m.value for m in RecoveryMode)
CLI_MODES = [m.cli for m in RecoveryMode]

#: exit codes (R-D8), the same for every command
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def counts(kind: str, mode) -> bool:
    """R-D7: whether a reported range is a problem under `mode`: corruption,
    a damaged segment, a bad superblock slot and truncated media always; a
    torn tail only in ABSOLUTE mode; an uncommitted epoch never (it is what a
    crash between checkpoints leaves)."""
    if kind in ("corrupt", "superblock", "segment", "truncated"):
        return True
    if kind == "torn":
        return RecoveryMode.parse(mode) is RecoveryMode.ABSOLUTE
    return False
