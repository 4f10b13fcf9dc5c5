"""`concordia-wal bench`: every benchmark is a module `concordia.tools.bench.<name>`
that defines a click command named `command`; this group collects them, so the
benchmarks live apart from the product and no one file is shared.  Kernels and
helpers only a benchmark uses sit here beside it.

Every benchmark prints a table, writes JSON (`--json` to stdout, `--out FILE`),
and reports its figures as ratios to a ceiling measured in the same run.
"""

from __future__ import annotations

import importlib
import pkgutil

import click


class _BenchGroup(click.Group):
    def _load(self):
        if getattr(self, "_loaded", False):
            return
        self._loaded = True
        for info in pkgutil.iter_modules(__path__):
            mod = importlib.import_module(f"{__name__}.{info.name}")
            cmd = getattr(mod, "command", None)
            if isinstance(cmd, click.Command):
                self.add_command(cmd)

    def list_commands(self, ctx):
        self._load()
        return super().list_commands(ctx)

    def get_command(self, ctx, name):
        self._load()
        return super().get_command(ctx, name)


@click.group(cls=_BenchGroup)
def bench():
    """Benchmarks: each prints a table and writes JSON, with ceilings measured
    in the same run.

    Example:

        concordia-wal bench devmem --json
    """
