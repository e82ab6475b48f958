// cross_entropy kernels. Forward: one block per row reads the row once with an online max / sum-exp
// (one exp per element), then a single block sums the row losses and counts the rows not ignored
// (linear_cross_entropy runs the row kernel per chunk of rows and the sum once).
// Backward: one block per row writes (exp(x - lse) - onehot) * dloss / count. Rows are read in 16-byte
// packs from their first 16-byte boundary on, so an odd V (50257) keeps vector loads. linear_cross_entropy
// runs both in one kernel per row (rows_gradient_kernel: the row staged in shared memory) where a row fits.
#include <algorithm>
#include <cstdint>
#include "core/cuda_async.cuh"
#include "core/cuda_types.cuh"
#include "ops/cross_entropy_cuda.h"

namespace lintape::ops_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;
constexpr int kReduceThreads = 1024;

// The running maximum starts at the lowest finite value rather than -inf, so that rows of -inf never
// evaluate exp(-inf - -inf).
template <class A> __device__ __forceinline__ A lowest();
template <> __device__ __forceinline__ float lowest<float>() { return -3.402823466e38f; }
template <> __device__ __forceinline__ double lowest<double>() { return -1.7976931348623157e308; }

// exp of a non-positive argument: the hardware approximation in f32 (its error is far below an f32
// loss's tolerance), the exact one in f64.
__device__ __forceinline__ float exp_nonpos(float v) { return __expf(v); }
__device__ __forceinline__ double exp_nonpos(double v) { return exp(v); }

// (m, s) holds sum exp(x - m) over the values seen.
template <class A> __device__ __forceinline__ void add_value(A& m, A& s, A v) {
  if (v > m) {
    s = s * exp_nonpos(m - v) + A(1);
    m = v;
  } else {
    s += exp_nonpos(v - m);
  }
}
template <class A> __device__ __forceinline__ void merge(A& m, A& s, A m2, A s2) {
  A mx = m > m2 ? m : m2;
  s = s * exp_nonpos(m - mx) + s2 * exp_nonpos(m2 - mx);
  m = mx;
}

// Elements before the first 16-byte boundary of a row (rows of odd length start anywhere).
template <class T> __device__ __forceinline__ int64_t head_of(const T* p, int64_t n) {
  int64_t h = int64_t((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16) / int64_t(sizeof(T));
  return h < n ? h : n;
}

template <class T> constexpr int kVec = 16 / sizeof(T);

// (m, s) takes a 16-byte pack: one rescale to the pack's maximum, then its exps.
template <class A, class P, int V>
__device__ __forceinline__ void add_pack(A& m, A& s, const P& p) {
  A v[V], pm = lowest<A>();
#pragma unroll
  for (int k = 0; k < V; ++k) {
    v[k] = to_acc(p.v[k]);
    pm = v[k] > pm ? v[k] : pm;
  }
  if (pm > m) {
    s *= exp_nonpos(m - pm);
    m = pm;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) s += exp_nonpos(v[k] - m);
}

// The block's (m, s) merged (each warp's by butterfly, then warp 0 over the warps'), its log-sum-exp in l.
// Every thread calls it (a barrier inside); true for the one thread (0) that holds l.
template <class A>
__device__ __forceinline__ bool block_lse(A m, A s, A* sm, A* ss, A& l) {
  for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp != 0) return false;
  const int warps = blockDim.x / 32;
  m = lane < warps ? sm[lane] : lowest<A>();
  s = lane < warps ? ss[lane] : A(0);
  for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  if (lane != 0) return false;
  l = m + log(s);
  return true;
}

// A row's loss from its log-sum-exp l and target logit xt (0 when ignored); a target out of range is recorded in
// bad as (row + 1, target), the first one only.
template <class A>
__device__ __forceinline__ A row_loss_of(int64_t t, int64_t classes, int64_t ignore_index, A l, A xt, long long* bad,
                                         int64_t global_row) {
  if (t == ignore_index) return A(0);
  if (t < 0 || t >= classes) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(bad), 0ull, (unsigned long long)(global_row + 1)) == 0ull)
      bad[1] = t;
    return A(0);
  }
  return l - xt;
}

// A row: a scalar head up to a 16-byte boundary, 16-byte packs (one rescale per pack), a scalar tail.
template <class T, class I>
__global__ void forward_rows_kernel(const T* __restrict__ logits, const I* __restrict__ targets, int64_t classes,
                                    int64_t ignore_index, acc_t<T>* __restrict__ lse, acc_t<T>* __restrict__ row_loss,
                                    long long* bad, int64_t row_offset) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>;
  using P = Pack<T, V>;
  __shared__ A sm[32], ss[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * classes;
  const int64_t head = head_of(x, classes), packs = (classes - head) / V;
  const P* xp = reinterpret_cast<const P*>(x + head);
  A m = lowest<A>(), s = 0;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) add_value(m, s, to_acc(x[i]));
