"""Every benchmark's --help shows its examples one command a line, as they
must be typed (click rewraps a docstring paragraph unless it is marked)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

BENCHES = main.commands["bench"].list_commands(None)


def test_every_benchmark_is_listed():
    assert {"append", "checkpoint", "compact", "devmem", "executor", "instrument", "recover",
            "restore"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_examples_print_one_command_a_line(name):
    res = CliRunner().invoke(main, ["bench", name, "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Example:")
    block = []
    for line in lines[start + 1:]:
        if line.strip() == "":
            if block:
                break
            continue
        block.append(line.strip())
    assert block, f"bench {name}: no example under 'Example:'"
    for line in block:
        assert line.startswith(f"concordia-wal bench {name}"), f"bench {name}: example line {line!r}"
        assert line.count("concordia-wal") == 1, f"bench {name}: two commands on one line: {line!r}"
