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
    guard = protect(session, cache, model, batch_size=8, max_tokens=4096)
    state = restore(session, guard)          # keys, values, counters, LoRA, tokens, mask, RNG
    model.generate(state.tokens, attention_mask=state.attention_mask, past_key_values=cache,
                   stopping_criteria=[CheckpointEvery(guard, 8, start=state.steps)], ...)

The continuation gives the tokens, cache and LoRA weights the uninterrupted
run would have, under `generate()`'s defaults:
- with auto-compile on (CUDA and a StaticCache, or
  `compile_config._compile_all_devices`), generate() runs the first forward
  of every call eagerly (`_prefill`); the uninterrupted run computed that
  token with the compiled decode step.  `protect` arranges that a `generate()`
  call whose first forward is one token on a cache already holding the rest
  (a resume) takes the compiled decode call instead, as the uninterrupted run
  did.  Eager models are untouched.
- sampling (`do_sample=True`) draws from the default generator of the cache's
  device: its state is captured with every epoch (`hf.rng`) and put back by
  `restore`, so a seeded run samples the same tokens after a resume;
- the attention mask is kept beside the tokens (`hf.mask`): resuming without
  it would mask every generated token equal to `pad_token_id`.

What is registered, by name under `prefix` (default "hf"):
- `hf.kv.<layer>.k` / `hf.kv.<layer>.v`: each layer's keys and values (kind
  "kv"), sliding-window layers included;
- `hf.counters`: one int64 row per layer (the position tensor and the host-side
  length a sliding-window layer keeps), written from the cache by the
  session's pre-checkpoint hook, so a plain `session.checkpoint()` captures it;
- `hf.lora@<digest>`: every LoRA weight of a PEFT model in one region (kind
  "adapter"), updated in place by online adaptation or not; the digest is
  of the weights' names, shapes and dtype, so that a log of another set of
  adapters (other layers, other modules) is refused in one line as absent
  rather than poured into these.  `protect` moves the weights into one
  tensor (`lora_layout="flat"`, where they share a dtype and a device and
  no storage): each parameter becomes a view of it (`p.data`), the same
  parameter object with the same values, each at a multiple of 256 bytes
  from the tensor's start, as a flat-parameter trainer lays them out, so
  that a checkpoint and a recovery meet one region where they met one a
  weight (a Qwen3's 112: each costs the host tens of microseconds at every
  registration, epoch and recovery).  Their addresses change once, at the
  first protect of the model (a later one takes them where they are, or,
  where adapters were added since, registers a region a weight rather than
  move what an earlier registration holds): protect before capturing a
  CUDA graph of your own that reads them, and before the first compiled
  step (a compiled step recorded before records again).  As with
  a region a weight, a weight given new storage afterwards (`p.data = ...`)
  is no longer the one protected: protect again.
  `lora_layout="tensors"` registers `hf.lora.<parameter>` a weight, as
  logs written before the flat layout hold them; "auto" (the default)
  takes that layout when the session's log holds these weights so, and
  where they cannot share one tensor.  Adapters added after a log was
  written: with absent="keep" a restore to an earlier epoch keeps every
  LoRA weight as it is (one region), where a region a weight kept only the
  new ones;
- `hf.tokens` / `hf.mask` / `hf.tokens_len`, when `max_tokens` is given: the
  tokens generated so far, their attention mask, their count and the steps
  taken, so that `generate()` can continue after a restore;
- `hf.rng`: the state of the default random generator of the cache's device
  (unless `protect(..., rng=False)`).

A `DynamicCache` reallocates its tensors at every step, so there is nothing
fixed to protect: it is refused in one line that says to use a `StaticCache`.
transformers and peft are imported only here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import weakref

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria

from concordia.regions.errors import SessionError
from concordia.regions.region import FLAT_ALIGN, flat_layout, position_page_bytes

PREFIX = "hf"


