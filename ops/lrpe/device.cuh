// Device-side parts shared by the fused LRPE kernels (ops/lrpe/rows.cu, ops/lrpe/seq_stats.cuh): the layout
// and angle rule (Geo), vector loads and stores, the angles, the acts and the in-row softmax.
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include "core/cuda_acts.cuh"
#include "core/cuda_angle.cuh"
#include "core/cuda_types.cuh"
#include "ops/lrpe/launch.h"

namespace lintape::lrpe_cuda {
using namespace lintape::cuda;

// Internal to the LRPE kernels; each translation unit that includes this gets its own copy.
namespace {

constexpr int kThreads = 128;      // threads per block of the row kernels
constexpr int kStatRows = 8;       // token lanes per block (blockDim.y) in the sequence-statistics kernels
constexpr int kMaxUnitsPerLane = 4;
constexpr int64_t kRowWaves = 3;   // waves of resident blocks the row kernels aim for
constexpr int64_t kGroupRows = 4;  // batch rows per group of the row kernels, at least (where B allows)
constexpr int64_t kStatWaves = 4;  // waves of resident blocks in the statistics kernels

// Batch rows per thread in the backward statistics kernel: at most 4, and at most 8 sums per thread.
template <int VEC, bool ROT>
constexpr int stat_batch_tile() {
  return std::min(4, std::max(1, 8 / ((ROT ? 2 : 1) * VEC)));
}

enum ActCode : int { kNone, kRelu, kSigmoid, kSilu, kSoftmaxFeature, kSoftmaxSequence };
// What a row kernel is compiled for: no act, the elementwise acts, softmax over the feature dim, softmax
// over the sequence, or every act chosen at run time (the shapes of several units per lane or of narrow
// vectors, which are rare). A body compiled for one class keeps only the registers it needs.
enum ActClass : int { kNoAct, kElementwise, kFeature, kSequence, kAnyAct };

// The layout and the angle rule, passed by value to every kernel.
struct Geo {
  int64_t B, N, H, D;
  int64_t x_batch, x_tok, x_head;  // x's strides (x may be a view; out and dout are contiguous)
  int64_t dx_batch, dx_tok, dx_head;  // dx's strides (the backward's dx may be a view too)
  int64_t A;         // angle width: D for the cosine kinds, D/2 for rotate
  int64_t half;      // offset of x's second half for rotate (D/2)
  int64_t out_row;   // 2D for the cosine kinds, D for rotate
  int64_t out_half;  // offset of the second output half: D, or D/2 for rotate
  const float* theta;
  int64_t theta_stride;  // E, or 0 when theta has one row shared by all heads
  int E;
  bool rate_per_head;    // 1d theta of one column: one rate for all features of a head
  int64_t offset;
  const int32_t* starts; // 1d with documents: (B, N), token t of row b at offset + t - starts[b, t]; else null
  int md_k;              // 0 for 1d; else the number of grid axes
  int64_t grid[4];
  int64_t L;             // md: tokens in front with angle 0
  const float* table;    // md cached: (2, P, H, D) cos then sin
  int64_t P;
  int act;
  int lpr;               // lanes per row
  int64_t bchunk;        // batch rows per blockIdx.y of the row kernels
  const float* lse;      // (B, H, D) log-sum-exp over N (softmax over the sequence); with documents
                         // (B, N, H, D), over each document, in the row of its first token (stat_row)
  const float* q;        // (B, H, D) sum over N of y * dy (its backward); with documents as lse
};

// Where row (b, t, h) of x starts.
__device__ __forceinline__ int64_t x_row(const Geo& g, int64_t b, int64_t t, int64_t h) {
  return b * g.x_batch + t * g.x_tok + h * g.x_head;
}

template <int CLS>
__device__ __forceinline__ bool has_act(int act) {
  return CLS == kAnyAct ? act != kNone : CLS != kNoAct;
}
template <int CLS>
__device__ __forceinline__ bool feature_softmax(int act) {
  return CLS == kAnyAct ? act == kSoftmaxFeature : CLS == kFeature;
}
template <int CLS>
__device__ __forceinline__ bool sequence_softmax(int act) {
  return CLS == kAnyAct ? act == kSoftmaxSequence : CLS == kSequence;
}

template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <int VEC, class T>
__device__ __forceinline__ Vec<T, VEC> load_raw(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}

template <int VEC, class T>
__device__ __forceinline__ void to_float(const Vec<T, VEC>& r, float (&out)[VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) out[e] = to_acc(r.v[e]);
}

template <int VEC, class T>
__device__ __forceinline__ void store(T* p, const float (&in)[VEC]) {
  Vec<T, VEC> r;
#pragma unroll
  for (int e = 0; e < VEC; ++e) r.v[e] = from_acc<T>(in[e]);
  *reinterpret_cast<Vec<T, VEC>*>(p) = r;
}

// f32 side buffers (statistics, the md table), read 16 bytes at a time at most.
template <int VEC>
__device__ __forceinline__ void load_f32(const float* p, float (&out)[VEC]) {
  constexpr int W = VEC < 4 ? VEC : 4;
#pragma unroll
  for (int w = 0; w < VEC; w += W) {
    Vec<float, W> r = *reinterpret_cast<const Vec<float, W>*>(p + w);
#pragma unroll
    for (int e = 0; e < W; ++e) out[w + e] = r.v[e];
  }
}

using cuda_device::angle_sincos;

// 1d: the rate of angle index j (th: the head's row of theta).
__device__ __forceinline__ float rate_1d(const Geo& g, const float* th, int64_t j) {
  return g.rate_per_head ? th[0] : (j < g.E ? th[j] : 0.f);
}

// cos/sin of angle indices j0 .. j0 + VEC - 1 of token t, head h (1d: of position offset + t, t the
// token's place in its document).
template <int VEC>
__device__ __forceinline__ void unit_sincos(const Geo& g, int64_t t, int64_t h, int64_t j0, float (&c)[VEC],
                                            float (&s)[VEC]) {
  if (g.md_k > 0 && t < g.L) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) c[e] = 1.f, s[e] = 0.f;
    return;
  }
  if (g.table) {
    const float* tc = g.table + ((t - g.L) * g.H + h) * g.D + j0;
    load_f32<VEC>(tc, c);
    load_f32<VEC>(tc + g.P * g.H * g.D, s);
    return;
  }
  const float* th = g.theta + h * g.theta_stride;
  if (g.md_k == 0) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) angle_sincos(double(g.offset + t), rate_1d(g, th, j0 + e), c[e], s[e]);
    return;
  }
  // Grid coordinates of token t - L, row-major (the last axis varies fastest).
  double co[4] = {0, 0, 0, 0};
  int64_t rest = t - g.L;
