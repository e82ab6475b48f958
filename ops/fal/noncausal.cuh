// Internal to the FAL family: the chunk kernels of the noncausal FAL for bf16 and f16 inputs (the reduction in
// ops/fal/noncausal.cu, the row passes in ops/fal/noncausal_rows.cu). They reuse the causal chunk machinery
// (ops/fal/chunk.cuh: 64-token chunks, mma.sync with f32 accumulation) with whole rows of q and k: a row's D
// columns are loaded together, so that softmax over the feature dim can run on q and k.
//
// The work is a list of items, (b, h, chunk), cut into equal runs of consecutive items, one run per block, as
// many blocks as fit on the GPU at once (a run crosses (b, h) boundaries as it needs):
//   reduce    S = X^T Z summed over the chunks (kv: X = kb, Z = vb; dkv: X = qb, Z = gb o dO); each run writes
//             one partial state per (b, h) it touches and a fixed-order sum adds them (deterministic);
//   rows      per chunk, with the (b, h)'s state W in shared memory (in the inputs' dtype): Y = X W, then
//               out:  o = gb o Y                                  (X = qb, W = kv)
//               query grads: dg = act_g'(dO o Y), dqb = (gb o dO) W^T    (X = qb, W = kv)
//               key grads:   dv = act_v'(Y), dkb = vb W^T                (X = kb, W = dkv)
//             and dqb, dkb go back through the LRPE and the act to dq, dk. On Hopper the row passes run
//             ops/fal/noncausal_rows_hopper.cu instead (warpgroups on chunks of their own, wgmma).
#pragma once
#include "ops/fal/chunk.cuh"
#include "core/cuda_reduce.cuh"

namespace lintape::fal_cuda::noncausal {

using chunk::Args;
using chunk::kC;
using chunk::kPad;
using chunk::Raw;

// Consecutive runs of `per` items, `blocks` of them (the last may be shorter; none is empty).
struct Partition {
  int64_t per = 1, blocks = 0;
};
inline Partition partition(int64_t total, int64_t slots, int64_t min_per) {
  Partition p;
  if (total <= 0) return p;
  p.per = (total + slots - 1) / slots;
  if (p.per < min_per) p.per = min_per;
  p.blocks = (total + p.per - 1) / p.per;
  return p;
}

// Item (b, h, chunk) of the list (item w = (b H + h) nC + chunk), stepped through in order without divisions.
struct Item {
  int64_t b, chunk;
  int h;
  __device__ __forceinline__ void start(int64_t w, const Args& a) {
    const int64_t bh = w / a.nC;
    chunk = w - bh * a.nC;
    b = bh / a.H;
    h = int(bh - b * a.H);
  }
  __device__ __forceinline__ void step(const Args& a) {
    if (++chunk == a.nC) {
      chunk = 0;
      if (++h == a.H) h = 0, ++b;
    }
  }
  __device__ __forceinline__ int64_t bh(const Args& a) const { return b * a.H + h; }
  __device__ __forceinline__ int64_t t0() const { return chunk * kC; }
};

// The LRPE angles of one head, per column d of D, in shared memory (kAngleRows x DP floats): the rate, and the
// cos and sin of the rotations by `step` tokens (a thread's rows in encode_rows), by 8 tokens (an mma
// fragment's two rows) and by kC tokens (one chunk to the next). A thread computes the angles of its first row
// and rotates them to the next rows.
constexpr int kAngleRows = 7;
template <int DP>
__device__ __forceinline__ void fill_angles(const Args& a, int h, int step, float* tab) {
  for (int d = threadIdx.x; d < DP; d += blockDim.x) {
    const float rate = chunk::rate_of(a, h, d);
    tab[d] = rate;
    chunk::angle_cs(rate, step, tab[DP + d], tab[2 * DP + d]);
    chunk::angle_cs(rate, 8, tab[3 * DP + d], tab[4 * DP + d]);
    chunk::angle_cs(rate, kC, tab[5 * DP + d], tab[6 * DP + d]);
  }
}
// (c, s) of angle x turned into those of x + y, given cos y and sin y.
__device__ __forceinline__ void rotate(float& c, float& s, float cy, float sy) {
  const float cn = c * cy - s * sy;
  s = fmaf(c, sy, s * cy);
  c = cn;
}

// The cos and sin of a thread's 8 columns at its first row of a chunk in encode_rows. From one chunk of a
// (b, h) to the next they are turned by kC tokens (four multiply-adds a column against an angle reduction and
// two special-function results); they are computed afresh at a run's first chunk, at a (b, h)'s, and every
// kFreshChunks chunks, which bounds the rounding the turns add (about 1e-7 each). They live in shared memory
// (kept, 16 floats a thread, value u of thread x at u NThr + x): in registers they cost the reduction spills.
// Without kept (null) they are computed afresh for every chunk.
template <int DP, int NThr>
struct FirstRowAngles {
  static constexpr int kFreshChunks = 32;
  static constexpr size_t kBytes = sizeof(float) * 16 * NThr;
  float* kept = nullptr;
  int64_t at = -1;  // the chunk start t0 they belong to (-1: none yet)
  // The angles at chunk start t0 into (c, s), after fill_angles of the chunk's head (tab).
  __device__ __forceinline__ void move_to(const Args& a, const float* tab, int64_t t0, int i0, float (&c)[8],
                                          float (&s)[8]) {
    const int c8 = (threadIdx.x % (DP / 8)) * 8;
    float* mine = kept + threadIdx.x;
    if (kept && t0 == at + kC && (t0 / kC) % kFreshChunks != 0) {
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        c[u] = mine[u * NThr], s[u] = mine[(8 + u) * NThr];
        rotate(c[u], s[u], tab[5 * DP + c8 + u], tab[6 * DP + c8 + u]);
      }
    } else {
#pragma unroll
      for (int u = 0; u < 8; ++u) chunk::angle_cs(tab[c8 + u], a.position + t0 + i0, c[u], s[u]);
    }
    if (kept)
#pragma unroll
      for (int u = 0; u < 8; ++u) mine[u * NThr] = c[u], mine[(8 + u) * NThr] = s[u];
    at = t0;
  }
};

