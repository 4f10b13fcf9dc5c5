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
