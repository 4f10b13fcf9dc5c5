"""Concordia: fault tolerance for the GPU state of long-running LLM inference.

What a user needs is importable from here: `Session` (protect arrays, take
checkpoints, recover), `prefetch` (a fresh process's log opened and its
epoch read while it builds its model), `Policy` (when to checkpoint), the statistics a
checkpoint and a recovery return (`CheckpointStats`, `RecoveryStats`) and every
error class (`ConcordiaError` and its subclasses, from `concordia.errors`).
They are imported on first use, so that importing a sub-package
(`concordia.wal`, `concordia.devmem`, ...) stays light; `dir(concordia)` lists
them all the same.  A package Concordia needs that is not installed is named in
one line (`MissingDependencyError`, also an `ImportError`).
"""

import importlib

__version__ = "0.1.0"

# every class of concordia.errors (tests hold the two lists equal)
_ERRORS = (
    "AbsentRegionError",
    "BackendClosedError", "BadSizeError", "BadSpecError", "ChainError", "ConcordiaError",
    "CorruptionError", "CudaUnavailableError", "DemoError", "DevmemError", "StandbyError",
    "DuplicateRegionError", "ExecutorError", "ExecutorStalledError", "ExecutorStoppedError",
    "ForeignOwnerError", "FormatVersionError", "GpuUnavailableError",
    "HostRegisterRefusedError", "InjectedFaultError", "InstrumentError", "KernelCompileError",
    "KernelError", "KernelInputError", "LibpmemUnavailableError", "LockedError", "LogFullError", "LogPressureWarning",
    "MissingDependencyError", "NotADaxDeviceError", "NotALogError", "NothingToRecoverError", "TargetNotEmptyError",
    "NumaNodeError", "OutOfRangeError", "OutputExistsError", "OutputIsInputError", "PathNotFoundError",
    "PermissionDeniedError", "PlanError",
    "ProtocolError", "ReadOnlyError", "ReadOnlyFeatureError", "RecordTooLargeError",
    "RecoverMismatchError", "RecoveryDigestError", "RegionError", "RegionMismatchError",
    "RingFullError", "RingLayoutError", "SessionClosedError", "SessionError",
    "ShapeChangedError", "SuperblockError", "TakeoverRevoked", "TornTailError", "TriggerWarning",
    "UnknownRegionError", "UnsupportedArrayError", "UsageError", "WalError", "WriterStoppedError",
)
_HOME = {"Session": ".session", "prefetch": ".prefetching", "Policy": ".policy",
         "CheckpointStats": ".checkpoint.stats",
         "RecoveryStats": ".restore.run",
         **{name: ".errors" for name in _ERRORS}}

__all__ = ["Session", "prefetch", "Policy", "CheckpointStats", "RecoveryStats", *_ERRORS]


def __getattr__(name):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'concordia' has no attribute {name!r}")
    try:
        module = importlib.import_module(home, __name__)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == __name__:
            raise
        from .root_error import MissingDependencyError

        raise MissingDependencyError(missing, needed_by=f"concordia.{name}") from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
