// rms_norm kernels. Blocks of 8 warps. A row belongs to a group of W warps (W = 1, 2, 4 or 8: the
// fewest whose lanes hold the row in at most kMaxPerLane 16-byte packs each; a block serves 8 / W
// groups), so the row is read from memory once and kept in registers between its reduction and its
// output. H, the packs a lane holds, is a template parameter (1 ... kMaxPerLane) so that a row spends
// no registers on packs it does not have. Rows longer than 8 warps can hold are streamed in chunks and
// read twice (the second time mostly from cache). Scalar packs (V = 1) when C or an address rules out
// 16-byte packs.
// Forward: one row per group, as many blocks as that takes.
// Backward: as many blocks as fit on the device at once; each block takes an even slice of the rows
// and each of its groups every G-th row of the slice. A thread always sees the same columns of a row,
// so it sums its share of dweight = sum_rows dy * x * r in registers; at the end the block adds its
// groups' sums (in group order) through shared memory into one row of a (blocks, C) f32 buffer (f64
// for f64), and a second kernel sums that buffer's columns into dweight. No atomics: the result does
// not depend on timing. Streamed rows (one group per block) sum dweight in shared memory instead.
#include <climits>
#include <cstdint>
#include "core/cuda_types.cuh"
#include "ops/rms_norm_cuda.h"

namespace lintape::cuda_ops {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;
constexpr int kMaxWarps = kThreads / 32;  // per row group
constexpr int kMaxPerLane = 4;             // packs per lane and array held in registers
// Blocks per SM the backward is compiled for (it caps the registers): 3 (24 warps) when a lane holds
// at most 3 packs, which is what keeps enough loads in flight; 2 for 4 packs, which need more.
template <int H> constexpr int kBackwardBlocks = H < 4 ? 3 : 2;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// An empty asm that claims to change a held pack of 16-bit values: the compiler must then keep it as
// loaded, two values per register, across the row's reduction, instead of keeping each value unpacked
// in a register of its own (twice the registers; fewer blocks fit).
template <class T, int V> __device__ __forceinline__ void keep_packed(Pack<T, V>& p) {
  if constexpr (sizeof(T) == 2 && V % 2 == 0) {
    uint32_t* words = reinterpret_cast<uint32_t*>(p.v);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) asm volatile("" : "+r"(words[i]));
  }
}

template <class A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // the same in every lane: each step adds the same two values in both lanes of a pair
}

// Each group of a block waits on its own named barrier (1 + its index; 0 is __syncthreads's).
__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The sum of v over the `warps` warps of this thread's group; every thread of the group must call it.
template <class A> __device__ __forceinline__ A group_sum(A v, int warps, A* red) {
  v = warp_sum(v);
  if (warps == 1) return v;
  const int warp = threadIdx.x / 32, first = warp - warp % warps, id = 1 + warp / warps;
  if (threadIdx.x % 32 == 0) red[warp] = v;
  group_barrier(id, 32 * warps);
  A s = 0;
  for (int i = 0; i < warps; ++i) s += red[first + i];
  group_barrier(id, 32 * warps);  // red is written again for the next row
  return s;
}