@dataclasses.dataclass
class Guard:
    """What `protect` registered: the session, the cache, the region names."""

    session: object
    cache: object
    model: object | None
    prefix: str
    kv: list  # [(layer index, keys name, values name)]
    lora: dict  # "<prefix>.lora.<parameter name>" -> parameter
    counters: object  # int64 tensor [layers, 2]
    tokens: object | None = None  # int64 tensor [batch, max_tokens]
    tokens_len: object | None = None  # int64 tensor [8]: tokens so far, steps taken
    mask: object | None = None  # int64 tensor [batch, max_tokens]: their attention mask
    rng: object | None = None  # int64 tensor on the cache's device: the sampling generator's state
    _rng_last: list | None = None  # the words last written into `rng` (CUDA)
    _ints_last: list | None = None  # the sliding-window lengths last written into `counters`
    lengths: list | None = None  # positions each layer holds, on the host, as of the coming checkpoint
    _known_length: int | None = None  # positions every layer holds, as generate()'s tokens tell it
    #: words mode (a resident session): an int64 word on the cache's device counting the cache's
    #: resets (the positions detectors' sequence id), and its last value written
    resets: object | None = None
    _resets_last: int | None = None
    _cum: list | None = None  # the layers' position tensors, when one stack takes them (`_sync_counters`)
    _cum_buf: object | None = None
    #: the regions holding the LoRA weights: ["<prefix>.lora@<digest>"] (flat), a name a weight (tensors), or []
    lora_regions: list = dataclasses.field(default_factory=list)

    @property
    def names(self) -> list[str]:
        out = [n for _, k, v in self.kv for n in (k, v)] + [f"{self.prefix}.counters"] + list(self.lora_regions)
        if self.tokens is not None:
            out += [f"{self.prefix}.tokens", f"{self.prefix}.mask", f"{self.prefix}.tokens_len"]
        if self.rng is not None:
            out.append(f"{self.prefix}.rng")
        return out

    def record_tokens(self, input_ids, attention_mask=None, steps: int | None = None) -> None:
        """Copy the sequences so far (int tensor [batch, n]) into the protected
        token buffer; generate()'s hook calls this before each checkpoint.
        `attention_mask`: the mask of the first columns as given to
        generate() (the prompt's; the columns after it are ones, as generate()
        extends it); None: every column counts.  `steps`: the new tokens taken
        so far, which `restore` hands back for CheckpointEvery(start=...)."""
        if self.tokens is None:
            raise SessionError("protect() was called without max_tokens: no token buffer to record into",
                               where=f"{self.prefix}.tokens")
        b, n = input_ids.shape
        if b != self.tokens.shape[0] or n > self.tokens.shape[1]:
            raise SessionError(f"{b} sequences of {n} tokens do not fit the token buffer "
                               f"{tuple(self.tokens.shape)}", where=f"{self.prefix}.tokens",
                               hint="give protect() a larger max_tokens")
        self.tokens[:, :n].copy_(input_ids, non_blocking=True)
        self.mask[:, :n].fill_(1)
        if attention_mask is not None:
            m = attention_mask.shape[1]
            if tuple(attention_mask.shape) != (b, m) or m > n:
                raise SessionError(f"an attention mask of shape {tuple(attention_mask.shape)} does not cover "
                                   f"the first columns of {b} sequences of {n} tokens", where=f"{self.prefix}.mask")
            self.mask[:, :m].copy_(attention_mask, non_blocking=True)
        self.tokens_len[0].fill_(n)
        if steps is not None:
            self.tokens_len[1].fill_(int(steps))

    def _record_rng(self) -> None:
        # int64 words on the cache's device: [length in bytes, state...].  On
        # CUDA the state is two words (seed, offset), written by fill_ with
        # the values as kernel arguments: no host-to-device copy, no wait on
        # the step.  On the CPU it is a plain copy.
        dev = self.counters.device
        state = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
        n = state.numel()
        if n > (self.rng.numel() - 1) * 8 or n % 8:
            raise SessionError(f"the random generator's state ({n} bytes) does not fit its region",
                               where=f"{self.prefix}.rng")
        words = state.view(torch.int64)
        if dev.type == "cuda":
            vals = [n] + words.tolist()
            if vals != self._rng_last:
                for i, v in enumerate(vals):
                    self.rng[i].fill_(v)
                self._rng_last = vals
        else:
            self.rng[0].fill_(n)
            self.rng[1:1 + words.numel()].copy_(words)

    def _restore_rng(self) -> None:
        words = self.rng.cpu()
        n = int(words[0])
        if n == 0:  # captured by no checkpoint yet
            return
        state = words[1:1 + n // 8].clone().view(torch.uint8)
        dev = self.counters.device
        try:
            if dev.type == "cuda":
                torch.cuda.set_rng_state(state, dev)
            else:
                torch.set_rng_state(state)
        except RuntimeError as exc:
            raise SessionError(f"the random generator's state cannot be put back: {exc}".splitlines()[0],
                               where=f"{self.prefix}.rng",
                               hint="restore with the torch build that wrote the log") from None
        self._rng_last = None

    def capture(self) -> None:
        """What a checkpoint takes beside the tensors: the counters, the lengths, the generator."""
        self._sync_counters()
        if self.rng is not None:
            self._record_rng()

    def _sync_counters(self) -> None:
        # The position tensors live on the device and move without the host; a
        # sliding-window layer also keeps a Python int that leaves them behind
        # once the window is full.  Both go into one int64 row per layer.
        layers = self.cache.layers
        cum = [layer.cumulative_length for layer in layers]
        first = self._cum is None
        if first or any(a is not b for a, b in zip(cum, self._cum)):
            # the layers' own position tensors, made once and moved in place: stacked in one call each time
            fast = all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.int64
                       and t.device == self.counters.device for t in cum)
            self._cum = cum if fast else None
            self._cum_buf = torch.empty(len(cum), dtype=torch.int64, device=self.counters.device) if fast else None
        if self._cum is not None and first:
            # protect()'s call: a copy a layer (copy-engine copies), not the stack, whose kernel a fresh
            # process loads at its first launch (5 ms inside a recovery of a Qwen3, profiled on an H100);
            # the first checkpoint, after the first token, loads it instead
            _copy_each([(t, self.counters[i, 0]) for i, t in enumerate(cum)])
        else:
            pos = (torch.stack(cum, out=self._cum_buf) if self._cum is not None else
                   torch.stack([t.reshape(()).to(self.counters.device, torch.int64) for t in cum]))
            self.counters[:, 0].copy_(pos)
        if self.resets is not None:  # words mode: the detectors read the counters where they are
            self._known_length = None
        elif self._known_length is not None:  # from generate()'s tokens: no read of the device
            self.lengths = [self._known_length] * len(layers)
            self._known_length = None
        else:
            self.lengths = [int(row[0]) for row in self.counters.tolist()]
        ints = [int(getattr(layer, "cumulative_length_int", -1)) for layer in layers]
        if ints != self._ints_last:  # a kernel argument each, no copy from the host to wait for
            for i, v in enumerate(ints):
                if self._ints_last is None or self._ints_last[i] != v:
                    self.counters[i, 1].fill_(v)
            self._ints_last = ints
        if self.resets is not None:
            n = int(getattr(self.cache, "concordia_resets", 0))
            if n != self._resets_last:
                self.resets.fill_(n)
                self._resets_last = n


