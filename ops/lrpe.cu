// Fused LRPE kernels: act + positional encoding forward, and its backward, in one pass over memory.
//
// Layout: x is (B, N, H, D) contiguous, seen as rows of D features, one row per (b, t, h). A group of
// `lpr` lanes (a power of two <= 32) handles one (t, h) with vectors of VEC elements (16 bytes when D
// allows) and loops over the batch: the angles depend on (t, h, feature) only, so each lane computes its
// cos/sin once and reuses them for every b. A lane's "unit" is VEC consecutive angle indices j: for the
// cosine kinds x[j] -> out[j], out[D + j]; for rotate the pair x[j], x[D/2 + j] -> out[j], out[D/2 + j].
//
// Softmax over the feature dim reduces across a row's lanes with shuffles. Softmax over the sequence is
// two-pass: a statistics kernel (online max / sum-exp per (b, N-chunk, h, d)) and a finalize kernel
// give the per-(b, h, d) log-sum-exp, which the apply kernel and the backward use. Its backward first
// sums y * dy over N the same way. Everything is computed in f32 but the angle reduction (double).
#include <cstdint>
#include <type_traits>
#include "core/cuda_types.cuh"
#include "ops/lrpe_cuda.h"

namespace lintape::lrpe_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;  // threads per block of the row kernels
constexpr int kStatRows = 8;   // token lanes per block (blockDim.y) in the sequence-statistics kernels
constexpr int kBatchTile = 2;  // batch elements per thread in the backward statistics kernel
constexpr int kMaxUnitsPerLane = 4;

enum ActCode : int { kNone, kRelu, kSigmoid, kSilu, kSoftmaxFeature, kSoftmaxSequence };

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
  const float* lse;      // (B, H, D) log-sum-exp over N (softmax over the sequence)
  const float* q;        // (B, H, D) sum over N of y * dy (its backward)
};

template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <int VEC, class T>
__device__ __forceinline__ void load(const T* p, float (&out)[VEC]) {
  Vec<T, VEC> r = *reinterpret_cast<const Vec<T, VEC>*>(p);
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
// sincospif needs no slow path (sincosf's large-argument reduction lives in local memory).
__device__ __forceinline__ void angle_sincos(double pos, float rate, float& c, float& s) {
  double turns = pos * double(rate) * 0.31830988618379067;  // angle / pi
  turns -= 2.0 * rint(0.5 * turns);
  sincospif(float(turns), &s, &c);
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
    const double pos = double(g.offset + t);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      int64_t j = j0 + e;
      float rate = g.rate_per_head ? th[0] : (j < g.E ? th[j] : 0.f);
      angle_sincos(pos, rate, c[e], s[e]);
    }
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

// Launch bounds: one unit per lane fits in 64 registers, so four blocks share an SM; more units, or the
// rotate backward, need more registers and get fewer blocks.
template <class T, int VEC, int NV, bool ROT>
__global__ void __launch_bounds__(kThreads, NV == 1 ? 4 : 1)
    forward_kernel(const T* __restrict__ x, T* __restrict__ out, Geo g) {
  constexpr int P = ROT ? 2 : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
    float c[NV][VEC], s[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      ok[i] = row < rows && lane + i * lpr < units;
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    }
    for (int64_t b = blockIdx.y; b < g.B; b += gridDim.y) {
      const int64_t r = (b * g.N + t) * g.H + h;
      float v[NV][P][VEC];
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (ok[i]) load<VEC>(x + r * g.D + p * g.half + (lane + i * lpr) * VEC, v[i][p]);
      if (g.act == kSoftmaxFeature) {
        softmax_feature<NV, P, VEC>(v, ok, lpr);
      } else if (g.act == kSoftmaxSequence) {
#pragma unroll
        for (int i = 0; i < NV; ++i)
          if (ok[i]) softmax_sequence<P, VEC>(g, b, h, int64_t(lane + i * lpr) * VEC, v[i]);
      } else {
        with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
              for (int e = 0; e < VEC; ++e) v[i][p][e] = act_forward<A.value>(v[i][p][e]);
        });
      }
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
        T* o = out + r * g.out_row + (lane + i * lpr) * VEC;
        store<VEC>(o, o0);
        store<VEC>(o + g.out_half, o1);
      }
    }
  }
}