// A thread's packs of a row are c0 + h * size (h < H) counted from its rank in the group, c0 = 0 (held
// rows: one chunk) or every multiple of the chunk (streamed rows); `left` is how many there are.
template <class T, int V, int H, bool kStreamed>
__global__ void __launch_bounds__(kThreads, 4)
    forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, acc_t<T>* __restrict__ rstd,
                   int64_t rows, int cols, int warps, acc_t<T> eps) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  __shared__ A red[kMaxWarps];
  const int size = 32 * warps, rank = threadIdx.x % size;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / size) + threadIdx.x / size;
  if (row >= rows) return;  // the whole group leaves: no barrier waits for it
  const int64_t left = cols / V - rank, chunk = int64_t(size) * H;
  const P* xr = reinterpret_cast<const P*>(x + row * cols) + rank;
  const P* wr = reinterpret_cast<const P*>(w) + rank;
  P* yr = reinterpret_cast<P*>(y + row * cols) + rank;
  P p[H];
  A ss = 0;
  for (int64_t c0 = 0; c0 < left; c0 += chunk) {
#pragma unroll
    for (int h = 0; h < H; ++h)
      if (c0 + h * size < left) p[h] = xr[c0 + h * size];
#pragma unroll
    for (int h = 0; h < H; ++h)
      if (c0 + h * size < left)
#pragma unroll
        for (int k = 0; k < V; ++k) ss += to_acc(p[h].v[k]) * to_acc(p[h].v[k]);
    if constexpr (!kStreamed) break;
  }
  const A r = A(1) / sqrt(group_sum(ss, warps, red) / A(cols) + eps);
  if (rank == 0) rstd[row] = r;
  for (int64_t c0 = 0; c0 < left; c0 += chunk) {
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const int64_t j = c0 + h * size;
      if (j >= left) continue;
      if constexpr (kStreamed) p[h] = xr[j];
      P q = wr[j], o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_acc<T>(to_acc(p[h].v[k]) * r * to_acc(q.v[k]));
      yr[j] = o;
    }
    if constexpr (!kStreamed) break;
  }
}

// dx may be null (not wanted); dw_part (gridDim.x, C) is null when dweight is not wanted. Shared memory
// holds one C-long sum per group, element k of pack j at k * packs + j so that the lanes of a warp touch
// consecutive banks.
template <class T, int V, int H, bool kStreamed>
__global__ void __launch_bounds__(kThreads, kBackwardBlocks<H>)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                    const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, acc_t<T>* __restrict__ dw_part,
                    int64_t rows, int cols, int warps) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[kMaxWarps];
  A* sdw = reinterpret_cast<A*>(smem_raw);
  const int size = 32 * warps, rank = threadIdx.x % size, group = threadIdx.x / size, groups = kThreads / size;
  const int64_t packs = cols / V, left = packs - rank, chunk = int64_t(size) * H;
  // A streamed row has one group per block, so a column is always summed by the same thread.
  if (kStreamed && dw_part) {
    for (int c = threadIdx.x; c < cols; c += kThreads) sdw[c] = 0;
    __syncthreads();
  }
  A dw[H][V] = {};  // held rows: this thread's columns, summed over its rows
  const P* wr = reinterpret_cast<const P*>(w) + rank;
  const int64_t begin = rows * blockIdx.x / gridDim.x, end = rows * (blockIdx.x + 1) / gridDim.x;
  for (int64_t row = begin + group; row < end; row += groups) {
    const A r = rstd[row];
    const P* gr = reinterpret_cast<const P*>(dy + row * cols) + rank;
    const P* xr = reinterpret_cast<const P*>(x + row * cols) + rank;
    P g[H], xv[H];
    A s = 0;
    for (int64_t c0 = 0; c0 < left; c0 += chunk) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        if (c0 + h * size >= left) continue;
        g[h] = gr[c0 + h * size];
        xv[h] = xr[c0 + h * size];
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        if (c0 + h * size >= left) continue;
        P wv = wr[c0 + h * size];
#pragma unroll
        for (int k = 0; k < V; ++k) s += to_acc(g[h].v[k]) * to_acc(wv.v[k]) * to_acc(xv[h].v[k]);
      }
      if constexpr (!kStreamed) break;
    }
    const A coef = r * r * r * group_sum(s, warps, red) / A(cols);
    if constexpr (!kStreamed) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        if (h * size >= left) continue;
        keep_packed(g[h]);
        keep_packed(xv[h]);
      }
    }
    P* dxr = dx ? reinterpret_cast<P*>(dx + row * cols) + rank : nullptr;
    for (int64_t c0 = 0; c0 < left; c0 += chunk) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const int64_t j = c0 + h * size;
        if (j >= left) continue;
        if constexpr (kStreamed) {
          g[h] = gr[j];
          xv[h] = xr[j];
        }
        P wv = wr[j], o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A gk = to_acc(g[h].v[k]), xk = to_acc(xv[h].v[k]);
          o.v[k] = from_acc<T>(r * to_acc(wv.v[k]) * gk - coef * xk);
          if constexpr (!kStreamed)
            dw[h][k] += gk * xk * r;
          else if (dw_part)
            sdw[k * packs + rank + j] += gk * xk * r;
        }
        if (dxr) dxr[j] = o;
      }
      if constexpr (!kStreamed) break;
    }
  }
  if (!dw_part) return;
  if constexpr (!kStreamed) {
#pragma unroll
    for (int h = 0; h < H; ++h)
      if (h * size < left)
#pragma unroll
        for (int k = 0; k < V; ++k) sdw[group * int64_t(cols) + k * packs + rank + h * size] = dw[h][k];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += kThreads) {
    A s = 0;
    for (int i = 0; i < groups; ++i) s += sdw[i * int64_t(cols) + (c % V) * packs + c / V];
    dw_part[blockIdx.x * int64_t(cols) + c] = s;
  }
}

