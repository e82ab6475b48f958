// Embedding gather and scatter-add: one warp per token row. The gather copies rows as raw units of
// 16 bytes where the row size and addresses allow (else 8, 4 or 2), so it needs no dtype dispatch.
// The scatter-add is deterministic: the positions are sorted by id (a stable radix sort), then one block
// per run of equal ids sums its rows in position order, so repeated ids add in the same order every run.
#include <cub/device/device_radix_sort.cuh>
#include <algorithm>
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

// keys[i] = ids[i] (rows for an id out of range: sorted last, never added), positions[i] = i.
template <class I>
__global__ void sort_keys_kernel(const I* __restrict__ ids, int32_t* __restrict__ keys, int32_t* __restrict__ positions,
                                 int64_t n, int64_t rows) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = int64_t(ids[i]);
    keys[i] = int32_t(id < 0 || id >= rows ? rows : id);
    positions[i] = int32_t(i);
  }
}

// Block b takes the sorted entries b, b + gridDim.x, ...; the first entry of each run of equal keys adds
// the run's rows of dout (in position order) into its row of dw, the block's threads over the columns.
template <class T, class A>
__global__ void segment_add_kernel(const T* __restrict__ dout, const int32_t* __restrict__ keys,
                                   const int32_t* __restrict__ positions, A* __restrict__ dw, int64_t n, int64_t cols,
                                   int64_t rows) {
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const int32_t key = keys[p];
    if (key >= rows || (p > 0 && keys[p - 1] == key)) continue;
    int64_t end = p + 1;
    while (end < n && keys[end] == key) ++end;
    A* dst = dw + int64_t(key) * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      A acc = dst[c];
      for (int64_t q = p; q < end; ++q) acc += A(to_acc(dout[int64_t(positions[q]) * cols + c]));
      dst[c] = acc;
    }
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
  const int64_t n = ids.numel(), rows = dweight.size(0), cols = dweight.size(1);
  if (n == 0 || cols == 0) return;
  LT_CHECK(n < (int64_t(1) << 31) && rows < (int64_t(1) << 31) - 1,
           "[embedding] the backward sorts 32-bit ids and positions; got ", n, " ids and ", rows, " rows");
  const Device dev = dout.device();
  cudaStream_t s = stream(dev.index);
  Tensor keys = empty({2, n}, DType::I32, dev), positions = empty({2, n}, DType::I32, dev);
  int32_t* k = keys.data_ptr<int32_t>();
  int32_t* v = positions.data_ptr<int32_t>();
  const unsigned blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  if (ids.dtype() == DType::I64)
    sort_keys_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const int64_t*>(ids.data()), k, v, n, rows);
  else
    sort_keys_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const int32_t*>(ids.data()), k, v, n, rows);
  LT_CUDA_CHECK_LAUNCH();
  int end_bit = 1;  // enough bits for the keys 0 .. rows
  while (end_bit < 31 && (int64_t(1) << end_bit) <= rows) ++end_bit;
  cub::DoubleBuffer<int32_t> key_buf(k, k + n), pos_buf(v, v + n);
  size_t temp_bytes = 0;
  LT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, key_buf, pos_buf, int(n), 0, end_bit, s));
  Tensor temp = empty({int64_t(temp_bytes / 8 + 1)}, DType::I64, dev);
  LT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, key_buf, pos_buf, int(n), 0, end_bit, s));
  const unsigned seg_blocks = unsigned(std::min<int64_t>(n, int64_t(kMaxBlocks) * 4));
  const int seg_threads = cols >= 256 ? 256 : 128;
  LT_DISPATCH_FLOAT_CUDA(dout.dtype(), "embedding", T, {
    using A = acc_t<T>;
    segment_add_kernel<T, A><<<seg_blocks, seg_threads, 0, s>>>(static_cast<const T*>(dout.data()),
                                                                 key_buf.Current(), pos_buf.Current(),
                                                                 static_cast<A*>(dweight.data()), n, cols, rows);
  });
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::ops_cuda
