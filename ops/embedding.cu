// Embedding gather and scatter-add: one warp per token row. The gather copies rows as raw units of
// 16 bytes where the row size and addresses allow (else 8, 4 or 2), so it needs no dtype dispatch.
#include <cstdint>
#include "core/cuda_types.cuh"
#include "ops/embedding_cuda.h"

namespace lintape::ops_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;  // 8 warps, 8 rows in flight per block
constexpr int kWarps = kThreads / 32;
constexpr unsigned kMaxBlocks = 4096;  // rows beyond are covered by the grid-stride loop

template <class U, class I>
__global__ void gather_kernel(const U* __restrict__ w, const I* __restrict__ ids, U* __restrict__ out, int64_t n,
                              int64_t rows, int64_t units, long long* bad) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; i < n; i += int64_t(gridDim.x) * kWarps) {
    const int64_t id = int64_t(ids[i]);
    U* dst = out + i * units;
    if (id < 0 || id >= rows) {
      if (lane == 0 && atomicCAS(reinterpret_cast<unsigned long long*>(bad), 0ull, (unsigned long long)(i + 1)) == 0ull)
        bad[1] = id;
      for (int64_t j = lane; j < units; j += 32) dst[j] = U{};
      continue;
    }
    const U* src = w + id * units;
    for (int64_t j = lane; j < units; j += 32) dst[j] = src[j];
  }
}

template <class T, class A, class I>
__global__ void scatter_add_kernel(const T* __restrict__ dout, const I* __restrict__ ids, A* __restrict__ dw, int64_t n,
                                   int64_t cols) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; i < n; i += int64_t(gridDim.x) * kWarps) {
    const T* src = dout + i * cols;
    A* dst = dw + int64_t(ids[i]) * cols;
    for (int64_t c = lane; c < cols; c += 32) atomicAdd(dst + c, A(to_acc(src[c])));
  }
}

unsigned blocks_for_rows(int64_t n) {
  int64_t b = (n + kWarps - 1) / kWarps;
  return unsigned(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

template <class U, class I>
void launch_gather(const Tensor& w, const I* ids, const Tensor& out, int64_t n, const Tensor& bad) {
  int64_t units = w.size(1) * int64_t(dtype_size(w.dtype())) / int64_t(sizeof(U));
  gather_kernel<U, I><<<blocks_for_rows(n), kThreads, 0, stream(w.device().index)>>>(
      static_cast<const U*>(w.data()), ids, static_cast<U*>(out.data()), n, w.size(0), units,
      static_cast<long long*>(bad.data()));
  LT_CUDA_CHECK_LAUNCH();
}

template <class I>
void gather(const Tensor& w, const I* ids, const Tensor& out, int64_t n, const Tensor& bad) {
  uintptr_t bits = reinterpret_cast<uintptr_t>(w.data()) | reinterpret_cast<uintptr_t>(out.data()) |
                   uintptr_t(w.size(1) * int64_t(dtype_size(w.dtype())));
  if (bits % 16 == 0)
    launch_gather<uint4>(w, ids, out, n, bad);
  else if (bits % 8 == 0)
    launch_gather<uint2>(w, ids, out, n, bad);
  else if (bits % 4 == 0)
    launch_gather<uint32_t>(w, ids, out, n, bad);
  else
    launch_gather<uint16_t>(w, ids, out, n, bad);
}

}  // namespace

void embedding_forward_cuda(const Tensor& weight, const Tensor& ids, const Tensor& out, const Tensor& bad) {
  int64_t n = ids.numel();
  if (n == 0 || weight.size(1) == 0) return;
  if (ids.dtype() == DType::I64)
    gather(weight, static_cast<const int64_t*>(ids.data()), out, n, bad);
  else
    gather(weight, static_cast<const int32_t*>(ids.data()), out, n, bad);
}

void embedding_backward_cuda(const Tensor& dout, const Tensor& ids, const Tensor& dweight) {
  int64_t n = ids.numel(), cols = dweight.size(1);
  if (n == 0 || cols == 0) return;
  cudaStream_t s = stream(dout.device().index);
  LT_DISPATCH_FLOAT_CUDA(dout.dtype(), "embedding", T, {
    using A = acc_t<T>;
    A* dw = static_cast<A*>(dweight.data());
    const T* g = static_cast<const T*>(dout.data());
    if (ids.dtype() == DType::I64)
      scatter_add_kernel<T, A, int64_t><<<blocks_for_rows(n), kThreads, 0, s>>>(
          g, static_cast<const int64_t*>(ids.data()), dw, n, cols);
    else
      scatter_add_kernel<T, A, int32_t><<<blocks_for_rows(n), kThreads, 0, s>>>(
          g, static_cast<const int32_t*>(ids.data()), dw, n, cols);
  });
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::ops_cuda
