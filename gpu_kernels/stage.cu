// Staging: one page-batch record of the listed dirty pages, written straight
// into a granted extent (device memory, a host mapping registered with CUDA, or
// a pinned staging ring), laid out exactly as docs/internals.md "WAL record
// layout" says and as reference.stage_page_batch writes it.
//
// Three launches on one stream, no host round trip between them (and
// stage_delta, below: one launch for a few pages listed by a detector):
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

// One page by one warp: coalesced 16-byte copy into `out`, CRC32C returned to
// every lane.
__device__ __forceinline__ u32 copy_page(const u32* T, const u8* region, u64 region_bytes, u64 page,
                                         uint4* out, int lane, PageCrc k) {
    const u64 base = page * PAGE_BYTES;
    const u8* src = region + base;
    const u32 valid = base + PAGE_BYTES <= region_bytes ? PAGE_BYTES : (u32)(region_bytes - base);
    if (valid == PAGE_BYTES) {
#pragma unroll 4
        for (u32 c = lane; c < PAGE_CHUNKS; c += WARP) out[c] = __ldcs(reinterpret_cast<const uint4*>(src) + c);
    } else {
        for (u32 c = lane; c < PAGE_CHUNKS; c += WARP) out[c] = load16(src, c * 16, valid);
    }
    return warp_page_crc(T, src, valid, lane, k);
}

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
    u32* index = reinterpret_cast<u32*>(rec + RECORD_HEADER_BYTES);
    for (u64 i = tid; i < count; i += threads) index[i] = ids[i];
    const u64 pad_lo = (RECORD_HEADER_BYTES + 8 * count) / 4, pad_hi = page_batch_payload_off(count) / 4;
    if (tid < pad_hi - pad_lo) reinterpret_cast<u32*>(rec)[pad_lo + tid] = 0;

    const int lane = threadIdx.x & 31;
    const PageCrc k = page_crc_setup(lane);
    u8* payload = rec + page_batch_payload_off(count);
    u32* crc_table = index + count;
    const u64 warps = threads >> 5;
    for (u64 i = tid >> 5; i < count; i += warps) {
        const u32 crc = copy_page(T, region, region_bytes, ids[i],
                                  reinterpret_cast<uint4*>(payload + i * PAGE_BYTES), lane, k);
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
    write_page_batch_header(T, dst + off, length, lsn_base + off, epoch, region_id, salt, flags, count, PAGE_BYTES,
                            page_batch_body_crc(raw, count));
}

// One launch for a checkpoint of a few dirty pages, after a detector that
// listed them (list, *list_count: shadow_diff.cu / fingerprint.cu):
//   the listed ids sorted in shared memory; when there are 1..cap_pages of
//   them and their record fits dst_bytes, one warp per page copies it into
//   the record at dst (offset 0 of an extent the host reserved before the
//   detector ran) with its CRC32C, then the tables, the body CRC and the
//   header, stored last; the region's page CRC table takes the new CRCs and
//   the region digest (CRC32C of that table) moves by the XOR of each changed
//   word's contribution: CRC32C is affine, so word i changing by d changes the
//   digest by the raw CRC of d shifted over the 4 * (num_pages - 1 - i) bytes
//   after it.
// Whatever the outcome: mail[0] = pages found, mail[1] = bytes written (0 if
// none or refused), mail[2] = records written (0 or 1), mail[3] = the digest
// after this checkpoint, then, after a system fence, mail[4] = epoch (the
// host may poll it); *list_count is reset for the next checkpoint.  mail is
// host memory the device can address (pinned).  A refused list (more pages
// than cap_pages) leaves the region's table untouched: the host compacts the
// detector's flags and stages the pages with stage_alloc/payload/finalize.
// Twin: reference.stage_delta.  One block of DELTA_THREADS threads.
#define DELTA_THREADS 1024
#define DELTA_MAX_PAGES (DELTA_THREADS / WARP)

extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
stage_delta(const u8* __restrict__ region, u64 region_bytes, u64 num_pages, const u32* __restrict__ list,
            u32* __restrict__ list_count, u32 cap_pages, u8* __restrict__ dst, u64 dst_bytes, u64 lsn,
            u64 epoch, u32 region_id, u32 salt, u32 flags, u32* __restrict__ table, u32 digest,
            volatile u64* mail) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    __shared__ u32 ids[DELTA_MAX_PAGES];
    __shared__ u32 crcs[DELTA_MAX_PAGES];
    __shared__ u32 moved;
    const u32 t = threadIdx.x, lane = t & 31, w = t >> 5;
    const u32 count = *(volatile u32*)list_count;
    const u32 cap = cap_pages < DELTA_MAX_PAGES ? cap_pages : DELTA_MAX_PAGES;
    const u64 length = page_batch_length(count, PAGE_BYTES);
    const bool fits = count > 0 && count <= cap && length <= dst_bytes;
    if (fits) {
        if (t == 0) moved = 0;
        if (t < count) {  // rank sort: the ids are distinct
            const u32 mine = list[t];
            u32 rank = 0;
            for (u32 j = 0; j < count; ++j) rank += list[j] < mine;
            ids[rank] = mine;
        }
        crc_tables_build(T);  // synchronises the block
        u32* index = reinterpret_cast<u32*>(dst + RECORD_HEADER_BYTES);
        if (w < count) {
            const u32 crc = copy_page(T, region, region_bytes, ids[w],
                                      reinterpret_cast<uint4*>(dst + page_batch_payload_off(count) + (u64)w * PAGE_BYTES),
                                      (int)lane, page_crc_setup((int)lane));
            if (lane == 0) crcs[w] = crc;
        }
        const u32 pad_lo = (RECORD_HEADER_BYTES + 8 * count) / 4, pad_hi = (u32)(page_batch_payload_off(count) / 4);
        if (t < pad_hi - pad_lo) reinterpret_cast<u32*>(dst)[pad_lo + t] = 0;
        __syncthreads();
        if (t < count) {
            const u32 p = ids[t];
            index[t] = p;
            index[count + t] = crcs[t];
            const u32 delta = table[p] ^ crcs[t];
            table[p] = crcs[t];
            if (delta)
                atomicXor(&moved, gf2_multmodp(xpow8n(4 * (num_pages - 1 - p)), crc_word(T, 0, delta)));
        }
        __syncthreads();
        if (t == 0) {
            u32 raw = 0;
            for (u32 i = 0; i < count; ++i) raw = crc_word(T, raw, ids[i]);  // the tables, from shared
            for (u32 i = 0; i < count; ++i) raw = crc_word(T, raw, crcs[i]);
            write_page_batch_header(T, dst, length, lsn, epoch, region_id, salt, flags, count, PAGE_BYTES,
                                    page_batch_body_crc(raw, count));
            digest ^= moved;
        }
    }
    if (t == 0) {
        mail[0] = count;
        mail[1] = fits ? length : 0;
        mail[2] = fits ? 1 : 0;
        mail[3] = digest;
        *list_count = 0;
        __threadfence_system();
        mail[4] = epoch;
    }
}