@dataclasses.dataclass
class Restored:
    """What `restore` put back: the epoch, the recovery statistics and, when a
    token buffer is protected, what `generate()` needs to continue: the tokens
    so far (int64 [batch, n]), their attention mask (int64 [batch, n]) and the
    new tokens taken (`steps`, for `CheckpointEvery(start=...)`)."""

    epoch: int
    stats: object
    tokens: object | None
    attention_mask: object | None = None
    steps: int = 0


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
    """{name: parameter} of `model.named_parameters()` whose name has a part
    beginning "lora_" (PEFT's adapters: `lora_A`, `lora_B`, `lora_embedding_A`, ...).

    Walked by hand, with the same order, names and sharing rules as
    `named_parameters` (a module or parameter met again is not met again), and
    a parameter's name made only when it is taken: the generators of
    `named_parameters` made the name of every module and parameter of the
    model, 1.5 ms over a PEFT Qwen3's thousand modules in a fresh process's
    recovery.  A model whose class, or a module whose class, lays out its own
    `named_parameters`, `named_modules` or `_named_members` is asked through
    `named_parameters` itself."""
    if model is None:
        return {}
    if any(getattr(type(model), f) is not getattr(torch.nn.Module, f) for f in ("named_parameters", "_named_members")):
        return _lora_named(model.named_parameters())   # (every module's own named_modules: in the walk)
    found = _peft_lora(model)
    return found if found is not None else _lora_walk(model)


def _plain(kind) -> bool:
    """Whether module class `kind` walks its children as nn.Module does."""
    return kind.named_modules is torch.nn.Module.named_modules


def _peft_lora(model) -> dict | None:
    """`_lora_parameters` of a PEFT LoRA model from the modules PEFT put its
    adapters in (`targeted_module_names`), without walking the rest of the
    model: a Qwen3's 56 targets, not its thousand modules (1.3 ms of a
    recovery's protect() on a CI host).  Each target is walked as the whole
    model would be, its own "lora_" parameters then its "lora_" children's, in
    its order; the targets are taken in the order of `named_modules` (each
    module's place among its parent's children), once each.  None
    where the model is not that: not a PEFT model over a LoRA tuner with one
    adapter, an adapter that saves whole modules, tokens or targets
    parameters (their weights lie outside the targets), or a class on the
    way with a walk of its own; the whole model is walked then."""
    base = model._modules.get("base_model")
    inner = base._modules.get("model") if base is not None else None
    targets = getattr(base, "targeted_module_names", None)
    configs = getattr(base, "peft_config", None)
    if (inner is None or not isinstance(targets, list) or not isinstance(configs, dict) or len(configs) != 1
            or not type(model).__module__.startswith("peft") or not type(base).__module__.startswith("peft")):
        return None
    config = next(iter(configs.values()))
    if (type(config).__name__ != "LoraConfig" or getattr(config, "modules_to_save", None)
            or getattr(config, "trainable_token_indices", None) or getattr(config, "target_parameters", None)):
        return None
    if not (_plain(type(model)) and _plain(type(base)) and _plain(type(inner))):
        return None
    found, places = [], {}   # (each part's place among its parent's children, target, module): named_modules' order
    for target in targets:
        module, at = inner, []
        for part in target.split("."):
            children = module._modules if module is not None else {}
            if part not in children or part.startswith("lora_"):   # ("lora_" parts: the whole walk names them)
                return None
            place = places.get(id(module))
            if place is None:
                place = places[id(module)] = {name: i for i, name in enumerate(children)}
            at.append(place[part])
            module = children[part]
        if module is None:
            return None
        found.append((tuple(at), target, module))
    # PEFT lists them as it met them; a second adapter's, added then the first deleted, come after the
    # first's (and stay listed): in the order of the modules, each once
    found = sorted({at: (at, t, m) for at, t, m in found}.values(), key=lambda f: f[0])
    out, seen_modules, seen_params, plain = {}, set(), set(), set()   # plain: classes with nn.Module's walk
    walk = torch.nn.Module.named_modules
    for _, target, module in found:
        stack = [(module, "base_model.model." + target, False)]
        while stack:   # (a module met again, checked as it is taken, as the whole walk does)
            m, path, under = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            kind = type(m)
            if kind not in plain:
                if kind.named_modules is not walk:
                    return None
                plain.add(kind)
            params, children = m._parameters, m._modules
            if params:
                for name, p in params.items():
                    if p is not None and id(p) not in seen_params and (under or name.startswith("lora_")):
                        seen_params.add(id(p))
                        out[path + "." + name] = p
            if children:
                for name, child in reversed(children.items()):
                    if child is not None and (under or name.startswith("lora_")):
                        stack.append((child, path + "." + name, True))
    return out


