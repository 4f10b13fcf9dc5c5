"""Memory backends for the log: one `Backend` interface over device DAX, pmem
files, shared memory, plain files and pinned host memory; the libpmem bindings;
CUDA host registration (`cuda_host`, CuPy imported lazily); a fault-injecting
wrapper for crash tests.  Imports nothing of the rest of Concordia."""

from .errors import *  # noqa: F401,F403
from .backend import Backend, Survives
from .devdax import DevDaxBackend
from .fault import FaultInjectingBackend
from .opener import Spec, detect_kind, open_backend, parse_spec
from .tiers import FileBackend, MemoryBackend, PmemBackend, ShmBackend

__all__ = [
    "Backend", "Survives", "Spec", "open_backend", "parse_spec", "detect_kind",
    "FaultInjectingBackend", "DevDaxBackend", "FileBackend", "MemoryBackend", "PmemBackend", "ShmBackend",
]
