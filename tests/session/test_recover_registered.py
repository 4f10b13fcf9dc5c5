"""`recover(into="registered")` checks each registered region's own view
against the log (`restore.run.check_view`), not a view adapted again from the
object (173 DLPack round trips for a protected Qwen3); an object whose storage
changed since `register` is adapted and checked as any target is, as before."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from concordia import Session
from concordia.errors import RecoverMismatchError
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
            "n": rng.integers(0, 1 << 30, (90, 110), dtype=np.int64)}   # 20 pages


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



def test_a_tensor_transposed_in_place_since_register_is_refused_as_before(tmp_path):
    # t_() keeps the storage (address, bytes, shape of a square tensor): only the strides say it
    path = str(tmp_path / "log")
    _written(path, {"sq": torch.arange(16, dtype=torch.float32).reshape(4, 4)})
    with Session(path, create=False) as s:
        t = torch.zeros((4, 4))
        s.register("sq", t)
        t.t_()
        with pytest.raises(RecoverMismatchError, match="not C-contiguous") as e:
            s.recover(into="registered")
    assert "\n" not in str(e.value) and (t == 0).all()


def test_regions_not_asked_for_are_written_whole_by_the_next_checkpoint(tmp_path):
    # they hold what the log may never have had: a delta against it would not add up to their digest
    path = str(tmp_path / "log")
    want = _state(3)
    _written(path, want)
    fresh = {n: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v)) for n, v in want.items()}
    fresh["n"][:] = 9
    with Session(path, create=False) as s:
        for name, a in fresh.items():
            s.register(name, a)
        s.recover(into="registered", regions=["t", "a"])
        fresh["n"][0, 0] = 10
        st = s.checkpoint()
        assert st.pages["n"] == s.region_set.get("n").pages and st.pages["t"] == st.pages["a"] == 0
    with Session(path, create=False, readonly=True) as r:
        got = r.recover()
    _same(got, fresh)


def test_a_region_skip_corrupt_took_back_to_an_older_epoch_is_written_whole_next(tmp_path):
    # its restored bytes are epoch 1's while the log's latest is 3: a delta from them is no delta of the log's
    from .test_restore_deferred import _flip, _page_offset

    path = f"file:{tmp_path / 'log'}"
    rng = np.random.default_rng(4)
    kv, sched = rng.standard_normal(4096, dtype=np.float32), np.arange(1000, dtype=np.int64)
    with Session(path, size=16 << 20, segment_size=1 << 20) as s:
        s.register("kv", kv)
        s.register("sched", sched)
        s.checkpoint()
        kv[3 * 1024] = 7.0   # page 3, epoch 2
        s.checkpoint()
        sched[0] = -1        # epoch 3: kv unchanged
        s.checkpoint()
    _flip(path, _page_offset(path, "kv", 3, -1))   # epoch 2's record of kv
    fresh = {"kv": np.zeros_like(kv), "sched": np.zeros_like(sched)}
    with Session(path, create=False) as s:
        for name, a in fresh.items():
            s.register(name, a)
        s.recover(into="registered", mode="skip_corrupt")
        assert s.last_recovery.epochs == {"kv": 1, "sched": 3}
        assert fresh["kv"][3 * 1024] != 7.0 and fresh["sched"][0] == -1
        fresh["kv"][0] = 1.0
        fresh["sched"][999] = 5
        st = s.checkpoint()
        assert st.pages["kv"] == s.region_set.get("kv").pages   # whole
        assert st.pages["sched"] == 1                             # a delta from the latest epoch


@pytest.mark.parametrize("into", ["registered", "given"])
def test_host_targets_order_no_stream(tmp_path, monkeypatch, into):
    """A recovery into host arrays and CPU tensors orders no stream, nor
    looks for CuPy to say so (`StreamOrder.of` drops host objects first)."""
    from concordia.regions import streams

    path = f"file:{tmp_path / 'h.log'}"
    want = _state(3)
    _written(path, want)

    def refused():
        raise AssertionError("CuPy was looked for to order host targets")
    monkeypatch.setattr(streams, "cupy_module", refused)
    fresh = {n: (torch.zeros_like(w) if isinstance(w, torch.Tensor) else np.zeros_like(w)) for n, w in want.items()}
    with Session(path, create=False) as s:
        if into == "registered":
            for name, a in fresh.items():
                s.register(name, a)
            s.recover(into="registered")
        else:
            s.recover(into=fresh)
    _same(fresh, want)


def test_a_recovery_that_fails_after_its_copies_still_orders_the_streams_later_work(tmp_path, monkeypatch):
    """Session.recover(into="registered") ends its stream order (the targets'
    later work waits for the copies) after its own reads of the targets, and
    also when those reads raise: the copies were queued either way."""
    from concordia.regions.streams import StreamOrder

    path = f"file:{tmp_path / 'f.log'}"
    want = _state(3)
    _written(path, want)
    ended = []
    monkeypatch.setattr(StreamOrder, "before_later_work", lambda self: ended.append(self))
    fresh = {n: (torch.zeros_like(w) if isinstance(w, torch.Tensor) else np.zeros_like(w)) for n, w in want.items()}
    with Session(path, create=False) as s:
        for name, a in fresh.items():
            s.register(name, a)
        s.recover(into="registered")
        assert len(ended) == 1
        monkeypatch.setattr(Session, "_continue_from", lambda self, *a: (_ for _ in ()).throw(OSError("no room")))
        with pytest.raises(OSError, match="no room"):
            s.recover(into="registered")
        assert len(ended) == 2
    _same(fresh, want)
