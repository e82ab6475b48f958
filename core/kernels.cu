#include "core/cuda_types.cuh"
#include "core/kernels.h"
#include <type_traits>

namespace lintape::core_kernels {
using namespace lintape::cuda;

namespace {
constexpr int kThreads = 256;

template <class D, class S>
__global__ void copy_kernel(D* dst, const S* src, int64_t n, StridedIndex di, StridedIndex si, bool flat) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    S v = flat ? src[i] : src[si.offset(i)];
    (flat ? dst[i] : dst[di.offset(i)]) = from_double<D>(to_double(v));
  }
}

template <class T>
__global__ void fill_kernel(T* dst, int64_t n, StridedIndex di, bool flat, double value) {
  T v = from_double<T>(value);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[flat ? i : di.offset(i)] = v;
}

template <class T>
__global__ void random_kernel(T* dst, int64_t n, uint64_t seed, bool normal) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_double<T>(normal ? counter_normal(seed, uint64_t(i)) : counter_uniform(seed, uint64_t(i), 0));
}

template <class T>
__global__ void arange_kernel(T* dst, int64_t n, int64_t start) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_double<T>(double(start + i));
}

template <class T, class S>
__global__ void accumulate_kernel(T* dst, const S* src, int64_t n, StridedIndex di, StridedIndex si, bool flat) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    T& out = dst[flat ? i : di.offset(i)];
    out = from_double<T>(to_double(out) + to_double(src[flat ? i : si.offset(i)]));
  }
}

// The contiguous case in packs of V (16 bytes of the narrower type): the same sums as accumulate_kernel,
// with fewer, wider accesses (the parameters' gradients are most of them).
template <class T, class S, int V>
__global__ void accumulate_packs_kernel(T* dst, const S* src, int64_t packs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    Pack<T, V> d = reinterpret_cast<const Pack<T, V>*>(dst)[i];
    const Pack<S, V> x = reinterpret_cast<const Pack<S, V>*>(src)[i];
#pragma unroll
    for (int k = 0; k < V; ++k) d.v[k] = from_double<T>(to_double(d.v[k]) + to_double(x.v[k]));
    reinterpret_cast<Pack<T, V>*>(dst)[i] = d;
  }
}

// Rows of `width` contiguous elements at pitches dpitch and spitch (elements): one vector word per thread.
template <class V>
__global__ void copy_rows_kernel(char* dst, const char* src, int64_t rows, int64_t width_words, int64_t dpitch,
                                 int64_t spitch) {
  const int64_t n = rows * width_words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width_words, c = i - r * width_words;
    reinterpret_cast<V*>(dst + r * dpitch)[c] = reinterpret_cast<const V*>(src + r * spitch)[c];
  }
}

unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}
}  // namespace

namespace {
// A same-dtype copy whose layouts are, after merging dims, `rows` rows of `width` contiguous elements (a
// slice of a wider tensor: split's backward, contiguous() of a narrow), copied in the widest aligned words.
bool copy_as_rows(const Tensor& dst, const Tensor& src, cudaStream_t s) {
  const JointLayout j = merge_dims(dst, src);
  if (j.ndim > 2 || j.ndim == 0 || j.stride_a[j.ndim - 1] != 1 || j.stride_b[j.ndim - 1] != 1) return false;
  const int64_t es = int64_t(dtype_size(dst.dtype()));
  const int64_t width = j.shape[j.ndim - 1] * es, rows = j.ndim == 2 ? j.shape[0] : 1;
  const int64_t dpitch = (j.ndim == 2 ? j.stride_a[0] : 0) * es, spitch = (j.ndim == 2 ? j.stride_b[0] : 0) * es;
  if (rows > 1 && (dpitch < width || spitch < width)) return false;
  char* d = static_cast<char*>(dst.data());
  const char* sp = static_cast<const char*>(src.data());
  auto aligned = [&](int64_t bytes) {
    return width % bytes == 0 && dpitch % bytes == 0 && spitch % bytes == 0 && uintptr_t(d) % bytes == 0 &&
           uintptr_t(sp) % bytes == 0;
  };
  auto launch = [&](auto word) {
    using V = decltype(word);
    const int64_t words = width / int64_t(sizeof(V));
    copy_rows_kernel<V><<<blocks_for(rows * words), kThreads, 0, s>>>(d, sp, rows, words, dpitch, spitch);
  };
  if (aligned(16))
    launch(uint4{});
  else if (aligned(8))
    launch(uint2{});
  else if (aligned(4))
    launch(uint32_t{});
  else
    launch(uint16_t{});  // every dtype is at least 2 bytes
  LT_CUDA_CHECK_LAUNCH();
  return true;
}
}  // namespace

