// Internal to the FAL family: the pieces of the causal tensor-core kernels (ops/fal/chunk_fwd.cu,
// ops/fal/chunk_bwd.cu) for bf16 and f16 inputs.
//
// The sequence is cut into chunks of C = 64 tokens. Per (b, h) and chunk c, with Q, K (C x D'), V, G, dO
// (C x E) the chunk's activated and encoded rows, S_c the state entering the chunk, gamma_i = lambda^(i + 1),
// delta_j = lambda^(cl - 1 - j) (cl tokens in the chunk) and M_ij = lambda^(i - j) for j <= i (else 0):
//   Y = diag(gamma) Q S_c + (Q K^T o M) V,   O = gb o Y,   S_(c+1) = lambda^cl S_c + K^T diag(delta) V
// and, with dY = dO o gb and R_c the gradient of S_c (R_nC = dS_final, R_0 = dS0):
//   R_c = lambda^cl R_(c+1) + Q^T diag(gamma) dY
//   dQ = diag(gamma) dY S_c^T + (dY V^T o M) K,   dK = (dY V^T o M)^T Q + diag(delta) V R_(c+1)^T
//   dV = (Q K^T o M)^T dY + diag(delta) K R_(c+1),  dgb = dO o Y.
// With documents (ops/documents.h: st_i the start of row i's document, t0 the chunk's first token): M_ij is 0
// also where t0 + j < st_i; gamma_i is 0 unless the state entering the chunk reaches row i (enters(st_i, t0):
// its document began before t0 or is the row's first); delta_j is 0 unless key j is in the document of the
// chunk's last token; lambda^cl becomes 0 unless that document entered the chunk. The decay powers stay those
// of the token gaps, and R follows the same rules backward. The 1-D LRPE position of row i is offset + t0 + i -
// st_i.
// The forward is one kernel per (b, h), sequential over chunks with the whole f32 state in registers; it writes
// the output and S_final, and every S_c (in T) when the call records its backward, or those of the even chunks
// only (half_states: the gradient kernel of an odd chunk c then computes S_c = lambda^cl S_(c-1) + K^T diag(delta) V
// over chunk c - 1 from the saved S_(c-1), with the forward's products). The backward's state kernels
// are sequential over chunks and parallel over (b, h, 64-wide slice of D', 64-wide slice of E): each keeps its f32
// state tile in registers and writes the state entering every chunk (S_c unless the forward saved them, then
// R_(c+1)) once, in the inputs' dtype; its gradient kernel is parallel over (chunk, b, h). When B x H leaves SMs
// idle, ops/fal/causal.cu cuts each (b, h)'s chunks into segments (chunk_segments): a local pass sums each segment
// from zero, a scan turns the sums into the states at the segments' boundaries, and the forward and the state
// passes then walk the segments side by side.
//
// Rows are put through the act and the LRPE as they are loaded into shared memory (never written to global
// memory), 64 columns of D (an "angle slice") at a time: one slice gives one 64-wide slice of D' (no LRPE) or
// two (cosine: columns d and D + d). The products run on the tensor cores: mma.sync m16n8k16 with bf16 or f16
// operands loaded by ldmatrix, f32 accumulation.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include "core/cuda_acts.cuh"
#include "core/cuda_angle.cuh"
#include "core/cuda_async.cuh"
#include "core/cuda_mma.cuh"
#include "core/cuda_types.cuh"
#include "ops/fal/launch.h"

namespace lintape::fal_cuda {

// The chunk kernels read x (B, tokens, H, width) in place when its heads are rows of its width inside each
// token and its rows are 16-byte aligned.
inline bool chunk_readable(const Tensor& x) {
  const Shape& s = x.strides();
  return s[3] == 1 && s[2] == x.size(3) && s[1] % 8 == 0 && s[0] % 8 == 0 &&
         reinterpret_cast<uintptr_t>(x.data()) % 16 == 0;
}

}  // namespace lintape::fal_cuda

