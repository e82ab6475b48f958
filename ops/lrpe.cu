// Fused LRPE kernels: act + positional encoding forward, and its backward, in one pass over memory.
//
// Layout: x is (B, N, H, D) contiguous, seen as rows of D features, one row per (b, t, h). A group of
// `lpr` lanes (a power of two <= 32) handles one (t, h) with vectors of VEC elements (16 bytes when D
// allows) for a group of g.bchunk batch rows: the angles depend on (t, h, feature) only, so each lane
// computes its cos/sin once and reuses them for every b of its group. A lane's "unit" is VEC
// consecutive angle indices j: for the cosine kinds x[j] -> out[j], out[D + j]; for rotate the pair
// x[j], x[D/2 + j] -> out[j], out[D/2 + j]. The kernels are memory-bound; the row kernels are kept within
// 64 to 80 registers, so that 24 to 32 warps per SM keep enough loads in flight.
//
// Softmax over the feature dim reduces across a row's lanes with shuffles. Softmax over the sequence is
// two-pass: a statistics kernel (online max / sum-exp per (b, N-chunk, h, d)) and a finalize kernel
// give the per-(b, h, d) log-sum-exp, which the apply kernel and the backward use. Its backward first
// sums y * dy over N the same way. Everything is computed in f32 but the angle reduction (double).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include "core/cuda_types.cuh"
#include "ops/lrpe_cuda.h"

namespace lintape::lrpe_cuda {
using namespace lintape::cuda;

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
  int64_t A;         // angle width: D for the cosine kinds, D/2 for rotate
  int64_t half;      // offset of x's second half for rotate (D/2)
  int64_t out_row;   // 2D for the cosine kinds, D for rotate
  int64_t out_half;  // offset of the second output half: D, or D/2 for rotate
  const float* theta;
  int64_t theta_stride;  // E, or 0 when theta has one row shared by all heads
  int E;
  bool rate_per_head;    // 1d theta of one column: one rate for all features of a head
  int64_t offset;
  int md_k;              // 0 for 1d; else the number of grid axes
  int64_t grid[4];
  int64_t L;             // md: tokens in front with angle 0
  const float* table;    // md cached: (2, P, H, D) cos then sin
  int64_t P;
  int act;
  int lpr;               // lanes per row
  int64_t bchunk;        // batch rows per blockIdx.y of the row kernels
  const float* lse;      // (B, H, D) log-sum-exp over N (softmax over the sequence)
  const float* q;        // (B, H, D) sum over N of y * dy (its backward)
};

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

// cos and sin of pos * rate. The product is exact in double (pos an integer below 2^29); reduced there
// to a fraction of a half turn, it keeps f32 accuracy at angles of tens of thousands of radians, and
// sincospif needs no slow path (sincosf's large-argument reduction lives in local memory). Whole turns
// are rounded off by adding and subtracting 1.5 * 2^52 (two adds on the double pipe, cheaper than rint).
__device__ __forceinline__ void angle_sincos(double pos, float rate, float& c, float& s) {
  constexpr double kRound = 0x1.8p52;
  double turns = pos * double(rate) * 0.31830988618379067;  // angle / pi
  turns -= 2.0 * ((0.5 * turns + kRound) - kRound);
  sincospif(float(turns), &s, &c);
}

// 1d: the rate of angle index j (th: the head's row of theta).
__device__ __forceinline__ float rate_1d(const Geo& g, const float* th, int64_t j) {
  return g.rate_per_head ? th[0] : (j < g.E ? th[j] : 0.f);
}

// cos/sin of angle indices j0 .. j0 + VEC - 1 of token t, head h.
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
__device__ __forceinline__ float sigmoidf(float v) { return __fdividef(1.f, 1.f + __expf(-v)); }

template <int ACT>
__device__ __forceinline__ float act_forward(float v) {
  if constexpr (ACT == kRelu) return fmaxf(v, 0.f);
  if constexpr (ACT == kSigmoid) return sigmoidf(v);
  if constexpr (ACT == kSilu) return v * sigmoidf(v);
  return v;
}

