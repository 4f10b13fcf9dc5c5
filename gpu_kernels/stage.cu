// Staging: one page-batch record of the listed dirty pages, written straight
// into a granted extent (device memory, a host mapping registered with CUDA, or
// a pinned staging ring), laid out exactly as docs/internals.md "WAL record
// layout" says and as reference.stage_page_batch writes it.
//
// Three launches on one stream, no host round trip between them:
//   stage_alloc     one thread claims `length` bytes at the extent's cursor
//                   (compare-and-swap; a record that does not fit is counted in
//                   cursor[2] and nothing is written) and leaves the offset in
//                   slot[0];
//   stage_payload   index table, zero pad, and one warp per page: coalesced
//                   16-byte copy into the payload, then the page's CRC32C into
//                   the CRC table (and into `crcs` on the device);
//   stage_finalize  one block: body CRC over index + CRC tables, the header
//                   with its CRC, stored last.
// cursor: u64[4] = used bytes, records written, records refused, reserved.
//
// -D PAGE_BYTES (multiple of 64).
#include "common.cuh"

#define HEADER_BYTES 64
#define TYPE_PAGE_BATCH 0x01u

__device__ __forceinline__ u64 payload_off(u64 count) { return HEADER_BYTES + ((8 * count + 63) & ~63ull); }

extern "C" __global__ void stage_alloc(u64* cursor, u64 capacity, u64 length, u64* slot) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u64 old = *(volatile u64*)cursor;
    for (;;) {
        if (old + length > capacity) {
            atomicAdd(&cursor[2], 1ull);
            slot[0] = NO_SLOT;
            return;
        }
        const u64 seen = atomicCAS(&cursor[0], old, old + length);
        if (seen == old) break;
        old = seen;
    }
    atomicAdd(&cursor[1], 1ull);
    slot[0] = old;
}

extern "C" __global__ void __launch_bounds__(256)
stage_payload(const u8* __restrict__ region, const u32* __restrict__ ids, u64 count,
              u64 region_bytes, u8* __restrict__ dst, const u64* __restrict__ slot,
              u32* __restrict__ crcs) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    const u64 off = slot[0];
    if (off == NO_SLOT) return;
    crc_tables_build(T);
    u8* rec = dst + off;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 threads = (u64)gridDim.x * blockDim.x;
    u32* index = reinterpret_cast<u32*>(rec + HEADER_BYTES);
    for (u64 i = tid; i < count; i += threads) index[i] = ids[i];
    const u64 pad_lo = (HEADER_BYTES + 8 * count) / 4, pad_hi = payload_off(count) / 4;
    if (tid < pad_hi - pad_lo) reinterpret_cast<u32*>(rec)[pad_lo + tid] = 0;

    const int lane = threadIdx.x & 31;
    const PageCrc k = page_crc_setup(lane);
    u8* payload = rec + payload_off(count);
    u32* crc_table = index + count;
    const u64 warps = threads >> 5;
    for (u64 i = tid >> 5; i < count; i += warps) {
        const u64 base = (u64)ids[i] * PAGE_BYTES;
        const u8* src = region + base;
        uint4* out = reinterpret_cast<uint4*>(payload + i * PAGE_BYTES);
        const u32 valid = base + PAGE_BYTES <= region_bytes ? PAGE_BYTES : (u32)(region_bytes - base);
        if (valid == PAGE_BYTES) {
#pragma unroll 4
            for (u32 c = lane; c < PAGE_CHUNKS; c += WARP) out[c] = __ldcs(reinterpret_cast<const uint4*>(src) + c);
        } else {
            for (u32 c = lane; c < PAGE_CHUNKS; c += WARP) out[c] = load16(src, c * 16, valid);
        }
        const u32 crc = warp_page_crc(T, src, valid, lane, k);
        if (lane == 0) {
            crc_table[i] = crc;
            crcs[i] = crc;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
stage_finalize(const u32* __restrict__ ids, const u32* __restrict__ crcs, u64 count,
               u8* __restrict__ dst, const u64* __restrict__ slot, u64 length, u64 lsn_base,
               u64 epoch, u32 region_id, u32 salt, u32 flags) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    __shared__ u32 red[32];
    const u64 off = slot[0];
    if (off == NO_SLOT) return;
    crc_tables_build(T);
    const u32 raw_ids = block_raw_crc_words(T, ids, count, red);
    const u32 raw_crcs = block_raw_crc_words(T, crcs, count, red);
    if (threadIdx.x != 0) return;
    // body = index table || CRC table: shift the first over the second's bytes
    const u32 raw = gf2_multmodp(xpow8n(4 * count), raw_ids) ^ raw_crcs;
    const u32 body_crc = ~(raw ^ gf2_multmodp(xpow8n(8 * count), 0xFFFFFFFFu));
    const u64 lsn = lsn_base + off;
    u32 h[16];
    h[0] = (u32)length;          h[1] = (u32)(length >> 32);
    h[2] = TYPE_PAGE_BATCH | ((flags & 0xFFu) << 8);   // type, flags, reserved u16
    h[3] = region_id;
    h[4] = (u32)lsn;             h[5] = (u32)(lsn >> 32);
    h[6] = (u32)epoch;           h[7] = (u32)(epoch >> 32);
    h[8] = salt;                 h[9] = body_crc;
    h[10] = (u32)count;          h[11] = PAGE_BYTES;
    h[12] = 0;                   h[13] = 0;            // aux
    h[14] = 0;                                         // reserved
    u32 hc = 0xFFFFFFFFu;
    for (int w = 0; w < 15; ++w) hc = crc_word(T, hc, h[w]);
    h[15] = ~hc;
    uint4* out = reinterpret_cast<uint4*>(dst + off);
    // the length word goes last: a reader that sees it sees a whole header
    out[3] = make_uint4(h[12], h[13], h[14], h[15]);
    out[2] = make_uint4(h[8], h[9], h[10], h[11]);
    out[1] = make_uint4(h[4], h[5], h[6], h[7]);
    __threadfence_system();
    out[0] = make_uint4(h[0], h[1], h[2], h[3]);
}
