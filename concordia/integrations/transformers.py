"""Hugging Face transformers and PEFT: protect a `StaticCache` (and a model's
LoRA adapters) with a `concordia.Session`, restore them in place, and
checkpoint from inside `model.generate()`.

    from concordia.integrations.transformers import protect, restore, CheckpointEvery

    cache = StaticCache(config=model.config, max_cache_len=4096)
    guard = protect(session, cache, model, batch_size=8)      # registers every tensor
    model.generate(ids, past_key_values=cache, max_new_tokens=256,
                   stopping_criteria=[CheckpointEvery(guard, 8)])
    ...
    # in a fresh process, on a fresh GPU:
    guard = protect(session, cache, model, batch_size=8)
    state = restore(session, cache, model)                     # keys, values, counters, LoRA, tokens
    model.generate(state.tokens, past_key_values=cache, ...)   # continues

What is registered, by name under `prefix` (default "hf"):
- `hf.kv.<layer>.k` / `hf.kv.<layer>.v`: each layer's keys and values (kind
  "kv"), sliding-window layers included;
- `hf.counters`: one int64 row per layer (the position tensor and the host-side
  length a sliding-window layer keeps), written from the cache by the
  session's pre-checkpoint hook, so a plain `session.checkpoint()` captures it;
- `hf.lora.<parameter>`: every LoRA weight of a PEFT model (kind "adapter"),
  updated in place by online adaptation or not;
- `hf.tokens` / `hf.tokens_len`, when `max_tokens` is given: the tokens
  generated so far, so that `generate()` can continue after a restore.

A `DynamicCache` reallocates its tensors at every step, so there is nothing
fixed to protect: it is refused in one line that says to use a `StaticCache`.
transformers and peft are imported only here.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria

from concordia.regions.errors import SessionError

PREFIX = "hf"


@dataclasses.dataclass
class Guard:
    """What `protect` registered: the session, the cache, the region names."""

    session: object
    cache: object
    model: object | None
    prefix: str
    kv: list  # [(layer index, keys name, values name)]
    lora: dict  # region name -> parameter
    counters: object  # int64 tensor [layers, 2]
    tokens: object | None = None  # int64 tensor [batch, max_tokens]
    tokens_len: object | None = None  # int64 tensor [1]

    @property
    def names(self) -> list[str]:
        out = [n for _, k, v in self.kv for n in (k, v)] + [f"{self.prefix}.counters"] + list(self.lora)
        if self.tokens is not None:
            out += [f"{self.prefix}.tokens", f"{self.prefix}.tokens_len"]
        return out

    def record_tokens(self, input_ids) -> None:
        """Copy the sequences so far (int tensor [batch, n]) into the protected
        token buffer; generate()'s hook calls this before each checkpoint."""
        if self.tokens is None:
            raise SessionError("protect() was called without max_tokens: no token buffer to record into",
                               where=f"{self.prefix}.tokens")
        b, n = input_ids.shape
        if b != self.tokens.shape[0] or n > self.tokens.shape[1]:
            raise SessionError(f"{b} sequences of {n} tokens do not fit the token buffer "
                               f"{tuple(self.tokens.shape)}", where=f"{self.prefix}.tokens",
                               hint="give protect() a larger max_tokens")
        self.tokens[:, :n].copy_(input_ids, non_blocking=True)
        self.tokens_len.fill_(n)

    def _sync_counters(self) -> None:
        # The position tensors live on the device and move without the host; a
        # sliding-window layer also keeps a Python int that leaves them behind
        # once the window is full.  Both go into one int64 row per layer.
        layers = self.cache.layers
        pos = torch.stack([layer.cumulative_length.reshape(()).to(self.counters.device, torch.int64)
                           for layer in layers])
        self.counters[:, 0].copy_(pos)
        ints = [int(getattr(layer, "cumulative_length_int", -1)) for layer in layers]
        self.counters[:, 1].copy_(torch.tensor(ints, dtype=torch.int64), non_blocking=False)


@dataclasses.dataclass
class Restored:
    """What `restore` put back: the epoch, the recovery statistics and, when a
    token buffer is protected, the tokens so far (int64 [batch, n])."""

    epoch: int
    stats: object
    tokens: object | None


def _check_cache(cache) -> None:
    if isinstance(cache, DynamicCache):
        raise SessionError("a DynamicCache reallocates its tensors at every step, so it cannot be protected",
                           where="protect", hint="use StaticCache(config=model.config, max_cache_len=N)")
    if not isinstance(cache, StaticCache):
        raise SessionError(f"cannot protect a {type(cache).__name__}: only StaticCache is supported",
                           where="protect", hint="use StaticCache(config=model.config, max_cache_len=N)")


def _initialise(cache, model, batch_size, dtype, device) -> None:
    """Allocate the cache's tensors ahead of the first update (they are lazy),
    from the model's config, so they can be registered before the prefill."""
    if all(layer.is_initialized for layer in cache.layers):
        return
    if model is None or batch_size is None:
        raise SessionError("the cache is not allocated yet: give protect() the model and batch_size, "
                           "or run the prefill first", where="protect")
    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if dtype is None or device is None:
        p = next(model.parameters())
        dtype = dtype if dtype is not None else p.dtype
        device = device if device is not None else p.device
    cache.early_initialization(batch_size=batch_size, num_heads=heads, head_dim=head_dim,
                               dtype=dtype, device=device)