#pragma unroll 2
  for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) add_pack<A, P, V>(m, s, xp[j]);
  for (int64_t i = head + packs * V + threadIdx.x; i < classes; i += blockDim.x) add_value(m, s, to_acc(x[i]));
  A l;
  if (!block_lse(m, s, sm, ss, l)) return;
  lse[row] = l;
  const int64_t t = int64_t(targets[row]);
  const bool in_range = t != ignore_index && t >= 0 && t < classes;
  row_loss[row] = row_loss_of(t, classes, ignore_index, l, in_range ? to_acc(x[t]) : A(0), bad, row_offset + row);
}

// One block: loss = sum of row losses / count (0 when count is 0). Without row losses (and loss) it only
// counts the rows not ignored.
template <class A, class I>
__global__ void forward_reduce_kernel(const A* __restrict__ row_loss, const I* __restrict__ targets, int64_t rows,
                                      int64_t ignore_index, A* __restrict__ loss, long long* __restrict__ count) {
  __shared__ A s_sum[32];
  __shared__ long long s_cnt[32];
  A sum = 0;
  long long cnt = 0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    if (int64_t(targets[i]) == ignore_index) continue;
    if (row_loss) sum += row_loss[i];
    ++cnt;
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (lane == 0) {
    s_sum[warp] = sum;
    s_cnt[warp] = cnt;
  }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x / 32;
  sum = lane < warps ? s_sum[lane] : A(0);
  cnt = lane < warps ? s_cnt[lane] : 0;
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  if (lane == 0) {
    *count = cnt;
    if (loss) *loss = cnt > 0 ? sum / A(cnt) : A(0);
  }
}

// V = 1: all scalar (dlogits and logits differ in alignment); else head, packs and tail as forward.
template <class T, int V, class I>
__global__ void backward_kernel(const acc_t<T>* __restrict__ dloss, const T* __restrict__ logits,
                                const I* __restrict__ targets, int64_t classes, int64_t ignore_index,
                                const acc_t<T>* __restrict__ lse, const long long* __restrict__ count,
                                T* __restrict__ dlogits) {
  using A = acc_t<T>;
  using P = Pack<T, V>;
  const int64_t row = blockIdx.x;
  const int64_t t = int64_t(targets[row]);
  const long long cnt = *count;
  const bool ignored = t == ignore_index || cnt == 0;
  const A scale = ignored ? A(0) : *dloss / A(cnt), l = lse[row];
  const T* x = logits + row * classes;
  T* d = dlogits + row * classes;
  auto grad = [&](A v, int64_t i) {
    return from_acc<T>(ignored ? A(0) : (exp_nonpos(v - l) - (i == t ? A(1) : A(0))) * scale);
  };
  const int64_t head = V == 1 ? classes : head_of(x, classes), packs = (classes - head) / V;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) d[i] = grad(to_acc(x[i]), i);
  const P* xp = reinterpret_cast<const P*>(x + head);
  P* dp = reinterpret_cast<P*>(d + head);
#pragma unroll 2
  for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) {
    P p = xp[j], o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = grad(to_acc(p.v[k]), head + j * V + k);
    dp[j] = o;
  }
  for (int64_t i = head + packs * V + threadIdx.x; i < classes; i += blockDim.x) d[i] = grad(to_acc(x[i]), i);
}

