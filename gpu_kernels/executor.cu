// The persistent executor: one resident warp takes tasks from the ring in mapped
// host memory (layout: concordia/executor/ring.py) and runs each task's handler.
//
// Footprint: one block of 32 threads, no shared memory.  Lane 0 is the only
// thread that polls host memory (one 8-byte acquire load of the next slot's
// sequence number, with a growing __nanosleep back-off); the warp reads a slot
// in one coalesced 128-byte load and writes a completion in one 64-byte store.
//
// Handlers run at full GPU width as child grids launched by lane 0 (dynamic
// parallelism, CX_CHILD=1, needs -rdc=true); lane 0 then waits on a counter in
// device memory (never host memory) that each child block bumps when done.
// With CX_CHILD=0 the same handler bodies run on the resident warp itself
// (no -rdc; slow, for devices or toolchains without device-side launch).
// Every handler is also a __global__ kernel the host can launch directly
// (the "direct" baseline the benchmark compares against).
//
// Bounded: the control loop leaves after `idle_ns` without a task (state
// IDLE_EXIT, after re-checking the slot once: ring.py protocol step 5), after
// `lifetime_ns` in total (LIFETIME_EXIT), and a child that does not finish
// within `child_timeout_ns` fails its task with TIMEOUT and the executor with FAULT.
//
// -D options: CX_CHILD (0/1), CX_OPS (bit mask of op codes compiled into the
// operator table; PING, QUIESCE and STOP are always there), CX_EPOCH (with
// CX_CHILD and PAGE_BYTES: the EPOCH handler, a session's epoch by the table
// pass of table.cu into an arena, below; CX_PAGE_BYTES_1..3, other page sizes
// its shadow and fingerprint groups may have), CX_RECOVER (with CX_CHILD: the RECOVER
// handler, a recovery's pages from the registered log mapping into device
// arrays, each checked against its stored CRC32C, below).
// (A 32-register cap on the control warp, so that it fits beside a GEMM block
// that fills the register file, was measured on the H200: the GEMM slowed just
// as much, so the block slot, not registers, is what residency costs.)

#ifndef CX_CHILD
#define CX_CHILD 1
#endif
#ifndef CX_OPS
#define CX_OPS 0xFFFFu
#endif

#if (defined(CX_EPOCH) || defined(CX_RECOVER)) && CX_CHILD
#include "table.cu"  // the table pass's kernels (and common.cuh), launched as child grids
#else
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

__device__ __forceinline__ bool differs(uint4 a, uint4 b) {
    return ((a.x ^ b.x) | (a.y ^ b.y) | (a.z ^ b.z) | (a.w ^ b.w)) != 0;
}
#endif

// Ring layout (ring.py).
#define CX_HDR_BYTES 256
#define CX_TASK_BYTES 128
#define CX_COMP_BYTES 64
#define CX_OFF_TAIL 128
#define CX_OFF_STATE 136
#define CX_OFF_EXECUTOR_ID 140
#define CX_OFF_POLLS 144
#define CX_OFF_INSTANCE 152

// Op codes (ring.Op).
#define OP_PING 1
#define OP_CHECKPOINT 2
#define OP_APPEND_LOG 3
#define OP_SCATTER 4
#define OP_QUIESCE 5
#define OP_STOP 6
// A Session's epoch (the EPOCH handler below, built with CX_EPOCH; else
// UNSUPPORTED_OP) and a recovery's pages (the RECOVER handler, built with
// CX_RECOVER; else UNSUPPORTED_OP).
#define OP_EPOCH 7
#define OP_RECOVER 8

// Status (ring.Status).
#define ST_OK 0
#define ST_UNSUPPORTED_OP 1
#define ST_BAD_ARGS 2
#define ST_LAUNCH_FAILED 3
#define ST_TIMEOUT 4
// EPOCH: the arena has no room for an epoch's bound, or lost an epoch (nothing was detected)
#define ST_NO_ROOM 6
// EPOCH: the epoch's records did not fit what the arena had left: the detectors
// moved on and nothing was written; the arena takes no further epoch (`lost`)
#define ST_LOST 7

// Consumer state (ring.ConsumerState).
#define CS_RUNNING 1
#define CS_IDLE_EXIT 2
#define CS_QUIESCED 3
#define CS_STOPPED 4
#define CS_FAULT 5
#define CS_LIFETIME_EXIT 6

#define FULL 0xFFFFFFFFu
#define CHILD_THREADS 256

// Device-memory scratch shared by the control warp and its child grids.
struct cx_scratch {
    u64 pages;        // pages found / applied (atomicAdd by handler warps)
    u64 bytes;        // a RECOVER's bytes read (atomicAdd by its warps)
    u32 done_blocks;  // child blocks finished
    u32 errors;       // pages rejected by bounds checks (SCATTER, RECOVER)
    u64 claim;        // an epoch's commit: 0 open, CX_CLAIM_COMMIT (its child read every region), CX_CLAIM_CANCEL
    u64 reserved[4];
};

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- handler bodies: one warp per page, any number of warps ------------------

// CHECKPOINT: pages of src (nbytes, a multiple of 16) that differ from shadow are
// copied to out[slot] (zero-padded past nbytes) with out_ids[slot] = page, and
// into shadow.  Slots are taken with an atomic counter, so their order is arbitrary.
__device__ void checkpoint_body(const uint4* __restrict__ src, uint4* __restrict__ shadow,
                                uint4* __restrict__ out, u32* __restrict__ out_ids, u64 nbytes,
                                u64 page_bytes, cx_scratch* sc, u64 warp, u64 nwarps, u32 lane) {
    const u64 vpp = page_bytes >> 4;
    const u64 nvec = nbytes >> 4;
    const u64 npages = (nbytes + page_bytes - 1) / page_bytes;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (u64 p = warp; p < npages; p += nwarps) {
        const u64 v0 = p * vpp;
        const u64 v1 = min(v0 + vpp, nvec);
        bool diff = false;
        for (u64 v = v0 + lane; v < v1; v += 32) diff |= differs(src[v], shadow[v]);
        if (!__any_sync(FULL, diff)) continue;
        u64 slot = 0;
        if (lane == 0) slot = atomicAdd(&sc->pages, 1ull);
        slot = __shfl_sync(FULL, slot, 0);
        uint4* o = out + slot * vpp;
        for (u64 v = v0 + lane; v < v0 + vpp; v += 32) {
            const uint4 a = v < v1 ? src[v] : zero;
            o[v - v0] = a;
            if (v < v1) shadow[v] = a;
        }
        if (lane == 0) out_ids[slot] = (u32)p;
    }
}

// APPEND_LOG: copy nbytes from src to dst (16-byte vectors when both are aligned).
__device__ void copy_body(u8* __restrict__ dst, const u8* __restrict__ src, u64 nbytes, u64 tid, u64 nthreads) {
    if ((((u64)dst | (u64)src) & 15) == 0) {
        const u64 nvec = nbytes >> 4;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (u64 v = tid; v < nvec; v += nthreads) d[v] = s[v];
        for (u64 b = (nvec << 4) + tid; b < nbytes; b += nthreads) dst[b] = src[b];
    } else {
        for (u64 b = tid; b < nbytes; b += nthreads) dst[b] = src[b];
    }
}

// SCATTER: page j of src goes to page ids[j] of dst (region_bytes, multiple of 16);
// ids out of range are counted in sc->errors and skipped.
__device__ void scatter_body(uint4* __restrict__ dst, const uint4* __restrict__ src, const u32* __restrict__ ids,
                             u64 count, u64 page_bytes, u64 region_bytes, cx_scratch* sc, u64 warp, u64 nwarps,
                             u32 lane) {
    const u64 vpp = page_bytes >> 4;
    const u64 nvec = region_bytes >> 4;
    for (u64 j = warp; j < count; j += nwarps) {
        const u64 p = ids[j];
        const u64 v0 = p * vpp;
        if (v0 >= nvec) {
            if (lane == 0) atomicAdd(&sc->errors, 1u);
            continue;
        }
        const u64 v1 = min(v0 + vpp, nvec);
        for (u64 v = v0 + lane; v < v1; v += 32) dst[v] = src[j * vpp + (v - v0)];
        if (lane == 0) atomicAdd(&sc->pages, 1ull);
    }
}

__device__ __forceinline__ void block_done(cx_scratch* sc) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&sc->done_blocks, 1u);
    }
}

// ---- handler kernels (child grids, or launched directly by the host) ---------

extern "C" __global__ void cx_checkpoint(const uint4* src, uint4* shadow, uint4* out, u32* out_ids, u64 nbytes,
                                         u64 page_bytes, cx_scratch* sc) {
    const u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    checkpoint_body(src, shadow, out, out_ids, nbytes, page_bytes, sc, t >> 5, (gridDim.x * (u64)blockDim.x) >> 5,
                    threadIdx.x & 31);
    block_done(sc);
}

