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


def test_table_has_a_row_per_variant_and_shape():
    # the table of a run's JSON (the run itself needs a GPU: scripts/gpu/instrument.sh)
    from concordia.tools.bench_instrument import SHAPES, VARIANTS, _table

    rows = [{"variant": v, "median_us": 10.0 + i, "overhead": i / 100, "bandwidth_GBps": 3000.0 - i,
             "ratio_to_copy": 0.9, "registers": None if i else 12} for i, v in enumerate(VARIANTS)]
    doc = {"ceiling": {"bandwidth_GBps": 3300.0}, "goal": {"exit_hooks_max_overhead": 0.05},
           "shapes": [{"shape": s, "launch": {"grid": 4, "block": 256}, "spread": 0.01, "variants": rows}
                      for s in SHAPES]}
    lines = _table(doc).splitlines()
    assert lines[0].startswith("ceiling (D2D copy): 3300 GB/s") and "at most 5%" in lines[0]
    assert len(lines) == 1 + len(SHAPES) * (2 + len(VARIANTS))
    assert lines[3].split()[:3] == ["plain", "10.0", "0.0%"] and lines[3].split()[-1] == "12"
    assert lines[4].split()[-1] == "?"      # registers unknown
