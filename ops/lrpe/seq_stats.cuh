// Softmax over the sequence: the statistics kernels (included by ops/lrpe/rows.cu only).
#pragma once
#include "ops/lrpe/device.cuh"

namespace lintape::lrpe_cuda {
namespace {

// Softmax over the sequence, pass 1: per (column vector of the H*D plane, N-chunk, b) the max and
// sum-exp of x over the chunk's tokens; part is (2, B, C, H*D): max, then sum. Tokens come in steps of
// kStep per token lane, loaded together, so that the running sum is rescaled once per step rather than
// once per value.
template <class T, int VEC>
__global__ void __launch_bounds__(32 * kStatRows, 3)
    seq_stats_forward_kernel(const T* __restrict__ x, float* __restrict__ part, Geo g, int64_t chunk) {
  constexpr int kStep = 4;
  __shared__ float sm[2 * VEC][kStatRows][32];  // [value][token lane][column]: no bank conflicts
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.z, B = gridDim.z, C = gridDim.y;
  const int64_t N = g.N, HD = g.H * g.D;
  const int64_t t0 = blockIdx.y * chunk, t1 = min(N, t0 + chunk);
  const bool ok = col < HD / VEC;
  // The column's vector in token 0 (vectors never straddle heads: VEC divides D).
  const T* xc = x + b * g.x_batch + col * VEC / g.D * g.x_head + col * VEC % g.D;
  float m[VEC], s[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) m[e] = -INFINITY, s[e] = 0.f;
  if (ok) {
    for (int64_t t = t0 + threadIdx.y; t < t1; t += kStep * kStatRows) {
      Vec<T, VEC> raw[kStep];
#pragma unroll
      for (int i = 0; i < kStep; ++i)
        if (t + i * kStatRows < t1) raw[i] = load_raw<VEC>(xc + (t + i * kStatRows) * g.x_tok);
      float v[kStep][VEC];
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
        if (t + i * kStatRows < t1)
          to_float(raw[i], v[i]);
        else
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[i][e] = -INFINITY;
      }
      running_max_sum<kStep, VEC>(m, s, v);  // m finite from here on: token t is always in range
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
        for (int p = 0; p < P; ++p) raw[bb][2 + p] = load_raw<VEC>(x + x_row(g, b0 + bb, t, h) + p * g.half + j0);
      }
      if (!stepped || step % kReseed == 0) {
        unit_sincos<VEC>(g, t, h, j0, c, s);
      } else {
        advance_sincos<VEC>(c, s, rc, rs);
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

}  // namespace
}  // namespace lintape::lrpe_cuda
