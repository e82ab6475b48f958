// Index arithmetic shared by CPU loops and CUDA kernels: the element offset of the i-th element (in
// row-major order) of a strided tensor, and the counter-based random numbers behind randn/rand.
#pragma once
#include <cmath>
#include <cstdint>
#include "core/tensor.h"

#if defined(__CUDACC__)
#define LT_HD __host__ __device__ __forceinline__
#else
#define LT_HD inline
#endif

namespace lintape {

struct StridedIndex {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};

  StridedIndex() = default;
  // The layout of t, or of t broadcast to `out_shape` (strides 0 along broadcast dims).
  explicit StridedIndex(const Tensor& t) : StridedIndex(t, t.shape()) {}
  StridedIndex(const Tensor& t, const Shape& out_shape) {
    ndim = int(out_shape.size());
    LT_CHECK(ndim <= kMaxDims, "[strided] tensors have at most ", kMaxDims, " dims; got ", ndim);
    int lead = ndim - int(t.dim());
    for (int d = 0; d < ndim; ++d) {
      shape[d] = out_shape[size_t(d)];
      int td = d - lead;
      stride[d] = (td < 0 || t.shape()[size_t(td)] == 1) ? 0 : t.strides()[size_t(td)];
    }
  }

  // A layout given by its dims (as JointLayout gives them).
  StridedIndex(int dims, const int64_t* sizes, const int64_t* strides) : ndim(dims) {
    for (int d = 0; d < dims; ++d) {
      shape[d] = sizes[d];
      stride[d] = strides[d];
    }
  }

  LT_HD int64_t offset(int64_t linear) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t i = linear % shape[d];
      linear /= shape[d];
      off += i * stride[d];
    }
    return off;
  }
};

// Two tensors of one shape walked together in row-major order, with size-1 dims dropped and neighbouring
// dims merged where both tensors allow it (d and d + 1 merge when stride[d] == stride[d + 1] * size[d + 1] in
// both): fewer dims to index, and a slice of a wider tensor becomes rows of contiguous elements.
struct JointLayout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {}, stride_a[kMaxDims] = {}, stride_b[kMaxDims] = {};
  StridedIndex index_a() const { return StridedIndex(ndim, shape, stride_a); }
  StridedIndex index_b() const { return StridedIndex(ndim, shape, stride_b); }
};

inline JointLayout merge_dims(const Tensor& a, const Tensor& b) {
  JointLayout j;
  for (size_t d = 0; d < a.shape().size(); ++d) {
    const int64_t n = a.shape()[d], sa = a.strides()[d], sb = b.strides()[d];
    if (n == 1) continue;
    if (j.ndim > 0 && j.stride_a[j.ndim - 1] == sa * n && j.stride_b[j.ndim - 1] == sb * n) {
      j.shape[j.ndim - 1] *= n;
      j.stride_a[j.ndim - 1] = sa;
      j.stride_b[j.ndim - 1] = sb;
    } else {
      j.shape[j.ndim] = n;
      j.stride_a[j.ndim] = sa;
      j.stride_b[j.ndim] = sb;
      ++j.ndim;
    }
  }
  return j;
}

// splitmix64 finaliser: a bijective mix of 64 bits.
LT_HD uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform number in (0, 1) that depends only on (seed, index, lane).
LT_HD double counter_uniform(uint64_t seed, uint64_t index, uint64_t lane) {
  uint64_t r = mix64(mix64(seed) ^ (index * 2 + lane));
  return (double(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// A standard normal number by Box-Muller, computed in double so CPU and CUDA agree.
LT_HD double counter_normal(uint64_t seed, uint64_t index) {
  double u1 = counter_uniform(seed, index, 0), u2 = counter_uniform(seed, index, 1);
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);  // global: lintape:: has Tensor overloads
}

}  // namespace lintape