namespace lintape::fal_cuda::chunk {

constexpr int kC = 64;       // tokens per chunk
constexpr int kSlice = 64;   // columns of an angle slice
constexpr int kEtile = 64;   // E columns of a state-pass block
constexpr int kPad = 8;      // a shared row's padding (16 bytes: ldmatrix rows fall on distinct banks)
constexpr int kLdS = kSlice + kPad;
constexpr int kLdC = kC + kPad;

struct Args {
  const void *q, *k, *v, *g, *dout;
  void *out, *dq, *dk, *dv, *dg;
  int64_t sq_b, sq_t, sk_b, sk_t, sv_b, sv_t, sg_b, sg_t;  // batch and token strides (elements); heads at h*D / h*E
  int64_t sdq_b, sdq_t, sdk_b, sdk_t, sdv_b, sdv_t, sdg_b, sdg_t;  // the same for the gradients (backward)
  void* states;            // (B, H, nC, D', E) in T: S_c, the state entering chunk c
  bool half_states = false;  // states holds the even chunks' S_c only: (B, H, ceil(nC / 2), D', E) (saved_slot)
  void* rstates;           // (B, H, nC, D', E) in T (backward): R_(c+1), the gradient of the state leaving chunk c
  const float* S0;         // (B, H, D', E) f32 or null (zeros)
  float* S_final;          // (B, H, D', E) f32 or null (not written)
  const float* dS_final;   // (B, H, D', E) f32 or null (zeros)
  float* dS0;              // (B, H, D', E) f32 or null (not written)
  const float* theta;
  int theta_rows, theta_cols;
  const float* decay;  // (H) or null
  const int32_t* starts;  // (B, N) the documents' starts (ops/documents.h), or null (one document per row)
  int H, D, E, P;      // P = D' (2D with cosine LRPE)
  int64_t N, nC;
  int64_t position;
  int act_q, act_k, act_v, act_g, lrpe;
  // The causal passes' cut of each (b, h)'s chunks into G segments of seg_chunks (the last may be shorter;
  // G = 1: none). boundary (B, H, G - 1, D', E) f32 holds the state at each inner boundary: S leaving segment
  // j forward, R entering segment j from its right in reverse. local: the pass sums each segment from zero into
  // boundary (forward: segments 0 ... G-2 into slots 0 ... G-2; reverse: 1 ... G-1 into 0 ... G-2) and writes
  // no per-chunk state.
  int64_t G = 1, seg_chunks = 0;
  float* boundary = nullptr;
  bool local = false;
  // The Hopper forward's balanced cut (piece > 0, G = 1): block x walks chunks [x piece, (x + 1) piece) of the
  // list of every (b, h)'s chunks in order (item bh nC + c, list_end = B H nC items), which may take the end of
  // one (b, h) and the start of the next ones; boundary (blocks - 1, D', E) f32 holds in slot x - 1 the state
  // entering item x piece where that item is not a (b, h)'s first chunk (causal.cu's piece_boundaries).
  int64_t piece = 0, list_end = 0;
  bool walks_in_z = false;  // state passes: grid (E tiles, slices, walks), else (walks, slices, E tiles)
};

// x, which the compiler must treat as unknown: what is computed from it is computed again where it is used
// rather than held in registers across a loop.
__device__ __forceinline__ int64_t opaque_index(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

// The chunks whose entering states a.states holds per (b, h), and the slot of chunk c's (with half_states, of
// chunk c - 1's for an odd c: the backward's gradient kernel advances it across chunk c - 1).
__host__ __device__ __forceinline__ int64_t saved_chunks(const Args& a) {
  return a.half_states ? (a.nC + 1) / 2 : a.nC;
}
__device__ __forceinline__ int64_t saved_slot(const Args& a, int64_t c) { return a.half_states ? c / 2 : c; }

// The chunks [c0, c1) that block x of a causal pass walks, and the f32 (D', E) states it starts from and
// leaves (null: zeros / not written). A pass runs B x H x G blocks, or B x H x (G - 1) when local.
struct Walk {
  int64_t bh;
  int c0, c1;  // chunk indices fit an int (a sequence of 2^37 tokens does not fit memory)
  const float* start;
  float* last;
};
// The walk over the whole sequence (a.G == 1).
__device__ __forceinline__ Walk whole_walk(const Args& a, int64_t x, bool reverse) {
  const size_t PE = size_t(a.P) * a.E;
  const float* begin = reverse ? a.dS_final : a.S0;
  float* end = reverse ? a.dS0 : a.S_final;
  return Walk{x, 0, int(a.nC), begin ? begin + x * PE : nullptr, end ? end + x * PE : nullptr};
}
__device__ __forceinline__ Walk walk_of(const Args& a, int64_t x, bool reverse) {
  const size_t PE = size_t(a.P) * a.E;
  if (a.G == 1) return whole_walk(a, x, reverse);
  const int64_t slots = a.G - 1, walks = a.local ? slots : a.G;  // walks per (b, h)
  Walk w;
  w.bh = x / walks;
  // A local reverse pass sums segments 1 ... G - 1 (segment 0 needs no sum).
  const int64_t seg = x % walks + (a.local && reverse ? 1 : 0);
  w.c0 = int(seg * a.seg_chunks);
  w.c1 = int(min(a.nC, w.c0 + a.seg_chunks));
  if (a.local) {
    w.start = nullptr;
    w.last = a.boundary + x * PE;
    return w;
  }
  // Forward walks start at the sequence's first segment from S0; reverse ones at its last from dS_final.
  const bool first = reverse ? seg == a.G - 1 : seg == 0, final = reverse ? seg == 0 : seg == a.G - 1;
  const float* begin = reverse ? a.dS_final : a.S0;
  float* end = reverse ? a.dS0 : a.S_final;
  w.start = first ? (begin ? begin + w.bh * PE : nullptr) : a.boundary + (w.bh * slots + seg - (reverse ? 0 : 1)) * PE;
  w.last = final && end ? end + w.bh * PE : nullptr;
  return w;
}
// The balanced cut's (a.piece > 0) k-th walk of block x in the fused forward (bh < 0: none): the part of the
// block's items in the k-th (b, h) they touch (only the first can start inside one).
__device__ __forceinline__ Walk forward_walk(const Args& a, int64_t x, int k) {
  const size_t PE = size_t(a.P) * a.E;
  const int64_t f0 = x * a.piece, f1 = min(f0 + a.piece, a.list_end), bh = f0 / a.nC + k;
  if (bh * a.nC >= f1) return Walk{-1, 0, 0, nullptr, nullptr};
  Walk w;
  w.bh = bh;
  w.c0 = int(max(f0 - bh * a.nC, int64_t(0)));
  w.c1 = int(min(f1 - bh * a.nC, a.nC));
  w.start = w.c0 > 0 ? a.boundary + (x - 1) * PE : a.S0 ? a.S0 + bh * PE : nullptr;
  w.last = w.c1 == a.nC && a.S_final ? a.S_final + bh * PE : nullptr;
  return w;
}

// ---------------------------------------------------------------------------------------------------
// Tensor-core helpers.

using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;
using cuda::cp_async_wait_all;
using cuda::smem_addr;

using cuda_device::ldmatrix_x4;
using cuda_device::ldmatrix_x4_trans;
using cuda_device::mma16816;

// A warp's accumulator tile of (16 MT) x (8 NT) f32 values. Element r of tile (mt, nt) sits at row
// 16 mt + lane / 4 + 8 (r / 2), column 8 nt + 2 (lane % 4) + r % 2.
template <int MT, int NT>
struct Acc {
  float x[MT][NT][4];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) x[m][n][r] = 0.0f;
  }
  __device__ __forceinline__ static int row(int m, int r) { return 16 * m + ((threadIdx.x & 31) >> 2) + 8 * (r >> 1); }
  __device__ __forceinline__ static int col(int n, int r) { return 8 * n + 2 * (threadIdx.x & 3) + (r & 1); }
};

