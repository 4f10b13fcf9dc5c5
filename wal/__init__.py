"""The write-ahead log: on-media format (FORMAT.md), volume and segments,
appender, reader, snapshots, compaction and the recovery planner.

What a user of the log needs is exported here: opening and verifying a log
(`Log`, `RecoveryMode`, `verify`), planning a recovery (`plan`, `scan`, `Plan`,
`RegionPlan`, `History`), compaction (`compact`, `CompactReport`) and base
snapshots (`create_base_snapshot`, `list_snapshots`, `SnapshotInfo`), with the
records they hand back and every error class.  The plumbing under them
(`Volume`, `Appender`, `format`) stays importable but is not in `__all__`.
"""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors
from .format import PageBatch, RegionInfo, region_digest
from .reader import Dropped, Record, RecoveryMode, verify
from .log import Log
from .planner import History, Plan, RegionPlan, plan, scan
from .compaction import CompactReport, compact
from .snapshot import SnapshotInfo, create_base_snapshot, list_snapshots
from .volume import SegmentInfo, Volume  # noqa: F401  plumbing: importable, not in __all__
from .appender import Appender, Extent, Reservation  # noqa: F401

__all__ = [
    "Log", "RecoveryMode", "Dropped", "Record", "verify",
    "plan", "scan", "Plan", "RegionPlan", "History",
    "compact", "CompactReport",
    "create_base_snapshot", "list_snapshots", "SnapshotInfo",
    "PageBatch", "RegionInfo", "region_digest",
    *_errors,
]
