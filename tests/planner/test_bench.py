"""Smoke runs of `concordia-wal bench restore` and `bench compact` (quick sizes)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_restore_quick_json(tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", "restore", "--quick", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "restore" and doc["ceiling"]["gb_per_s"] > 0
    assert doc["plan"]["bytes_to_read"] == doc["restored_bytes"] < doc["plan"]["naive_bytes"]
    for row in doc["results"]:
        assert row["gb_per_s"] > 0 and row["ratio_to_memcpy"] > 0


def test_compact_quick_json_and_table():
    r = CliRunner().invoke(main, ["bench", "compact", "--quick", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["benchmark"] == "compact" and [x["source"] for x in doc["results"]] == ["fold", "live"]
    assert doc["plan_bytes_after"] == doc["region_bytes"] and doc["segments_freed"] >= 0
    r = CliRunner().invoke(main, ["bench", "compact", "--quick"])
    assert r.exit_code == 0 and "ratio" in r.output


def test_bad_options_are_one_line():
    r = CliRunner().invoke(main, ["bench", "restore", "--quick", "--dirty", "2"])
    assert r.exit_code == 2 and "Traceback" not in r.output
