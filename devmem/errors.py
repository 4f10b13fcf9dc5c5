"""The root of Concordia's error hierarchy and the memory-backend errors.

The root class lives here because `devmem` is the bottom of the import graph
(tools -> concordia -> gpu_kernels -> wal -> devmem): every other layer derives
its errors from `ConcordiaError` without importing upward.

Every error renders as one line.  `where` names the place ("segment 3 @ 0x1a040",
a path, a device) and `hint` a remedy; both are optional.
"""

from __future__ import annotations


class ConcordiaError(Exception):
    """Base class of every error Concordia raises on purpose.

    exit_code is what a command line returns when this error ends it:
    1 = problems found in the data, 2 = usage or I/O error (see tools).
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f" ({self.hint})"
        return " ".join(text.split())  # never more than one line


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