// The forward's row kernel and the backward kernel in one pass, in place (dlogits == logits): the row's packs are
// staged in shared memory by cp.async (each thread its own, MAXP at most, in two groups so that the first half's
// sums run while the second half lands) between the log-sum-exp and the gradient, so the logits are read once from
// global memory. The arithmetic and its order are those of forward_rows_kernel and backward_kernel: the same bits.
template <class T, class I, int MAXP>
__global__ void __launch_bounds__(kThreads, 3)
    rows_gradient_kernel(T* __restrict__ logits, const I* __restrict__ targets, int64_t classes, int64_t ignore_index,
                         acc_t<T>* __restrict__ lse, acc_t<T>* __restrict__ row_loss, long long* bad,
                         int64_t row_offset, const acc_t<T>* __restrict__ dloss, const long long* __restrict__ count) {
  using A = acc_t<T>;
  constexpr int V = kVec<T>, HALF = MAXP / 2;
  using P = Pack<T, V>;
  extern __shared__ uint4 staged[];  // the row's packs, in the row's order
  __shared__ A sm[32], ss[32], s_lse;
  const P* sp = reinterpret_cast<const P*>(staged);
  const int64_t row = blockIdx.x;
  T* x = logits + row * classes;
  const int64_t head = head_of(x, classes), packs = (classes - head) / V, tail = head + packs * V;
  const P* xp = reinterpret_cast<const P*>(x + head);
#pragma unroll
  for (int k = 0; k < MAXP; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * kThreads;
    if (j < packs) cp_async16(staged + j, xp + j);
    if (k == HALF - 1) cp_async_commit();
  }
  cp_async_commit();
  const int64_t t = int64_t(targets[row]);
  // The target's logit, read before any thread writes its gradient over the row.
  const A xt = threadIdx.x == 0 && t != ignore_index && t >= 0 && t < classes ? to_acc(x[t]) : A(0);
  // head < V and classes - tail < V: a thread holds at most one scalar of each (as the forward's loops give it).
  const int64_t hi = threadIdx.x, ti = tail + threadIdx.x;
  const A hv = hi < head ? to_acc(x[hi]) : A(0), tv = ti < classes ? to_acc(x[ti]) : A(0);
  A m = lowest<A>(), s = 0;
  if (hi < head) add_value(m, s, hv);
  cp_async_wait<1>();
#pragma unroll
  for (int k = 0; k < HALF; ++k)
    if (threadIdx.x + int64_t(k) * kThreads < packs) add_pack<A, P, V>(m, s, sp[threadIdx.x + k * kThreads]);
  cp_async_wait<0>();
#pragma unroll
  for (int k = HALF; k < MAXP; ++k)
    if (threadIdx.x + int64_t(k) * kThreads < packs) add_pack<A, P, V>(m, s, sp[threadIdx.x + k * kThreads]);
  if (ti < classes) add_value(m, s, tv);
  A lt;
  if (block_lse(m, s, sm, ss, lt)) {
    lse[row] = lt;
    s_lse = lt;
    row_loss[row] = row_loss_of(t, classes, ignore_index, lt, xt, bad, row_offset + row);
  }
  __syncthreads();
  const long long cnt = *count;
  const bool ignored = t == ignore_index || cnt == 0;
  const A scale = ignored ? A(0) : *dloss / A(cnt), l = s_lse;
  auto grad = [&](A v, int64_t i) {
    return from_acc<T>(ignored ? A(0) : (exp_nonpos(v - l) - (i == t ? A(1) : A(0))) * scale);
  };
  if (hi < head) x[hi] = grad(hv, hi);
  P* dp = reinterpret_cast<P*>(x + head);
#pragma unroll
  for (int k = 0; k < MAXP; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * kThreads;
    if (j >= packs) break;
    const P p = sp[j];
    P o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = grad(to_acc(p.v[e]), head + j * V + e);
    dp[j] = o;
  }
  if (ti < classes) x[ti] = grad(tv, ti);
}

// Rows of at most this many 16-byte packs a thread take rows_gradient_kernel (32768 classes in bf16 or f16).
constexpr int kMaxPacksPerThread = 16;

template <class T, class I>
void rows_forward(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& lse,
                  const Tensor& row_loss, const Tensor& bad, int64_t row_offset) {
  using A = acc_t<T>;
  const int64_t rows = logits.size(0), classes = logits.size(1);
  if (rows == 0) return;
  forward_rows_kernel<T, I><<<unsigned(rows), kThreads, 0, stream(logits.device().index)>>>(
      static_cast<const T*>(logits.data()), static_cast<const I*>(targets.data()), classes, ignore_index,
      static_cast<A*>(lse.data()), static_cast<A*>(row_loss.data()), static_cast<long long*>(bad.data()), row_offset);
  LT_CUDA_CHECK_LAUNCH();
}

template <class A, class I>
void reduce(const Tensor& row_loss, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
            const Tensor& count) {
  forward_reduce_kernel<A, I><<<1, kReduceThreads, 0, stream(targets.device().index)>>>(
      row_loss.defined() ? static_cast<const A*>(row_loss.data()) : nullptr, static_cast<const I*>(targets.data()),
      targets.numel(), ignore_index, loss.defined() ? static_cast<A*>(loss.data()) : nullptr,
      static_cast<long long*>(count.data()));
  LT_CUDA_CHECK_LAUNCH();
}

// Calls f.template operator()<I>() with I the targets' index type.
template <class F> void with_index_type(const Tensor& targets, F&& f) {
  if (targets.dtype() == DType::I64)
    f(int64_t{});
  else
    f(int32_t{});
}

