// Fused FAL decoding step: one token per (b, h), S' = lambda S + kb^T vb and o = gb * (qb S').
//
// A block handles one (b, h) and a tile of kColumns state columns e. It first requests the token's q, k, v and
// g rows, then its part of the state; while the state arrives it applies the acts (elementwise ones as the rows
// are stored, softmax over the feature dim across the block) and the LRPE in shared memory, then updates its
// columns. A thread owns VEC adjacent columns (16-byte loads when E allows, else one): a warp covers VEC rows
// of the tile, warp w walks rows VEC w, VEC w + VEC kRowGroups, ..., and the partial products are summed in a
// fixed order (over the warp's rows by shuffles, then over the warps). The state is read and written once:
// the step is bound by the state's memory traffic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include "core/cuda_types.cuh"
#include "core/cuda_reduce.cuh"
#include "ops/fal/chunk.cuh"
#include "ops/fal/launch.h"

namespace lintape::fal_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kColumns = 32;   // state columns per block (128-byte rows of the tile)
constexpr int kRowGroups = 8;  // warps, each a group of state rows
constexpr int kThreads = 32 * kRowGroups;
constexpr int kPrefetchValues = 32;  // state values per thread held in registers: all of them up to P = 256

struct StepGeo {
  int H, D, E, P;
  int act_q, act_k, act_v, act_g;
  int lrpe;
  const float* theta;
  int theta_rows, theta_cols;
  int64_t position;
  const float* decay;
};

using cuda_device::warp_max;
using cuda_device::warp_sum;

// Softmax over a row of `len` values in shared memory, in place when act asks for it; every thread of the block
// calls it. The elementwise acts were applied as the row was loaded.
__device__ void row_softmax(float* row, int len, int act, float* scratch) {
  if (act != FalStepSpec::kSoftmaxFeature) return;
  if (threadIdx.x < 32) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < len; i += 32) m = fmaxf(m, row[i]);
    m = warp_max(m);
    float s = 0;
    for (int i = threadIdx.x; i < len; i += 32) s += __expf(row[i] - m);
    s = warp_sum(s);
    if (threadIdx.x == 0) {
      scratch[0] = m;
      scratch[1] = 1.0f / s;
    }
  }
  __syncthreads();
  const float m = scratch[0], inv = scratch[1];
  for (int i = threadIdx.x; i < len; i += blockDim.x) row[i] = __expf(row[i] - m) * inv;
  __syncthreads();
}

// The LRPE rate of feature j of head h, as the chunk kernels read it.
__device__ __forceinline__ float rate_of(const StepGeo& g, int h, int j) {
  return chunk::theta_rate(g.theta, g.theta_rows, g.theta_cols, h, j);
}

