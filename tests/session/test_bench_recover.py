"""`concordia-wal bench recover --quick` runs end to end and reports its ceiling."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_quick_json(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["bench", "recover", "--quick", "--tiers", "file", "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["ceiling"]["GBps"] > 0
    assert len(data["rows"]) == 2
    for row in data["rows"]:
        assert row["tier"] == "file" and row["bytes"] > 0
        assert 0 < row["ratio_to_ceiling"]
        assert row["reprefill_s"] > 0 and row["total_s"] > 0
        # the program's path too: a Session's writable open and recover()
        assert row["session_open_s"] > 0 and row["session_recover_s"] > 0
        assert row["session_total_s"] == pytest.approx(row["session_open_s"] + row["session_recover_s"])
        # and where its time went, as the session reports it
        assert list(row["session_phases"])[:3] == ["open", "targets", "plan"] and "check_copy" in row["session_phases"]


def test_bad_tier_is_a_usage_error():
    res = CliRunner().invoke(main, ["bench", "recover", "--quick", "--tiers", "tape"])
    assert res.exit_code == 2 and "tape" in res.output
