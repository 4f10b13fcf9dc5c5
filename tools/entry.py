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
  a command ended by it (`timeout` itself exits 124 unless given
  --preserve-status).  Once either signal has landed, both are let go until
  the command ends (`stopping`).  A SIGTERM that was ignored, or that the
  program embedding the command handles itself, is left as it was, and a
  command that returns puts back the handlers it replaced.  `dump --follow`
  ends on either as on its normal end (exit 0); `standby --hold` gives its
  log back on SIGTERM (exit 0).
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

__all__ = ["concordia", "concordia_wal", "interrupted", "was_interrupted", "stopping", "EXIT_INTERRUPTED",
           "EXIT_TERMINATED", "Terminated"]

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


def _after_stop(signum, frame):
    """A Ctrl-C or SIGTERM that lands once the command is stopping: let go,
    so that the cleanup runs to its end.  A handler that does nothing rather
    than SIG_IGN: a signal already pending when its handler changes is still
    handled without error, and a child started during the cleanup starts with
    the default action."""


def stopping(signum: int) -> KeyboardInterrupt:
    """Record that `signum` (SIGINT or SIGTERM) stops the command, let every
    later one of the two go (`_after_stop`, where this module's handler or
    the caller's for `signum` is installed) and return what to raise:
    `Terminated` for SIGTERM, KeyboardInterrupt for SIGINT.  When both land
    together, Python runs SIGINT's handler first, and the command says
    `interrupted`.  For a command with a handler of its own (`bench
    standby`'s), so that it ends as every other does."""
    _stopped_by.append(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig == signum or signal.getsignal(sig) in (_on_sigint, _on_sigterm):
            signal.signal(sig, _after_stop)
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _on_sigint(signum, frame):
    raise stopping(signum)


def _on_sigterm(signum, frame):
    raise stopping(signum)


def _catch_interrupts() -> dict:
    """Install `_on_sigint` where SIGINT has Python's own handler, and
    `_on_sigterm` where SIGTERM has the default action (not where either was
    ignored at start, nor where an embedding program set another).  Returns
    the handlers replaced, {signal: handler}."""
    replaced = {}
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            replaced[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            replaced[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread of the main interpreter
        pass
    return replaced


def _put_back(replaced: dict) -> None:
    """The handlers `_catch_interrupts` replaced, back where the command
    left its own in place (a program that runs a command in-process gets its
    signals back).  Not after a stop: the signals stay let go until the end."""
    if _stopped_by:
        return
    for sig, old in replaced.items():
        if signal.getsignal(sig) in (_on_sigint, _on_sigterm):
            signal.signal(sig, old)


def _run(program: str, module: str) -> None:
    del _stopped_by[:]
    replaced = _catch_interrupts()
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
    finally:
        _put_back(replaced)


def concordia() -> None:
    """`concordia`: the demo and the standby."""
    _run("concordia", ".cli")


def concordia_wal() -> None:
    """`concordia-wal`: inspect, verify, recover, restore, compact, bench."""
    _run("concordia-wal", ".wal_cli")
