"""Smoke test of `concordia-wal bench devmem` (the quick size)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_quick_json(tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "devmem", "--quick", "--json", "--out", str(out),
                                  "--tier", "memory", "--tier", "shm", "--tier", "file",
                                  "--dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "devmem" and doc["ceiling"]["gb_per_s"] > 0
    assert [row["tier"] for row in doc["results"]] == ["memory", "shm", "file"]
    for row in doc["results"]:
        assert row["gb_per_s"] > 0 and row["ratio_to_memcpy"] > 0
    assert {r["tier"]: r["persist_path"] for r in doc["results"]}["file"] == "msync"
    assert list(tmp_path.iterdir()) == [out]            # scratch logs removed


def test_table_and_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["bench", "devmem", "--quick", "--tier", "memory"])
    assert r.exit_code == 0 and "ratio" in r.output and "memory" in r.output
    r = CliRunner().invoke(main, ["bench", "devmem", "--quick", "--dir", str(tmp_path / "no")])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_size_below_a_page_is_a_usage_error():
    # sizes are cut to whole pages before they are checked, so nothing maps 0 bytes
    r = CliRunner().invoke(main, ["bench", "devmem", "--size", "100", "--tier", "memory"])
    assert r.exit_code == 2 and "4 KiB page" in r.output and "Traceback" not in r.output
