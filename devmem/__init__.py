"""Memory backends for the log: one `Backend` interface over device DAX, pmem
files, shared memory, huge-page files, plain files and pinned host memory; the libpmem bindings;
CUDA host registration (`cuda_host`, CuPy imported lazily); a fault-injecting
wrapper for crash tests.  Imports nothing of the rest of Concordia but the
root error class and the lazy loader (`concordia.lazy`): the names load on
first use."""

from concordia.lazy import exports, homes_of

from .errors import *  # noqa: F401,F403

__getattr__, __dir__ = exports(__name__, homes_of({
    "backend": ("Backend", "Survives"),
    "devdax": ("DevDaxBackend",),
    "fault": ("FaultInjectingBackend",),
    "hugetlb": ("HugetlbBackend",),
    "opener": ("Spec", "detect_kind", "open_backend", "parse_spec"),
    "tiers": ("FileBackend", "MemoryBackend", "PmemBackend", "ShmBackend"),
}))

__all__ = [
    "Backend", "Survives", "Spec", "open_backend", "parse_spec", "detect_kind",
    "FaultInjectingBackend", "DevDaxBackend", "FileBackend", "HugetlbBackend", "MemoryBackend", "PmemBackend", "ShmBackend",
]
