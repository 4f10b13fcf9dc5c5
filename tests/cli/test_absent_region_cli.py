"""`concordia-wal restore` of a region at an epoch where it has no state (it
was registered after it) is refused in one line on stderr, exit 1 (nothing
to recover: docs/cli.md, Exit codes), and no output file is left behind;
`recover --plan` shows it as absent, not as a region it restores."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

import concordia
from concordia.tools.wal_cli import main

N = 2 * 4096


@pytest.fixture
def late_log(tmp_path):
    """A checkpointed at epoch 1, B registered after it and first written at
    epoch 2, C registered after the last commit (never written)."""
    path = tmp_path / "late.log"
    with concordia.Session(f"file:{path}", size=16 << 20, segment_size=1 << 20) as s:
        s.register("A", np.full(N, 1, np.uint8))
        s.checkpoint()
        b = np.full(N, 7, np.uint8)
        s.register("B", b)
        s.checkpoint()
        s.register("C", np.full(N, 9, np.uint8))
    return path, b


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_restore_refuses_an_absent_region_in_one_line_and_writes_nothing(late_log, tmp_path):
    path, b = late_log
    out = tmp_path / "b.npy"
    res = _cli("restore", path, "--region", "B", "--epoch", 1, "--out", out)
    assert res.exit_code == 1, res.output
    assert res.stderr.splitlines() == [
        f"error: file:{path}: region 'B' has no state at epoch 1 (it was first written at epoch 2) "
        "(restore --epoch 2 or later)"]
    assert sorted(os.listdir(tmp_path)) == ["late.log"]  # no .npy, no temporary

    out.write_bytes(b"keep me")  # an output it would replace is left as it was
    res = _cli("restore", path, "--region", "C", "--out", out, "--force")
    assert res.exit_code == 1 and len(res.stderr.splitlines()) == 1
    assert "region 'C' has no state at epoch 2 (no committed epoch holds it yet)" in res.stderr
    assert out.read_bytes() == b"keep me" and sorted(os.listdir(tmp_path)) == ["b.npy", "late.log"]

    # at an epoch that holds it, the same region restores
    res = _cli("restore", path, "--region", "B", "--epoch", 2, "--out", out, "--force")
    assert res.exit_code == 0, res.output
    assert np.array_equal(np.load(out), b)


def test_plan_shows_the_region_absent_not_restorable(late_log):
    path, _ = late_log
    res = _cli("recover", path, "--plan", "--epoch", 1, "--json")
    assert res.exit_code == 1, res.output
    d = json.loads(res.stdout)
    assert set(d["regions"]) == {"A"} and d["epoch"] == 1 and d["error"] is None
    assert {n: (x["epoch"], x["first_epoch"]) for n, x in d["absent"].items()} == {"B": (1, 2), "C": (1, None)}
    assert d["exit_code"] == 1
    res = _cli("recover", path, "--plan", "--epoch", 1)
    assert "absent   region 'B' has no state at epoch 1 (it was first written at epoch 2)" in res.stdout