def _lora_walk(model) -> dict:
    """`_lora_parameters` by a walk of the whole model (its docstring)."""
    out, seen_modules, seen_params, plain = {}, set(), set(), set()   # plain: classes with nn.Module's walk
    stack = [(model, None, False)]   # (module, (its parent's entry, its name) or None, under a "lora_" part)
    while stack:
        entry = stack.pop()   # in the order named_modules visits them: depth first, children in their order
        module, _, under = entry
        kind = type(module)
        if kind not in plain:
            if kind.named_modules is not torch.nn.Module.named_modules:
                return _lora_named(model.named_parameters())
            plain.add(kind)
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        params, children = module._parameters, module._modules
        if params:
            for name, p in params.items():
                if p is None or id(p) in seen_params:
                    continue
                seen_params.add(id(p))
                if under or name.startswith("lora_"):
                    parts, e = [name], entry
                    while e[1] is not None:
                        e, part = e[1]
                        parts.append(part)
                    out[".".join(reversed(parts))] = p
        if children:
            for name, child in reversed(children.items()):
                if child is not None:
                    stack.append((child, (entry, name), under or name.startswith("lora_")))
    return out


def _lora_named(named) -> dict:
    return {name: p for name, p in named if ".lora_" in name or name.startswith("lora_")}


def _lora_flat(session, lora: dict, prefix: str, layout: str):
    """(region name, the one tensor holding every weight of `lora` ({name:
    parameter}), [each weight's view of it], or None where the parameters
    are its views already), or None: a region a weight (`protect`'s
    `lora_layout`).  The weights lie in order, each at a
    multiple of FLAT_ALIGN bytes (`flat_layout`), the gaps zero; the values are copied in
    here, and the caller makes each parameter its view once the regions are
    registered (a refused protect() moves nothing).  The name is
    "<prefix>.lora@<digest>", the digest of the names, shapes and dtype: a
    log written by another set of adapters of the same size holds another
    name, so a recovery refuses it in one line (absent) rather than pour
    one adapter's weights into another's.
    None where the layout is "tensors"; where "auto" finds the log holding
    any of these weights a region each (and not this flat region); where
    the weights differ in dtype or device, or share storage (a view each
    would untie them), or where a registration holds any of them where
    they are (`_HELD`: moving them would leave it reading memory they left);
    "flat" refuses these in one line.  Weights this function laid out
    already (an earlier protect of the same model) are taken where they
    are: compiled code that holds their addresses keeps them."""
    if layout == "tensors":
        return None
    names, ps = list(lora), [p.data for p in lora.values()]
    dt, dev = ps[0].dtype, ps[0].device
    key = hashlib.sha256(repr([str(dt), FLAT_ALIGN] + [(n, tuple(p.shape)) for n, p in zip(names, ps)]).encode())
    name = f"{prefix}.lora@{key.hexdigest()[:16]}"
    log = session.log
    if layout == "auto" and log.region_named(name) is None and any(
            log.region_named(f"{prefix}.lora.{n}") is not None for n in names):
        return None   # a log of a region a weight: recovered in its layout
    offsets, total = flat_layout([p.numel() for p in ps], ps[0].element_size())
    mixed = any(p.dtype != dt or p.device != dev for p in ps)
    if not mixed and _laid_out(ps, offsets, total):   # by an earlier protect: no move
        with torch.inference_mode(False):
            return name, torch.empty(0, dtype=dt, device=dev).set_(ps[0].untyped_storage(), 0, (total,)), None
    why = _unmovable(lora, ps, mixed)
    if why is not None:
        if layout == "flat":
            raise SessionError(f"{why}: they cannot be held in one tensor", where="protect",
                               hint='lora_layout="tensors" registers a region a weight')
        return None
    gapless = total == sum(p.numel() for p in ps)
    with torch.inference_mode(False):   # (an inference tensor's views could not be trained)
        flat = (torch.empty if gapless else torch.zeros)(total, dtype=dt, device=dev)   # (the gaps: zeros)
        # each weight's view: as_strided makes it in one call (a slice, then a view, cost 2.7 times as much
        # on the host, 0.66 ms for a Qwen3's 112); the weights are contiguous (protect checked), so their
        # strides address their elements as the flat tensor holds them
        views = [flat.as_strided(p.shape, p.stride(), o) for p, o in zip(ps, offsets)]
        # one launch of the batched copy a read ahead has loaded, or a copy a weight: on CUDA each is a
        # copy-engine copy (contiguous, one dtype), where one torch.cat would be a kernel that a fresh
        # process loads at its first launch (about 7 ms of a Qwen3's recovery on an H100)
        _copy_each(list(zip(ps, views)), alike=True)
        if dev.type == "cuda" and torch.cuda.current_stream(dev) != torch.cuda.default_stream(dev):
            for p in ps:   # the old weights go once their parameters move: not before a side stream read them
                p.record_stream(torch.cuda.current_stream(dev))
    return name, flat, views


