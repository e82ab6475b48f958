// Internal to the FAL family: the chunk sweep kernel that the sequence launchers (ops/fal/noncausal.cu,
// ops/fal/causal.cu) share, with the per-row act, LRPE and their backward.
//
// A block owns one (b, h) and a range of tokens, and keeps a (D', E) f32 state S in shared memory. It walks
// its range in chunks of C = 16 tokens; each chunk's rows are loaded, put through the acts and the LRPE by one
// warp per row (never written to memory), and then, depending on the pass:
//   forward      y_i = a_i (x_i S) + sum_j w_ij (x_i . y_j) v_j,  o_i = gb_i * y_i
//   query grad   the same y_i gives dgb_i = do_i * y_i; dqb_i = a_i (S dy_i) + sum_j w_ij (dy_i . v_j) y_j
//   key grad     (reverse sweep, x = kb, y = qb, v = dy, u = vb) dvb_i and dkb_i by the same two formulas
//   reduce       S += sum_j c_j y_j^T v_j only (noncausal kv = kb^T vb or dkv = qb^T dy over a token range)
// Causal passes add the intra-chunk terms (w_ij = lambda^|i - j| on the causal side of the diagonal) and
// carry S from chunk to chunk: S <- lambda^C S + sum_j c_j y_j^T v_j. Noncausal row passes read a fixed S
// (kv or dkv) and have a_i = 1, no intra-chunk terms.
//
// Causal passes with documents (starts set; the kernel's Docs instance, so that the calls without keep their
// code), st_t the start of token t's document and [cs, c1) the chunk: the state at a chunk edge holds the
// document of the token before it (the forward's S_cs that of token cs - 1, S0 standing for the row's first
// document; the reverse state at c1 that of token c1 - 1, dS_final standing for the row's last), so
//   forward  a_i != 0 iff st_i < max(cs, 1); w_ij = 0 for cs + j < st_i; c_j != 0 iff st_(c1-1) <= cs + j
//   reverse  a_i != 0 iff st_(c1-1) <= cs + i; w_ij = 0 for cs + i < st_j; c_j != 0 iff st_j < max(cs, 1)
// and the carry lambda^cl is 0 unless st_(c1-1) < max(cs, 1), both ways. LRPE positions are offset + t - st_t.
//
// The products (the chunk's scores, x S, S u, and the state update) run on the tensor cores: WMMA 16 x 16 x 8
// tf32 tiles read from the f32 rows in shared memory, accumulated in f32. For bf16 and f16 inputs one tf32
// product (10-bit mantissa, finer than the inputs); for f32 inputs three (the operands split into tf32 head
// and tail), so f32 results stay at f32 accuracy. Everything accumulates in f32.
#pragma once
#include <mma.h>
#include <cmath>
#include <type_traits>
#include "core/cuda_types.cuh"
#include "core/cuda_acts.cuh"
#include "core/cuda_angle.cuh"
#include "core/cuda_reduce.cuh"
#include "ops/fal/launch.h"