// A row of q or k is held by DP / 8 consecutive lanes, 8 columns each.
template <int DP>
__device__ __forceinline__ float row_max(float v) {
  return cuda_device::warp_max<DP / 8>(v);
}
template <int DP>
__device__ __forceinline__ float row_sum(float v) {
  return cuda_device::warp_sum<DP / 8>(v);
}

// The act of a row, 8 columns per thread: elementwise, or softmax over the row (every lane of the warp calls it).
template <int DP>
__device__ __forceinline__ void row_act(float (&x)[8], int act) {
  if (act == FalStepSpec::kSoftmaxFeature) {
    float m = x[0];
#pragma unroll
    for (int u = 1; u < 8; ++u) m = fmaxf(m, x[u]);
    m = row_max<DP>(m);
    float s = 0.0f;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      x[u] = __expf(x[u] - m);
      s += x[u];
    }
    const float inv = 1.0f / row_sum<DP>(s);
#pragma unroll
    for (int u = 0; u < 8; ++u) x[u] *= inv;
  } else {
    chunk::act_n(x, act, true);
  }
}

// q or k rows t0 ... t0 + kC - 1 (all DP = D columns, fetched with c0 = 0) through the act and the LRPE into a
// kC x P tile laid out by `at`: columns [0, D) act(x) cos and [D, 2D) act(x) sin with the cosine LRPE
// (angles from tab, filled with step NThr / (DP / 8): the thread's first-row angles, moved to t0 here, turned
// to its next rows), else [0, D) act(x). Rows past a.N are zeros.
template <class T, int DP, int NThr, class At>
__device__ __forceinline__ void encode_rows(const Args& a, const Raw<DP, NThr>& r, int act, const float* tab,
                                            FirstRowAngles<DP, NThr>& first, int64_t t0, T* tile, At at) {
  constexpr int kStep = NThr / (DP / 8);  // rows between a thread's pieces
  const int c8 = (threadIdx.x % (DP / 8)) * 8, i0 = threadIdx.x / (DP / 8);
  const bool cosine = a.lrpe == FalStepSpec::kCosine;
  float c[8], s[8];
  if (cosine) first.move_to(a, tab, t0, i0, c, s);
#pragma unroll
  for (int it = 0; it < Raw<DP, NThr>::kIt; ++it) {
    const int i = i0 + it * kStep;
    const int64_t t = t0 + i;
    float x[8];
    chunk::unpack8<T>(r.u[it], x);
    row_act<DP>(x, act);
    if (t >= a.N)
#pragma unroll
      for (int u = 0; u < 8; ++u) x[u] = 0.0f;
    if (cosine) {
      float xs[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (it > 0) rotate(c[u], s[u], tab[DP + c8 + u], tab[2 * DP + c8 + u]);
        xs[u] = x[u] * s[u];
        x[u] *= c[u];
      }
      chunk::store8(tile + at(i, DP + c8), xs);
    }
    chunk::store8(tile + at(i, c8), x);
  }
}

// Whether a's acts are the language model's (silu on q, k and g, none on v), which the kernels run as constants
// (code without dispatch: row passes 1.2-1.35x faster than with the acts as arguments, bench/notes/fal-hopper.md).
// The causal chunk kernels ask it on the device; the noncausal ones and the walks take it from their launch.
__host__ __device__ inline bool model_acts_of(const Args& a) {
  return a.act_q == FalStepSpec::kSilu && a.act_k == FalStepSpec::kSilu && a.act_v == FalStepSpec::kNone &&
         a.act_g == FalStepSpec::kSilu;
}

// The launchers. a.N and a.nC are the tokens and chunks of the pass (keys for kv and the key grads, queries
// otherwise); state (B, H, P, E) f32.
// state = kv (grad false: k and v over a.N keys) or dkv (grad true: q, g, dout over a.N queries).
void reduce(const Args& a, bool grad, DType dtype, int64_t BH, float* state, cudaStream_t st, Device dev);
// The causal forward's balanced cut (chunk::Args::piece, on wgmma): the piece of items before each cut x = 1 ...
// cuts summed from zero (lambda^(end - 1 - t) kb_t^T vb_t) in `runs` runs of run_chunks chunks, run r of cut x
// into partial[(x - 1) runs + r] (P x E f32 each; a run past its piece, or a cut at a (b, h)'s first chunk,
// writes nothing). causal.cu's piece_boundaries scans them into the boundary states.
void reduce_pieces(const Args& a, DType dtype, int64_t cuts, int64_t runs, int64_t run_chunks, float* partial,
                   cudaStream_t st);
enum RowPass : int { kOut, kQueryGrads, kKeyGrads };
void rows(const Args& a, int pass, DType dtype, int64_t BH, const float* state, cudaStream_t st, Device dev);
// The row passes on Hopper's warpgroup products (ops/fal/noncausal_rows_hopper.cu), which rows() runs where
// hopper_rows_take says they may: a device of compute capability 9.0 with the sm_90a kernels, an elementwise act
// on the pass's q or k (LINTAPE_FAL_NONCAUSAL_ROWS=mma keeps the mma.sync kernel).
bool hopper_rows_take(const Args& a, int pass, Device dev);
void hopper_rows(const Args& a, int pass, DType dtype, int64_t BH, const float* state, cudaStream_t st, Device dev);

}  // namespace lintape::fal_cuda::noncausal
