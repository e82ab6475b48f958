#include "core/kernels.h"
#include <algorithm>
#include <cstring>
#include <limits>
#include "core/strided.h"

namespace lintape::core_kernels {

namespace {
template <class Fn>
void dispatch_pair(DType a, DType b, Fn&& fn) {
  LT_DISPATCH_ALL(a, "copy", A, { LT_DISPATCH_ALL(b, "copy", B, { fn(A{}, B{}); }); });
}

// Every supported pair converts exactly through double (bf16/f16 convert through float).
template <class T> double to_double(T v) { return double(v); }

// Walks a layout by runs along its last dim: fn(dst offset, src offset, count, dst step, src step) for
// each run, so that the index arithmetic is paid once per row rather than once per element. `src`
// (optional) has dst's shape, possibly broadcast.
template <class Fn>
void for_each_run(const StridedIndex& di, const StridedIndex* si, int64_t n, Fn&& fn) {
  const int last = di.ndim - 1;
  const int64_t inner = di.ndim > 0 ? di.shape[last] : 1;
  if (n == 0 || inner == 0) return;
  const int64_t dstep = di.ndim > 0 ? di.stride[last] : 1;
  const int64_t sstep = si && si->ndim > 0 ? si->stride[last] : 1;
  for (int64_t start = 0; start < n; start += inner)
    fn(di.offset(start), si ? si->offset(start) : int64_t(0), inner, dstep, sstep);
}
}  // namespace

void copy_cpu(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.nbytes() > 0) std::memcpy(dst.data(), src.data(), dst.nbytes());  // an empty tensor may hold no pointer
    return;
  }
  StridedIndex di(dst), si(src);
  char* dbase = static_cast<char*>(dst.data());
  const char* sbase = static_cast<const char*>(src.data());
  dispatch_pair(dst.dtype(), src.dtype(), [&](auto d0, auto s0) {
    using D = decltype(d0);
    using S = decltype(s0);
    D* d = reinterpret_cast<D*>(dbase);
    const S* s = reinterpret_cast<const S*>(sbase);
    if (dst.is_contiguous() && src.is_contiguous()) {
      for (int64_t i = 0; i < n; ++i) d[i] = D(to_double(s[i]));
      return;
    }
    for_each_run(di, &si, n, [&](int64_t doff, int64_t soff, int64_t count, int64_t dstep, int64_t sstep) {
      for (int64_t k = 0; k < count; ++k) d[doff + k * dstep] = D(to_double(s[soff + k * sstep]));
    });
  });
}

void fill_cpu(const Tensor& dst, double value) {
  int64_t n = dst.numel();
  StridedIndex di(dst);
  LT_DISPATCH_ALL(dst.dtype(), "fill", T, {
    const T v = T(value);
    T* d = static_cast<T*>(dst.data());
    if (dst.is_contiguous()) {
      std::fill_n(d, n, v);
    } else {
      for_each_run(di, nullptr, n, [&](int64_t off, int64_t, int64_t count, int64_t step, int64_t) {
        for (int64_t k = 0; k < count; ++k) d[off + k * step] = v;
      });
    }
  });
}

void random_cpu(const Tensor& dst, uint64_t seed, bool normal) {
  int64_t n = dst.numel();
  LT_DISPATCH_FLOAT(dst.dtype(), "randn", T, {
    T* d = static_cast<T*>(dst.data());
    for (int64_t i = 0; i < n; ++i)
      d[i] = T(normal ? counter_normal(seed, uint64_t(i)) : counter_uniform(seed, uint64_t(i), 0));
  });
}

void arange_cpu(const Tensor& dst, int64_t start) {
  int64_t n = dst.numel();
  LT_DISPATCH_ALL(dst.dtype(), "arange", T, {
    T* d = static_cast<T*>(dst.data());
    for (int64_t i = 0; i < n; ++i) d[i] = T(double(start + i));
  });
}

namespace {
template <class T, class S>
void accumulate_typed(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  T* d = static_cast<T*>(dst.data());
  const S* s = static_cast<const S*>(src.data());
  if (dst.is_contiguous() && src.is_contiguous()) {
    for (int64_t i = 0; i < n; ++i) d[i] = T(to_double(d[i]) + to_double(s[i]));
    return;
  }
  StridedIndex di(dst), si(src);
  for_each_run(di, &si, n, [&](int64_t doff, int64_t soff, int64_t count, int64_t dstep, int64_t sstep) {
    for (int64_t k = 0; k < count; ++k) {
      T& out = d[doff + k * dstep];
      out = T(to_double(out) + to_double(s[soff + k * sstep]));
    }
  });
}
}  // namespace

void accumulate_cpu(const Tensor& dst, const Tensor& src) {
  if (src.dtype() == DType::BF16 && dst.dtype() == DType::F32) return accumulate_typed<float, bf16>(dst, src);
  if (src.dtype() == DType::F16 && dst.dtype() == DType::F32) return accumulate_typed<float, f16>(dst, src);
  LT_DISPATCH_ALL(dst.dtype(), "accumulate", T, { accumulate_typed<T, T>(dst, src); });
}

}  // namespace lintape::core_kernels

namespace lintape {

void accumulate_(const Tensor& dst, const Tensor& src) {
  const bool dtypes = dst.dtype() == src.dtype() || (dst.dtype() == DType::F32 && is_float16(src.dtype()));
  LT_CHECK(dst.shape() == src.shape() && dtypes && dst.device() == src.device(),
           "[accumulate] expected equal shape and device, and equal dtypes or f32 += bf16/f16; got ", shape_str(dst.shape()), " ",
           dtype_name(dst.dtype()), " ", dst.device().name(), " += ", shape_str(src.shape()), " ",
           dtype_name(src.dtype()), " ", src.device().name());
  dst.storage().version++;
#if LINTAPE_WITH_CUDA
  if (dst.is_cuda()) return core_kernels::accumulate_cuda(dst, src);
#endif
  core_kernels::accumulate_cpu(dst, src);
}

}  // namespace lintape
