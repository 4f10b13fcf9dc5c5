"""Tried as a new user would: every `Example:` line of every subcommand's
--help runs as written (in a directory holding ./concordia-data/demo.log,
the log `concordia demo` leaves) and exits 0."""

from __future__ import annotations

import shlex
import subprocess

import click
import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

from .conftest import WAL


def _commands(group: click.Group, prefix=()):
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if name == "bench":
            continue  # benchmarks carry their own examples and smoke tests
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def examples(cmd: click.Command) -> list[str]:
    doc = cmd.help or ""
    assert "Example:" in doc, f"{cmd.name}: no Example: block in its help"
    block = doc.split("Example:", 1)[1]
    return [ln.strip() for ln in block.splitlines() if ln.strip().startswith("concordia-wal ")]


ALL = [(" ".join(path), ex) for path, cmd in _commands(main) for ex in examples(cmd)]


def test_every_subcommand_has_an_example():
    names = {" ".join(p) for p, _ in _commands(main)}
    assert {"format", "info", "dump", "verify", "compact", "snapshot", "snapshot list",
            "snapshot create", "restore", "recover"} <= names
    assert {n for n, _ in ALL} == names


@pytest.mark.parametrize("name,example", ALL, ids=[f"{n}:{i}" for i, (n, _) in enumerate(ALL)])
def test_example_runs(workdir, name, example):
    argv = shlex.split(example)[1:]
    res = CliRunner().invoke(main, argv)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 0, (example, res.output)
    help_text = CliRunner().invoke(main, argv[: len(name.split())] + ["--help"]).output
    assert example in help_text


def test_examples_through_the_shell(workdir):
    """Three of them as a shell runs them, the entry point included."""
    for example in [e for n, e in ALL if n in ("info", "verify", "recover")][:3]:
        r = subprocess.run(example.replace("concordia-wal", shlex.quote(WAL), 1), shell=True,
                           capture_output=True, text=True, timeout=60, cwd=workdir)
        assert r.returncode == 0, (example, r.stderr)


def test_examples_are_in_the_reference():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md"), encoding="utf-8").read()
    missing = [e for _, e in ALL if e not in doc]
    assert not missing, f"docs/cli.md lacks the --help examples {missing}"


def test_concordia_examples_print_as_written():
    """`concordia demo --help` keeps each example on a line of its own (click
    rewraps a paragraph unless it is marked as preformatted); the demo itself
    is run by tests/demo."""
    from concordia.tools.cli import main as app_main

    for name, cmd in app_main.commands.items():
        lines = [ln.strip() for ln in cmd.help.split("Example:", 1)[1].splitlines()
                 if ln.strip().startswith("concordia")]
        assert lines, f"{name}: no example"
        shown = CliRunner().invoke(app_main, [name, "--help"]).output
        assert all(f"\n      {ln}\n" in shown for ln in lines), (lines, shown)
