"""The coordinated epoch and one rank replaced, on gloo with several processes (CPU)."""

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from concordia.demo import tp
from concordia.group import committed_epochs, group_epoch


@pytest.mark.parametrize("phase", ["after_reduce"])
def test_replace_one_rank_bit_identical(tmp_path, phase):
    steps = 6
    base = tp.run(world=2, steps=steps, workdir=str(tmp_path / "base"))
    got = tp.run(world=2, steps=steps, kill=(1, 3, phase), workdir=str(tmp_path / "kill"))
    for r in range(2):
        for k in ("x", "kv", "out"):
            assert got["ranks"][r][k] == base["ranks"][r][k], (r, k)
    phases = [p["phase"] for p in got["timeline"]]
    assert phases == ["detect", "isolate", "restore", "reintegrate"]
    why = {r: got["ranks"][r]["events"]["rejoin"]["why"] for r in range(2)}
    assert why == {0: "ahead", 1: "replacement"}  # the survivor had committed step 3 alone
    logs = [f"file:{tmp_path / 'kill' / 'logs' / f'rank{r}.log'}" for r in range(2)]
    G = group_epoch(logs)
    assert all(G in committed_epochs(lg) for lg in logs)
    assert G == max(committed_epochs(logs[1]))  # the replacement's log ends at the group epoch
    # the survivor's orphan epoch (step 3, committed by rank 0 alone) is in its log only
    orphans = set(committed_epochs(logs[0])) - set(committed_epochs(logs[1]))
    assert orphans and max(orphans) < G
    from concordia import Session

    for r, lg in enumerate(logs):
        arrays = Session(lg, create=False).recover(G)
        assert np.asarray(arrays["x"]).tobytes() == got["ranks"][r]["x"]
        assert np.asarray(arrays["kv"]).tobytes() == got["ranks"][r]["kv"]
        assert int(np.asarray(arrays["step"])[0]) == steps
