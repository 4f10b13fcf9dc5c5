"""`concordia-wal bench standby --quick` runs end to end on the host: a primary
SIGKILLed, a warm standby's takeover timed from the kill to its first step."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_quick_run_reports_kill_to_decoding(tmp_path):
    out = tmp_path / "standby.json"
    res = CliRunner().invoke(main, ["bench", "standby", "--quick", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["cause"] == "the primary's writer lock came free" and rep["epoch"] == 2
    parts = rep["kill_to_detect_s"] + rep["isolate_s"] + rep["restore_s"] + rep["first_decode_s"]
    assert rep["kill_to_decoding_s"] > 0 and abs(rep["kill_to_decoding_s"] - parts) < 1e-6
    assert [p["phase"] for p in rep["timeline"]] == ["detect", "isolate", "restore", "reintegrate"]
    assert rep["ceiling"]["GBps"] > 0 and rep["restore_ratio_to_ceiling"] > 0


def test_follow_runs_a_warm_and_a_hot_standby_on_a_primary_checkpointing_every_step(tmp_path):
    out = tmp_path / "follow.json"
    res = CliRunner().invoke(main, ["bench", "standby", "--quick", "--follow", "--steps-s", "0.3", "--json",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    warm, hot = rep["warm"], rep["hot"]
    assert warm["primary"]["checkpoints_every_step"] and hot["primary"]["checkpoints_every_step"]
    assert "mirror" not in warm["restore"] and warm["restore_GBps"] > 0
    assert "mirror" in hot["restore"] and hot["restore_GBps"] is None
    assert hot["restore"]["mirror"]["epoch"] == hot["epoch"] > 2
    assert rep["hot_vs_warm"] == hot["kill_to_decoding_s"] / warm["kill_to_decoding_s"] > 0
    assert rep["hot_vs_warm_to_restored"] == hot["kill_to_restored_s"] / warm["kill_to_restored_s"] > 0
