// Dirty pages of a paged KV cache and of an adapter region, from metadata
// only: cost follows what changed, not the size of the cache.
//
// kv_scan: the cache is [layers][num_blocks, 2, KV_BLOCK_SIZE, KV_HEADS,
// KV_HEAD_DIM] of KV_DTYPE_BYTES-byte elements (layer stride layer_bytes).
// One warp per sequence; the lanes walk the logical blocks holding the new
// tokens [start, seq_len) (start = ckpt_len, or 0 when the sequence is now
// shorter, i.e. replaced), look up the physical block, and append the pages
// covering those tokens' K and V slots in every layer to `out` (atomic
// cursor counters[0]; entries past `cap` are counted but not stored, so the
// caller can grow and rerun).  Table entries < 0 are skipped; an entry naming
// a block >= num_blocks, or a logical block past the table, counts in
// counters[1].  The list is unsorted and may repeat pages (shared blocks); the
// launcher sorts and deduplicates.  Twin: reference.kv_dirty_blocks.
//
// adapter_scan: one thread per adapter slot; a slot whose version moved adds
// its pages_per_slot pages (clipped at num_pages); the launcher records the
// versions as seen once the list is complete.  Twin: reference.adapter_dirty_pages.
//
// -D PAGE_BYTES, KV_BLOCK_SIZE, KV_HEADS, KV_HEAD_DIM, KV_DTYPE_BYTES for kv_scan.
#include "common.cuh"

#ifdef KV_BLOCK_SIZE
#define KV_TOKEN_BYTES ((u64)KV_HEADS * KV_HEAD_DIM * KV_DTYPE_BYTES)
#define KV_HALF_BYTES ((u64)KV_BLOCK_SIZE * KV_TOKEN_BYTES)
#define KV_BLOCK_BYTES (2 * KV_HALF_BYTES)

__device__ __forceinline__ void emit_range(u64 lo, u64 hi, u32* out, u32 cap, u32* counters) {
    const u64 first = lo / PAGE_BYTES, last = (hi - 1) / PAGE_BYTES;
    const u32 n = (u32)(last - first + 1);
    const u32 pos = atomicAdd(&counters[0], n);
    for (u32 j = 0; j < n; ++j)
        if (pos + j < cap) out[pos + j] = (u32)(first + j);
}

extern "C" __global__ void __launch_bounds__(256)
kv_scan(const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ seq_lens,
        const int* __restrict__ ckpt_lens, int num_seqs, int num_blocks, int num_layers,
        u64 layer_bytes, u32* __restrict__ out, u32 cap, u32* counters) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int s = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; s < num_seqs; s += warps) {
        const long long len = seq_lens[s], prev = ckpt_lens[s];
        const long long start = len >= prev ? prev : 0;
        if (len <= start) continue;
        const long long lb0 = start / KV_BLOCK_SIZE, lb1 = (len - 1) / KV_BLOCK_SIZE;
        for (long long lb = lb0 + lane; lb <= lb1; lb += WARP) {
            if (lb >= max_blocks) {
                atomicAdd(&counters[1], 1u);
                continue;
            }
            const int phys = block_tables[(long long)s * max_blocks + lb];
            if (phys < 0) continue;
            if (phys >= num_blocks) {
                atomicAdd(&counters[1], 1u);
                continue;
            }
            const long long b0 = lb * KV_BLOCK_SIZE;
            const u64 t0 = (u64)((start > b0 ? start : b0) - b0);
            const u64 t1 = (u64)((len < b0 + KV_BLOCK_SIZE ? len : b0 + KV_BLOCK_SIZE) - b0);
            for (int l = 0; l < num_layers; ++l) {
                const u64 blk = (u64)l * layer_bytes + (u64)phys * KV_BLOCK_BYTES;
                for (int kv = 0; kv < 2; ++kv) {
                    const u64 lo = blk + kv * KV_HALF_BYTES + t0 * KV_TOKEN_BYTES;
                    emit_range(lo, lo + (t1 - t0) * KV_TOKEN_BYTES, out, cap, counters);
                }
            }
        }
    }
}
#endif  // KV_BLOCK_SIZE

extern "C" __global__ void __launch_bounds__(256)
adapter_scan(const u64* __restrict__ versions, const u64* __restrict__ seen, int num_slots,
             u32 pages_per_slot, u32 num_pages, u32* __restrict__ out, u32 cap, u32* counters) {
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < num_slots; s += gridDim.x * blockDim.x) {
        const u64 v = versions[s];
        if (v == seen[s]) continue;
        const u64 lo = (u64)s * pages_per_slot;
        if (lo >= num_pages) {
            atomicAdd(&counters[1], 1u);
            continue;
        }
        const u64 hi = lo + pages_per_slot < num_pages ? lo + pages_per_slot : num_pages;
        const u32 n = (u32)(hi - lo);
        const u32 pos = atomicAdd(&counters[0], n);
        for (u32 j = 0; j < n; ++j)
            if (pos + j < cap) out[pos + j] = (u32)(lo + j);
    }
}
