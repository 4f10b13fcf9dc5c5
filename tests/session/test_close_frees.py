"""A closed session holds none of the caller's memory: once `close()` (or the
with-block) ends, dropping the arrays, the cache and the guard frees them by
reference counting alone, with the session's name still in scope and the
garbage collector off.  A closed session that kept its regions (or an
integration hook that kept its guard, a cache that kept itself through its
reset wrapper) pinned a 32k-token cache, 30 GB of device memory, until some
later collection: the next allocation of that size failed."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import numpy as np
import pytest

import concordia


@contextlib.contextmanager
def _no_collector():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_closed_session_lets_go_of_numpy_arrays_and_hooks(file_log):
    with _no_collector():
        a, b = np.zeros(1 << 16, np.uint8), np.ones(4096, np.float32)
        seen = []
        with concordia.Session(file_log, size=16 << 20) as s:
            s.register("a", a)
            s.register("b", b, kind="scheduler")
            s.before_checkpoint(functools.partial(seen.append, b))  # a hook holding an array, as a guard does
            a[:100] = 7
            s.checkpoint()
        refs = [weakref.ref(a), weakref.ref(b)]
        del a, b, seen
        assert s.closed and s.regions == {}
        assert [r() is None for r in refs] == [True, True]
    # the log still holds the epoch: a new session recovers it
    with concordia.Session(file_log, create=False) as s2:
        got = s2.recover()
        assert int(got["a"][:100].sum()) == 700 and float(got["b"].sum()) == 4096.0


def _tiny_cache_freed(device: str, file_log: str):
    torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
    pytest.importorskip("transformers", reason="the transformers integration needs transformers")
    pytest.importorskip("peft", reason="the LoRA part needs peft")
    from transformers import StaticCache

    from concordia.demo.model import build, prompt
    from concordia.integrations.transformers import protect, restore

    cfg, model = build("tiny", device)
    ids = prompt(2, 48, cfg.vocab_size, device)
    held = (lambda: torch.cuda.memory_allocated()) if device == "cuda" else (lambda: 0)
    with torch.no_grad():  # a first forward's own allocations (the BLAS workspace) before the count starts
        model(ids, past_key_values=StaticCache(config=cfg, max_cache_len=56), use_cache=True)
    with _no_collector():
        base = held()
        cache = StaticCache(config=cfg, max_cache_len=56)
        with concordia.Session(file_log, size=64 << 20) as s:
            guard = protect(s, cache, model, batch_size=2, max_tokens=56)
            with torch.no_grad():
                model(ids, past_key_values=cache, use_cache=True)
            s.checkpoint()
        want = cache.layers[0].keys.clone()
        cache.reset()  # the reset counter's wrapper stays callable, holding the cache weakly
        refs = [weakref.ref(layer.keys) for layer in cache.layers] + [weakref.ref(guard)]
        del cache, guard
        assert all(r() is None for r in refs)
        assert held() <= base + want.nbytes  # the device memory is back, but for the clone
        # and after a recovery into a fresh cache
        fresh = StaticCache(config=cfg, max_cache_len=56)
        with concordia.Session(file_log, create=False) as s:
            guard = protect(s, fresh, model, batch_size=2, max_tokens=56)
            restore(s, guard)
        assert torch.equal(fresh.layers[0].keys, want)
        refs = [weakref.ref(layer.keys) for layer in fresh.layers] + [weakref.ref(guard)]
        del fresh, guard
        assert all(r() is None for r in refs)
        assert held() <= base + want.nbytes


def test_a_protected_cache_is_freed_when_dropped_after_close(file_log):
    _tiny_cache_freed("cpu", file_log)


@pytest.mark.gpu
def test_a_protected_cuda_cache_gives_its_device_memory_back_after_close(shm_log):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch build has no CUDA device")
    pytest.importorskip("cupy", reason="the device path needs CuPy")
    _tiny_cache_freed("cuda", shm_log)


def test_a_deep_copy_of_a_protected_cache_counts_its_own_resets():
    """The reset counter holds its cache weakly; a deep copy (a prompt cache
    copied per request) gets a counter of its own, which resets the copy and
    goes on working once the original is gone."""
    pytest.importorskip("torch", reason="the transformers integration needs torch")
    pytest.importorskip("transformers", reason="the transformers integration needs transformers")
    import copy

    from transformers import StaticCache

    from concordia.demo.model import build
    from concordia.integrations.transformers import _count_resets

    cfg, _ = build("tiny", "cpu", lora=False)
    with _no_collector():
        cache = StaticCache(config=cfg, max_cache_len=16)
        _count_resets(cache)
        twin = copy.deepcopy(cache)
        twin.reset()
        assert (twin.concordia_resets, cache.concordia_resets) == (1, 0)
        gone = weakref.ref(cache)
        del cache
        assert gone() is None
        twin.reset()
        assert twin.concordia_resets == 2
