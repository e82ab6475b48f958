// Softmax over the sequence with documents: the statistics kernels (included by ops/lrpe/rows.cu only).
//
// Each document of a row gets its own statistics, written in the row of its first token of a (B, N, H, D)
// f32 buffer (stat_row; the rows of other tokens stay unwritten), so no count of the documents is needed on
// the host and nothing waits for the device. A row is cut into pieces of `piece` consecutive tokens, one per
// warp, which walks it token by token for 32 column vectors of the H*D plane: a document that begins and
// ends inside the piece is finished there; the piece's first part (when the piece begins inside a document)
// and its last document (when one begins inside the piece) go into partials that the finalize kernel merges
// across pieces. Without documents ops/lrpe/seq_stats.cuh runs instead.
#pragma once
#include "ops/lrpe/device.cuh"

namespace lintape::lrpe_cuda {
namespace {

// Piece p of row b: tokens [a, e).
struct Piece {
  int64_t a, e;
};
__device__ __forceinline__ Piece piece_of(int64_t p, int64_t piece, int64_t N) {
  return {p * piece, min(N, (p + 1) * piece)};
}

// Merges the online max and sum-exp (m2, s2) into (m, s); m2 finite.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

// Pass 1 of the forward: per (column vector, piece, b) the max and sum-exp of each document's tokens in the
// piece. part is (4, B, pieces, H*D): the head's max and sum, the tail's max and sum (each written only where
// the piece has one); lse gets the log-sum-exp of the documents inside the piece. Up to 128 registers (16
// warps per SM; at 80, 16-byte vectors spilled 228 bytes).
template <class T, int VEC>
__global__ void __launch_bounds__(32 * kStatRows, 2)
    doc_stats_forward_kernel(const T* __restrict__ x, float* __restrict__ part, float* __restrict__ lse, Geo g,
                             int64_t piece) {
  constexpr int kStep = 4;
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.z, B = gridDim.z;
  const int64_t HD = g.H * g.D, pieces = (g.N + piece - 1) / piece, p = int64_t(blockIdx.y) * kStatRows + threadIdx.y;
  if (col >= HD / VEC || p >= pieces) return;
  const Piece pc = piece_of(p, piece, g.N);
  const int32_t* st = g.starts + b * g.N;
  const T* xc = x + b * g.x_batch + col * VEC / g.D * g.x_head + col * VEC % g.D;
  const int64_t plane = B * pieces * HD, at = (b * pieces + p) * HD + col * VEC;
  int64_t cur = st[pc.a];  // the start of the document being summed
  bool head = cur < pc.a;  // it began before the piece
  float m[VEC], s[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) m[e] = -INFINITY, s[e] = 0.f;
  // The document being summed is done (flush) or the piece is (at its end).
  auto flush = [&](bool last) {
    if (head || last) {
      float* dst = part + (head ? 0 : 2) * plane + at;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[e] = m[e], dst[plane + e] = s[e];
    } else {
      float* dst = lse + (b * g.N + cur) * HD + col * VEC;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[e] = m[e] + logf(s[e]);
    }
  };
  for (int64_t t = pc.a; t < pc.e; t += kStep) {
    Vec<T, VEC> raw[kStep];
    int32_t sv[kStep];
#pragma unroll
    for (int i = 0; i < kStep; ++i)
      if (t + i < pc.e) {
        raw[i] = load_raw<VEC>(xc + (t + i) * g.x_tok);
        sv[i] = st[t + i];
      }
    float v[kStep][VEC];
#pragma unroll
    for (int i = 0; i < kStep; ++i)
      if (t + i < pc.e) to_float(raw[i], v[i]);
    if (t + kStep <= pc.e && sv[kStep - 1] == cur) {
      // The usual case: all kStep tokens in the current document (starts are nondecreasing), one rescale.
      running_max_sum<kStep, VEC>(m, s, v);
      continue;
    }
#pragma unroll
    for (int i = 0; i < kStep; ++i) {
      if (t + i >= pc.e) break;
      if (sv[i] != cur) {  // a document begins at t + i
        flush(false);
        head = false;
        cur = sv[i];
#pragma unroll
        for (int e = 0; e < VEC; ++e) m[e] = -INFINITY, s[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float mx = fmaxf(m[e], v[i][e]);
        s[e] = s[e] * __expf(m[e] - mx) + __expf(v[i][e] - mx);
        m[e] = mx;
      }
    }
  }
  flush(true);
}

// Pass 1 of the backward: per (unit, piece, b) the sum over each document's tokens in the piece of y * gr
// (gr the gradient of act(x)), with y from the documents' lse. part is (2, B, pieces, H, D): the head's sum
// and the tail's (as above); q gets the sums of the documents inside the piece. The angles advance from
// token to token by a rotation of one position, recomputed exactly at each document start and every
// kReseed tokens. No register bound: rotate needs 206 at 16-byte vectors (8 warps per SM), 128 spilled 204
// bytes.
template <class T, int VEC, bool ROT>
__global__ void __launch_bounds__(32 * kStatRows)
    doc_stats_backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, float* __restrict__ part,
                              float* __restrict__ q, Geo g, int64_t piece) {
  constexpr int P = ROT ? 2 : 1, kStep = 2, kReseed = 8;
  const int64_t per_head = g.A / VEC, unit = int64_t(blockIdx.x) * 32 + threadIdx.x, b = blockIdx.z;
  const int64_t pieces = (g.N + piece - 1) / piece, p = int64_t(blockIdx.y) * kStatRows + threadIdx.y;
  if (unit >= g.H * per_head || p >= pieces) return;
  const int64_t h = unit / per_head, j0 = (unit - h * per_head) * VEC;
  const Piece pc = piece_of(p, piece, g.N);
  const int32_t* st = g.starts + b * g.N;
  const int64_t plane = gridDim.z * pieces * g.H * g.D, at = (b * pieces + p) * g.H * g.D + h * g.D + j0;
  float rc[VEC], rs[VEC];  // cos/sin of one position's step
#pragma unroll
  for (int e = 0; e < VEC; ++e) angle_sincos(1.0, rate_1d(g, g.theta + h * g.theta_stride, j0 + e), rc[e], rs[e]);
  int64_t cur = st[pc.a];
  bool head = cur < pc.a;
  float l[P][VEC], c[VEC], s[VEC], acc[P][VEC];
  int since = 0;  // tokens since c and s were exact
  auto begin = [&](int64_t t) {  // the document of token t starts at cur: its lse, t's angles, a zero sum
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      load_f32<VEC>(g.lse + ((b * g.N + cur) * g.H + h) * g.D + pp * g.half + j0, l[pp]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[pp][e] = 0.f;
    }
    unit_sincos<VEC>(g, t - cur, h, j0, c, s);
    since = 0;
  };
  auto flush = [&](bool last) {
    float* dst = head || last ? part + (head ? 0 : plane) + at : q + ((b * g.N + cur) * g.H + h) * g.D + j0;
#pragma unroll
    for (int pp = 0; pp < P; ++pp)
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[pp * g.half + e] = acc[pp][e];
  };
  begin(pc.a);
  for (int64_t t = pc.a; t < pc.e; t += kStep) {
    Vec<T, VEC> raw[kStep][2 + P];  // dout's two halves, then x
    int32_t sv[kStep];
#pragma unroll
    for (int i = 0; i < kStep; ++i)
      if (t + i < pc.e) {
        const int64_t r = (b * g.N + t + i) * g.H + h;
        raw[i][0] = load_raw<VEC>(dout + r * g.out_row + j0);
        raw[i][1] = load_raw<VEC>(dout + r * g.out_row + g.out_half + j0);
#pragma unroll
        for (int pp = 0; pp < P; ++pp) raw[i][2 + pp] = load_raw<VEC>(x + x_row(g, b, t + i, h) + pp * g.half + j0);
        sv[i] = st[t + i];
      }
#pragma unroll
    for (int i = 0; i < kStep; ++i) {
      const int64_t tt = t + i;
      if (tt >= pc.e) break;
      if (sv[i] != cur) {  // a document begins at tt
        flush(false);
        head = false;
        cur = sv[i];
        begin(tt);
      } else if (tt != pc.a) {
        if (++since == kReseed) {
          unit_sincos<VEC>(g, tt - cur, h, j0, c, s);
          since = 0;
        } else {
          advance_sincos<VEC>(c, s, rc, rs);
        }
      }
      float d0[VEC], d1[VEC], v[P][VEC];
      to_float(raw[i][0], d0);
      to_float(raw[i][1], d1);
#pragma unroll
      for (int pp = 0; pp < P; ++pp) {
        to_float(raw[i][2 + pp], v[pp]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[pp][e] = __expf(v[pp][e] - l[pp][e]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        acc[0][e] += v[0][e] * (d0[e] * c[e] + d1[e] * s[e]);
        if constexpr (ROT) acc[P - 1][e] += v[P - 1][e] * (d1[e] * c[e] - d0[e] * s[e]);
      }
    }
  }
  flush(true);
}

// Pass 2: per (column k of the H*D plane, piece, b), the piece where a document begins last merges that
// document's tail with the heads of the pieces it runs on into, and writes the document's lse (LSE: part as
// the forward wrote it) or sum (else: part as the backward wrote it) into out's row of its first token.
template <bool LSE>
__global__ void __launch_bounds__(128)
    doc_stats_finalize(const float* __restrict__ part, float* __restrict__ out, const int32_t* __restrict__ starts,
                       int64_t N, int64_t HD, int64_t piece) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, p = blockIdx.y, b = blockIdx.z;
  const int64_t pieces = gridDim.y, plane = gridDim.z * pieces * HD;
  if (k >= HD) return;
  const int32_t* st = starts + b * N;
  const Piece pc = piece_of(p, piece, N);
  const int64_t doc = st[pc.e - 1];
  if (doc < pc.a) return;  // no document begins in this piece
  const int64_t at = (b * pieces + p) * HD + k;
  float m = LSE ? part[2 * plane + at] : 0.f, s = part[(LSE ? 3 : 1) * plane + at];
  for (int64_t n = p + 1; n < pieces; ++n) {
    const Piece next = piece_of(n, piece, N);
    if (st[next.a] == next.a) break;  // the document ended with piece n - 1
    const int64_t at_n = (b * pieces + n) * HD + k;
    if constexpr (LSE)
      merge_max_sum(m, s, part[at_n], part[plane + at_n]);
    else
      s += part[at_n];
    if (st[next.e - 1] >= next.a) break;  // another document begins in piece n
  }
  out[(b * N + doc) * HD + k] = LSE ? m + logf(s) : s;
}

}  // namespace
}  // namespace lintape::lrpe_cuda
