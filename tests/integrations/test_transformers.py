"""concordia.integrations.transformers on the CPU, against the real transformers
and peft: a tiny random Qwen3 with a StaticCache and a LoRA adapter updated
online, protected with protect(), checkpointed from inside generate(),
SIGKILLed and resumed in a fresh process bit-identically."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
pytest.importorskip("transformers", reason="the transformers integration needs transformers (test extra)")
pytest.importorskip("peft", reason="the LoRA part needs peft (test extra)")

from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache  # noqa: E402

import concordia  # noqa: E402
from concordia.demo.model import build, lora_update, pick_kill_at, prompt, run_demo  # noqa: E402
from concordia.errors import SessionError  # noqa: E402
from concordia.integrations.transformers import CheckpointEvery, protect, restore  # noqa: E402


def _log(tmp_path, name="hf.log"):
    return f"file:{tmp_path / name}"


def _session(tmp_path, **kw):
    return concordia.Session(_log(tmp_path), size=64 << 20, segment_size=8 << 20, **kw)


def test_protect_registers_every_layer_counter_and_lora_weight(tmp_path):
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=32)
    with _session(tmp_path) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        lora = [n for n, _ in model.named_parameters() if "lora_" in n]
        assert len(lora) == 2 * 2 * cfg.num_hidden_layers  # q and v, A and B, per layer
        assert set(s.regions) == set(g.names)
        # counters; tokens, their mask and count; the sampling generator's state
        assert len(g.names) == 2 * cfg.num_hidden_layers + 1 + 1 + 3 + 1   # the LoRA weights: one region
        assert {s.regions[k].kind for _, k, _ in g.kv} == {"kv"}
        (flat,) = g.lora_regions
        assert flat.startswith("hf.lora@") and s.regions[flat].kind == "adapter"
        assert sorted(g.lora) == sorted(f"hf.lora.{n}" for n in lora)
        # registered as they are: the cache's own tensors, not copies
        assert s.regions["hf.kv.0.k"].owner is cache.layers[0].keys
        # the cache by the positions its steps write, one row a page
        assert {s.regions[k].detect for _, k, _ in g.kv} == {"positions"}
        assert s.regions["hf.kv.0.k"].page_bytes == cfg.head_dim * 4  # fp32 rows of 16 on the CPU


def _adapted(targets: tuple, seed: int = 0):
    """(config, the tiny Qwen3 with a LoRA adapter of rank 8 on `targets`), its weights drawn from `seed`."""
    from peft import LoraConfig, get_peft_model

    cfg, model = build("tiny", "cpu", lora=False, seed=seed)
    torch.manual_seed(seed + 1)
    return cfg, get_peft_model(model, LoraConfig(r=8, target_modules=list(targets), init_lora_weights=False)).eval()


def _lora_of(model) -> dict:
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


def test_the_lora_weights_become_views_of_one_region_with_their_values_and_parameters_kept(tmp_path):
    """protect() moves a PEFT model's LoRA weights into one tensor (the "hf.lora@<digest>" region): each
    parameter is the same object, with the same values and shape, now a view of it at an aligned
    offset; an update through a parameter is the region's; a second protect of the same model takes
    the weights where they are (no new addresses); a recovery fills them."""
    cfg, model = build("tiny", "cpu")
    lora = _lora_of(model)
    before = {n: (p, p.detach().clone()) for n, p in lora.items()}
    with _session(tmp_path) as s:
        g = protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
        flat = s.regions[g.lora_regions[0]].owner
        assert flat.dim() == 1 and flat.dtype == next(iter(lora.values())).dtype
        for n, p in _lora_of(model).items():
            was, values = before[n]
            assert p is was and torch.equal(p.detach(), values), n
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), n
            assert (p.data_ptr() - flat.data_ptr()) % 256 == 0 and p.is_contiguous(), n
        addresses = {n: p.data_ptr() for n, p in lora.items()}
        lora_update(model)(1, None)
        s.checkpoint()
        want = {n: p.detach().clone() for n, p in lora.items()}
    with concordia.Session(_log(tmp_path), create=False) as r:   # a second protect of the same model
        g2 = protect(r, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
        assert {n: p.data_ptr() for n, p in lora.items()} == addresses
        with torch.no_grad():
            for p in lora.values():
                p.zero_()
        restore(r, g2)
        for n, p in lora.items():
            assert torch.equal(p.detach(), want[n]), n
        assert g2.lora_regions == g.lora_regions


@pytest.mark.gpu
def test_on_cuda_the_lora_move_and_the_counters_go_in_one_launch_each_once_loaded(tmp_path, monkeypatch):
    """On CUDA, with gpu_kernels' batched copy loaded (as a read ahead loads it), protect() copies every
    LoRA weight into the flat region in one launch on torch's current stream (here a side stream), and
    its layers' position counters in another; restore() puts the counters back into the layers in one
    (this tiny model's few pairs batched as a Qwen3's 112 adapters are: BATCH_FROM lowered).  The values
    are kept, the parameters are the region's views, the positions are the epoch's."""
    from concordia.gpu_kernels import gpu
    from concordia.integrations import transformers as hf

    monkeypatch.setattr(hf, "BATCH_FROM", 1)
    gpu.copy_spans_ready()
    calls, real = [], gpu.copy_addresses

    def spy(pairs, sizes, **kw):
        import cupy

        assert cupy.cuda.get_current_stream().ptr == torch.cuda.current_stream().cuda_stream   # torch's stream
        done = real(pairs, sizes, **kw)
        calls.append((len(pairs), done))
        return done

    monkeypatch.setattr(gpu, "copy_addresses", spy)
    cfg, model = build("tiny", "cuda")
    layers = cfg.num_hidden_layers
    lora = _lora_of(model)
    before = {n: p.detach().clone() for n, p in lora.items()}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    cache = StaticCache(config=cfg, max_cache_len=16)
    with _session(tmp_path) as s:
        with torch.cuda.stream(side):
            g = protect(s, cache, model, batch_size=1)
        side.synchronize()
        assert (len(lora), True) in calls and (layers, True) in calls
        flat = s.regions[g.lora_regions[0]].owner
        for n, p in _lora_of(model).items():
            assert torch.equal(p.detach(), before[n]), n
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), n
        with torch.no_grad():
            model(prompt(1, 5, cfg.vocab_size, "cuda"), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        s.checkpoint()
        want = [int(layer.cumulative_length) for layer in cache.layers]
    assert want == [5] * layers
    calls.clear()
    with concordia.Session(_log(tmp_path), create=False) as r:
        fresh = StaticCache(config=cfg, max_cache_len=16)
        g2 = protect(r, fresh, model, batch_size=1)
        restore(r, g2)
        assert [int(layer.cumulative_length) for layer in fresh.layers] == want
    assert calls.count((layers, True)) == 2   # the fresh cache's counters at protect, the layers' at restore


def test_a_fresh_model_recovers_its_lora_weights_from_the_flat_region(tmp_path):
    """A fresh model of the same shape (other weights) takes the log's LoRA weights through its
    own protect() and restore(), byte for byte."""
    cfg, model = build("tiny", "cpu")
    with _session(tmp_path) as s:
        protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
        lora_update(model)(3, None)
        s.checkpoint()
        want = {n: p.detach().clone() for n, p in _lora_of(model).items()}
    _, fresh = build("tiny", "cpu", seed=5)
    assert any(not torch.equal(p.detach(), want[n]) for n, p in _lora_of(fresh).items())
    with concordia.Session(_log(tmp_path), create=False) as r:
        restore(r, protect(r, StaticCache(config=cfg, max_cache_len=16), fresh, batch_size=1))
    for n, p in _lora_of(fresh).items():
        assert torch.equal(p.detach(), want[n]), n


def test_a_log_of_a_region_a_lora_weight_is_recovered_in_that_layout(tmp_path):
    """lora_layout="tensors" registers a region a weight (the layout of logs written before the flat
    one) and leaves the parameters' storage alone; "auto" in a session whose log holds that layout
    takes it, so such a log still restores; an unknown layout is refused in one line."""
    cfg, model = build("tiny", "cpu")
    ptrs = {n: p.data_ptr() for n, p in _lora_of(model).items()}
    with _session(tmp_path) as s:
        g = protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1, lora_layout="tensors")
        assert {n: p.data_ptr() for n, p in _lora_of(model).items()} == ptrs
        assert sorted(g.lora_regions) == sorted(g.lora) and not any("@" in n for n in s.regions)
        lora_update(model)(2, None)
        s.checkpoint()
        want = {n: p.detach().clone() for n, p in _lora_of(model).items()}
    _, fresh = build("tiny", "cpu", seed=5)
    with concordia.Session(_log(tmp_path), create=False) as r:
        g2 = protect(r, StaticCache(config=cfg, max_cache_len=16), fresh, batch_size=1)
        assert sorted(g2.lora_regions) == sorted(g.lora_regions)
        restore(r, g2)
    for n, p in _lora_of(fresh).items():
        assert torch.equal(p.detach(), want[n]), n
    with concordia.Session(_log(tmp_path, "other.log"), size=64 << 20, segment_size=8 << 20) as s:
        with pytest.raises(SessionError) as e:
            protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1, lora_layout="packed")
        assert "\n" not in str(e.value) and "lora_layout" in str(e.value)
        assert not s.regions


class _OddAdapters(torch.nn.Module):
    """LoRA weights whose sizes are not multiples of the flat tensor's 256-byte alignment."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.lora_A = torch.nn.Parameter(torch.randn(3, 5, generator=g))
        self.lora_B = torch.nn.Parameter(torch.randn(7, generator=g))
        self.lora_C = torch.nn.Parameter(torch.randn(64, generator=g))


