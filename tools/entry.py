"""The installed `concordia` and `concordia-wal` commands.

The command modules import the whole library (numpy, crc32c, click: a second
or more on a loaded machine), so two things are settled here, before those
imports start, with nothing but the standard library:

* Ctrl-C.  `interrupted` is how every command ends on an interrupt: the one
  line `error: interrupted` on stderr and exit 130, never a traceback, during
  the imports as much as during the work.  The first SIGINT stops the
  command (KeyboardInterrupt, which unwinds through every cleanup: temporary
  files removed, a benchmark's logs deleted); later ones are ignored, so that
  the cleanup is not cut short.  A SIGINT that was ignored when the process
  started (a background job) stays ignored.
* SIGTERM (`timeout`, a service manager's stop, `kill`) ends a command the
  same way: it unwinds through the same cleanups (a benchmark's scratch logs
  in /dev/shm are removed, a half-written output is dropped), then the one
  line `error: terminated` and exit 143 (128 + SIGTERM), as a shell reports
  a command ended by it.  Once either signal has landed, both are ignored
  until the command ends.  A SIGTERM that was ignored, or that the program
  embedding the command handles itself, is left as it was.
* A missing package.  Every command needs the packages the library depends
  on (`crc32c` for the log's checksums, numpy, ...), most of them only once
  the command runs, when a plain import would end in a traceback midway.  The
  commands and the library's format module (which loads each of them) are
  imported inside a guard, before anything runs, so a missing package is one
  line naming it and exit code 2, like any other usage error, for every
  command and its --help alike.
"""

from __future__ import annotations

import importlib
import signal
import sys

__all__ = ["concordia", "concordia_wal", "interrupted", "was_interrupted", "EXIT_INTERRUPTED", "EXIT_TERMINATED",
           "Terminated"]

EXIT_USAGE = 2  # tools.common.EXIT_USAGE, which cannot be imported without the library
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM

_stopped_by: list[int] = []  # the signal that stopped the command, once one has


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was, so that it unwinds as Ctrl-C
    does (every `except KeyboardInterrupt` that cleans up runs for it too)."""


def interrupted() -> None:
    """End the command after Ctrl-C (one line on stderr, exit 130) or
    SIGTERM (`error: terminated`, exit 143)."""
    term = bool(_stopped_by) and _stopped_by[0] == signal.SIGTERM
    try:
        sys.stderr.write("error: terminated\n" if term else "error: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    sys.exit(EXIT_TERMINATED if term else EXIT_INTERRUPTED)


def was_interrupted(exc: BaseException | None) -> bool:
    """Whether `exc` is a KeyboardInterrupt or was raised while one unwound
    (a cleanup that failed because the work under it was cut short, say a
    log closed with a reservation still open): either way the command was
    interrupted, and says so, rather than reporting what the cleanup tripped on."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _stop(signum: int) -> None:
    # the first of Ctrl-C and SIGTERM stops the command; the cleanup it unwinds through runs to its end
    _stopped_by.append(signum)
    for sig, handler in _installed.items():
        if signal.getsignal(sig) is handler:
            signal.signal(sig, signal.SIG_IGN)


def _on_sigint(signum, frame):
    _stop(signum)
    raise KeyboardInterrupt


def _on_sigterm(signum, frame):
    _stop(signum)
    raise Terminated


_installed = {signal.SIGINT: _on_sigint, signal.SIGTERM: _on_sigterm}


def _catch_interrupts() -> None:
    """Install `_on_sigint` where SIGINT has Python's own handler, and
    `_on_sigterm` where SIGTERM has the default action (not where either was
    ignored at start, nor where an embedding program set another)."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread of the main interpreter
        pass


def _run(program: str, module: str) -> None:
    _catch_interrupts()
    try:
        try:
            main = importlib.import_module(module, __package__).main
            importlib.import_module("concordia.wal.format")  # numpy and crc32c: what every command needs
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if not missing or missing == "concordia":
                raise
            print(f"{program}: error: needs the {missing!r} package, which is not installed "
                  f"(pip install {missing})", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        main()
    except KeyboardInterrupt:
        interrupted()


def concordia() -> None:
    """`concordia`: the demo and the standby."""
    _run("concordia", ".cli")


def concordia_wal() -> None:
    """`concordia-wal`: inspect, verify, recover, restore, compact, bench."""
    _run("concordia-wal", ".wal_cli")
