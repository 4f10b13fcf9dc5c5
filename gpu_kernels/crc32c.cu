// CRC32C (Castagnoli) on the device.
//
// crc32c_pages: one warp per listed page; each lane runs slicing-by-8 over its
// contiguous slice and the lanes' registers are recombined with GF(2) shift
// operators (common.cuh), so the result equals the `crc32c` package's value
// of the zero-padded page.  ids == NULL means pages 0..count-1.
// crc32c_words: one block over a u32 array (the region digest: CRC32C of the
// little-endian array of page CRCs).  Twins: reference.crc32c_pages,
// reference.region_digest.
//
// -D PAGE_BYTES (multiple of 64) for crc32c_pages; crc32c_words needs none.
#include "common.cuh"

#ifdef PAGE_BYTES
extern "C" __global__ void __launch_bounds__(256)
crc32c_pages(const u8* __restrict__ region, const u32* __restrict__ ids, u64 count,
             u64 region_bytes, u32* __restrict__ out) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    crc_tables_build(T);
    const int lane = threadIdx.x & 31;
    const PageCrc k = page_crc_setup(lane);
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < count; i += warps) {
        const u64 p = ids ? (u64)ids[i] : i;
        const u64 base = p * PAGE_BYTES;
        const u32 valid = base + PAGE_BYTES <= region_bytes ? PAGE_BYTES : (u32)(region_bytes - base);
        const u32 crc = warp_page_crc(T, region + base, valid, lane, k);
        if (lane == 0) out[i] = crc;
    }
}
#endif  // PAGE_BYTES

extern "C" __global__ void __launch_bounds__(1024)
crc32c_words(const u32* __restrict__ data, u64 n_words, u32* __restrict__ out) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    __shared__ u32 red[32];
    crc_tables_build(T);
    const u32 raw = block_raw_crc_words(T, data, n_words, red);
    if (threadIdx.x == 0) out[0] = ~(raw ^ gf2_multmodp(xpow8n(4 * n_words), 0xFFFFFFFFu));
}
