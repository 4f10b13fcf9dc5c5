/* CRC32C (Castagnoli) of many pages in one call, optionally copying each page
 * as it is hashed.  Built by wal/pagecrc.py with the system C compiler on first
 * use and called through ctypes (which releases the GIL around every call).
 *
 * The CPU's `crc32` instruction (SSE4.2) takes 8 bytes per step with a latency
 * of about 3 cycles and a throughput of one per cycle, so one chain of steps
 * runs at a third of the possible speed.  Pages are independent: three pages
 * are hashed at once, one chain each, which keeps the unit busy every cycle.
 * The last one or two pages of a call run as two chains or one.
 *
 * CRC convention (FORMAT.md §1): init 0xFFFFFFFF, reflected, final xor
 * 0xFFFFFFFF; the value of an empty page is 0.  Loads and stores go through
 * memcpy, so pages may start at any address and be of any length.
 *
 * Where the CPU has VPCLMULQDQ on 512-bit registers (AVX-512), pages of 256
 * bytes or more are hashed by folding instead (see fold_page below): four
 * carry-less multiplies per 64 bytes, three to four times the speed of the
 * `crc32` chains, with the last 256 bytes of folded state and the page's tail
 * finished on the `crc32` instruction.
 *
 * Only the hashing functions are compiled for SSE4.2 or AVX-512 (target
 * attributes); concordia_pagecrc_supported() and concordia_pagecrc_vector()
 * are plain code that asks the CPU, and the caller uses nothing else unless the
 * first returns 1.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <nmmintrin.h>
#define HASH __attribute__((target("sse4.2")))
#define INLINE_HASH static inline __attribute__((always_inline, target("sse4.2")))
#define VEC __attribute__((target("sse4.2,avx512f,avx512vl,vpclmulqdq")))
#else
#error "the page CRC helper needs an x86 CPU with SSE4.2"
#endif

int concordia_pagecrc_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

/* 1 while pages of 256 bytes or more are hashed by folding (set by
 * concordia_pagecrc_vector) */
static int use_fold = 0;

/* Ask for (enable = 1) or refuse (0) the folding path; returns whether it is in
 * use now (never where the CPU lacks AVX-512 VPCLMULQDQ). */
int concordia_pagecrc_vector(int enable)
{
    __builtin_cpu_init();
    use_fold = enable && __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx512f")
               && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
    return use_fold;
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline void store64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}

/* The CRC of k (1..3) pages of n bytes each, src[j] -> out[j]; when copy is
 * set, page j is also written to dst[j] (the bytes hashed are the bytes
 * written).  k and copy are constants at every call site, so each use is
 * compiled to its own straight loop. */
INLINE_HASH void lanes(int k, int copy, const uint8_t *const *src, uint8_t *const *dst, size_t n,
                       uint32_t *out)
{
    uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
    const uint8_t *s0 = src[0], *s1 = k > 1 ? src[1] : src[0], *s2 = k > 2 ? src[2] : src[0];
    uint8_t *d0 = copy ? dst[0] : NULL, *d1 = copy && k > 1 ? dst[1] : NULL, *d2 = copy && k > 2 ? dst[2] : NULL;
    size_t words = n & ~(size_t)7, i = 0;
    for (; i < words; i += 8) {
        uint64_t v0 = load64(s0 + i);
        uint64_t v1 = k > 1 ? load64(s1 + i) : 0;
        uint64_t v2 = k > 2 ? load64(s2 + i) : 0;
        c0 = _mm_crc32_u64(c0, v0);
        if (k > 1)
            c1 = _mm_crc32_u64(c1, v1);
        if (k > 2)
            c2 = _mm_crc32_u64(c2, v2);
        if (copy) {
            store64(d0 + i, v0);
            if (k > 1)
                store64(d1 + i, v1);
            if (k > 2)
                store64(d2 + i, v2);
        }
    }
    uint32_t t0 = (uint32_t)c0, t1 = (uint32_t)c1, t2 = (uint32_t)c2;
    for (; i < n; i++) {  /* the last n % 8 bytes */
        t0 = _mm_crc32_u8(t0, s0[i]);
        if (copy)
            d0[i] = s0[i];
        if (k > 1) {
            t1 = _mm_crc32_u8(t1, s1[i]);
            if (copy)
                d1[i] = s1[i];
        }
        if (k > 2) {
            t2 = _mm_crc32_u8(t2, s2[i]);
            if (copy)
                d2[i] = s2[i];
        }
    }
    out[0] = ~t0;
    if (k > 1)
        out[1] = ~t1;
    if (k > 2)
        out[2] = ~t2;
}