// xq, xk (D, after the acts) -> qb, kb (P): the LRPE of one token of head h, with the angles of the chunked
// kernels (chunk::angle_cs), so that a prefill and the steps after it agree. first_rate is this thread's rate
// for j = threadIdx.x, loaded early by the caller.
__device__ void rows_lrpe(const float* xq, const float* xk, float* qb, float* kb, int h, const StepGeo& g,
                          float first_rate) {
  const int D = g.D;
  const int A = g.lrpe == FalStepSpec::kRotate ? D / 2 : D;
  for (int j = threadIdx.x; j < A; j += blockDim.x) {
    if (g.lrpe == FalStepSpec::kNoLrpe) {
      qb[j] = xq[j];
      kb[j] = xk[j];
      continue;
    }
    float s, c;
    chunk::angle_cs(j == int(threadIdx.x) ? first_rate : rate_of(g, h, j), g.position, c, s);
    if (g.lrpe == FalStepSpec::kCosine) {
      qb[j] = xq[j] * c;
      qb[D + j] = xq[j] * s;
      kb[j] = xk[j] * c;
      kb[D + j] = xk[j] * s;
    } else {
      qb[j] = xq[j] * c - xq[A + j] * s;
      qb[A + j] = xq[j] * s + xq[A + j] * c;
      kb[j] = xk[j] * c - xk[A + j] * s;
      kb[A + j] = xk[j] * s + xk[A + j] * c;
    }
  }
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads)
    step_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ gate,
                const float* __restrict__ S_in, float* __restrict__ S_out, T* __restrict__ out, StepGeo g) {
  using V = std::conditional_t<VEC == 4, float4, float>;
  constexpr int kLanesPerRow = kColumns / VEC, kRowsPerPass = kRowGroups * VEC, kPasses = kPrefetchValues / VEC;
  extern __shared__ float smem[];
  const int D = g.D, E = g.E, P = g.P;
  float* qb = smem;                               // P
  float* kb = qb + P;                             // P
  float* xq = kb + P;                             // D
  float* xk = xq + D;                             // D
  float* vb = xk + D;                             // E
  float* gb = vb + E;                             // E
  float* part = gb + E;                           // kRowGroups * kColumns
  float* scratch = part + kRowGroups * kColumns;  // 2

  const int64_t bh = blockIdx.x;  // b * H + h: the token's row in (B, 1, H, .)
  const int h = int(bh % g.H);
  const int lane = threadIdx.x % 32, group = threadIdx.x / 32;
  const int e0 = blockIdx.y * kColumns + (lane % kLanesPerRow) * VEC;  // this thread's first column
  const int row0 = group * VEC + lane / kLanesPerRow;                  // and row; then every kRowsPerPass
  const bool cols_ok = e0 < E;  // E is a multiple of VEC
  const float* src = S_in + bh * P * E + e0;
  auto at = [&](const float* base, int p) { return reinterpret_cast<const V*>(base + int64_t(p) * E); };
  // The token's rows, this thread's LRPE rate and the decay are requested first: they head the prologue's
  // chain, which then runs while the state arrives. Next come up to kPrefetchValues state values a thread (the
  // rest stream afterwards). A thread's first element of q, k and of v, g waits in registers, unconverted, so
  // that nothing waits on it before the state's requests are out.
  const int i0 = threadIdx.x;
  T first[4] = {};
  if (i0 < D) first[0] = q[bh * D + i0], first[1] = k[bh * D + i0];
  if (i0 < E) first[2] = v[bh * E + i0], first[3] = gate[bh * E + i0];
  const float first_rate = g.lrpe != FalStepSpec::kNoLrpe && i0 < D ? rate_of(g, h, i0) : 0.0f;
  const float lam = g.decay ? g.decay[h] : 1.0f;
  V pre[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int p = row0 + i * kRowsPerPass;
    if (cols_ok && p < P) pre[i] = *at(src, p);
  }
  // Elementwise acts as the rows are stored; softmax (over the whole row) after the barrier.
  auto put = [](float* row, int i, float x, int act) {
    row[i] = act == FalStepSpec::kSoftmaxFeature ? x : chunk::act_f(x, act);  // the chunk kernels' acts
  };
  for (int i = i0; i < D; i += kThreads) {
    put(xq, i, to_acc(i == i0 ? first[0] : q[bh * D + i]), g.act_q);
    put(xk, i, to_acc(i == i0 ? first[1] : k[bh * D + i]), g.act_k);
  }
  for (int i = i0; i < E; i += kThreads) {
    put(vb, i, to_acc(i == i0 ? first[2] : v[bh * E + i]), g.act_v);
    put(gb, i, to_acc(i == i0 ? first[3] : gate[bh * E + i]), g.act_g);
  }
  __syncthreads();
  row_softmax(xq, D, g.act_q, scratch);
  row_softmax(xk, D, g.act_k, scratch);
  row_softmax(vb, E, g.act_v, scratch);
  row_softmax(gb, E, g.act_g, scratch);
  rows_lrpe(xq, xk, qb, kb, h, g, first_rate);
  __syncthreads();

  float y[VEC] = {};
  if (cols_ok) {
    float ve[VEC];
#pragma unroll
    for (int c = 0; c < VEC; ++c) ve[c] = vb[e0 + c];
    float* dst = S_out + bh * P * E + e0;
    auto update = [&](V in, int p) {
      float* sv = reinterpret_cast<float*>(&in);
      const float kp = kb[p], qp = qb[p];
#pragma unroll
      for (int c = 0; c < VEC; ++c) {
        sv[c] = lam * sv[c] + kp * ve[c];
        y[c] += qp * sv[c];
      }
      *reinterpret_cast<V*>(dst + int64_t(p) * E) = in;
    };
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int p = row0 + i * kRowsPerPass;
      if (p < P) update(pre[i], p);
    }
#pragma unroll 4
    for (int p = row0 + kPasses * kRowsPerPass; p < P; p += kRowsPerPass) update(*at(src, p), p);
  }
  // Sum over the warp's rows (lanes kLanesPerRow apart), then over the warps in order.
