// Fused FAL decoding step: one token per (b, h), S' = lambda S + kb^T vb and o = gb * (qb S').
//
// A block handles one (b, h) and a tile of kColumns state columns e. It first issues the loads of its part of
// the state, then loads the token's q, k, v and g rows, applies the acts (softmax over the feature dim reduces
// across the block) and the LRPE, all in shared memory, then updates its columns: thread (e, p-group) walks
// rows p, p + kRowGroups, ... and the p-groups' partial products are summed in a fixed order. The state is read
// and written once: the step is bound by the state's memory traffic.
#include <algorithm>
#include <cmath>
#include "core/cuda_types.cuh"
#include "ops/fal_cuda.h"

namespace lintape::fal_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kColumns = 32;   // state columns per block (one warp wide: coalesced rows of the state)
constexpr int kRowGroups = 8;  // groups of state rows, one warp each
constexpr int kThreads = kColumns * kRowGroups;
constexpr int kPrefetchRows = 32;  // state rows per thread held in registers: all of them up to P = 256

struct StepGeo {
  int H, D, E, P;
  int act_q, act_k, act_v, act_g;
  int lrpe;
  const float* theta;
  int theta_rows, theta_cols;
  int64_t position;
  const float* decay;
};

__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// act over a row of `len` values in shared memory; every thread of the block calls it.
__device__ void row_act(float* row, int len, int act, float* scratch) {
  if (act == FalStepSpec::kSoftmaxFeature) {
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
  } else if (act != FalStepSpec::kNone) {
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
      const float x = row[i];
      row[i] = act == FalStepSpec::kRelu      ? fmaxf(x, 0.0f)
               : act == FalStepSpec::kSigmoid ? 1.0f / (1.0f + __expf(-x))
                                              : x / (1.0f + __expf(-x));
    }
  }
  __syncthreads();
}

// xq, xk (D, after the acts) -> qb, kb (P): the LRPE of one token of head h. The angle is formed and reduced
// modulo 2 pi in double, so that long positions stay f32-accurate.
__device__ void rows_lrpe(const float* xq, const float* xk, float* qb, float* kb, int h, const StepGeo& g) {
  const int D = g.D;
  const int A = g.lrpe == FalStepSpec::kRotate ? D / 2 : D;
  for (int j = threadIdx.x; j < A; j += blockDim.x) {
    if (g.lrpe == FalStepSpec::kNoLrpe) {
      qb[j] = xq[j];
      kb[j] = xk[j];
      continue;
    }
    const float* rate = g.theta + (g.theta_rows == 1 ? 0 : h * g.theta_cols);
    const double r = g.theta_cols == 1 ? rate[0] : (j < g.theta_cols ? rate[j] : 0.0);
    const double a = double(g.position) * r;
    float s, c;
    sincosf(float(a - 6.283185307179586 * rint(a * 0.15915494309189535)), &s, &c);
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

template <class T>
__global__ void __launch_bounds__(kThreads)
    step_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ gate,
                const float* __restrict__ S_in, float* __restrict__ S_out, T* __restrict__ out, StepGeo g) {
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
  const int lane = threadIdx.x % kColumns, group = threadIdx.x / kColumns;
  const int e = blockIdx.y * kColumns + lane;
  const float* src = S_in + bh * P * E + e;
  // The state is loaded before the token's prologue, so that its latency hides behind it: rows group, group +
  // kRowGroups, ... up to kPrefetchRows of them; the rest stream afterwards.
  float pre[kPrefetchRows];
#pragma unroll
  for (int i = 0; i < kPrefetchRows; ++i) {
    const int p = group + i * kRowGroups;
    pre[i] = e < E && p < P ? src[int64_t(p) * E] : 0.0f;
  }
  for (int i = threadIdx.x; i < D; i += kThreads) {
    xq[i] = to_acc(q[bh * D + i]);
    xk[i] = to_acc(k[bh * D + i]);
  }
  for (int i = threadIdx.x; i < E; i += kThreads) {
    vb[i] = to_acc(v[bh * E + i]);
    gb[i] = to_acc(gate[bh * E + i]);
  }
  __syncthreads();
  row_act(xq, D, g.act_q, scratch);
  row_act(xk, D, g.act_k, scratch);
  row_act(vb, E, g.act_v, scratch);
  row_act(gb, E, g.act_g, scratch);
  rows_lrpe(xq, xk, qb, kb, h, g);
  __syncthreads();

  const float lam = g.decay ? g.decay[h] : 1.0f;
  float y = 0;
  if (e < E) {
    const float ve = vb[e];
    float* dst = S_out + bh * P * E + e;
#pragma unroll
    for (int i = 0; i < kPrefetchRows; ++i) {
      const int p = group + i * kRowGroups;
      if (p < P) {
        const float s = lam * pre[i] + kb[p] * ve;
        dst[int64_t(p) * E] = s;
        y += qb[p] * s;
      }
    }
#pragma unroll 8
    for (int p = group + kPrefetchRows * kRowGroups; p < P; p += kRowGroups) {
      const float s = lam * src[int64_t(p) * E] + kb[p] * ve;
      dst[int64_t(p) * E] = s;
      y += qb[p] * s;
    }
  }
  part[group * kColumns + lane] = y;
  __syncthreads();
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
    if (smem > 48 * 1024)
      LT_CUDA_CHECK(cudaFuncSetAttribute(step_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    step_kernel<T><<<grid, kThreads, smem, st>>>(static_cast<const T*>(q.data()), static_cast<const T*>(k.data()),
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
