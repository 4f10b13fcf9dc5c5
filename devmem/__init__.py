"""Memory backends for the log: one `Backend` interface over device DAX, pmem
files, shared memory, plain files and pinned host memory.  Imports nothing of
the rest of Concordia."""

from .errors import *  # noqa: F401,F403