HASH static void group(int k, int copy, const uint8_t *const *src, uint8_t *const *dst, size_t n, uint32_t *out)
{
    if (copy) {
        if (k == 3)
            lanes(3, 1, src, dst, n, out);
        else if (k == 2)
            lanes(2, 1, src, dst, n, out);
        else
            lanes(1, 1, src, dst, n, out);
    } else {
        if (k == 3)
            lanes(3, 0, src, dst, n, out);
        else if (k == 2)
            lanes(2, 0, src, dst, n, out);
        else
            lanes(1, 0, src, dst, n, out);
    }
}

/* Folding (the method of Intel's "Fast CRC Computation Using PCLMULQDQ").
 *
 * In the reflected bit order a 16-byte block loaded little-endian has bit i as
 * the coefficient of x^(127 - i); the carry-less product of two 64-bit values
 * read the same way is the product of their polynomials times x.  A block
 * A = LO x^64 + HI moved D bits later in the message becomes A x^D, which is
 * congruent mod P to LO K1 + HI K2 with K1 = x^(64 + D - 1) mod P and
 * K2 = x^(D - 1) mod P (the -1 undoes the product's extra x); being congruent
 * mod P is all the CRC needs, since the CRC of a block (no initial value, no
 * final xor) is its polynomial times x^32 mod P.  Four registers hold 256 bytes,
 * so each 128-bit lane is folded onto the lane 256 bytes (D = 2048 bits) later.
 * Each constant is written as that register wants it: the coefficient of x^e of
 * the remainder at bit 63 - e.  (tests/wal/test_pagecrc.py derives them again.) */
#define FOLD_K1 0xe9a5d8be00000000ull  /* x^(64 + 2048 - 1) mod P */
#define FOLD_K2 0x1426a81500000000ull  /* x^(2048 - 1) mod P */

VEC static inline __m512i fold_step(__m512i x, __m512i k, __m512i data)
{
    /* lo * K1 ^ hi * K2 ^ data in every 128-bit lane */
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                     data, 0x96);
}

/* CRC32C of one page of n >= 256 bytes; with copy set, also copied to dst. */
VEC static inline __attribute__((always_inline)) uint32_t fold_page(int copy, const uint8_t *p, uint8_t *dst,
                                                                    size_t n)
{
    const __m512i k = _mm512_set_epi64(FOLD_K2, FOLD_K1, FOLD_K2, FOLD_K1, FOLD_K2, FOLD_K1, FOLD_K2, FOLD_K1);
    __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    if (copy) {
        _mm512_storeu_si512(dst, x0);
        _mm512_storeu_si512(dst + 64, x1);
        _mm512_storeu_si512(dst + 128, x2);
        _mm512_storeu_si512(dst + 192, x3);
    }
    /* the initial value 0xFFFFFFFF is the same as inverting the first 32 bits */
    x0 = _mm512_xor_si512(x0, _mm512_maskz_set1_epi32(1, -1));
    size_t i = 256;
    for (; i + 256 <= n; i += 256) {
        __m512i y0 = _mm512_loadu_si512(p + i), y1 = _mm512_loadu_si512(p + i + 64);
        __m512i y2 = _mm512_loadu_si512(p + i + 128), y3 = _mm512_loadu_si512(p + i + 192);
        if (copy) {
            _mm512_storeu_si512(dst + i, y0);
            _mm512_storeu_si512(dst + i + 64, y1);
            _mm512_storeu_si512(dst + i + 128, y2);
            _mm512_storeu_si512(dst + i + 192, y3);
        }
        x0 = fold_step(x0, k, y0);
        x1 = fold_step(x1, k, y1);
        x2 = fold_step(x2, k, y2);
        x3 = fold_step(x3, k, y3);
    }
    /* the 256 folded bytes stand for everything before byte i: finish them and
     * the tail on the crc32 instruction, starting from no initial value */
    uint8_t acc[256];
    _mm512_storeu_si512(acc, x0);
    _mm512_storeu_si512(acc + 64, x1);
    _mm512_storeu_si512(acc + 128, x2);
    _mm512_storeu_si512(acc + 192, x3);
    uint64_t c = 0;
    for (size_t j = 0; j < 256; j += 8)
        c = _mm_crc32_u64(c, load64(acc + j));
    for (; i + 8 <= n; i += 8) {
        uint64_t v = load64(p + i);
        if (copy)
            store64(dst + i, v);
        c = _mm_crc32_u64(c, v);
    }
    uint32_t t = (uint32_t)c;
    for (; i < n; i++) {
        if (copy)
            dst[i] = p[i];
        t = _mm_crc32_u8(t, p[i]);
    }
    return ~t;
}