// d act(v) / dv * g for the elementwise acts.
template <int ACT>
__device__ __forceinline__ float act_backward(float v, float g) {
  if constexpr (ACT == kRelu) return v > 0.f ? g : 0.f;
  if constexpr (ACT == kSigmoid) {
    float y = sigmoidf(v);
    return g * y * (1.f - y);
  }
  if constexpr (ACT == kSilu) {
    float sg = sigmoidf(v);
    return g * sg * (1.f + v * (1.f - sg));
  }
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

// v <- exp(v - lse) for softmax over the sequence; lse of (b, h) at angle index j0 of part p.
template <int P, int VEC>
__device__ __forceinline__ void softmax_sequence(const Geo& g, int64_t b, int64_t h, int64_t j0,
                                                 float (&v)[P][VEC]) {
#pragma unroll
  for (int p = 0; p < P; ++p) {
    float l[VEC];
    load_f32<VEC>(g.lse + (b * g.H + h) * g.D + p * g.half + j0, l);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[p][e] = __expf(v[p][e] - l[e]);
  }
}

// The row kernels: one (t, h) row per lane group, the batch rows b0 .. b1 - 1 of blockIdx.y. The rows
// are grid-strided; the loops over rows and batch rows are uniform across a block, so that the softmax
// shuffles always see the whole warp. The forward with one unit per lane loads batch rows in tiles of
// two 16-byte vectors per lane, in flight together; it fits in 64 registers (32 warps per SM), rotate
// with a softmax in 80.
template <class T, int VEC, int NV, bool ROT, int CLS>
__global__ void __launch_bounds__(kThreads, NV > 1 ? 1 : ROT && (CLS == kFeature || CLS == kSequence) ? 6 : 8)
    forward_kernel(const T* __restrict__ x, T* __restrict__ out, Geo g) {
  constexpr int P = ROT ? 2 : 1, BT = NV == 1 ? 2 / P : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  const int64_t b0 = int64_t(blockIdx.y) * g.bchunk, b1 = min(g.B, b0 + g.bchunk);
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) ok[i] = row < rows && lane + i * lpr < units;
    float c[NV][VEC], s[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    for (int64_t b = b0; b < b1; b += BT) {
      // x of batch rows b .. b + BT - 1 (those below b1), every unit.
      Vec<T, VEC> raw[BT][NV][P];
#pragma unroll
      for (int k = 0; k < BT; ++k)
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (ok[i] && b + k < b1)
              raw[k][i][p] = load_raw<VEC>(x + (((b + k) * g.N + t) * g.H + h) * g.D + p * g.half +
                                           (lane + i * lpr) * VEC);
#pragma unroll
      for (int k = 0; k < BT; ++k) {
        if (b + k >= b1) break;
        float v[NV][P][VEC];
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p) to_float(raw[k][i][p], v[i][p]);
        if (feature_softmax<CLS>(g.act)) {
          softmax_feature<NV, P, VEC>(v, ok, lpr);
        } else if (sequence_softmax<CLS>(g.act)) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
            if (ok[i]) softmax_sequence<P, VEC>(g, b + k, h, int64_t(lane + i * lpr) * VEC, v[i]);
        } else if (has_act<CLS>(g.act)) {
          with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
            for (int i = 0; i < NV; ++i)
#pragma unroll
              for (int p = 0; p < P; ++p)
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[i][p][e] = act_forward<A.value>(v[i][p][e]);
          });
        }
        T* orow = out + (((b + k) * g.N + t) * g.H + h) * g.out_row;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (!ok[i]) continue;
          float o0[VEC], o1[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if constexpr (ROT) {
              o0[e] = v[i][0][e] * c[i][e] - v[i][1][e] * s[i][e];
              o1[e] = v[i][0][e] * s[i][e] + v[i][1][e] * c[i][e];
            } else {
              o0[e] = v[i][0][e] * c[i][e];
              o1[e] = v[i][0][e] * s[i][e];
            }
          }
          T* o = orow + (lane + i * lpr) * VEC;
          store<VEC>(o, o0);
          store<VEC>(o + g.out_half, o1);
        }
      }
    }
  }
}

// Backward: per batch row, dout's two halves and (behind an act) x, all in flight together. Behind an
// act the cosine kind needs up to 72 registers and rotate 80 (28 and 24 warps per SM); no act fits in 64.
template <class T, int VEC, int NV, bool ROT, int CLS>
__global__ void __launch_bounds__(kThreads, NV > 1 ? 1 : CLS == kNoAct ? 8 : ROT ? 6 : 7)
    backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, T* __restrict__ dx, Geo g) {
  constexpr int P = ROT ? 2 : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  const int64_t b0 = int64_t(blockIdx.y) * g.bchunk, b1 = min(g.B, b0 + g.bchunk);
  const bool need_x = has_act<CLS>(g.act);
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) ok[i] = row < rows && lane + i * lpr < units;
    float c[NV][VEC], s[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = (b * g.N + t) * g.H + h;
      // gr: the gradient of act(x) (the inverse rotation of dout); v: x, then y for softmax.
      float gr[NV][P][VEC], v[NV][P][VEC];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (!ok[i]) continue;
        const int64_t j0 = int64_t(lane + i * lpr) * VEC;
        const Vec<T, VEC> r0 = load_raw<VEC>(dout + r * g.out_row + j0);
        const Vec<T, VEC> r1 = load_raw<VEC>(dout + r * g.out_row + g.out_half + j0);
        Vec<T, VEC> rx[P];
        if (need_x)
#pragma unroll
          for (int p = 0; p < P; ++p) rx[p] = load_raw<VEC>(x + r * g.D + p * g.half + j0);
        float d0[VEC], d1[VEC];
        to_float(r0, d0);
        to_float(r1, d1);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          gr[i][0][e] = d0[e] * c[i][e] + d1[e] * s[i][e];
          if constexpr (ROT) gr[i][P - 1][e] = d1[e] * c[i][e] - d0[e] * s[i][e];
        }
        if (need_x)