extern "C" __global__ void cx_copy(u8* dst, const u8* src, u64 nbytes, cx_scratch* sc) {
    copy_body(dst, src, nbytes, blockIdx.x * (u64)blockDim.x + threadIdx.x, gridDim.x * (u64)blockDim.x);
    block_done(sc);
}

extern "C" __global__ void cx_scatter(uint4* dst, const uint4* src, const u32* ids, u64 count, u64 page_bytes,
                                      u64 region_bytes, cx_scratch* sc) {
    const u64 t = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    scatter_body(dst, src, ids, count, page_bytes, region_bytes, sc, t >> 5, (gridDim.x * (u64)blockDim.x) >> 5,
                 threadIdx.x & 31);
    block_done(sc);
}

#if defined(CX_RECOVER) && CX_CHILD
// ---- RECOVER: a recovery's pages, from the log mapping into device arrays -----
//
// The task's a[0] is a descriptor (device memory: concordia/executor/recover.py,
// RECOVER_DESC) of the pages a recovery plan reads, as runs: pages of one
// record whose log rows and page ids both follow on (restore/device.py's
// transfer layout).  Page k of the plan belongs to the last run whose first
// page is <= k.  One warp a page: the page's bytes go from the log (`log`,
// the device address of the registered mapping's byte 0; read over the bus
// once) to page `id` of its region's array (whole pages: the arrays hold
// every page padded), then the warp computes the page's CRC32C from what it
// wrote (device memory) and compares it with the stored one; bad[k] says
// whether it differed.  The arrays are a recovery's own, never the caller's
// targets: the host copies them there only once every page and digest
// checked out.  The completion counts the pages applied, the bytes read and
// (as lsn_first) the pages damaged.  A descriptor whose runs do not tile the
// pages from 0, or with a region not 16-byte aligned, is refused whole
// (recover_refused: BAD_ARGS, nothing launched); a page outside the log, its
// region or the CRC table, or read from an address not 16-byte aligned, is
// refused (BAD_ARGS once the task ends: the other pages are in the
// recovery's own arrays, never a target).
// Twin: concordia/executor/recover.py (apply_runs).
struct cx_recover_run {             // recover.RUN
    u64 first, off, id, crc, page_bytes, region;
};

struct cx_recover_desc {            // recover.RECOVER_DESC
    u64 log, log_bytes, runs, n_runs, pages, crc_table, n_crcs, regions, n_regions, bad;
};

// Whether a RECOVER descriptor's runs and regions are refused whole, before
// any launch (lane 0; O(runs + regions)): pages and no runs, runs present and
// no pages, runs whose first pages do not start at 0 and rise strictly below
// `pages`, or a region not 16-byte aligned.  (recover.out_of_bounds: the twin.)
__device__ bool recover_refused(const cx_recover_desc* d) {
    const cx_recover_run* runs = reinterpret_cast<const cx_recover_run*>(d->runs);
    const u64* regions = reinterpret_cast<const u64*>(d->regions);
    if (!d->n_runs) return d->pages != 0;
    if (runs[0].first != 0) return true;
    for (u64 i = 1; i < d->n_runs; ++i)
        if (runs[i].first <= runs[i - 1].first) return true;
    if (runs[d->n_runs - 1].first >= d->pages) return true;
    for (u64 r = 0; r < d->n_regions; ++r)
        if (regions[2 * r] & 15) return true;
    return false;
}

extern "C" __global__ void __launch_bounds__(256) cx_recover(const cx_recover_desc* d, cx_scratch* sc) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    crc_tables_build(T);
    const int lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    const cx_recover_run* runs = reinterpret_cast<const cx_recover_run*>(d->runs);
    const u64* regions = reinterpret_cast<const u64*>(d->regions);   // (base, bytes) a region
    const u32* stored = reinterpret_cast<const u32*>(d->crc_table);
    u8* bad = reinterpret_cast<u8*>(d->bad);
    const u64 n_runs = d->n_runs, pages = d->pages;
    PageCrcRt k;
    k.page_bytes = 0;
    u64 applied = 0, bytes = 0, damaged = 0;
    for (u64 p = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < pages; p += warps) {
        u64 lo = 0, hi = n_runs;   // the run of page p: the last whose first page is <= p
        while (hi - lo > 1) {
            const u64 mid = (lo + hi) >> 1;
            if (runs[mid].first <= p) lo = mid;
            else hi = mid;
        }
        const cx_recover_run r = runs[lo];
        // refused (counted, nothing of the page read or written): a page before its run, a page size not
        // a multiple of 16 below 2^31, no such region, a page past the log's end, its region's or the CRC
        // table's, or a source not 16-byte aligned (recover_refused saw to the rest); nothing here overflows
        const u64 pb64 = r.page_bytes;
        bool refused = p < r.first || pb64 == 0 || (pb64 & 15) || pb64 >= (1ull << 31) || r.region >= d->n_regions;
        const u64 j = p - r.first;
        if (!refused) {
            const u64 fit = regions[2 * r.region + 1] / pb64;   // whole pages the region holds
            refused = r.off > d->log_bytes || j >= (d->log_bytes - r.off) / pb64 || r.id >= fit ||
                      j >= fit - r.id || ((d->log + r.off) & 15) || r.crc >= d->n_crcs || j >= d->n_crcs - r.crc;
        }
        if (refused) {
            if (lane == 0) atomicAdd(&sc->errors, 1u);
            continue;
        }
        const u32 pb = (u32)pb64, chunks = pb / 16;
        if (pb != k.page_bytes) k = page_crc_setup_rt(pb, lane);
        const uint4* src = reinterpret_cast<const uint4*>(d->log + r.off + j * pb);
        u8* page = reinterpret_cast<u8*>(regions[2 * r.region]) + (r.id + j) * pb;
        uint4* out = reinterpret_cast<uint4*>(page);
        for (u32 c = lane; c < chunks; c += WARP) out[c] = __ldcs(src + c);
        __syncwarp();   // the page written, by every lane, before the lanes read their slices of it
        const u32 step = crc_step_of(pb);
        u32 a = (u32)lane * step, b = a + step;
        if (a > pb) a = pb;
        if (b > pb) b = pb;
        u32 raw = 0;
        for (u32 off = a; off < b; off += 16)
            raw = crc_chunk(T, raw, __ldcg(reinterpret_cast<const uint4*>(page + off)));
        raw = gf2_multmodp(k.lane_shift, raw);
        const u32 crc = warp_xor(raw) ^ k.finish;
        const bool ok = crc == stored[r.crc + j];
        if (lane == 0) bad[p] = (u8)!ok;
        applied += ok;
        damaged += !ok;
        bytes += pb;
    }
    if (lane == 0) {
        if (applied) atomicAdd(&sc->pages, applied);
        if (bytes) atomicAdd(&sc->bytes, bytes);
        if (damaged) atomicAdd(&sc->reserved[0], damaged);
    }
    block_done(sc);
}
#endif

// ---- the control warp -------------------------------------------------------

#if CX_CHILD
// A fire-and-forget child runs beside its still-running parent; where the
// toolchain does not name that stream, the block's implicit stream is used.
#if defined(cudaStreamFireAndForget)
#define CX_CHILD_STREAM cudaStreamFireAndForget
#else
#define CX_CHILD_STREAM 0
#endif

// Whether the device-side launch was accepted.  CX_NO_LAUNCH_STATUS drops the
// check for toolchains that do not declare the device runtime's cudaGetLastError;
// a launch that failed then shows as a child timeout.
#if defined(CX_NO_LAUNCH_STATUS)
#define CX_LAUNCHED() true
#else
#define CX_LAUNCHED() (cudaGetLastError() == cudaSuccess)
#endif

// Lane 0 only: wait (bounded) until `blocks` child blocks have finished.
__device__ int wait_children(cx_scratch* sc, u32 blocks, u64 timeout_ns) {
    const u64 t0 = now_ns();
    u32 nap = 0;
    while (*(volatile u32*)&sc->done_blocks < blocks) {
        if (now_ns() - t0 > timeout_ns) return ST_TIMEOUT;
        nap = nap ? min(nap * 2, 1024u) : 32u;
        __nanosleep(nap);
    }
    __threadfence();
    return ST_OK;
}

__device__ __forceinline__ u32 child_grid(u64 warps_needed, u32 n_sm) {
    const u64 per_block = CHILD_THREADS / 32;
    u64 g = (warps_needed + per_block - 1) / per_block;
    const u64 cap = (u64)n_sm * 8;
    if (g > cap) g = cap;
    return g ? (u32)g : 1u;
}
#endif

__device__ __forceinline__ void reset_scratch(cx_scratch* sc) {
    sc->pages = 0;
    sc->bytes = 0;
    sc->done_blocks = 0;
    sc->errors = 0;
    sc->claim = 0;
    __threadfence();
}