namespace lintape::fal_cuda {

enum SweepPass : int { kForward, kQueryGrad, kKeyGrad, kReduceKV, kReduceDKV };

constexpr int kSweepWarps = 8;
constexpr int kSweepThreads = 32 * kSweepWarps;
constexpr int kScoreWarps = 8;  // warps that share the intra-chunk scores' contraction
static_assert(kScoreWarps <= kSweepWarps, "the score warps are a subset of the block");
constexpr int kMaxSharedBytes = 227 * 1024;  // sm_90 opt-in limit per block
constexpr int kMaxHeadDim = 256;
constexpr int kSweepChunk = 16;  // tokens per chunk: one row of tensor-core tiles

struct SweepArgs {
  const void *q, *k, *v, *g, *dout;
  void *dq, *dk, *dv, *dg, *out;
  const float* state_in;  // (B H [, segments], P, E): S0, kv, dkv or dS_final, or each segment's; null: zeros
  float* state_out;       // (B H [, splits], P, E): S_final, dS0 or a reduction's partial; null: not written
  const int32_t* starts;  // causal: (B, N) the documents' starts (ops/documents.h), or null (none)
  const float* theta;
  int theta_rows, theta_cols;
  const float* decay;
  int H, D, E, P;
  int64_t N, M;            // query and key tokens
  int64_t position;        // token 0's position
  int act_q, act_k, act_v, act_g, lrpe;
  int pass;
  bool causal;
  int64_t tokens_per_block;  // the token range of grid.y's blocks
  bool block_states;         // state_in holds one state per block (a causal segment's incoming state)
};

// The tiles are whole 16 x 16 tensor-core tiles: P and E rounded up to 16 (the pads hold zeros), rows padded
// by 4 floats (a multiple of 4 for the tf32 loads, and fewer bank conflicts than a power of two).
struct SweepDims {
  int Pp, Ep, ldP, ldE, wide;
};
__host__ __device__ inline SweepDims sweep_dims(int64_t D, int64_t P, int64_t E) {
  SweepDims z;
  z.Pp = int((P + 15) / 16 * 16);
  z.Ep = int((E + 15) / 16 * 16);
  z.ldP = z.Pp + 4;
  z.ldE = z.Ep + 4;
  z.wide = int(((D > E ? D : E) + 7) / 8 * 8);
  return z;
}

// Shared memory floats of one block (docs: with the chunk's document starts after them).
inline size_t sweep_smem_floats(int64_t D, int64_t P, int64_t E, bool docs = false) {
  const SweepDims z = sweep_dims(D, P, E);
  const int64_t C = kSweepChunk;
  return size_t(int64_t(z.Pp) * z.ldE + 3 * C * z.ldP + 3 * C * z.ldE + (2 + kScoreWarps) * C * (C + 4) + 4 * C +
                kSweepWarps * int64_t(z.wide) + (docs ? C : 0));
}

using cuda_device::warp_max;
using cuda_device::warp_sum;
using cuda_device::sigmoid_rn;

// row (len floats in shared memory) <- act(row); one warp.
__device__ __forceinline__ void warp_act(float* row, int len, int act) {
  const int lane = threadIdx.x & 31;
  if (act == FalStepSpec::kSoftmaxFeature) {
    float m = -INFINITY;
    for (int i = lane; i < len; i += 32) m = fmaxf(m, row[i]);
    m = warp_max(m);
    float s = 0;
    for (int i = lane; i < len; i += 32) s += __expf(row[i] - m);
    const float inv = 1.0f / warp_sum(s);
    for (int i = lane; i < len; i += 32) row[i] = __expf(row[i] - m) * inv;
  } else if (act != FalStepSpec::kNone) {
    for (int i = lane; i < len; i += 32) {
      const float x = row[i];
      row[i] = act == FalStepSpec::kRelu ? fmaxf(x, 0.0f) : act == FalStepSpec::kSigmoid ? sigmoid_rn(x)
                                                                                         : x * sigmoid_rn(x);
    }
  }
  __syncwarp();
}

// A row of up to kMaxHeadDim values held by one warp: lane l holds elements l, l + 32, ... A row's loads are
// all issued before any is used (and before anything is stored), so fetching a row costs one memory latency.
constexpr int kRowRegs = kMaxHeadDim / 32;
struct WarpRow {
  float x[kRowRegs];
};

template <class T>
__device__ __forceinline__ WarpRow warp_fetch(const T* __restrict__ src, int len) {
  WarpRow r;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kRowRegs; ++u) {
    const int i = lane + 32 * u;
    r.x[u] = i < len ? cuda::to_acc(src[i]) : 0.0f;
  }
  return r;
}

__device__ __forceinline__ void warp_store(const WarpRow& r, float* dst, int len) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kRowRegs; ++u)
    if (lane + 32 * u < len) dst[lane + 32 * u] = r.x[u];
  __syncwarp();
}

