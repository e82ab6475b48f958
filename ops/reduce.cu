// CUDA reductions over the middle dim of a contiguous (outer, len, inner) block (see Dims3). When
// inner == 1 each row is contiguous: a warp per row, 16-byte loads where the row allows. Otherwise the
// (o, i) columns are walked with loads coalesced across adjacent columns: sums by a thread per column
// (part), softmax and max by a block per 32 columns whose thread rows split len. Sums too short in
// rows or columns to fill the GPU are split along len: partial sums (in the accumulation type) first,
// then a second pass.
#include <algorithm>
#include <type_traits>
#include "core/cuda_types.cuh"
#include "core/cuda_reduce.cuh"
#include "ops/reduce_cuda.h"

namespace lintape::reduce {
using namespace lintape::cuda;

namespace {
constexpr int kThreads = 256;
// Enough warps (and threads) to fill 132 SMs at half occupancy: below that, a sum is split along len.
constexpr int64_t kFillWarps = 132 * 32;
constexpr int64_t kFillThreads = kFillWarps * 32;

template <class T> constexpr int kVec = 16 / int(sizeof(T));

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
unsigned blocks_for(int64_t threads) { return unsigned(std::clamp<int64_t>(ceil_div(threads, kThreads), 1, 65535)); }

#define LT_WARP_LOOP(w, count)                                                                  \
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < (count);         \
       w += int64_t(gridDim.x) * blockDim.x / 32)
#define LT_THREAD_LOOP(t, count)                                                                \
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < (count); t += int64_t(gridDim.x) * blockDim.x)

using cuda_device::warp_sum;

// Column kernels (inner > 1) run blocks of 32 x kColLanes threads over tiles of 32 adjacent columns:
// threadIdx.x picks the column, threadIdx.y splits len, and col_combine merges the kColLanes partial
// results of each column through shared memory. Loads stay coalesced across threadIdx.x.
constexpr int kColLanes = 16;
unsigned tiles_for(int64_t cols) { return unsigned(std::clamp<int64_t>(ceil_div(cols, 32), 1, 65535)); }

// Every thread of a column gets merge() of that column's kColLanes partial (u, v) pairs.
template <class U, class V, class Merge>
__device__ __forceinline__ void col_combine(U& u, V& v, Merge merge) {
  __shared__ U su[kColLanes][32];
  __shared__ V sv[kColLanes][32];
  int x = threadIdx.x, y = threadIdx.y;
  su[y][x] = u, sv[y][x] = v;
  __syncthreads();
  if (y == 0) {
    for (int k = 1; k < kColLanes; ++k) merge(u, v, su[k][x], sv[k][x]);
    su[0][x] = u, sv[0][x] = v;
  }
  __syncthreads();
  u = su[0][x], v = sv[0][x];
  __syncthreads();  // before the next tile writes su and sv again
}

// ---- sum ----

