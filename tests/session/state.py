"""Small arrays of every kind, shared by the session tests and their child processes."""

from __future__ import annotations

import numpy as np

LOG_SIZE = 16 << 20
SEGMENT = 4 << 20


def make_state(seed=0):
    """One array per kind: a paged KV cache, adapter pages, scheduler tables and
    an opaque byte blob whose size is not a multiple of the page."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, 8, 2, 4, 2, 16), dtype=np.float32)  # [layers, blocks, 2, bs, heads, dim]
    adapter = rng.standard_normal((4, 2, 64, 8), dtype=np.float32)
    sched = rng.integers(-1, 100, size=300, dtype=np.int32)
    blob = rng.integers(0, 256, size=1000, dtype=np.uint8)
    return {"kv": kv, "adapter": adapter, "sched": sched, "blob": blob}


KINDS = {"kv": "kv", "adapter": "adapter", "sched": "scheduler", "blob": "opaque"}
PAGE = {"kv": 1024, "adapter": 4096, "sched": 256, "blob": 128}


def register_all(session, state):
    for name, arr in state.items():
        session.register(name, arr, kind=KINDS[name], page_bytes=PAGE[name])


def mutate(state, seed):
    rng = np.random.default_rng(seed)
    state["kv"][1, 3, 0, 2] += 1.0
    state["adapter"][2, 1, rng.integers(0, 64)] = rng.standard_normal(8, dtype=np.float32)
    state["sched"][rng.integers(0, 300)] = int(rng.integers(0, 100))
    state["blob"][-3:] = rng.integers(0, 256, size=3, dtype=np.uint8)


def copy(state):
    return {k: v.copy() for k, v in state.items()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert x.tobytes() == y.tobytes(), k
