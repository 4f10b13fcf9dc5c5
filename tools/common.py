"""What every command line shares: the error boundary (library errors become
one line and an exit code, never a traceback), JSON output and size parsing.

Exit codes: 0 clean, 1 problems found in the data, 2 usage or I/O error.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import click

from concordia.devmem.errors import ConcordiaError

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2


def guarded(fn):
    """Run a click command body; turn any ConcordiaError or OSError into one line
    on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConcordiaError as exc:
            click.echo(f"error: {exc.one_line()}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {where}{exc.strerror or exc}", err=True)
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


def emit_json(obj) -> None:
    """Print one JSON document (stable key order, no NaN)."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=_jsonable))


def _jsonable(o):
    if hasattr(o, "to_json"):
        return o.to_json()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (bytes, bytearray)):
        return o.hex()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'64M', '1GiB', '4096' -> bytes (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise click.BadParameter(f"not a size: {text!r} (use e.g. 4096, 64M, 1GiB)")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


SIZE = SizeType()