#pragma unroll
  for (int c = 0; c < VEC; ++c)
    for (int o = kLanesPerRow; o < 32; o *= 2) y[c] += __shfl_xor_sync(0xffffffffu, y[c], o);
  if (lane < kLanesPerRow)
#pragma unroll
    for (int c = 0; c < VEC; ++c) part[group * kColumns + lane * VEC + c] = y[c];
  __syncthreads();
  const int e = blockIdx.y * kColumns + lane;
  if (group == 0 && e < E) {
    float sum = 0;
    for (int r = 0; r < kRowGroups; ++r) sum += part[r * kColumns + lane];
    out[bh * E + e] = from_acc<T>(gb[e] * sum);
  }
}

}  // namespace

void step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
          const Tensor& state_in, const Tensor& state_out, const Tensor& out) {
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3), E = v.size(3), P = state_in.size(2);
  StepGeo geo{int(H),
              int(D),
              int(E),
              int(P),
              spec.act_q,
              spec.act_k,
              spec.act_v,
              spec.act_g,
              spec.lrpe,
              spec.theta.defined() ? spec.theta.data_ptr<float>() : nullptr,
              spec.theta.defined() ? int(spec.theta.size(0)) : 0,
              spec.theta.defined() ? int(spec.theta.size(1)) : 0,
              spec.position,
              spec.decay.defined() ? spec.decay.data_ptr<float>() : nullptr};
  if (B * H == 0 || E == 0) return;
  const dim3 grid(unsigned(B * H), unsigned((E + kColumns - 1) / kColumns));
  const size_t smem = sizeof(float) * size_t(2 * P + 2 * D + 2 * E + kRowGroups * kColumns + 2);
  cudaStream_t st = stream(q.device().index);
  auto launch = [&](auto type_tag) {
    using T = decltype(type_tag);
    // 16-byte state loads when every row of the state starts 16-byte aligned.
    const bool wide = E % 4 == 0 && reinterpret_cast<uintptr_t>(state_in.data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(state_out.data()) % 16 == 0;
    auto kernel = wide ? step_kernel<T, 4> : step_kernel<T, 1>;
    if (smem > 48 * 1024)
      LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kThreads, smem, st>>>(static_cast<const T*>(q.data()), static_cast<const T*>(k.data()),
                                         static_cast<const T*>(v.data()), static_cast<const T*>(g.data()),
                                         state_in.data_ptr<float>(), state_out.data_ptr<float>(),
                                         static_cast<T*>(out.data()), geo);
    LT_CUDA_CHECK_LAUNCH();
  };
  switch (q.dtype()) {
    case DType::F32: launch(float()); break;
    case DType::BF16: launch(__nv_bfloat16()); break;
    case DType::F16: launch(__half()); break;
    default: fail(str("[fal_step] the fused kernel supports f32, bf16 and f16; got ", dtype_name(q.dtype())));
  }
}

}  // namespace lintape::fal_cuda
