"""`concordia-wal bench into --quick` runs end to end on the host: a writer
process protects bf16 tensors, fresh reader processes recover them into their
own zeroed tensors, and the figures say how, beside the ceiling."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

pytest.importorskip("torch", reason="bench into recovers into PyTorch tensors")


def test_quick_run_recovers_every_tensor_in_fresh_processes(tmp_path):
    out = tmp_path / "into.json"
    res = CliRunner().invoke(main, ["bench", "into", "--quick", "--deltas", "3", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    shm = rep["tiers"]["shm"]
    assert rep["identical"] is True and len(shm["runs"]) == 2
    assert shm["writer"]["epoch"] == 4 and shm["epoch"] == 4   # the base and three deltas, the last recovered
    assert shm["bytes"] == shm["writer"]["bytes"] == 4 << 20
    assert shm["total_s"] == pytest.approx(shm["open_s"] + shm["recover_s"])
    assert shm["ratio_to_h2d"] == pytest.approx(shm["GBps"] / shm["h2d_GBps"])
    assert {"open", "plan"} <= set(shm["phases"])


def test_an_output_that_exists_is_refused_before_any_work(tmp_path):
    out = tmp_path / "into.json"
    out.write_text("mine")
    res = CliRunner().invoke(main, ["bench", "into", "--quick", "--out", str(out)])
    assert res.exit_code == 2 and out.read_text() == "mine"
    assert "Traceback" not in res.output


def test_an_unknown_tier_is_one_line(tmp_path):
    res = CliRunner().invoke(main, ["bench", "into", "--tiers", "shm,tape"])
    assert res.exit_code == 2 and "unknown tier tape" in res.output


def test_a_profile_file_in_no_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCORDIA_INTO_PROFILE", str(tmp_path / "gone" / "profile.txt"))
    out = tmp_path / "into.json"
    res = CliRunner().invoke(main, ["bench", "into", "--quick", "--out", str(out)])
    assert res.exit_code == 2 and "CONCORDIA_INTO_PROFILE" in res.output and "Traceback" not in res.output
    assert not out.exists()
