"""The `concordia` and `concordia-wal` command lines."""
