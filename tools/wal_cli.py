"""`concordia-wal`: inspect, verify, compact, snapshot and restore a log."""

from __future__ import annotations

import click

from concordia import __version__

from .bench import bench


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="concordia-wal")
def main():
    """Inspect, verify, compact, snapshot and restore Concordia logs.

    A LOG is named the same way everywhere: dax:/dev/dax0.0, pmem:/mnt/pmem/log,
    shm:NAME, file:PATH, or a plain path (the tier is detected).

    Exit codes: 0 clean, 1 problems found, 2 usage or I/O error.
    """


main.add_command(bench)
