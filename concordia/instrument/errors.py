"""The instrumentation error class.

`concordia/errors.py` is meant to define `InstrumentError` (docs/internals.md,
"Errors"); until it does, the same class is defined here on the shared root so
every instrumentation failure is still a one-line `ConcordiaError`.
"""

from __future__ import annotations

try:  # the project-wide definition, once concordia/errors.py carries it
    from concordia.errors import InstrumentError  # type: ignore[attr-defined]
except Exception:  # stand-in until then; same base, same rendering
    from concordia.devmem.errors import ConcordiaError

    class InstrumentError(ConcordiaError):  # type: ignore[no-redef]
        """PTX could not be parsed or rewritten, or a hook could not be installed."""


__all__ = ["InstrumentError"]