#: the fewest pairs `_copy_each` copies in one launch: its fixed cost (the stream's view, the row table's
#: upload, the launch; about 0.2 ms of host on an H100's) is some 25 copy_ calls' (8 microseconds each)
BATCH_FROM = 64


def _copy_each(pairs: list, alike: bool = False) -> None:
    """dst.copy_(src) for each (src, dst) tensor pair of `pairs`: in one
    launch where `_copied_at_once` can, a copy a pair otherwise."""
    if not _copied_at_once(pairs, alike):
        for src, dst in pairs:
            dst.copy_(src)


def _copied_at_once(pairs: list, alike: bool) -> bool:
    """Queue `_copy_each`'s copies as one launch of gpu_kernels' `copy_spans`
    on torch's current stream, where there are BATCH_FROM pairs or more,
    every tensor is a contiguous CUDA tensor on one device, each pair of one
    dtype and size (`alike`: the caller made them so, not checked again),
    CuPy is imported and that kernel is loaded there already (a read ahead
    loads it: the 112 copies of a Qwen3's adapters took 1.4 ms of a fresh
    recovery's host one at a time; its 28 counters stay a copy a pair, one
    launch cost as much as their copies, H100 stamps at `7c38424`).  False,
    with nothing queued, otherwise."""
    import sys

    if len(pairs) < BATCH_FROM or "cupy" not in sys.modules:
        return False
    dev = pairs[0][1].device
    if dev.type != "cuda":
        return False
    if not alike and not all(s.device == dev and d.device == dev and s.dtype == d.dtype and s.numel() == d.numel()
                             and s.is_contiguous() and d.is_contiguous() for s, d in pairs):
        return False
    import cupy

    from concordia.gpu_kernels import gpu
    from concordia.regions.streams import producer_stream

    with cupy.cuda.Device(dev.index), producer_stream(pairs[0][1], None):   # torch's current stream there
        return gpu.copy_addresses([(s.data_ptr(), d.data_ptr()) for s, d in pairs],
                                  [s.numel() * s.element_size() for s, _ in pairs])


def _unmovable(lora: dict, ps: list, mixed: bool) -> str | None:
    """Why weights `lora` (their tensors `ps`) cannot be moved into one tensor, or None."""
    if mixed:
        return "the LoRA weights differ in dtype or device"
    if len({p.untyped_storage().data_ptr() for p in ps}) < len(ps):
        return "LoRA weights share storage (a view each would untie them, or take them from another's buffer)"
    held = next((n for n, p in lora.items() if _held(p)), None)
    if held is not None:
        return (f"LoRA weight {held!r} is registered where it is by an earlier protect (a move would leave "
                "that registration reading memory it left)")
    return None


#: id -> weak reference of each LoRA parameter some protect() registered where it is (a tensor's == is
#: elementwise, so no WeakSet; a parameter freed leaves)
_HELD: dict = {}


def _held(param) -> bool:
    ref = _HELD.get(id(param))
    return ref is not None and ref() is param


def _laid_out(ps: list, offsets: list, total: int) -> bool:
    """Whether weights `ps` are views of one storage of `total` elements, each
    at its offset of `offsets`, as `_lora_flat` lays them out."""
    storage = ps[0].untyped_storage()
    if any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in ps):
        return False
    return (storage.nbytes() == total * ps[0].element_size()
            and all(p.storage_offset() == o and p.is_contiguous() for p, o in zip(ps, offsets)))