#if defined(CX_EPOCH) && CX_CHILD
// ---- EPOCH: a session's epoch into an arena (concordia/checkpoint/arena.py) ------
//
// The task's a[0] is a descriptor (device memory, written by the host once per
// arena: concordia/executor/device_epoch.py) of the session's region table,
// the table pass's buffers, the arena (a reserved extent of the log, mapped)
// and the arena's words (mapped host memory: the host reads them).  Lane 0
// checks the room (the most one epoch writes, and its commit) and launches
// the epoch as a fire-and-forget child.  A table of at most d->small_pages
// pages runs as one block (cx_epoch_small: table.cu's device functions
// between barriers).  A larger one runs as one driver thread, which launches
// the pass on its own block's stream, where launches run in the order made:
// one detection grid per group of rows, the plan, staging (into the
// snapshot where the epoch fits it: via_snapshot), the claim of the commit
// (which lets a trigger's gate go), a snapshot's copy into the arena,
// finalizing, the commit (table.cu's table_commit), then `cx_epoch_close`.  Either ends by
// moving the words on and bumping the scratch counter lane 0 waits for
// (`epoch_close`).  No host step: the epoch is
// durable when the commit's header is stored (tiers whose writes need no
// persist call), and the host takes it on at its next call (`Arena.adopt`).
#define CX_MAX_GROUPS 8

struct cx_group {                   // one detection launch: rows sharing a detector (table.py's DET_*) and page size
    u64 rows, row_first, n_rows, pages, detector, page_bytes;
};

// table.py's detector codes of the groups (DET_POSITIONS: table.cu)
#define DET_SHADOW 1
#define DET_FINGERPRINT 2

// The page sizes this module's shadow and fingerprint detection is built for
// (device_epoch.compile_defines: PAGE_BYTES, then CX_PAGE_BYTES_1..3 for a
// table of several), one instance of table.cu's detectors each.  A
// descriptor with a group of another size, or more groups than it holds, is
// refused before anything is launched (epoch_refused: BAD_ARGS, nothing
// detected or written, every detector's state as it was); the host builds the
// module for its table's sizes, so none comes.
#ifdef CX_PAGE_BYTES_1
#define CX_SIZE_1(X) X(CX_PAGE_BYTES_1)
#else
#define CX_SIZE_1(X)
#endif
#ifdef CX_PAGE_BYTES_2
#define CX_SIZE_2(X) X(CX_PAGE_BYTES_2)
#else
#define CX_SIZE_2(X)
#endif
#ifdef CX_PAGE_BYTES_3
#define CX_SIZE_3(X) X(CX_PAGE_BYTES_3)
#else
#define CX_SIZE_3(X)
#endif
// X(size) for each page size the module's detection is built for
#define CX_EACH_SIZE(X) X(PAGE_BYTES) CX_SIZE_1(X) CX_SIZE_2(X) CX_SIZE_3(X)

__device__ __forceinline__ bool cx_size_built(u64 pb) {
#define CX_BUILT(PB) if (pb == (PB)) return true;
    CX_EACH_SIZE(CX_BUILT)
#undef CX_BUILT
    return false;
}

// A shadow or fingerprint group's detection as a child grid of the driver
// (its size one the module is built for: epoch_refused saw to it).
template <u32 PB>
__device__ __forceinline__ void cx_detect_launch(const cx_group& k, const TableEntry* table, u8* flags) {
    const u32 blocks = (u32)min((k.pages + 7) / 8, (u64)65535);
    const u32* rows = reinterpret_cast<const u32*>(k.rows);
    const u64* first = reinterpret_cast<const u64*>(k.row_first);
    if (k.detector == DET_FINGERPRINT) table_fingerprint_pb<PB><<<blocks, 256>>>(table, rows, first, (u32)k.n_rows, flags);
    else table_shadow_pb<PB><<<blocks, 256>>>(table, rows, first, (u32)k.n_rows, flags);
}

__device__ __forceinline__ void cx_detect_group(const cx_group& k, const TableEntry* table, u8* flags) {
#define CX_LAUNCH(PB) if (k.page_bytes == (PB)) { cx_detect_launch<PB>(k, table, flags); return; }
    CX_EACH_SIZE(CX_LAUNCH)
#undef CX_LAUNCH
}

// ... and by warps [w0, w0 + warps) of one block (cx_epoch_small).
template <u32 PB>
__device__ __forceinline__ void cx_detect_block(const cx_group& k, const TableEntry* table, u8* flags, u64 w0,
                                                u64 warps) {
    const u32* rows = reinterpret_cast<const u32*>(k.rows);
    const u64* first = reinterpret_cast<const u64*>(k.row_first);
    if (k.detector == DET_FINGERPRINT) fingerprint_rows_pb<PB>(table, rows, first, (u32)k.n_rows, flags, w0, warps);
    else shadow_rows_pb<PB>(table, rows, first, (u32)k.n_rows, flags, w0, warps);
}

__device__ __forceinline__ void cx_detect_group_block(const cx_group& k, const TableEntry* table, u8* flags, u64 w0,
                                                      u64 warps) {
#define CX_RUN(PB) if (k.page_bytes == (PB)) { cx_detect_block<PB>(k, table, flags, w0, warps); return; }
    CX_EACH_SIZE(CX_RUN)
#undef CX_RUN
}

struct cx_epoch_desc {              // device_epoch.EPOCH_DESC
    u64 table, n_rows, flags, total_pages, ids, recs, max_records, plan, digests, order;
    u64 mail_plan, mail_counts, mail_offsets;
    u64 arena, arena_lsn, arena_bytes, salt, bound, commit_length, words;
    u64 stage_blocks, finalize_blocks, n_groups;
    u64 fired, fired_cap;           // a trigger's log in mapped host memory (trigger_poll), and its room in pairs
    u64 stamps;                     // 0, or CX_STAMPS times (ns) of the epoch's phases in mapped host memory
    u64 small_pages;                // a table of at most this many pages runs as one block (cx_epoch_small)
    u64 snap, snap_bytes;           // 0, or device memory an epoch of at most snap_bytes record bytes is staged in
    u64 snapped;                    // 0, or a mapped host u64: the epochs staged through the snapshot
    cx_group groups[CX_MAX_GROUPS];
};

struct cx_arena_words {             // checkpoint/arena.py: WORDS
    u64 used, last_commit, last_epoch, epochs, missed, lost, expect, adapt;
};

// The phase stamps (device_epoch.STAMPS), when a descriptor asks for them:
// the global timer as lane 0 launches the driver, as the driver starts, after
// detection, the plan, staging, finalizing and the commit (each a one-thread
// kernel in the stream: it adds its own launch), as the close runs, and as
// lane 0 has waited.  What an epoch's latency is made of, for the bench.
#define CX_STAMPS 9

extern "C" __global__ void cx_stamp(u64* at) {
    *(volatile u64*)at = now_ns();
}

// An epoch's commit is claimed by its child once every region was read and
// staged (before the commit record), or cancelled by the control warp when the
// child outran its timeout: whichever comes first.  A cancelled epoch commits
// nothing (its plan no longer fits: epoch_close says lost), so letting the
// producer's gate go at a timeout never lets a commit hold pages read after it;
// a claimed one has read everything and only its commit is left.
#define CX_CLAIM_COMMIT 1ull
#define CX_CLAIM_CANCEL 2ull
#ifndef CX_CLAIMED_WAIT_NS
#define CX_CLAIMED_WAIT_NS (10ull * 1000 * 1000 * 1000)
#endif

// One thread: the commit claimed, or the plan made not to fit (cancelled);
// once claimed, claiming again changes nothing.
__device__ __forceinline__ void claim_commit(TablePlan* plan, cx_scratch* sc) {
    __threadfence();  // the epoch's reads of the regions before the claim other grids act on
    const u64 was = atomicCAS(reinterpret_cast<unsigned long long*>(&sc->claim), 0ull, CX_CLAIM_COMMIT);
    if (was != 0ull && was != CX_CLAIM_COMMIT) {
        plan->fits = 0;
        __threadfence();
    }
}

// The snapshot (d->snap): an epoch whose records fit it is staged there, in
// device memory, at HBM speed; its commit is claimed then (every region is
// read), so a trigger's gate goes (run_epoch) before the records cross the
// bus into the arena; they are copied there, their headers written and the
// commit stored while the producer's next step runs.  The arena's bytes are
// the same either way.  A larger epoch, or a descriptor with none, is staged
// straight into the arena and claims its commit once its headers are written,
// as before the snapshot: the gate holds the step until then.
__device__ __forceinline__ bool via_snapshot(const cx_epoch_desc* d, const TablePlan* plan) {
    return d->snap != 0 && plan->fits && plan->bytes <= d->snap_bytes;
}