def test_lora_weights_of_odd_sizes_sit_at_aligned_offsets_with_zeros_between(tmp_path):
    """Weights whose sizes leave gaps at the 256-byte alignment keep their values, each starts on an
    aligned offset, the gaps are zeros, and a recovery gives each its bytes back."""
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=16)
    odd = _OddAdapters()
    want = {n: p.detach().clone() for n, p in odd.named_parameters()}
    with _session(tmp_path) as s:
        protect(s, cache, model, batch_size=1)   # the cache allocated; then the odd module's weights
        g = protect(s, cache, odd, prefix="odd", lora_layout="flat")
        flat = s.regions[g.lora_regions[0]].owner
        assert flat.numel() == 64 + 64 + 64   # 15, 7 and 64 floats, each from a 64-float boundary
        assert [p.data_ptr() - flat.data_ptr() for p in odd.parameters()] == [0, 256, 512]
        assert torch.count_nonzero(flat[15:64]) == 0 and torch.count_nonzero(flat[64 + 7:128]) == 0
        for n, p in odd.named_parameters():
            assert torch.equal(p.detach(), want[n]), n
        s.checkpoint()
        with torch.no_grad():
            for p in odd.parameters():
                p.fill_(-1.0)
        restore(s, g)
    for n, p in odd.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_lora_weights_of_two_dtypes_keep_a_region_each_and_flat_is_refused(tmp_path):
    """Weights of differing dtypes cannot share one tensor: "auto" registers a region a weight,
    "flat" is refused in one line with nothing registered."""
    cfg, model = build("tiny", "cpu")
    first = next(iter(_lora_of(model).values()))
    first.data = first.data.to(torch.float64)
    with _session(tmp_path) as s:
        g = protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
        assert not any("@" in n for n in s.regions) and len(g.lora_regions) == len(g.lora)
    with concordia.Session(_log(tmp_path, "flat.log"), size=64 << 20, segment_size=8 << 20) as s:
        with pytest.raises(SessionError) as e:
            protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1, lora_layout="flat")
        assert "\n" not in str(e.value) and "dtype or device" in str(e.value)
        assert not s.regions


