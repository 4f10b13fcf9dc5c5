// Recovery scatter: apply pages from log bytes into a device region.
//
// One warp per entry i: the page at src + src_offsets[i] (16-byte aligned,
// PAGE_BYTES long) is checked against expected[i] when `expected` is given;
// a mismatching page is not applied and bad[i] is set to 1, otherwise bad[i]
// is 0 and the page lands at page ids[i] of the region (truncated at the
// region's end).  src may be device memory or a registered host mapping.
// Twin: reference.scatter_pages.
//
// -D PAGE_BYTES (multiple of 64).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
scatter_pages(const u8* __restrict__ src, const u64* __restrict__ src_offsets,
              const u32* __restrict__ ids, const u32* __restrict__ expected, u64 count,
              u8* __restrict__ region, u64 region_bytes, u8* __restrict__ bad) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    crc_tables_build(T);
    const int lane = threadIdx.x & 31;
    const PageCrc k = page_crc_setup(lane);
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < count; i += warps) {
        const u8* page = src + src_offsets[i];
        if (expected) {
            const u32 crc = warp_page_crc(T, page, PAGE_BYTES, lane, k);
            if (lane == 0) bad[i] = (u8)(crc != expected[i]);
            if (crc != expected[i]) continue;
        } else if (lane == 0) {
            bad[i] = 0;
        }
        const u64 base = (u64)ids[i] * PAGE_BYTES;
        const u32 valid = base + PAGE_BYTES <= region_bytes ? PAGE_BYTES : (u32)(region_bytes - base);
        uint4* out = reinterpret_cast<uint4*>(region + base);
        for (u32 c = lane; c * 16 < valid; c += WARP) {
            const uint4 v = __ldcs(reinterpret_cast<const uint4*>(page) + c);
            if (c * 16 + 16 <= valid) out[c] = v;
            else store_partial(region + base + c * 16, v, valid - c * 16);
        }
    }
}

// The per-page tables scatter_pages reads, expanded from runs: one thread per
// page k < n; its run r is the last whose first page is <= k (a binary search
// over `runs` ascending firsts), j = k - first[r], and
//   stage[k] = run_stage[r] + j * run_pb[r],  ids[k] = (u32)(run_id[r] + j),
//   crcs[k] = crc_table[run_crc[r] + j].
// One launch where the array library took a dozen.  Twin: reference.expand_runs.
extern "C" __global__ void __launch_bounds__(256)
expand_runs(const i64* __restrict__ first, const i64* __restrict__ run_stage, const i64* __restrict__ run_pb,
            const i64* __restrict__ run_id, const i64* __restrict__ run_crc, u64 runs,
            const u32* __restrict__ crc_table, u64 n, u64* __restrict__ stage, u32* __restrict__ ids,
            u32* __restrict__ crcs) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        u64 lo = 0, hi = runs;   // the answer lies in [lo, hi): first[lo] <= k
        while (hi - lo > 1) {
            const u64 mid = lo + (hi - lo) / 2;
            if ((u64)first[mid] <= k) lo = mid; else hi = mid;
        }
        const i64 j = (i64)k - first[lo];
        stage[k] = (u64)(run_stage[lo] + j * run_pb[lo]);
        ids[k] = (u32)(run_id[lo] + j);
        crcs[k] = crc_table[run_crc[lo] + j];
    }
}