VEC static void fold_pages(const uint8_t *base, int64_t stride, int64_t count, size_t n, uint32_t *out)
{
    for (int64_t i = 0; i < count; i++)
        out[i] = fold_page(0, base + i * stride, NULL, n);
}

VEC static uint32_t fold_copy_page(const uint8_t *src, uint8_t *dst, size_t n)
{
    return fold_page(1, src, dst, n);
}

/* out[i] = CRC32C of the page_bytes bytes at base + i * stride, i < count. */
HASH void concordia_page_crcs(const uint8_t *base, int64_t stride, int64_t count, int64_t page_bytes,
                              uint32_t *out)
{
    size_t n = (size_t)page_bytes;
    if (use_fold && n >= 256) {
        fold_pages(base, stride, count, n, out);
        return;
    }
    int64_t i = 0;
    for (; i + 3 <= count; i += 3) {
        const uint8_t *s[3] = {base + i * stride, base + (i + 1) * stride, base + (i + 2) * stride};
        group(3, 0, s, NULL, n, out + i);
    }
    if (i < count) {
        const uint8_t *s[3] = {base + i * stride, base + (i + 1 < count ? i + 1 : i) * stride, base + i * stride};
        group((int)(count - i), 0, s, NULL, n, out + i);
    }
}

/* out[i] = CRC32C of the lengths[i] bytes at base + offsets[i], i < count: the
 * payloads of many records in one call (a walk's page checks), three at a time
 * where three spans in a row are of one length. */
HASH void concordia_span_crcs(const uint8_t *base, const int64_t *offsets, const int64_t *lengths, int64_t count,
                              uint32_t *out)
{
    int64_t i = 0;
    while (i < count) {
        size_t n = (size_t)lengths[i];
        if (use_fold && n >= 256) {
            fold_pages(base + offsets[i], 0, 1, n, out + i);
            i++;
            continue;
        }
        int k = 1;
        while (k < 3 && i + k < count && (size_t)lengths[i + k] == n)
            k++;
        const uint8_t *s[3] = {base + offsets[i], base + offsets[i + (k > 1)], base + offsets[i + (k > 2 ? 2 : 0)]};
        group(k, 0, s, NULL, n, out + i);
        i += k;
    }
}

/* Page i (i < count) of page_bytes bytes is copied to dst + i * page_bytes from
 * src + offsets[i] (or, when offsets is NULL, from src + i * src_stride), and
 * out[i] is the CRC32C of the bytes copied.  A negative offset stands for a page
 * nobody wrote: it is zero-filled and its CRC is that of a zero page.  The
 * source and destination pages must not overlap. */
HASH void concordia_copy_page_crcs(uint8_t *dst, const uint8_t *src, const int64_t *offsets, int64_t src_stride,
                                   int64_t count, int64_t page_bytes, uint32_t *out)
{
    size_t n = (size_t)page_bytes;
    const uint8_t *s[3];
    uint8_t *d[3];
    int64_t idx[3];
    int k = 0, have_zero = 0;
    uint32_t zero_crc = 0;
    for (int64_t i = 0; i < count; i++) {
        uint8_t *to = dst + i * page_bytes;
        int64_t off = offsets ? offsets[i] : i * src_stride;
        if (off < 0) {
            memset(to, 0, n);
            if (!have_zero) {
                const uint8_t *z[1] = {to};
                lanes(1, 0, z, NULL, n, &zero_crc);
                have_zero = 1;
            }
            out[i] = zero_crc;
            continue;
        }
        if (use_fold && n >= 256) {
            out[i] = fold_copy_page(src + off, to, n);
            continue;
        }
        s[k] = src + off;
        d[k] = to;
        idx[k] = i;
        if (++k == 3) {
            uint32_t got[3];
            lanes(3, 1, s, d, n, got);
            out[idx[0]] = got[0];
            out[idx[1]] = got[1];
            out[idx[2]] = got[2];
            k = 0;
        }
    }
    if (k) {
        uint32_t got[3];
        group(k, 1, s, d, n, got);
        for (int j = 0; j < k; j++)
            out[idx[j]] = got[j];
    }
}

/* The ids table of a page batch: t[i] = ids[i] as u32 (ids are u32 when
 * ids_are_i64 is 0, else i64).  Returns 0, -1 when the ids are not strictly
 * increasing, -2 when one does not fit in a u32. */
