"""What every command line shares: the error boundary (library errors become
one line and an exit code, never a traceback), JSON output and size parsing,
and how an output file is named and written (`check_outputs`, `write_output`).

Exit codes: 0 clean, 1 problems found in the data, 2 usage or I/O error,
130 interrupted (`entry.interrupted`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import click

from concordia.regions.errors import NothingToRecoverError, RecoveryDigestError, RegionMismatchError
from concordia.root_error import CLI, ConcordiaError, speaking
from concordia.wal.errors import AbsentRegionError, CorruptionError, NotALogError
from concordia.sizes import parse_size
from concordia.wal.modes import CLI_MODES, RecoveryMode

from .entry import interrupted, was_interrupted

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
# and 130 (entry.EXIT_INTERRUPTED): Ctrl-C, handled before the library is even imported

# The library errors that mean "problems found in the data" (exit 1), with
# every subclass (TornTailError, ChainError, SuperblockError are corruptions);
# any other ConcordiaError is a usage or I/O error (exit 2).  The library's
# classes carry no exit codes: this table is the one place that maps them.
PROBLEMS_FOUND = (CorruptionError, NotALogError, RegionMismatchError, NothingToRecoverError, RecoveryDigestError,
                  AbsentRegionError)


def exit_code_of(exc: ConcordiaError) -> int:
    """The exit code a command line ends with when `exc` stops it."""
    return EXIT_PROBLEMS if isinstance(exc, PROBLEMS_FOUND) else EXIT_USAGE


class Where:
    """What a command is reading right now, so that an unexpected failure on
    damaged input can still be reported as one line naming the place.

    Commands set `target` once the log is opened and `at` ("segment N @ 0xOFF")
    while they walk it; `data` says the bytes were recognised as a log, which
    makes an unexpected failure a problem found in the data (exit 1) rather
    than an I/O or usage error (exit 2)."""

    target: str | None = None
    at: str | None = None
    data: bool = False

    @classmethod
    def reset(cls) -> None:
        cls.target = cls.at = None
        cls.data = False


_SIGBUS_GUARD = None  # the installed C-callable handler, kept alive while the process runs


def _on_sigbus(signum: int) -> None:
    place = Where.at or Where.target
    lead = f"{place}: " if place else ""
    line = (f"error: {lead}bus error (SIGBUS) on a mapped file: it was cut shorter, or its file "
            f"system is full or failing (check the file and free space, then run the command again)\n")
    try:
        os.write(2, line.encode("utf-8", "replace"))
    finally:
        os._exit(EXIT_USAGE)


def install_sigbus_guard() -> bool:
    """The last line of defence against SIGBUS, after every mapping the
    command lines make has been reserved or read safely: a C-level handler
    (through ctypes) that prints one line naming the place (`Where`) and ends
    the process with exit 2.  Python's own `signal` handlers cannot do this: they
    run after the faulting instruction, which faults again for ever, and
    `faulthandler` only prints a traceback before the process dies of the
    signal.  The handler never returns, so a fault cannot repeat; it is
    installed once, and not where faulthandler already holds the signal (a
    test run that wants tracebacks keeps them).  Returns whether it is in place."""
    global _SIGBUS_GUARD
    if _SIGBUS_GUARD is not None:
        return True
    import faulthandler

    if faulthandler.is_enabled():
        return False
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        proto = ctypes.CFUNCTYPE(None, ctypes.c_int)
        handler = proto(_on_sigbus)
        libc.signal.argtypes = [ctypes.c_int, proto]
        libc.signal.restype = ctypes.c_void_p
        if libc.signal(int(signal.SIGBUS), handler) == ctypes.c_void_p(-1).value:  # SIG_ERR
            return False
    except (OSError, AttributeError, ValueError):
        return False
    _SIGBUS_GUARD = handler
    return True


class OneLineGroup(click.Group):
    """A command group whose usage errors (an unknown option, a bad value, a
    missing argument) are one line and exit 2, like every other error, instead
    of click's usage block: `error: concordia-wal info: no such option: --nope
    (see concordia-wal info --help)`.  Subgroups made with `group()` inherit it."""

    group_class = type  # `@grp.group()` makes another OneLineGroup

    # Ctrl-C outside a command body (parsing, loading the benchmarks) is the
    # same one line and exit 130 as inside one (`guarded`): caught here, before
    # click would print a blank line and turn it into an Abort
    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            interrupted()

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            interrupted()
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort) as exc:
            if was_interrupted(exc):
                interrupted()
            raise

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare group: its help, as click gives it
            click.echo(exc.ctx.get_help(), err=True)
            sys.exit(EXIT_USAGE)
        except click.exceptions.UsageError as exc:
            path = exc.ctx.command_path if exc.ctx is not None else (prog_name or self.name)
            message = " ".join(exc.format_message().split())
            click.echo(f"error: {path}: {message} (see {path} --help)", err=True)
            sys.exit(EXIT_USAGE)
        except click.exceptions.ClickException as exc:
            click.echo(f"error: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:  # click's own Ctrl-C (or an aborted prompt)
            interrupted()
        # click returns the code of a ctx.exit() (--help, --version) and a command's return value
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else EXIT_OK)


def guarded(fn):
    """Run a click command body; turn any ConcordiaError or OSError into one line
    on stderr and the documented exit code.  Anything else that escapes (a
    library failing on bytes it did not expect) also becomes one line, naming
    the place being read, never a traceback.  A SIGBUS from a mapped file is
    one line and exit 2 as well (`install_sigbus_guard`).  Ctrl-C is exit 130
    and `error: interrupted`, also when a cleanup it unwound through failed in
    turn (`entry.was_interrupted`): the interrupt is what happened."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        Where.reset()
        install_sigbus_guard()
        try:
            with speaking(CLI):  # hints name the options a person types, not Python arguments
                return fn(*args, **kwargs)
        except SystemExit:  # the command's own exit code (a Ctrl-C it ends on by design included)
            raise
        except BaseException as exc:
            if was_interrupted(exc):
                interrupted()
            _end_with(exc)

    return wrapper


def _end_with(exc: BaseException) -> None:
    """End a command body that raised `exc` (not an interrupt): one line on
    stderr and the exit code (`guarded`); click's own exceptions go on to
    click, which already prints them as one line."""
    if isinstance(exc, (click.exceptions.ClickException, click.exceptions.Exit)):
        raise exc
    if isinstance(exc, ConcordiaError):
        if exc.where is None and (Where.at or Where.target):
            exc.where = Where.at or Where.target  # every error names a place
        click.echo(f"error: {exc.one_line(CLI)}", err=True)
        sys.exit(exit_code_of(exc))
    if isinstance(exc, BrokenPipeError):
        # `concordia-wal dump LOG | head`: the reader left; that is not an error
        _silence_stdout()
        sys.exit(EXIT_OK)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"error: {where}{exc.strerror or exc}", err=True)
        sys.exit(EXIT_USAGE)
    if not isinstance(exc, Exception):  # GeneratorExit and the like: not ours to report
        raise exc
    # the boundary: anything else (a library failing on bytes it did not
    # expect) is one line naming the place being read, never a traceback
    place = Where.at or Where.target
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    lead = f"{place}: " if place else ""
    what = "unreadable data" if Where.data else "unexpected failure"
    click.echo(f"error: {lead}{what} ({text})", err=True)
    sys.exit(EXIT_PROBLEMS if Where.data else EXIT_USAGE)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final
    flush does not complain."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def emit_json(obj) -> None:
    """Print one JSON document (stable key order; NaN and infinities as null)."""
    click.echo(json.dumps(_finite(obj), indent=2, sort_keys=False, allow_nan=False, default=_jsonable))


def _finite(o):
    """`o` with every non-finite float made None: strict JSON has no NaN, and a
    benchmark must not lose its figures to one undefined ratio."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if hasattr(o, "dtype") and hasattr(o, "item") and getattr(o, "ndim", 1) == 0:
        return _finite(o.item())
    return o


def _jsonable(o):
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (bytes, bytearray)):
        return o.hex()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class SizeType(click.ParamType):
    """A byte count (`concordia.sizes.parse_size`: 4096, 64M, 1GiB); with
    `positive`, 0 is refused (a benchmark's bytes, not an optional limit)."""

    name = "SIZE"

    def __init__(self, positive: bool = False):
        self.positive = positive

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        try:
            n = parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if self.positive and n <= 0:
            self.fail(f"{value!r} is no bytes: give a size above 0", param, ctx)
        return n


SIZE = SizeType()
#: a size that must be above 0
BYTES = SizeType(positive=True)


class FiniteRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (a comparison with nan
    is false, so FloatRange lets it through), as a usage error."""

    def convert(self, value, param, ctx):
        import math

        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class LsnType(click.ParamType):
    """An LSN as a person types it: decimal or 0x-prefixed hex."""

    name = "LSN"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            n = int(str(value), 0)
        except ValueError:
            self.fail(f"not an LSN: {value!r} (decimal or 0x hex)", param, ctx)
        if n < 0:
            self.fail(f"an LSN is not negative: {value!r}", param, ctx)
        return n


LSN = LsnType()


def open_volume(spec: str, *, writable: bool = False):
    """Open the volume named by `spec`; read-only unless `writable`, and then
    mapped read-only so that not one byte can change.  A target without a
    superblock becomes NotALogError("not a Concordia log ...")."""
    from concordia.devmem import open_backend
    from concordia.wal import Volume
    from concordia.wal.errors import NotALogError

    # reading another user's log is how an operator inspects it; the
    # permission bits still decide whether that is allowed
    backend = open_backend(spec, readonly=not writable, allow_foreign_owner=not writable)
    Where.target = backend.where
    try:
        vol = Volume.open(backend, writable=writable)
    except NotALogError:
        backend.close()
        raise NotALogError("not a Concordia log (no superblock magic at offset 0)",
                           where=backend.where) from None
    except BaseException:
        backend.close()
        raise
    Where.data = True
    return vol


def progress_bar(length: int, label: str):
    """A click progress bar on stderr (hidden when stderr is not a terminal)."""
    import inspect

    kw = {}
    if "hidden" in inspect.signature(click.progressbar).parameters:
        kw["hidden"] = not sys.stderr.isatty()  # scripts and pipes get no bar residue
    return click.progressbar(length=max(1, int(length)), label=label, file=sys.stderr,
                             show_pos=False, show_percent=True, **kw)


#: recovery modes as the command lines spell them: the library's one mode type
MODES = CLI_MODES


def mode_name(value: str) -> str:
    """A command line's mode (`tolerate-tail`) as the library names it (`tolerate_tail`)."""
    return RecoveryMode.parse(value).value


class Bar:
    """A progress bar on stderr (shown only when stderr is a terminal) fed by
    the library's progress(done_bytes, total_bytes) callbacks; it learns its
    length at the first one.  `enabled=False` (--json, --quiet) shows nothing.
    `stage(i, n)` is the callback for the i-th of n passes of equal length
    over the same bytes, so one bar covers them all."""

    def __init__(self, label: str, *, enabled: bool = True):
        self.label = label
        self.enabled = enabled
        self.bar = None
        self.done = 0
        self.length = 0

    def absolute(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = progress_bar(total, self.label).__enter__()
            self.length = total
        self.bar.update(done - self.done)
        self.done = done

    def stage(self, i: int, n: int):
        return lambda done, total: self.absolute(i * total + done, n * total)

    def finish(self) -> None:
        """The rest of the bar at once (a pass that was not needed)."""
        if self.bar is not None:
            self.absolute(self.length, self.length)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None



def unwritten_slot(vol) -> str | None:
    """'A' or 'B' when that superblock slot was never written (all zero) on a
    volume whose superblock has not been updated since it was formatted: the
    slot is unused, not damaged.  None otherwise."""
    sb = vol.superblock
    if sb.sequence != 0:
        return None
    off = sb.slot_bytes  # sequence 0 lives in slot A; slot B is written first at sequence 1
    arr = vol.backend.array
    if off + sb.slot_bytes <= arr.size and not arr[off:off + sb.slot_bytes].any():
        return "B"
    return None


def require_cupy(error, *, where: str, hint: str):
    """CuPy with at least one CUDA device, or `error` (a ConcordiaError class)
    naming `where` and why, as one line: how a GPU benchmark refuses to run on
    a machine without CuPy or without a device."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:
        raise error(f"a CUDA device is needed ({type(exc).__name__}: {exc})",
                    where=where, hint=hint) from None
    return cupy


def check_outputs(force: bool, *paths, logs=()) -> None:
    """Refuse, before any work, each output a command was asked to write
    (None entries skipped) that is one of the `logs` it reads (names, as a
    user gives them), that exists, unless `force` (`--force`), or that is not
    a regular file: one line naming the path, exit 2, nothing touched
    (devmem.outfile.check_output, the one rule every written output follows)."""
    from concordia.devmem import parse_spec
    from concordia.devmem.outfile import check_output

    inputs = [parse_spec(log).path for log in logs]
    for path in paths:
        if path is not None:
            check_output(path, replace=force, inputs=inputs)


def write_output(path: str, data: bytes, *, replace: bool, inputs=()) -> str:
    """Write `data` as the file `path`, complete or not at all: a temporary
    file beside it, space reserved, fsynced, renamed into place
    (devmem.outfile.OutputFile).  An existing `path` is replaced only with
    `replace` (`--force`); a failure or Ctrl-C leaves `path` as it was."""
    from concordia.devmem.outfile import OutputFile

    with OutputFile(path, replace=replace, size=len(data), inputs=inputs) as f:
        f.write(data, 0)
        return f.commit(expect_size=len(data))


def report(doc: dict, *, as_json: bool, out: str | None, table, force: bool = False) -> None:
    """How every benchmark ends: JSON to `out` when asked (an existing file
    only replaced with `force`), then JSON or the table (`table(doc) -> str`)
    on stdout."""
    if out:
        write_output(out, json.dumps(_finite(doc), indent=2, allow_nan=False, default=_jsonable).encode(),
                     replace=force)
    if as_json:
        emit_json(doc)
    else:
        click.echo(table(doc))