#pragma unroll
          for (int p = 0; p < P; ++p) to_float(rx[p], v[i][p]);
      }
      if (feature_softmax<CLS>(g.act)) {
        softmax_feature<NV, P, VEC>(v, ok, lpr);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              if (ok[i]) dot += v[i][p][e] * gr[i][p][e];
        dot = group_sum(dot, lpr);
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
#pragma unroll
            for (int e = 0; e < VEC; ++e) gr[i][p][e] = v[i][p][e] * (gr[i][p][e] - dot);
      } else if (sequence_softmax<CLS>(g.act)) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (!ok[i]) continue;
          const int64_t j0 = int64_t(lane + i * lpr) * VEC;
          softmax_sequence<P, VEC>(g, b, h, j0, v[i]);
#pragma unroll
          for (int p = 0; p < P; ++p) {
            float q[VEC];
            load_f32<VEC>(g.q + (b * g.H + h) * g.D + p * g.half + j0, q);
#pragma unroll
            for (int e = 0; e < VEC; ++e) gr[i][p][e] = v[i][p][e] * (gr[i][p][e] - q[e]);
          }
        }
      } else if (need_x) {
        with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
              for (int e = 0; e < VEC; ++e) gr[i][p][e] = act_backward<A.value>(v[i][p][e], gr[i][p][e]);
        });
      }
      T* drow = dx + r * g.D;
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (ok[i]) store<VEC>(drow + p * g.half + (lane + i * lpr) * VEC, gr[i][p]);
    }
  }
}

// Softmax over the sequence, pass 1: per (column vector of the H*D plane, N-chunk, b) the max and
// sum-exp of x over the chunk's tokens; part is (2, B, C, H*D): max, then sum. Tokens come in steps of
// kStep per token lane, loaded together, so that the running sum is rescaled once per step rather than
// once per value.
template <class T, int VEC>
__global__ void __launch_bounds__(32 * kStatRows, 3)
    seq_stats_forward_kernel(const T* __restrict__ x, float* __restrict__ part, int64_t N, int64_t HD, int64_t chunk) {
  constexpr int kStep = 4;
  __shared__ float sm[2 * VEC][kStatRows][32];  // [value][token lane][column]: no bank conflicts
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.z, B = gridDim.z, C = gridDim.y;
  const int64_t t0 = blockIdx.y * chunk, t1 = min(N, t0 + chunk);
  const bool ok = col < HD / VEC;
  float m[VEC], s[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) m[e] = -INFINITY, s[e] = 0.f;
  if (ok) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kStep * kStatRows) {
      Vec<T, VEC> raw[kStep];
#pragma unroll
      for (int i = 0; i < kStep; ++i)
        if (t + i * kStatRows < t1) raw[i] = load_raw<VEC>(x + (b * N + t + i * kStatRows) * HD + col * VEC);
      float v[kStep][VEC];
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
        if (t + i * kStatRows < t1)
          to_float(raw[i], v[i]);
        else
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[i][e] = -INFINITY;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float mx = m[e];  // finite from here on: token t is always in range
#pragma unroll
        for (int i = 0; i < kStep; ++i) mx = fmaxf(mx, v[i][e]);
        float sum = s[e] * __expf(m[e] - mx);
#pragma unroll
        for (int i = 0; i < kStep; ++i) sum += __expf(v[i][e] - mx);
        m[e] = mx;
        s[e] = sum;
      }
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    sm[e][threadIdx.y][threadIdx.x] = m[e];
    sm[VEC + e][threadIdx.y][threadIdx.x] = s[e];
  }
  __syncthreads();
  if (!ok) return;
  // Each token lane now merges some of the VEC columns over all token lanes (lane 0 saw tokens, so the
  // max is finite; a lane that saw none adds 0 * exp(-inf)).
  for (int e = threadIdx.y; e < VEC; e += kStatRows) {
    float mm = -INFINITY, ss = 0.f;
    for (int y = 0; y < kStatRows; ++y) mm = fmaxf(mm, sm[e][y][threadIdx.x]);
    for (int y = 0; y < kStatRows; ++y) ss += sm[VEC + e][y][threadIdx.x] * __expf(sm[e][y][threadIdx.x] - mm);
    const int64_t at = (b * C + blockIdx.y) * HD + col * VEC + e;
    part[at] = mm;
    part[B * C * HD + at] = ss;
  }
}