def test_a_log_of_another_set_of_adapters_of_the_same_size_is_refused_with_nothing_written(tmp_path):
    """Adapters on k_proj written, a model adapting v_proj (the same shapes in a grouped-query model)
    recovering: the flat region's name says whose weights it holds, so the recovery refuses it in
    one line as absent before it writes anything, rather than pour k's weights into v."""
    from concordia.errors import AbsentRegionError

    _, on_k = _adapted(("k_proj",))
    cfg, on_v = _adapted(("v_proj",), seed=3)
    assert [p.shape for p in _lora_of(on_k).values()] == [p.shape for p in _lora_of(on_v).values()]
    with _session(tmp_path) as s:
        protect(s, StaticCache(config=cfg, max_cache_len=16), on_k, batch_size=1)
        s.checkpoint()
    before = {n: p.detach().clone() for n, p in _lora_of(on_v).items()}
    with concordia.Session(_log(tmp_path), create=False) as r:
        g = protect(r, StaticCache(config=cfg, max_cache_len=16), on_v, batch_size=1)
        with pytest.raises(AbsentRegionError) as e:
            restore(r, g)
        assert "\n" not in str(e.value) and g.lora_regions[0] in str(e.value)
    for n, p in _lora_of(on_v).items():
        assert torch.equal(p.detach(), before[n]), n


