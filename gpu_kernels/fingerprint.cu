// Page fingerprints: a 64-bit hash per page, kept on the device (8 bytes per
// page), reading the region once.
//
// For the page's little-endian u64 words w_j (zero-padded last page):
//   x_j = (w_j ^ j*K1) * K2;  x_j ^= x_j >> 29;  fp = fmix64((sum_j x_j) ^ PAGE_BYTES)
// The sum is order-free, so lanes take lane-strided 16-byte chunks and the warp
// adds its partial sums.  With `flags` given, flags[p] = (fp != fps[p]) and
// fps[p] is refreshed when `update`; without, fps receives the fingerprints.
// With `list_count` given, dirty page ids are also appended to `list` as in
// shadow_diff.cu.
// Twin: reference.fingerprint_pages / fingerprint_dirty (same constants).
//
// -D PAGE_BYTES (multiple of 64).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
fingerprint(const u8* __restrict__ region, u64* __restrict__ fps, u8* __restrict__ flags,
            u64 num_pages, u64 region_bytes, int update, u32* __restrict__ list,
            u32* __restrict__ list_count, u32 list_cap) {
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < num_pages; p += warps) {
        const u64 h = page_fingerprint(region, region_bytes, p, lane);
        if (lane == 0) {
            if (flags) {
                const u64 old = fps[p];
                flags[p] = (u8)(h != old);
                if (update && h != old) fps[p] = h;
                if (h != old && list_count) note_dirty(list, list_count, list_cap, p);
            } else {
                fps[p] = h;
            }
        }
    }
}
