// rms_norm kernels. A row belongs to a group of L lanes (L = 4, 8, ..., 256, the fewest that hold the row
// in their packs of 16 bytes; a block of 256 threads serves 256 / L rows), so the row is read from memory
// once and kept in registers between its reduction and its output, and short rows (a head of 128) keep
// every lane busy. Rows longer than 256 lanes can hold are streamed in chunks and read twice. Scalar
// loads (packs of one) when C or an address rules out 16-byte packs.
// Backward: each block owns a set of rows (grid-stride) and writes dx. dweight = sum dy * x * r: a
// lane always sees the same columns of a held row, so it sums them over its rows in registers and adds
// them into the block's shared f32 partial (f64 for f64) once at the end, the row groups in turn (streamed
// rows add each element there); a second kernel adds the per-block partials into dweight in a fixed
// order, so dweight has the same bits every run.
// add_rms_norm: the forward first forms s = x + residual (rounded to the dtype, as `add` does), writes it
// and normalises it; the backward adds the residual stream's gradient to dx before its one rounding.
#include <cstdint>
#include <type_traits>
#include "core/cuda_async.cuh"
#include "core/cuda_reduce.cuh"
#include "core/cuda_types.cuh"
#include "ops/rms_norm_cuda.h"

namespace lintape::ops_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Packs per lane held in registers (in the backward two arrays of them, plus the dweight sums): three
// 16-byte packs of bf16/f16 (so a row of 768 is one warp's), else four.
template <int V> constexpr int kHeld = V == 8 ? 3 : 4;

using cuda_device::warp_sum;

// The sum of v over the L lanes of this thread's row group; every thread of the block must call it.
template <int L, class A> __device__ __forceinline__ A group_sum(A v, A* red) {
  if constexpr (L <= 32) {
    return warp_sum<L>(v);
  } else {
    constexpr int W = L / 32;
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, first = warp / W * W;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    A s = 0;
#pragma unroll
    for (int i = 0; i < W; ++i) s += red[first + i];
    __syncthreads();  // red is reused for the next row
    return s;
  }
}

// Pack index h of chunk c0 for this thread: lanes of the group take consecutive packs.
template <int L> __device__ __forceinline__ int64_t pack_index(int64_t c0, int h) {
  return c0 + int64_t(h) * L + (threadIdx.x % L);
}

// res and sum are null for rms_norm alone; for add_rms_norm the row normalised is sum = x + res.
template <class T, int V, int L>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ sum,
                               const T* __restrict__ w, T* __restrict__ y, acc_t<T>* __restrict__ rstd, int64_t rows,
                               int64_t cols, acc_t<T> eps) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  constexpr int64_t kChunk = int64_t(L) * kHeld<V>;
  __shared__ A red[kWarps];
  const int64_t row = blockIdx.x * int64_t(kThreads / L) + threadIdx.x / L;
  const bool active = row < rows;
  const int64_t packs = cols / V;
  const bool held = packs <= kChunk;
  const P* xr = reinterpret_cast<const P*>(x + row * cols);
  const P* rr = res ? reinterpret_cast<const P*>(res + row * cols) : nullptr;
  P* sr = sum ? reinterpret_cast<P*>(sum + row * cols) : nullptr;
  const P* wr = reinterpret_cast<const P*>(w);
  P* yr = reinterpret_cast<P*>(y + row * cols);
  P p[kHeld<V>];
  A ss = 0;
  for (int64_t c0 = 0; c0 < packs; c0 += kChunk) {
#pragma unroll
    for (int h = 0; h < kHeld<V>; ++h) {
      const int64_t j = pack_index<L>(c0, h);
      if (!active || j >= packs) continue;
      p[h] = xr[j];
      if (res) {
        const P q = rr[j];
#pragma unroll
        for (int k = 0; k < V; ++k) p[h].v[k] = from_acc<T>(to_acc(p[h].v[k]) + to_acc(q.v[k]));
        sr[j] = p[h];
      }
    }
#pragma unroll
    for (int h = 0; h < kHeld<V>; ++h)
      if (active && pack_index<L>(c0, h) < packs)
#pragma unroll
        for (int k = 0; k < V; ++k) ss += to_acc(p[h].v[k]) * to_acc(p[h].v[k]);
  }
  const A r = A(1) / sqrt(group_sum<L>(ss, red) / A(cols) + eps);
  if (!active) return;
  if (threadIdx.x % L == 0) rstd[row] = r;
  for (int64_t c0 = 0; c0 < packs; c0 += kChunk) {
#pragma unroll
    for (int h = 0; h < kHeld<V>; ++h) {
      const int64_t j = pack_index<L>(c0, h);
      if (j >= packs) continue;
      if (!held) p[h] = res ? sr[j] : xr[j];  // this thread wrote sr[j] in the first pass
      P q = wr[j], o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_acc<T>(to_acc(p[h].v[k]) * r * to_acc(q.v[k]));
      yr[j] = o;
    }
  }
}

