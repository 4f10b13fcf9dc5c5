// Shaped after the code CuPy generates for an ElementwiseKernel: arrays arrive
// as CArray structs by value (pointer, size, shape, strides), the index is a
// CIndexer, and the body runs in a grid-stride loop over a 64-bit index.
#include <cstddef>

template <typename T, int ndim>
struct CArray {
  T* data_;
  ptrdiff_t size_;
  ptrdiff_t shape_[ndim];
  ptrdiff_t strides_[ndim];
  __device__ T& operator[](ptrdiff_t i) {
    char* p = reinterpret_cast<char*>(data_);
    ptrdiff_t rest = i;
    for (int d = ndim - 1; d >= 0; --d) {
      ptrdiff_t k = rest % shape_[d];
      rest /= shape_[d];
      p += k * strides_[d];
    }
    return *reinterpret_cast<T*>(p);
  }
};

struct CIndexer1 { ptrdiff_t size_; };

#define CUPY_FOR(i, n)                                                   \
  for (ptrdiff_t i = static_cast<ptrdiff_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
       i < (n); i += static_cast<ptrdiff_t>(blockDim.x) * gridDim.x)

extern "C" __global__ void cupy_add(const CArray<float, 1> _raw_in0,
                                    const CArray<float, 1> _raw_in1,
                                    CArray<float, 1> _raw_out0, CIndexer1 _ind) {
  CArray<float, 1> in0 = _raw_in0, in1 = _raw_in1, out0 = _raw_out0;
  CUPY_FOR(i, _ind.size_) {
    out0[i] = in0[i] + in1[i];
  }
}

extern "C" __global__ void cupy_where_half(const CArray<bool, 2> _raw_cond,
                                           const CArray<unsigned short, 2> _raw_x,
                                           CArray<unsigned short, 2> _raw_out, CIndexer1 _ind) {
  CArray<bool, 2> c = _raw_cond;
  CArray<unsigned short, 2> x = _raw_x, out = _raw_out;
  CUPY_FOR(i, _ind.size_) {
    if (c[i]) out[i] = x[i];
  }
}

extern "C" __global__ void cupy_copy_double(const double* __restrict__ src,
                                            double* __restrict__ dst, ptrdiff_t n) {
  CUPY_FOR(i, n) { dst[i] = src[i] * 2.0; }
}