#pragma unroll
  for (int a = 3; a >= 0; --a)
    if (a < g.md_k) {
      co[a] = double(rest % g.grid[a]);
      rest /= g.grid[a];
    }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    int j = int(j0) + e;
    int a = j / g.E;
    const double pos = a == 0 ? co[0] : a == 1 ? co[1] : a == 2 ? co[2] : co[3];
    angle_sincos(pos, th[j - a * g.E], c[e], s[e]);
  }
}

// The acts and softmax use the fast exp and division (a few ulp): per element they would otherwise
// cost more instructions than the memory traffic leaves room for.
using cuda_device::sigmoid_fast;

template <int ACT>
__device__ __forceinline__ float act_forward(float v) {
  if constexpr (ACT == kRelu) return fmaxf(v, 0.f);
  if constexpr (ACT == kSigmoid) return sigmoid_fast(v);
  if constexpr (ACT == kSilu) return v * sigmoid_fast(v);
  return v;
}

// d act(v) / dv * g for the elementwise acts.
template <int ACT>
__device__ __forceinline__ float act_backward(float v, float g) {
  if constexpr (ACT == kRelu) return v > 0.f ? g : 0.f;
  if constexpr (ACT == kSigmoid) return cuda_device::sigmoid_grad(sigmoid_fast(v), g);
  if constexpr (ACT == kSilu) return cuda_device::silu_grad(v, sigmoid_fast(v), g);
  return g;
}

template <int V>
using IC = std::integral_constant<int, V>;

// Runs f(IC<act>) for an elementwise act (nothing for none), so that the loops over elements inside f
// carry no branch on the act.
template <class F>
__device__ __forceinline__ void with_elementwise_act(int act, F&& f) {
  switch (act) {
    case kRelu: f(IC<kRelu>()); break;
    case kSigmoid: f(IC<kSigmoid>()); break;
    case kSilu: f(IC<kSilu>()); break;
    default: break;
  }
}

// Reductions across the lanes of one row group (aligned, a power of two wide); every lane of the warp
// takes part.
__device__ __forceinline__ float group_max(float v, int lpr) {
  for (int o = lpr / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float group_sum(float v, int lpr) {
  for (int o = lpr / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// v <- softmax of the row (all units of all lanes of the group); units with ok false take no part.
template <int NV, int P, int VEC>
__device__ __forceinline__ void softmax_feature(float (&v)[NV][P][VEC], const bool (&ok)[NV], int lpr) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (ok[i]) m = fmaxf(m, v[i][p][e]);
  m = group_max(m, lpr);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (ok[i]) {
          v[i][p][e] = __expf(v[i][p][e] - m);
          sum += v[i][p][e];
        }
  float inv = __fdividef(1.f, group_sum(sum, lpr));
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[i][p][e] *= inv;
}

// The row of the sequence statistics (g.lse, g.q) that token t of batch row b reads: b, or with documents
// b x N + the token's document start (one row per document, at its first token).
template <bool DOCS>
__device__ __forceinline__ int64_t stat_row(const Geo& g, int64_t b, int64_t start) {
  return DOCS ? b * g.N + start : b;
}

// v <- exp(v - lse) for softmax over the sequence; lse of statistics row srow (stat_row), head h, at angle
// index j0 of part p.
template <int P, int VEC>
__device__ __forceinline__ void softmax_sequence(const Geo& g, int64_t srow, int64_t h, int64_t j0,
                                                 float (&v)[P][VEC]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
    float l[VEC];
    load_f32<VEC>(g.lse + (srow * g.H + h) * g.D + p * g.half + j0, l);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[p][e] = __expf(v[p][e] - l[e]);
  }
}

// The angles one token on: (c, s) rotated by the angles of one step, (rc, rs).
template <int VEC>
__device__ __forceinline__ void advance_sincos(float (&c)[VEC], float (&s)[VEC], const float (&rc)[VEC],
                                               const float (&rs)[VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float cn = c[e] * rc[e] - s[e] * rs[e];
    s[e] = s[e] * rc[e] + c[e] * rs[e];
    c[e] = cn;
  }
}

// The sequence statistics' running max m and sum s of exp(x - m), per lane element, over kStep more tokens v.
template <int kStep, int VEC>
__device__ __forceinline__ void running_max_sum(float (&m)[VEC], float (&s)[VEC], const float (&v)[kStep][VEC]) {
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    float mx = m[e];
#pragma unroll
    for (int i = 0; i < kStep; ++i) mx = fmaxf(mx, v[i][e]);
    float sum = s[e] * __expf(m[e] - mx);
#pragma unroll
    for (int i = 0; i < kStep; ++i) sum += __expf(v[i][e] - mx);
    m[e] = mx;
    s[e] = sum;
  }
}

}  // namespace
}  // namespace lintape::lrpe_cuda