def test_a_refused_protect_leaves_the_lora_weights_where_they_were(tmp_path):
    """A protect() refused at registration (a region of its names registered already) moves no
    parameter: the weights keep their storage, addresses and values."""
    cfg, model = build("tiny", "cpu")
    lora = _lora_of(model)
    ptrs = {n: p.data_ptr() for n, p in lora.items()}
    with _session(tmp_path) as s:
        s.register("hf.rng", np.zeros(4, np.int64))   # protect's own name, taken
        with pytest.raises(SessionError):
            protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
        assert {n: p.data_ptr() for n, p in lora.items()} == ptrs


def test_weights_an_earlier_protect_holds_where_they_are_are_not_moved_by_a_later_one(tmp_path):
    """A protect() of a region a weight holds the parameters where they are; a later protect of the
    same model (another prefix, another session) must not move them, or the first registration would
    log memory they left: "auto" registers a region a weight there too, "flat" is refused in one line,
    and both registrations log the weights an update writes."""
    cfg, model = build("tiny", "cpu")
    lora = _lora_of(model)
    ptrs = {n: p.data_ptr() for n, p in lora.items()}
    cache = StaticCache(config=cfg, max_cache_len=16)
    with _session(tmp_path) as s:
        protect(s, cache, model, batch_size=1, prefix="a", lora_layout="tensors")
        with pytest.raises(SessionError) as e:
            protect(s, cache, model, prefix="b", lora_layout="flat")
        assert "\n" not in str(e.value) and "earlier protect" in str(e.value)
        g = protect(s, cache, model, prefix="c")
        assert not any("@" in n for n in g.lora_regions)
        assert {n: p.data_ptr() for n, p in lora.items()} == ptrs
        lora_update(model)(4, None)
        s.checkpoint()
        want = {n: p.detach().clone() for n, p in lora.items()}
    with concordia.Session(_log(tmp_path), create=False) as r:
        got = r.recover()
    for n, w in want.items():
        assert torch.equal(got[f"a.lora.{n}"], w) and torch.equal(got[f"c.lora.{n}"], w), n


def test_protect_under_inference_mode_leaves_the_adapters_trainable(tmp_path):
    """protect() called under torch.inference_mode(): the LoRA weights, moved into the flat tensor,
    are ordinary tensors still, and a backward pass through them gives gradients."""
    cfg, model = build("tiny", "cpu")
    with _session(tmp_path) as s, torch.inference_mode():
        protect(s, StaticCache(config=cfg, max_cache_len=16), model, batch_size=1)
    lora = _lora_of(model)
    assert not any(p.is_inference() for p in lora.values())
    for p in lora.values():
        p.requires_grad_(True)
    out = model(torch.tensor([[1, 2, 3]])).logits.sum()
    out.backward()
    assert all(p.grad is not None for p in lora.values())


def test_an_old_log_of_fewer_adapters_a_region_each_is_recovered_in_that_layout(tmp_path):
    """A log of a region a weight (lora_layout="tensors") written by a model adapting v_proj, recovered
    by one adapting q_proj and v_proj whose first weight the log lacks: "auto" still takes the layout
    the log holds, so the v weights are restored and the q weights are the ones named absent."""
    from concordia.errors import AbsentRegionError

    _, on_v = _adapted(("v_proj",))
    cfg, on_qv = _adapted(("q_proj", "v_proj"), seed=3)
    with _session(tmp_path) as s:
        protect(s, StaticCache(config=cfg, max_cache_len=16), on_v, batch_size=1, lora_layout="tensors")
        s.checkpoint()
    want = {n: p.detach().clone() for n, p in _lora_of(on_v).items()}
    with concordia.Session(_log(tmp_path), create=False) as r:
        g = protect(r, StaticCache(config=cfg, max_cache_len=16), on_qv, batch_size=1)
        assert not any("@" in n for n in g.lora_regions)
        with pytest.raises(AbsentRegionError) as e:
            restore(r, g)
        assert ".q_proj." in str(e.value)
        restore(r, g, absent="keep")
    got = _lora_of(on_qv)
    for n, w in want.items():
        assert torch.equal(got[n].detach(), w), n


def test_dynamic_cache_is_refused_in_one_line(tmp_path):
    with _session(tmp_path) as s:
        with pytest.raises(SessionError) as e:
            protect(s, DynamicCache(), None)
    msg = str(e.value)
    assert "\n" not in msg and "DynamicCache" in msg and "StaticCache" in msg