// The finalize kernels: per (column of the H*D plane, b), block (32, kStatRows) with the token lanes
// taking every kStatRows-th chunk partial, then merging through shared memory.
// lse (B, H*D) = log-sum-exp over the C chunk partials (every chunk saw tokens: its max is finite).
__global__ void __launch_bounds__(32 * kStatRows)
    seq_stats_forward_finalize(const float* __restrict__ part, float* __restrict__ lse, int64_t C, int64_t HD) {
  __shared__ float sm[2][kStatRows][32];
  const int64_t k = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.y, B = gridDim.y;
  float m = -INFINITY, s = 0.f;
  if (k < HD)
    for (int64_t c = threadIdx.y; c < C; c += kStatRows) {
      const float pm = part[(b * C + c) * HD + k], ps = part[((B + b) * C + c) * HD + k];
      const float mx = fmaxf(m, pm);
      s = s * __expf(m - mx) + ps * __expf(pm - mx);
      m = mx;
    }
  sm[0][threadIdx.y][threadIdx.x] = m;
  sm[1][threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || k >= HD) return;
  float mm = -INFINITY, ss = 0.f;
  for (int y = 0; y < kStatRows; ++y) mm = fmaxf(mm, sm[0][y][threadIdx.x]);
  for (int y = 0; y < kStatRows; ++y) ss += sm[1][y][threadIdx.x] * __expf(sm[0][y][threadIdx.x] - mm);
  lse[b * HD + k] = mm + logf(ss);
}

// q (B, H*D) = the sum of the C chunk partials.
__global__ void __launch_bounds__(32 * kStatRows)
    seq_stats_backward_finalize(const float* __restrict__ part, float* __restrict__ q, int64_t C, int64_t HD) {
  __shared__ float sm[kStatRows][32];
  const int64_t k = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.y;
  float sum = 0.f;
  if (k < HD)
    for (int64_t c = threadIdx.y; c < C; c += kStatRows) sum += part[(b * C + c) * HD + k];
  sm[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || k >= HD) return;
  for (int y = 1; y < kStatRows; ++y) sum += sm[y][threadIdx.x];
  q[b * HD + k] = sum;
}

// Softmax over the sequence, backward pass 1: per (unit, N-chunk, tile of BT batch rows) the sum over
// the chunk's tokens of y * gr, gr the gradient of act(x); part is (B, C, H, D). A token's loads for the
// batch tile go out first, and its angles serve every row of the tile. In 1d a token lane's angles
// advance from token to token by a rotation of kStatRows positions (four multiply-adds instead of a
// sincos), recomputed exactly every kReseed tokens so that the rounding cannot build up.
template <class T, int VEC, bool ROT>
__global__ void __launch_bounds__(32 * kStatRows, 2)
    seq_stats_backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, float* __restrict__ part, Geo g,
                              int64_t chunk) {
  constexpr int P = ROT ? 2 : 1, BT = stat_batch_tile<VEC, ROT>(), K = BT * P * VEC, kReseed = 8;
  __shared__ float sm[K][kStatRows][32];  // [value][token lane][unit]: no bank conflicts
  const int64_t per_head = g.A / VEC, unit = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t h = unit / per_head, j0 = (unit - h * per_head) * VEC, C = gridDim.y;
  const int64_t t0 = blockIdx.y * chunk, t1 = min(g.N, t0 + chunk), b0 = int64_t(blockIdx.z) * BT;
  const bool ok = unit < g.H * per_head;
  float acc[BT][P][VEC] = {};
  if (ok) {
    const bool stepped = g.md_k == 0;
    float c[VEC], s[VEC], rc[VEC], rs[VEC];  // cos/sin of the token's angles; of the step between tokens
    if (stepped)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        angle_sincos(double(kStatRows), rate_1d(g, g.theta + h * g.theta_stride, j0 + e), rc[e], rs[e]);
    int step = 0;
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kStatRows, ++step) {
      Vec<T, VEC> raw[BT][2 + P];  // dout's two halves, then x
#pragma unroll
      for (int bb = 0; bb < BT; ++bb) {
        if (b0 + bb >= g.B) break;
        const int64_t r = ((b0 + bb) * g.N + t) * g.H + h;
        raw[bb][0] = load_raw<VEC>(dout + r * g.out_row + j0);
        raw[bb][1] = load_raw<VEC>(dout + r * g.out_row + g.out_half + j0);
#pragma unroll
        for (int p = 0; p < P; ++p) raw[bb][2 + p] = load_raw<VEC>(x + r * g.D + p * g.half + j0);
      }
      if (!stepped || step % kReseed == 0) {
        unit_sincos<VEC>(g, t, h, j0, c, s);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float cn = c[e] * rc[e] - s[e] * rs[e];
          s[e] = s[e] * rc[e] + c[e] * rs[e];
          c[e] = cn;
        }
      }
#pragma unroll
      for (int bb = 0; bb < BT; ++bb) {
        const int64_t b = b0 + bb;
        if (b >= g.B) break;
        float d0[VEC], d1[VEC], v[P][VEC];
        to_float(raw[bb][0], d0);
        to_float(raw[bb][1], d1);
#pragma unroll
        for (int p = 0; p < P; ++p) to_float(raw[bb][2 + p], v[p]);
        softmax_sequence<P, VEC>(g, b, h, j0, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          acc[bb][0][e] += v[0][e] * (d0[e] * c[e] + d1[e] * s[e]);
          if constexpr (ROT) acc[bb][P - 1][e] += v[P - 1][e] * (d1[e] * c[e] - d0[e] * s[e]);
        }
      }
    }
  }