// dx may be null (not wanted); dres (the residual stream's gradient, added to dx) is null for rms_norm
// alone; dw_part (gridDim.x, C) is null when dweight is not wanted. Shared memory
// holds the block's dweight partial, element (j, k) of pack j at k * packs + j so that the lanes of a
// warp add into consecutive banks. With `stage` (held rows of 16-byte packs) it also holds two rows per
// row group of dy, x and dres: each lane copies its packs of the group's next row by cp.async while it works
// on the current one, and reads back only what it copied (no barrier).
template <class T, int V, int L>
__global__ void __launch_bounds__(kThreads, 2)
    backward_kernel(const T* __restrict__ dy, const T* __restrict__ dres, const T* __restrict__ x,
                    const T* __restrict__ w, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                    acc_t<T>* __restrict__ dw_part, int64_t rows, int64_t cols, bool stage) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  constexpr int64_t kChunk = int64_t(L) * kHeld<V>;
  constexpr int kGroups = kThreads / L;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[kWarps];
  A* sdw = reinterpret_cast<A*>(smem_raw);
  const int64_t packs = cols / V;
  const bool held = packs <= kChunk;
  if (dw_part) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sdw[c] = 0;
    __syncthreads();
  }
  A dw_held[kHeld<V>][V] = {};  // held rows: this lane's columns, summed over its rows
  const P* wr = reinterpret_cast<const P*>(w);
  const int64_t row_step = int64_t(gridDim.x) * kGroups;
  // The staged rows: this group's two buffers of [dy | x | dres] packs, after the dweight partial.
  P* staged = reinterpret_cast<P*>(smem_raw + (dw_part ? (cols * sizeof(A) + 15) / 16 * 16 : 0)) +
              (threadIdx.x / L) * 6 * packs;
  auto stage_row = [&](int64_t row, int buf) {
    if (row < rows) {
      P* b = staged + buf * 3 * packs;
#pragma unroll
      for (int h = 0; h < kHeld<V>; ++h) {
        const int64_t j = pack_index<L>(0, h);
        if (j >= packs) continue;
        cp_async16(b + j, dy + row * cols + j * V);
        cp_async16(b + packs + j, x + row * cols + j * V);
        if (dres) cp_async16(b + 2 * packs + j, dres + row * cols + j * V);
      }
    }
    cp_async_commit();  // empty past the last row: the count of groups stays the same for every lane
  };
  if (stage) stage_row(blockIdx.x * int64_t(kGroups) + threadIdx.x / L, 0);
  // The loop bound is uniform over the block: every thread reaches each group_sum.
  int it = 0;
  for (int64_t row0 = blockIdx.x * int64_t(kGroups); row0 < rows; row0 += row_step, ++it) {
    const int64_t row = row0 + threadIdx.x / L;
    const bool active = row < rows;
    const P* gr = reinterpret_cast<const P*>(dy + row * cols);
    const P* xr = reinterpret_cast<const P*>(x + row * cols);
    const A r = active ? rstd[row] : A(0);
    const P* dr = dres ? reinterpret_cast<const P*>(dres + row * cols) : nullptr;
    const P* sb = staged + (it & 1) * 3 * packs;
    if (stage) {
      stage_row(row + row_step, (it + 1) & 1);
      cp_async_wait<1>();  // this row's copies have landed
    }
    P g[kHeld<V>], xv[kHeld<V>], dv[kHeld<V>];
    A s = 0;
    for (int64_t c0 = 0; c0 < packs; c0 += kChunk) {
#pragma unroll
      for (int h = 0; h < kHeld<V>; ++h) {
        const int64_t j = pack_index<L>(c0, h);
        if (active && j < packs) {
          g[h] = stage ? sb[j] : gr[j];
          xv[h] = stage ? sb[packs + j] : xr[j];
          if (dr && held) dv[h] = stage ? sb[2 * packs + j] : dr[j];  // used after the row's sum
        }
      }
#pragma unroll
      for (int h = 0; h < kHeld<V>; ++h) {
        const int64_t j = pack_index<L>(c0, h);
        if (!active || j >= packs) continue;
        P wv = wr[j];
#pragma unroll
        for (int k = 0; k < V; ++k) s += to_acc(g[h].v[k]) * to_acc(wv.v[k]) * to_acc(xv[h].v[k]);
      }
    }
    const A coef = r * r * r * group_sum<L>(s, red) / A(cols);
    if (!active) continue;
    for (int64_t c0 = 0; c0 < packs; c0 += kChunk) {
#pragma unroll
      for (int h = 0; h < kHeld<V>; ++h) {
        const int64_t j = pack_index<L>(c0, h);
        if (j >= packs) continue;
        if (!held) {
          g[h] = gr[j];
          xv[h] = xr[j];
        }
        P wv = wr[j], o;
        if (dr && !held) dv[h] = dr[j];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A gk = to_acc(g[h].v[k]), xk = to_acc(xv[h].v[k]);
          o.v[k] = from_acc<T>(r * to_acc(wv.v[k]) * gk - coef * xk + (dr ? to_acc(dv[h].v[k]) : A(0)));
          if (dw_part && held)
            dw_held[h][k] += gk * xk * r;
          else if (dw_part)  // streamed rows: L = 256, one row group, so this lane alone owns (j, k)
            sdw[k * packs + j] += gk * xk * r;
        }
        if (dx) reinterpret_cast<P*>(dx + row * cols)[j] = o;
      }
    }
  }
  if (dw_part) {
    if (held) {
      // The row groups add their sums one after another, in group order: the same bits every run.
      for (int g = 0; g < kGroups; ++g) {
        if (threadIdx.x / L == g) {
#pragma unroll
          for (int h = 0; h < kHeld<V>; ++h) {
            const int64_t j = pack_index<L>(0, h);
            if (j < packs)
#pragma unroll
              for (int k = 0; k < V; ++k) sdw[k * packs + j] += dw_held[h][k];
          }
        }
        if (kGroups > 1) __syncthreads();
      }
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dw_part[blockIdx.x * cols + c] = sdw[(c % V) * packs + c / V];
  }
}

