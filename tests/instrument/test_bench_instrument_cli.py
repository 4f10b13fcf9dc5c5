"""The benchmark's command line: help, and the one-line error without a GPU."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from concordia.tools.bench.instrument import command
from tests.conftest import gpu_unavailable_reason


def test_help():
    r = CliRunner().invoke(command, ["--help"])
    assert r.exit_code == 0 and "Example:" in r.output and "--json" in r.output


def test_without_a_gpu_it_fails_in_one_line():
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: scripts/gpu/instrument.sh runs the real benchmark")
    r = CliRunner().invoke(command, ["--quick", "--json"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0]
    assert "Traceback" not in r.output


def test_table_has_a_row_per_variant_and_shape():
    # the table of a run's JSON (the run itself needs a GPU: scripts/gpu/instrument.sh)
    from concordia.tools.bench.instrument import SHAPES, VARIANTS, _table

    rows = [{"variant": v, "median_us": 10.0 + i, "overhead": i / 100, "bandwidth_GBps": 3000.0 - i,
             "ratio_to_copy": 0.9, "registers": None if i else 12} for i, v in enumerate(VARIANTS)]
    doc = {"ceiling": {"bandwidth_GBps": 3300.0}, "goal": {"exit_hooks_max_overhead": 0.05},
           "shapes": [{"shape": s, "launch": {"grid": 4, "block": 256}, "spread": 0.01, "variants": rows}
                      for s in SHAPES]}
    lines = _table(doc).splitlines()
    assert lines[0].startswith("ceiling (D2D copy): 3300 GB/s") and "at most 5%" in lines[0]
    assert len(lines) == 1 + len(SHAPES) * (2 + len(VARIANTS))
    assert lines[3].split()[:3] == ["plain", "10.0", "0.0%"] and lines[3].split()[-1] == "12"
    assert lines[4].split()[-1] == "?"      # registers unknown


def test_every_variant_rewrites_and_edits_the_bench_kernels(tmp_path):
    # what `bench instrument` does on the GPU before it times anything: each
    # variant's options give the counting it names, the edited variants find
    # their text in both kernels, and the result assembles
    from concordia.instrument.rewriter import Options, rewrite
    from concordia.tools.bench.instrument import EDITS, SETTINGS, SRC
    from tests.instrument.conftest import nvcc_ptx, ptxas

    src = tmp_path / "bench.cu"
    src.write_text(SRC)
    text = nvcc_ptx(src, tmp_path).read_text()
    for variant, settings in SETTINGS.items():
        opts = {k: v for k, v in settings.items() if k != "gate"}
        res = rewrite(text, Options(**opts))
        want = opts.get("pause_gate", True)
        assert res.options.pause_gate == want, variant
        ptx = res.ptx
        for old, new, least in EDITS.get(variant, []):
            assert ptx.count(old) >= least, (variant, old)
            ptx = ptx.replace(old, new)
        p = ptxas(ptx, tmp_path)
        assert p.returncode == 0, f"{variant}: {p.stderr}"