// The LRPE rates of head h that lane j + 32 u uses for angle index j + 32 u (0 past theta's columns).
struct LaneRates {
  float r[kRowRegs];
};
__device__ __forceinline__ LaneRates lane_rates(const SweepArgs& a, int h) {
  LaneRates out;
  const int lane = threadIdx.x & 31;
  const float* rate = a.theta ? a.theta + (a.theta_rows == 1 ? 0 : h * a.theta_cols) : nullptr;
#pragma unroll
  for (int u = 0; u < kRowRegs; ++u) {
    const int j = lane + 32 * u;
    out.r[u] = !rate ? 0.0f : a.theta_cols == 1 ? rate[0] : j < a.theta_cols ? rate[j] : 0.0f;
  }
  return out;
}

// The angles of the chunked kernels and the step (cuda_device::angle_cs), so that every FAL path agrees.
using cuda_device::angle_cs;

// Forward LRPE in place on the rows qd and kd (either may be null) of one position: the angles are computed once
// for both. backward: the transposed rotation, on gradient rows. One warp.
__device__ __forceinline__ void warp_lrpe(float* qd, float* kd, const SweepArgs& a, const LaneRates& rates,
                                          int64_t pos, bool backward) {
  if (a.lrpe == FalStepSpec::kNoLrpe) return;
  const int D = a.D, lane = threadIdx.x & 31;
  const int A = a.lrpe == FalStepSpec::kRotate ? D / 2 : D;
#pragma unroll
  for (int u = 0; u < kRowRegs; ++u) {
    const int j = lane + 32 * u;
    if (j >= A) break;
    float c, s;
    angle_cs(rates.r[u], pos, c, s);
    auto rotate = [&](float* d) {
      if (a.lrpe == FalStepSpec::kCosine) {
        if (backward) {
          d[j] = c * d[j] + s * d[D + j];
        } else {
          const float xv = d[j];
          d[j] = xv * c;
          d[D + j] = xv * s;
        }
      } else {
        const float x1 = d[j], x2 = d[A + j];
        d[j] = backward ? c * x1 + s * x2 : x1 * c - x2 * s;
        d[A + j] = backward ? c * x2 - s * x1 : x1 * s + x2 * c;
      }
    };
    if (qd) rotate(qd);
    if (kd) rotate(kd);
  }
  __syncwarp();
}

// dx (len, global) from grad (len, shared) for y = act(x); x is the raw row, act_out holds act(x). One warp.
template <class T>
__device__ void warp_act_backward(const WarpRow& x, const float* act_out, const float* grad, T* dx, int len,
                                  int act) {
  const int lane = threadIdx.x & 31;
  float dot = 0;
  if (act == FalStepSpec::kSoftmaxFeature) {
    for (int i = lane; i < len; i += 32) dot += act_out[i] * grad[i];
    dot = warp_sum(dot);
  }
#pragma unroll
  for (int u = 0; u < kRowRegs; ++u) {
    const int i = lane + 32 * u;
    if (i >= len) break;
    const float gi = grad[i], y = act_out[i];
    float d = gi;
    switch (act) {
      case FalStepSpec::kRelu: d = y > 0.0f ? gi : 0.0f; break;
      case FalStepSpec::kSigmoid: d = cuda_device::sigmoid_grad(y, gi); break;
      case FalStepSpec::kSilu: d = cuda_device::silu_grad(x.x[u], sigmoid_rn(x.x[u]), gi); break;
      case FalStepSpec::kSoftmaxFeature: d = y * (gi - dot); break;
      default: break;
    }
    dx[i] = cuda::from_acc<T>(d);
  }
  __syncwarp();
}

// dx (D, global) from grad (P, shared, overwritten) for qb = lrpe(act(x)), x the raw row; scratch holds D
// floats. One warp.
template <class T>
__device__ void row_backward(const WarpRow& x, float* grad, float* scratch, T* dx, int act, const SweepArgs& a,
                             const LaneRates& rates, int64_t pos) {
  warp_store(x, scratch, a.D);
  warp_act(scratch, a.D, act);
  warp_lrpe(grad, nullptr, a, rates, pos, true);
  warp_act_backward(x, scratch, grad, dx, a.D, act);
}

