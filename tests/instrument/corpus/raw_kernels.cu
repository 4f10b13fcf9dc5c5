// RawKernel-style sources: early returns, vector stores that may straddle a
// page boundary, atomics and reductions into global memory, a device function
// that stores through a pointer, and a kernel with no stores at all.
#include <cstdint>

__device__ __noinline__ void put(int* p, int v) { *p = v; }

extern "C" __global__ void scatter_vec(float4* out, const int* idx, int n, float add) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int j = idx[i];
  if (j < 0) return;
  float4 v = out[j];
  v.x += add; v.y += add; v.z += add; v.w += add;
  out[j] = v;
  if ((i & 31) == 0) put(reinterpret_cast<int*>(out) + 1, i);
}

extern "C" __global__ void histogram(const uint8_t* data, unsigned* bins, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    atomicAdd(&bins[data[i]], 1u);
}

extern "C" __global__ void bytes_and_halves(uint8_t* b, uint16_t* h, uint2* w, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = (uint8_t)i;
  if (i < n / 2) h[i] = (uint16_t)i;
  if (i < n / 8) w[i] = make_uint2(i, ~i);
}

extern "C" __global__ void nothing_written(const float* a, int n) {
  if (threadIdx.x > 1024) __trap();
}