def protect(session, cache, model=None, *, batch_size: int | None = None, max_tokens: int | None = None,
            prefix: str = PREFIX, detect: str = "fingerprint", page_bytes: int = 4096,
            dtype=None, device=None, rng: bool = True, kv_detect: str = "positions",
            words: bool | None = None, lora_layout: str = "auto") -> Guard:
    """Register `cache` (a transformers `StaticCache`) and, when `model` carries
    PEFT adapters, their LoRA weights with `session`.  A cache not yet
    allocated is allocated here from the model's config (`batch_size` needed).
    Full-attention layers are checkpointed by the positions written since
    the last epoch (`kv_detect="positions"`: O(new tokens), row-sized pages;
    the lengths come from `generate()`'s tokens inside `CheckpointEvery`, from
    the cache's counters otherwise); sliding-window layers, the LoRA weights
    and the token buffer by `detect`.  A `cache.reset()` is counted, so the
    next checkpoint writes the cache whole.
    `lora_layout` ("auto", "flat" or "tensors"): how the LoRA weights are
    registered (the module's docstring: one region holding them all, their
    parameters made views of it, or a region a weight as before).
    `max_tokens` adds a protected buffer of the tokens generated so far and
    their attention mask; `rng` protects the sampling generator's state.
    When the model compiles its decode step, a resuming `generate()` call is
    arranged to take it for its first token (see the module's docstring).
    The same call in a recovering process registers the same regions, which
    `restore` then fills.
    `words` (default: whether the session has a resident executor): every
    region is found dirty where it lives, with no host step, so that the
    resident executor's trigger takes the epochs (`CheckpointEvery`): the
    positions detectors read each layer's length from the counters and the
    resets from a word beside them (`table.DET_POSITIONS`), and the small
    regions (counters, lengths, generator) are fingerprinted at
    `page_bytes` like the adapters.  Returns the `Guard` naming them."""
    _check_cache(cache)
    if lora_layout not in ("auto", "flat", "tensors"):
        raise SessionError(f"lora_layout must be 'auto', 'flat' or 'tensors', not {lora_layout!r}", where="protect")
    _initialise(cache, model, batch_size, dtype, device)
    if words is None:
        words = getattr(session, "resident", None) is not None
    kv = []
    dev = cache.layers[0].keys.device
    # the sliding-window lengths (a Python int a layer) go in with the allocation: one copy from the host,
    # not a fill a layer (`_sync_counters` writes only those that change)
    ints = [int(getattr(layer, "cumulative_length_int", -1)) for layer in cache.layers]
    counters = torch.tensor([[0, v] for v in ints], dtype=torch.int64, device=dev)
    guard = Guard(session=session, cache=cache, model=model, prefix=prefix, kv=kv, lora={}, counters=counters,
                  _ints_last=ints)
    _count_resets(cache)
    if words:
        guard.resets = torch.zeros((1,), dtype=torch.int64, device=dev)
    guard._sync_counters()
    # the small regions: every page each epoch by the host, or fingerprinted beside the adapters (words)
    small = dict(detect=detect, page_bytes=page_bytes) if words else None
    regions = []   # registered in one call, all or none: a protect() refused midway leaves none behind
    for i, layer in enumerate(cache.layers):
        k, v = f"{prefix}.kv.{i}.k", f"{prefix}.kv.{i}.v"
        for name, t in ((k, layer.keys), (v, layer.values)):
            if kv_detect == "positions" and not getattr(layer, "is_sliding", False):
                # a decode step's new rows, from the counters: O(new tokens), one row a page
                hints = (dict(length=_length_word(layer, counters[i, 0:1]), seq_ids=guard.resets) if words else
                         dict(length=lambda i=i: guard.lengths[i], seq_ids=lambda: cache.concordia_resets))
                regions.append(dict(name=name, array=t, kind="kv", detect="positions",
                                    page_bytes=position_page_bytes(t.shape[-1] * t.element_size()), **hints))
            else:  # a sliding-window layer rolls every position once its window is full
                regions.append(dict(name=name, array=t, kind="kv", detect=detect, page_bytes=page_bytes))
        kv.append((i, k, v))
    regions.append(dict(name=f"{prefix}.counters", array=counters, kind="opaque",
                        **(small or dict(detect="all", page_bytes=64))))
    lora = _lora_parameters(model)
    for name, p in lora.items():
        if not p.data.is_contiguous():
            raise SessionError("the LoRA weight is not contiguous", where=f"parameter {name!r}")
        guard.lora[f"{prefix}.lora.{name}"] = p
    flat = _lora_flat(session, lora, prefix, lora_layout) if lora else None
    views = None   # the parameters' views of the flat tensor, where they are to move into it
    if flat is not None:
        flat_name, flat_tensor, views = flat
        guard.lora_regions = [flat_name]
        regions.append(dict(name=flat_name, array=flat_tensor, kind="adapter", detect=detect, page_bytes=page_bytes))
    else:
        guard.lora_regions = list(guard.lora)
        regions += [dict(name=region, array=p.data, kind="adapter", detect=detect, page_bytes=page_bytes)
                    for region, p in guard.lora.items()]
    if max_tokens is not None:
        b = cache.layers[0].keys.shape[0]
        guard.tokens = torch.zeros((b, int(max_tokens)), dtype=torch.int64, device=dev)
        guard.tokens_len = torch.zeros((8,), dtype=torch.int64, device=dev)
        guard.mask = torch.zeros((b, int(max_tokens)), dtype=torch.int64, device=dev)
        regions += [dict(name=f"{prefix}.tokens", array=guard.tokens, kind="opaque", detect=detect,
                         page_bytes=page_bytes),
                    dict(name=f"{prefix}.mask", array=guard.mask, kind="opaque", detect=detect, page_bytes=page_bytes),
                    dict(name=f"{prefix}.tokens_len", array=guard.tokens_len, kind="opaque",
                         **(small or dict(detect="all", page_bytes=64)))]
    if rng:
        # a word of length, then the state (16 bytes on CUDA, 5,056 on the CPU), on
        # the cache's device so that every region takes the same (device) path
        n = 8 if dev.type == "cuda" else 640
        guard.rng = torch.zeros((n,), dtype=torch.int64, device=dev)
        regions.append(dict(name=f"{prefix}.rng", array=guard.rng, kind="opaque",
                            **(small or dict(detect="all", page_bytes=n * 8))))
    session.register_all(regions)   # (refused: the guard, never returned, goes with the error)
    if views is not None:   # each LoRA parameter now a view of the region (the same values)
        for param, view in zip(lora.values(), views):
            param.data = view
    for param in lora.values():   # registered where they are now: no later protect moves them
        _HELD[id(param)] = weakref.ref(param, lambda ref, key=id(param): _HELD.pop(key, None))
    session.before_checkpoint(guard.capture)
    if model is not None:
        _resume_compiled(model)
    return guard