def _lora_parameters(model) -> dict:
    if model is None:
        return {}
    return {name: p for name, p in model.named_parameters() if ".lora_" in name or name.startswith("lora_")}


def protect(session, cache, model=None, *, batch_size: int | None = None, max_tokens: int | None = None,
            prefix: str = PREFIX, detect: str = "fingerprint", page_bytes: int = 4096,
            dtype=None, device=None) -> Guard:
    """Register `cache` (a transformers `StaticCache`) and, when `model` carries
    PEFT adapters, their LoRA weights with `session`.  A cache not yet
    allocated is allocated here from the model's config (`batch_size` needed).
    `max_tokens` adds a protected buffer of the tokens generated so far.
    The same call in a recovering process registers the same regions, which
    `restore` then fills.  Returns the `Guard` naming them."""
    _check_cache(cache)
    _initialise(cache, model, batch_size, dtype, device)
    kv = []
    for i, layer in enumerate(cache.layers):
        k, v = f"{prefix}.kv.{i}.k", f"{prefix}.kv.{i}.v"
        session.register(k, layer.keys, kind="kv", detect=detect, page_bytes=page_bytes)
        session.register(v, layer.values, kind="kv", detect=detect, page_bytes=page_bytes)
        kv.append((i, k, v))
    dev = cache.layers[0].keys.device
    counters = torch.zeros((len(cache.layers), 2), dtype=torch.int64, device=dev)
    guard = Guard(session=session, cache=cache, model=model, prefix=prefix, kv=kv, lora={}, counters=counters)
    guard._sync_counters()
    session.register(f"{prefix}.counters", counters, kind="opaque", detect="all", page_bytes=64)
    for name, p in _lora_parameters(model).items():
        if not p.data.is_contiguous():
            raise SessionError("the LoRA weight is not contiguous", where=f"parameter {name!r}")
        region = f"{prefix}.lora.{name}"
        session.register(region, p.data, kind="adapter", detect=detect, page_bytes=page_bytes)
        guard.lora[region] = p
    if max_tokens is not None:
        b = cache.layers[0].keys.shape[0]
        guard.tokens = torch.zeros((b, int(max_tokens)), dtype=torch.int64, device=dev)
        guard.tokens_len = torch.zeros((8,), dtype=torch.int64, device=dev)
        session.register(f"{prefix}.tokens", guard.tokens, kind="opaque", detect=detect, page_bytes=page_bytes)
        session.register(f"{prefix}.tokens_len", guard.tokens_len, kind="opaque", detect="all", page_bytes=64)
    session.before_checkpoint(guard._sync_counters)
    return guard


def restore(session, guard: Guard, target="latest") -> Restored:
    """Recover every region `guard` names in place (keys, values, LoRA weights,
    token buffer), then put each layer's position counters back, so the next
    `model(...)` or `generate()` call continues where the checkpoint was."""
    out = session.recover(target, into="registered")
    del out
    counters = guard.counters.cpu()
    for i, layer in enumerate(guard.cache.layers):
        layer.cumulative_length.copy_(counters[i, 0].to(layer.cumulative_length.device))
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int = int(counters[i, 1])
    tokens = None
    if guard.tokens is not None:
        n = int(guard.tokens_len[0].item())
        tokens = guard.tokens[:, :n].clone()
    if guard.cache.layers[0].keys.is_cuda:
        torch.cuda.current_stream().synchronize()
    return Restored(epoch=int(session.last_recovery.epoch), stats=session.last_recovery, tokens=tokens)


class CheckpointEvery(StoppingCriteria):
    """A `generate()` stopping criterion that never stops: every `every` new
    tokens it records the sequences in the guard's token buffer (when it has
    one) and checkpoints the session.  `on_step(step, input_ids)`, if given, is
    called first, for work that belongs to the step (an online LoRA update).
    `start`: the steps already taken, when `generate()` continues after a
    restore (the new tokens so far), so that `on_step` keeps its numbering.
    `after(step, stats)`, if given, is called after each checkpoint.

        model.generate(ids, past_key_values=cache, stopping_criteria=[CheckpointEvery(guard, 8)])
    """

    def __init__(self, guard: Guard, every: int = 1, on_step=None, *, start: int = 0, after=None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SessionError(f"every must be a whole number >= 1, not {every!r}", where="CheckpointEvery")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise SessionError(f"start must be a whole number >= 0, not {start!r}", where="CheckpointEvery")
        self.guard, self.every, self.on_step, self.after = guard, every, on_step, after
        self.steps = start
        self.stats = []

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps, input_ids)
        if self.steps % self.every == 0:
            if self.guard.tokens is not None:
                self.guard.record_tokens(input_ids)
            st = self.guard.session.checkpoint(reason="generate", on_full="coalesce")
            self.stats.append(st)
            if self.after is not None:
                self.after(self.steps, st)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
