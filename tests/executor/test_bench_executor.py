"""Smoke test of `concordia-wal bench executor` (CPU mode, quick size) and its
one-line refusal where no GPU is usable."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

pytestmark = pytest.mark.timeout(120)


def test_cpu_quick_json(tmp_path):
    out = tmp_path / "e.json"
    r = CliRunner().invoke(main, ["bench", "executor", "--cpu", "--quick", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "executor" and doc["device"] == "cpu"
    assert doc["round_trip"]["executor"]["median_us"] > 0 and doc["round_trip"]["ratio_median"] > 0
    assert doc["throughput"]["thread_tasks_per_s"] > 0 and 0 < doc["throughput"]["ratio"]
    assert doc["checkpoint"]["executor_gb_per_s"] > 0 and doc["checkpoint"]["ratio"] > 0
    assert doc["hot_swap"]["swaps"] == 5 and doc["hot_swap"]["gap_median_us"] > 0


def test_cpu_table():
    r = CliRunner().invoke(main, ["bench", "executor", "--cpu", "--quick"])
    assert r.exit_code == 0, r.output
    assert "round trip" in r.output and "hot swap" in r.output


def test_gpu_mode_without_a_gpu_is_one_line():
    from conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: the GPU run is scripts/gpu/executor.sh")
    r = CliRunner().invoke(main, ["bench", "executor", "--quick"])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and r.output.startswith("error: gpu executor:")
    assert "Traceback" not in r.output