// dweight = the column sums of part (parts, C). 32 threads per column each add every 32nd row, kBatch
// loads in flight at a time (parts is a few per SM: one or two batches); their sums are then added in a
// fixed order.
template <class T>
__global__ void __launch_bounds__(1024)
    sum_partials_kernel(const acc_t<T>* __restrict__ part, T* __restrict__ dw, int parts, int cols) {
  using A = acc_t<T>;
  constexpr int kBatch = 16;
  __shared__ A red[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  A s = 0;
  for (int p0 = threadIdx.y; p0 < parts && c < cols; p0 += 32 * kBatch) {
    A v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = p0 + 32 * i < parts ? part[int64_t(p0 + 32 * i) * cols + c] : A(0);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) s += v[i];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  s = 0;
  for (int i = 0; i < 32; ++i) s += red[i][threadIdx.x];
  dw[c] = from_acc<T>(s);
}

// 16-byte packs when the row length and every base address allow it.
template <class T> bool packable(int64_t cols, std::initializer_list<const Tensor*> ts) {
  if (cols % int64_t(16 / sizeof(T)) != 0) return false;
  for (const Tensor* t : ts)
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return true;
}

int sm_count(int device) {
  int n = 0;
  LT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// How a row of `packs` packs is spread: the fewest warps (up to kMaxWarps) whose lanes hold it in
// kMaxPerLane packs each, and the packs per lane that takes; longer rows are streamed by kMaxWarps.
struct Layout {
  int warps, per_lane, groups;  // per group; per lane; groups per block
  bool streamed;
  explicit Layout(int64_t packs) {
    warps = 1;
    while (warps < kMaxWarps && packs > int64_t(32) * warps * kMaxPerLane) warps *= 2;
    const int64_t h = (packs + 32 * warps - 1) / (32 * warps);
    streamed = h > kMaxPerLane;
    per_lane = int(streamed ? kMaxPerLane : h);
    groups = kMaxWarps / warps;  // 1 when streamed
  }
};

// The kernels' compile-time parameters: packs per lane, rows streamed or held.
template <int H, bool S> struct KernelShape {
  static constexpr int per_lane = H;
  static constexpr bool streamed = S;
};

// Calls f(KernelShape<...>()) for the layout.
template <class F> void with_layout(const Layout& l, F&& f) {
  static_assert(kMaxPerLane == 4, "with_layout lists 1 ... kMaxPerLane");
  if (l.streamed) return f(KernelShape<kMaxPerLane, true>());
  switch (l.per_lane) {
    case 1: return f(KernelShape<1, false>());
    case 2: return f(KernelShape<2, false>());
    case 3: return f(KernelShape<3, false>());
    default: return f(KernelShape<4, false>());
  }
}

template <class T, int V>
void forward_for(const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd, int64_t rows,
                 int cols) {
  using A = acc_t<T>;
  const Layout l(cols / V);
  with_layout(l, [&](auto k) {
    using K = decltype(k);
    forward_kernel<T, V, K::per_lane, K::streamed><<<grid_for(rows, l.groups), kThreads, 0, stream(x.device().index)>>>(
        static_cast<const T*>(x.data()), static_cast<const T*>(w.data()), static_cast<T*>(y.data()),
        static_cast<A*>(rstd.data()), rows, cols, l.warps, A(eps));
    LT_CUDA_CHECK_LAUNCH();
  });
}

template <class T, int V>
void backward_for(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dx,
                  const Tensor& dweight, int64_t rows, int cols) {
  using A = acc_t<T>;
  const int dev = x.device().index;
  const cudaStream_t s = stream(dev);
  const Layout l(cols / V);
  // One C-long dweight sum per group (a streamed row: one group per block).
  const size_t smem = dweight.defined() ? size_t(l.groups) * size_t(cols) * sizeof(A) : 0;
  with_layout(l, [&](auto k) {
    using K = decltype(k);
    auto kernel = backward_kernel<T, V, K::per_lane, K::streamed>;
    if (smem > 48 * 1024) {
      int max_smem = 0;
      LT_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      const size_t room = size_t(max_smem) - kMaxWarps * sizeof(A);
      LT_CHECK(smem <= room, "[rms_norm] the CUDA backward supports C <= ", room / sizeof(A), " for ",
               dtype_name(x.dtype()), " on this device (a block sums dweight in shared memory); got C = ", cols);
      LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    int per_sm = 0;
    LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    const int64_t fill = int64_t(per_sm < 1 ? 1 : per_sm) * sm_count(dev), need = grid_for(rows, l.groups);
    const int grid = int(need < fill ? need : fill);
    Tensor part;
    if (dweight.defined()) part = empty({grid, cols}, dtype_of<A>::value, x.device());
    kernel<<<grid, kThreads, smem, s>>>(
        static_cast<const T*>(dy.data()), static_cast<const T*>(x.data()), static_cast<const T*>(w.data()),
        static_cast<const A*>(rstd.data()), dx.defined() ? static_cast<T*>(dx.data()) : nullptr,
        part.defined() ? static_cast<A*>(part.data()) : nullptr, rows, cols, l.warps);
    LT_CUDA_CHECK_LAUNCH();
    if (!dweight.defined()) return;
    sum_partials_kernel<T><<<grid_for(cols, 32), dim3(32, 32), 0, s>>>(static_cast<const A*>(part.data()),
                                                                        static_cast<T*>(dweight.data()), grid, cols);
    LT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void rms_norm_forward_cuda(const Tensor& x, const Tensor& weight, double eps, const Tensor& y, const Tensor& rstd) {
  int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  LT_CHECK(cols <= INT_MAX, "[rms_norm] C must be < 2^31 on CUDA; got ", cols);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "rms_norm", T, {
    if (packable<T>(cols, {&x, &weight, &y}))
      forward_for<T, 16 / sizeof(T)>(x, weight, eps, y, rstd, rows, int(cols));
    else
      forward_for<T, 1>(x, weight, eps, y, rstd, rows, int(cols));
  });
}

void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            const Tensor& dx, const Tensor& dweight) {
  int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (cols == 0) return;
  if (rows == 0) {
    if (dweight.defined()) Tensor(dweight).zero_();
    return;
  }
  LT_CHECK(cols <= INT_MAX, "[rms_norm] C must be < 2^31 on CUDA; got ", cols);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "rms_norm", T, {
    if (packable<T>(cols, {&dy, &x, &weight, &dx}))
      backward_for<T, 16 / sizeof(T)>(dy, x, weight, rstd, dx, dweight, rows, int(cols));
    else
      backward_for<T, 1>(dy, x, weight, rstd, dx, dweight, rows, int(cols));
  });
}

}  // namespace lintape::cuda_ops
