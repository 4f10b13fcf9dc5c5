"""Every error Concordia raises, in one place.

The classes live beside the code that raises them (`concordia.devmem.errors`,
`concordia.wal.errors`, ...); this module re-exports them all and adds the
errors of the `Session` API.  Every one renders as a single line
(`where: message (hint)`).
"""

from __future__ import annotations

from concordia.devmem.errors import *  # noqa: F401,F403
from concordia.devmem.errors import ConcordiaError

try:  # the log's errors; absent only while the log package is incomplete
    from concordia.wal.errors import *  # noqa: F401,F403
except ImportError:  # pragma: no cover
    pass

for _mod in ("concordia.gpu_kernels.errors", "concordia.executor.errors", "concordia.instrument.errors"):
    try:
        _m = __import__(_mod, fromlist=["*"])
    except ImportError:  # pragma: no cover - optional parts
        continue
    globals().update({k: v for k, v in vars(_m).items()
                      if isinstance(v, type) and issubclass(v, ConcordiaError)})
del _mod


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

    exit_code = 1


class RecoverMismatchError(SessionError):
    """An array given to recover into does not match the region in the log."""


class NothingToRecoverError(SessionError):
    """The log holds no committed epoch (or not the one asked for)."""

    exit_code = 1


class RecoveryDigestError(SessionError):
    """Recovered bytes do not match the digest committed for the epoch."""

    exit_code = 1


class DemoError(SessionError):
    """The demo's worker or recovery process failed."""
