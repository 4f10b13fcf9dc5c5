"""`concordia`: the application-side command line (the fault-tolerant demo)."""

from __future__ import annotations

import sys

import click

from concordia import __version__

from .common import EXIT_OK, EXIT_PROBLEMS, emit_json, guarded


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="concordia")
def main():
    """Concordia: exact GPU state back after a crash."""


class _KillAt(click.ParamType):
    name = "STEP|random"

    def convert(self, value, param, ctx):
        if value == "random" or isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a step number nor 'random'", param, ctx)


@main.command()
@click.option("--log", "log", default="file:./concordia-data/demo.log", show_default=True,
              help="Log to checkpoint into (file:PATH, shm:NAME, pmem:PATH, dax:/dev/daxX.Y); "
                   "formatted afresh, left in place afterwards.")
@click.option("--steps", default=160, show_default=True, type=click.IntRange(2, None),
              help="Decode steps of the whole run.")
@click.option("--kill-at", default="random", show_default=True, type=_KillAt(),
              help="Step after which the worker is SIGKILLed (random: between two checkpoints).")
@click.option("--every", default=4, show_default=True, type=click.IntRange(1, None),
              help="Checkpoint every N steps.")
@click.option("--seed", default=0, show_default=True, help="Seed of the model weights and requests.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Where the model runs (auto: the GPU when CuPy finds one).")
@click.option("--force", is_flag=True,
              help="Format --log even when it holds something other than a Concordia log.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@guarded
def demo(log, steps, kill_at, every, seed, device, force, as_json):
    """Run a decode loop, SIGKILL it, recover it from the log in a fresh
    process and check the result is bit-identical to an uninterrupted run.
    --log is formatted afresh: a Concordia log there is replaced, anything
    else is refused (exit 2, left unchanged) unless --force.

    Prints the recovery timeline (detect, isolate, restore, reintegrate) and
    the bytes moved.  Exit 0 when bit-identical, 1 when not.

    Example:

    \b
        concordia demo --steps 96 --kill-at 41
        concordia-wal info file:./concordia-data/demo.log
    """
    from concordia.demo import format_report, run_demo

    progress = None if as_json else (lambda msg: click.echo(f"... {msg}", err=True))
    rep = run_demo(log=log, steps=steps, kill_at=kill_at, seed=seed, every=every, device=device,
                   progress=progress, force=force)
    if as_json:
        emit_json(rep)
    else:
        click.echo(format_report(rep))
    sys.exit(EXIT_OK if rep["identical"] else EXIT_PROBLEMS)


if __name__ == "__main__":
    main()
