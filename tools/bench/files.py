"""What a benchmark writes and what it makes for itself, and the rules for both.

Outputs (`--out`, `--plot`): named by the user, checked before the run starts
(`common.check_outputs`: an existing file is refused unless `--force`), written
whole or not at all at the end (`common.write_output`, `save_figure`).

Everything else a benchmark touches is its own (`Scratch`): its logs, its
baselines' files (SQLite, LMDB, torch.save), its folders.  They live in
private folders the run makes (`tempfile.mkdtemp`: in /dev/shm for shm logs,
on a hugetlbfs mount for hugetlb ones, in the temporary folder or under
`--dir` for files) and are removed when the run ends, however it ends (an
error, Ctrl-C, SIGTERM).  A log path the user names (`bench longrun --log`) is
`claim`ed: refused when it holds anything (a Concordia log, any nonzero
byte: `wal.volume.check_format_target`, the rule every format follows),
created empty when absent and then removed at the end; an existing one that
holds nothing (an empty file, a zeroed device) is used and left as the run
leaves it.  Nothing a run did not create is ever removed: removal checks that
a path is still the file or folder the run made (device and inode).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import click

__all__ = ["Scratch", "force_option", "save_figure"]

SHM_DIR = "/dev/shm"


def force_option(*outputs: str):
    """The `--force` of a benchmark that writes `outputs` (option names)."""
    return click.option("--force", is_flag=True,
                        help=f"Replace {' and '.join(outputs)} when it exists (refused otherwise).")


def save_figure(fig, path: str, *, replace: bool, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG at `path`, complete or absent, an existing
    file replaced only with `replace` (as the JSON of `--out`)."""
    import io

    from ..common import write_output

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    write_output(path, buf.getvalue(), replace=replace)


def _identity(path: str):
    st = os.lstat(path)
    return st.st_dev, st.st_ino


class Scratch:
    """The files and folders one benchmark run makes, removed by `close`
    (a context manager: on leaving the block, however it is left).

        with Scratch("append") as scratch:
            spec = scratch.log("r1")              # shm:/dev/shm/concordia-bench-append-XXXX/r1-1
            path = scratch.path("x.sqlite", SHM_DIR)
            scratch.discard(spec)                 # early, to give the space back
    """

    def __init__(self, label: str):
        self.label = label
        self._folders: dict[str, tuple[str, tuple]] = {}   # parent -> (folder, identity)
        self._claimed: list[tuple[str, tuple]] = []        # (path, identity) made at a name the user gave
        self._n = 0

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- where things go ------------------------------------------------------------
    def folder(self, parent: str | None = None) -> str:
        """This run's private folder inside `parent` (default: the temporary
        folder), made at the first call for that parent."""
        from concordia.devmem.outfile import hold_interrupts

        key = os.path.realpath(parent or tempfile.gettempdir())
        if key not in self._folders:
            with hold_interrupts():  # made and remembered, or neither
                path = tempfile.mkdtemp(prefix=f"concordia-bench-{self.label}-", dir=key)
                self._folders[key] = (path, _identity(path))
        return self._folders[key][0]

    def path(self, name: str, parent: str | None = None) -> str:
        """A fresh path (nothing there yet) in this run's folder inside `parent`."""
        self._n += 1
        return os.path.join(self.folder(parent), f"{name}-{self._n}")

    def log(self, name: str, tier: str = "shm", parent: str | None = None) -> str:
        """The spec of a new log of this run, on `tier`: `shm` (in /dev/shm),
        `file` (in `parent`, default the temporary folder), `hugetlb` (on
        `parent` or the default hugetlbfs mount) or `memory`.  Every call
        names another log: `Session(spec)` creates it."""
        if tier == "memory":
            return "memory:"
        if tier == "shm":
            return f"shm:{self.path(name, SHM_DIR)}"
        if tier == "hugetlb":
            if parent is None:
                from concordia.devmem import hugetlb

                parent = hugetlb.default_mount()
                if parent is None:
                    raise click.UsageError("no hugetlbfs is mounted (scripts/hugepages.sh setup, as root)")
            return f"hugetlb:{self.path(name, parent)}"
        if tier == "file":
            return f"file:{self.path(name, parent)}"
        raise click.BadParameter(f"unknown tier {tier!r}")

    # -- a path the user named --------------------------------------------------------
    def claim(self, spec: str, *, option: str) -> str:
        """Take the log path `spec` the user gave with `option` for this run's
        log: refused (TargetNotEmptyError, exit 2, nothing touched) when it
        holds anything; made here, empty, when absent (and removed at the end).
        Returns `spec`."""
        from concordia.devmem import parse_spec
        from concordia.devmem.backend import os_error
        from concordia.devmem.outfile import hold_interrupts
        from concordia.wal.volume import check_format_target

        s = parse_spec(spec)
        if s.path is None:  # memory:, pinned: hold nothing before this process makes them
            return spec
        try:
            with hold_interrupts():  # made and remembered, or neither
                fd = os.open(s.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                self._claimed.append((s.path, (st.st_dev, st.st_ino)))
        except FileExistsError:
            check_format_target(spec, hint=f"{option} is where the benchmark puts a log of its own: "
                                           "name a path that does not exist")
        except OSError as exc:
            raise os_error(exc, s.path, f"cannot create the log {option} names") from None
        return spec

    # -- giving back ------------------------------------------------------------------
    def _ours(self, path: str) -> bool:
        real = os.path.realpath(path)
        return any(os.path.dirname(real) == os.path.realpath(folder) for folder, _ in self._folders.values())

    def discard(self, spec: str) -> None:
        """Remove the file behind `spec` now, when it lies in one of this run's
        folders (a log it is done with); anything else stays until `close`."""
        from concordia.devmem import parse_spec

        path = parse_spec(spec).path
        if path is not None and self._ours(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Remove what this run made and nothing else: the files it created at
        names the user gave, and its folders with all they hold, each only
        while it is still what the run made."""
        from concordia.devmem.tiers import discard_created

        while self._claimed:
            path, ident = self._claimed.pop()
            discard_created(path, ident)
        while self._folders:
            _, (folder, ident) = self._folders.popitem()
            try:
                if _identity(folder) != ident:
                    continue
            except OSError:
                continue
            shutil.rmtree(folder, ignore_errors=True)
