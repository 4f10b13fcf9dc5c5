"""The instrumentation error class.

`InstrumentError` derives from the project root `ConcordiaError`, like the
executor's errors; `concordia.errors` re-exports it with the rest of the
hierarchy.  It is defined here, not imported from `concordia.errors`: that
module imports this one, so either import order must give the same class.
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class InstrumentError(ConcordiaError):
    """PTX could not be parsed or rewritten, or a hook could not be installed."""


__all__ = ["InstrumentError"]