def _length_word(layer, counter):
    """A layer's length as a word the positions detector reads where the cache
    is: the layer's own position tensor (int64, one element, updated in place
    by every forward and zeroed by `reset`), else its row of the counters,
    which each checkpoint writes from it."""
    t = getattr(layer, "cumulative_length", None)
    if isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.int64 and t.device == counter.device:
        return t
    return counter


def _count_resets(cache) -> None:
    """Count the cache's resets (`cache.concordia_resets`), once per cache
    however many sessions protect it: a positions region starts over when
    the count moves."""
    if hasattr(cache, "concordia_resets"):
        return
    cache.concordia_resets = 0
    cache.reset = _CountingReset(cache, vars(cache).get("reset"))


class _CountingReset:
    """A cache's `reset` that counts (`_count_resets`).  It holds the cache
    weakly: a cache holding a function that holds the cache would be freed
    (30 GB of device memory at 32k tokens) only by a garbage collection.  A
    deep copy of the cache (a prompt cache copied per request, as transformers
    documents) gets a wrapper of its own, counting and resetting the copy."""

    def __init__(self, cache, own=None):
        self.ref = weakref.ref(cache)
        self.own = own   # an instance's own reset (another wrapper's), else None: its class's

    def __call__(self, *a, **kw):
        c = self.ref()
        if c is None:
            raise SessionError("this reset belongs to a cache that no longer exists",
                               hint="call reset() on the cache itself")
        c.concordia_resets += 1
        return self.own(*a, **kw) if self.own is not None else type(c).reset(c, *a, **kw)

    def __deepcopy__(self, memo):
        import copy

        cache = self.ref()
        # the cache being copied is in memo by the time its attributes are: its copy is there
        twin = memo.get(id(cache)) if cache is not None else None
        return _CountingReset(twin if twin is not None else cache, copy.deepcopy(self.own, memo))


def _generation_model(model):
    """The object whose `generate()` loop runs the forwards: the model itself,
    or the transformers model under a PEFT wrapper; None if it has none."""
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    if hasattr(type(model), "_prefill") and hasattr(model, "get_compiled_call"):
        return model
    return None


def _resume_compiled(model) -> None:
    """Make a resuming generate() call's first forward the compiled decode
    call when generate() compiles its decode step.

    generate() runs the first forward of every call through the eager
    `__call__` (`_prefill`) and the later ones through the compiled call.  A
    call continuing a restored cache feeds one token on a cache holding the
    rest: the very step the uninterrupted run computed compiled.  Eager and
    compiled forwards do not round alike, so that one step would differ.  Here
    such a first forward takes the compiled call, with the inputs a decode
    step is given; any other first forward (a prompt, several new tokens,
    chunked prefill, embeddings, an eager model) is generate()'s own."""
    target = _generation_model(model)
    if target is None or "_prefill" in vars(target):
        return
    own = target._prefill

    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        cache = model_kwargs.get("past_key_values")
        mask = model_kwargs.get("attention_mask")
        if (cache is not None and generation_config.prefill_chunk_size is None
                and model_kwargs.get("inputs_embeds") is None and not self.config.is_encoder_decoder
                and self._valid_auto_compile_criteria(model_kwargs, generation_config)
                and (mask is None or mask.shape[1] == input_ids.shape[1])
                and input_ids.shape[1] - cache.get_seq_length() == 1):
            inputs = self.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            with self._optimize_model_for_decode():
                return self.get_compiled_call(generation_config.compile_config)(**inputs, return_dict=True)
        return own(input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)

    target._prefill = types.MethodType(_prefill, target)


def restore(session, guard: Guard, target="latest", absent: str = "refuse") -> Restored:
    """Recover every region `guard` names in place (keys, values, LoRA weights,
    token buffer), then put each layer's position counters back, so the next
    `model(...)` or `generate()` call continues where the checkpoint was.
    A region with no state at `target` (an adapter added after it) is refused
    before anything is written (AbsentRegionError); absent="keep" leaves its
    weights as they are and lists it in `stats.kept` (`Session.recover`)."""
    out = session.recover(target, into="registered", absent=absent)
    del out
    pos = guard.counters[:, 0]   # where the counters are: copies on the device, none from the host
    _copy_each([(at, layer.cumulative_length) for layer, at in zip(guard.cache.layers, pos, strict=True)])
    # queued behind the recovery's copies; only now does the host wait for them (a read of the counters)
    counters = guard.counters.cpu()
    for i, layer in enumerate(guard.cache.layers):
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int = int(counters[i, 1])
    tokens = mask = None
    steps = 0
    if guard.tokens is not None:
        n, steps = (int(x) for x in guard.tokens_len[:2].tolist())
        tokens = guard.tokens[:, :n].clone()
        mask = guard.mask[:, :n].clone()
    guard._ints_last = None  # the regions now hold what the log held
    if guard.rng is not None:
        guard._restore_rng()
    if guard.cache.layers[0].keys.is_cuda:
        torch.cuda.current_stream().synchronize()
    return Restored(epoch=int(session.last_recovery.epoch), stats=session.last_recovery, tokens=tokens,
                    attention_mask=mask, steps=steps)


