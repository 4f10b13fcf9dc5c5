"""`concordia`: the application-side command line (the fault-tolerant demo)."""

from __future__ import annotations

import click

from concordia import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="concordia")
def main():
    """Concordia: exact GPU state back after a crash."""
