// The region table's checkpoint (concordia/checkpoint/table.py): every region
// of an epoch in a few launches on one stream, with no host round trip:
//
//   table_fingerprint / table_shadow   one launch per group of table rows that
//       share a detector and page size (-D PAGE_BYTES; templates on the page
//       size for a module of several, executor.cu's): one warp per page of
//       the group, the row found by binary search over the group's page
//       prefix; flags[first_page + p] = dirty, the detector state advanced.
//   table_positions one launch per group of static-cache rows whose length
//       (and sequence id) the caller keeps in device words: a warp per row
//       reads them and counts the pages holding a position in [last length,
//       length now) of any of the row's runs, every page when the length went
//       down or the sequence id moved (a reset, a new prompt); no page is read
//       or flagged (the twin: detect.listed_pages over the same rows).
//   table_mark      flags of pages the host listed (block tables, versions).
//   table_plan      one block: the epoch's sorted dirty pages (page space
//       indices), from the flags of the flagged rows and, for positions rows,
//       from their counts (their lengths then become the rows' last), so that
//       a decode step costs its new rows, not the cache; each row's count, and
//       the records: row after row
//       in table order, each row's pages cut into records of per_record pages,
//       back to back from offset 0 of the extent (the twin is
//       table.plan_records).  When they need more than the extent holds, or
//       more records than there is room for, `fits` is 0 and nothing is staged.
//   table_stage     one warp per dirty page: payload copy, page CRC32C into the
//       record's CRC table and the region's page CRC table, the index entry; the
//       region digest moves by each changed CRC word (as stage_delta does).
//   table_finalize  one warp per record: body CRC over the two tables, then the
//       header, stored last (common.cuh's write_page_batch_header, as stage.cu's kernels write it).
//   table_commit    one warp, for a pass that commits its own epoch: the commit
//       record right after the records (its twin: HostTablePass, by wal.format).
//
// Records are page batches exactly as gpu_kernels/stage.cu and
// reference.stage_page_batch write them (FORMAT.md §6).  Page sizes are read
// from the table by the plan, stage and finalize kernels, so one launch of
// each covers rows of any page size.
#include "common.cuh"


// concordia.checkpoint.table.ENTRY (64 bytes)
struct TableEntry {
    u64 base, nbytes, state, crc_table, first_page;
    u32 pages, page_bytes, detector, region_id, digest_slot, per_record;
};

// concordia.checkpoint.table.DET_POSITIONS: TableEntry.detector of a row whose
// state is a PositionsState
#define DET_POSITIONS 4

// concordia.checkpoint.table.POSITIONS (96 bytes): the detector state of a
// static-cache row [..., max_len, row] whose length the caller keeps in a
// device word (int64; `seq` likewise its sequence id, 0: none)
struct PositionsState {
    u64 length, seq;
    i64 last, last_seq;  // as of the last epoch (last < 0: none yet, every page)
    i64 now, now_seq;    // what this epoch's detection read (now < 0: out of range); the plan makes them last
    u64 max_len, row_bytes;
    i64 lo, lo_seq;      // last and last_seq as this epoch's detection found them: its baseline
    u64 count, at;       // the pages this epoch writes (detection), where its ids start (the plan)
};

// concordia.checkpoint.table.RECORD (32 bytes)
struct TableRecord {
    u64 lo, offset, length;
    u32 region, count;
};

// concordia.checkpoint.table.PLAN
struct TablePlan {
    u64 fits, bytes, records, pages;
};


// The last i in [0, n) with first[i] <= q (first[0] = 0 <= q).
__device__ __forceinline__ u32 last_at_or_below(const u64* first, u32 n, u64 q) {
    u32 lo = 0, hi = n;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) >> 1;
        if (first[mid] <= q) lo = mid;
        else hi = mid;
    }
    return lo;
}

