"""Making a file's name durable, not only its bytes.

Syncing a file (msync, fsync) makes its contents and size durable, not the
directory entry that names it: after a power loss a file that was created
or renamed into place can be missing although every byte of it was synced
(ext4 and XFS commit the entry with the directory, which nothing synced).
POSIX's remedy is an fsync of the directory after the entry changed.  Every
place that makes a file appear calls one of these:

    sync_parent(path)          # after creating `path` (the log file, a backup copy)
    publish(tmp, path)         # fsync tmp, rename it to path, fsync the directory

A file system that cannot sync a directory (EINVAL, ENOTSUP: some FUSE and
network mounts) is let be: there is nothing more a program can do there.
"""

from __future__ import annotations

import errno
import os

from .backend import os_error

#: errnos meaning "this file system does not sync directories" (nothing to do)
_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS}


def sync_dir(path) -> None:
    """fsync(2) the directory `path`, so that the entries created or renamed
    in it so far survive a power loss."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise os_error(exc, path, "cannot open the directory to sync it") from None
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise os_error(exc, path, "cannot sync the directory") from None
    finally:
        os.close(fd)


def sync_parent(path) -> None:
    """Sync the directory holding `path` (after `path` was created or renamed)."""
    sync_dir(os.path.dirname(os.path.abspath(os.fspath(path))) or ".")


def publish(tmp, path) -> None:
    """Put the finished file `tmp` in place as `path`, durably: its bytes are
    synced, it is renamed over `path` (atomic: a reader sees the old file or
    the new one, never part of one), then the directory is synced so that the
    new name survives a power loss.  `tmp` must lie in `path`'s directory."""
    tmp, path = os.fspath(tmp), os.fspath(path)
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise os_error(exc, tmp, "cannot open the file to sync it") from None
    try:
        os.fsync(fd)
    except OSError as exc:
        raise os_error(exc, tmp, "cannot sync the file") from None
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise os_error(exc, path, "cannot rename the file into place") from None
    sync_parent(path)


__all__ = ["sync_dir", "sync_parent", "publish"]
