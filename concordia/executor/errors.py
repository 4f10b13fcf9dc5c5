"""Errors of the executor: the task ring, its consumers and the watchdog.

`ExecutorError` derives from the project root `ConcordiaError`; `concordia.errors`
re-exports it with the rest of the hierarchy.  `where` names the ring position
("ring slot 5 (task 1029)") or the executor ("gpu executor 3").
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class ExecutorError(ConcordiaError):
    """The executor could not take, run or finish a task."""


class RingLayoutError(ExecutorError):
    """A buffer does not hold a task ring of this layout (magic, version, sizes)."""


class RingFullError(ExecutorError):
    """Back-pressure: the ring stayed full for the whole submit timeout."""


class ExecutorStalledError(ExecutorError):
    """The watchdog saw tasks pending while the consumer's tail did not move."""


class ExecutorStoppedError(ExecutorError):
    """A task was submitted after STOP, or waited on after the consumer stopped."""


class ProtocolError(ExecutorError):
    """A slot's sequence number or a completion does not match the protocol."""


class TriggerWarning(ConcordiaError, RuntimeWarning):
    """A warning, not raised: a device trigger found no arena for a due step
    (the log full, or no arena holds its epochs now), so the session's own
    path took that step's epoch, on the host and slower (coalesced only when
    the log is too full for it as well).  Issued once per run of such steps;
    it renders as one line like every error.  Not an ExecutorError: under
    `-W error` it must not read as an engine's failure."""