// This warp's index in its grid, and the grid's warps.
__device__ __forceinline__ u64 grid_warp() { return ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ u64 grid_warps() { return (u64)gridDim.x * (blockDim.x >> 5); }

// rows: the group's table rows; row_first: u64[n_rows + 1], the group's page
// prefix (row_first[n_rows] = the group's pages).  The bodies take the warps
// [w0, w0 + warps) of their launch (w0 this warp's index): a kernel of its
// own, or one block of a fused epoch (executor.cu's cx_epoch_small).  PB: the
// group's page size (every row's), known when the module is built.
template <u32 PB>
__device__ __forceinline__ void fingerprint_rows_pb(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                                                    const u64* __restrict__ row_first, u32 n_rows,
                                                    u8* __restrict__ flags, u64 w0, u64 warps) {
    const int lane = threadIdx.x & 31;
    const u64 total = row_first[n_rows];
    for (u64 q = w0; q < total; q += warps) {
        const u32 e = last_at_or_below(row_first, n_rows, q);
        const TableEntry& t = table[rows[e]];
        const u64 p = q - row_first[e];
        const u64 h = page_fingerprint_pb<PB>(reinterpret_cast<const u8*>(t.base), t.nbytes, p, lane);
        if (lane == 0) {
            u64* fps = reinterpret_cast<u64*>(t.state);
            const u64 old = fps[p];
            flags[t.first_page + p] = (u8)(h != old);
            if (h != old) fps[p] = h;
        }
    }
}

template <u32 PB>
__device__ __forceinline__ void shadow_rows_pb(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                                               const u64* __restrict__ row_first, u32 n_rows, u8* __restrict__ flags,
                                               u64 w0, u64 warps) {
    const int lane = threadIdx.x & 31;
    const u64 total = row_first[n_rows];
    for (u64 q = w0; q < total; q += warps) {
        const u32 e = last_at_or_below(row_first, n_rows, q);
        const TableEntry& t = table[rows[e]];
        const u64 p = q - row_first[e];
        const unsigned diff = page_shadow_diff_pb<PB>(reinterpret_cast<const u8*>(t.base),
                                                      reinterpret_cast<u8*>(t.state), t.nbytes, p, lane, 1);
        if (lane == 0) flags[t.first_page + p] = (u8)diff;
    }
}

// The same as kernels of their own, for a page size PB (executor.cu launches them from the device).
template <u32 PB>
__global__ void __launch_bounds__(256)
table_fingerprint_pb(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                     const u64* __restrict__ row_first, u32 n_rows, u8* __restrict__ flags) {
    fingerprint_rows_pb<PB>(table, rows, row_first, n_rows, flags, grid_warp(), grid_warps());
}

template <u32 PB>
__global__ void __launch_bounds__(256)
table_shadow_pb(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                const u64* __restrict__ row_first, u32 n_rows, u8* __restrict__ flags) {
    shadow_rows_pb<PB>(table, rows, row_first, n_rows, flags, grid_warp(), grid_warps());
}

#if defined(PAGE_BYTES) && !defined(CX_EPOCH)  // (the EPOCH handler launches the templates above)
extern "C" __global__ void __launch_bounds__(256)
table_fingerprint(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                  const u64* __restrict__ row_first, u32 n_rows, u8* __restrict__ flags) {
    fingerprint_rows_pb<PAGE_BYTES>(table, rows, row_first, n_rows, flags, grid_warp(), grid_warps());
}

extern "C" __global__ void __launch_bounds__(256)
table_shadow(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
             const u64* __restrict__ row_first, u32 n_rows, u8* __restrict__ flags) {
    shadow_rows_pb<PAGE_BYTES>(table, rows, row_first, n_rows, flags, grid_warp(), grid_warps());
}
#endif  // PAGE_BYTES

// ---- positions: the rows of static caches, from the caller's device words ------
//
// A decode step adds one position to every run of a cache's rows: a handful of
// pages among the hundreds of thousands the cache holds.  Detection reads each
// row's words and counts its dirty pages (a warp a row, a lane a run); the plan
// writes their ids from the same arithmetic.  No page is read or flagged: the
// cost is the rows' and the new pages', not the cache's (the host's twin,
// detect.position_pages, lists the same pages).

__device__ __forceinline__ i64 positions_word(u64 addr) { return addr ? *(volatile const i64*)addr : 0; }

__device__ __forceinline__ PositionsState* positions_state(const TableEntry& t) {
    return reinterpret_cast<PositionsState*>(t.state);
}

// Whether this epoch writes the row whole: a length out of range (now < 0), one
// that went down, a sequence id that moved (a reset, a new prompt), or no epoch
// before (lo < 0).
__device__ __forceinline__ bool positions_whole(i64 lo, i64 lo_seq, i64 now, i64 now_seq) {
    return now < 0 || now < lo || now_seq != lo_seq || lo < 0;
}

// The pages of run m of a row (positions [lo, hi) of its max_len, each row_bytes:
// bytes [m * span + lo * row_bytes, m * span + hi * row_bytes) of the region)
// that the run before did not already name: [*first, *first + count).  Pages
// may straddle two runs, whose ranges then meet at that page.  hi > lo.
__device__ __forceinline__ u64 run_pages(u64 m, u64 span, u64 row_bytes, u64 page_bytes, i64 lo, i64 hi,
                                         u64* first) {
    const u64 end = m * span + (u64)hi * row_bytes - 1;
    u64 start = (m * span + (u64)lo * row_bytes) / page_bytes;
    if (m) {
        const u64 before = ((m - 1) * span + (u64)hi * row_bytes - 1) / page_bytes + 1;
        if (before > start) start = before;
    }
    *first = start;
    return end / page_bytes >= start ? end / page_bytes - start + 1 : 0;
}

// The runs of positions row `t`: its leading dimensions (batch x heads), each max_len positions.
__device__ __forceinline__ u64 positions_runs(const TableEntry& t, u64 max_len, u64 row_bytes) {
    const u64 span = max_len * row_bytes;
    return span ? t.nbytes / span : 0;
}

// rows: the group's table rows; the warps [w0, w0 + warps) of the launch take a
// row each in turn.  Each row's state takes what its words say now (now,
// now_seq), its last epoch's as this epoch's baseline (lo, lo_seq: a second
// plan of the same epoch reads the same), and the number of pages this epoch
// writes (count).
__device__ __forceinline__ void positions_rows(const TableEntry* __restrict__ table, const u32* __restrict__ rows,
                                               u32 n_rows, u64 w0, u64 warps) {
    const int lane = threadIdx.x & 31;
    for (u64 e = w0; e < n_rows; e += warps) {
        const TableEntry& t = table[rows[e]];
        PositionsState* s = positions_state(t);
        i64 lo = 0, lo_seq = 0, now = 0, now_seq = 0;
        if (lane == 0) {
            const i64 read = positions_word(s->length);
            now_seq = positions_word(s->seq);
            now = read < 0 ? 0 : (read > (i64)s->max_len ? (i64)s->max_len : read);
            // a length out of range: every page, and again next time (the host's twin refuses it in
            // one line; the device cannot, so it writes the region whole)
            if (read != now) now = -1;
            lo = s->last;
            lo_seq = s->last_seq;
            s->lo = lo;
            s->lo_seq = lo_seq;
            s->now = now;
            s->now_seq = now_seq;
        }
        lo = (i64)__shfl_sync(FULL_MASK, (unsigned long long)lo, 0);
        lo_seq = (i64)__shfl_sync(FULL_MASK, (unsigned long long)lo_seq, 0);
        now = (i64)__shfl_sync(FULL_MASK, (unsigned long long)now, 0);
        now_seq = (i64)__shfl_sync(FULL_MASK, (unsigned long long)now_seq, 0);
        u64 c = 0;
        if (positions_whole(lo, lo_seq, now, now_seq)) {
            c = lane == 0 ? t.pages : 0;
        } else if (now > lo) {
            const u64 runs = positions_runs(t, s->max_len, s->row_bytes);
            u64 first;
            for (u64 m = lane; m < runs; m += WARP) c += run_pages(m, s->max_len * s->row_bytes, s->row_bytes,
                                                                   t.page_bytes, lo, now, &first);
        }
        c = warp_sum64(c);
        if (lane == 0) s->count = c;
    }
}

// A warp a row of the group (the host launches it with a warp per row).
extern "C" __global__ void __launch_bounds__(256)
table_positions(const TableEntry* __restrict__ table, const u32* __restrict__ rows, u32 n_rows) {
    positions_rows(table, rows, n_rows, grid_warp(), grid_warps());
}

// flags[pages[i]] = value for i < n
extern "C" __global__ void table_mark(u8* __restrict__ flags, const u64* __restrict__ pages, u64 n, u32 value) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        flags[pages[i]] = (u8)value;
}