// dweight[c] = the sum over the blocks' partials of column c: a block of 32 x 32 threads takes 32 columns,
// each of its 32 rows of lanes a strided share of the partials, then one row adds the 32 shares. The order
// is fixed, so the result is the same every run.
constexpr int kReduceLanes = 32;

template <class T>
__global__ void __launch_bounds__(kReduceLanes * kReduceLanes)
    reduce_partials_kernel(const acc_t<T>* __restrict__ part, T* __restrict__ dw, int64_t parts, int64_t cols) {
  using A = acc_t<T>;
  __shared__ A shares[kReduceLanes][kReduceLanes + 1];
  const int64_t c = blockIdx.x * int64_t(kReduceLanes) + threadIdx.x;
  A s = 0;
  if (c < cols)
    for (int64_t b = threadIdx.y; b < parts; b += kReduceLanes) s += part[b * cols + c];
  shares[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  A total = 0;
  for (int y = 0; y < kReduceLanes; ++y) total += shares[y][threadIdx.x];
  dw[c] = from_acc<T>(total);
}

// 16-byte packs when the row length and every base address allow it.
template <class T> bool packable(int64_t cols, std::initializer_list<const Tensor*> ts) {
  if (cols % int64_t(16 / sizeof(T)) != 0) return false;
  for (const Tensor* t : ts)
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return true;
}

// The fewest lanes per row (4, 8, ..., 256) that hold the row in kHeld packs each; 256 streams longer rows.
int lanes_per_row(int64_t packs, int held) {
  for (int lanes = 4; lanes < kThreads; lanes *= 2)
    if (packs <= int64_t(lanes) * held) return lanes;
  return kThreads;
}

// Calls f(std::integral_constant<int, L>) for L = lanes_per_row(cols / V).
template <int V, class F> void with_lanes(int64_t cols, F&& f) {
  switch (lanes_per_row(cols / V, kHeld<V>)) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 256>{});
  }
}

template <class T> const T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data()) : nullptr;
}

template <class T, int V>
void forward_for(const Tensor& x, const Tensor& res, const Tensor& sum, const Tensor& w, double eps, const Tensor& y,
                 const Tensor& rstd, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  with_lanes<V>(cols, [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    forward_kernel<T, V, L><<<grid_for(rows, kThreads / L), kThreads, 0, stream(x.device().index)>>>(
        static_cast<const T*>(x.data()), data_or_null<T>(res), sum.defined() ? static_cast<T*>(sum.data()) : nullptr,
        static_cast<const T*>(w.data()), static_cast<T*>(y.data()), static_cast<A*>(rstd.data()), rows, cols, A(eps));
    LT_CUDA_CHECK_LAUNCH();
  });
}

