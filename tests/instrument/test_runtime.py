"""Host-side helpers of the hooks that need no GPU."""

from __future__ import annotations

import numpy as np

from concordia.instrument.runtime import bitmap_pages


def test_bitmap_pages_reads_only_the_set_bits_in_order():
    rng = np.random.default_rng(7)
    for pages in (1, 31, 32, 33, 1000, 1 << 16):
        bits = rng.random(pages) < 0.01
        bits[rng.integers(pages)] = True
        padded = np.zeros(-(-pages // 32) * 32 + 32, bool)   # a spare word, and bits past the end set
        padded[:pages] = bits
        padded[pages:] = True
        words = np.packbits(padded, bitorder="little").view("<u4")
        got = bitmap_pages(words, pages)
        assert np.array_equal(got, np.flatnonzero(bits)) and got.dtype == np.int64
    assert bitmap_pages(np.zeros(4, np.uint32), 128).size == 0


def test_attaching_a_module_to_its_own_gate_again_leaves_the_gate_alone(monkeypatch):
    # set_regions re-attaches every module with its gate; watching again would
    # clear the hold slots of a launch held at that gate
    import types

    from concordia.instrument import runtime
    from concordia.instrument.rewriter import Options

    class Global:
        def __init__(self, ptr):
            self.data = types.SimpleNamespace(ptr=ptr)
            self.value = None

        def set(self, v):
            self.value = v

    globals_ = {}
    monkeypatch.setattr(runtime, "module_global",
                        lambda mod, name, n, dt: globals_.setdefault((mod, name), Global(0x1000 + len(globals_))))
    monkeypatch.setattr(runtime, "_watched", {})

    class Gate:
        device_ptr = 0xabc

        def __init__(self):
            self.calls = []

        def watch(self, hold, slots):
            self.calls.append(("watch", hold))

        def unwatch(self, hold):
            self.calls.append(("unwatch", hold))

    res = types.SimpleNamespace(options=Options())
    g = Gate()
    runtime.attach("mod", res, g)
    runtime.attach("mod", res, g)
    runtime.attach("mod", res, g, [])
    assert [c[0] for c in g.calls] == ["watch"]
    runtime.attach("mod", res, None)
    assert [c[0] for c in g.calls] == ["watch", "unwatch"]
    assert int(globals_[("mod", "__concordia_gate")].value[0]) == 0