static int fill_ids(uint32_t *t, const void *ids, int ids_are_i64, int64_t count)
{
    int64_t prev = -1;
    for (int64_t i = 0; i < count; i++) {
        int64_t id = ids_are_i64 ? ((const int64_t *)ids)[i] : (int64_t)((const uint32_t *)ids)[i];
        if (id < 0 || id > 0xFFFFFFFFll)
            return -2;
        if (id <= prev)
            return -1;
        prev = id;
        t[i] = (uint32_t)id;
    }
    return 0;
}

/* The tables of a page batch (FORMAT.md §6.1) in one call: tables[0:4n] = the
 * page ids, tables[4n:8n] = the CRC32C of each of the n pages at
 * pages + i * stride.  Returns the CRC32C of those 8n bytes (the record
 * header's body CRC), or fill_ids's negative code (nothing hashed; the
 * tables then hold garbage).  tables is 4-byte aligned. */
HASH int64_t concordia_page_batch_tables(const uint8_t *pages, int64_t stride, int64_t count, int64_t page_bytes,
                                         const void *ids, int ids_are_i64, uint8_t *tables)
{
    uint32_t *t = (uint32_t *)(void *)tables;
    int bad = fill_ids(t, ids, ids_are_i64, count);
    if (bad)
        return bad;
    concordia_page_crcs(pages, stride, count, page_bytes, t + count);
    const uint8_t *z[1] = {tables};
    uint32_t c;
    lanes(1, 0, z, NULL, (size_t)(8 * count), &c);
    return (int64_t)c;
}

/* The same, for a record written in place: the n pages are also copied to
 * payload (back to back) and hashed as they are copied, and tables_bytes - 8n
 * bytes of zero padding follow the tables.  When the ids are bad nothing is
 * written but part of the ids table. */
HASH int64_t concordia_copy_page_batch(uint8_t *tables, int64_t tables_bytes, uint8_t *payload, const uint8_t *pages,
                                       int64_t stride, int64_t count, int64_t page_bytes, const void *ids,
                                       int ids_are_i64)
{
    uint32_t *t = (uint32_t *)(void *)tables;
    int bad = fill_ids(t, ids, ids_are_i64, count);
    if (bad)
        return bad;
    memset(tables + 8 * count, 0, (size_t)(tables_bytes - 8 * count));
    concordia_copy_page_crcs(payload, pages, NULL, stride, count, page_bytes, t + count);
    const uint8_t *z[1] = {tables};
    uint32_t c;
    lanes(1, 0, z, NULL, (size_t)(8 * count), &c);
    return (int64_t)c;
}

/* One CRC32C per row of `rows` x `count` page CRCs: the CRC of the row's pages
 * laid end to end, each page the same length, folded from their CRCs
 * (FORMAT.md V-P5 on a record's CRC table): acc = Z(acc) ^ crc[i] from acc = 0
 * (an empty message), where Z appends a page of zero bytes to what acc is the
 * CRC of, given as four 256-entry tables over acc's bytes (format's
 * _zero_shift_tables for the page length).  Plain code: table lookups only. */
void concordia_fold_crcs(const uint32_t *crcs, int64_t rows, int64_t count, const uint32_t *z, uint32_t *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *c = crcs + r * count;
        uint32_t acc = 0;
        for (int64_t i = 0; i < count; i++)
            acc = z[acc & 0xff] ^ z[256 + ((acc >> 8) & 0xff)] ^ z[512 + ((acc >> 16) & 0xff)] ^ z[768 + (acc >> 24)]
                  ^ c[i];
        out[r] = acc;
    }
}

/* The records laid back to back from byte `start` of `base` (FORMAT.md §5.1: each
 * header's first eight bytes its length), walked by their lengths up to `used`
 * bytes: their offsets into `out` (room for `cap`), stopping before a length
 * under `min_len`, not a multiple of `align`, or running past `used`, or once
 * `out` is full.  Returns how many; the header checks are the caller's.  With
 * `headers` (room for `cap` x `min_len` bytes), each record's first `min_len`
 * bytes (its header) are copied there too, in order.  `*end`: where the walk
 * stopped (the next record's offset when `out` filled up). */
int64_t concordia_walk_lengths(const uint8_t *base, int64_t start, int64_t used, int64_t min_len, int64_t align,
                               int64_t *out, int64_t cap, uint8_t *headers, int64_t *end)
{
    int64_t pos = start, n = 0;
    while (pos + 8 <= used && n < cap) {
        uint64_t len = load64(base + pos);
        if (len < (uint64_t)min_len || len % (uint64_t)align || len > (uint64_t)(used - pos))
            break;
        if (headers)  /* the header's bytes while they are at hand: no second pass over scattered lines */
            memcpy(headers + n * min_len, base + pos, (size_t)min_len);
        out[n++] = pos;
        pos += (int64_t)len;
    }
    *end = pos;
    return n;
}
