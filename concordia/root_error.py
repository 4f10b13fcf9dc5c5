"""The root of Concordia's error hierarchy, below every layer.

This module imports nothing, so every layer (devmem at the bottom, then wal,
gpu_kernels, the runtime and the command line) derives its errors from
`ConcordiaError` without importing anything above itself.  `concordia.errors`
is where a user finds every class; the command line maps them to exit codes.

Every error renders as one line.  `where` names the place ("segment 3 @ 0x1a040",
a path, a device) and `hint` a remedy; both are optional.
"""

from __future__ import annotations

__all__ = ["ConcordiaError", "MissingDependencyError"]


class ConcordiaError(Exception):
    """Base class of every error Concordia raises on purpose."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f" ({self.hint})"
        return " ".join(text.split())  # never more than one line


class MissingDependencyError(ConcordiaError, ImportError):
    """A package Concordia needs is not installed (also an ImportError)."""

    def __init__(self, package: str, *, needed_by: str):
        super().__init__(f"needs the {package!r} package, which is not installed", where=needed_by,
                         hint=f"pip install {package}")
        self.name = package
