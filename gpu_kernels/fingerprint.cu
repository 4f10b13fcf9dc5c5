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

#ifndef UNROLL
#define UNROLL 8
#endif

#define FP_K1 0x9E3779B97F4A7C15ull
#define FP_K2 0xBF58476D1CE4E5B9ull
#define FP_M1 0xBF58476D1CE4E5B9ull
#define FP_M2 0x94D049BB133111EBull

__device__ __forceinline__ u64 fp_mix(u64 w, u64 j) {
    u64 x = (w ^ (j * FP_K1)) * FP_K2;
    return x ^ (x >> 29);
}

__device__ __forceinline__ u64 fp_chunk(uint4 v, u32 c) {
    const u64 w0 = (u64)v.x | ((u64)v.y << 32), w1 = (u64)v.z | ((u64)v.w << 32);
    return fp_mix(w0, 2ull * c) + fp_mix(w1, 2ull * c + 1);
}

__device__ __forceinline__ u64 fmix64(u64 z) {
    z ^= z >> 30;
    z *= FP_M1;
    z ^= z >> 27;
    z *= FP_M2;
    return z ^ (z >> 31);
}

extern "C" __global__ void __launch_bounds__(256)
fingerprint(const u8* __restrict__ region, u64* __restrict__ fps, u8* __restrict__ flags,
            u64 num_pages, u64 region_bytes, int update, u32* __restrict__ list,
            u32* __restrict__ list_count, u32 list_cap) {
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < num_pages; p += warps) {
        const u64 base = p * PAGE_BYTES;
        const u8* r = region + base;
        u64 sum = 0;
        if (base + PAGE_BYTES <= region_bytes) {
#pragma unroll 1
            for (int k0 = 0; k0 < LANE_CHUNKS; k0 += UNROLL) {
                uint4 a[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int c = lane + WARP * (k0 + u);
                    if (k0 + u < LANE_CHUNKS && c < PAGE_CHUNKS)
                        a[u] = __ldcs(reinterpret_cast<const uint4*>(r) + c);
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int c = lane + WARP * (k0 + u);
                    if (k0 + u < LANE_CHUNKS && c < PAGE_CHUNKS) sum += fp_chunk(a[u], (u32)c);
                }
            }
        } else {
            const u32 valid = (u32)(region_bytes - base);
            for (u32 c = lane; c < PAGE_CHUNKS; c += WARP) sum += fp_chunk(load16(r, c * 16, valid), c);
        }
        sum = warp_sum64(sum);
        if (lane == 0) {
            const u64 h = fmix64(sum ^ (u64)PAGE_BYTES);
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