// The warps [w0, w0 + warps) of the launch, once staging has ended: in a
// snapshot, each record's header slot zeroed (a reader of the arena finds
// none until finalize writes it).
__device__ __forceinline__ void snapshot_headers(const cx_epoch_desc* d, const TableRecord* recs,
                                                 const TablePlan* plan, u64 w0, u64 warps) {
    const int lane = threadIdx.x & 31;
    u8* snap = reinterpret_cast<u8*>(d->snap);
    for (u64 i = w0; i < plan->records; i += warps)
        if (lane < RECORD_HEADER_BYTES / 4) reinterpret_cast<u32*>(snap + recs[i].offset)[lane] = 0u;
}

// One thread, once the commit is claimed: an epoch staged in the snapshot counted in d->snapped.
__device__ __forceinline__ void snapshot_count(const cx_epoch_desc* d, const TablePlan* plan) {
    if (d->snapped && via_snapshot(d, plan)) atomicAdd(reinterpret_cast<unsigned long long*>(d->snapped), 1ull);
}

// Threads [t0, t0 + threads) of the launch: the snapshot's records into the
// arena at `dst` (16-byte words, as staging writes them; a tail byte by
// byte), fenced at system scope before the headers are written.
__device__ __forceinline__ void snapshot_copy(const cx_epoch_desc* d, const TablePlan* plan, u8* dst, u64 t0,
                                              u64 threads) {
    const u8* snap = reinterpret_cast<const u8*>(d->snap);
    const uint4* src = reinterpret_cast<const uint4*>(snap);
    const u64 words = plan->bytes / 16;
    for (u64 i = t0; i < words; i += threads) reinterpret_cast<uint4*>(dst)[i] = src[i];
    for (u64 i = 16 * words + t0; i < plan->bytes; i += threads) dst[i] = snap[i];
    __threadfence_system();
}

// One thread, after the commit: the arena's words moved on (the host reads
// them), the pages and bytes for the completion, then the counter lane 0 waits on.
// `room`: the record bytes the whole arena holds beside a commit, the most the next epoch is tried with.
__device__ void epoch_close(const TablePlan* plan, cx_arena_words* w, u64 at, u64 lsn, u64 epoch, u64 commit_length,
                            u64 bound, u64 room, cx_scratch* sc, u64* stamps) {
    if (stamps) *(volatile u64*)&stamps[7] = now_ns();
    const TablePlan p = *plan;
    if (p.fits) {
        w->used = at + p.bytes + commit_length;
        if (w->adapt) w->expect = max(min(2 * p.bytes, room), bound);  // the next epoch: twice this one, at most room
        w->last_commit = lsn + p.bytes;
        w->last_epoch = epoch;
        w->epochs = w->epochs + 1;
        sc->pages = p.pages;
        sc->bytes = p.bytes;
    } else {  // lost: the detectors moved on, nothing written; the host writes every region whole next
        w->lost = epoch;
        sc->errors = 1;
    }
    __threadfence_system();
    atomicAdd(&sc->done_blocks, 1u);
}

extern "C" __global__ void cx_epoch_close(const TablePlan* plan, cx_arena_words* w, u64 at, u64 lsn, u64 epoch,
                                          u64 commit_length, u64 bound, u64 room, cx_scratch* sc, u64* stamps) {
    epoch_close(plan, w, at, lsn, epoch, commit_length, bound, room, sc, stamps);
}

// One epoch's view of its descriptor, its records written at arena offset `at`.
struct cx_epoch_at {
    const TableEntry* table;
    u8* flags;
    u32* ids;
    TableRecord* recs;
    TablePlan* plan;
    u32* digests;
    u8* dst;
    u64 lsn, room;
    u32 salt, n;
};

__device__ __forceinline__ cx_epoch_at epoch_at(const cx_epoch_desc* d, u64 at) {
    cx_epoch_at e;
    e.table = reinterpret_cast<const TableEntry*>(d->table);
    e.flags = reinterpret_cast<u8*>(d->flags);
    e.ids = reinterpret_cast<u32*>(d->ids);
    e.recs = reinterpret_cast<TableRecord*>(d->recs);
    e.plan = reinterpret_cast<TablePlan*>(d->plan);
    e.digests = reinterpret_cast<u32*>(d->digests);
    e.dst = reinterpret_cast<u8*>(d->arena) + at;
    e.lsn = d->arena_lsn + at;
    e.room = d->arena_bytes - at;
    e.salt = (u32)d->salt;
    e.n = (u32)d->n_rows;
    return e;
}

// The driver's staging: table_stage's work, into the snapshot where the epoch fits it (via_snapshot).
extern "C" __global__ void __launch_bounds__(256) cx_epoch_stage(const cx_epoch_desc* d, u64 at) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    const cx_epoch_at e = epoch_at(d, at);
    if (!e.plan->fits) return;
    const u64 first_warp = ((u64)blockIdx.x * blockDim.x) >> 5;
    if (first_warp >= e.plan->pages) return;  // the whole block: before any barrier
    crc_tables_build(T);
    u8* dst = via_snapshot(d, e.plan) ? reinterpret_cast<u8*>(d->snap) : e.dst;
    stage_pages(T, e.table, e.ids, e.recs, e.plan, dst, e.digests, grid_warp(), grid_warps());
}

// One block, once staging has ended (every region read): an epoch staged in
// the snapshot has its headers there zeroed, then claims its commit (which
// lets a trigger's gate go: run_epoch).
extern "C" __global__ void __launch_bounds__(256) cx_epoch_read(const cx_epoch_desc* d, u64 at, cx_scratch* sc) {
    const cx_epoch_at e = epoch_at(d, at);
    if (!via_snapshot(d, e.plan)) return;  // the whole block: before the barrier
    snapshot_headers(d, e.recs, e.plan, threadIdx.x >> 5, blockDim.x >> 5);
    __syncthreads();
    if (threadIdx.x == 0) {
        claim_commit(e.plan, sc);
        snapshot_count(d, e.plan);
    }
}

// One thread, before the commit: the commit claimed (changes nothing once a snapshot's epoch claimed it).
extern "C" __global__ void cx_epoch_claim(TablePlan* plan, cx_scratch* sc) {
    claim_commit(plan, sc);
}

// The driver's copy of a snapshot into the arena (nothing for an epoch staged there).
extern "C" __global__ void __launch_bounds__(256) cx_epoch_copy(const cx_epoch_desc* d, u64 at) {
    const cx_epoch_at e = epoch_at(d, at);
    if (!via_snapshot(d, e.plan)) return;
    snapshot_copy(d, e.plan, e.dst, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x);
}

// One thread: the pass's launches, in order, on this block's stream.
extern "C" __global__ void cx_epoch_driver(const cx_epoch_desc* d, u64 at, u64 epoch, u64 prev_commit,
                                           cx_scratch* sc) {
    const cx_epoch_at e = epoch_at(d, at);
    u64* st = reinterpret_cast<u64*>(d->stamps);
    if (st) *(volatile u64*)&st[1] = now_ns();
    for (u64 g = 0; g < d->n_groups && g < CX_MAX_GROUPS; ++g) {
        const cx_group& k = d->groups[g];
        if (k.detector == DET_POSITIONS)  // a warp a row: its words and its new pages' count, no page read
            table_positions<<<(u32)min((k.n_rows + 7) / 8, (u64)65535), 256>>>(
                e.table, reinterpret_cast<const u32*>(k.rows), (u32)k.n_rows);
        else
            cx_detect_group(k, e.table, e.flags);
    }
    if (st) cx_stamp<<<1, 1>>>(st + 2);
    table_plan<<<1, 1024>>>(e.table, e.n, e.flags, e.ids, e.recs, d->max_records,
                            e.room - d->commit_length, e.plan, reinterpret_cast<TablePlan*>(d->mail_plan),
                            reinterpret_cast<u32*>(d->mail_counts), reinterpret_cast<u64*>(d->mail_offsets));
    if (st) cx_stamp<<<1, 1>>>(st + 3);
    cx_epoch_stage<<<(u32)d->stage_blocks, 256>>>(d, at);
    if (st) cx_stamp<<<1, 1>>>(st + 4);
    cx_epoch_read<<<1, 256>>>(d, at, sc);
    cx_epoch_copy<<<(u32)d->stage_blocks, 256>>>(d, at);
    table_finalize<<<(u32)d->finalize_blocks, 256>>>(e.table, e.ids, e.recs, e.plan, e.dst, e.lsn, epoch, e.salt);
    if (st) cx_stamp<<<1, 1>>>(st + 5);
    cx_epoch_claim<<<1, 1>>>(e.plan, sc);  // an epoch staged straight into the arena (a snapshot's: claimed)
    table_commit<<<1, 32>>>(e.table, reinterpret_cast<const u32*>(d->order), e.n, e.digests, e.plan, e.dst, e.room,
                            e.lsn, epoch, e.salt, prev_commit);
    if (st) cx_stamp<<<1, 1>>>(st + 6);
    cx_epoch_close<<<1, 1>>>(e.plan, reinterpret_cast<cx_arena_words*>(d->words), at, e.lsn, epoch, d->commit_length,
                             d->bound, d->arena_bytes - d->commit_length, sc, st);
}

