"""Output files that are either complete or absent: what `restore` writes
(a region as `.npy`), a repair's backup copy, a benchmark's JSON.

An `OutputFile` is written to a temporary file beside its target (same
directory, hence same file system), its blocks reserved up front when the size
is known (posix_fallocate: a full disk is an error before the first byte, never
a SIGBUS on a mapped store), fsynced, and only then renamed over the target
(with `replace`) or linked to it (without: an output that appeared meanwhile is
not overwritten).  Until `commit` the target is as it was: a failure, an
interrupt or a crash leaves the old file (or none) and at most a `.NAME.tmp-*`
file, which a failure removes.

An output that is one of the inputs (the same file by device and inode, or the
same path once links are resolved) is refused before anything is created: the
rename would otherwise replace the input by its own output.

This is the one way the command lines write a named output, and
`check_output` the one rule for naming one: an existing output is refused
unless the caller was told to replace it (`--force`), what is not a regular
file is refused always.  A command runs `check_output` on each output before
its work starts (a long benchmark is not run only to be refused at the end)
and `OutputFile` checks again as it writes.

Ctrl-C: the two steps that make a name and remember it (creating the
temporary, putting the output in place) hold SIGINT and SIGTERM back until both are done
(`hold_interrupts`), so an interrupt never leaves a temporary that nothing
remembers to remove, nor an output in place that is then called unwritten.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import threading

from concordia.root_error import Hint

from .backend import OUTPUT_HINTS, os_error
from .dirsync import sync_parent
from .errors import BadSpecError, DevmemError, OutputExistsError, OutputIsInputError, PathNotFoundError

__all__ = ["OutputFile", "check_not_input", "check_output", "hold_interrupts", "OVERWRITE_HINT"]

#: how to replace an existing output: `replace=True` in Python; every command
#: line that writes an output file takes `--force` for it
OVERWRITE_HINT = Hint(api="pass replace=True to overwrite it", cli="pass --force to overwrite it")


def output_error(exc: OSError, where: str, doing: str):
    """`os_error` for an output file: its hints speak of the output, not of a log."""
    return os_error(exc, where, doing, hints=OUTPUT_HINTS)


def _identity(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_not_input(out: str, inputs, *, what: str = "the log") -> None:
    """Refuse `out` when it is one of `inputs` (paths; None entries skipped):
    the same file (device and inode, so hard links and symbolic links count)
    or the same resolved path."""
    mine = _identity(out)
    real = os.path.realpath(out)
    for inp in inputs:
        if inp is None:
            continue
        if os.path.realpath(inp) == real or (mine is not None and _identity(inp) == mine):
            raise OutputIsInputError(f"the output is {what} itself ({inp})", where=out,
                                     hint="write the output to another file")


def check_output(path, *, replace: bool = False, inputs=(), what: str = "the log"):
    """Refuse an output path before anything is written: one of `inputs`
    (`check_not_input`), something other than a regular file, (without
    `replace`) an existing file, or a path in a folder that does not exist.
    Returns (absolute path, its stat or None where it does not exist).
    A symbolic link to a regular file is followed: that file is the output
    (written beside it and renamed over it), never the link itself; a link
    to nothing is refused (it would make a file wherever it points).
    Creates and changes nothing."""
    path = os.path.abspath(os.fspath(path))
    check_not_input(path, inputs, what=what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise BadSpecError(f"the output is a symbolic link to nothing ({os.readlink(path)})", where=path,
                               hint="name the file to write itself") from None
        if not os.path.isdir(os.path.dirname(path)):  # found now, not after a long run
            raise PathNotFoundError("no such folder for the output", where=os.path.dirname(path),
                                    hint="create it, or name a file in a folder that exists") from None
        return path, None
    except OSError as exc:
        raise output_error(exc, path, "cannot look at the output") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadSpecError("the output exists and is not a regular file", where=path,
                           hint="name a file to write")
    if not replace:
        raise OutputExistsError("the output exists", where=path, hint=OVERWRITE_HINT)
    return os.path.realpath(path), st


@contextlib.contextmanager
def hold_interrupts():
    """SIGINT and SIGTERM held back for the block and delivered when it ends,
    each signal that landed once, in the order they landed (Python's handler,
    or the command line's, then raises KeyboardInterrupt there, and the rest
    are not delivered).  Only in the main thread, and for each signal only
    where it runs a Python handler; elsewhere the block runs as it is.  Every
    handler is put back, even when a signal pending at that moment raises."""
    try:
        main = threading.current_thread() is threading.main_thread()
        olds = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    except ValueError:
        olds = {}
    olds = {sig: h for sig, h in olds.items() if callable(h)}
    if not olds:
        yield
        return
    held = {}   # signal -> frame, in the order they landed

    def hold(signum, frame):
        held.setdefault(signum, frame)

    for sig in olds:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        raised = None
        for sig, old in olds.items():
            while True:   # signal.signal first runs the handlers of signals pending then, which may raise
                try:
                    signal.signal(sig, old)
                    break
                except BaseException as exc:  # noqa: BLE001 - put back every handler, then raise
                    raised = raised or exc
        if raised is not None:
            raise raised
        for signum, frame in list(held.items()):
            olds[signum](signum, frame)


class OutputFile:
    """One output file, written under a temporary name and renamed into place
    by `commit`.  Use as a context manager: leaving the block by an exception
    removes the temporary file and leaves the target untouched.

        with OutputFile(path, replace=force, size=n, inputs=[log_path]) as out:
            os.pwrite(out.fd, data, 0)      # or map out.tmp_path
            out.commit()

    size: bytes to reserve (posix_fallocate) before anything is written; the
    file is that long.  None: grows as written.
    mode: permission bits of a new file (less the umask)."""

    def __init__(self, path, *, replace: bool = False, size: int | None = None, inputs=(),
                 what: str = "the log", mode: int = 0o666):
        self.replace = replace
        self.committed = False
        self.fd = -1
        self.tmp_path = ""
        path, st = check_output(path, replace=replace, inputs=inputs, what=what)
        self.path = path
        try:
            self._create_temporary(mode)
            self._prepare(st, size)
        except BaseException:  # a failure or Ctrl-C: the caller never gets the object to abort
            self.abort()
            raise

    def _create_temporary(self, mode: int) -> None:
        directory, base = os.path.split(self.path)
        for _ in range(100):
            tmp = os.path.join(directory, f".{base}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
            with hold_interrupts():  # made and remembered, or neither
                try:
                    self.fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                                      mode)
                except FileExistsError:
                    continue
                except OSError as exc:
                    raise output_error(exc, self.path, "cannot create the output") from None
                self.tmp_path = tmp
            return
        raise DevmemError("cannot find a free temporary name beside the output", where=self.path)

    def _prepare(self, st, size) -> None:
        path = self.path
        if st is not None:
            try:
                os.fchmod(self.fd, stat.S_IMODE(st.st_mode))   # a replaced file keeps its mode
            except OSError:
                pass
        if size:
            try:
                os.posix_fallocate(self.fd, 0, int(size))
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    try:
                        os.ftruncate(self.fd, int(size))
                    except OSError as exc2:
                        raise output_error(exc2, path, f"cannot make the output {size} bytes") from None
                else:
                    raise output_error(exc, path, f"cannot reserve {size} bytes for the output") from None

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if not self.committed:
            self.abort()

    def write(self, data, offset: int) -> None:
        """pwrite all of `data` at `offset` of the temporary file."""
        view = memoryview(data).cast("B")
        while len(view):
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as exc:
                raise output_error(exc, f"{self.path} @ {offset:#x}", "write failed") from None
            view, offset = view[n:], offset + n

    def commit(self, *, expect_size: int | None = None) -> str:
        """fsync the temporary file, check its length when `expect_size` is
        given, put it in place (rename, or link without `replace`) and fsync
        the directory.  Returns the target path."""
        try:
            os.fsync(self.fd)
            have = os.fstat(self.fd).st_size
            if expect_size is not None and have != expect_size:
                raise DevmemError(f"the output is {have} bytes, {expect_size} were written",
                                  where=self.path)
            os.close(self.fd)
            self.fd = -1
            with hold_interrupts():  # in place and known to be, or neither
                self._put_in_place()
                self.committed = True
        except OSError as exc:
            self.abort()
            raise output_error(exc, self.path, "cannot complete the output") from None
        except BaseException:
            self.abort()
            raise
        sync_parent(self.path)  # the name, not only the bytes, survives a power loss (dirsync)
        return self.path

    def _put_in_place(self) -> None:
        if self.replace:
            os.replace(self.tmp_path, self.path)
            return
        try:
            os.link(self.tmp_path, self.path)
            os.unlink(self.tmp_path)
        except FileExistsError:
            raise OutputExistsError("the output appeared while it was written", where=self.path,
                                    hint=OVERWRITE_HINT) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            # no hard links here: checked absent above, renamed now
            if os.path.lexists(self.path):
                raise OutputExistsError("the output appeared while it was written",
                                        where=self.path, hint=OVERWRITE_HINT) from None
            os.rename(self.tmp_path, self.path)

    def abort(self) -> None:
        """Close and remove the temporary file; the target stays as it was."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if self.tmp_path and not self.committed:
            try:
                os.unlink(self.tmp_path)
            except OSError:
                pass
            self.tmp_path = ""


