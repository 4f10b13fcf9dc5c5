"""Opening the log a `concordia.Session` works on: a named log opened or
created as the session's arguments allow, read-only for recovery, or for
writing at a read-only session's first write."""

from __future__ import annotations

import os

from concordia.devmem.errors import PathNotFoundError
from concordia.regions.errors import SessionError
from concordia.wal.errors import NotALogError
from concordia.wal.log import Log

#: the size of a log a session creates when none is given
DEFAULT_SIZE = 256 << 20


def open_read_only(log):
    """The read-only recovery path: no writer lock, nothing cut (a writer may be
    appending right now: `Log.open(live=True)`), and nothing refused at open
    (refuse=False): any log the command lines can read opens, and `recover`
    decides in the mode it is given, as they do."""
    return Log.open(log, writable=False, check_pages="last", live=True, refuse=False)


def open_log(log, *, create, size, segment_size, overwrite, readonly=False):
    """(Log, owned): open the named log, or create it where allowed.  With
    create=False a named log is opened read-only (Session's docstring), and
    nothing is ever created: a name that holds no log is refused in one line
    (PathNotFoundError, NotALogError)."""
    if isinstance(log, Log):
        if readonly and log.writable:
            raise SessionError("readonly=True with a Log opened for writing", hint="pass the log's name")
        return log, False
    named = isinstance(log, (str, os.PathLike))
    if readonly and not named:
        raise SessionError("readonly=True needs a log name", where=str(log))
    if overwrite and not create:
        raise SessionError("overwrite=True formats a new log, create=False opens an existing one",
                           where=str(log), hint="pass one of them")
    kw = {} if segment_size is None else {"segment_size": segment_size}
    # the tier as the opener reads the name: a file called `memory` is a file,
    # not the memory tier (formatting it unasked would destroy what it holds)
    from concordia.devmem import parse_spec
    from concordia.wal.volume import VOLATILE_KINDS

    volatile = named and parse_spec(log).kind in VOLATILE_KINDS
    if volatile and not create:
        raise NotALogError("holds no log: a log in this process's memory is made by this process",
                           where=log, hint="pass create=True to make one")
    if overwrite or volatile:  # a volatile tier holds nothing before this process made it
        return Log.create(log, size=size or DEFAULT_SIZE, overwrite=True, **kw), True
    if not create and named:  # recovery reads: the writer lock waits for the first write
        return open_read_only(log), True
    try:
        # page payloads are checked at open only where V-C4 needs them (the last
        # one-sync commit's records): every page a recovery reads is checked
        # where it lands, and checking all of them here read the whole log
        # first (about 6 GB/s on one core)
        return Log.open(log, writable=True, check_pages="last"), True
    except (PathNotFoundError, NotALogError):
        if not create:
            raise
    # a target holding anything that is not a log (a file of the user's) is
    # refused and left as it is (TargetNotEmptyError), not formatted
    from concordia.wal.volume import check_format_target

    check_format_target(log, hint="pass overwrite=True to format it anyway")
    return Log.create(log, size=size or DEFAULT_SIZE, overwrite=True, **kw), True


def writable(session, doing: str, *, owns: bool, target):
    """The log, writable: a session on a log opened read-only (create=False)
    and owned by it (`owns`; `target`: the name it opened)
    takes the writer lock and opens it for writing now (which cuts the
    uncommitted tail).  When a writer committed in between, the regions'
    CRC tables no longer describe the log's state: their next checkpoint
    writes them whole."""
    if session.log.writable:
        return session.log
    if session.readonly or not owns:
        raise SessionError(f"cannot {doing}: the log was opened read-only",
                           where=str(session.log_name),
                           hint="open it with Session(log, create=False) to write" if session.readonly
                           else "pass a Log opened with writable=True")
    if session.ahead is not None:  # its copy of the state is of no use once this session writes
        session.ahead.drop("the session wrote to the log")
    old = session.log
    seen = (old.last_committed_epoch, old.commits[-1].lsn if old.commits else 0)
    session.log = Log.open(target, writable=True, check_pages="last")
    old.close()
    if (session.log.last_committed_epoch, session.log.appender.last_commit_lsn) != seen:
        session.region_set.lose()
    else:
        session.region_set.changed()  # cached routes and region table belong to the old open
    session.region_set.next_epoch = max(session.region_set.next_epoch, session.epoch + 1)
    return session.log
