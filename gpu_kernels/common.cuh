// Shared device code of Concordia's page kernels: byte types, bounded 16-byte
// loads over a region whose last page may be short, and CRC32C (Castagnoli,
// reflected) by slicing-by-8 tables in shared memory, split across the lanes
// of a warp and recombined with GF(2) shift operators.
//
// Compiled by NVRTC (gpu_kernels/jit.py, which inlines this file) and by
// `nvcc --ptx` in CI; no standard headers, so both see the same code.
//
// Specialisation (-D): PAGE_BYTES, a positive multiple of 64.
#pragma once

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define CRC_POLY 0x82F63B78u
#define NO_SLOT 0xFFFFFFFFFFFFFFFFull
#define WARP 32
#define FULL_MASK 0xFFFFFFFFu

// ---- CRC32C tables --------------------------------------------------------
// T[k][i]: register after byte i followed by k zero bytes.  8 KiB of shared
// memory; built by the whole block before any warp uses it.
#define CRC_TABLE_WORDS (8 * 256)

__device__ __forceinline__ void crc_tables_build(u32* T) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = (u32)i;
        for (int b = 0; b < 8; ++b) c = (c & 1u) ? (c >> 1) ^ CRC_POLY : (c >> 1);
        T[i] = c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = T[i];
        for (int k = 1; k < 8; ++k) {
            c = (c >> 8) ^ T[c & 0xFFu];
            T[k * 256 + i] = c;
        }
    }
    __syncthreads();
}

// Feed 4 bytes (little-endian word w) into the raw register.
__device__ __forceinline__ u32 crc_word(const u32* T, u32 crc, u32 w) {
    w ^= crc;
    return T[3 * 256 + (w & 0xFFu)] ^ T[2 * 256 + ((w >> 8) & 0xFFu)] ^
           T[1 * 256 + ((w >> 16) & 0xFFu)] ^ T[(w >> 24)];
}

// Feed 8 bytes (words lo, hi in memory order).
__device__ __forceinline__ u32 crc_dword(const u32* T, u32 crc, u32 lo, u32 hi) {
    lo ^= crc;
    return T[7 * 256 + (lo & 0xFFu)] ^ T[6 * 256 + ((lo >> 8) & 0xFFu)] ^
           T[5 * 256 + ((lo >> 16) & 0xFFu)] ^ T[4 * 256 + (lo >> 24)] ^
           T[3 * 256 + (hi & 0xFFu)] ^ T[2 * 256 + ((hi >> 8) & 0xFFu)] ^
           T[1 * 256 + ((hi >> 16) & 0xFFu)] ^ T[(hi >> 24)];
}

__device__ __forceinline__ u32 crc_chunk(const u32* T, u32 crc, uint4 v) {
    crc = crc_dword(T, crc, v.x, v.y);
    return crc_dword(T, crc, v.z, v.w);
}

