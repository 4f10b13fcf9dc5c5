"""`recover(into="registered")` checks each registered region's own view
against the log (`restore.run.check_view`), not a view adapted again from the
object (173 DLPack round trips for a protected Qwen3); an object whose storage
changed since `register` is adapted and checked as any target is, as before."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from concordia import Session
from concordia.restore import run as restore_run

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")


def _written(path, regions: dict) -> None:
    with Session(path, size=16 << 20, segment_size=1 << 20) as s:
        for name, a in regions.items():
            s.register(name, a)
        s.checkpoint()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return {"t": torch.randn((4, 300), generator=g).to(torch.bfloat16),
            "a": rng.standard_normal((5, 77)).astype(ml_dtypes.bfloat16),
            "n": rng.integers(0, 1 << 30, (9, 11), dtype=np.int64)}


def _same(got: dict, want: dict) -> None:
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert torch.equal(g.view(torch.uint16), w.view(torch.uint16)), name
        else:
            assert g.tobytes() == w.tobytes(), name


def test_registered_regions_are_checked_by_their_own_views(tmp_path, monkeypatch):
    want = _state(1)
    path = str(tmp_path / "log")
    _written(path, want)

    def adapted_again(*a, **k):
        raise AssertionError("a registered region's target was adapted again")

    fresh = {n: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v)) for n, v in want.items()}
    with Session(path, create=False) as s:
        for name, a in fresh.items():
            s.register(name, a)
        monkeypatch.setattr(restore_run, "adapt", adapted_again)
        out = s.recover(into="registered")
    assert all(out[n] is fresh[n] for n in fresh)
    _same(fresh, want)


def test_a_region_whose_storage_changed_is_adapted_as_any_target(tmp_path):
    want = _state(2)
    path = str(tmp_path / "log")
    _written(path, want)
    fresh = {n: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v)) for n, v in want.items()}
    with Session(path, create=False) as s:
        for name, a in fresh.items():
            s.register(name, a)
        old = fresh["t"].data_ptr()
        fresh["t"].set_(torch.zeros_like(fresh["t"]))   # same shape, new storage
        assert fresh["t"].data_ptr() != old
        s.recover(into="registered")
    _same(fresh, want)   # restored into the storage the tensor holds now, as before

