#include "core/kernels.h"
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
}  // namespace

void copy_cpu(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    std::memcpy(dst.data(), src.data(), dst.nbytes());
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
    bool flat = dst.is_contiguous() && src.is_contiguous();
    for (int64_t i = 0; i < n; ++i) {
      const S v = flat ? s[i] : s[si.offset(i)];
      (flat ? d[i] : d[di.offset(i)]) = D(to_double(v));
    }
  });
}

void fill_cpu(const Tensor& dst, double value) {
  int64_t n = dst.numel();
  StridedIndex di(dst);
  LT_DISPATCH_ALL(dst.dtype(), "fill", T, {
    T v = T(value);
    T* d = static_cast<T*>(dst.data());
    for (int64_t i = 0; i < n; ++i) d[di.offset(i)] = v;
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

void accumulate_cpu(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  StridedIndex di(dst), si(src);
  LT_DISPATCH_ALL(dst.dtype(), "accumulate", T, {
    T* d = static_cast<T*>(dst.data());
    const T* s = static_cast<const T*>(src.data());
    for (int64_t i = 0; i < n; ++i) {
      T& out = d[di.offset(i)];
      out = T(to_double(out) + to_double(s[si.offset(i)]));
    }
  });
}

}  // namespace lintape::core_kernels

namespace lintape {

void accumulate_(const Tensor& dst, const Tensor& src) {
  LT_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype() && dst.device() == src.device(),
           "[accumulate] expected equal shape, dtype and device; got ", shape_str(dst.shape()), " ",
           dtype_name(dst.dtype()), " ", dst.device().name(), " += ", shape_str(src.shape()), " ",
           dtype_name(src.dtype()), " ", src.device().name());
  dst.storage().version++;
#if LINTAPE_WITH_CUDA
  if (dst.is_cuda()) return core_kernels::accumulate_cuda(dst, src);
#endif
  core_kernels::accumulate_cpu(dst, src);
}

}  // namespace lintape
