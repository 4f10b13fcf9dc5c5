"""CI smoke run of `concordia-wal bench append --quick` (one record size, both
media): the JSON has every figure beside its ceiling, and the verify pass ran."""

from __future__ import annotations

import json

from click.testing import CliRunner

from concordia.tools.bench.append import command


def test_bench_append_quick_json(tmp_path):
    out = tmp_path / "append.json"
    r = CliRunner().invoke(command, ["--quick", "--pages", "64", "--total", "8M", "--dir", str(tmp_path),
                                     "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert json.loads(out.read_text()) == doc
    media = {row["medium"] for row in doc["results"]}
    assert media == {"shm", "file"}
    for row in doc["results"]:
        assert row["record_bytes"] == 64 * 4096
        for k in ("concordia", "ceiling", "sqlite", "lmdb"):
            assert row[f"{k}_gb_per_s"] > 0
        assert row["ratio_to_ceiling"] > 0
    assert doc["verify"]["ok"] and doc["verify"]["bytes"] > 0
    assert set(doc["goals"]) >= {"verify_ge_5_gb_per_s"}


def test_bench_append_table_and_bad_args(tmp_path):
    r = CliRunner().invoke(command, ["--quick", "--pages", "1", "--total", "1M", "--medium", "shm"])
    assert r.exit_code == 0 and "ratio" in r.output and "verify" in r.output
    r = CliRunner().invoke(command, ["--pages", "2000"])
    assert r.exit_code == 2
