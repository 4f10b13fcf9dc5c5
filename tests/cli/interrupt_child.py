"""Run a command line in this process as its installed entry point runs it,
with Ctrl-C (a real SIGINT, sent by this process to itself) landing at one
named point of its work: where the interrupt lands is chosen by what the
program is doing, never by a delay.

    python interrupt_child.py POINT NOTES PROGRAM ARG...

POINT is one of POINTS, or `term:` and one of them for a SIGTERM (what
`timeout` and a service manager send) in place of the SIGINT, or `both:` and
one of them for the two landing at once (both raised while blocked, then let
through together, as when they arrive during a long call into C); PROGRAM is
`concordia-wal` or `concordia`.  The
point writes what it saw (the path of a file the command had made, say) to
the file NOTES, one line each, so the test can look for it afterwards.
Nothing of the project is imported before the point is set up, so that the
`imports` point lands while the entry point imports the library.
"""

from __future__ import annotations

import importlib.abc
import signal
import sys

NOTES = None
SIGNAL = signal.SIGINT


def note(text: str) -> None:
    with open(NOTES, "a") as f:
        f.write(f"{text}\n")


def ctrl_c(where: str) -> None:
    """The interrupt, here and now (the handler runs before this returns)."""
    note(f"interrupted {where}")
    if SIGNAL == "both":
        both = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, both)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, both)   # both pending: Python runs SIGINT's handler first
        return
    signal.raise_signal(SIGNAL)


class _OnImport(importlib.abc.MetaPathFinder):
    """Ctrl-C as `numpy` starts being imported: the commands reach it through
    their first imports, long before any work."""

    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            ctrl_c("importing numpy")
        return None


def _once(owner, attr, before=None, after=None):
    """Wrap `owner.attr` so that its first call runs `before(*args)` or, once
    it returned, `after(result, *args)`; later calls go straight through."""
    orig = getattr(owner, attr)
    fired = []

    def wrapper(*args, **kwargs):
        if fired:
            return orig(*args, **kwargs)
        if before is not None and before(*args, **kwargs):
            fired.append(1)
        result = orig(*args, **kwargs)
        if not fired and after is not None and after(result, *args, **kwargs):
            fired.append(1)
        return result

    setattr(owner, attr, wrapper)


def _imports():
    sys.meta_path.insert(0, _OnImport())


def _compact_write():
    """Inside compaction's write: a base record reserved, not yet persisted."""
    from concordia.wal import format as F

    def before(*args, **kwargs):
        if kwargs.get("flags", 0) & F.FLAG_BASE:
            ctrl_c("encoding a base record into its reservation")
            return True
        return False

    _once(F, "encode_page_batch_into", before=before)


def _log_created():
    """Right after a log was made (its file created, formatted and mapped)."""
    from concordia.wal.log import Log

    orig = Log.create.__func__

    def create(cls, target, *args, **kwargs):
        log = orig(cls, target, *args, **kwargs)
        note(f"log {log.backend.path}")
        ctrl_c("after the log was created")
        return log

    Log.create = classmethod(create)


def _session_checkpoint():
    """At a Session's first checkpoint (its log made and open)."""
    from concordia.session import Session

    def before(self, *args, **kwargs):
        note(f"log {self.log.backend.path}")
        ctrl_c("at the first checkpoint")
        return True

    _once(Session, "checkpoint", before=before)


def _output_write():
    """While an output file (restore's .npy, a backup, a benchmark's JSON) is
    being written under its temporary name."""
    from concordia.devmem.outfile import OutputFile

    def after(result, self, *args, **kwargs):
        note(f"temporary {self.tmp_path}")
        ctrl_c("writing an output")
        return True

    _once(OutputFile, "write", after=after)


def _format_zeroing():
    """After `format` created the file, as it lays the volume out."""
    from concordia.wal.volume import Volume

    def before(target, *args, **kwargs):  # Volume.create, bound to its class
        note(f"log {getattr(target, 'path', target)}")
        ctrl_c("formatting")
        return True

    _once(Volume, "create", before=before)


def _follow_poll():
    """`dump --follow` after its first poll (where a person's Ctrl-C lands)."""
    from concordia.wal.reader import Follower

    _once(Follower, "poll", after=lambda *a, **k: (ctrl_c("following"), True)[1])


POINTS = {
    "imports": _imports,
    "compact-write": _compact_write,
    "log-created": _log_created,
    "session-checkpoint": _session_checkpoint,
    "output-write": _output_write,
    "format": _format_zeroing,
    "follow-poll": _follow_poll,
}


def main() -> None:
    global NOTES, SIGNAL
    point, NOTES, program, *args = sys.argv[1:]
    if point.startswith("term:"):
        point, SIGNAL = point[len("term:"):], signal.SIGTERM
    elif point.startswith("both:"):
        point, SIGNAL = point[len("both:"):], "both"
    POINTS[point]()
    sys.argv = [program, *args]
    from concordia.tools import entry

    {"concordia-wal": entry.concordia_wal, "concordia": entry.concordia}[program]()


if __name__ == "__main__":
    main()
