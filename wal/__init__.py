"""The write-ahead log: on-media format (FORMAT.md), volume and segments,
appender, reader, snapshots, compaction and the recovery planner.

What a user of the log needs is exported here: opening and verifying a log
(`Log`, `RecoveryMode`, `verify`), planning a recovery (`plan`, `scan`, `Plan`,
`RegionPlan`, `History`), compaction (`compact`, `CompactReport`) and base
snapshots (`create_base_snapshot`, `list_snapshots`, `SnapshotInfo`), with the
records they hand back and every error class.  The plumbing under them
(`Volume`, `Appender`, `format`) stays importable but is not in `__all__`.

The names load on first use (`concordia.lazy`): importing one submodule
(`concordia.wal.errors`, say) does not load the rest.
"""

from concordia.lazy import exports, homes_of

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors

__getattr__, __dir__ = exports(__name__, homes_of({
    "format": ("PageBatch", "RegionInfo", "region_digest"),
    "reader": ("Dropped", "Record", "RecoveryMode", "verify"),
    "log": ("Log",),
    "planner": ("History", "Plan", "RegionPlan", "plan", "scan"),
    "compaction": ("CompactReport", "compact"),
    "snapshot": ("SnapshotInfo", "create_base_snapshot", "list_snapshots"),
    # plumbing: importable, not in __all__
    "volume": ("SegmentInfo", "Volume"),
    "appender": ("Appender", "Extent", "Reservation"),
}))

__all__ = [
    "Log", "RecoveryMode", "Dropped", "Record", "verify",
    "plan", "scan", "Plan", "RegionPlan", "History",
    "compact", "CompactReport",
    "create_base_snapshot", "list_snapshots", "SnapshotInfo",
    "PageBatch", "RegionInfo", "region_digest",
    *_errors,
]
