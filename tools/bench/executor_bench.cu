// Kernels the executor benchmark compares against: an empty kernel (the cost of
// a launch plus a synchronise) and the naive resident block the executor is
// designed not to be (all 32 threads spin on host memory with no back-off).

typedef unsigned long long u64;

extern "C" __global__ void cx_noop(u64* out) {
    if (out != 0 && threadIdx.x == 0 && blockIdx.x == 0) out[0] += 1;
}

// Leaves when *flag (mapped host memory) becomes non-zero or after lifetime_ns.
extern "C" __global__ void cx_naive_spin(const volatile u64* flag, u64 lifetime_ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        if (*flag != 0) return;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > lifetime_ns) return;
    }
}
