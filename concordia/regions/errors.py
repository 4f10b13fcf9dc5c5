"""The runtime's errors: the Session API, recovery, the standby and the demo.

They live in the lowest room of the runtime that raises them (a region is
refused at `register`), so that every room above raises them without
importing up, and `concordia.errors` (the public face, which nothing inside
the package imports) can list them without loading any runtime code.  Each
renders as one line (`where: message (hint)`, `concordia.root_error`).
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class SessionError(ConcordiaError):
    """The Session API was used wrongly or met state it cannot accept."""


class SessionClosedError(SessionError):
    """The session was closed; open a new one on the same log."""


class UnsupportedArrayError(SessionError):
    """The object is not a numpy array, CuPy array or DLPack tensor Concordia can protect."""


class DuplicateRegionError(SessionError):
    """A region of this name is already registered in this session."""


class UnknownRegionError(SessionError):
    """No region of this name is registered (or present in the log)."""


class ShapeChangedError(SessionError):
    """A registered array changed shape, dtype or storage since it was registered."""


class RegionMismatchError(SessionError):
    """The log already holds a region of this name with other attributes
    (typically a log written by another program)."""


class RecoverMismatchError(SessionError):
    """An array given to recover into does not match the region in the log."""


class NothingToRecoverError(SessionError):
    """The log holds no committed epoch (or not the one asked for)."""


class RecoveryDigestError(SessionError):
    """Recovered bytes do not match the digest committed for the epoch."""


class StandbyError(ConcordiaError):
    """A standby could not watch or take over a log (exit code 2)."""


class TakeoverRevoked(StandbyError):
    """An early takeover's epoch was not the one the log decided once the
    writer lock was held (`Takeover.confirm`): what was made from it is void.
    `Standby.run` then restores the decided epoch and resumes again."""

    def __init__(self, message: str, *, log=None, epoch: int = 0, decided: int = 0, **kw):
        super().__init__(message, **kw)
        self.log, self.epoch, self.decided = log, epoch, decided


class DemoError(SessionError):
    """The demo's worker or recovery process failed."""


class LogPressureWarning(ConcordiaError, RuntimeWarning):
    """A warning, not raised: checkpoints asked to coalesce under log pressure
    (`Session.checkpoint(on_full="coalesce")`) found the log too full for
    their epoch, so their pages wait for the next one.  Issued once per run
    of such checkpoints; it renders as one line like every error."""


__all__ = ["SessionError", "SessionClosedError", "UnsupportedArrayError", "DuplicateRegionError",
           "UnknownRegionError", "ShapeChangedError", "RegionMismatchError", "RecoverMismatchError",
           "NothingToRecoverError", "RecoveryDigestError", "StandbyError", "TakeoverRevoked", "DemoError",
           "LogPressureWarning"]
