"""The installed `concordia` and `concordia-wal` commands.

Every command needs the packages the library depends on (`crc32c` for the
log's checksums, numpy, ...), most of them only once the command runs, when
a plain import would end in a traceback midway.  These entry points import
the commands and the library's format module (which loads each of them)
inside a guard, before anything runs, so a missing package is one line
naming it and exit code 2, like any other usage error, for every command and
its --help alike.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["concordia", "concordia_wal"]

EXIT_USAGE = 2  # tools.common.EXIT_USAGE, which cannot be imported without the library


def _run(program: str, module: str) -> None:
    try:
        main = importlib.import_module(module, __package__).main
        importlib.import_module("concordia.wal.format")  # numpy and crc32c: what every command needs
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if not missing or missing == "concordia":
            raise
        print(f"{program}: error: needs the {missing!r} package, which is not installed "
              f"(pip install {missing})", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    main()


def concordia() -> None:
    """`concordia`: the demo and the standby."""
    _run("concordia", ".cli")


def concordia_wal() -> None:
    """`concordia-wal`: inspect, verify, recover, restore, compact, bench."""
    _run("concordia-wal", ".wal_cli")