def test_an_unallocated_cache_without_the_model_is_refused(tmp_path):
    cfg, _ = build("tiny", "cpu", lora=False)
    with _session(tmp_path) as s:
        with pytest.raises(SessionError, match="batch_size"):
            protect(s, StaticCache(config=cfg, max_cache_len=16), None)
        assert not s.regions  # nothing registered


def test_a_protect_refused_midway_registers_nothing_and_can_be_made_again(tmp_path):
    """A refusal after the cache's regions were made (a log too small for the cache and the adapter together)
    leaves no region behind: the same protect() on a log that fits then registers them all, where a second
    call used to meet DuplicateRegionError."""
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=16384)   # 16 MiB of keys and values for two rows
    with concordia.Session(_log(tmp_path, "small.log"), size=8 << 20, segment_size=1 << 20) as s:
        with pytest.raises(SessionError) as e:
            protect(s, cache, model, batch_size=2, max_tokens=32)
        assert "\n" not in str(e.value) and "the log holds" in str(e.value)
        assert not s.regions and not s.log.regions   # nothing registered, no descriptor written
    with _session(tmp_path) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        assert set(s.regions) == set(g.names)


def test_checkpoint_every_n_tokens_from_generate(tmp_path):
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=40)
    with _session(tmp_path) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=40)
        hook = CheckpointEvery(g, 3)
        model.generate(input_ids=prompt(2, 8, cfg.vocab_size, "cpu"), max_new_tokens=12, do_sample=False,
                       past_key_values=cache, stopping_criteria=[hook])
        assert len(hook.stats) == 4 and s.epoch == 4
    with pytest.raises(SessionError, match="every"):
        CheckpointEvery(g, 0)
    with pytest.raises(SessionError, match="wait must be True or False"):
        CheckpointEvery(g, 1, wait="yes")


def _generate(model, cfg, cache, guard, steps, start=0, ids=None):
    hook = CheckpointEvery(guard, 1, on_step=lora_update(model), start=start)
    ids = prompt(2, 8, cfg.vocab_size, "cpu") if ids is None else ids
    return model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, past_key_values=cache,
                          stopping_criteria=[hook])


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-window"])
def test_restore_puts_cache_counters_and_adapter_back(tmp_path, sliding):
    """Generate 5 tokens, then 9 more after restoring into fresh objects; the
    result equals 14 tokens in one go, cache and adapter byte for byte.  With
    a sliding window of 6, the window is full and rolling at the restore."""
    def make():
        cfg, model = build("tiny", "cpu")
        if sliding:
            torch.manual_seed(0)
            cfg = Qwen3Config(**{**cfg.to_dict(), "use_sliding_window": True, "sliding_window": 6,
                                 "layer_types": ["sliding_attention", "full_attention"]})
            cfg, model = cfg, _peft(Qwen3ForCausalLM(cfg).eval())
        return cfg, model, StaticCache(config=cfg, max_cache_len=24)

    cfg, model, cache = make()
    with concordia.Session(_log(tmp_path, "ref.log"), size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=24)
        ref = _generate(model, cfg, cache, g, 14)
        ref_state = {n: t.clone() for n, t in _tensors(g).items()}
    cfg, model, cache = make()
    with _session(tmp_path) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=24)
        _generate(model, cfg, cache, g, 5)
    cfg, model, cache = make()
    with concordia.Session(_log(tmp_path), create=False) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=24)
        state = restore(s, g)
        assert state.epoch == 5 and state.tokens.shape == (2, 8 + 5)
        if sliding:
            assert cache.layers[0].cumulative_length_int == 8 + 4  # the 5th token's K/V is not cached yet
        out = _generate(model, cfg, cache, g, 9, start=5, ids=state.tokens)
    assert torch.equal(out, ref)
    for n, t in _tensors(g).items():
        assert torch.equal(t, ref_state[n]), n


