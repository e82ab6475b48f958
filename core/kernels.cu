#include "core/cuda_types.cuh"
#include "core/kernels.h"

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
__global__ void fill_kernel(T* dst, int64_t n, StridedIndex di, double value) {
  T v = from_double<T>(value);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[di.offset(i)] = v;
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

template <class T>
__global__ void accumulate_kernel(T* dst, const T* src, int64_t n, StridedIndex di, StridedIndex si) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    T& out = dst[di.offset(i)];
    out = from_double<T>(to_double(out) + to_double(src[si.offset(i)]));
  }
}

unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b < 1 ? 1 : (b > 65536 ? 65536 : b));
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
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "copy", D, {
    LT_DISPATCH_ALL_CUDA(src.dtype(), "copy", S, {
      copy_kernel<D, S><<<blocks_for(n), kThreads, 0, s>>>(static_cast<D*>(dst.data()),
                                                          static_cast<const S*>(src.data()), n,
                                                          StridedIndex(dst), StridedIndex(src), flat);
    });
  });
  LT_CUDA_CHECK_LAUNCH();
}

void fill_cuda(const Tensor& dst, double value) {
  int64_t n = dst.numel();
  if (n == 0) return;
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "fill", T, {
    fill_kernel<T><<<blocks_for(n), kThreads, 0, stream(dst.device().index)>>>(static_cast<T*>(dst.data()), n,
                                                                               StridedIndex(dst), value);
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
  LT_DISPATCH_ALL_CUDA(dst.dtype(), "accumulate", T, {
    accumulate_kernel<T><<<blocks_for(n), kThreads, 0, stream(dst.device().index)>>>(
        static_cast<T*>(dst.data()), static_cast<const T*>(src.data()), n, StridedIndex(dst), StridedIndex(src));
  });
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::core_kernels
