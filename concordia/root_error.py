"""The root of Concordia's error hierarchy, below every layer.

This module imports nothing, so every layer (devmem at the bottom, then wal,
gpu_kernels, the runtime and the command line) derives its errors from
`ConcordiaError` without importing anything above itself.  `concordia.errors`
is where a user finds every class; the command line maps them to exit codes.

Every error renders as one line.  `where` names the place ("segment 3 @ 0x1a040",
a path, a device) and `hint` a remedy; both are optional.

A remedy that names a knob names it as the interface in use spells it: a
Python caller passes `create=True`, a person at a shell types `--force`.  Such
a hint is a `Hint`, which carries both wordings; an error picks one when it is
rendered, by the interface in force (`interface()`): "api" unless a command
line has said otherwise with `speaking("cli")` for the length of a command.
A hint that names nothing of either interface stays a plain string.
"""

from __future__ import annotations

__all__ = ["API", "CLI", "ConcordiaError", "Hint", "MissingDependencyError", "interface", "speaking"]

#: the interfaces a hint is worded for: the Python API and the command lines
API = "api"
CLI = "cli"

_interface = API  # what `interface()` says; changed only by `speaking`


def interface() -> str:
    """The interface errors are rendered for right now: API or CLI."""
    return _interface


class speaking:
    """`with speaking(CLI): ...` renders every error's hint in the command
    line's words until the block ends (the command lines wrap each command in
    it); the interface before is put back afterwards, also on an exception."""

    def __init__(self, which: str):
        if which not in (API, CLI):
            raise ValueError(f"an interface is {API!r} or {CLI!r}, not {which!r}")
        self.which = which
        self._before: list[str] = []

    def __enter__(self) -> "speaking":
        global _interface
        self._before.append(_interface)
        _interface = self.which
        return self

    def __exit__(self, *exc) -> None:
        global _interface
        _interface = self._before.pop()


class Hint:
    """A remedy worded once for each interface: `api` names the Python
    arguments (`pass create=True`), `cli` the command-line options or
    commands (`pass --force`).  `text()` is the wording of the interface in
    force; `str(hint)` is the same."""

    __slots__ = ("api", "cli")

    def __init__(self, api: str, cli: str):
        self.api = api
        self.cli = cli

    def text(self, which: str | None = None) -> str:
        return self.cli if (which or _interface) == CLI else self.api

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"Hint(api={self.api!r}, cli={self.cli!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Hint) and (self.api, self.cli) == (other.api, other.cli)

    def __hash__(self) -> int:
        return hash((self.api, self.cli))


class ConcordiaError(Exception):
    """Base class of every error Concordia raises on purpose.

    hint: a plain string, or a `Hint` when the remedy names a knob that the
    Python API and the command lines spell differently."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | Hint | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self, which: str | None = None) -> str:
        """`where: message (hint)` on one line, the hint in the words of
        interface `which` (default: the one in force, `interface()`)."""
        text = f"{self.where}: {self.message}" if self.where else self.message
        hint = self.hint.text(which) if isinstance(self.hint, Hint) else self.hint
        if hint:
            text += f" ({hint})"
        return " ".join(text.split())  # never more than one line

    def __str__(self) -> str:
        # rendered when asked for, not when raised: the interface that shows
        # the error decides the hint's words, and a `where` filled in later counts
        return self.one_line()


class MissingDependencyError(ConcordiaError, ImportError):
    """A package Concordia needs is not installed (also an ImportError)."""

    def __init__(self, package: str, *, needed_by: str):
        super().__init__(f"needs the {package!r} package, which is not installed", where=needed_by,
                         hint=f"pip install {package}")
        self.name = package