#pragma unroll
  for (int bb = 0; bb < BT; ++bb)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int e = 0; e < VEC; ++e) sm[(bb * P + p) * VEC + e][threadIdx.y][threadIdx.x] = acc[bb][p][e];
  __syncthreads();
  if (!ok) return;
  // Each token lane now sums some of the K values over all token lanes.
  for (int k = threadIdx.y; k < K; k += kStatRows) {
    const int bb = k / (P * VEC), p = (k / VEC) % P, e = k % VEC;
    const int64_t b = b0 + bb;
    if (b >= g.B) continue;
    float sum = 0.f;
    for (int y = 0; y < kStatRows; ++y) sum += sm[k][y][threadIdx.x];
    part[((b * C + blockIdx.y) * g.H + h) * g.D + p * g.half + j0 + e] = sum;
  }
}

__global__ void table_kernel(float* __restrict__ table, Geo g) {
  const int64_t n = g.P * g.H * g.D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % g.D, r = i / g.D, h = r % g.H, p = r / g.H;
    float c[1], s[1];
    unit_sincos<1>(g, g.L + p, h, d, c, s);
    table[i] = c[0];
    table[n + i] = s[0];
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side


int act_code(const LrpeSpec& spec) {
  switch (spec.act) {
    case Act::None: return kNone;
    case Act::Relu: return kRelu;
    case Act::Sigmoid: return kSigmoid;
    case Act::Silu: return kSilu;
    case Act::Softmax: return spec.dim == ActDim::Feature ? kSoftmaxFeature : kSoftmaxSequence;
  }
  return kNone;
}

Geo make_geo(const Shape& xs, const LrpeSpec& spec) {
  const char* op = spec.name();
  const Tensor& th = spec.theta;
  LT_CHECK(th.defined() && th.dim() == 2 && th.dtype() == DType::F32 && th.is_cuda() && th.is_contiguous(), "[", op,
           "] the kernels need theta as a contiguous f32 CUDA tensor (H or 1, E)");
  Geo g{};
  g.B = xs[0], g.N = xs[1], g.H = xs[2], g.D = xs[3];
  g.A = spec.rotate() ? g.D / 2 : g.D;
  g.half = g.D / 2;
  g.out_row = spec.rotate() ? g.D : 2 * g.D;
  g.out_half = spec.rotate() ? g.D / 2 : g.D;
  g.theta = th.data_ptr<float>();
  g.E = int(th.size(1));
  g.theta_stride = th.size(0) == 1 ? 0 : th.size(1);
  g.rate_per_head = spec.rate_per_head();
  g.offset = spec.offset;
  if (spec.kind == LrpeSpec::MdCosine) {
    g.md_k = int(spec.grid.size());
    for (int a = 0; a < g.md_k; ++a) g.grid[a] = spec.grid[size_t(a)];
    g.L = spec.extra_tokens;
    g.P = g.N - g.L;
    if (spec.table.defined()) g.table = spec.table.data_ptr<float>();
  }
  g.act = act_code(spec);
  return g;
}

void check_tensor(const Tensor& t, const Shape& shape, DType dtype, Device device, const char* op, const char* name) {
  LT_CHECK(t.defined() && t.shape() == shape && t.dtype() == dtype && t.device() == device && t.is_contiguous(), "[",
           op, "] ", name, " must be ", shape_str(shape), " ", dtype_name(dtype), " contiguous on ", device.name(),
           "; got ",
           t.defined() ? str(shape_str(t.shape()), " ", dtype_name(t.dtype()), t.is_contiguous() ? "" : " strided",
                             " on ", t.device().name())
                       : std::string("an undefined tensor"));
}

void check_x(const Tensor& x, const char* op) {
  LT_CHECK(x.dim() == 4 && x.is_cuda() && x.is_contiguous(), "[", op,
           "] the kernels need x (B, N, H, D) contiguous on a CUDA device; got ", shape_str(x.shape()),
           x.is_contiguous() ? "" : " strided", " on ", x.device().name());
}

int sm_count(int device) {
  int n = 0;
  LT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// The widest vector (16 bytes at most) that divides `width` and keeps every pointer aligned.
template <class T>
int pick_vec(int64_t width, std::initializer_list<const void*> ptrs) {
  for (int vec = int(16 / sizeof(T)); vec > 1; vec /= 2) {
    bool fits = width % vec == 0;
    for (const void* p : ptrs) fits = fits && reinterpret_cast<uintptr_t>(p) % (vec * sizeof(T)) == 0;
    if (fits) return vec;
  }
  return 1;
}

// Calls fn(IC<VEC>, IC<NV>, IC<act class>) for the instantiated shapes: the full 16-byte vector with one
// unit per lane, compiled per act class; 4 units per lane, and the narrower vectors (D not a multiple of
// the full one), compiled once for every act.
template <class T, class Fn>
void with_row_shape(int vec, int nv, int act, Fn&& fn) {
  constexpr int kFull = int(16 / sizeof(T));
  if (vec == kFull && nv == 1) {
    if (act == kSoftmaxFeature) return fn(IC<kFull>(), IC<1>(), IC<kFeature>());
    if (act == kSoftmaxSequence) return fn(IC<kFull>(), IC<1>(), IC<kSequence>());
    if (act == kNone) return fn(IC<kFull>(), IC<1>(), IC<kNoAct>());
    return fn(IC<kFull>(), IC<1>(), IC<kElementwise>());
  }
  if (vec == kFull) return fn(IC<kFull>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  if constexpr (kFull > 4) {
    if (vec == 4) return fn(IC<4>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  }
  if (vec == 2) return fn(IC<2>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  return fn(IC<1>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
}

template <class T, class Fn>
void with_vec(int vec, Fn&& fn) {
  constexpr int kFull = int(16 / sizeof(T));
  if (vec == kFull) return fn(IC<kFull>());
  if constexpr (kFull > 4) {
    if (vec == 4) return fn(IC<4>());
  }
  if (vec == 2) return fn(IC<2>());
  return fn(IC<1>());
}

// Resident blocks of Kernel per SM at `threads` threads per block (asked once per kernel).
template <auto Kernel>
int blocks_per_sm(int threads) {
  static const int n = [threads] {
    int v = 0;
    LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, threads, 0));
    return std::max(v, 1);
  }();
  return n;
}

// Lanes per row (g.lpr) for rows of A / vec vectors; returns the units per lane the kernels need.
int row_lanes(Geo& g, int vec, const char* op) {
  const int64_t units = g.A / vec;
  int lpr = 1;
  while (lpr < 32 && lpr < units) lpr *= 2;
  g.lpr = lpr;
  const int64_t nv = (units + lpr - 1) / lpr;
  LT_CHECK(nv <= kMaxUnitsPerLane, "[", op, "] the fused kernels handle rows of at most ", 32 * kMaxUnitsPerLane,
           " vectors of ", vec, " elements (D up to ", (g.A == g.D ? 1 : 2) * 32 * kMaxUnitsPerLane * vec,
           " here); got D = ", g.D);
  return nv == 1 ? 1 : kMaxUnitsPerLane;
}

// The row kernels' grid: row blocks x batch groups of g.bchunk rows. A lane computes its angles once per
// row and batch group, and works through its group's rows one after the other; so the batch is split
// only as far as the GPU needs: when the row blocks fit in the resident slots, into as many groups as
// still fit in one wave (a second, partial wave would cost a whole block's latency chain); else into
// enough groups for kRowWaves waves. No group gets fewer than kGroupRows rows (the angles would cost
// more than the rows' memory traffic). batch_rows > 0 sets the group size instead (tests).
dim3 row_grid(Geo& g, int64_t slots, int64_t batch_rows) {
  const int64_t rpb = kThreads / g.lpr, row_blocks = (g.N * g.H + rpb - 1) / rpb;
  int64_t groups = row_blocks <= slots ? slots / row_blocks : (kRowWaves * slots + row_blocks - 1) / row_blocks;
  groups = std::clamp<int64_t>(groups, 1, std::max<int64_t>(1, g.B / kGroupRows));
  g.bchunk = batch_rows > 0 ? std::min(batch_rows, g.B) : (g.B + groups - 1) / groups;
  g.bchunk = std::max(g.bchunk, (g.B + 65534) / 65535);  // gridDim.y <= 65535
  groups = (g.B + g.bchunk - 1) / g.bchunk;
  return dim3(unsigned(std::min<int64_t>(row_blocks, INT_MAX)), unsigned(groups));
}

template <auto Kernel, class... Args>
void launch_rows(Geo g, int64_t batch_rows, int sms, cudaStream_t st, Args... args) {
  const dim3 grid = row_grid(g, int64_t(sms) * blocks_per_sm<Kernel>(kThreads), batch_rows);
  Kernel<<<grid, kThreads, 0, st>>>(args..., g);
  LT_CUDA_CHECK_LAUNCH();
}

// Token chunks for the statistics kernels: about kStatWaves waves of resident blocks, at least 32 tokens
// per chunk; `forced` > 0 sets the chunk instead (tests).
int64_t stat_chunks(int64_t blocks_per_chunk, int64_t N, int64_t slots, int64_t forced, int64_t& chunk) {
  const int64_t want = std::max<int64_t>(1, kStatWaves * slots / std::max<int64_t>(1, blocks_per_chunk));
  const int64_t c = std::min((N + 31) / 32, want);
  chunk = forced > 0 ? std::min(forced, N) : (N + c - 1) / c;
  return (N + chunk - 1) / chunk;
}

unsigned flat_blocks(int64_t n) { return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + 255) / 256), 4096)); }

