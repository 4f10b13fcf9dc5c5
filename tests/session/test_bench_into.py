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


def test_variants_run_alternated_with_the_default_on_the_same_log(tmp_path):
    """--variant runs readers of the same log under other environment
    settings, a round at a time after the default's: each variant's figures
    sit beside the default's with its ratio to them."""
    out = tmp_path / "into.json"
    res = CliRunner().invoke(main, ["bench", "into", "--quick", "--readers", "3", "--out", str(out),
                                    "--variant", "copy:CONCORDIA_RESTORE_READ=copy",
                                    "--variant", "threads:CONCORDIA_RESTORE_THREADS=2,CONCORDIA_PIN_SMALL_BYTES=0"])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert set(rep["variants"]) == {"copy", "threads"} and rep["identical"] is True
    assert rep["variants"]["threads"]["env"] == {"CONCORDIA_RESTORE_THREADS": "2", "CONCORDIA_PIN_SMALL_BYTES": "0"}
    base = rep["tiers"]["shm"]
    assert len(base["runs"]) == 3
    for v in rep["variants"].values():
        t = v["tiers"]["shm"]
        assert len(t["runs"]) == 3 and t["epoch"] == base["epoch"] and all(r["identical"] for r in t["runs"])
        assert t["vs_default"]["recover_s"] == pytest.approx(t["recover_s"] / base["recover_s"])
    assert "copy" in res.output and "threads" in res.output   # the table has a row each


def test_a_variant_the_environment_would_not_take_is_refused_before_any_work(tmp_path):
    """A variant that names no setting, a lower-case or empty variable, no name, the default's
    name or a name used twice is one line naming the option; the output is not written."""
    out = tmp_path / "into.json"
    for bad in (["x:"], ["x:restore=copy"], [":A=1"], ["default:A=1"], ["x:A=1", "x:B=2"], ["x:A"]):
        args = [a for v in bad for a in ("--variant", v)]
        res = CliRunner().invoke(main, ["bench", "into", "--quick", "--out", str(out), *args])
        assert res.exit_code == 2 and "--variant" in res.output and "Traceback" not in res.output, (bad, res.output)
        assert not out.exists()


def test_a_variant_whose_reader_fails_is_recorded_and_the_rest_go_on(tmp_path):
    """A variant whose environment stops its reader (Python cannot start with
    no standard library): its one line is kept as the variant's `error`, its
    later rounds are not run, and the default's and other variants' figures
    stand."""
    out = tmp_path / "into.json"
    res = CliRunner().invoke(main, ["bench", "into", "--quick", "--out", str(out),
                                    "--variant", f"broken:PYTHONHOME={tmp_path / 'none'}",
                                    "--variant", "copy:CONCORDIA_RESTORE_READ=copy"])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    broken = rep["variants"]["broken"]["tiers"]["shm"]
    assert set(broken) == {"error"} and "the reader ended" in broken["error"] and "\n" not in broken["error"]
    assert len(rep["variants"]["copy"]["tiers"]["shm"]["runs"]) == 2 and rep["identical"] is True
    assert "broken" in res.output and "failed:" in res.output
