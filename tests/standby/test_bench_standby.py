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
