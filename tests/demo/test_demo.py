"""`concordia demo` on the CPU: killed at several points, always bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from concordia.demo import pick_kill_step, run_demo
from concordia.errors import DemoError
from concordia.tools.cli import main

STEPS = 40


@pytest.mark.parametrize("kill_at", [5, 18, 39, "random"])
def test_killed_worker_recovers_bit_identical(tmp_path, kill_at):
    rep = run_demo(log=f"file:{tmp_path / 'demo.log'}", steps=STEPS, kill_at=kill_at, every=4, device="cpu")
    assert rep["identical"], rep["compared"]
    assert all(rep["compared"].values())
    w = rep["worker"]
    if kill_at != "random":
        assert w["killed_after_step"] == kill_at
    # the kill lands between checkpoints: work since the last commit is recomputed
    assert w["last_commit_step"] < w["killed_after_step"]
    assert rep["recovery"]["recomputed_steps"] == w["killed_after_step"] - w["last_commit_step"]
    assert rep["recovery"]["resumed_at_step"] == w["last_commit_step"]
    assert [p["phase"] for p in rep["timeline"]] == ["detect", "isolate", "restore", "reintegrate"]
    assert all(p["ms"] >= 0 for p in rep["timeline"])
    assert rep["recovery"]["restore_bytes"] >= rep["workload"]["state_bytes"]["adapter"]
    assert (tmp_path / "demo.log").exists()  # left for concordia-wal


def test_random_kill_points_fall_between_checkpoints():
    import random

    rng = random.Random(1)
    for _ in range(200):
        k = pick_kill_step(40, 4, rng)
        assert 5 <= k < 40 and k % 4


def test_cli_json_and_exit_code(tmp_path):
    log = f"file:{tmp_path / 'cli.log'}"
    r = subprocess.run([sys.executable, "-m", "concordia.tools.cli", "demo", "--log", log, "--steps", "24",
                        "--kill-at", "11", "--device", "cpu", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["identical"] is True and rep["worker"]["killed_after_step"] == 11


def test_cli_prints_the_timeline(tmp_path):
    res = CliRunner().invoke(main, ["demo", "--log", f"file:{tmp_path / 't.log'}", "--steps", "20",
                                    "--kill-at", "7", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for word in ("detect", "isolate", "restore", "reintegrate", "BIT-IDENTICAL", "SIGKILL after step 7"):
        assert word in res.output


@pytest.mark.parametrize("argv, words", [
    (["--kill-at", "500"], ["--kill-at 500"]),
    (["--steps", "4", "--every", "4"], ["no step to kill"]),
])
def test_cli_bad_input_is_one_line(tmp_path, argv, words):
    res = CliRunner().invoke(main, ["demo", "--log", f"file:{tmp_path / 'b.log'}", "--device", "cpu", *argv])
    assert res.exit_code == 2
    err = res.output.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    for w in words:
        assert w in err[0]


def test_a_gpu_demo_without_a_gpu_is_refused_before_any_folder_is_made(tmp_path):
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is importable here: the GPU demo runs (GPU tests cover it)")
    except Exception:
        pass
    res = CliRunner().invoke(main, ["demo", "--log", f"file:{tmp_path / 'a' / 'b' / 'x.log'}", "--device", "gpu"])
    assert res.exit_code == 2
    err = res.output.strip().splitlines()
    assert len(err) == 1 and "no usable GPU" in err[0] and "use --device cpu" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_demo_error_is_a_concordia_error():
    with pytest.raises(DemoError):
        run_demo(steps=1, device="cpu")


def test_warm_up_steps_until_the_model_has_run():
    """The GPU warm-up loads the model's kernels by stepping a scratch workload;
    the reference workload admits nobody in its first steps, so one step would
    load none of them (the first recomputed step then paid for them)."""
    from concordia.demo import warm_model
    from concordia.demo.workload import Workload, WorkloadConfig, make_requests

    cfg = WorkloadConfig(seed=0)
    first = min(r.arrival for r in make_requests(cfg))
    wl = Workload(cfg)
    n = warm_model(wl)
    assert n == first + 1 and wl.step_index == n
    with pytest.raises(DemoError, match="ran no sequence in its first 2 steps"):
        warm_model(Workload(cfg), max_steps=min(2, first))