def _peft(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()


def _tensors(g):
    out = {n: p.data for n, p in g.lora.items()}
    for i, k, v in g.kv:
        out[k], out[v] = g.cache.layers[i].keys, g.cache.layers[i].values
    return out


def test_restore_without_the_adapter_would_differ(tmp_path):
    """The comparison is not vacuous: resuming with the adapter as built (not
    as updated online) gives other tokens."""
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=32)
    with _session(tmp_path) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        ref = _generate(model, cfg, cache, g, 16)
        ref_kv = [t.clone() for t in _tensors(g).values()]
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=32)
    with _session(tmp_path, overwrite=True) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        _generate(model, cfg, cache, g, 8)
    cfg, model = build("tiny", "cpu")
    cache = StaticCache(config=cfg, max_cache_len=32)
    with concordia.Session(_log(tmp_path), create=False) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        state = restore(s, g)
        fresh_cfg, fresh = build("tiny", "cpu")  # the adapter as built, not as restored
        for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
            if "lora_" not in n:
                q.data.copy_(p.data)
        out = _generate(fresh, fresh_cfg, cache, g, 8, start=8, ids=state.tokens)
    kv = list(_tensors(g).values())
    assert not torch.equal(out, ref) or not all(torch.equal(a, b) for a, b in zip(kv, ref_kv))


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [6, 13, "random"])
def test_sigkilled_generate_resumes_bit_identical_in_a_fresh_process(tmp_path, kill_at):
    if kill_at == "random":
        kill_at = pick_kill_at(20, 4, random.Random())
    rep = run_demo(_log(tmp_path), steps=20, every=4, kill_at=kill_at)
    assert rep["identical"], rep["compared"]
    assert rep["tokens_identical"] and all(rep["compared"].values())
    assert rep["worker"]["killed_after_step"] == kill_at - 1
    last = (kill_at - 1) // 4 * 4  # the last step a checkpoint committed
    assert rep["resumed_at_step"] == last and rep["recovered_epoch"] == last // 4


def test_cli_model_demo_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "concordia.tools.cli", "demo", "--model", "qwen3", "--device", "cpu",
                        "--steps", "12", "--every", "4", "--kill-at", "7", "--json",
                        "--log", _log(tmp_path, "cli.log")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["identical"] is True and rep["resumed_at_step"] == 4
    assert rep["worker"]["killed_after_step"] == 7  # --kill-at N: after step N, as in the reference demo
    assert rep["model"]["regions"] == 2 * 2 + 1 + 1 + 3 + 1   # keys and values, counters, the LoRA, tokens, rng


