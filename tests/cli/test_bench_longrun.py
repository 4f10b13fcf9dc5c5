"""`concordia-wal bench longrun`: a short run of both configurations writes the
keys the results pages read, and bad options are one-line usage errors."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_a_short_longrun_reports_both_configurations(tmp_path):
    out = tmp_path / "longrun.json"
    res = CliRunner().invoke(main, ["bench", "longrun", "--epochs", "600", "--noretain-epochs", "100",
                                    "--state", "256K", "--log-size", "8M", "--samples", "3", "--bins", "5",
                                    "--log", f"file:{tmp_path / 'log'}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert set(doc["configs"]) == {"retain", "noretain"}
    for c in doc["configs"].values():
        assert c["recovery_s_by_epoch"][0][0] == min(200, c["epochs"]) and c["recovery_s_by_epoch"][-1][0] == c["epochs"]
        assert len(c["ckpt_ms_p99_by_epoch"]) == 5 and all(v > 0 for _, v in c["ckpt_ms_p99_by_epoch"])
    r = doc["configs"]["retain"]
    assert r["epochs"] == 600 and r["retention"]["bases"] >= 1 and r["oldest_epoch"] > 0
    assert doc["during_compaction"] > 0 and doc["without"] > 0
    assert "checkpoint p99 during compaction" in res.output
    assert not (tmp_path / "log").exists()  # the benchmark's log is removed


def test_a_state_that_is_not_whole_pages_is_a_usage_error():
    res = CliRunner().invoke(main, ["bench", "longrun", "--state", "5000"])
    assert res.exit_code == 2 and "--state" in res.output