template <class T, int VEC, int NV, bool ROT>
__global__ void __launch_bounds__(kThreads, NV == 1 ? (ROT ? 2 : 4) : 1)
    backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, T* __restrict__ dx, Geo g) {
  constexpr int P = ROT ? 2 : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
    float c[NV][VEC], s[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      ok[i] = row < rows && lane + i * lpr < units;
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    }
    for (int64_t b = blockIdx.y; b < g.B; b += gridDim.y) {
      const int64_t r = (b * g.N + t) * g.H + h;
      // gr: the gradient of act(x) (the inverse rotation of dout); v: x, then y for softmax.
      float gr[NV][P][VEC], v[NV][P][VEC];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (!ok[i]) continue;
        const int64_t j0 = int64_t(lane + i * lpr) * VEC;
        float d0[VEC], d1[VEC];
        load<VEC>(dout + r * g.out_row + j0, d0);
        load<VEC>(dout + r * g.out_row + g.out_half + j0, d1);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          gr[i][0][e] = d0[e] * c[i][e] + d1[e] * s[i][e];
          if constexpr (ROT) gr[i][P - 1][e] = d1[e] * c[i][e] - d0[e] * s[i][e];
        }
        if (g.act != kNone)
#pragma unroll
          for (int p = 0; p < P; ++p) load<VEC>(x + r * g.D + p * g.half + j0, v[i][p]);
      }
      if (g.act == kSoftmaxFeature) {
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
      } else if (g.act == kSoftmaxSequence) {
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
      } else {
        with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
              for (int e = 0; e < VEC; ++e) gr[i][p][e] = act_backward<A.value>(v[i][p][e], gr[i][p][e]);
        });
      }
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (ok[i]) store<VEC>(dx + r * g.D + p * g.half + (lane + i * lpr) * VEC, gr[i][p]);
    }
  }
}

// Softmax over the sequence, pass 1: per (column vector of the H*D plane, N-chunk, b) the max and
// sum-exp of x over the chunk's tokens; part is (2, B, C, H*D): max, then sum. Tokens come in steps of
// kStep per token lane, so that the running sum is rescaled once per step rather than once per value.
template <class T, int VEC>
__global__ void __launch_bounds__(32 * kStatRows, 3)
    seq_stats_forward_kernel(const T* __restrict__ x, float* __restrict__ part, int64_t N, int64_t HD, int64_t chunk) {
  constexpr int kStep = 4;
  __shared__ float sm[kStatRows][32][2 * VEC];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.z, B = gridDim.z, C = gridDim.y;
  const int64_t t0 = blockIdx.y * chunk, t1 = min(N, t0 + chunk);
  const bool ok = col < HD / VEC;
  float m[VEC], s[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) m[e] = -INFINITY, s[e] = 0.f;
  if (ok) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kStep * kStatRows) {
      float v[kStep][VEC];
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
        const int64_t ti = t + i * kStatRows;
        if (ti < t1)
          load<VEC>(x + (b * N + ti) * HD + col * VEC, v[i]);
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
    sm[threadIdx.y][threadIdx.x][e] = m[e];
    sm[threadIdx.y][threadIdx.x][VEC + e] = s[e];
  }
  __syncthreads();
  if (!ok) return;
  // Each token lane now merges some of the VEC columns over all token lanes (lane 0 saw tokens, so the
  // max is finite; a lane that saw none adds 0 * exp(-inf)).
  for (int e = threadIdx.y; e < VEC; e += kStatRows) {
    float mm = -INFINITY, ss = 0.f;
    for (int y = 0; y < kStatRows; ++y) mm = fmaxf(mm, sm[y][threadIdx.x][e]);
    for (int y = 0; y < kStatRows; ++y) ss += sm[y][threadIdx.x][VEC + e] * __expf(sm[y][threadIdx.x][e] - mm);
    const int64_t at = (b * C + blockIdx.y) * HD + col * VEC + e;
    part[at] = mm;
    part[B * C * HD + at] = ss;
  }
}