// One block of CX_SMALL_THREADS: the whole epoch of a small table (at most
// d->small_pages pages), the same device functions as the driver's launches
// (table.cu) between the block's barriers, in one launch instead of seven.
// Every thread fences its records at system scope before the barrier that
// lets the commit's warp write, and the commit's header is fenced before the
// words move on, as the end of a kernel orders them for the driver.  Half an
// SM's registers at most (two blocks fit one), so that the launch finds room
// beside the caller's kernels.
#define CX_SMALL_THREADS 512

extern "C" __global__ void __launch_bounds__(CX_SMALL_THREADS, 2)
    cx_epoch_small(const cx_epoch_desc* d, u64 at, u64 epoch, u64 prev_commit, cx_scratch* sc) {
    __shared__ u32 T[CRC_TABLE_WORDS];
    __shared__ u64 sums[32];
    const cx_epoch_at e = epoch_at(d, at);
    volatile u64* st = reinterpret_cast<volatile u64*>(d->stamps);
    const bool stamper = st != nullptr && threadIdx.x == 0;
    const u64 w0 = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (stamper) st[1] = now_ns();
    crc_tables_build(T);
    for (u64 g = 0; g < d->n_groups && g < CX_MAX_GROUPS; ++g) {
        const cx_group& k = d->groups[g];
        if (k.detector == DET_POSITIONS)  // a warp a row
            positions_rows(e.table, reinterpret_cast<const u32*>(k.rows), (u32)k.n_rows, w0, warps);
        else
            cx_detect_group_block(k, e.table, e.flags, w0, warps);
    }
    __syncthreads();
    if (stamper) st[2] = now_ns();
    plan_block(e.table, e.n, e.flags, e.ids, e.recs, d->max_records, e.room - d->commit_length,
               e.plan, reinterpret_cast<TablePlan*>(d->mail_plan), reinterpret_cast<u32*>(d->mail_counts),
               reinterpret_cast<u64*>(d->mail_offsets), sums);
    __syncthreads();
    if (stamper) st[3] = now_ns();
    const bool snapped = via_snapshot(d, e.plan);
    if (e.plan->fits)
        stage_pages(T, e.table, e.ids, e.recs, e.plan, snapped ? reinterpret_cast<u8*>(d->snap) : e.dst, e.digests,
                    w0, warps);
    __syncthreads();
    if (stamper) st[4] = now_ns();
    if (snapped) {  // every region read: the commit claimed, a trigger's gate may go (run_epoch)
        snapshot_headers(d, e.recs, e.plan, w0, warps);
        __syncthreads();
        if (threadIdx.x == 0) {
            claim_commit(e.plan, sc);
            snapshot_count(d, e.plan);
        }
        __syncthreads();
        if (e.plan->fits) snapshot_copy(d, e.plan, e.dst, threadIdx.x, blockDim.x);  // fits: 0 once cancelled
        __syncthreads();
    }
    if (e.plan->fits) finalize_records(T, e.table, e.ids, e.recs, e.plan, e.dst, e.lsn, epoch, e.salt, w0, warps);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) claim_commit(e.plan, sc);  // staged straight into the arena (a snapshot's: claimed)
    __syncthreads();
    if (stamper) st[5] = now_ns();
    if (threadIdx.x < 32)
        commit_warp(T, e.table, reinterpret_cast<const u32*>(d->order), e.n, e.digests, e.plan, e.dst, e.room, e.lsn,
                    epoch, e.salt, prev_commit);
    __syncthreads();
    if (stamper) st[6] = now_ns();
    if (threadIdx.x == 0) {
        __threadfence_system();  // the commit's header (this thread's, as lane 0 of the commit's warp) first
        epoch_close(e.plan, reinterpret_cast<cx_arena_words*>(d->words), at, e.lsn, epoch, d->commit_length, d->bound,
                    d->arena_bytes - d->commit_length, sc, const_cast<u64*>(st));
    }
}

// Lane 0: wait_children for an epoch's child, which also lets a trigger's
// gate go (gate[1] = 0; `gate` nullptr: none) once the child claims its
// commit: every region is read then, and what is left of the epoch (a
// snapshot's copy into the arena, the headers, the commit) runs beside the
// producer's next step.  *released: whether it let the gate go.
__device__ int wait_epoch(cx_scratch* sc, u64 timeout_ns, u32* gate, bool* released) {
    const u64 t0 = now_ns();
    u32 nap = 0;
    while (*(volatile u32*)&sc->done_blocks < 1) {
        if (gate != nullptr && !*released && *(volatile u64*)&sc->claim == CX_CLAIM_COMMIT) {
            __threadfence_system();
            atomicExch(&gate[1], 0u);
            __threadfence_system();
            *released = true;
        }
        if (now_ns() - t0 > timeout_ns) return ST_TIMEOUT;
        nap = nap ? min(nap * 2, 1024u) : 32u;
        __nanosleep(nap);
    }
    __threadfence();
    return ST_OK;
}

// Whether the descriptor asks what this module cannot run: more detection
// groups than it holds, or a shadow or fingerprint group of a page size its
// detection is not built for (cx_size_built).  Refused before anything is launched.
__device__ bool epoch_refused(const cx_epoch_desc* d) {
    if (d->n_groups > CX_MAX_GROUPS) return true;
    for (u64 g = 0; g < d->n_groups; ++g)
        if (d->groups[g].detector != DET_POSITIONS && !cx_size_built(d->groups[g].page_bytes)) return true;
    return false;
}

// Lane 0 only: one epoch of the descriptor `d` into its arena, waited for;
// a trigger's gate (`gate`, else nullptr) let go once every region is read
// (wait_epoch; *released says so).  *lsn0 / *lsn1: where the epoch's records
// begin and its commit lies.
__device__ int run_epoch(const cx_epoch_desc* d, cx_scratch* sc, u64 child_timeout_ns, u64* lsn0, u64* lsn1,
                         u32* gate, bool* released) {
    if (epoch_refused(d)) return ST_BAD_ARGS;  // nothing detected, nothing written
    volatile cx_arena_words* w = reinterpret_cast<volatile cx_arena_words*>(d->words);
    const u64 at = w->used;
    if (w->lost || d->arena_bytes < at || d->arena_bytes - at < w->expect + d->commit_length) {
        w->missed = w->missed + 1;
        __threadfence_system();
        return ST_NO_ROOM;
    }
    const u64 epoch = w->last_epoch + 1, prev = w->last_commit;
    volatile u64* st = reinterpret_cast<volatile u64*>(d->stamps);
    reset_scratch(sc);
    if (st) st[0] = now_ns();
    if (d->total_pages <= d->small_pages)
        cx_epoch_small<<<1, CX_SMALL_THREADS, 0, CX_CHILD_STREAM>>>(d, at, epoch, prev, sc);
    else
        cx_epoch_driver<<<1, 1, 0, CX_CHILD_STREAM>>>(d, at, epoch, prev, sc);
    if (!CX_LAUNCHED()) return ST_LAUNCH_FAILED;
    int status = wait_epoch(sc, child_timeout_ns, gate, released);
    // timed out: cancelled before its commit, the child commits nothing; past its claim it read
    // every region and only its commit is left, waited for once more, at least CX_CLAIMED_WAIT_NS
    // (a TIMEOUT must mean that nothing of the epoch is committed)
    if (status == ST_TIMEOUT &&
        atomicCAS(reinterpret_cast<unsigned long long*>(&sc->claim), 0ull, CX_CLAIM_CANCEL) == CX_CLAIM_COMMIT)
        status = wait_epoch(sc, max(child_timeout_ns, CX_CLAIMED_WAIT_NS), gate, released);
    if (st) st[8] = now_ns();
    if (status != ST_OK) return status;
    if (*(volatile u32*)&sc->errors) return ST_LOST;  // the records did not fit what was left (arena.py)
    *lsn0 = d->arena_lsn + at;
    *lsn1 = w->last_commit;
    return ST_OK;
}

