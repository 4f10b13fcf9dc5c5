"""Smoke test of `concordia-wal bench executor-session` on the CPU (numpy
session, CPU executor, quick size) and its refusal of a bad --regions."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.wal_cli import main


def test_cpu_quick_json_says_what_ran_and_recovers_identical(tmp_path):
    out = tmp_path / "xs.json"
    r = CliRunner().invoke(main, ["bench", "executor-session", "--cpu", "--quick", "--regions", "1,8", "--json",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "executor-session" and doc["device"] == "cpu" and doc["regions_xp"] == "numpy"
    assert doc["executor"]["device_epoch_handler"] is False
    assert set(doc["stall"]) >= {"epochs_committed", "recovered_identical"}
    assert doc["stall"]["stall"] == "python_busy_loop"
    # a stall that releases the GIL leaves the consumer committing; every epoch checked recovers exactly
    assert doc["stall_variants"]["time.sleep"]["epochs_committed"] > 0
    assert all(v["recovered_identical"] and not v["errors"] for v in doc["stall_variants"].values())
    assert set(doc["ckpt_ms"]) == {"host", "host_mapped", "resident", "auto"}
    assert all(set(row) == {"1", "8"} and all(x > 0 for x in row.values()) for row in doc["ckpt_ms"].values())
    assert doc["ckpt_detail"]["resident"]["8"]["executor"] == "resident"
    assert doc["ckpt_detail"]["host"]["8"]["executor"] == "host"
    assert doc["ckpt_detail"]["auto"]["8"]["executor"] == "host"  # a numpy session: auto keeps the caller's thread
    assert "residency" not in doc


def test_a_bad_regions_list_is_a_usage_error():
    r = CliRunner().invoke(main, ["bench", "executor-session", "--cpu", "--regions", "1,x"])
    assert r.exit_code == 2 and "is not a list of region counts" in r.output


def test_parts_run_only_what_they_name_and_an_unknown_part_is_a_usage_error():
    r = CliRunner().invoke(main, ["bench", "executor-session", "--cpu", "--quick", "--regions", "1",
                                  "--parts", "ckpt", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["parts"] == ["ckpt"] and "stall" not in doc
    assert set(doc["ckpt_ms"]) == {"host", "host_mapped", "resident", "auto"}
    assert set(doc["goals"]) == {"resident_ckpt<=host_1"}
    # the GPU's parts name nothing on the CPU: no row, no goal
    r = CliRunner().invoke(main, ["bench", "executor-session", "--cpu", "--quick", "--parts", "recover", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert "recover" not in doc and doc["goals"] == {}
    r = CliRunner().invoke(main, ["bench", "executor-session", "--cpu", "--parts", "stall,recoverr"])
    assert r.exit_code == 2 and "unknown part 'recoverr'" in r.output