// lse (B, H*D) = log-sum-exp over the C chunk partials (every chunk saw tokens: its max is finite).
__global__ void seq_stats_forward_finalize(const float* __restrict__ part, float* __restrict__ lse, int64_t B,
                                           int64_t C, int64_t HD) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < B * HD; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / HD, k = i - b * HD;
    const float* pm = part + b * C * HD + k;
    const float* ps = pm + B * C * HD;
    float m = -INFINITY, s = 0.f;
#pragma unroll 4
    for (int64_t c = 0; c < C; ++c) m = fmaxf(m, pm[c * HD]);
#pragma unroll 4
    for (int64_t c = 0; c < C; ++c) s += ps[c * HD] * __expf(pm[c * HD] - m);
    lse[i] = m + logf(s);
  }
}

// Softmax over the sequence, backward pass 1: per (unit, N-chunk, tile of kBatchTile batch elements)
// the sum over the chunk's tokens of y * gr, gr the gradient of act(x); part is (B, C, H, D).
template <class T, int VEC, bool ROT>
__global__ void __launch_bounds__(32 * kStatRows, 3)
    seq_stats_backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, float* __restrict__ part, Geo g,
                              int64_t chunk) {
  constexpr int P = ROT ? 2 : 1, K = kBatchTile * P * VEC;
  __shared__ float sm[kStatRows][32][K];
  const int64_t per_head = g.A / VEC, unit = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t h = unit / per_head, j0 = (unit - h * per_head) * VEC, C = gridDim.y;
  const int64_t t0 = blockIdx.y * chunk, t1 = min(g.N, t0 + chunk), b0 = int64_t(blockIdx.z) * kBatchTile;
  const bool ok = unit < g.H * per_head;
  float acc[kBatchTile][P][VEC] = {};
  if (ok) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kStatRows) {
      float c[VEC], s[VEC];
      unit_sincos<VEC>(g, t, h, j0, c, s);
#pragma unroll
      for (int bb = 0; bb < kBatchTile; ++bb) {
        const int64_t b = b0 + bb;
        if (b >= g.B) break;
        const int64_t r = (b * g.N + t) * g.H + h;
        float d0[VEC], d1[VEC], v[P][VEC];
        load<VEC>(dout + r * g.out_row + j0, d0);
        load<VEC>(dout + r * g.out_row + g.out_half + j0, d1);
#pragma unroll
        for (int p = 0; p < P; ++p) load<VEC>(x + r * g.D + p * g.half + j0, v[p]);
        softmax_sequence<P, VEC>(g, b, h, j0, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          acc[bb][0][e] += v[0][e] * (d0[e] * c[e] + d1[e] * s[e]);
          if constexpr (ROT) acc[bb][P - 1][e] += v[P - 1][e] * (d1[e] * c[e] - d0[e] * s[e]);
        }
      }
    }
  }
  float* mine = &sm[threadIdx.y][threadIdx.x][0];
#pragma unroll
  for (int bb = 0; bb < kBatchTile; ++bb)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int e = 0; e < VEC; ++e) mine[(bb * P + p) * VEC + e] = acc[bb][p][e];
  __syncthreads();
  if (!ok) return;
  // Each token lane now sums some of the K values over all token lanes.
  for (int k = threadIdx.y; k < K; k += kStatRows) {
    const int bb = k / (P * VEC), p = (k / VEC) % P, e = k % VEC;
    const int64_t b = b0 + bb;
    if (b >= g.B) continue;
    float sum = 0.f;
    for (int y = 0; y < kStatRows; ++y) sum += sm[y][threadIdx.x][k];
    part[((b * C + blockIdx.y) * g.H + h) * g.D + p * g.half + j0 + e] = sum;
  }
}