template <class T>
void seq_stats_forward(const T* x, const Geo& g, int64_t forced_chunk, const Tensor& lse, Device dev, int sms,
                       cudaStream_t st) {
  const int64_t HD = g.H * g.D;
  const int vec = pick_vec<T>(g.D, {x});
  const int64_t gx = (HD / vec + 31) / 32;
  Tensor part;
  int64_t C = 0;
  with_vec<T>(vec, [&](auto V) {
    constexpr auto kernel = seq_stats_forward_kernel<T, V.value>;
    int64_t chunk = 0;
    C = stat_chunks(gx * g.B, g.N, int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows), forced_chunk, chunk);
    part = empty({2, g.B, C, HD}, DType::F32, dev);
    const dim3 grid{unsigned(gx), unsigned(C), unsigned(g.B)}, block{32, kStatRows};
    kernel<<<grid, block, 0, st>>>(x, part.data_ptr<float>(), g.N, HD, chunk);
    LT_CUDA_CHECK_LAUNCH();
  });
  const dim3 fgrid{unsigned((HD + 31) / 32), unsigned(g.B)}, fblock{32, kStatRows};
  seq_stats_forward_finalize<<<fgrid, fblock, 0, st>>>(part.data_ptr<float>(), lse.data_ptr<float>(), C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

// q (B, H, D) for the backward of softmax over the sequence; vec is the row kernels' vector width.
template <class T, int VEC, bool ROT>
void seq_stats_backward(const T* x, const T* dout, const Geo& g, int64_t forced_chunk, const Tensor& q, Device dev,
                        int sms, cudaStream_t st) {
  constexpr auto kernel = seq_stats_backward_kernel<T, VEC, ROT>;
  constexpr int64_t bt = stat_batch_tile<VEC, ROT>();
  const int64_t HD = g.H * g.D, gx = (g.H * (g.A / VEC) + 31) / 32, gz = (g.B + bt - 1) / bt;
  int64_t chunk = 0;
  const int64_t C =
      stat_chunks(gx * gz, g.N, int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows), forced_chunk, chunk);
  Tensor part = empty({g.B, C, HD}, DType::F32, dev);
  const dim3 grid{unsigned(gx), unsigned(C), unsigned(gz)}, block{32, kStatRows};
  kernel<<<grid, block, 0, st>>>(x, dout, part.data_ptr<float>(), g, chunk);
  LT_CUDA_CHECK_LAUNCH();
  const dim3 fgrid{unsigned((HD + 31) / 32), unsigned(g.B)}, fblock{32, kStatRows};
  seq_stats_backward_finalize<<<fgrid, fblock, 0, st>>>(part.data_ptr<float>(), q.data_ptr<float>(), C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void forward(const Tensor& x, const LrpeSpec& spec, const Tensor& out, const Tensor& stats) {
  const char* op = spec.name();
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(out, spec.out_shape(x.shape()), x.dtype(), dev, op, "out");
  if (spec.seq_softmax()) check_tensor(stats, {x.size(0), x.size(2), x.size(3)}, DType::F32, dev, op, "stats");
  Geo g = make_geo(x.shape(), spec);
  if (x.numel() == 0) return;
  const int sms = sm_count(dev.index);
  cudaStream_t st = stream(dev.index);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), op, T, {
    if constexpr (std::is_same_v<T, double>) {
      fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got f64"));
    } else {
      const T* xp = static_cast<const T*>(x.data());
      T* op_ = static_cast<T*>(out.data());
      if (spec.seq_softmax()) {
        seq_stats_forward<T>(xp, g, spec.stat_chunk, stats, dev, sms, st);
        g.lse = stats.data_ptr<float>();
      }
      const int vec = pick_vec<T>(g.A, {xp, op_});
      const int nv = row_lanes(g, vec, op);
      with_row_shape<T>(vec, nv, g.act, [&](auto V, auto NV, auto CLS) {
        if (spec.rotate())
          launch_rows<forward_kernel<T, V.value, NV.value, true, CLS.value>>(g, spec.batch_rows, sms, st, xp, op_);
        else
          launch_rows<forward_kernel<T, V.value, NV.value, false, CLS.value>>(g, spec.batch_rows, sms, st, xp, op_);
      });
    }
  });
}

void backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec, const Tensor& stats, const Tensor& dx) {
  const char* op = spec.name();
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(dout, spec.out_shape(x.shape()), x.dtype(), dev, op, "dout");
  check_tensor(dx, x.shape(), x.dtype(), dev, op, "dx");
  if (spec.seq_softmax()) check_tensor(stats, {x.size(0), x.size(2), x.size(3)}, DType::F32, dev, op, "stats");
  Geo g = make_geo(x.shape(), spec);
  if (x.numel() == 0) return;
  const int sms = sm_count(dev.index);
  cudaStream_t st = stream(dev.index);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), op, T, {
    if constexpr (std::is_same_v<T, double>) {
      fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got f64"));
    } else {
      const T* xp = static_cast<const T*>(x.data());
      const T* dp = static_cast<const T*>(dout.data());
      T* dxp = static_cast<T*>(dx.data());
      const int vec = pick_vec<T>(g.A, {xp, dp, dxp});
      Tensor q;
      if (spec.seq_softmax()) {
        g.lse = stats.data_ptr<float>();
        q = empty({g.B, g.H, g.D}, DType::F32, dev);
        with_vec<T>(vec, [&](auto V) {
          if (spec.rotate())
            seq_stats_backward<T, V.value, true>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
          else
            seq_stats_backward<T, V.value, false>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
        });
        g.q = q.data_ptr<float>();
      }
      const int nv = row_lanes(g, vec, op);
      with_row_shape<T>(vec, nv, g.act, [&](auto V, auto NV, auto CLS) {
        if (spec.rotate())
          launch_rows<backward_kernel<T, V.value, NV.value, true, CLS.value>>(g, spec.batch_rows, sms, st, xp, dp,
                                                                                dxp);
        else
          launch_rows<backward_kernel<T, V.value, NV.value, false, CLS.value>>(g, spec.batch_rows, sms, st, xp, dp,
                                                                                 dxp);
      });
    }
  });
}

void build_table(const LrpeSpec& spec, int64_t H, int64_t D, const Tensor& table) {
  LT_CHECK(spec.kind == LrpeSpec::MdCosine && !spec.table.defined(),
           "[md_lrpe_cosine] build_table needs an md spec without a table");
  int64_t P = 1;
  for (int64_t n : spec.grid) P *= n;
  check_tensor(table, {2, P, H, D}, DType::F32, spec.theta.device(), "md_lrpe_cosine", "table");
  Geo g = make_geo({1, spec.extra_tokens + P, H, D}, spec);
  if (table.numel() == 0) return;
  table_kernel<<<flat_blocks(P * H * D), 256, 0, stream(table.device().index)>>>(table.data_ptr<float>(), g);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::lrpe_cuda
