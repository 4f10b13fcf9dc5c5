"""What the staging kernel's GF(2) arithmetic costs on the device (issue 32):
the trigger's decode-shaped epoch staged 3,584 pages of 1 KiB in about
243 µs (`trigger_phases_probe`, 26f551f), 15 GB/s, into device memory and
into the mapped arena alike.  Each page's warp first sets up the split page
CRC on every lane (`page_crc_setup_rt`: two `xpow8n` and a `gf2_multmodp`),
then lane 0 alone moves its region's digest (`xpow8n` of a region-sized
exponent).  This launches that arithmetic alone, one warp a page, in the
staging kernel's grid: with `xpow8n` by repeated squaring (the kernels until
the X8_POW2 table) and as common.cuh computes it now (a power from X8_POW2
per set bit); beside an empty kernel of the same grid.  Medians of REPS
launches timed by CUDA events.  Diagnostic only.
Usage: python3 scripts/gf2_cost_probe.py [PAGES] [REGION_PAGES] [PAGE_BYTES] [REPS]"""

from __future__ import annotations

import statistics
import sys

import cupy as cp
import numpy as np

from concordia.gpu_kernels import jit

pages = int(sys.argv[1]) if len(sys.argv) > 1 else 3584
region_pages = int(sys.argv[2]) if len(sys.argv) > 2 else 10256
pb = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 50
common = (jit.SOURCE_DIR / jit.COMMON).read_text().replace("#pragma once", "", 1)
code = common + r"""
__device__ __forceinline__ u32 xpow8n_squaring(u64 n) {  // the kernels' xpow8n before X8_POW2
    u32 result = 1u << 31, base = 1u << 23;
    while (n) {
        if (n & 1) result = gf2_multmodp(result, base);
        base = gf2_multmodp(base, base);
        n >>= 1;
    }
    return result;
}

extern "C" __global__ void empty_grid(u32 pages, u32* out) {
    const u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w < pages && (threadIdx.x & 31) == 0) out[w] = (u32)w;
}

extern "C" __global__ void staging_math(u32 pages, u32 region_pages, u32 pb, int tabled, u32* out) {
    const u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (w >= pages) return;
    const u32 step = 16 * ((pb / 16 + WARP - 1) / WARP);
    u32 hi = (lane + 1) * step;
    if (hi > pb) hi = pb;
    const u64 p = w % region_pages;
    u32 acc;
    if (tabled) {
        acc = xpow8n(pb - hi) ^ gf2_multmodp(xpow8n(pb), 0xFFFFFFFFu);
        if (lane == 0) acc ^= gf2_multmodp(xpow8n(4 * (region_pages - 1 - p)), 0x1234567u);
    } else {
        acc = xpow8n_squaring(pb - hi) ^ gf2_multmodp(xpow8n_squaring(pb), 0xFFFFFFFFu);
        if (lane == 0) acc ^= gf2_multmodp(xpow8n_squaring(4 * (region_pages - 1 - p)), 0x1234567u);
    }
    out[w * 32 + lane] = acc;
}
"""
mod = jit.load(code, jit.NVRTC_OPTIONS, ("empty_grid", "staging_math"), where="gf2_cost_probe")
empty, math = mod.get_function("empty_grid"), mod.get_function("staging_math")
out = cp.zeros(pages * 32, cp.uint32)
grid = ((pages + 7) // 8,)


def timed(fn, args) -> float:
    fn(grid, (256,), args)  # loaded and warm
    start, end, us = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(reps):
        start.record()
        fn(grid, (256,), args)
        end.record()
        end.synchronize()
        us.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(us)


base = timed(empty, (np.uint32(pages), out))
slow = timed(math, (np.uint32(pages), np.uint32(region_pages), np.uint32(pb), np.int32(0), out))
a = out.get()
fast = timed(math, (np.uint32(pages), np.uint32(region_pages), np.uint32(pb), np.int32(1), out))
same = bool(np.array_equal(a, out.get()))
print(f"{pages} warps ({grid[0]} blocks of 256), pages of {pb} bytes, regions of {region_pages} pages, "
      f"{reps} launches each, median us")
print(f"  empty grid {base:8.1f}")
print(f"  xpow8n by squaring (before X8_POW2) {slow:8.1f}")
print(f"  xpow8n from X8_POW2 (common.cuh)     {fast:8.1f}  (same results: {same})")