// q (B, H*D) = the sum of the C chunk partials.
__global__ void seq_stats_backward_finalize(const float* __restrict__ part, float* __restrict__ q, int64_t B,
                                            int64_t C, int64_t HD) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < B * HD; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / HD, k = i - b * HD;
    float sum = 0.f;
#pragma unroll 4
    for (int64_t c = 0; c < C; ++c) sum += part[(b * C + c) * HD + k];
    q[i] = sum;
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

const char* op_name(const LrpeSpec& spec) {
  switch (spec.kind) {
    case LrpeSpec::Cosine: return "lrpe_cosine";
    case LrpeSpec::Rotate: return "lrpe_rotate";
    case LrpeSpec::MdCosine: return "md_lrpe_cosine";
  }
  return "lrpe";
}

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
  const char* op = op_name(spec);
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

// Calls fn(IC<VEC>, IC<NV>) for the instantiated shapes: the full 16-byte vector with 1 or 4 units per
// lane; the narrower vectors (D not a multiple of the full one) always with 4.
template <class T, class Fn>
void with_row_shape(int vec, int nv, Fn&& fn) {
  constexpr int kFull = int(16 / sizeof(T));
  if (vec == kFull) {
    if (nv == 1) return fn(IC<kFull>(), IC<1>());
    return fn(IC<kFull>(), IC<kMaxUnitsPerLane>());
  }
  if constexpr (kFull > 4) {
    if (vec == 4) return fn(IC<4>(), IC<kMaxUnitsPerLane>());
  }
  if (vec == 2) return fn(IC<2>(), IC<kMaxUnitsPerLane>());
  return fn(IC<1>(), IC<kMaxUnitsPerLane>());
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

// Launch shape of the row kernels: lanes per row, units per lane, and a grid of row blocks x batch
// groups; batch groups only when the rows alone cannot fill the GPU.
struct RowLaunch {
  int nv;
  dim3 grid;
};
RowLaunch row_launch(Geo& g, int vec, int sms, const char* op) {
  const int64_t units = g.A / vec;
  int lpr = 1;
  while (lpr < 32 && lpr < units) lpr *= 2;
  g.lpr = lpr;
  const int64_t nv = (units + lpr - 1) / lpr;
  LT_CHECK(nv <= kMaxUnitsPerLane, "[", op, "] the fused kernels handle rows of at most ", 32 * kMaxUnitsPerLane,
           " vectors of ", vec, " elements (D up to ", (g.A == g.D ? 1 : 2) * 32 * kMaxUnitsPerLane * vec,
           " here); got D = ", g.D);
  const int64_t rows_per_block = kThreads / lpr, row_blocks = (g.N * g.H + rows_per_block - 1) / rows_per_block;
  const int64_t target = int64_t(sms) * (2048 / kThreads) * 2;
  const int64_t gx = std::max<int64_t>(1, std::min(row_blocks, target));
  const int64_t gy = std::max<int64_t>(1, std::min(g.B, target / gx));
  return {nv == 1 ? 1 : kMaxUnitsPerLane, dim3(unsigned(gx), unsigned(gy))};
}

// Token chunks for the statistics kernels: enough blocks for about two waves, at least 32 tokens each.
int64_t stat_chunks(int64_t blocks_per_chunk, int64_t N, int sms, int64_t& chunk) {
  const int64_t target = int64_t(sms) * (2048 / (32 * kStatRows)) * 2;
  int64_t c = std::max<int64_t>(1, std::min((N + 31) / 32, target / std::max<int64_t>(1, blocks_per_chunk)));
  chunk = (N + c - 1) / c;
  return (N + chunk - 1) / chunk;
}

unsigned flat_blocks(int64_t n) { return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + 255) / 256), 4096)); }

