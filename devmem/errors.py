"""The memory-backend errors, derived from the project root `ConcordiaError`
(`concordia.root_error`, which imports nothing: devmem stays the bottom layer
of the project's own code).

`where` names the place (a path, a device) and `hint` a remedy; both optional.
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class DevmemError(ConcordiaError):
    """A memory backend could not be opened, created, mapped or persisted."""


class PathNotFoundError(DevmemError):
    """The named file or device does not exist."""


class NotADaxDeviceError(DevmemError):
    """A `dax:` target is not a device-DAX character device."""


class ForeignOwnerError(DevmemError):
    """The log belongs to another user and foreign logs were not allowed."""


class BadSizeError(DevmemError):
    """A size is too small, or not a multiple of the backend's alignment."""


class ReadOnlyError(DevmemError):
    """The target can only be opened read-only but writing was asked for."""


class PermissionDeniedError(DevmemError):
    """The operating system refused access."""


class LibpmemUnavailableError(DevmemError):
    """libpmem was requested explicitly but cannot be loaded."""


class NumaNodeError(DevmemError):
    """The requested NUMA node does not exist or cannot hold the mapping."""


class CudaUnavailableError(DevmemError):
    """A CUDA-only operation (pinned memory, host registration) without a usable GPU."""


class HostRegisterRefusedError(DevmemError):
    """The kernel or driver refuses to pin this mapping for the GPU."""


class OutOfRangeError(DevmemError):
    """An offset / length pair does not lie inside the mapping."""


class BackendClosedError(DevmemError):
    """The backend was used after `close()`."""


class BadSpecError(DevmemError):
    """A log name (`dax:`, `pmem:`, `shm:`, `file:`, `pinned:`, `memory:`) cannot be parsed."""


class LockedError(DevmemError):
    """Another writer holds the log's advisory lock (`Backend.lock`)."""


class InjectedFaultError(DevmemError):
    """A failure injected on purpose by `fault.FaultInjectingBackend`."""
