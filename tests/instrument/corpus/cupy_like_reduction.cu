// Shaped after CuPy's ReductionKernel output: each block reduces a segment in
// shared memory with a tree, and thread 0 writes one output element (a
// predicated store after a barrier); several exits through the guard.
#include <cstddef>

#define _REDUCE(_offset)                                   \
  if (_tid < _offset) {                                    \
    float _a = _sdata[_tid], _b = _sdata[_tid + _offset];  \
    _sdata[_tid] = _a + _b;                                \
  }

extern "C" __global__ void cupy_sum(const float* _raw_in, float* _raw_out,
                                    ptrdiff_t _in_size, ptrdiff_t _out_size,
                                    int _block_stride) {
  __shared__ float _sdata[512];
  unsigned int _tid = threadIdx.x;
  ptrdiff_t _out_ind = blockIdx.x;
  if (_out_ind >= _out_size) return;
  float _s = 0.0f;
  for (ptrdiff_t j = _tid; j < _in_size; j += blockDim.x)
    _s += _raw_in[_out_ind * _in_size + j];
  _sdata[_tid] = _s;
  __syncthreads();
  for (int off = 256; off > 0; off >>= 1) {
    if (off < (int)blockDim.x) { _REDUCE(off); }
    __syncthreads();
  }
  if (_tid == 0) _raw_out[_out_ind] = _sdata[0];
}

extern "C" __global__ void cupy_argmax_i64(const long long* in, long long* out_idx,
                                           long long* out_val, ptrdiff_t n) {
  __shared__ long long sv[256];
  __shared__ long long si[256];
  unsigned t = threadIdx.x;
  long long best = -(1LL << 62), bi = -1;
  for (ptrdiff_t j = t; j < n; j += blockDim.x)
    if (in[j] > best) { best = in[j]; bi = j; }
  sv[t] = best; si[t] = bi;
  __syncthreads();
  for (unsigned off = blockDim.x / 2; off > 0; off >>= 1) {
    if (t < off && sv[t + off] > sv[t]) { sv[t] = sv[t + off]; si[t] = si[t + off]; }
    __syncthreads();
  }
  if (t != 0) return;
  out_idx[blockIdx.x] = si[0];
  atomicMax(out_val, sv[0]);
}