// ---- the plan (one block of 1024 threads) -------------------------------------

// Exclusive prefix sum of v over the block; *total receives the block's sum.
// `sums` is 32 u64 of shared memory.
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* sums, u64* total) {
    const u32 t = threadIdx.x, lane = t & 31, w = t >> 5, warps = blockDim.x >> 5;
    u64 incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const u64 x = __shfl_up_sync(FULL_MASK, incl, d);
        if ((int)lane >= d) incl += x;
    }
    __syncthreads();  // the previous scan's readers are done with `sums`
    if (lane == 31) sums[w] = incl;
    __syncthreads();
    if (w == 0) {
        u64 s = lane < warps ? sums[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u64 x = __shfl_up_sync(FULL_MASK, s, d);
            if ((int)lane >= d) s += x;
        }
        sums[lane] = s;  // inclusive over warps
    }
    __syncthreads();
    *total = sums[warps - 1];
    return (w ? sums[w - 1] : 0) + incl - v;
}

// The first i in [0, n) with ids[i] >= v (n when none).
__device__ __forceinline__ u64 lower_bound_u32(const u32* ids, u64 n, u64 v) {
    u64 lo = 0, hi = n;
    while (lo < hi) {
        const u64 mid = (lo + hi) >> 1;
        if ((u64)ids[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Sorted positions in [from, to) of the set flags into ids; returns their
// number (every thread).  Tiles of 64 flags per thread (from `from` rounded
// down to a multiple of 64), a block scan of the per-thread counts.
__device__ u64 block_compact(const u8* __restrict__ flags, u64 from, u64 to, u32* __restrict__ ids, u64* sums) {
    u64 base = 0;
    for (u64 tile = from & ~63ull; tile < to; tile += (u64)blockDim.x * 64) {
        const u64 lo = tile + (u64)threadIdx.x * 64;
        u64 bits = 0;
        if (lo >= from && lo + 64 <= to) {
            const uint4* p = reinterpret_cast<const uint4*>(flags + lo);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 v = p[q];
                const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k)
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if ((words[k] >> (8 * b)) & 0xFFu) bits |= 1ull << (16 * q + 4 * k + b);
            }
        } else {
            for (int k = 0; k < 64; ++k)
                if (lo + k >= from && lo + k < to && flags[lo + k]) bits |= 1ull << k;
        }
        u64 tile_total;
        u64 off = base + block_exclusive_scan((u64)__popcll(bits), sums, &tile_total);
        while (bits) {
            const int k = __ffsll((long long)bits) - 1;
            ids[off++] = (u32)(lo + k);
            bits &= bits - 1;
        }
        base += tile_total;
    }
    return base;
}

__device__ __forceinline__ bool is_positions(const TableEntry* table, u32 r) {
    return table[r].detector == DET_POSITIONS;
}

// The first row after r0 whose kind (positions or not) is not r0's, or n: the
// block searches together (every thread; `found` a u32 of shared memory).
__device__ u32 kind_end(const TableEntry* __restrict__ table, u32 n, u32 r0, u32* found) {
    const bool kind = is_positions(table, r0);
    if (threadIdx.x == 0) *found = n;
    __syncthreads();
    for (u32 r = r0 + 1 + threadIdx.x; r < n && r < *(volatile u32*)found; r += blockDim.x)
        if (is_positions(table, r) != kind) {
            atomicMin(found, r);
            break;
        }
    __syncthreads();
    const u32 end = *found;
    __syncthreads();  // every thread has read it before it is written again
    return end;
}

// The plan's part for positions rows [r0, r1): each row's dirty pages, in
// order, into ids from `base` on, row after row (each row's first at `at` in
// its state); returns base plus their number.  The whole block runs it.
__device__ u64 positions_ids(const TableEntry* __restrict__ table, u32 r0, u32 r1, u32* __restrict__ ids, u64 base,
                             u64* sums) {
    for (u32 tile = r0; tile < r1; tile += blockDim.x) {
        const u32 r = tile + threadIdx.x;
        const u64 c = r < r1 ? positions_state(table[r])->count : 0;
        u64 total;
        const u64 off = block_exclusive_scan(c, sums, &total);
        if (r < r1) positions_state(table[r])->at = base + off;
        base += total;
    }
    __syncthreads();  // every row's `at` before the warps write from it
    const int lane = threadIdx.x & 31;
    for (u32 r = r0 + (threadIdx.x >> 5); r < r1; r += blockDim.x >> 5) {
        const TableEntry& t = table[r];
        const PositionsState* s = positions_state(t);
        u64 at = s->at;
        const i64 lo = s->lo, now = s->now;
        if (positions_whole(lo, s->lo_seq, now, s->now_seq)) {
            for (u64 j = lane; j < t.pages; j += WARP) ids[at + j] = (u32)(t.first_page + j);
            continue;
        }
        if (now <= lo) continue;
        const u64 runs = positions_runs(t, s->max_len, s->row_bytes), span = s->max_len * s->row_bytes;
        for (u64 m0 = 0; m0 < runs; m0 += WARP) {
            const u64 m = m0 + lane;
            u64 first = 0;
            const u64 c = m < runs ? run_pages(m, span, s->row_bytes, t.page_bytes, lo, now, &first) : 0;
            u64 incl = c;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const u64 x = __shfl_up_sync(FULL_MASK, incl, d);
                if (lane >= d) incl += x;
            }
            for (u64 j = 0; j < c; ++j) ids[at + incl - c + j] = (u32)(t.first_page + first + j);
            at += __shfl_sync(FULL_MASK, incl, 31);
        }
    }
    __syncthreads();  // the ids written before anything reads them
    return base;
}

// The plan's last step for positions rows: each detector moves to what its
// detection read (run again by a second plan of the same epoch: the same).
__device__ __forceinline__ void positions_advance(const TableEntry* __restrict__ table, u32 n) {
    for (u32 r = threadIdx.x; r < n; r += blockDim.x) {
        if (table[r].detector != DET_POSITIONS) continue;
        PositionsState* s = positions_state(table[r]);
        s->last = s->now;
        s->last_seq = s->now_seq;
    }
}

// mail_plan / mail_counts / mail_offsets: pinned host memory the device
// addresses (the host reads them after the stream's event): the plan, each
// row's count, each record's offset (what the appender checks the extent by).
// The whole block (every thread) runs it; `sums` is 32 u64 of shared memory.
__device__ void plan_block(const TableEntry* __restrict__ table, u32 n, const u8* __restrict__ flags,
                           u32* __restrict__ ids, TableRecord* __restrict__ recs, u64 max_records, u64 dst_bytes,
                           TablePlan* __restrict__ plan, TablePlan* mail_plan, u32* mail_counts, u64* mail_offsets,
                           u64* sums) {
    // the sorted dirty pages, run of rows by run of rows: the flags of rows a detector flagged, the
    // positions rows' pages from their counts (never flagged: no pass over the cache's pages)
    __shared__ u32 found;
    u64 k = 0;
    for (u32 r0 = 0; r0 < n;) {
        const u32 r1 = kind_end(table, n, r0, &found);
        if (is_positions(table, r0)) {
            k = positions_ids(table, r0, r1, ids, k, sums);
        } else {
            const TableEntry& last = table[r1 - 1];
            k += block_compact(flags, table[r0].first_page, last.first_page + last.pages, ids + k, sums);
        }
        r0 = r1;
    }
    positions_advance(table, n);
    __syncthreads();  // every thread's ids written before any thread searches them
    u64 rec_base = 0, byte_base = 0;
    for (u32 tile = 0; tile < n; tile += blockDim.x) {
        const u32 r = tile + threadIdx.x;
        u64 c = 0, start = 0, nrec = 0, bytes = 0, per = 1, pb = 0;
        if (r < n) {
            const TableEntry& e = table[r];
            start = lower_bound_u32(ids, k, e.first_page);
            c = lower_bound_u32(ids, k, e.first_page + e.pages) - start;
            per = e.per_record;
            pb = e.page_bytes;
            const u64 full = c / per, rem = c % per;
            nrec = full + (rem ? 1 : 0);
            bytes = full * page_batch_length(per, pb) + (rem ? page_batch_length(rem, pb) : 0);
            mail_counts[r] = (u32)c;
        }
        u64 tile_recs, tile_bytes;
        const u64 rec_off = block_exclusive_scan(nrec, sums, &tile_recs);
        const u64 byte_off = block_exclusive_scan(bytes, sums, &tile_bytes);
        u64 at = byte_base + byte_off;
        for (u64 j = 0; j < nrec; ++j) {
            const u64 i = rec_base + rec_off + j;
            const u64 cnt = c - j * per < per ? c - j * per : per;
            const u64 len = page_batch_length(cnt, pb);
            if (i < max_records) {
                TableRecord out;
                out.lo = start + j * per;
                out.offset = at;
                out.length = len;
                out.region = r;
                out.count = (u32)cnt;
                recs[i] = out;
                mail_offsets[i] = at;
            }
            at += len;
        }
        rec_base += tile_recs;
        byte_base += tile_bytes;
    }
    if (threadIdx.x == 0) {
        TablePlan out;
        out.fits = byte_base <= dst_bytes && rec_base <= max_records;
        out.bytes = byte_base;
        out.records = rec_base;
        out.pages = k;
        *plan = out;
        *mail_plan = out;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
table_plan(const TableEntry* __restrict__ table, u32 n, const u8* __restrict__ flags,
           u32* __restrict__ ids, TableRecord* __restrict__ recs, u64 max_records, u64 dst_bytes,
           TablePlan* __restrict__ plan, TablePlan* mail_plan, u32* mail_counts, u64* mail_offsets) {
    __shared__ u64 sums[32];
    plan_block(table, n, flags, ids, recs, max_records, dst_bytes, plan, mail_plan, mail_counts,
               mail_offsets, sums);
}

// ---- staging (page sizes read from the table) ----------------------------------

// Per-lane constants of the split page CRC for `pb`-byte pages (common.cuh's
// PageCrc / page_crc_setup with the page size known only at run time).
struct PageCrcRt {
    u32 page_bytes, lane_shift, finish;
};

__device__ __forceinline__ u32 crc_step_of(u32 pb) { return 16 * ((pb / 16 + WARP - 1) / WARP); }

__device__ __forceinline__ PageCrcRt page_crc_setup_rt(u32 pb, int lane) {
    u32 hi = (u32)(lane + 1) * crc_step_of(pb);
    if (hi > pb) hi = pb;
    PageCrcRt c;
    c.page_bytes = pb;
    c.lane_shift = xpow8n(pb - hi);
    c.finish = gf2_multmodp(xpow8n(pb), 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
    return c;
}

// One page by one warp: 16-byte copy into `out`, CRC32C to every lane.
__device__ __forceinline__ u32 copy_page_rt(const u32* T, const u8* region, u64 region_bytes, u64 page,
                                            uint4* out, int lane, PageCrcRt k) {
    const u32 pb = k.page_bytes, chunks = pb / 16;
    const u64 base = page * pb;
    const u8* src = region + base;
    const u32 valid = base + pb <= region_bytes ? pb : (u32)(region_bytes - base);
    if (valid == pb) {
        for (u32 c = lane; c < chunks; c += WARP) out[c] = __ldcs(reinterpret_cast<const uint4*>(src) + c);
    } else {
        for (u32 c = lane; c < chunks; c += WARP) out[c] = load16(src, c * 16, valid);
    }
    const u32 step = crc_step_of(pb);
    u32 lo = (u32)lane * step, hi = lo + step;
    if (lo > pb) lo = pb;
    if (hi > pb) hi = pb;
    u32 raw = 0;
    for (u32 off = lo; off < hi; off += 16) raw = crc_chunk(T, raw, load16(src, off, valid));
    raw = gf2_multmodp(k.lane_shift, raw);
    return warp_xor(raw) ^ k.finish;
}

// The record holding dirty page k: the last i with recs[i].lo <= k.
__device__ __forceinline__ u64 record_of(const TableRecord* recs, u64 n, u64 k) {
    u64 lo = 0, hi = n;
    while (hi - lo > 1) {
        const u64 mid = (lo + hi) >> 1;
        if (recs[mid].lo <= k) lo = mid;
        else hi = mid;
    }
    return lo;
}

// digests: u32 per row (digest_slot), moved here by every changed page CRC.
// The warps [w0, w0 + warps) of the launch stage dirty pages w0, w0 + warps, ...
// with the CRC tables T built (by the caller, before any warp runs this).
__device__ __forceinline__ void stage_pages(const u32* T, const TableEntry* __restrict__ table,
                                            const u32* __restrict__ ids, const TableRecord* __restrict__ recs,
                                            const TablePlan* __restrict__ plan, u8* __restrict__ dst,
                                            u32* __restrict__ digests, u64 w0, u64 warps) {
    const u64 k_total = plan->pages, n_recs = plan->records;
    const int lane = threadIdx.x & 31;
    PageCrcRt crc_k;
    crc_k.page_bytes = 0;
    for (u64 k = w0; k < k_total; k += warps) {
        const TableRecord rec = recs[record_of(recs, n_recs, k)];
        const TableEntry& e = table[rec.region];
        if (e.page_bytes != crc_k.page_bytes) crc_k = page_crc_setup_rt(e.page_bytes, lane);
        const u64 i = k - rec.lo;
        const u64 p = (u64)ids[k] - e.first_page;
        u8* out = dst + rec.offset;
        const u32 crc = copy_page_rt(T, reinterpret_cast<const u8*>(e.base), e.nbytes, p,
                                     reinterpret_cast<uint4*>(out + page_batch_payload_off(rec.count) + i * e.page_bytes),
                                     lane, crc_k);
        if (lane == 0) {
            u32* index = reinterpret_cast<u32*>(out + RECORD_HEADER_BYTES);
            index[i] = (u32)p;
            index[rec.count + i] = crc;
            u32* crcs = reinterpret_cast<u32*>(e.crc_table);
            const u32 delta = crcs[p] ^ crc;
            crcs[p] = crc;
            if (delta)
                atomicXor(&digests[e.digest_slot],
                          gf2_multmodp(xpow8n(4 * ((u64)e.pages - 1 - p)), crc_word(T, 0, delta)));
        }
        if (i == 0) {  // the zero pad between the tables and the payload
            const u64 pad_lo = (RECORD_HEADER_BYTES + 8ull * rec.count) / 4, pad_hi = page_batch_payload_off(rec.count) / 4;
            for (u64 w = pad_lo + lane; w < pad_hi; w += WARP) reinterpret_cast<u32*>(out)[w] = 0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
table_stage(const TableEntry* __restrict__ table, const u32* __restrict__ ids,
            const TableRecord* __restrict__ recs, const TablePlan* __restrict__ plan, u8* __restrict__ dst,
            u32* __restrict__ digests) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    if (!plan->fits) return;
    const u64 first_warp = ((u64)blockIdx.x * blockDim.x) >> 5;
    if (first_warp >= plan->pages) return;  // the whole block: before any barrier
    crc_tables_build(T);
    stage_pages(T, table, ids, recs, plan, dst, digests, grid_warp(), grid_warps());
}

// The body CRC is computed from device memory (the epoch's dirty pages and
// the regions' CRC tables, which hold what the record's tables hold), not by
// reading the record back from a host mapping.  Warps [w0, w0 + warps) of
// the launch take records w0, w0 + warps, ..., with T built.
__device__ __forceinline__ void finalize_records(const u32* T, const TableEntry* __restrict__ table,
                                                 const u32* __restrict__ ids, const TableRecord* __restrict__ recs,
                                                 const TablePlan* __restrict__ plan, u8* __restrict__ dst,
                                                 u64 lsn_base, u64 epoch, u32 salt, u64 w0, u64 warps) {
    const u64 n_recs = plan->records;
    const int lane = threadIdx.x & 31;
    for (u64 i = w0; i < n_recs; i += warps) {
        const TableRecord rec = recs[i];
        const TableEntry& e = table[rec.region];
        u8* out = dst + rec.offset;
        // body = index table || CRC table: 2 * count words; a slice per lane
        const u32* page_crcs = reinterpret_cast<const u32*>(e.crc_table);
        const u64 count = rec.count, nw = 2 * count, per = (nw + WARP - 1) / WARP;
        u64 lo = per * lane, hi = lo + per;
        if (lo > nw) lo = nw;
        if (hi > nw) hi = nw;
        u32 raw = 0;
        for (u64 w = lo; w < hi; ++w) {
            const u32 page = (u32)(ids[rec.lo + (w < count ? w : w - count)] - e.first_page);
            raw = crc_word(T, raw, w < count ? page : page_crcs[page]);
        }
        raw = warp_xor(gf2_multmodp(xpow8n(4 * (nw - hi)), raw));
        if (lane == 0) {
            write_page_batch_header(T, out, rec.length, lsn_base + rec.offset, epoch, e.region_id, salt, 0,
                                    rec.count, e.page_bytes, page_batch_body_crc(raw, rec.count));
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
table_finalize(const TableEntry* __restrict__ table, const u32* __restrict__ ids,
               const TableRecord* __restrict__ recs, const TablePlan* __restrict__ plan, u8* __restrict__ dst,
               u64 lsn_base, u64 epoch, u32 salt) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    if (!plan->fits) return;
    const u64 first_warp = ((u64)blockIdx.x * blockDim.x) >> 5;
    if (first_warp >= plan->records) return;
    crc_tables_build(T);
    finalize_records(T, table, ids, recs, plan, dst, lsn_base, epoch, salt, grid_warp(), grid_warps());
}

// ---- the commit (a pending epoch the pass commits itself) ------------------------

// One warp: the epoch's commit record (FORMAT.md §8) right after its records,
// for a pass that commits its epoch itself (a pending epoch on a tier whose
// writes need no persist call: concordia/checkpoint/epoch.py).  Its counts
// come from the plan, its digests are the rows' (`digests[digest_slot]`) in
// region-id order (`order`: the rows sorted by region id), `prev_commit` is
// the LSN of the log's last commit.  The body, its zero pad and the header
// slot after the record (when that lies inside the extent) are written and
// fenced before the header, stored last by the one header writer: a reader
// sees the whole record or none.  Nothing is written when the plan did not
// fit (the plan was given the extent less this record's length).
// One warp, with T built: the commit (above).
__device__ void commit_warp(const u32* T, const TableEntry* __restrict__ table, const u32* __restrict__ order, u32 n,
                            const u32* __restrict__ digests, const TablePlan* __restrict__ plan, u8* __restrict__ dst,
                            u64 extent_bytes, u64 lsn_base, u64 epoch, u32 salt, u64 prev_commit) {
    const TablePlan p = *plan;
    const u64 body = 32 + 8ull * n, length = RECORD_HEADER_BYTES + ((body + 63) & ~63ull);
    if (!p.fits || p.bytes + length > extent_bytes) return;
    const int lane = threadIdx.x & 31;
    u8* rec = dst + p.bytes;
    u32* words = reinterpret_cast<u32*>(rec + RECORD_HEADER_BYTES);
    // body = record_count, record_bytes, first_lsn (u64 each), n_regions, 0, then (region_id, digest) pairs
    const u64 head[4] = {p.records, p.bytes, p.records ? lsn_base : 0ull, (u64)n};
    const u64 nw = body / 4, per = (nw + WARP - 1) / WARP;
    u64 lo = per * lane, hi = lo + per;
    if (lo > nw) lo = nw;
    if (hi > nw) hi = nw;
    u32 raw = 0;
    for (u64 w = lo; w < hi; ++w) {
        u32 v;
        if (w < 8) {
            v = (u32)(head[w >> 1] >> (32 * (w & 1)));
        } else {
            const TableEntry& e = table[order[(w - 8) >> 1]];
            v = (w & 1) ? digests[e.digest_slot] : e.region_id;
        }
        words[w] = v;
        raw = crc_word(T, raw, v);
    }
    raw = warp_xor(gf2_multmodp(xpow8n(4 * (nw - hi)), raw));
    for (u64 w = nw + lane; w < (length - RECORD_HEADER_BYTES) / 4; w += WARP) words[w] = 0;
    if (p.bytes + length + RECORD_HEADER_BYTES <= extent_bytes && lane < 16)
        reinterpret_cast<u32*>(rec + length)[lane] = 0;  // a clean end after the commit until the host trims
    __threadfence_system();
    __syncwarp();
    if (lane == 0)
        write_record_header(T, rec, length, TYPE_COMMIT, 0, lsn_base + p.bytes, epoch, NO_REGION, salt,
                            crc_of_raw(raw, body), body, 0, prev_commit);
}

extern "C" __global__ void __launch_bounds__(32)
table_commit(const TableEntry* __restrict__ table, const u32* __restrict__ order, u32 n,
             const u32* __restrict__ digests, const TablePlan* __restrict__ plan, u8* __restrict__ dst,
             u64 extent_bytes, u64 lsn_base, u64 epoch, u32 salt, u64 prev_commit) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    crc_tables_build(T);
    commit_warp(T, table, order, n, digests, plan, dst, extent_bytes, lsn_base, epoch, salt, prev_commit);
}
