"""Every error Concordia raises, in one place: the public face.

The root `ConcordiaError` is in `concordia.root_error` (below every layer); each
layer's classes live beside the code that raises them (`concordia.devmem.errors`,
`concordia.wal.errors`, the runtime's in `concordia.regions.errors`, ...).  This
module imports each of them by name; no module of the package imports it, and
importing it loads no runtime code (the packages' `__init__` load their
contents on first use).  Every one renders as a single line
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
    RingLayoutError, TriggerWarning,
)
from concordia.gpu_kernels.errors import (
    GpuUnavailableError, KernelCompileError, KernelError, KernelInputError,
)
from concordia.instrument.errors import InstrumentError
from concordia.regions.errors import (
    DemoError, DuplicateRegionError, LogPressureWarning, NothingToRecoverError, RecoverMismatchError,
    RecoveryDigestError,
    RegionMismatchError, SessionClosedError, SessionError, ShapeChangedError, StandbyError, TakeoverRevoked,
    UnknownRegionError, UnsupportedArrayError,
)
from concordia.root_error import ConcordiaError, MissingDependencyError
from concordia.wal.errors import (
    AbsentRegionError, ChainError, CorruptionError, FormatVersionError, LogFullError, NotALogError, PlanError,
    ReadOnlyFeatureError, RecordTooLargeError, RegionError, SuperblockError, TargetNotEmptyError, TornTailError,
    UsageError, WalError, WriterStoppedError,
)


__all__ = [
    "ConcordiaError", "MissingDependencyError", "AbsentRegionError",
    "BackendClosedError", "BadSizeError", "BadSpecError", "ChainError", "CorruptionError",
    "CudaUnavailableError", "DemoError", "DevmemError", "DuplicateRegionError", "ExecutorError", "StandbyError",
    "ExecutorStalledError", "ExecutorStoppedError", "ForeignOwnerError", "FormatVersionError",
    "GpuUnavailableError", "HostRegisterRefusedError", "InjectedFaultError", "InstrumentError",
    "KernelCompileError", "KernelError", "KernelInputError", "LibpmemUnavailableError",
    "LockedError", "LogFullError", "LogPressureWarning", "NotADaxDeviceError", "NotALogError", "NothingToRecoverError",
    "NumaNodeError", "OutOfRangeError", "OutputExistsError", "OutputIsInputError", "PathNotFoundError", "PermissionDeniedError", "PlanError",
    "ProtocolError", "TriggerWarning", "ReadOnlyError", "ReadOnlyFeatureError", "RecordTooLargeError",
    "RecoverMismatchError", "RecoveryDigestError", "RegionError", "RegionMismatchError",
    "RingFullError", "RingLayoutError", "SessionClosedError", "SessionError", "ShapeChangedError",
    "SuperblockError", "TakeoverRevoked", "TargetNotEmptyError", "TornTailError", "UnknownRegionError", "UnsupportedArrayError", "UsageError",
    "WalError", "WriterStoppedError",
]