// One k-step of 8 on the tensor cores: acc += a (16 x 8) b (8 x 16), f32 tiles in shared memory rounded to
// tf32. With Split (f32 inputs) each operand is split into a tf32 head and a tf32 tail and three products are
// summed (head head, head tail, tail head), which keeps the product at about f32 accuracy.
using SweepAcc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float>;

template <bool Split, class LayoutA, class LayoutB>
__device__ __forceinline__ void mma_k8(SweepAcc& acc, const float* a, int lda, const float* b, int ldb) {
  namespace w = nvcuda::wmma;
  w::fragment<w::matrix_a, 16, 16, 8, w::precision::tf32, LayoutA> fa, fa_tail;
  w::fragment<w::matrix_b, 16, 16, 8, w::precision::tf32, LayoutB> fb, fb_tail;
  w::load_matrix_sync(fa, a, unsigned(lda));
  w::load_matrix_sync(fb, b, unsigned(ldb));
#pragma unroll
  for (int i = 0; i < fa.num_elements; ++i) {
    const float x = fa.x[i], head = w::__float_to_tf32(x);
    fa.x[i] = head;
    if (Split) fa_tail.x[i] = w::__float_to_tf32(x - head);
  }
#pragma unroll
  for (int i = 0; i < fb.num_elements; ++i) {
    const float x = fb.x[i], head = w::__float_to_tf32(x);
    fb.x[i] = head;
    if (Split) fb_tail.x[i] = w::__float_to_tf32(x - head);
  }
  if (Split) {
    w::mma_sync(acc, fa_tail, fb, acc);
    w::mma_sync(acc, fa, fb_tail, acc);
  }
  w::mma_sync(acc, fa, fb, acc);
}

// acc holds a 16 x 16 tile of rows_of_tile; returns acc <- diag(scale) acc through the warp's tile in shared
// memory (the accumulator's layout is opaque, so a per-row factor goes through memory).
__device__ __forceinline__ void scale_tile_rows(SweepAcc& acc, float* tile, int ld, const float* scale) {
  namespace w = nvcuda::wmma;
  w::store_matrix_sync(tile, acc, unsigned(ld), w::mem_row_major);
  __syncwarp();
  for (int idx = threadIdx.x & 31; idx < 256; idx += 32) tile[(idx >> 4) * ld + (idx & 15)] *= scale[idx >> 4];
  __syncwarp();
  w::load_matrix_sync(acc, tile, unsigned(ld), w::mem_row_major);
}

