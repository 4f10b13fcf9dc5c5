"""Benchmarks end through tools.common.report: strict JSON, where an undefined
figure (NaN, an infinite ratio) is written as null instead of stopping the run."""

from __future__ import annotations

import json
import math

import numpy as np

from concordia.tools.common import report


def test_non_finite_figures_become_null_in_the_file_and_on_stdout(tmp_path, capsys):
    doc = {"ratio": math.nan, "rows": [{"GBps": np.float32(2.5), "speedup": math.inf}, (1, -math.inf)]}
    out = tmp_path / "bench.json"
    report(doc, as_json=True, out=str(out), table=lambda d: "unused")
    for text in (out.read_text(), capsys.readouterr().out):
        got = json.loads(text)
        assert got == {"ratio": None, "rows": [{"GBps": 2.5, "speedup": None}, [1, None]]}
        assert "NaN" not in text and "Infinity" not in text