template <class T>
void seq_stats_forward(const T* x, const Geo& g, const Tensor& lse, Device dev, int sms, cudaStream_t st) {
  const int64_t HD = g.H * g.D;
  const int vec = pick_vec<T>(g.D, {x});
  const int64_t gx = (HD / vec + 31) / 32;
  int64_t chunk = 0;
  const int64_t C = stat_chunks(gx * g.B, g.N, sms, chunk);
  Tensor part = empty({2, g.B, C, HD}, DType::F32, dev);
  with_vec<T>(vec, [&](auto V) {
    const dim3 grid{unsigned(gx), unsigned(C), unsigned(g.B)}, block{32, kStatRows};
    seq_stats_forward_kernel<T, V.value><<<grid, block, 0, st>>>(x, part.data_ptr<float>(), g.N, HD, chunk);
  });
  LT_CUDA_CHECK_LAUNCH();
  seq_stats_forward_finalize<<<flat_blocks(g.B * HD), 256, 0, st>>>(part.data_ptr<float>(), lse.data_ptr<float>(),
                                                                    g.B, C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T>
void seq_stats_backward(const T* x, const T* dout, const Geo& g, int vec, const Tensor& q, Device dev, int sms,
                        cudaStream_t st, bool rot) {
  const int64_t HD = g.H * g.D;
  const int64_t gx = (g.H * (g.A / vec) + 31) / 32, gz = (g.B + kBatchTile - 1) / kBatchTile;
  int64_t chunk = 0;
  const int64_t C = stat_chunks(gx * gz, g.N, sms, chunk);
  Tensor part = empty({g.B, C, HD}, DType::F32, dev);
  const dim3 grid{unsigned(gx), unsigned(C), unsigned(gz)}, block{32, kStatRows};
  with_vec<T>(vec, [&](auto V) {
    if (rot)
      seq_stats_backward_kernel<T, V.value, true><<<grid, block, 0, st>>>(x, dout, part.data_ptr<float>(), g, chunk);
    else
      seq_stats_backward_kernel<T, V.value, false><<<grid, block, 0, st>>>(x, dout, part.data_ptr<float>(), g, chunk);
  });
  LT_CUDA_CHECK_LAUNCH();
  seq_stats_backward_finalize<<<flat_blocks(g.B * HD), 256, 0, st>>>(part.data_ptr<float>(), q.data_ptr<float>(),
                                                                     g.B, C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

Shape out_shape(const Shape& xs, const LrpeSpec& spec) {
  return {xs[0], xs[1], xs[2], spec.rotate() ? xs[3] : 2 * xs[3]};
}

}  // namespace

void forward(const Tensor& x, const LrpeSpec& spec, const Tensor& out, const Tensor& stats) {
  const char* op = op_name(spec);
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(out, out_shape(x.shape(), spec), x.dtype(), dev, op, "out");
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
        seq_stats_forward<T>(xp, g, stats, dev, sms, st);
        g.lse = stats.data_ptr<float>();
      }
      const int vec = pick_vec<T>(g.A, {xp, op_});
      RowLaunch rl = row_launch(g, vec, sms, op);
      with_row_shape<T>(vec, rl.nv, [&](auto V, auto NV) {
        if (spec.rotate())
          forward_kernel<T, V.value, NV.value, true><<<rl.grid, kThreads, 0, st>>>(xp, op_, g);
        else
          forward_kernel<T, V.value, NV.value, false><<<rl.grid, kThreads, 0, st>>>(xp, op_, g);
      });
      LT_CUDA_CHECK_LAUNCH();
    }
  });
}

void backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec, const Tensor& stats, const Tensor& dx) {
  const char* op = op_name(spec);
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(dout, out_shape(x.shape(), spec), x.dtype(), dev, op, "dout");
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
        seq_stats_backward<T>(xp, dp, g, vec, q, dev, sms, st, spec.rotate());
        g.q = q.data_ptr<float>();
      }
      RowLaunch rl = row_launch(g, vec, sms, op);
      with_row_shape<T>(vec, rl.nv, [&](auto V, auto NV) {
        if (spec.rotate())
          backward_kernel<T, V.value, NV.value, true><<<rl.grid, kThreads, 0, st>>>(xp, dp, dxp, g);
        else
          backward_kernel<T, V.value, NV.value, false><<<rl.grid, kThreads, 0, st>>>(xp, dp, dxp, g);
      });
      LT_CUDA_CHECK_LAUNCH();
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
