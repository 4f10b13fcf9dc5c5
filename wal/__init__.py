"""The write-ahead log: on-media format (FORMAT.md), volume and segments,
appender, reader, snapshots, compaction and the recovery planner."""

from .errors import *  # noqa: F401,F403
from .format import PageBatch, RegionInfo, region_digest
from .reader import Dropped, Record, RecoveryMode, verify
from .log import Log
from .volume import SegmentInfo, Volume
from .appender import Appender, Extent, Reservation

__all__ = [
    "Log", "RecoveryMode", "Dropped", "Record", "Volume", "SegmentInfo", "Appender", "Reservation",
    "Extent", "PageBatch", "RegionInfo", "region_digest", "verify",
]