template <class T, int V, int L>
void launch_backward(const Tensor& dy, const Tensor& dres, const Tensor& x, const Tensor& w, const Tensor& rstd,
                     const Tensor& dx, const Tensor& dweight, int64_t rows, int64_t cols) {
  using A = acc_t<T>;
  int dev = x.device().index;
  cudaStream_t s = stream(dev);
  size_t smem = 0;
  // Rows held in registers with 16-byte packs are staged (two rows of dy, x, dres per row group). On an H100 at
  // 32768 rows of 768, loading them straight took 14% longer and staging three rows 10% longer (docs/BENCHMARKS.md).
  const bool stage = sizeof(T) * V == 16 && cols / V <= int64_t(L) * kHeld<V>;
  const size_t stage_bytes = stage ? size_t(kThreads / L) * 6 * size_t(cols) * sizeof(T) : 0;
  if (dweight.defined()) {
    smem = (size_t(cols) * sizeof(A) + 15) / 16 * 16;
    int max_smem = 0;
    LT_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    LT_CHECK(smem + kWarps * sizeof(A) <= size_t(max_smem), "[rms_norm] C = ", cols,
             " is too large for the weight gradient's per-block sum (", smem,
             " bytes of shared memory; this device has ", max_smem, ")");
  }
  smem += stage_bytes;
  if (smem > 40 * 1024)
    LT_CUDA_CHECK(
        cudaFuncSetAttribute(backward_kernel<T, V, L>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // One wave of resident blocks, each over several row groups: a second, partial wave would leave most of
  // the card idle at its end, and fewer blocks mean fewer weight-gradient partials to add.
  int per_sm = 0;
  LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, backward_kernel<T, V, L>, kThreads, smem));
  const int64_t blocks = grid_for(rows, kThreads / L), cap = int64_t(per_sm > 0 ? per_sm : 1) * sm_count(dev);
  const unsigned grid = unsigned(blocks < cap ? blocks : cap);
  Tensor part;
  if (dweight.defined())
    part = empty({int64_t(grid), cols}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, x.device());
  backward_kernel<T, V, L><<<grid, kThreads, smem, s>>>(
      static_cast<const T*>(dy.data()), data_or_null<T>(dres), static_cast<const T*>(x.data()),
      static_cast<const T*>(w.data()),
      static_cast<const A*>(rstd.data()), dx.defined() ? static_cast<T*>(dx.data()) : nullptr,
      part.defined() ? static_cast<A*>(part.data()) : nullptr, rows, cols, stage);
  LT_CUDA_CHECK_LAUNCH();
  if (!dweight.defined()) return;
  reduce_partials_kernel<T><<<unsigned((cols + kReduceLanes - 1) / kReduceLanes), dim3(kReduceLanes, kReduceLanes), 0,
                              s>>>(static_cast<const A*>(part.data()), static_cast<T*>(dweight.data()), grid, cols);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int V>
void backward_for(const Tensor& dy, const Tensor& dres, const Tensor& x, const Tensor& w, const Tensor& rstd,
                  const Tensor& dx, const Tensor& dweight, int64_t rows, int64_t cols) {
  with_lanes<V>(cols, [&](auto lanes) {
    launch_backward<T, V, decltype(lanes)::value>(dy, dres, x, w, rstd, dx, dweight, rows, cols);
  });
}

}  // namespace

void rms_norm_forward_cuda(const Tensor& x, const Tensor& residual, const Tensor& sum, const Tensor& weight,
                           double eps, const Tensor& y, const Tensor& rstd) {
  int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (rows == 0) return;
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "rms_norm", T, {
    if (packable<T>(cols, {&x, &residual, &sum, &weight, &y}))
      forward_for<T, 16 / sizeof(T)>(x, residual, sum, weight, eps, y, rstd, rows, cols);
    else
      forward_for<T, 1>(x, residual, sum, weight, eps, y, rstd, rows, cols);
  });
}

void rms_norm_backward_cuda(const Tensor& dy, const Tensor& dsum, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, const Tensor& dx, const Tensor& dweight) {
  int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  if (cols == 0) return;
  if (rows == 0) {
    if (dweight.defined()) Tensor(dweight).zero_();
    return;
  }
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "rms_norm", T, {
    if (packable<T>(cols, {&dy, &dsum, &x, &weight, &dx}))
      backward_for<T, 16 / sizeof(T)>(dy, dsum, x, weight, rstd, dx, dweight, rows, cols);
    else
      backward_for<T, 1>(dy, dsum, x, weight, rstd, dx, dweight, rows, cols);
  });
}

}  // namespace lintape::ops_cuda
