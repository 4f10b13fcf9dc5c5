"""The write-ahead log: on-media format (FORMAT.md), volume and segments,
appender, reader, snapshots, compaction and the recovery planner."""