// ---- the device trigger: every N steps counted on the device -------------------
//
// The producer queues `cx_step_gate` on its stream after each decode step: it
// counts the step (in stream order: when the step has run) and, at each
// multiple of the armed trigger's N (gate[2] = N, 0: none armed), holds there
// (gate[1] = 1) and waits, bounded, until the executor lets go, so that the
// epoch holds the state between that step and the next; it adds the hold to
// gate[3] (steps) and gate[4..5] (ns, a u64: the gate is 8-byte aligned), and
// a step that gave up waiting (no epoch) to gate[0]; gate[6..7] (a u64) is the
// count of the step that holds (what the log says the epoch holds).  An EPOCH task with
// a[1] = N > 0 arms the trigger (a[2] the counter, a[3] the gate, u32[4]):
// while idle, the control warp runs the epoch once the producer holds, logs
// (epoch, count) in the descriptor's `fired`, and lets go; no host thread
// takes part.  The executor stays resident while an armed trigger's steps
// come (trigger_keeps).  a[4]: a host-mapped u64, the steps the host has
// queued (0: none kept), a[5]: counts up to which a held step is let go with
// no epoch (the host took that step's epoch itself).  An EPOCH task with
// a[1] != 0 and a[0] = 0 disarms it (the host's arena swap); disarming,
// arming again and leaving let go of any step held.
extern "C" __global__ void cx_step_gate(u64* counter, u32* gate, u64 timeout_ns) {
    // atomic: the producer's current stream may change between steps, and two gates on
    // unordered streams must not lose a count (the host's `due` is counted the same way)
    const u64 count = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull) + 1;
    __threadfence_system();
    const u32 every = *(volatile u32*)&gate[2];
    if (every == 0 || count % every) return;
    // gate[1]: 0 none, 1 held (this step), 2 taken (the control warp runs its epoch)
    const u64 t0 = now_ns();
    *(volatile u64*)(gate + 6) = count;  // the held step's count, before it is seen holding
    __threadfence_system();
    atomicExch(&gate[1], 1u);
    __threadfence_system();
    u32 nap = 32;
    for (;;) {
        const u32 g = *(volatile u32*)&gate[1];
        if (g == 0) break;                                // let go after its epoch (or released)
        // the trigger went before taking it; a control warp armed again may take it meanwhile (then 2: wait)
        if (*(volatile u32*)&gate[2] == 0 && g == 1 && atomicCAS(&gate[1], 1u, 0u) == 1u) break;
        // not taken in time: go on without an epoch (counted in gate[0]); once taken, wait for it to end
        if (now_ns() - t0 > timeout_ns && atomicCAS(&gate[1], 1u, 0u) == 1u) {
            atomicAdd(&gate[0], 1u);
            break;
        }
        __nanosleep(nap);
        nap = min(nap * 2, 4096u);
    }
    __threadfence_system();
    // what holding cost the producer: gate[3] the steps held, gate[4..5] their ns (u64)
    atomicAdd(&gate[3], 1u);
    atomicAdd(reinterpret_cast<unsigned long long*>(gate + 4), (unsigned long long)(now_ns() - t0));
}

#ifndef CX_ARMED_IDLE_NS
#define CX_ARMED_IDLE_NS (50ull * 1000 * 1000)
#endif
#ifndef CX_QUEUED_WAIT_NS
#define CX_QUEUED_WAIT_NS (10ull * 1000 * 1000 * 1000)
#endif
struct cx_trigger {  // lane 0's, in registers: what an EPOCH task with a[1] > 0 armed
    const cx_epoch_desc* d;
    u64 every;
    u64* counter;
    u32* gate;
    const u64* queued;  // host-mapped: the steps the host queued (nullptr: not kept)
    u64 seen;           // the counter when last read
    u64 skip;           // held steps up to this count are let go with no epoch
};

// Lane 0: steps the host queued that have not run (the counter `c` behind `queued`).  They
// count for as long as a held step waits for its epoch (the gate's timeout) since a step last
// ran, not for good: a count the host left behind lets a synchronize return after that.
__device__ __forceinline__ bool steps_coming(const cx_trigger* t, u64 c, u64 t_idle) {
    return t->queued != nullptr && *(volatile const u64*)t->queued > c && now_ns() - t_idle <= CX_QUEUED_WAIT_NS;
}

// Lane 0: whether an armed trigger keeps the executor resident.  It does while
// steps come: a step run on the device (the counter moved) or a task within
// CX_ARMED_IDLE_NS, or a step the host queued that has not run yet (its gate
// may be due: leaving first would let it pass with no epoch, however long the
// producer's stream takes to reach it).  Once the producer's stream drains
// (a device-wide synchronize waits for it) the executor leaves
// CX_ARMED_IDLE_NS later; its log says so and the host's next step arms it again.
__device__ __forceinline__ bool trigger_keeps(cx_trigger* t, u64* t_idle) {
    if (t->d == nullptr) return false;
    const u64 c = *(volatile u64*)t->counter;
    if (c != t->seen) {
        t->seen = c;
        *t_idle = now_ns();
    }
    if (steps_coming(t, c, *t_idle)) return true;
    return now_ns() - *t_idle <= CX_ARMED_IDLE_NS;
}

// what a trigger's log says in [1] when the executor left with it armed (its lifetime, a fault):
// not a ring status; the host arms it again (step_trigger.TRIGGER_LEFT)
#define CX_TRIGGER_LEFT 0x100

// Lane 0, as the trigger goes (disarmed, armed again, the executor leaving):
// no step holds for it from here on, and one held now is let go.
__device__ __forceinline__ void trigger_release(cx_trigger* t) {
    if (t->gate == nullptr) return;
    *(volatile u32*)&t->gate[2] = 0;
    __threadfence_system();
    atomicExch(&t->gate[1], 0u);
    __threadfence_system();
}

// Lane 0, as the executor leaves: an armed trigger says so in its log, so that
// the host, which believes it armed, arms it again (the next task relaunches);
// `why`: CX_TRIGGER_LEFT, or the status of a fault the executor leaves with
// (the host then fails the route rather than arming it again).
__device__ __forceinline__ void trigger_leave(cx_trigger* t, u64 why) {
    if (t->d != nullptr) {
        reinterpret_cast<volatile u64*>(t->d->fired)[1] = why;
        t->d = nullptr;
    }
    trigger_release(t);
}

// Lane 0, about to leave idle with a trigger armed: the handshake with the
// host's step (Dekker's, as the ring's step 5).  The log says TRIGGER_LEFT
// first, then the queued steps and a held step are read again.  The host's
// `step()` writes its step to `queued` before it reads the log, and queues
// the step's gate after: either this sees the step coming (the log goes back
// to 0, the executor stays and takes it), or the host sees TRIGGER_LEFT and
// arms the trigger again before it queues the gate.  The gate is released
// only once the executor leaves (trigger_leave): a gate queued before was
// counted in `queued` and seen here (steps_coming: a count no step catches
// up with does not keep the executor).
__device__ bool trigger_stays(cx_trigger* t, u64 t_idle) {
    if (t->d == nullptr) return false;
    volatile u64* fired = reinterpret_cast<volatile u64*>(t->d->fired);
    fired[1] = CX_TRIGGER_LEFT;
    __threadfence_system();  // the log's store before the loads (handshake)
    const u64 c = *(volatile u64*)t->counter;
    // a step that ran since the last poll may not have raised its gate yet (cx_step_gate counts first)
    if (c == t->seen && !steps_coming(t, c, t_idle) && *(volatile u32*)&t->gate[1] != 1u) return false;
    fired[1] = 0;
    __threadfence_system();
    return true;
}

// Lane 0, between polls of the ring: one step of the armed trigger.  Returns
// 1 when it let a held step go (the caller counts it as work, not idleness), 2 when
// the epoch timed out (its child may still run: the executor leaves faulted),
// else 0.
__device__ int trigger_poll(cx_trigger* t, cx_scratch* sc, u64 child_timeout_ns) {
    if (t->d == nullptr) return 0;
    if (atomicCAS(&t->gate[1], 1u, 2u) != 1u) return 0;  // no step holds at a multiple (or it gave up)
    __threadfence_system();
    const u64 count = *(volatile u64*)(t->gate + 6);  // the held step's (the counter may have moved on)
    if (count <= t->skip) {  // the host took this step's epoch itself: let go, none more
        atomicExch(&t->gate[1], 0u);
        __threadfence_system();
        return 1;
    }
    u64 l0 = 0, l1 = 0;
    bool released = false;  // the gate went once the epoch had read every region: a later step may hold now
    const int status = run_epoch(t->d, sc, child_timeout_ns, &l0, &l1, t->gate, &released);
    // the log: [0] epochs logged, [1] the status that stopped the trigger (0: none), then (epoch, count) pairs
    volatile u64* fired = reinterpret_cast<volatile u64*>(t->d->fired);
    if (status == ST_OK) {
        const u64 k = fired[0];
        if (k < t->d->fired_cap) {
            fired[2 + 2 * k] = reinterpret_cast<volatile cx_arena_words*>(t->d->words)->last_epoch;
            fired[3 + 2 * k] = count;
            __threadfence_system();
            fired[0] = k + 1;
        }
    } else if (status != ST_NO_ROOM) {  // a miss is counted in the words; anything else disarms
        fired[1] = (u64)status;
        t->d = nullptr;
        trigger_release(t);
        return status == ST_TIMEOUT ? 2 : 1;
    }
    __threadfence_system();
    if (!released) atomicExch(&t->gate[1], 0u);
    __threadfence_system();
    return 1;
}
#endif