template <class T, bool Docs>
__global__ void __launch_bounds__(kSweepThreads) sweep_kernel(SweepArgs a) {
  namespace w = nvcuda::wmma;
  using RowM = w::row_major;
  using ColM = w::col_major;
  constexpr bool kSplit = std::is_same<T, float>::value;
  constexpr int C = kSweepChunk, ldC = C + 4;
  extern __shared__ __align__(128) float smem[];
  const int P = a.P, E = a.E, D = a.D;
  const SweepDims z = sweep_dims(D, P, E);
  const int Pp = z.Pp, Ep = z.Ep, ldP = z.ldP, ldE = z.ldE, ldS = z.ldE;
  float* S = smem;                      // Pp x ldS: the state, zero beyond (P, E)
  float* Qs = S + Pp * ldS;             // C x ldP: qb
  float* Ks = Qs + C * ldP;             // C x ldP: kb
  float* OP = Ks + C * ldP;             // C x ldP: dqb or dkb
  float* Vs = OP + C * ldP;             // C x ldE: vb
  float* Ys = Vs + C * ldE;             // C x ldE: dy = do * gb
  float* OE = Ys + C * ldE;             // C x ldE: y or dvb
  float* Aw = OE + C * ldE;             // C x ldC: w_ij (x_i . y_j)
  float* Bw = Aw + C * ldC;             // C x ldC: w_ij (u_i . v_j)
  float* row_decay = Bw + C * ldC;      // C: lambda^(i + 1) (reverse: lambda^(cl - 1 - i)), the state term's
  float* update_decay = row_decay + C;  // C: lambda^(cl - 1 - j) (reverse: lambda^(j + 1)), the update's weights
  float* powers = update_decay + C;     // C + 1 (of 2 C): lambda^k, k = 0 ... C
  float* partial = powers + 2 * C;      // kScoreWarps x 16 x ldC: partial scores
  float* scratch = partial + kScoreWarps * 16 * ldC;  // warps x z.wide
  int* doc = reinterpret_cast<int*>(scratch + kSweepWarps * z.wide);  // Docs: C, st_(cs + i) - cs

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t bh = blockIdx.x, b = bh / a.H;
  const int h = int(bh % a.H);
  const bool causal = a.causal, pass_rows = a.pass <= kKeyGrad;
  const bool reverse = causal && (a.pass == kKeyGrad || a.pass == kReduceDKV);
  const bool update = causal || !pass_rows;
  const bool need_q = a.pass != kReduceKV && (causal || a.pass != kKeyGrad);
  const bool need_k = causal ? a.pass != kReduceDKV : a.pass == kReduceKV || a.pass == kKeyGrad;
  const bool need_dy = a.pass == kQueryGrad || a.pass == kReduceDKV || reverse;
  const float lam = causal && a.decay ? a.decay[h] : 1.0f;

  // Token range: blockIdx.y's slice of the queries or keys (causal: a segment, or the whole sequence).
  const bool over_keys = a.pass == kReduceKV || (!causal && a.pass == kKeyGrad);
  const int64_t len = over_keys ? a.M : a.N;
  const int64_t t0 = int64_t(blockIdx.y) * a.tokens_per_block;
  const int64_t t1 = min(len, t0 + a.tokens_per_block);
  if (t0 >= t1 && pass_rows) return;

  const int64_t state_slot = a.block_states ? bh * gridDim.y + blockIdx.y : bh;
  const float* S_src = a.state_in ? a.state_in + state_slot * P * E : nullptr;
  for (int i = tid; i < Pp * Ep; i += kSweepThreads) {
    const int p = i / Ep, e = i % Ep;
    S[p * ldS + e] = S_src && p < P && e < E ? S_src[p * E + e] : 0.0f;
  }
  for (int i = tid; i <= C; i += kSweepThreads) powers[i] = lam == 1.0f ? 1.0f : powf(lam, float(i));

  // Roles of the chunk arrays in the formulas above.
  const bool keys_first = a.pass == kKeyGrad || a.pass == kReduceKV;
  const float* X = keys_first ? Ks : Qs;
  const float* Y = keys_first ? Qs : Ks;
  const float* V = a.pass == kKeyGrad ? Ys : Vs;
  const float* U = a.pass == kKeyGrad ? Vs : Ys;
  const float* Yup = a.pass == kReduceKV ? Ks : a.pass == kReduceDKV ? Qs : Y;  // the state update's rows
  float* Vup = a.pass == kReduceKV || a.pass == kForward || a.pass == kQueryGrad ? Vs : Ys;

  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* g = static_cast<const T*>(a.g);
  const T* dout = static_cast<const T*>(a.dout);
  auto qrow = [&](int64_t t) { return ((b * a.N + t) * a.H + h) * int64_t(D); };
  auto krow = [&](int64_t t) { return ((b * a.M + t) * a.H + h) * int64_t(D); };
  auto vrow = [&](int64_t t) { return ((b * a.M + t) * a.H + h) * int64_t(E); };
  auto grow = [&](int64_t t) { return ((b * a.N + t) * a.H + h) * int64_t(E); };
  // Docs: the start of token t's document.
  auto doc_start = [&](int64_t t) { return int64_t(a.starts[b * a.N + t]); };
  auto zero = [&](float* row, int from, int to) {
    for (int i = from + lane; i < to; i += 32) row[i] = 0.0f;
  };
  float* scr = scratch + warp * z.wide;
  const LaneRates rates = lane_rates(a, h);

  const int64_t chunks = (t1 - t0 + C - 1) / C;
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t c = reverse ? chunks - 1 - ci : ci;
    const int64_t cs = t0 + c * C;
    const int cl = int(min(int64_t(C), t1 - cs));
    __syncthreads();  // the previous chunk's rows and S are no longer read
    // Rows past the chunk's end and columns past P or E are zeros, so the tiles can be whole. A row's inputs
    // are fetched together, then stored, put through the acts and the LRPE (angles shared by q and k).
    for (int r = warp; r < C; r += kSweepWarps) {
      const int64_t t = cs + r;
      const bool live = r < cl;
      const int64_t pos = a.position + t - (Docs && live ? doc_start(t) : 0);
      float* qd = Qs + r * ldP;
      float* kd = Ks + r * ldP;
      if (live) {
        WarpRow xq, xk, xv, xg, xd;
        if (need_q) xq = warp_fetch(q + qrow(t), D);
        if (need_k) {
          xk = warp_fetch(k + krow(t), D);
          xv = warp_fetch(v + vrow(t), E);
        }
        if (need_dy) {
          xg = warp_fetch(g + grow(t), E);
          xd = warp_fetch(dout + grow(t), E);
        }
        if (need_q) {
          warp_store(xq, qd, D);
          warp_act(qd, D, a.act_q);
        }
        if (need_k) {
          warp_store(xk, kd, D);
          warp_act(kd, D, a.act_k);
          warp_store(xv, Vs + r * ldE, E);
          warp_act(Vs + r * ldE, E, a.act_v);
        }
        warp_lrpe(need_q ? qd : nullptr, need_k ? kd : nullptr, a, rates, pos, false);
        if (need_dy) {
          warp_store(xg, scr, E);
          warp_act(scr, E, a.act_g);
#pragma unroll
          for (int u = 0; u < kRowRegs; ++u)
            if (lane + 32 * u < E) Ys[r * ldE + lane + 32 * u] = xd.x[u] * scr[lane + 32 * u];
        }
      }
      if (need_q) zero(qd, live ? P : 0, Pp);
      if (need_k) {
        zero(kd, live ? P : 0, Pp);
        zero(Vs + r * ldE, live ? E : 0, Ep);
      }
      if (need_dy) zero(Ys + r * ldE, live ? E : 0, Ep);
      __syncwarp();
    }
    for (int i = tid; i < C; i += kSweepThreads) {
      const bool decays = causal && lam != 1.0f;
      row_decay[i] = decays ? powers[max(0, reverse ? cl - 1 - i : i + 1)] : 1.0f;
      update_decay[i] = i >= cl ? 0.0f : decays ? powers[reverse ? i + 1 : cl - 1 - i] : 1.0f;
      if (Docs && i < cl) {
        // The gates of the header's table; doc[cl - 1] < first is the carry's.
        const int st_i = int(doc_start(cs + i) - cs), st_last = int(doc_start(cs + cl - 1) - cs);
        const int first = cs == 0 ? 1 : 0;
        doc[i] = st_i;
        if (reverse ? st_last > i : st_i >= first) row_decay[i] = 0.0f;
        if (reverse ? st_i >= first : st_last > i) update_decay[i] = 0.0f;
      }
    }
    __syncthreads();

    if (pass_rows) {
      const bool need_P = a.pass != kForward;
      if (causal) {
        // Intra-chunk scores X Y^T (and U V^T), each warp of the first kScoreWarps a slice of the contraction
        // (half of them each when both are needed), the partials summed in a fixed order; then the weights on
        // the causal side: j <= i forward, j >= i in the reverse sweep.
        const int a_warps = need_P ? kScoreWarps / 2 : kScoreWarps;
        if (warp < kScoreWarps) {
          const bool is_a = warp < a_warps;
          const int slot = is_a ? warp : warp - a_warps, slots = is_a ? a_warps : kScoreWarps - a_warps;
          const int steps = (is_a ? Pp : Ep) / 8, per = (steps + slots - 1) / slots;
          const float* L = is_a ? X : U;
          const float* R = is_a ? Y : V;
          const int ld = is_a ? ldP : ldE;
          SweepAcc acc;
          w::fill_fragment(acc, 0.0f);
          for (int st = slot * per; st < min(steps, (slot + 1) * per); ++st)
            mma_k8<kSplit, RowM, ColM>(acc, L + 8 * st, ld, R + 8 * st, ld);
          w::store_matrix_sync(partial + warp * 16 * ldC, acc, unsigned(ldC), w::mem_row_major);
        }
        __syncthreads();
        for (int idx = tid; idx < C * C; idx += kSweepThreads) {
          const int i = idx / C, j = idx % C;
          // Documents: the later token's document starts at or before the earlier one.
          const bool live = i < cl && j < cl && (reverse ? j >= i : j <= i) &&
                            (!Docs || (reverse ? i >= doc[j] : j >= doc[i]));
          const float wt = !live ? 0.0f : powers[reverse ? j - i : i - j];
          float sa = 0.0f, sb = 0.0f;
          for (int p = 0; p < kScoreWarps; ++p) (p < a_warps ? sa : sb) += partial[p * 16 * ldC + i * ldC + j];
          Aw[i * ldC + j] = live ? sa * wt : 0.0f;
          Bw[i * ldC + j] = live && need_P ? sb * wt : 0.0f;
        }
        __syncthreads();
      }
      // OE = diag(row_decay) X S + Aw V and OP = diag(row_decay) U S^T + Bw Y, a 16-column tile per warp.
      for (int tile = warp; tile < Ep / 16; tile += kSweepWarps) {
        const int n0 = tile * 16;
        SweepAcc acc;
        w::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < Pp; kk += 8) mma_k8<kSplit, RowM, RowM>(acc, X + kk, ldP, S + kk * ldS + n0, ldS);
        if (causal) {
          scale_tile_rows(acc, OE + n0, ldE, row_decay);
          for (int kk = 0; kk < C; kk += 8) mma_k8<kSplit, RowM, RowM>(acc, Aw + kk, ldC, V + kk * ldE + n0, ldE);
        }
        w::store_matrix_sync(OE + n0, acc, unsigned(ldE), w::mem_row_major);
      }
      if (need_P)
        for (int tile = warp; tile < Pp / 16; tile += kSweepWarps) {
          const int n0 = tile * 16;
          SweepAcc acc;
          w::fill_fragment(acc, 0.0f);
          for (int kk = 0; kk < Ep; kk += 8) mma_k8<kSplit, RowM, ColM>(acc, U + kk, ldE, S + n0 * ldS + kk, ldS);
          if (causal) {
            scale_tile_rows(acc, OP + n0, ldP, row_decay);
            for (int kk = 0; kk < C; kk += 8)
              mma_k8<kSplit, RowM, RowM>(acc, Bw + kk, ldC, Y + kk * ldP + n0, ldP);
          }
          w::store_matrix_sync(OP + n0, acc, unsigned(ldP), w::mem_row_major);
        }
      __syncthreads();
      for (int r = warp; r < cl; r += kSweepWarps) {
        const int64_t t = cs + r, pos = a.position + t - (Docs ? cs + doc[r] : 0);
        float* oe = OE + r * ldE;
        if (a.pass == kForward) {
          warp_store(warp_fetch(g + grow(t), E), scr, E);
          warp_act(scr, E, a.act_g);
          T* out = static_cast<T*>(a.out) + grow(t);
          for (int e = lane; e < E; e += 32) out[e] = cuda::from_acc<T>(scr[e] * oe[e]);
        } else if (a.pass == kQueryGrad) {
          const WarpRow xg = warp_fetch(g + grow(t), E), xd = warp_fetch(dout + grow(t), E),
                        xq = warp_fetch(q + qrow(t), D);
#pragma unroll
          for (int u = 0; u < kRowRegs; ++u)
            if (lane + 32 * u < E) oe[lane + 32 * u] *= xd.x[u];
          warp_store(xg, scr, E);
          warp_act(scr, E, a.act_g);
          warp_act_backward(xg, scr, oe, static_cast<T*>(a.dg) + grow(t), E, a.act_g);
          row_backward(xq, OP + r * ldP, scr, static_cast<T*>(a.dq) + qrow(t), a.act_q, a, rates, pos);
        } else {
          const WarpRow xv = warp_fetch(v + vrow(t), E), xk = warp_fetch(k + krow(t), D);
          warp_act_backward(xv, Vs + r * ldE, oe, static_cast<T*>(a.dv) + vrow(t), E, a.act_v);
          row_backward(xk, OP + r * ldP, scr, static_cast<T*>(a.dk) + krow(t), a.act_k, a, rates, pos);
        }
      }
    }

    if (update) {
      __syncthreads();  // the outputs above read S and Vup before they move on
      // S <- carry S + Yup^T diag(update_decay) Vup; the decay goes onto Vup's rows in place.
      if (causal) {
        for (int idx = tid; idx < C * Ep; idx += kSweepThreads) Vup[(idx / Ep) * ldE + idx % Ep] *= update_decay[idx / Ep];
        __syncthreads();
      }
      float carry = causal ? powers[cl] : 1.0f;
      if (Docs && causal && doc[cl - 1] >= (cs == 0 ? 1 : 0)) carry = 0.0f;  // the last token's document began here
      const int tiles_e = Ep / 16;
#pragma unroll 2
      for (int tile = warp; tile < (Pp / 16) * tiles_e; tile += kSweepWarps) {
        const int p0 = (tile / tiles_e) * 16, n0 = (tile % tiles_e) * 16;
        SweepAcc acc;
        w::load_matrix_sync(acc, S + p0 * ldS + n0, unsigned(ldS), w::mem_row_major);
        if (carry != 1.0f)
          for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= carry;
        for (int kk = 0; kk < C; kk += 8)
          mma_k8<kSplit, ColM, RowM>(acc, Yup + kk * ldP + p0, ldP, Vup + kk * ldE + n0, ldE);
        w::store_matrix_sync(S + p0 * ldS + n0, acc, unsigned(ldS), w::mem_row_major);
      }
    }
  }
  if (a.state_out && update) {
    __syncthreads();
    float* dst = a.state_out + (bh * gridDim.y + blockIdx.y) * int64_t(P) * E;
    for (int i = tid; i < P * E; i += kSweepThreads) dst[i] = S[(i / E) * ldS + i % E];
  }
}