template <class T, class I>
void backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& lse,
              const Tensor& count, const Tensor& dlogits) {
  using A = acc_t<T>;
  int64_t rows = logits.size(0), classes = logits.size(1);
  if (rows == 0) return;
  cudaStream_t s = stream(logits.device().index);
  auto launch = [&](auto kernel) {
    kernel<<<unsigned(rows), kThreads, 0, s>>>(static_cast<const A*>(dloss.data()),
                                               static_cast<const T*>(logits.data()),
                                               static_cast<const I*>(targets.data()), classes, ignore_index,
                                               static_cast<const A*>(lse.data()),
                                               static_cast<const long long*>(count.data()),
                                               static_cast<T*>(dlogits.data()));
  };
  uintptr_t skew = reinterpret_cast<uintptr_t>(dlogits.data()) - reinterpret_cast<uintptr_t>(logits.data());
  if (skew % 16 == 0)
    launch(backward_kernel<T, kVec<T>, I>);
  else
    launch(backward_kernel<T, 1, I>);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, class I>
bool rows_gradient(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& lse,
                   const Tensor& row_loss, const Tensor& bad, int64_t row_offset, const Tensor& dloss,
                   const Tensor& count) {
  using A = acc_t<T>;
  if constexpr (sizeof(T) == 8) {  // f64 keeps the two kernels
    return false;
  } else {
    const int64_t rows = logits.size(0), classes = logits.size(1);
    if (classes > int64_t(kMaxPacksPerThread) * kThreads * kVec<T>) return false;
    if (rows == 0) return true;
    // Shared memory for the row's packs (64 KiB at the longest rows, so three blocks an SM).
    const size_t smem = size_t(std::max<int64_t>(classes / kVec<T>, 1) * 16);  // packs <= classes / V
    static bool configured = false;
    if (!configured) {
      LT_CUDA_CHECK(cudaFuncSetAttribute(rows_gradient_kernel<T, I, kMaxPacksPerThread>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kMaxPacksPerThread * kThreads * 16));
      configured = true;
    }
    rows_gradient_kernel<T, I, kMaxPacksPerThread><<<unsigned(rows), kThreads, smem, stream(logits.device().index)>>>(
        static_cast<T*>(logits.data()), static_cast<const I*>(targets.data()), classes, ignore_index,
        static_cast<A*>(lse.data()), static_cast<A*>(row_loss.data()), static_cast<long long*>(bad.data()),
        row_offset, static_cast<const A*>(dloss.data()), static_cast<const long long*>(count.data()));
    LT_CUDA_CHECK_LAUNCH();
    return true;
  }
}

}  // namespace

void cross_entropy_rows_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& lse,
                             const Tensor& row_loss, const Tensor& bad, int64_t row_offset) {
  LT_DISPATCH_FLOAT_CUDA(logits.dtype(), "cross_entropy", T, {
    with_index_type(targets, [&](auto index) {
      rows_forward<T, decltype(index)>(logits, targets, ignore_index, lse, row_loss, bad, row_offset);
    });
  });
}

void cross_entropy_reduce_cuda(const Tensor& row_loss, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                               const Tensor& count, DType acc_dtype) {
  with_index_type(targets, [&](auto index) {
    using I = decltype(index);
    if (acc_dtype == DType::F64)
      reduce<double, I>(row_loss, targets, ignore_index, loss, count);
    else
      reduce<float, I>(row_loss, targets, ignore_index, loss, count);
  });
}

void cross_entropy_forward_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                                const Tensor& lse, const Tensor& count, const Tensor& bad) {
  Tensor row_loss = empty({logits.size(0)}, lse.dtype(), logits.device());
  cross_entropy_rows_cuda(logits, targets, ignore_index, lse, row_loss, bad, 0);
  cross_entropy_reduce_cuda(row_loss, targets, ignore_index, loss, count, lse.dtype());
}

void cross_entropy_backward_cuda(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                                 int64_t ignore_index, const Tensor& lse, const Tensor& count, const Tensor& dlogits) {
  LT_DISPATCH_FLOAT_CUDA(logits.dtype(), "cross_entropy", T, {
    with_index_type(targets, [&](auto index) {
      backward<T, decltype(index)>(dloss, logits, targets, ignore_index, lse, count, dlogits);
    });
  });
}

bool cross_entropy_rows_gradient_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                      const Tensor& lse, const Tensor& row_loss, const Tensor& bad, int64_t row_offset,
                                      const Tensor& dloss, const Tensor& count) {
  bool done = false;
  LT_DISPATCH_FLOAT_CUDA(logits.dtype(), "cross_entropy", T, {
    with_index_type(targets, [&](auto index) {
      done = rows_gradient<T, decltype(index)>(logits, targets, ignore_index, lse, row_loss, bad, row_offset, dloss,
                                               count);
    });
  });
  return done;
}

}  // namespace lintape::ops_cuda