// Runs one task's handler on the whole warp; returns the status and leaves the
// page count in *pages, both valid in every lane (the completion is written by
// lanes 1..7, so a value only lane 0 holds would reach the host as 0).
__device__ int run_handler(u32 op, const u64* a, cx_scratch* sc, u32 n_sm, u64 child_timeout_ns, u32 lane,
                           u64* pages, u64* epoch_lsn) {
    int status = ST_UNSUPPORTED_OP;
    u64 found = 0;
    switch (op) {
#if (CX_OPS >> OP_CHECKPOINT) & 1
    case OP_CHECKPOINT: {
        const u64 nbytes = a[4], pb = a[5];
        if (pb == 0 || (pb & 15) || (nbytes & 15) || nbytes == 0 || ((a[0] | a[1] | a[2]) & 15)) {
            status = ST_BAD_ARGS;
            break;
        }
#if CX_CHILD
        if (lane == 0) {
            reset_scratch(sc);
            const u32 g = child_grid((nbytes + pb - 1) / pb, n_sm);
            cx_checkpoint<<<g, CHILD_THREADS, 0, CX_CHILD_STREAM>>>((const uint4*)a[0], (uint4*)a[1], (uint4*)a[2],
                                                                    (u32*)a[3], nbytes, pb, sc);
            status = CX_LAUNCHED() ? wait_children(sc, g, child_timeout_ns) : ST_LAUNCH_FAILED;
        }
        status = __shfl_sync(FULL, status, 0);
#else
        if (lane == 0) reset_scratch(sc);
        __syncwarp();
        checkpoint_body((const uint4*)a[0], (uint4*)a[1], (uint4*)a[2], (u32*)a[3], nbytes, pb, sc, 0, 1, lane);
        __syncwarp();
        status = ST_OK;
#endif
        break;
    }
#endif
#if (CX_OPS >> OP_APPEND_LOG) & 1
    case OP_APPEND_LOG: {
        if (a[0] == 0 || a[1] == 0) {
            status = ST_BAD_ARGS;
            break;
        }
#if CX_CHILD
        if (lane == 0) {
            reset_scratch(sc);
            const u32 g = child_grid((a[2] + 16 * CHILD_THREADS - 1) / (16 * 32), n_sm);
            cx_copy<<<g, CHILD_THREADS, 0, CX_CHILD_STREAM>>>((u8*)a[0], (const u8*)a[1], a[2], sc);
            status = CX_LAUNCHED() ? wait_children(sc, g, child_timeout_ns) : ST_LAUNCH_FAILED;
        }
        status = __shfl_sync(FULL, status, 0);
#else
        copy_body((u8*)a[0], (const u8*)a[1], a[2], lane, 32);
        __syncwarp();
        status = ST_OK;
#endif
        break;
    }
#endif
#if (CX_OPS >> OP_SCATTER) & 1
    case OP_SCATTER: {
        const u64 pb = a[4], rb = a[5];
        if (pb == 0 || (pb & 15) || (rb & 15) || ((a[0] | a[1]) & 15)) {
            status = ST_BAD_ARGS;
            break;
        }
#if CX_CHILD
        if (lane == 0) {
            reset_scratch(sc);
            const u32 g = child_grid(a[3], n_sm);
            cx_scatter<<<g, CHILD_THREADS, 0, CX_CHILD_STREAM>>>((uint4*)a[0], (const uint4*)a[1], (const u32*)a[2],
                                                                 a[3], pb, rb, sc);
            status = CX_LAUNCHED() ? wait_children(sc, g, child_timeout_ns) : ST_LAUNCH_FAILED;
        }
        status = __shfl_sync(FULL, status, 0);
#else
        if (lane == 0) reset_scratch(sc);
        __syncwarp();
        scatter_body((uint4*)a[0], (const uint4*)a[1], (const u32*)a[2], a[3], pb, rb, sc, 0, 1, lane);
        __syncwarp();
        status = ST_OK;
#endif
        if (status == ST_OK && lane == 0 && *(volatile u32*)&sc->errors) status = ST_BAD_ARGS;
        status = __shfl_sync(FULL, status, 0);
        break;
    }
#endif
#if defined(CX_RECOVER) && CX_CHILD
    case OP_RECOVER: {
        if (a[0] == 0 || (a[0] & 7)) {
            status = ST_BAD_ARGS;
            break;
        }
        u32 refuse = 0;   // (recover_refused: nothing launched)
        if (lane == 0) {
            const cx_recover_desc* d = reinterpret_cast<const cx_recover_desc*>(a[0]);
            reset_scratch(sc);
            sc->reserved[0] = 0;
            __threadfence();
            refuse = recover_refused(d);
        }
        if (__shfl_sync(FULL, refuse, 0)) {
            status = ST_BAD_ARGS;
            break;
        }
        if (lane == 0) {
            const cx_recover_desc* d = reinterpret_cast<const cx_recover_desc*>(a[0]);
            const u32 g = child_grid(d->pages, n_sm);
            cx_recover<<<g, CHILD_THREADS, 0, CX_CHILD_STREAM>>>(d, sc);
            status = CX_LAUNCHED() ? wait_children(sc, g, child_timeout_ns) : ST_LAUNCH_FAILED;
            if (status == ST_OK && *(volatile u32*)&sc->errors) status = ST_BAD_ARGS;
            if (status == ST_OK) {
                found = *(volatile u64*)&sc->pages;
                epoch_lsn[0] = *(volatile u64*)&sc->reserved[0];
                epoch_lsn[2] = *(volatile u64*)&sc->bytes;
            }
        }
        status = __shfl_sync(FULL, status, 0);
        break;
    }
#endif
#if defined(CX_EPOCH) && CX_CHILD
    case OP_EPOCH: {
        if (a[0] == 0 || (a[0] & 7)) {
            status = ST_BAD_ARGS;
            break;
        }
        u64 l0 = 0, l1 = 0;
        if (lane == 0) {
            bool released = false;  // no gate: a task's epoch is waited for whole
            status = run_epoch(reinterpret_cast<const cx_epoch_desc*>(a[0]), sc, child_timeout_ns, &l0, &l1,
                               nullptr, &released);
            if (status == ST_OK) {
                found = *(volatile u64*)&sc->pages;
                epoch_lsn[0] = l0;
                epoch_lsn[1] = l1;
                epoch_lsn[2] = *(volatile u64*)&sc->bytes;
            }
        }
        status = __shfl_sync(FULL, status, 0);
        break;
    }
#endif
    default:
        break;
    }
    // Lane 0 waited for the child grid (or did the counting itself): it reads
    // the counter, the warp gets it from lane 0.
    if (lane == 0 && status == ST_OK && (op == OP_CHECKPOINT || op == OP_SCATTER)) found = *(volatile u64*)&sc->pages;
    // (EPOCH: lane 0 read its pages above)
    *pages = __shfl_sync(FULL, found, 0);
    return __shfl_sync(FULL, status, 0);
}

