"""The reference workload: a small decoder-only transformer serving several
sequences at once from a paged KV cache, with a LoRA adapter updated online.

It exists to be protected.  Everything a decode loop needs to continue lives in
five arrays that are updated in place (never rebound), so a `Session` can
register them once and checkpoint them at any step:

    kv       [layers, num_blocks, 2, block_size, kv_heads, head_dim]  float32
             one PagedAttention cache per layer (K at [:, :, 0], V at [:, :, 1])
    adapter  [layers, 2, d_model, rank]  float32   LoRA A and B^T on the query
    sched    int32 scheduler tables, packed (see `SchedulerTables`)
    tokens   [requests, max_len] int32   prompt + generated tokens of every request
    meta     int64 counters (step, next request, requests done, config digest)

The weights are not state: they are derived from the seed, the same on every
run and backend.  The code is written against an array module `xp` (numpy or
CuPy); on one backend every step is bit-reproducible because every shape is
fixed (all slots are computed every step, idle ones masked) and the order of
operations never depends on data.  Control decisions (admission, block
allocation, completion) run on the host from a copy of the scheduler tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

FREE, RUNNING = 0, 1  # slot states
WAITING, ACTIVE, DONE = 0, 1, 2  # request states

# meta[] layout (int64)
META_STEP, META_NEXT_REQ, META_DONE, META_CONFIG, META_LEN = 0, 1, 2, 3, 8


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Sizes of the model, the cache and the request stream.  The defaults keep
    a CPU step at a few milliseconds."""

    seed: int = 0
    vocab: int = 1024
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 1024
    block_size: int = 16
    num_blocks: int = 64
    max_slots: int = 8
    max_blocks_per_seq: int = 8
    lora_rank: int = 8
    lora_lr: float = 0.05
    lora_decay: float = 0.98
    n_requests: int = 32
    prompt_len: tuple[int, int] = (4, 12)   # inclusive range
    new_tokens: tuple[int, int] = (8, 40)   # inclusive range
    arrival_gap: tuple[int, int] = (0, 4)   # steps between arrivals, inclusive

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def max_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    def digest(self) -> int:
        """A 63-bit digest of the configuration, kept in `meta` so that state
        recovered from a log is never continued under another configuration."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "WorkloadConfig":
        obj = dict(obj)
        for k in ("prompt_len", "new_tokens", "arrival_gap"):
            if k in obj:
                obj[k] = tuple(obj[k])
        return cls(**obj)

    def check(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("d_model must divide into n_heads, n_heads into n_kv_heads")
        if self.prompt_len[1] + self.new_tokens[1] > self.max_len:
            raise ValueError("longest request does not fit max_blocks_per_seq * block_size")
        if self.blocks_needed(self.prompt_len[1] + self.new_tokens[1]) > self.num_blocks:
            raise ValueError("longest request needs more blocks than the cache has")

    def blocks_needed(self, total_tokens: int) -> int:
        # the last generated token is never fed back, so the cache holds total - 1
        return -(-(total_tokens - 1) // self.block_size)


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    arrival: int
    prompt: np.ndarray  # int32
    max_new: int

    @property
    def total(self) -> int:
        return len(self.prompt) + self.max_new


def make_requests(cfg: WorkloadConfig) -> list[Request]:
    """The request stream, a pure function of the configuration."""
    rng = np.random.default_rng([cfg.seed, 1])
    out, t = [], 0
    for i in range(cfg.n_requests):
        t += int(rng.integers(cfg.arrival_gap[0], cfg.arrival_gap[1] + 1))
        plen = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
        prompt = rng.integers(0, cfg.vocab, size=plen).astype(np.int32)
        new = int(rng.integers(cfg.new_tokens[0], cfg.new_tokens[1] + 1))
        out.append(Request(i, t, prompt, new))
    return out


class SchedulerTables:
    """Named int32 views into one packed buffer, so the whole scheduler is one
    region.  Works on any array module: views of a CuPy buffer are CuPy views."""

    def __init__(self, cfg: WorkloadConfig, buf):
        s, mb, nb, r = cfg.max_slots, cfg.max_blocks_per_seq, cfg.num_blocks, cfg.n_requests
        self.layout = [
            ("block_tables", (s, mb)),   # block id per slot and logical block, -1 unused
            ("seq_lens", (s,)),          # tokens held in the cache per slot
            ("slot_state", (s,)),        # FREE | RUNNING
            ("slot_req", (s,)),          # request served by the slot, -1 none
            ("next_token", (s,)),        # input token of the slot's next step
            ("block_owner", (nb,)),      # slot owning each block, -1 free
            ("block_stamp", (nb,)),      # 1 + step of the last write into each block
            ("req_state", (r,)),         # WAITING | ACTIVE | DONE
            ("req_len", (r,)),           # tokens (prompt + generated) of each request
        ]
        self.buf = buf
        off = 0
        for name, shape in self.layout:
            n = int(np.prod(shape))
            setattr(self, name, buf[off:off + n].reshape(shape))
            off += n
        assert off == buf.size

    @staticmethod
    def size(cfg: WorkloadConfig) -> int:
        s, mb = cfg.max_slots, cfg.max_blocks_per_seq
        return s * mb + 4 * s + 2 * cfg.num_blocks + 2 * cfg.n_requests


def _weights(cfg: WorkloadConfig) -> dict[str, np.ndarray]:
    """Deterministic float32 weights from the seed (host numpy, identical everywhere)."""
    rng = np.random.default_rng([cfg.seed, 0])
    d, dff, kvd, L = cfg.d_model, cfg.d_ff, cfg.n_kv_heads * cfg.head_dim, cfg.n_layers

    def mat(*shape, fan_in):
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)

    return {
        "emb": mat(cfg.vocab, d, fan_in=1) * np.float32(0.5),
        "pos": mat(cfg.max_len, d, fan_in=1) * np.float32(0.1),
        "wq": mat(L, d, d, fan_in=d),
        "wk": mat(L, d, kvd, fan_in=d),
        "wv": mat(L, d, kvd, fan_in=d),
        "wo": mat(L, d, d, fan_in=d),
        "w1": mat(L, d, dff, fan_in=d),
        "w2": mat(L, dff, d, fan_in=dff),
        "out": mat(d, cfg.vocab, fan_in=d),
        "lora_a": mat(L, d, cfg.lora_rank, fan_in=d),
    }


def _to_host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


class Workload:
    """The decode loop and its state.  `step()` advances every running sequence
    by one token; `regions()` names the arrays worth protecting."""

    def __init__(self, cfg: WorkloadConfig | None = None, xp=np):
        self.cfg = cfg = cfg or WorkloadConfig()
        cfg.check()
        self.xp = xp
        self.requests = make_requests(cfg)
        w = _weights(cfg)
        self.w = {k: xp.asarray(v) for k, v in w.items()}
        L, d = cfg.n_layers, cfg.d_model
        self.kv = xp.zeros((L, cfg.num_blocks, 2, cfg.block_size, cfg.n_kv_heads, cfg.head_dim), xp.float32)
        self.adapter = xp.zeros((L, 2, d, cfg.lora_rank), xp.float32)
        self.adapter[:, 0] = self.w["lora_a"]  # B starts at zero: the adapter starts as a no-op
        self.sched = xp.zeros(SchedulerTables.size(cfg), xp.int32)
        self.tokens = xp.full((cfg.n_requests, cfg.max_len), -1, xp.int32)
        self.meta = xp.zeros(META_LEN, xp.int64)
        t = SchedulerTables(cfg, self.sched)
        t.block_tables[...] = -1
        t.slot_req[...] = -1
        t.block_owner[...] = -1
        for r in self.requests:
            self.tokens[r.id, : len(r.prompt)] = xp.asarray(r.prompt)
            t.req_len[r.id] = len(r.prompt)
        self.meta[META_CONFIG] = cfg.digest()
        self._sched_views = t

    # ---------------------------------------------------------------- state
    def regions(self) -> dict[str, tuple[object, str]]:
        """name -> (array, kind) of everything a restart needs."""
        return {
            "kv": (self.kv, "kv"),
            "adapter": (self.adapter, "adapter"),
            "sched": (self.sched, "scheduler"),
            "tokens": (self.tokens, "scheduler"),
            "meta": (self.meta, "opaque"),
        }

    def kv_blocks(self) -> dict:
        """What a KV block-table scanner needs: live views of the block tables,
        the sequence lengths and the per-block write stamps."""
        t = self._sched_views
        return {"block_tables": t.block_tables, "seq_lens": t.seq_lens, "block_stamp": t.block_stamp}

    @property
    def step_index(self) -> int:
        return int(self.meta[META_STEP])

    @property
    def tables(self) -> SchedulerTables:
        """Views of the live scheduler tables (block tables, seq lens, ...)."""
        return self._sched_views

    def load_state(self, arrays: dict) -> None:
        """Copy recovered arrays into this workload's own (in place)."""
        for name, (dst, _) in self.regions().items():
            src = arrays[name]
            if tuple(src.shape) != tuple(dst.shape) or np.dtype(src.dtype) != np.dtype(dst.dtype):
                raise ValueError(f"region {name}: recovered {src.dtype}{tuple(src.shape)}, "
                                 f"workload needs {dst.dtype}{tuple(dst.shape)}")
            dst[...] = self.xp.asarray(src)
        if int(self.meta[META_CONFIG]) != self.cfg.digest():
            raise ValueError("recovered state belongs to another workload configuration")

    def snapshot(self) -> dict[str, np.ndarray]:
        """Host copies of every state array."""
        return {name: _to_host(a).copy() for name, (a, _) in self.regions().items()}

    def outputs(self) -> dict[int, list[int]]:
        """Generated tokens (prompt excluded) of every request so far."""
        toks = _to_host(self.tokens)
        lens = _to_host(self._sched_views.req_len)
        return {r.id: toks[r.id, len(r.prompt): lens[r.id]].tolist() for r in self.requests}

    # ---------------------------------------------------------------- one step
    def step(self) -> dict:
        """Admit, run one token for every running slot, retire finished
        sequences, update the adapter.  Returns what happened (for logs)."""
        cfg, xp = self.cfg, self.xp
        step = self.step_index
        h = SchedulerTables(cfg, _to_host(self.sched).copy())  # host mirror
        req_len = h.req_len
        admitted = self._admit(h, step)

        running = np.flatnonzero(h.slot_state == RUNNING)
        # allocate a block for every running slot whose next position opens one
        for s in running:
            pos = int(h.seq_lens[s])
            if pos % cfg.block_size == 0:
                free = np.flatnonzero(h.block_owner == -1)
                blk = int(free[0])  # admission reserved enough; lowest free block first
                h.block_owner[blk] = s
                h.block_tables[s, pos // cfg.block_size] = blk

        S = cfg.max_slots
        active = np.zeros(S, bool)
        active[running] = True
        pos = h.seq_lens.copy()
        tok = np.where(active, h.next_token, 0).astype(np.int32)
        blk = np.where(active, h.block_tables[np.arange(S), np.minimum(pos // cfg.block_size, cfg.max_blocks_per_seq - 1)], 0)
        h.block_stamp[blk[active]] = step + 1  # what a block-table scanner reads
        self.sched[...] = xp.asarray(h.buf)  # block tables must be on the device before the forward pass

        u = None
        if running.size:
            logits, u = self._forward(tok, pos, blk.astype(np.int32), active)
            nxt = _to_host(xp.argmax(logits, axis=1)).astype(np.int32)
        finished = []
        toks_host_updates = []
        for s in running:
            rid = int(h.slot_req[s])
            req = self.requests[rid]
            h.seq_lens[s] += 1
            p = int(h.seq_lens[s])
            if p < len(req.prompt):
                h.next_token[s] = req.prompt[p]
                continue
            n = int(req_len[rid])
            toks_host_updates.append((rid, n, int(nxt[s])))
            req_len[rid] = n + 1
            h.next_token[s] = nxt[s]
            if n + 1 == req.total:
                finished.append(rid)
                h.req_state[rid] = DONE
                h.block_owner[h.block_owner == s] = -1
                h.block_tables[s] = -1
                h.seq_lens[s] = 0
                h.slot_state[s] = FREE
                h.slot_req[s] = -1
                h.next_token[s] = 0
        for rid, n, t in toks_host_updates:
            self.tokens[rid, n] = t
        if u is not None:
            self._update_adapter(step % cfg.n_layers, u)
        self.sched[...] = xp.asarray(h.buf)
        self.meta[META_STEP] = step + 1
        if finished:
            self.meta[META_DONE] = int(self.meta[META_DONE]) + len(finished)
        return {"step": step, "running": int(running.size), "admitted": admitted, "finished": finished}

    def _admit(self, h: SchedulerTables, step: int) -> list[int]:
        cfg = self.cfg
        admitted = []
        nxt = int(self.meta[META_NEXT_REQ])
        while nxt < cfg.n_requests and self.requests[nxt].arrival <= step:
            free_slots = np.flatnonzero(h.slot_state == FREE)
            if free_slots.size == 0:
                break
            req = self.requests[nxt]
            # blocks promised to running sequences but not yet allocated
            promised = 0
            for s in np.flatnonzero(h.slot_state == RUNNING):
                r = self.requests[int(h.slot_req[s])]
                promised += cfg.blocks_needed(r.total) - int((h.block_tables[s] >= 0).sum())
            if int((h.block_owner == -1).sum()) - promised < cfg.blocks_needed(req.total):
                break  # first come, first served: wait for blocks
            s = int(free_slots[0])
            h.slot_state[s] = RUNNING
            h.slot_req[s] = req.id
            h.seq_lens[s] = 0
            h.next_token[s] = req.prompt[0]
            h.req_state[req.id] = ACTIVE
            admitted.append(req.id)
            nxt += 1
        self.meta[META_NEXT_REQ] = nxt
        return admitted

    def _forward(self, tok, pos, blk, active):
        """One token for every slot (idle slots computed and discarded; their
        cache writes go nowhere).  Returns logits [slots, vocab] and the mean
        normalised input of the layer whose adapter learns this step."""
        cfg, xp, w = self.cfg, self.xp, self.w
        S, L = cfg.max_slots, cfg.n_layers
        H, KVH, Dh, BS = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.block_size
        G = H // KVH
        T = cfg.max_len
        tok_d = xp.asarray(tok)
        pos_d = xp.asarray(pos.astype(np.int32))
        act_idx = xp.asarray(np.flatnonzero(active))
        blk_d = xp.asarray(blk)[act_idx]
        off_d = (pos_d % BS)[act_idx]
        tables = xp.asarray(np.maximum(_to_host(self._sched_views.block_tables), 0))  # [S, MB]
        # positions 0..T-1 visible to each slot: p <= pos (its own token included)
        visible = xp.arange(T, dtype=xp.int32)[None, :] <= pos_d[:, None]  # [S, T]
        scale = xp.float32(1.0 / np.sqrt(Dh))
        learn_layer = int(self.meta[META_STEP]) % L
        x = w["emb"][tok_d] + w["pos"][pos_d]
        u = None
        for l in range(L):
            hn = _rms(xp, x)
            if l == learn_layer:
                u = hn
            a = self.adapter[l]
            q = hn @ w["wq"][l] + (hn @ a[0]) @ a[1].T
            k = hn @ w["wk"][l]
            v = hn @ w["wv"][l]
            cache = self.kv[l]  # [NB, 2, BS, KVH, Dh]
            cache[blk_d, 0, off_d] = k[act_idx].reshape(-1, KVH, Dh)
            cache[blk_d, 1, off_d] = v[act_idx].reshape(-1, KVH, Dh)
            kk = cache[tables, 0].reshape(S, T, KVH, Dh)     # gather this slot's blocks
            vv = cache[tables, 1].reshape(S, T, KVH, Dh)
            qh = q.reshape(S, KVH, G, Dh)
            sc = (qh @ kk.transpose(0, 2, 3, 1)) * scale         # [S, KVH, G, T]
            sc = xp.where(visible[:, None, None, :], sc, xp.float32(-1e30))
            sc = sc - sc.max(axis=-1, keepdims=True)
            pr = xp.exp(sc)
            pr = xp.where(visible[:, None, None, :], pr, xp.float32(0))
            pr = pr / pr.sum(axis=-1, keepdims=True)
            o = (pr @ vv.transpose(0, 2, 1, 3)).reshape(S, -1)   # [S, KVH, G, Dh] -> [S, D]
            x = x + o @ w["wo"][l]
            hn = _rms(xp, x)
            x = x + xp.maximum(hn @ w["w1"][l], xp.float32(0)) @ w["w2"][l]
        logits = _rms(xp, x) @ w["out"]
        mask = xp.asarray(active.astype(np.float32))[:, None]
        u = (u * mask).sum(axis=0) / xp.float32(max(int(active.sum()), 1))
        return logits, u

    def _update_adapter(self, layer: int, u) -> None:
        """Online LoRA update of one layer per step (so adapter pages change a
        few at a time): B^T <- decay * B^T + lr * u (u A)^T, a Hebbian rule
        driven by what the model just saw."""
        cfg, xp = self.cfg, self.xp
        a = self.adapter[layer]
        coef = u @ a[0]  # [rank]
        a[1] *= xp.float32(cfg.lora_decay)
        a[1] += xp.float32(cfg.lora_lr) * (u[:, None] * coef[None, :])

    def prefill(self, tokens):
        """Dense causal forward of whole prompts, int32 tokens [batch, T] with
        T <= max_len: the work of rebuilding their KV cache from scratch (the
        re-prefill a system without a log pays after a crash).  Returns
        (K, V), each [layers, batch, T, kv_heads, head_dim]."""
        cfg, xp, w = self.cfg, self.xp, self.w
        tok = xp.asarray(tokens)
        B, T = tok.shape
        H, KVH, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // KVH
        causal = xp.tril(xp.ones((T, T), dtype=bool))
        scale = xp.float32(1.0 / np.sqrt(Dh))
        x = w["emb"][tok] + w["pos"][:T][None]
        ks, vs = [], []
        for l in range(cfg.n_layers):
            hn = _rms(xp, x)
            a = self.adapter[l]
            q = (hn @ w["wq"][l] + (hn @ a[0]) @ a[1].T).reshape(B, T, KVH, G, Dh)
            k = (hn @ w["wk"][l]).reshape(B, T, KVH, Dh)
            v = (hn @ w["wv"][l]).reshape(B, T, KVH, Dh)
            ks.append(k)
            vs.append(v)
            qt = q.transpose(0, 2, 3, 1, 4)                       # [B, KVH, G, T, Dh]
            sc = (qt @ k.transpose(0, 2, 3, 1)[:, :, None]) * scale  # [B, KVH, G, T, T]
            sc = xp.where(causal, sc, xp.float32(-1e30))
            sc = sc - sc.max(axis=-1, keepdims=True)
            pr = xp.exp(sc)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            o = (pr @ v.transpose(0, 2, 1, 3)[:, :, None])         # [B, KVH, G, T, Dh]
            o = o.transpose(0, 3, 1, 2, 4).reshape(B, T, -1)
            x = x + o @ w["wo"][l]
            hn = _rms(xp, x)
            x = x + xp.maximum(hn @ w["w1"][l], xp.float32(0)) @ w["w2"][l]
        return xp.stack(ks), xp.stack(vs)

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4

    def run(self, until_step: int, on_step=None) -> None:
        while self.step_index < until_step:
            info = self.step()
            if on_step is not None:
                on_step(self, info)


def _rms(xp, x):
    return x / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + xp.float32(1e-6))