void copy_cuda(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  if (n == 0) return;
  cudaStream_t s = stream(dst.device().index);
  bool flat = dst.is_contiguous() && src.is_contiguous();
  if (flat && dst.dtype() == src.dtype()) {
    LT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice, s));
    return;
  }
  if (dst.dtype() == src.dtype() && copy_as_rows(dst, src, s)) return;
  const JointLayout j = merge_dims(dst, src);
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "copy", D, {
    LT_DISPATCH_ALL_CUDA(src.dtype(), "copy", S, {
      copy_kernel<D, S><<<blocks_for(n), kThreads, 0, s>>>(static_cast<D*>(dst.data()),
                                                          static_cast<const S*>(src.data()), n, j.index_a(),
                                                          j.index_b(), flat);
    });
  });
  LT_CUDA_CHECK_LAUNCH();
}

void fill_cuda(const Tensor& dst, double value) {
  int64_t n = dst.numel();
  if (n == 0) return;
  const JointLayout j = merge_dims(dst, dst);
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "fill", T, {
    fill_kernel<T><<<blocks_for(n), kThreads, 0, stream(dst.device().index)>>>(
        static_cast<T*>(dst.data()), n, j.index_a(), dst.is_contiguous(), value);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void random_cuda(const Tensor& dst, uint64_t seed, bool normal) {
  int64_t n = dst.numel();
  if (n == 0) return;
  LT_DISPATCH_FLOAT_CUDA(dst.dtype(), "randn", T, {
    random_kernel<T><<<blocks_for(n), kThreads, 0, stream(dst.device().index)>>>(static_cast<T*>(dst.data()), n,
                                                                                 seed, normal);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void arange_cuda(const Tensor& dst, int64_t start) {
  int64_t n = dst.numel();
  if (n == 0) return;
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "arange", T, {
    arange_kernel<T><<<blocks_for(n), kThreads, 0, stream(dst.device().index)>>>(static_cast<T*>(dst.data()), n,
                                                                                 start);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void accumulate_cuda(const Tensor& dst, const Tensor& src) {
  int64_t n = dst.numel();
  if (n == 0) return;
  const JointLayout j = merge_dims(dst, src);
  const bool flat = dst.is_contiguous() && src.is_contiguous();
  cudaStream_t st = stream(dst.device().index);
  if (flat && is_float16(src.dtype()) && n % 8 == 0 && uintptr_t(src.data()) % 16 == 0 &&
      uintptr_t(dst.data()) % (8 * dtype_size(dst.dtype())) == 0) {
    const int64_t packs = n / 8;
    auto launch = [&](auto* d, auto* x) {
      accumulate_packs_kernel<std::remove_pointer_t<decltype(d)>, std::remove_cv_t<std::remove_pointer_t<decltype(x)>>, 8>
          <<<blocks_for(packs), kThreads, 0, st>>>(d, x, packs);
    };
    void* d = dst.data();
    const void* x = src.data();
    if (src.dtype() == DType::BF16) {
      const auto* xs = static_cast<const __nv_bfloat16*>(x);
      if (dst.dtype() == DType::F32) launch(static_cast<float*>(d), xs);
      else launch(static_cast<__nv_bfloat16*>(d), xs);
    } else {
      const auto* xs = static_cast<const __half*>(x);
      if (dst.dtype() == DType::F32) launch(static_cast<float*>(d), xs);
      else launch(static_cast<__half*>(d), xs);
    }
    LT_CUDA_CHECK_LAUNCH();
    return;
  }
  if (src.dtype() != dst.dtype()) {  // f32 += a 16-bit float (accumulate_ allows no other pair)
    float* d = static_cast<float*>(dst.data());
    if (src.dtype() == DType::BF16)
      accumulate_kernel<<<blocks_for(n), kThreads, 0, st>>>(d, static_cast<const __nv_bfloat16*>(src.data()), n,
                                                            j.index_a(), j.index_b(), flat);
    else
      accumulate_kernel<<<blocks_for(n), kThreads, 0, st>>>(d, static_cast<const __half*>(src.data()), n,
                                                            j.index_a(), j.index_b(), flat);
  } else {
    LT_DISPATCH_ALL_CUDA(dst.dtype(), "accumulate", T, {
      accumulate_kernel<<<blocks_for(n), kThreads, 0, st>>>(static_cast<T*>(dst.data()),
                                                            static_cast<const T*>(src.data()), n, j.index_a(),
                                                            j.index_b(), flat);
    });
  }
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::core_kernels