@pytest.mark.parametrize("kill_at", ["0", "12"])
def test_cli_model_demo_refuses_a_kill_point_outside_the_run(tmp_path, kill_at):
    r = subprocess.run([sys.executable, "-m", "concordia.tools.cli", "demo", "--model", "qwen3", "--device", "cpu",
                        "--steps", "12", "--kill-at", kill_at, "--log", _log(tmp_path, "cli.log")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"error: demo: --kill-at {kill_at} must lie in [1, 11]"], r.stderr


@pytest.mark.slow
def test_bench_model_quick_json(tmp_path):
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, "-c", "from concordia.tools.wal_cli import main; main()", "bench", "model", "--quick", "--json",
                        "--tier", "file", "--dir", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text())
    assert [(d["every"], d["wait"], d["executor"]) for d in doc["decode"]] == [
        (0, False, "host"), (1, False, "host"), (8, False, "host"), (1, True, "host"), (1, False, "resident"),
        (8, False, "resident")]
    assert len(doc["decode"][1]["ckpt_ms"]) == 8 and len(doc["decode"][2]["ckpt_ms"]) == 1
    assert "overhead_every_step" in doc and "overhead_every_step_waiting" in doc and doc["ckpt_ms_per_step"] > 0
    # one measured run a row: the baseline's spread between runs is not known
    assert doc["decode_steps"] == 8 and doc["baseline_spread"] is None
    # a resident session: the first checkpoint is CheckpointEvery's own, the trigger takes the next 7 (CPU)
    trig = doc["decode"][4]["retention"]["trigger"]
    held = {k: trig.pop(k) for k in ("held_steps", "held_ms_mean", "held_ms_per_step", "gave_up")}
    # every due step after the session's own first epoch is the trigger's: none skipped
    # (a file log needs a persist call: no arena, so no epoch of the CPU twin's snapshot either)
    assert trig == {"on_device": False, "fired": 7, "due": 7, "skipped": 0, "uncovered": 0, "coalesced": 0,
                    "mended": 0, "errors": [], "snapshot_epochs": 0}
    assert len(doc["decode"][4]["ckpt_ms"]) == 8
    # the CPU gate held the producer at each of the 7 epochs, for a time of its own
    assert held["held_steps"] == 7 and held["held_ms_mean"] > 0 and held["gave_up"] == 0, held
    assert "overhead_every_step_resident" in doc and "overhead_every_8_resident" in doc
    # CPU tensors take the host path, which never leaves an epoch pending (the device table pass does)
    assert all(d["pending"] == 0 for d in doc["decode"])
    assert all(d["hook_ms_median"] > 0 for d in doc["decode"])  # the host time inside the criterion
    # where the every-step checkpoint's host time goes, call by call
    assert {"update", "run", "run_room", "settle", "retention"} <= set(doc["decode"][1]["host_phases_ms"])
    per_step = doc["decode"][1]["host_phases_ms_per_step"]
    assert set(per_step) == set(doc["decode"][1]["host_phases_ms"]) and all(v >= 0 for v in per_step.values())
    assert per_step["run"] > 0 and per_step["update"] > 0  # a checkpoint and an adapter update a step: never 0 ms
    # the resident row: the guard's capture and token copy, and the trigger's step (the CPU gate's hold in it)
    assert {"capture", "record_tokens", "trigger_step"} <= set(doc["decode"][4]["host_phases_ms"])
    assert doc["decode"][4]["host_phases_ms_per_step"]["trigger_step"] > 0
    kept = doc["decode"][1]["retention"]
    assert kept["base_staging"] is None and kept["counts"].get("errors", 0) == 0  # the host writes CPU bases
    assert [r["context"] for r in doc["recovery"]] == [64, 256]
    assert all(r["identical"] for r in doc["recovery"])
    assert all(r["recovery_vs_reprefill"] > 0 for r in doc["recovery"])
    # --quick: one read-ahead child and one timed re-prefill a context, each figure the median of its runs
    assert all(r["reprefill_runs"] == [r["reprefill_s"]] and len(r["fresh_read_ahead_runs"]) == 1
               and r["fresh_read_ahead_errors"] == []
               and r["fresh_read_ahead_runs"][0] == r["fresh_read_ahead"]["recovery_s"] for r in doc["recovery"])
    # each read-ahead child counts the collector's passes inside its protect() and restore()
    for r in doc["recovery"]:
        (passes,) = r["fresh_read_ahead_gc"]
        assert passes == r["fresh_read_ahead"]["gc"] and set(passes) == {"passes", "s", "full"}
        assert 0 <= passes["full"] <= passes["passes"] and passes["s"] >= 0
    # the same recovery in a fresh process, at the epoch this one restored
    assert all(r["fresh"]["epoch"] == 1 and r["fresh"]["recovery_s"] > 0 for r in doc["recovery"]), doc["recovery"]
    # where each recovery's time went: the session's open, protect(), then the recovery's phases
    for got in [r for r in doc["recovery"]] + [r["fresh"] for r in doc["recovery"]]:
        assert {"open", "plan", "present"} <= set(got["phases"]) and got["session_s"] > 0 and got["protect_s"] > 0
        assert got["session_s"] + got["protect_s"] == pytest.approx(got["open_s"])
    # ... and in a fresh process that read the log ahead while it built its model: copied, not read
    for r in doc["recovery"]:
        ra = r["fresh_read_ahead"]
        assert ra["epoch"] == 1 and ra["read_ahead"]["used"] is True and ra["recovery_s"] > 0, ra
        assert {"read_ahead", "copy", "present"} <= set(ra["phases"]) and "plan" not in ra["phases"]
        assert ra["build_s"] > 0 and ra["read_ahead"]["open_s"] > 0 and ra["read_ahead"]["read_s"] > 0
        assert r["read_ahead_identical"] is True   # tensor for tensor what the plain fresh recovery restored
        assert "read_ahead_saved_s" in r and "total_s" in r["fresh"]
    assert set(doc["hf_restore_vs_reprefill_read_ahead"]) == {"ctx_64", "ctx_256"}
    assert set(doc["hf_restore_vs_reprefill"]) == {"ctx_64", "ctx_256"}
    assert all(v > 0 for v in doc["hf_restore_vs_reprefill"].values())
    assert len(doc["kills"]) == 2 and [k["sampled"] for k in doc["kills"]] == [False, True]
    assert all(k["identical"] for k in doc["kills"]) and doc["kills_run"]["identical"]
    lr = doc["longrun"]
    assert lr["steps"] == 300 and lr["generations"] == 3 and lr["log_full"] is False
    assert lr["recovery_at_end"]["epoch"] >= 300 and lr["recovery_at_end"]["steps"] == 300
