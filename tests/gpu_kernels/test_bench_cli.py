"""`concordia-wal bench checkpoint`: the CPU variant runs and reports every
part; without a CUDA device the GPU variant ends in one line, exit code 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main
from tests.conftest import gpu_unavailable_reason

SMALL = ["--sizes", "1M,2M", "--fractions", "page,0.5", "--e2e-sizes", "1M", "--stage-region", "2M",
         "--kv-cache-sizes", "1G,4G", "--reps", "2"]


def test_cpu_variant_reports_every_part(tmp_path):
    out = tmp_path / "c.json"
    res = CliRunner().invoke(main, ["bench", "checkpoint", "--cpu", "--quick", "--json", "--out", str(out),
                                    "--plot", str(tmp_path / "c.png"), *SMALL])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc == json.loads(out.read_text())
    assert len(doc["detect"]) == 4 and all(r["diff_read_Bps"] > 0 for r in doc["detect"])
    assert [r["dirty_pages"] for r in doc["stage"]] == [1, 256]
    assert doc["e2e"][0]["cpu_checkpoint_s"] > 0 and len(doc["kv"]) == 2
    assert (tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.parametrize("parts", ["kv", "detect,e2e"])
def test_plot_of_some_parts_marks_the_others_not_run(tmp_path, parts):
    # log axes without data cannot be drawn: a --parts run on the H200 ended
    # in "unexpected failure" at the plot
    res = CliRunner().invoke(main, ["bench", "checkpoint", "--cpu", "--quick", "--parts", parts, "--json",
                                    "--plot", str(tmp_path / "p.png"), *SMALL])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert sorted(k for k in ("detect", "stage", "e2e", "kv") if doc[k]) == sorted(parts.split(","))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_table_by_default():
    res = CliRunner().invoke(main, ["bench", "checkpoint", "--cpu", *SMALL])
    assert res.exit_code == 0 and "shadow diff" in res.output and "kv scanner" in res.output


def test_without_a_device_one_line_exit_2():
    if gpu_unavailable_reason() is None:
        pytest.skip("a CUDA device is present: the GPU variant runs in scripts/gpu/kernels.sh")
    res = CliRunner().invoke(main, ["bench", "checkpoint", "--quick"])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA device is needed" in lines[0] and "Traceback" not in res.output


@pytest.mark.parametrize("args, option", [
    (["--fractions", "page,2.0"], "--fractions"),
    (["--fractions", "half"], "--fractions"),
    (["--sizes", "0"], "--sizes"),
    (["--e2e-sizes", "1Q"], "--e2e-sizes"),
    (["--reps", "0"], "--reps"),
    (["--parts", "detect,nope"], "--parts"),
])
def test_bad_option_is_a_usage_error_naming_it(args, option):
    # checked before anything runs, on the GPU path too
    for mode in (["--cpu"], []):
        res = CliRunner().invoke(main, ["bench", "checkpoint", *mode, *args])
        assert res.exit_code == 2, res.output
        assert option in res.output and "Traceback" not in res.output
        assert "unexpected failure" not in res.output
