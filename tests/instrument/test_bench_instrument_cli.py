"""The benchmark's command line: help, and the one-line error without a GPU."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from concordia.tools.bench_instrument import command
from tests.conftest import gpu_unavailable_reason


def test_help():
    r = CliRunner().invoke(command, ["--help"])
    assert r.exit_code == 0 and "Example:" in r.output and "--json" in r.output


def test_without_a_gpu_it_fails_in_one_line():
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: scripts/gpu/instrument.sh runs the real benchmark")
    r = CliRunner().invoke(command, ["--quick", "--json"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0]
    assert "Traceback" not in r.output
