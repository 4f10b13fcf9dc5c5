// Shadow diff: which pages of a region differ from its device shadow.
//
// One warp per page (grid-stride), 16-byte streaming loads, UNROLL chunks of
// both buffers in flight per lane before the first compare.  Where a chunk
// differs and `update` is set, the region's chunk is stored into the shadow
// from registers, so a dirty page's shadow ends equal to the region without a
// second read.  flags[p] gets 1 for a dirty page, 0 otherwise (every page is
// written).  With `list_count` given, each dirty page's id is also appended
// to `list` (first `list_cap` of them, in no order) and counted in
// *list_count, so a checkpoint of a few dirty pages needs no pass over the
// flags (stage.cu: stage_delta).  Twin: reference.shadow_diff.
//
// -D PAGE_BYTES (multiple of 64).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
shadow_diff(const u8* __restrict__ region, u8* __restrict__ shadow, u8* __restrict__ flags,
            u64 num_pages, u64 region_bytes, int update, u32* __restrict__ list,
            u32* __restrict__ list_count, u32 list_cap) {
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < num_pages; p += warps) {
        const unsigned diff = page_shadow_diff(region, shadow, region_bytes, p, lane, update);
        if (lane == 0) {
            flags[p] = (u8)diff;
            if (diff && list_count) note_dirty(list, list_count, list_cap, p);
        }
    }
}