// Launches sweep_kernel<T, Docs> for a's dtype, Docs when a.starts is set (causal passes only).
inline void launch_sweep(SweepArgs a, DType dtype, dim3 grid, cudaStream_t st, const char* op) {
  const bool docs = a.starts != nullptr;
  LT_CHECK(!docs || a.causal, "[", op, "] internal: documents in a noncausal sweep");
  const size_t smem = sweep_smem_floats(a.D, a.P, a.E, docs) * sizeof(float);
  LT_CHECK(smem <= size_t(kMaxSharedBytes), "[", op, "] the fused kernel's state of D' = ", a.P, ", E = ", a.E,
           " does not fit in shared memory");
  auto go = [&](auto tag) {
    using T = decltype(tag);
    auto kernel = docs ? sweep_kernel<T, true> : sweep_kernel<T, false>;
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<grid, kSweepThreads, smem, st>>>(a);
    LT_CUDA_CHECK_LAUNCH();
  };
  switch (dtype) {
    case DType::F32: go(float()); break;
    case DType::BF16: go(__nv_bfloat16()); break;
    case DType::F16: go(__half()); break;
    default: fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got ", dtype_name(dtype)));
  }
}

// The fields of SweepArgs that come from the inputs and the spec.
inline SweepArgs sweep_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const FalStepSpec& spec) {
  SweepArgs a{};
  fill_common_args(a, q, k, v, g, spec);
  a.N = q.size(1);
  a.M = k.size(1);
  return a;
}

}  // namespace lintape::fal_cuda