class CheckpointEvery(StoppingCriteria):
    """A `generate()` stopping criterion that never stops: every `every` new
    tokens it records the sequences in the guard's token buffer (when it has
    one) and checkpoints the session.  `on_step(step, input_ids)`, if given, is
    called first, for work that belongs to the step (an online LoRA update).
    `start`: the steps already taken, when `generate()` continues after a
    restore (the new tokens so far), so that `on_step` keeps its numbering.
    `after(step, stats)`, if given, is called after each checkpoint.
    `attention_mask`: the mask given to generate() with its input, when there
    is one (a padded batch); it is kept with the tokens, so that `restore`
    hands back the mask generate() would be using.
    `wait`: False (the default) lets a checkpoint whose epoch the device can
    take alone stay pending (`Session.checkpoint(wait=False)`): it is queued
    in stream order behind the step, and committed by the next checkpoint
    (or the session's next call), while the host goes on to the next step;
    its statistics are filled then.  A crash loses at most that epoch.
    `trigger` (default: whether the session has a resident executor once
    the first checkpoint is in, which an "auto" session decides then, and
    `wait` is False; `trigger=True` needs a session that has one now):
    after its first checkpoint, the epochs are taken by the
    resident executor's trigger (`executor.step_trigger`) while this
    criterion only writes the tokens, counters and generator state and marks
    the step: on the device the persistent kernel takes each epoch at the
    step's end in stream order (one launch a step from the host, no wait);
    on the CPU the consumer thread takes it while the step holds.  Their
    statistics come with the session's next call (`Session.checkpoints`);
    `fired` lists (epoch, step count since arming).  Protect with the same
    session (`protect(..., words=True)`, its default there) so that every
    region is found dirty without the host.

        model.generate(ids, past_key_values=cache, stopping_criteria=[CheckpointEvery(guard, 8)])
    """

    def __init__(self, guard: Guard, every: int = 1, on_step=None, *, start: int = 0, after=None,
                 attention_mask=None, wait: bool = False, trigger: bool | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SessionError(f"every must be a whole number >= 1, not {every!r}", where="CheckpointEvery")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise SessionError(f"start must be a whole number >= 0, not {start!r}", where="CheckpointEvery")
        if not isinstance(wait, bool):
            raise SessionError(f"wait must be True or False, not {wait!r}", where="CheckpointEvery")
        if trigger is not None and not isinstance(trigger, bool):
            raise SessionError(f"trigger must be True, False or None, not {trigger!r}", where="CheckpointEvery")
        if trigger and getattr(guard.session, "resident", None) is None:
            raise SessionError("a trigger needs a session with a resident executor", where="CheckpointEvery",
                               hint='open the Session with executor="resident"')
        self.guard, self.every, self.on_step, self.after = guard, every, on_step, after
        self.attention_mask = attention_mask
        self.wait = wait
        self.steps = start
        self.stats = []
        #: None (the default): whether the session has a resident executor once the first checkpoint is in
        #: (an "auto" session decides then)
        self.use_trigger = trigger
        #: the resident executor's step trigger, armed after the first checkpoint (None before)
        self.trigger = None

    @property
    def fired(self) -> list:
        """[(epoch, steps counted since the trigger was armed)] of the trigger's epochs, each listed
        when its step goes; durable once its commit is in, which the session's next call waits for."""
        return [] if self.trigger is None else self.trigger.fired

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps, input_ids)
        due = self.steps % self.every == 0
        if due:
            if self.guard.tokens is not None:
                self.guard.record_tokens(input_ids, self.attention_mask, self.steps)
            # every layer holds the positions of all tokens but the newest (not yet fed)
            self.guard._known_length = input_ids.shape[1] - 1
        if self.trigger is not None:
            if due:
                self.guard.capture()  # what the session's hook would write, before the step's epoch
            self.trigger.step()   # the step ends here: its epoch, when due, is taken by the executor
            if due and self.after is not None:
                self.after(self.steps, None)
        elif due:
            st = self.guard.session.checkpoint(reason="generate", on_full="coalesce", wait=self.wait)
            self.stats.append(st)
            # an "auto" session decides at its first committed epoch (not at a coalesced one)
            if self.use_trigger is None and getattr(self.guard.session, "executor_info", {}).get("decided", True):
                self.use_trigger = getattr(self.guard.session, "resident", None) is not None and not self.wait
            if self.use_trigger:   # the first epoch is the session's own; the trigger takes the next ones
                self.trigger = self.guard.session.resident.step_trigger(self.every)
            if self.after is not None:
                self.after(self.steps, st)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