extern "C" __global__ void __launch_bounds__(32, 1)
    cx_executor(u8* ring, u32 capacity, u32 executor_id, u32 instance, cx_scratch* sc, u32 n_sm, u64 idle_ns,
                u64 lifetime_ns, u64 child_timeout_ns, u32 poll_max_ns, u32 resume) {
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;
    const u32 lane = threadIdx.x;
    const u64 mask = capacity - 1;
    u8* tasks = ring + CX_HDR_BYTES;
    u8* comps = tasks + (u64)capacity * CX_TASK_BYTES;
    volatile u32* state = (volatile u32*)(ring + CX_OFF_STATE);
    volatile u64* polls = (volatile u64*)(ring + CX_OFF_POLLS);

    // A lazy launch queued behind a QUIESCE / STOP is not ours to run (ring.py step 4).
    int gone = 0;
    if (lane == 0 && !resume) {
        const u32 st = *state;
        gone = st == CS_QUIESCED || st == CS_STOPPED || st == CS_FAULT;
    }
    if (__shfl_sync(FULL, gone, 0)) return;

    u64 n = 0;
    if (lane == 0) {
        *(volatile u32*)(ring + CX_OFF_EXECUTOR_ID) = executor_id;
        *(volatile u32*)(ring + CX_OFF_INSTANCE) = instance;
        *polls = 0;
        *state = CS_RUNNING;
        __threadfence_system();
        n = *(volatile u64*)(ring + CX_OFF_TAIL);
    }
    n = __shfl_sync(FULL, n, 0);
    const u64 t_start = now_ns();
    u64 t_idle = t_start;
    u64 taken = 0;
#if defined(CX_EPOCH) && CX_CHILD
    cx_trigger trig = {nullptr, 0, nullptr, nullptr, nullptr, 0, 0};  // lane 0's
#endif

    for (;;) {
        // 1. Lane 0 waits for slot n to be published (or leaves when idle too long).
        int cmd = 0;  // 1 = task, 2 = leave
        if (lane == 0) {
            const u64* seqp = (const u64*)(tasks + (n & mask) * CX_TASK_BYTES);
            u32 spins = 0, nap = 0;
            for (;;) {
                if (ld_acquire_sys(seqp) == n + 1) {
                    cmd = 1;
                    break;
                }
#if defined(CX_EPOCH) && CX_CHILD
                const int polled = trigger_poll(&trig, sc, child_timeout_ns);
                if (polled == 2) {  // its epoch timed out: leave faulted, as a timed-out task does
                    *state = CS_FAULT;
                    __threadfence_system();
                    cmd = 2;
                    break;
                }
                if (polled) {  // an epoch ran: work, not idleness
                    t_idle = now_ns();
                    spins = 0;
                    nap = 0;
                    continue;
                }
                // an armed trigger keeps the executor resident while steps come (trigger_keeps),
                // so that a device-wide synchronize (a framework recording a CUDA graph) waits
                // at most CX_ARMED_IDLE_NS after the producer's stream drains
                const bool armed = trigger_keeps(&trig, &t_idle);
#else
                const bool armed = false;
#endif
                const u64 t = now_ns();
                // past its lifetime, an executor whose armed trigger's steps still come leaves once
                // they stop, through the handshake below (leaving between them would let a due
                // step pass with no epoch)
                const bool old = t - t_start > lifetime_ns && !armed;
                if (old || (!armed && t - t_idle > idle_ns)) {
#if defined(CX_EPOCH) && CX_CHILD
                    if (trigger_stays(&trig, t_idle)) continue;  // a step came after all
#endif
                    *state = old ? CS_LIFETIME_EXIT : CS_IDLE_EXIT;
                    __threadfence_system();  // state store before the re-check load (handshake)
                    if (ld_acquire_sys(seqp) == n + 1) {
                        *state = CS_RUNNING;
#if defined(CX_EPOCH) && CX_CHILD
                        if (trig.d != nullptr) reinterpret_cast<volatile u64*>(trig.d->fired)[1] = 0;  // staying
#endif
                        __threadfence_system();
                        cmd = 1;
                    } else {
                        cmd = 2;
                    }
                    break;
                }
                if (++spins > 64) {
                    nap = nap ? min(nap * 2, poll_max_ns) : 32u;
                    __nanosleep(nap);
                }
            }
        }
        cmd = __shfl_sync(FULL, cmd, 0);
#if defined(CX_EPOCH) && CX_CHILD
        if (cmd == 2 && lane == 0) trigger_leave(&trig, CX_TRIGGER_LEFT);
#endif
        if (cmd == 2) return;
        __syncwarp();  // orders lane 0's acquire before the other lanes' slot loads

        // 2. The warp reads the 128-byte slot in one load: lane i holds word i.
        const volatile u64* slot = (const volatile u64*)(tasks + (n & mask) * CX_TASK_BYTES);
        const u64 word = lane < 16 ? slot[lane] : 0;
        const u64 w1 = __shfl_sync(FULL, word, 1);
        const u64 tag = __shfl_sync(FULL, word, 2);
        const u32 op = (u32)(w1 & 0xFFFF);
        const u32 region = (u32)(w1 >> 32);
        u64 a[7];
#pragma unroll
        for (int i = 0; i < 7; ++i) a[i] = __shfl_sync(FULL, word, 3 + i);

        // 3. Dispatch through the operator table.
        int status = ST_OK;
        u64 pages = 0, bytes = 0, lsn0 = 0, lsn1 = 0;
        int leave = 0;
        if (op == OP_PING) {
        } else if (op == OP_QUIESCE) {
            leave = CS_QUIESCED;
        } else if (op == OP_STOP) {
            leave = CS_STOPPED;
#if defined(CX_EPOCH) && CX_CHILD
        } else if (op == OP_EPOCH && a[1] != 0) {  // arm the trigger (a[1] every, a[2] counter, a[3] gate, a[4..5])
            // A trigger armed before lets go of its gate first; a[0] = 0 disarms (the host takes
            // its arena on, then arms it again on another).
            if (a[0] == 0) {
                if (lane == 0) {
                    trigger_release(&trig);
                    trig.d = nullptr;
                    trig.gate = nullptr;
                }
            } else if (a[2] == 0 || a[3] == 0) {
                status = ST_BAD_ARGS;
            } else if (lane == 0) {
                // armed again on its gate (the host saw it leaving, or a new arena): a step held
                // there stays held, for this trigger to take; another gate is let go first
                if (trig.gate != reinterpret_cast<u32*>(a[3])) trigger_release(&trig);
                trig.d = reinterpret_cast<const cx_epoch_desc*>(a[0]);
                // an instance that left before this one may have logged TRIGGER_LEFT after the host
                // cleared the log for this arm: it is armed now (a fault's status stays)
                volatile u64* log = reinterpret_cast<volatile u64*>(trig.d->fired);
                if (log[1] == CX_TRIGGER_LEFT) log[1] = 0;
                trig.every = a[1];
                trig.counter = reinterpret_cast<u64*>(a[2]);
                trig.gate = reinterpret_cast<u32*>(a[3]);
                trig.queued = reinterpret_cast<const u64*>(a[4]);
                trig.seen = *(volatile u64*)trig.counter;
                trig.skip = a[5];
                *(volatile u32*)&trig.gate[2] = (u32)a[1];  // the producer's gate holds at its multiples now
                __threadfence_system();
            }
#endif
        } else {
            u64 epoch_lsn[3] = {0, 0, 0};  // EPOCH: first record, commit, record bytes (lane 0's)
            status = run_handler(op, a, sc, n_sm, child_timeout_ns, lane, &pages, epoch_lsn);
            if (status == ST_OK) {
                if (op == OP_CHECKPOINT) {
                    bytes = pages * a[5];
                    lsn0 = a[6];
                    lsn1 = a[6] + bytes;
                } else if (op == OP_APPEND_LOG) {
                    bytes = a[2];
                    lsn0 = a[3];
                    lsn1 = a[3] + bytes;
                } else if (op == OP_SCATTER) {
                    bytes = pages * a[4];
                    lsn0 = lsn1 = a[6];
                } else if (op == OP_RECOVER) {  // pages applied, bytes read, pages damaged (lane 0's)
                    bytes = __shfl_sync(FULL, epoch_lsn[2], 0);
                    lsn0 = __shfl_sync(FULL, epoch_lsn[0], 0);
                } else if (op == OP_EPOCH) {  // the warp takes lane 0's
                    lsn0 = __shfl_sync(FULL, epoch_lsn[0], 0);
                    lsn1 = __shfl_sync(FULL, epoch_lsn[1], 0);
                    bytes = __shfl_sync(FULL, epoch_lsn[2], 0);
                }
            }
            if (status == ST_TIMEOUT) leave = CS_FAULT;
        }

        // 4. Completion: lanes 1..7 store words 1..7, then lane 0 stores seq and
        //    releases tail (ring.py protocol step 3).  One system-scope release
        //    orders all of it: __syncwarp makes the other lanes' stores precede
        //    lane 0's release, which is cumulative (a separate fence before seq
        //    would add a second system fence to every round trip).
        volatile u64* comp = (volatile u64*)(comps + (n & mask) * CX_COMP_BYTES);
        u64 cw = 0;
        switch (lane) {
        case 1: cw = (u64)op | ((u64)(u32)status << 16) | ((u64)executor_id << 32); break;
        case 2: cw = tag; break;
        case 3: cw = pages; break;
        case 4: cw = bytes; break;
        case 5: cw = lsn0; break;
        case 6: cw = lsn1; break;
        case 7: cw = (u64)region; break;
        default: break;
        }
        if (lane >= 1 && lane <= 7) comp[lane] = cw;
        __syncwarp();
        if (lane == 0) {
            comp[0] = n + 1;
            st_release_sys((u64*)(ring + CX_OFF_TAIL), n + 1);
            *polls = ++taken;
            if (leave) {
                __threadfence_system();
                *state = (u32)leave;
                __threadfence_system();
            }
        }
        ++n;
#if defined(CX_EPOCH) && CX_CHILD
        if (leave && lane == 0) trigger_leave(&trig, leave == CS_FAULT ? (u64)ST_TIMEOUT : CX_TRIGGER_LEFT);
#endif
        if (leave) return;
        t_idle = now_ns();
    }
}
