"""Every error Concordia raises, in one place.

The root `ConcordiaError` is in `concordia.root_error` (below every layer); each
layer's classes live beside the code that raises them (`concordia.devmem.errors`,
`concordia.wal.errors`, ...).  This module imports each of them by name and adds
the errors of the `Session` API.  Every one renders as a single line
(`where: message (hint)`).  Which exit code a command line returns for which
class is the command line's business (`concordia.tools.common.exit_code_of`).
"""

from __future__ import annotations

from concordia.devmem.errors import (
    BackendClosedError, BadSizeError, BadSpecError, CudaUnavailableError, DevmemError,
    ForeignOwnerError, HostRegisterRefusedError, InjectedFaultError, LibpmemUnavailableError,
    LockedError, NotADaxDeviceError, NumaNodeError, OutOfRangeError, OutputExistsError,
    OutputIsInputError, PathNotFoundError,
    PermissionDeniedError, ReadOnlyError,
)
from concordia.executor.errors import (
    ExecutorError, ExecutorStalledError, ExecutorStoppedError, ProtocolError, RingFullError,
    RingLayoutError,
)
from concordia.gpu_kernels.errors import (
    GpuUnavailableError, KernelCompileError, KernelError, KernelInputError,
)
from concordia.instrument.errors import InstrumentError
from concordia.root_error import ConcordiaError, MissingDependencyError
from concordia.wal.errors import (
    ChainError, CorruptionError, FormatVersionError, LogFullError, NotALogError, PlanError,
    ReadOnlyFeatureError, RecordTooLargeError, RegionError, SuperblockError, TargetNotEmptyError, TornTailError,
    UsageError, WalError, WriterStoppedError,
)


class SessionError(ConcordiaError):
    """The Session API was used wrongly or met state it cannot accept."""


class SessionClosedError(SessionError):
    """The session was closed; open a new one on the same log."""


class UnsupportedArrayError(SessionError):
    """The object is not a numpy array, CuPy array or DLPack tensor Concordia can protect."""


class DuplicateRegionError(SessionError):
    """A region of this name is already registered in this session."""


class UnknownRegionError(SessionError):
    """No region of this name is registered (or present in the log)."""


class ShapeChangedError(SessionError):
    """A registered array changed shape, dtype or storage since it was registered."""


class RegionMismatchError(SessionError):
    """The log already holds a region of this name with other attributes
    (typically a log written by another program)."""


class RecoverMismatchError(SessionError):
    """An array given to recover into does not match the region in the log."""


class NothingToRecoverError(SessionError):
    """The log holds no committed epoch (or not the one asked for)."""


class RecoveryDigestError(SessionError):
    """Recovered bytes do not match the digest committed for the epoch."""


class StandbyError(ConcordiaError):
    """A standby could not watch or take over a log (exit code 2)."""


class DemoError(SessionError):
    """The demo's worker or recovery process failed."""


__all__ = [
    "ConcordiaError", "MissingDependencyError",
    "BackendClosedError", "BadSizeError", "BadSpecError", "ChainError", "CorruptionError",
    "CudaUnavailableError", "DemoError", "DevmemError", "DuplicateRegionError", "ExecutorError", "StandbyError",
    "ExecutorStalledError", "ExecutorStoppedError", "ForeignOwnerError", "FormatVersionError",
    "GpuUnavailableError", "HostRegisterRefusedError", "InjectedFaultError", "InstrumentError",
    "KernelCompileError", "KernelError", "KernelInputError", "LibpmemUnavailableError",
    "LockedError", "LogFullError", "NotADaxDeviceError", "NotALogError", "NothingToRecoverError",
    "NumaNodeError", "OutOfRangeError", "OutputExistsError", "OutputIsInputError", "PathNotFoundError", "PermissionDeniedError", "PlanError",
    "ProtocolError", "ReadOnlyError", "ReadOnlyFeatureError", "RecordTooLargeError",
    "RecoverMismatchError", "RecoveryDigestError", "RegionError", "RegionMismatchError",
    "RingFullError", "RingLayoutError", "SessionClosedError", "SessionError", "ShapeChangedError",
    "SuperblockError", "TargetNotEmptyError", "TornTailError", "UnknownRegionError", "UnsupportedArrayError", "UsageError",
    "WalError", "WriterStoppedError",
]