// Warp w sums part w % parts of row w / parts: elements [p * chunk, min(len, (p + 1) * chunk)).
template <int V, class T, class O>
__global__ void sum_rows_kernel(const T* x, O* out, int64_t rows, int64_t len, int64_t chunk, int64_t parts,
                                acc_t<T> scale) {
  using P = Pack<T, V>;
  int lane = threadIdx.x % 32;
  LT_WARP_LOOP(w, rows * parts) {
    int64_t begin = (w % parts) * chunk, end = min(len, begin + chunk);
    const P* row = reinterpret_cast<const P*>(x + (w / parts) * len);
    acc_t<T> acc = 0;
    for (int64_t p = begin / V + lane; p < end / V; p += 32) {
      P pk = row[p];
#pragma unroll
      for (int k = 0; k < V; ++k) acc += to_acc(pk.v[k]);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[w] = from_acc<O>(acc * scale);
  }
}

// Thread t sums part t / cols of column c = t % cols; results land as (parts, cols).
template <class T, class O>
__global__ void sum_cols_kernel(const T* x, O* out, int64_t outer, int64_t len, int64_t inner, int64_t chunk,
                                int64_t parts, acc_t<T> scale) {
  int64_t cols = outer * inner;
  LT_THREAD_LOOP(t, cols * parts) {
    int64_t c = t % cols, begin = (t / cols) * chunk, end = min(len, begin + chunk);
    const T* col = x + (c / inner) * len * inner + c % inner;
    acc_t<T> acc = 0;
#pragma unroll 4
    for (int64_t j = begin; j < end; ++j) acc += to_acc(col[j * inner]);
    out[t] = from_acc<O>(acc * scale);
  }
}

template <class T, class O>
void launch_sum_rows(const T* x, O* out, int64_t rows, int64_t len, int64_t chunk, int64_t parts, double scale,
                     cudaStream_t s) {
  unsigned blocks = blocks_for(rows * parts * 32);
  if (len % kVec<T> == 0 && chunk % kVec<T> == 0 && aligned16(x))
    sum_rows_kernel<kVec<T>><<<blocks, kThreads, 0, s>>>(x, out, rows, len, chunk, parts, acc_t<T>(scale));
  else
    sum_rows_kernel<1><<<blocks, kThreads, 0, s>>>(x, out, rows, len, chunk, parts, acc_t<T>(scale));
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, class O>
void launch_sum_cols(const T* x, O* out, Dims3 d, int64_t chunk, int64_t parts, double scale, cudaStream_t s) {
  sum_cols_kernel<<<blocks_for(d.outer * d.inner * parts), kThreads, 0, s>>>(x, out, d.outer, d.len, d.inner, chunk,
                                                                          parts, acc_t<T>(scale));
  LT_CUDA_CHECK_LAUNCH();
}

template <class T>
void sum_typed(const Tensor& out, const Tensor& x, Dims3 d, double scale) {
  using A = acc_t<T>;
  cudaStream_t s = stream(x.device().index);
  const T* px = static_cast<const T*>(x.data());
  T* po = static_cast<T*>(out.data());
  int64_t cols = d.outer * d.inner, parts = 1, chunk = d.len;
  if (d.inner == 1 && d.outer < kFillWarps && d.len > 4096) {
    parts = std::min(ceil_div(kFillWarps, d.outer), ceil_div(d.len, 2048));
    chunk = ceil_div(ceil_div(d.len, parts), kVec<T>) * kVec<T>;
  } else if (d.inner > 1 && cols < kFillThreads && d.len > 64) {
    parts = std::min(ceil_div(kFillThreads, cols), ceil_div(d.len, 32));
    chunk = ceil_div(d.len, parts);
  }
  parts = ceil_div(d.len, chunk);
  if (parts == 1) {
    if (d.inner == 1) launch_sum_rows(px, po, d.outer, d.len, d.len, 1, scale, s);
    else launch_sum_cols(px, po, d, d.len, 1, scale, s);
    return;
  }
  Tensor partial = empty({cols * parts}, std::is_same_v<A, double> ? DType::F64 : DType::F32, x.device());
  A* pp = static_cast<A*>(partial.data());
  if (d.inner == 1) {
    launch_sum_rows(px, pp, d.outer, d.len, chunk, parts, 1.0, s);  // (rows, parts)
    launch_sum_rows(static_cast<const A*>(pp), po, d.outer, parts, parts, 1, scale, s);
  } else {
    launch_sum_cols(px, pp, d, chunk, parts, 1.0, s);  // (parts, cols)
    launch_sum_cols(static_cast<const A*>(pp), po, Dims3{1, parts, cols}, parts, 1, scale, s);
  }
}

// ---- max ----

// The first maximum wins; NaN beats every number (and the first NaN every later one).
template <class A> __device__ __forceinline__ bool beats(A v, int64_t j, A best, int64_t at) {
  if (isnan(v)) return !isnan(best) || j < at;
  return v > best || (v == best && j < at);
}

template <int V, class T>
__global__ void max_rows_kernel(const T* x, T* values, int64_t* indices, int64_t rows, int64_t len) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  int lane = threadIdx.x % 32;
  LT_WARP_LOOP(w, rows) {
    const P* row = reinterpret_cast<const P*>(x + w * len);
    A best = -INFINITY;
    int64_t at = len;  // no element yet: loses every tie
    for (int64_t p = lane; p < len / V; p += 32) {
      P pk = row[p];
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (beats(to_acc(pk.v[k]), p * V + k, best, at)) best = to_acc(pk.v[k]), at = p * V + k;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      A b = __shfl_xor_sync(0xffffffffu, best, o);
      int64_t a = __shfl_xor_sync(0xffffffffu, at, o);
      if (beats(b, a, best, at)) best = b, at = a;
    }
    if (lane == 0) values[w] = from_acc<T>(best), indices[w] = at;
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kColLanes)
    max_cols_kernel(const T* x, T* values, int64_t* indices, int64_t outer, int64_t len, int64_t inner) {
  using A = acc_t<T>;
  for (int64_t tile = blockIdx.x; tile * 32 < outer * inner; tile += gridDim.x) {
    int64_t c = tile * 32 + threadIdx.x;
    bool live = c < outer * inner;
    const T* col = x + (c / inner) * len * inner + c % inner;
    A best = -INFINITY;
    int64_t at = len;
    for (int64_t j = threadIdx.y; live && j < len; j += kColLanes)
      if (beats(to_acc(col[j * inner]), j, best, at)) best = to_acc(col[j * inner]), at = j;
    col_combine(best, at, [](A& b, int64_t& a, A b2, int64_t a2) {
      if (beats(b2, a2, b, a)) b = b2, a = a2;
    });
    if (live && threadIdx.y == 0) values[c] = from_acc<T>(best), indices[c] = at;
  }
}

template <class T>
__global__ void max_backward_kernel(T* dx, const T* dy, const int64_t* indices, int64_t len, int64_t inner,
                                    int64_t n) {
  LT_THREAD_LOOP(t, n) {
    int64_t r = t / inner, k = (r / len) * inner + t % inner;
    dx[t] = indices[k] == r % len ? dy[k] : from_acc<T>(acc_t<T>(0));
  }
}

// ---- softmax ----

// Online softmax statistics: running max m and sum s of exp(x - m).
template <class A> __device__ __forceinline__ void online_add(A& m, A& s, A v) {
  if (v > m) {
    s = s * std::exp(m - v) + A(1);
    m = v;
  } else if (v != A(-INFINITY)) {  // -inf adds 0 (and would give NaN while m is -inf)
    s += std::exp(v - m);
  }
}
template <class A> __device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
  A mx = m2 > m ? m2 : m;
  if (mx == A(-INFINITY)) return;
  s = s * std::exp(m - mx) + s2 * std::exp(m2 - mx);
  m = mx;
}

template <int V, class T>
__global__ void softmax_rows_kernel(const T* x, T* y, int64_t rows, int64_t len, bool is_log) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  int lane = threadIdx.x % 32;
  LT_WARP_LOOP(w, rows) {
    const P* xr = reinterpret_cast<const P*>(x + w * len);
    P* yr = reinterpret_cast<P*>(y + w * len);
    A m = -INFINITY, s = 0;
    for (int64_t p = lane; p < len / V; p += 32) {
      P pk = xr[p];
#pragma unroll
      for (int k = 0; k < V; ++k) online_add(m, s, to_acc(pk.v[k]));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
      online_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    A inv = A(1) / s, log_s = std::log(s);
    for (int64_t p = lane; p < len / V; p += 32) {
      P pk = xr[p], out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        A v = to_acc(pk.v[k]) - m;
        out.v[k] = from_acc<T>(is_log ? v - log_s : std::exp(v) * inv);
      }
      yr[p] = out;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kColLanes) softmax_cols_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                                   int64_t outer, int64_t len, int64_t inner,
                                                                   bool is_log) {
  using A = acc_t<T>;
  for (int64_t tile = blockIdx.x; tile * 32 < outer * inner; tile += gridDim.x) {
    int64_t c = tile * 32 + threadIdx.x;
    bool live = c < outer * inner;
    int64_t base = (c / inner) * len * inner + c % inner;
    A m = -INFINITY, s = 0;
#pragma unroll 4
    for (int64_t j = threadIdx.y; live && j < len; j += kColLanes) online_add(m, s, to_acc(x[base + j * inner]));
    col_combine(m, s, [](A& m1, A& s1, A m2, A s2) { online_merge(m1, s1, m2, s2); });
    A inv = A(1) / s, log_s = std::log(s);
#pragma unroll 4
    for (int64_t j = threadIdx.y; live && j < len; j += kColLanes) {
      A v = to_acc(x[base + j * inner]) - m;
      y[base + j * inner] = from_acc<T>(is_log ? v - log_s : std::exp(v) * inv);
    }
  }
}

template <int V, class T>
__global__ void softmax_backward_rows_kernel(T* dx, const T* y, const T* dy, int64_t rows, int64_t len, bool is_log) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  int lane = threadIdx.x % 32;
  LT_WARP_LOOP(w, rows) {
    const P* yr = reinterpret_cast<const P*>(y + w * len);
    const P* gr = reinterpret_cast<const P*>(dy + w * len);
    P* dr = reinterpret_cast<P*>(dx + w * len);
    A dot = 0;  // sum(y * dy), or sum(dy) for log_softmax
    for (int64_t p = lane; p < len / V; p += 32) {
      P py = yr[p], pg = gr[p];
#pragma unroll
      for (int k = 0; k < V; ++k) dot += is_log ? to_acc(pg.v[k]) : to_acc(py.v[k]) * to_acc(pg.v[k]);
    }
    dot = warp_sum(dot);
    for (int64_t p = lane; p < len / V; p += 32) {
      P py = yr[p], pg = gr[p], out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        A yv = to_acc(py.v[k]), g = to_acc(pg.v[k]);
        out.v[k] = from_acc<T>(is_log ? g - std::exp(yv) * dot : yv * (g - dot));
      }
      dr[p] = out;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kColLanes)
    softmax_backward_cols_kernel(T* __restrict__ dx, const T* __restrict__ y, const T* __restrict__ dy, int64_t outer,
                                 int64_t len, int64_t inner, bool is_log) {
  using A = acc_t<T>;
  for (int64_t tile = blockIdx.x; tile * 32 < outer * inner; tile += gridDim.x) {
    int64_t c = tile * 32 + threadIdx.x;
    bool live = c < outer * inner;
    int64_t base = (c / inner) * len * inner + c % inner;
    A dot = 0;
    int unused = 0;
#pragma unroll 4
    for (int64_t j = threadIdx.y; live && j < len; j += kColLanes) {
      int64_t k = base + j * inner;
      dot += is_log ? to_acc(dy[k]) : to_acc(y[k]) * to_acc(dy[k]);
    }
    col_combine(dot, unused, [](A& d1, int&, A d2, int) { d1 += d2; });
#pragma unroll 4
    for (int64_t j = threadIdx.y; live && j < len; j += kColLanes) {
      int64_t k = base + j * inner;
      A yv = to_acc(y[k]), g = to_acc(dy[k]);
      dx[k] = from_acc<T>(is_log ? g - std::exp(yv) * dot : yv * (g - dot));
    }
  }
}

// 16-byte loads along rows when every row starts 16-byte aligned.
template <class T> bool rows_vectorize(int64_t len, std::initializer_list<const void*> ptrs) {
  bool ok = len % kVec<T> == 0;
  for (const void* p : ptrs) ok = ok && aligned16(p);
  return ok;
}
}  // namespace

