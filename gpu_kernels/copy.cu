// Batched device-to-device copies: one launch for many (src, dst, bytes) rows.
// A recovery that copies a read ahead's arrays into a model's tensors made one
// cudaMemcpyAsync call an array (173 for a Qwen3 with its LoRA: 1.6 ms of the
// caller's time on an H100, for 0.48 GB the device copies in 0.3 ms).
//
// The host cuts every span into rows of at most a piece (gpu.COPY_PIECE) and
// hands one table: src[rows], dst[rows], bytes[rows] (u64 each, in that order).
// One block a row (grid-stride): 16-byte loads and stores where the row's two
// addresses are 16-byte aligned, then its last bytes one at a time; bytes one
// at a time otherwise.  Rows must not overlap one another.
// Twin: reference.copy_spans.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
copy_spans(const u64* __restrict__ table, u64 rows) {
    const u64* src = table;
    const u64* dst = table + rows;
    const u64* bytes = table + 2 * rows;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u8* s = reinterpret_cast<const u8*>(src[r]);
        u8* d = reinterpret_cast<u8*>(dst[r]);
        const u64 n = bytes[r];
        u64 done = 0;
        if (((src[r] | dst[r]) & 15) == 0) {
            const uint4* s16 = reinterpret_cast<const uint4*>(s);
            uint4* d16 = reinterpret_cast<uint4*>(d);
            const u64 words = n >> 4;
            for (u64 i = threadIdx.x; i < words; i += blockDim.x) d16[i] = __ldcs(s16 + i);
            done = words << 4;
        }
        for (u64 i = done + threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    }
}
