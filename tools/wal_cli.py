"""`concordia-wal`: inspect, verify, compact, snapshot and restore a log.

One click function per subcommand, each in the module of its kind:
`wal_cmd_inspect` (format, info, dump), `wal_cmd_check` (verify, recover),
`wal_cmd_state` (compact, snapshot, restore).  Exit codes and the JSON
schemas are documented in docs/cli.md.
"""

from __future__ import annotations

import click

from concordia import __version__

from .bench import bench
from .common import OneLineGroup
from .wal_cmd_check import recover_cmd, verify_cmd
from .wal_cmd_inspect import dump_cmd, format_cmd, info_cmd
from .wal_cmd_state import compact_cmd, restore_cmd, snapshot_grp


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="concordia-wal")
def main():
    """Inspect, verify, compact, snapshot and restore Concordia logs.

    A LOG is named the same way everywhere: dax:/dev/dax0.0, pmem:/mnt/pmem/log,
    shm:NAME, file:PATH, or a plain path (the tier is detected).

    Exit codes: 0 clean, 1 problems found, 2 usage or I/O error, 130 interrupted, 143 terminated.
    """


for _cmd in (format_cmd, info_cmd, dump_cmd, verify_cmd, recover_cmd, compact_cmd, snapshot_grp, restore_cmd):
    main.add_command(_cmd)
main.add_command(bench)