void sum_cuda(const Tensor& out, const Tensor& x, Dims3 d, double scale) {
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "sum", T, { sum_typed<T>(out, x, d, scale); });
}

void max_cuda(const Tensor& values, const Tensor& indices, const Tensor& x, Dims3 d) {
  cudaStream_t s = stream(x.device().index);
  int64_t* pi = static_cast<int64_t*>(indices.data());
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), "max", T, {
    const T* px = static_cast<const T*>(x.data());
    T* pv = static_cast<T*>(values.data());
    unsigned rows_blocks = blocks_for(d.outer * 32);
    if (d.inner > 1)
      max_cols_kernel<<<tiles_for(d.outer * d.inner), dim3(32, kColLanes), 0, s>>>(px, pv, pi, d.outer, d.len, d.inner);
    else if (rows_vectorize<T>(d.len, {px}))
      max_rows_kernel<kVec<T>><<<rows_blocks, kThreads, 0, s>>>(px, pv, pi, d.outer, d.len);
    else
      max_rows_kernel<1><<<rows_blocks, kThreads, 0, s>>>(px, pv, pi, d.outer, d.len);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void max_backward_cuda(const Tensor& dx, const Tensor& dy, const Tensor& indices, Dims3 d) {
  int64_t n = dx.numel();
  LT_DISPATCH_FLOAT_CUDA(dx.dtype(), "max", T, {
    max_backward_kernel<<<blocks_for(n), kThreads, 0, stream(dx.device().index)>>>(
        static_cast<T*>(dx.data()), static_cast<const T*>(dy.data()), static_cast<const int64_t*>(indices.data()),
        d.len, d.inner, n);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void softmax_cuda(const Tensor& y, const Tensor& x, Dims3 d, bool log) {
  cudaStream_t s = stream(x.device().index);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), log ? "log_softmax" : "softmax", T, {
    const T* px = static_cast<const T*>(x.data());
    T* py = static_cast<T*>(y.data());
    unsigned rows_blocks = blocks_for(d.outer * 32), col_blocks = tiles_for(d.outer * d.inner);
    if (d.inner > 1)
      softmax_cols_kernel<<<col_blocks, dim3(32, kColLanes), 0, s>>>(px, py, d.outer, d.len, d.inner, log);
    else if (rows_vectorize<T>(d.len, {px, py}))
      softmax_rows_kernel<kVec<T>><<<rows_blocks, kThreads, 0, s>>>(px, py, d.outer, d.len, log);
    else
      softmax_rows_kernel<1><<<rows_blocks, kThreads, 0, s>>>(px, py, d.outer, d.len, log);
  });
  LT_CUDA_CHECK_LAUNCH();
}

void softmax_backward_cuda(const Tensor& dx, const Tensor& y, const Tensor& dy, Dims3 d, bool log) {
  cudaStream_t s = stream(dx.device().index);
  LT_DISPATCH_FLOAT_CUDA(dx.dtype(), log ? "log_softmax" : "softmax", T, {
    T* pdx = static_cast<T*>(dx.data());
    const T* py = static_cast<const T*>(y.data());
    const T* pdy = static_cast<const T*>(dy.data());
    unsigned rows_blocks = blocks_for(d.outer * 32), col_blocks = tiles_for(d.outer * d.inner);
    if (d.inner > 1)
      softmax_backward_cols_kernel<<<col_blocks, dim3(32, kColLanes), 0, s>>>(pdx, py, pdy, d.outer, d.len, d.inner,
                                                                              log);
    else if (rows_vectorize<T>(d.len, {pdx, py, pdy}))
      softmax_backward_rows_kernel<kVec<T>><<<rows_blocks, kThreads, 0, s>>>(pdx, py, pdy, d.outer, d.len, log);
    else
      softmax_backward_rows_kernel<1><<<rows_blocks, kThreads, 0, s>>>(pdx, py, pdy, d.outer, d.len, log);
  });
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::reduce