// a * b modulo the polynomial, reflected bit order.
__device__ __forceinline__ u32 gf2_multmodp(u32 a, u32 b) {
    u32 m = 1u << 31, p = 0;
    while (a) {
        if (a & m) {
            p ^= b;
            a &= ~m;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ CRC_POLY : (b >> 1);
    }
    return p;
}

// X8_POW2[i] = x^(8 * 2^i) mod p, reflected (reference.X8_POW2, checked against it in CI).
__constant__ u32 X8_POW2[64] = {
    0x00800000u, 0x00008000u, 0x82F63B78u, 0x6EA2D55Cu, 0x18B8EA18u, 0x510AC59Au, 0xB82BE955u, 0xB8FDB1E7u,
    0x88E56F72u, 0x74C360A4u, 0xE4172B16u, 0x0D65762Au, 0x35D73A62u, 0x28461564u, 0xBF455269u, 0xE2EA32DCu,
    0xFE7740E6u, 0xF946610Bu, 0x3C204F8Fu, 0x538586E3u, 0x59726915u, 0x734D5309u, 0xBC1AC763u, 0x7D0722CCu,
    0xD289CABEu, 0xE94CA9BCu, 0x05B74F3Fu, 0xA51E1F42u, 0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u,
    0x00008000u, 0x82F63B78u, 0x6EA2D55Cu, 0x18B8EA18u, 0x510AC59Au, 0xB82BE955u, 0xB8FDB1E7u, 0x88E56F72u,
    0x74C360A4u, 0xE4172B16u, 0x0D65762Au, 0x35D73A62u, 0x28461564u, 0xBF455269u, 0xE2EA32DCu, 0xFE7740E6u,
    0xF946610Bu, 0x3C204F8Fu, 0x538586E3u, 0x59726915u, 0x734D5309u, 0xBC1AC763u, 0x7D0722CCu, 0xD289CABEu,
    0xE94CA9BCu, 0x05B74F3Fu, 0xA51E1F42u, 0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u,
};

// x^(8n) mod p: multiplying a raw register by it feeds n zero bytes.  One
// multiply per set bit of n, its power from X8_POW2: squaring up to each
// power cost a staging warp's lane 0 about 16 more per page (a region of
// ten thousand pages), the other lanes waiting.
__device__ __forceinline__ u32 xpow8n(u64 n) {
    u32 result = 1u << 31;
    for (int i = 0; n; ++i, n >>= 1)
        if (n & 1) result = gf2_multmodp(result, X8_POW2[i]);
    return result;
}

// ---- bounded loads --------------------------------------------------------
// 16 bytes at p + off of a page with `valid` real bytes; bytes past `valid`
// read as zero (the zero-padded last page).  p + off is 16-byte aligned.
__device__ __forceinline__ uint4 load16(const u8* p, u32 off, u32 valid) {
    if (off + 16 <= valid) return __ldcs(reinterpret_cast<const uint4*>(p + off));
    u32 w[4] = {0, 0, 0, 0};
#pragma unroll
    for (u32 b = 0; b < 16; ++b)
        if (off + b < valid) w[b >> 2] |= (u32)p[off + b] << (8 * (b & 3));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Store the first `n` (< 16) bytes of v.
__device__ __forceinline__ void store_partial(u8* p, uint4 v, u32 n) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (u32 b = 0; b < 16; ++b)
        if (b < n) p[b] = (u8)(w[b >> 2] >> (8 * (b & 3)));
}

__device__ __forceinline__ bool differs(uint4 a, uint4 b) {
    return ((a.x ^ b.x) | (a.y ^ b.y) | (a.z ^ b.z) | (a.w ^ b.w)) != 0;
}

// Append dirty page p to a detector's page list: the first `cap` pages found
// are kept (in no order), *count counts them all.
__device__ __forceinline__ void note_dirty(u32* list, u32* count, u32 cap, u64 p) {
    const u32 i = atomicAdd(count, 1u);
    if (i < cap) list[i] = (u32)p;
}

__device__ __forceinline__ u32 warp_xor(u32 v) {
    for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ u64 warp_sum64(u64 v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ---- page-batch records (FORMAT.md §6; wal/format.py, reference.stage_page_batch) ----
// header (64 bytes) | index table u32[count] | CRC table u32[count] | zero pad
// to a 64-byte boundary | payload: count pages of page_bytes.
#define RECORD_HEADER_BYTES 64
#define TYPE_PAGE_BATCH 0x01u
#define TYPE_COMMIT 0x03u
#define NO_REGION 0xFFFFFFFFu

__device__ __forceinline__ u64 page_batch_payload_off(u64 count) {
    return RECORD_HEADER_BYTES + ((8 * count + 63) & ~63ull);
}

__device__ __forceinline__ u64 page_batch_length(u64 count, u64 page_bytes) {
    return page_batch_payload_off(count) + count * page_bytes;
}

// CRC32C of `nbytes` bytes from the raw register of those bytes fed from a zero start.
__device__ __forceinline__ u32 crc_of_raw(u32 raw, u64 nbytes) {
    return ~(raw ^ gf2_multmodp(xpow8n(nbytes), 0xFFFFFFFFu));
}

// The body CRC32C (over the index and CRC tables, 8 * count bytes) from the
// raw register of those bytes fed from a zero start.
__device__ __forceinline__ u32 page_batch_body_crc(u32 raw, u64 count) {
    return crc_of_raw(raw, 8 * count);
}

// The one record header writer (one thread; FORMAT.md §5.1): its CRC over the
// first 60 bytes; the length word stored last, after a system-scope fence, so
// a reader that sees it sees a whole header (and, as the caller wrote the
// body before calling, a whole record).

__device__ __forceinline__ void write_record_header(const u32* T, u8* rec, u64 length, u32 type, u32 flags,
                                                    u64 lsn, u64 epoch, u32 region_id, u32 salt, u32 body_crc,
                                                    u64 count, u32 page_bytes, u64 aux) {
    u32 h[16];
    h[0] = (u32)length;          h[1] = (u32)(length >> 32);
    h[2] = (type & 0xFFu) | ((flags & 0xFFu) << 8);     // type, flags, reserved u16
    h[3] = region_id;
    h[4] = (u32)lsn;             h[5] = (u32)(lsn >> 32);
    h[6] = (u32)epoch;           h[7] = (u32)(epoch >> 32);
    h[8] = salt;                 h[9] = body_crc;
    h[10] = (u32)count;          h[11] = page_bytes;
    h[12] = (u32)aux;            h[13] = (u32)(aux >> 32);
    h[14] = 0;                                         // reserved
    u32 hc = 0xFFFFFFFFu;
    for (int w = 0; w < 15; ++w) hc = crc_word(T, hc, h[w]);
    h[15] = ~hc;
    uint4* out = reinterpret_cast<uint4*>(rec);
    out[3] = make_uint4(h[12], h[13], h[14], h[15]);
    out[2] = make_uint4(h[8], h[9], h[10], h[11]);
    out[1] = make_uint4(h[4], h[5], h[6], h[7]);
    __threadfence_system();
    out[0] = make_uint4(h[0], h[1], h[2], h[3]);
}

// A page batch's header (aux 0).
__device__ __forceinline__ void write_page_batch_header(const u32* T, u8* rec, u64 length, u64 lsn, u64 epoch,
                                                        u32 region_id, u32 salt, u32 flags, u64 count,
                                                        u32 page_bytes, u32 body_crc) {
    write_record_header(T, rec, length, TYPE_PAGE_BATCH, flags, lsn, epoch, region_id, salt, body_crc, count,
                        page_bytes, 0);
}

#ifdef PAGE_BYTES
#if (PAGE_BYTES % 64) != 0 || PAGE_BYTES <= 0
#error "PAGE_BYTES must be a positive multiple of 64"
#endif
#define PAGE_CHUNKS (PAGE_BYTES / 16)                       // 16-byte chunks per page
#define LANE_CHUNKS ((PAGE_CHUNKS + WARP - 1) / WARP)       // chunks per lane, lane-strided
#define CRC_STEP (16 * ((PAGE_CHUNKS + WARP - 1) / WARP))   // bytes of a lane's CRC slice

// Per-lane constants of the split page CRC: the shift over the bytes after the
// lane's slice, and the term that turns the XOR of raw registers into CRC32C
// (initial value's shift over the page, final inversion).
struct PageCrc {
    u32 lane_shift;
    u32 finish;
};

__device__ __forceinline__ PageCrc page_crc_setup(int lane) {
    u32 hi = (u32)(lane + 1) * CRC_STEP;
    if (hi > PAGE_BYTES) hi = PAGE_BYTES;
    PageCrc c;
    c.lane_shift = xpow8n(PAGE_BYTES - hi);
    c.finish = gf2_multmodp(xpow8n(PAGE_BYTES), 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
    return c;
}

// CRC32C of one page (valid real bytes, zero-padded to PAGE_BYTES), computed by
// the whole warp; every lane returns the result.
__device__ __forceinline__ u32 warp_page_crc(const u32* T, const u8* page, u32 valid, int lane,
                                             PageCrc k) {
    u32 lo = (u32)lane * CRC_STEP, hi = lo + CRC_STEP;
    if (lo > PAGE_BYTES) lo = PAGE_BYTES;
    if (hi > PAGE_BYTES) hi = PAGE_BYTES;
    u32 raw = 0;
    for (u32 off = lo; off < hi; off += 16) raw = crc_chunk(T, raw, load16(page, off, valid));
    raw = gf2_multmodp(k.lane_shift, raw);
    return warp_xor(raw) ^ k.finish;
}

#endif  // PAGE_BYTES

// ---- per-page detectors (one warp per page; every lane returns the result) ----
// Templates on the page size PB (a positive multiple of 64), so that one module
// may hold the detectors of several page sizes (executor.cu's EPOCH handler:
// PAGE_BYTES and CX_PAGE_BYTES_1..3); page_fingerprint and page_shadow_diff are
// those of PAGE_BYTES.
#ifndef UNROLL
#define UNROLL 8
#endif

// Page fingerprint (fingerprint.cu; twin reference.fingerprint_pages): for the
// page's little-endian u64 words w_j (zero-padded last page),
// x_j = (w_j ^ j*K1) * K2, x_j ^= x_j >> 29, fp = fmix64((sum_j x_j) ^ page bytes).
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

template <u32 PB>
__device__ __forceinline__ u64 page_fingerprint_pb(const u8* region, u64 region_bytes, u64 p, int lane) {
    static_assert(PB > 0 && PB % 64 == 0, "a page size must be a positive multiple of 64");
    constexpr int chunks = (int)(PB / 16), lane_chunks = (chunks + WARP - 1) / WARP;
    const u64 base = p * PB;
    const u8* r = region + base;
    u64 sum = 0;
    if (base + PB <= region_bytes) {
#pragma unroll 1
        for (int k0 = 0; k0 < lane_chunks; k0 += UNROLL) {
            uint4 a[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = lane + WARP * (k0 + u);
                if (k0 + u < lane_chunks && c < chunks)
                    a[u] = __ldcs(reinterpret_cast<const uint4*>(r) + c);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = lane + WARP * (k0 + u);
                if (k0 + u < lane_chunks && c < chunks) sum += fp_chunk(a[u], (u32)c);
            }
        }
    } else {
        const u32 valid = (u32)(region_bytes - base);
        for (u32 c = lane; c < (u32)chunks; c += WARP) sum += fp_chunk(load16(r, c * 16, valid), c);
    }
    return fmix64(warp_sum64(sum) ^ (u64)PB);
}

// Whether page p of `region` differs from `shadow` (shadow_diff.cu; twin
// reference.shadow_diff); with `update` the differing 16-byte chunks are
// stored into the shadow from registers.
template <u32 PB>
__device__ __forceinline__ unsigned page_shadow_diff_pb(const u8* region, u8* shadow, u64 region_bytes, u64 p,
                                                        int lane, int update) {
    static_assert(PB > 0 && PB % 64 == 0, "a page size must be a positive multiple of 64");
    constexpr int chunks = (int)(PB / 16), lane_chunks = (chunks + WARP - 1) / WARP;
    const u64 base = p * PB;
    const u8* r = region + base;
    u8* s = shadow + base;
    unsigned diff = 0;
    if (base + PB <= region_bytes) {
#pragma unroll 1
        for (int k0 = 0; k0 < lane_chunks; k0 += UNROLL) {
            uint4 a[UNROLL], b[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = lane + WARP * (k0 + u);
                if (k0 + u < lane_chunks && c < chunks) {
                    a[u] = __ldcs(reinterpret_cast<const uint4*>(r) + c);
                    b[u] = __ldcs(reinterpret_cast<const uint4*>(s) + c);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = lane + WARP * (k0 + u);
                if (k0 + u < lane_chunks && c < chunks && differs(a[u], b[u])) {
                    diff = 1;
                    if (update) reinterpret_cast<uint4*>(s)[c] = a[u];
                }
            }
        }
    } else {
        // the region's short last page: compare only its real bytes
        const u32 valid = (u32)(region_bytes - base);
        for (u32 c = lane; c * 16 < valid; c += WARP) {
            const uint4 a = load16(r, c * 16, valid), b = load16(s, c * 16, valid);
            if (differs(a, b)) {
                diff = 1;
                if (!update) continue;
                if (c * 16 + 16 <= valid) reinterpret_cast<uint4*>(s)[c] = a;
                else store_partial(s + c * 16, a, valid - c * 16);
            }
        }
    }
    return __any_sync(FULL_MASK, diff);
}

#ifdef PAGE_BYTES
__device__ __forceinline__ u64 page_fingerprint(const u8* region, u64 region_bytes, u64 p, int lane) {
    return page_fingerprint_pb<PAGE_BYTES>(region, region_bytes, p, lane);
}

__device__ __forceinline__ unsigned page_shadow_diff(const u8* region, u8* shadow, u64 region_bytes, u64 p,
                                                     int lane, int update) {
    return page_shadow_diff_pb<PAGE_BYTES>(region, shadow, region_bytes, p, lane, update);
}
#endif  // PAGE_BYTES

// Raw CRC register of n_words little-endian u32 words, computed by the whole
// block (slices per thread, recombined); `red` is blockDim.x/32 words of shared
// memory.  Every thread returns the result.
__device__ __forceinline__ u32 block_raw_crc_words(const u32* T, const u32* data, u64 n_words,
                                                   u32* red) {
    u64 per = (n_words + blockDim.x - 1) / blockDim.x;
    u64 lo = per * threadIdx.x, hi = lo + per;
    if (lo > n_words) lo = n_words;
    if (hi > n_words) hi = n_words;
    u32 raw = 0;
    for (u64 i = lo; i < hi; ++i) raw = crc_word(T, raw, data[i]);
    raw = gf2_multmodp(xpow8n(4 * (n_words - hi)), raw);
    raw = warp_xor(raw);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = raw;
    __syncthreads();
    u32 all = 0;
    for (u32 w = 0; w < (blockDim.x + 31) / 32; ++w) all ^= red[w];
    return all;
}