// A fragment of rows m (16) at column kk of A (M x K): stored [m][k] (ATrans false) or [k][m].
template <bool ATrans, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* A, int lda, int m, int kk) {
  const int lane = threadIdx.x & 31;
  if (!ATrans)
    ldmatrix_x4(a, A + (m + (lane & 15)) * lda + kk + (lane >> 4) * 8);
  else
    ldmatrix_x4_trans(a, A + (kk + (lane & 7) + ((lane >> 4) << 3)) * lda + m + ((lane >> 3) & 1) * 8);
}
// B fragments of two n-tiles (columns n .. n + 15) at row kk of B (K x N): stored [n][k] (BTrans false) or
// [k][n].
template <bool BTrans, class T>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const T* B, int ldb, int n, int kk) {
  const int lane = threadIdx.x & 31;
  if (!BTrans)
    ldmatrix_x4(b, B + (n + (lane & 7) + ((lane >> 4) << 3)) * ldb + kk + ((lane >> 3) & 1) * 8);
  else
    ldmatrix_x4_trans(b, B + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * ldb + n + (lane >> 4) * 8);
}

// acc += A B over k in [0, K) (K a multiple of 16) for the warp's tile at (m0, n0). A is (M x K): stored [m][k]
// (ATrans false) or [k][m]; B is (K x N): stored [n][k] (BTrans false) or [k][n]; shared memory, leading
// dimensions in elements (rows 16-byte aligned). NT is even.
template <class T, bool ATrans, bool BTrans, int MT, int NT>
__device__ __forceinline__ void warp_mma(Acc<MT, NT>& acc, const T* A, int lda, int m0, const T* B, int ldb, int n0,
                                         int K) {
  static_assert(NT % 2 == 0, "B fragments load in pairs of n-tiles");
  for (int kk = 0; kk < K; kk += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) load_a<ATrans>(a[m], A, lda, m0 + 16 * m, kk);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      uint32_t b[4];
      load_b<BTrans>(b, B, ldb, n0 + 8 * n, kk);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma16816<T>(acc.x[m][n], a[m], b[0], b[1]);
        mma16816<T>(acc.x[m][n + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// acc0 += A B0 and acc1 += A B1 (B0, B1 laid out alike): A's fragments load once, and the two products are
// independent chains for the tensor cores.
template <class T, bool ATrans, bool BTrans, int NT>
__device__ __forceinline__ void warp_mma2(Acc<1, NT>& acc0, Acc<1, NT>& acc1, const T* A, int lda, int m0,
                                          const T* B0, const T* B1, int ldb, int n0, int K) {
  static_assert(NT % 2 == 0, "B fragments load in pairs of n-tiles");
  for (int kk = 0; kk < K; kk += 16) {
    uint32_t a[4];
    load_a<ATrans>(a, A, lda, m0, kk);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      uint32_t b0[4], b1[4];
      load_b<BTrans>(b0, B0, ldb, n0 + 8 * n, kk);
      load_b<BTrans>(b1, B1, ldb, n0 + 8 * n, kk);
      mma16816<T>(acc0.x[0][n], a, b0[0], b0[1]);
      mma16816<T>(acc1.x[0][n], a, b1[0], b1[1]);
      mma16816<T>(acc0.x[0][n + 1], a, b0[2], b0[3]);
      mma16816<T>(acc1.x[0][n + 1], a, b1[2], b1[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Rows: acts, LRPE, vector loads.

// An input's (or a gradient's) row (b, token 0, h, 0): batch stride sb, heads width apart inside a token.
template <class T>
__device__ __forceinline__ const T* at_head(const void* p, int64_t b, int64_t sb, int64_t h, int64_t width) {
  return static_cast<const T*>(p) + b * sb + h * width;
}
template <class T>
__device__ __forceinline__ T* at_head(void* p, int64_t b, int64_t sb, int64_t h, int64_t width) {
  return static_cast<T*>(p) + b * sb + h * width;
}

using cuda_device::exp2_ftz;
using cuda_device::sigmoid_grad;
using cuda_device::silu_grad;
using cuda_device::sigmoid_tanh;

__device__ __forceinline__ float act_f(float x, int act) {
  switch (act) {
    case FalStepSpec::kRelu: return fmaxf(x, 0.0f);
    case FalStepSpec::kSigmoid: return sigmoid_tanh(x);
    case FalStepSpec::kSilu: return x * sigmoid_tanh(x);
    default: return x;
  }
}

// act over N values (one dispatch), or zeros when dead.
template <int N>
__device__ __forceinline__ void act_n(float (&x)[N], int act, bool live) {
  if (!live) {
#pragma unroll
    for (int u = 0; u < N; ++u) x[u] = 0.0f;
    return;
  }
  switch (act) {
    case FalStepSpec::kRelu:
#pragma unroll
      for (int u = 0; u < N; ++u) x[u] = fmaxf(x[u], 0.0f);
      break;
    case FalStepSpec::kSigmoid:
#pragma unroll
      for (int u = 0; u < N; ++u) x[u] = sigmoid_tanh(x[u]);
      break;
    case FalStepSpec::kSilu:
#pragma unroll
      for (int u = 0; u < N; ++u) x[u] *= sigmoid_tanh(x[u]);
      break;
    default: break;
  }
}

// dx for y = act(x), given dy.
__device__ __forceinline__ float act_grad(float x, float dy, int act) {
  switch (act) {
    case FalStepSpec::kRelu: return x > 0.0f ? dy : 0.0f;
    case FalStepSpec::kSigmoid: return sigmoid_grad(sigmoid_tanh(x), dy);
    case FalStepSpec::kSilu: return silu_grad(x, sigmoid_tanh(x), dy);
    default: return dy;
  }
}

// dy <- act'(x) dy over N values (one dispatch).
template <int N>
__device__ __forceinline__ void act_grad_n(const float (&x)[N], float (&dy)[N], int act) {
  switch (act) {
    case FalStepSpec::kRelu:
#pragma unroll
      for (int u = 0; u < N; ++u) dy[u] = x[u] > 0.0f ? dy[u] : 0.0f;
      break;
    case FalStepSpec::kSigmoid:
#pragma unroll
      for (int u = 0; u < N; ++u) {
        const float y = sigmoid_tanh(x[u]);
        dy[u] *= y * (1.0f - y);
      }
      break;
    case FalStepSpec::kSilu:
#pragma unroll
      for (int u = 0; u < N; ++u) {
        const float sg = sigmoid_tanh(x[u]);
        dy[u] *= sg * (1.0f + x[u] * (1.0f - sg));
      }
      break;
    default: break;
  }
}

// Documents (a.starts non-null): the start of token t's document in row b (a token past the sequence: itself),
// and whether the state entering a chunk at t0 reaches a token whose document starts at st.
__device__ __forceinline__ int doc_start(const Args& a, int64_t b, int64_t t) {
  return t < a.N ? a.starts[b * a.N + t] : int(t);
}
__device__ __forceinline__ bool enters(int st, int64_t t0) { return st < t0 || st == 0; }
// The chunk's rows' document starts into st (kC entries, rows i = tid, tid + NThr, ...).
template <int NThr>
__device__ __forceinline__ void load_doc_starts(const Args& a, int64_t b, int64_t t0, int* st) {
  for (int i = threadIdx.x; i < kC; i += NThr) st[i] = doc_start(a, b, t0 + i);
}

// lambda^e for e >= 0 (1 without decay).
__device__ __forceinline__ float decay_pow(float log2_lam, int e) {
  return e <= 0 ? 1.0f : exp2_ftz(log2_lam * float(e));
}

using cuda_device::angle_cs;  // the step kernel computes the same angles (core/cuda_angle.cuh)
// The LRPE rate of feature j of head h from theta (rows 1 or H, cols 1 or more; past its columns: 0).
__device__ __forceinline__ float theta_rate(const float* theta, int rows, int cols, int h, int j) {
  const float* r = theta + (rows == 1 ? 0 : h * cols);
  return cols == 1 ? r[0] : j < cols ? r[j] : 0.0f;
}
__device__ __forceinline__ float rate_of(const Args& a, int h, int j) {
  return theta_rate(a.theta, a.theta_rows, a.theta_cols, h, j);
}

// 8 values as 16 bytes.
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = cuda::from_acc<T>(x[i]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Two consecutive values (4 bytes, one access: every caller's offset is even from a 16-byte aligned row) as
// floats, and back.
template <class T>
__device__ __forceinline__ void load2(const T* p, float& x0, float& x1) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
  const T* e = reinterpret_cast<const T*>(&u);
  x0 = cuda::to_acc(e[0]);
  x1 = cuda::to_acc(e[1]);
}
template <class T>
__device__ __forceinline__ void store2(T* p, float x0, float x1) {
  uint32_t u;
  T* e = reinterpret_cast<T*>(&u);
  e[0] = cuda::from_acc<T>(x0);
  e[1] = cuda::from_acc<T>(x1);
  *reinterpret_cast<uint32_t*>(p) = u;
}

// acc (a warp's 16 x 8 NT tile at rows m0, columns n0 of a kC x kC matrix) times the causal decay mask
// (lambda^(i - j) for j <= i, else 0), into dst (leading dim kLdC). With documents, st holds the rows' document
// starts (load_doc_starts) and keys before them are masked too (j from lo = st_i - t0); null: none.
template <class T, int NT>
__device__ __forceinline__ void store_masked(const Acc<1, NT>& acc, T* dst, int m0, int n0, float log2_lam,
                                             const int* st = nullptr, int64_t t0 = 0) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      const int i = m0 + acc.row(0, r), j = n0 + acc.col(n, r);
      const int lo = st ? int(st[i] - t0) : 0;
      const float w0 = j <= i && j >= lo ? decay_pow(log2_lam, i - j) : 0.0f;
      const float w1 = j + 1 <= i && j + 1 >= lo ? decay_pow(log2_lam, i - j - 1) : 0.0f;
      store2(dst + i * kLdC + j, acc.x[0][n][r] * w0, acc.x[0][n][r + 1] * w1);
    }
}

// Loading a chunk's rows is split in two so that all of a thread's global loads are in flight at once: fetch
// issues the 16-byte loads into registers (zeros past the sequence or past E), store applies the act (and the
// LRPE or the gate) and writes the tile to shared memory. The kernels have NThr = kThreads threads (the
// gradient kernel twice as many); a thread's 8 columns are the same in every piece it loads.
constexpr int kThreads = 256;

template <int W, int NThr = kThreads>
struct Raw {
  static_assert(kC * (W / 8) % NThr == 0 && NThr % (W / 8) == 0, "whole pieces, fixed columns per thread");
  static constexpr int kIt = kC * (W / 8) / NThr;  // 16-byte pieces per thread
  uint4 u[kIt];
};

// Rows t0 ... t0 + kC - 1, columns [c0, c0 + W) of x (at (b, token 0, h, 0), token stride ts; cols columns).
template <class T, int W, int NThr>
__device__ __forceinline__ void fetch(const Args& a, const T* __restrict__ x, int64_t ts, int64_t t0, int c0,
                                      int cols, Raw<W, NThr>& r) {
#pragma unroll
  for (int it = 0; it < Raw<W, NThr>::kIt; ++it) {
    const int idx = threadIdx.x + it * NThr, i = idx / (W / 8), c = c0 + (idx % (W / 8)) * 8;
    const int64_t t = t0 + i;
    r.u[it] = t < a.N && c < cols ? *reinterpret_cast<const uint4*>(x + t * ts + c) : make_uint4(0, 0, 0, 0);
  }
}

template <class T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&x)[8]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = cuda::to_acc(e[i]);
}

// Values first ... first + N - 1 of 8 packed in 16 bytes, and N values stored as 2 N bytes.
template <class T, int N>
__device__ __forceinline__ void unpack_part(const uint4& u, int first, float (&x)[N]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = cuda::to_acc(e[first + i]);
}
template <class T, int N>
__device__ __forceinline__ void store_part(T* p, const float (&x)[N]) {
  if constexpr (N == 8) {
    store8(p, x);
  } else {
    static_assert(N == 4, "8 or 4 values");
    uint2 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = cuda::from_acc<T>(x[i]);
    *reinterpret_cast<uint2*>(p) = u;
  }
}

// q or k rows of angle slice `slice` (fetched with c0 = slice kSlice): half0 (and half1 with the cosine LRPE)
// are kC x kSlice tiles of leading dimension kLdS. Rows past the sequence are zeros. With r2 (q and k of the
// same tokens) the second rows go to r2_half0 and r2_half1 through the same angles. A thread's 8 columns go
// through in parts of Part (4 needs fewer registers). rates: the head's D rates (shared memory), or null to
// read them from theta. st: the rows' document starts (load_doc_starts), or null (no documents).
template <class T, int NThr, int Part = 8>
__device__ __forceinline__ void store_encoded(const Args& a, const Raw<kSlice, NThr>& r, int act, T* half0, T* half1,
                                              const Raw<kSlice, NThr>* r2, int act2, T* r2_half0, T* r2_half1, int h,
                                              int64_t t0, int slice, const float* rates = nullptr,
                                              const int* st = nullptr) {
  static_assert(Part == 8 || Part == 4, "parts of 8 or 4 columns");
  const int c8 = (threadIdx.x % (kSlice / 8)) * 8;
#pragma unroll
  for (int part = 0; part < 8; part += Part) {
    float rate[Part];
    if (a.lrpe == FalStepSpec::kCosine)
#pragma unroll
      for (int u = 0; u < Part; ++u) {
        const int j = slice * kSlice + c8 + part + u;
        rate[u] = rates ? rates[j] : rate_of(a, h, j);
      }
#pragma unroll
    for (int it = 0; it < Raw<kSlice, NThr>::kIt; ++it) {
      const int i = (threadIdx.x + it * NThr) / (kSlice / 8), at = i * kLdS + c8 + part;
      const int64_t t = t0 + i;
      const bool live = t < a.N;
      float x[Part], y[Part];
      unpack_part<T>(r.u[it], part, x);
      act_n(x, act, live);
      if (r2) {
        unpack_part<T>(r2->u[it], part, y);
        act_n(y, act2, live);
      }
      if (a.lrpe == FalStepSpec::kCosine) {  // dead rows are zeros whatever their angles
        const int64_t pos = a.position + t - (st ? st[i] : 0);
        float xs[Part], ys[Part];
#pragma unroll
        for (int u = 0; u < Part; ++u) {
          float c, s;
          angle_cs(rate[u], pos, c, s);
          xs[u] = x[u] * s;
          x[u] *= c;
          ys[u] = y[u] * s;
          y[u] *= c;
        }
        store_part<T>(half1 + at, xs);
        if (r2) store_part<T>(r2_half1 + at, ys);
      }
      store_part<T>(half0 + at, x);
      if (r2) store_part<T>(r2_half0 + at, y);
    }
  }
}

// Where element (row i, column c) of a kC-row tile lies (in elements; c a multiple of 8 with its next 7 after
// it). Rows of leading dimension ld, for mma.sync's ldmatrix:
struct RowMajorTile {
  int ld;
  __device__ __forceinline__ int operator()(int i, int c) const { return i * ld + c; }
};
// Blocks of 8 columns, each the kC rows' 16 bytes one after the other and then 16 bytes of padding (so that
// the 8 threads of a row's 8 blocks store to distinct banks): wgmma's MN-major layout without swizzle, rows
// along K (core/cuda_wgmma.cuh; LBO 128 bytes, SBO one block).
struct CoreColumnTile {
  static constexpr int kBlock = kC * 8 + 8;  // elements from one 8-column block to the next
  __device__ __forceinline__ int operator()(int i, int c) const { return (c >> 3) * kBlock + i * 8; }
};

// v rows (act), or gb o dO when d is given, each row times scale[i] when given, into a kC x W tile (leading
// dimension W + kPad unless `at` says otherwise); fetched with c0 = e0. Columns past E and rows past the
// sequence are zeros.
template <class T, int W, int NThr, class At = RowMajorTile>
__device__ __forceinline__ void store_rows(const Args& a, const Raw<W, NThr>& r, const Raw<W, NThr>* d, int act,
                                           int64_t t0, int e0, const float* scale, T* tile,
                                           At at = RowMajorTile{W + kPad}) {
#pragma unroll
  for (int it = 0; it < Raw<W, NThr>::kIt; ++it) {
    const int idx = threadIdx.x + it * NThr, i = idx / (W / 8), c8 = (idx % (W / 8)) * 8;
    const bool live = t0 + i < a.N && e0 + c8 < a.E;
    float y[8];
    unpack8<T>(r.u[it], y);
    act_n(y, act, live);
    if (d) {
      float z[8];
      unpack8<T>(d->u[it], z);
#pragma unroll
      for (int u = 0; u < 8; ++u) y[u] *= z[u];
    }
    if (scale)
#pragma unroll
      for (int u = 0; u < 8; ++u) y[u] *= scale[i];
    store8(tile + at(i, c8), y);
  }
}

// Rows [p0, p0 + kSlice) of a chunk's stored state (P x E in T, row stride E) into a kSlice x EP tile (leading
// dimension EP + kPad) through cp.async (wait with cp_async_wait_all); columns past E are zeros.
template <class T, int EP, int NThr = kThreads>
__device__ __forceinline__ void load_state_async(const Args& a, const T* __restrict__ st, int p0, T* tile) {
#pragma unroll
  for (int it = 0; it < kSlice * (EP / 8) / NThr; ++it) {
    const int idx = threadIdx.x + it * NThr, p = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
    T* dst = tile + p * (EP + kPad) + c8;
    if (c8 < a.E)
      cp_async16(dst, st + int64_t(p0 + p) * a.E + c8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// The launchers (ops/fal/chunk_fwd.cu, ops/fal/chunk_bwd.cu); ops/fal/causal.cu fills Args and picks them.
// True when these kernels take the call: bf16/f16, LRPE none or cosine, D 64 or 128, E a multiple of 8 up to
// 128, elementwise acts.
bool supported(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec);
// The state pass over the segments a.G: forward (reverse false) S_c into a.states and S_final from S0;
// reverse R_(c+1) into a.rstates and dS0 from dS_final; with a.local, each segment's sum into a.boundary.
void state_pass(const Args& a, DType dtype, int64_t BH, bool reverse, cudaStream_t st);
// The state passes on wgmma (ops/fal/chunk_state.cu), which state_pass runs where walk_runs says they take the
// call: the kernel chosen (set_state_pass_kernel; the walks unless LINTAPE_FAL_STATE_PASS=slices), no
// documents, an sm_90a build on a device of compute capability 9.0.
bool walk_runs(const Args& a);
void walk_pass(const Args& a, DType dtype, int64_t BH, bool reverse, cudaStream_t st);
// The fused forward: outputs and S_final, one kernel; with a.local, each segment's forward sum into a.boundary.
// It runs the Hopper form where hopper_forward_runs says it takes the call.
void forward(const Args& a, DType dtype, int64_t BH, cudaStream_t st);
// The fused forward on wgmma (ops/fal/chunk_fwd_hopper.cu): the kernel chosen (set_forward_kernel; Auto unless
// LINTAPE_FAL_FORWARD=chunks), not a local pass, no documents, an sm_90a build on compute capability 9.0.
bool hopper_forward_runs(const Args& a);
void hopper_forward(const Args& a, DType dtype, int64_t BH, cudaStream_t st);
// The gradients from a.states and a.rstates; the Hopper form where hopper_gradients_run says it takes the call.
void gradients(const Args& a, DType dtype, int64_t BH, cudaStream_t st);
// The gradient kernel on wgmma (ops/fal/chunk_bwd_hopper.cu): the kernel chosen (set_gradient_kernel; Auto unless
// LINTAPE_FAL_GRADIENT=chunks), no documents, an sm_90a build on compute capability 9.0.
bool hopper_gradients_run(const Args& a);
void hopper_gradients(const Args& a, DType dtype, int64_t BH, cudaStream_t st);

}  // namespace lintape::fal_cuda::chunk

namespace lintape::fal_cuda {

// x as the chunk kernels read it: in place when its rows suit them, else a contiguous copy.
inline Tensor chunk_input(const Tensor& x) { return chunk_readable(x) ? x : x.contiguous(); }

// The arguments both modes share, for inputs that chunk_readable accepts (the token counts are the
// caller's to set).
inline chunk::Args chunk_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const FalStepSpec& spec) {
  chunk::Args a{};
  fill_common_args(a, q, k, v, g, spec);
  a.starts = spec.starts.defined() ? spec.starts.data_ptr<int32_t>() : nullptr;
  a.sq_b = q.strides()[0], a.sq_t = q.strides()[1];
  a.sk_b = k.strides()[0], a.sk_t = k.strides()[1];
  a.sv_b = v.strides()[0], a.sv_t = v.strides()[1];
  a.sg_b = g.strides()[0], a.sg_t = g.strides()[1];
  return a;
}

// The arguments for a pass over `tokens` tokens (the queries or the keys).
inline chunk::Args over_tokens(chunk::Args a, int64_t tokens) {
  a.N = tokens;
  a.nC = (tokens + chunk::kC - 1) / chunk::kC;
  a.G = 1;
  a.seg_chunks = a.nC;
  return a;
}

// dO and the gradients, which may be strided like the inputs (rows of one buffer, as split's backward
// wants them).
inline void set_gradients(chunk::Args& a, const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                          const Tensor& dg) {
  for (const Tensor* x : {&dq, &dk, &dv, &dg})
    LT_CHECK(chunk_readable(*x), "[fal] internal: a gradient's layout does not suit the chunk kernels: strides ",
             shape_str(x->strides()));
  set_gradient_pointers(a, dout, dq, dk, dv, dg);
  a.sdq_b = dq.strides()[0], a.sdq_t = dq.strides()[1];
  a.sdk_b = dk.strides()[0], a.sdk_t = dk.strides()[1];
  a.sdv_b = dv.strides()[0], a.sdv_t = dv.strides()[1];
  a.sdg_b = dg.strides()[0], a.sdg_t = dg.strides()[1];
}

}  // namespace lintape::fal_cuda
