// Fused TPA attention on tensor cores (mma.sync m16n8k16, 16-bit inputs, f32 accumulation), forward and
// backward in the flash-attention 2 layout: 8 warps, each owning 16 rows of its block's tile; scores,
// probabilities and the accumulators stay in registers (an S accumulator pair is the next multiply's A
// fragment); online softmax in f32, base 2 (scale log2 e folded in, lse stored in base 2).
//
// q, k and v never exist in global memory: a tile is built in shared memory from its factors,
// x[i, :] = (1/R) sum_r a[i, h, r] b[i, r, :] in f32, rounded once. The repeated tiles (K and V in the
// forward and the dQ pass, Q in the dK/dV pass) are pipelined: the next tile's basis rows (contiguous
// over tokens, shared by all heads) go global -> shared by cp.async and its mixing values into
// registers while the current tile is multiplied; ranks too large for the stage area build straight
// from global memory. The forward and the dQ pass keep two K, V pairs and build tile j + 1 between
// the products of tile j, so the builds overlap the tensor-core work.
//   forward:  query tile of 128 rows; per key tile of 64: S = Q K^T, online softmax, O = alpha O + P V.
//   backward: Delta = rowsum(dO o O); a key-tile pass (128 keys; per query tile of 64: dK += dS^T Q,
//             dV += P^T dO) and a query-tile pass (128 queries; per key tile of 64: dQ += dS K), both
//             recomputing P = 2^(S scale log2 e - lse), dS = P (dP - Delta) scale. Each pass ends by
//             contracting its f32 dx tile to the factors: da (this head's values, written once) and db
//             (a sum over heads: f32 atomics into a workspace the launcher casts to the factor dtype).
#include <algorithm>
#include <cmath>
#include "core/cuda.h"
#include "core/cuda_types.cuh"
#include "ops/tpa_cuda.h"
#include "ops/tpa_mma.cuh"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBig = 16 * kWarps;  // the rows a block owns: queries (forward, dQ pass) or keys (dK/dV pass)
constexpr int kSmall = 64;         // the rows of each repeated tile
constexpr int kStageBytes = 96 * 1024;    // forward and dK/dV pass
constexpr int kStageBytesDq = 64 * 1024;  // dQ pass (it also holds dO and two K, V pairs)
constexpr int kMixMax = 4 * kThreads;  // mixing values staged per tile (64 rows x the ranks)
constexpr float kLog2e = 1.4426950408889634f;

template <class T>
struct Params {
  const T *aq, *bq, *ak, *bk, *av, *bv;
  T* out;
  float* lse;
  const T* dout;
  const float* delta;
  T *daq, *dak, *dav;        // written once per (token, head, rank)
  float *dbq, *dbk, *dbv;    // f32 workspaces, zeroed, summed over heads
  int N, M, H, Rq, Rk, Rv;
  float inv_rq, inv_rk, inv_rv, scale, sl2;  // sl2 = scale log2(e)
  bool causal, stage_kv, stage_kv_dq, stage_q;  // whether the repeated tiles' basis rows fit the stage area
};

// ---------------------------------------------------------------------------------------------------
// Tiles in shared memory: rows of HD 16-bit values with a 16-byte pad (ldmatrix without bank conflicts).

template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}
__device__ __forceinline__ float load_f(const float* p) { return *p; }
template <class T>
__device__ __forceinline__ float load_f(const T* p) { return to_acc(*p); }

// dst[i, :] = inv_r sum_r a[i * a_stride + r] b[(i R + r) HD + :] for i < valid, 0 for the other rows up to
// ROWS. b and a point at global memory or at a staged copy (a staged as f32). Each thread owns PER
// 16-byte chunks and issues the loads of G of them together, rank by rank (G < PER saves registers).
template <class T, int HD, int ROWS, int G = ROWS * (HD / 8) / kThreads, class A>
__device__ void build_tile(T* dst, const T* b, const A* a, int a_stride, int R, float inv_r, int valid) {
  constexpr int LD = HD + 8, CH = HD / 8, PER = ROWS * CH / kThreads;
  static_assert(ROWS * CH % kThreads == 0 && PER % G == 0, "whole chunks per thread and per group");
#pragma unroll 1
  for (int k0 = 0; k0 < PER; k0 += G) {
    float acc[G][8];
#pragma unroll
    for (int k = 0; k < G; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[k][e] = 0.f;
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int idx = int(threadIdx.x) + (k0 + k) * kThreads, i = idx / CH, c8 = idx % CH;
        if (i < valid) {
          const float w = load_f(a + size_t(i) * a_stride + r);
          const uint4 v = *reinterpret_cast<const uint4*>(b + (size_t(i) * R + r) * HD + c8 * 8);
          const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = unpack2<T>(u[e]);
            acc[k][2 * e] += w * f.x;
            acc[k][2 * e + 1] += w * f.y;
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < G; ++k) {
      const int idx = int(threadIdx.x) + (k0 + k) * kThreads, i = idx / CH, c8 = idx % CH;
      uint4 o;
      o.x = pack2<T>(acc[k][0] * inv_r, acc[k][1] * inv_r);
      o.y = pack2<T>(acc[k][2] * inv_r, acc[k][3] * inv_r);
      o.z = pack2<T>(acc[k][4] * inv_r, acc[k][5] * inv_r);
      o.w = pack2<T>(acc[k][6] * inv_r, acc[k][7] * inv_r);
      *reinterpret_cast<uint4*>(dst + i * LD + c8 * 8) = o;
    }
  }
}

// One factor pair of one (batch entry, head): a (B, L, H, R), b (B, L, R, HD).
template <class T>
struct Pair {
  const T* a;
  const T* b;
  int L, R;
  float inv_r;
};

// Builds rows row0.. of a pair's tile straight from global memory.
template <class T, int HD, int ROWS, int G = ROWS * (HD / 8) / kThreads>
__device__ void build_global(T* dst, const Pair<T>& f, int64_t bb, int h, int H, int row0) {
  const int64_t t0 = bb * f.L + row0;
  build_tile<T, HD, ROWS, G>(dst, f.b + t0 * f.R * HD, f.a + (t0 * H + h) * f.R, H * f.R, f.R, f.inv_r,
                          min(ROWS, f.L - row0));
}

// Starts staging rows row0.. of a pair: its basis rows (one contiguous block) by cp.async into `stage`
// (zero past the end), its mixing values for head h into mix[] (slot = thread + k kThreads, from `slot0`).
template <class T, int HD, int ROWS>
__device__ void stage_pair(T* stage, float (&mix)[kMixMax / kThreads], int slot0, const Pair<T>& f, int64_t bb,
                           int h, int H, int row0) {
  const int valid = max(0, min(ROWS, f.L - row0));
  const int64_t t0 = bb * f.L + row0;
  const T* src = f.b + t0 * f.R * HD;
  const int chunks = ROWS * f.R * HD / 8, valid_chunks = valid * f.R * HD / 8;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const bool ok = c < valid_chunks;
    cp_async16(stage + c * 8, src + (ok ? c * 8 : 0), ok);
  }
#pragma unroll
  for (int k = 0; k < kMixMax / kThreads; ++k) {
    const int slot = int(threadIdx.x) + k * kThreads - slot0;
    if (slot >= 0 && slot < ROWS * f.R) {
      const int i = slot / f.R, r = slot % f.R;
      mix[k] = i < valid ? to_acc(f.a[((t0 + i) * H + h) * f.R + r]) : 0.f;
    }
  }
}

// Copies rows row0.. of x (B, L, H, HD) for head h into a padded tile by cp.async, zero past L.
template <class T, int HD, int ROWS>
__device__ void copy_rows_async(T* dst, const T* x, int64_t bb, int h, int H, int L, int row0) {
  constexpr int LD = HD + 8, CH = HD / 8;
  for (int idx = threadIdx.x; idx < ROWS * CH; idx += kThreads) {
    const int i = idx / CH, c8 = idx % CH, n = row0 + i;
    const bool ok = n < L;
    cp_async16(dst + i * LD + c8 * 8, x + ((bb * L + (ok ? n : 0)) * H + h) * HD + c8 * 8, ok);
  }
}

// The repeated K and V tiles of the forward and the dQ pass: staged (prefetch, then build) or built from
// global memory. Shared memory: mix_s (kMixMax f32), stage, and two K, V pairs (kv).
template <class T, int HD>
struct KvTiles {
  static constexpr int LD = HD + 8;
  T* kv;  // two K, V pairs
  float* mix_s;
  T* stage;
  float mix[kMixMax / kThreads];
  Pair<T> k, v;
  int64_t bb;
  int h, H;
  bool staged;

  __device__ void prefetch(int j) {
    stage_pair<T, HD, kSmall>(stage, mix, 0, k, bb, h, H, j * kSmall);
    stage_pair<T, HD, kSmall>(stage + kSmall * k.R * HD, mix, kSmall * k.R, v, bb, h, H, j * kSmall);
    cp_async_commit();
  }
  // Waits for the staged tile and publishes its mixing values (block-wide: ends in a barrier).
  __device__ void arrive() {
    cp_async_wait<0>();
#pragma unroll
    for (int q = 0; q < kMixMax / kThreads; ++q) mix_s[threadIdx.x + q * kThreads] = mix[q];
    __syncthreads();
  }
  // Builds tile j into kd, vd: from the stage area (after arrive) or from global memory.
  __device__ void build(int j, T* kd, T* vd) {
    if (staged) {
      const int valid = min(kSmall, k.L - j * kSmall);
      build_tile<T, HD, kSmall>(kd, stage, mix_s, k.R, k.R, k.inv_r, valid);
      build_tile<T, HD, kSmall>(vd, stage + kSmall * k.R * HD, mix_s + kSmall * k.R, v.R, v.R, v.inv_r, valid);
    } else {
      build_global<T, HD, kSmall>(kd, k, bb, h, H, j * kSmall);
      build_global<T, HD, kSmall>(vd, v, bb, h, H, j * kSmall);
    }
  }
  __device__ void start() {
#pragma unroll
    for (int q = 0; q < kMixMax / kThreads; ++q) mix[q] = 0.f;
    if (staged) prefetch(0);
  }
  // Tile j lives in pair j % 2, and tile j + 1 is built while tile j is multiplied, so the build's
  // loads and arithmetic overlap the tensor-core work. Per tile j: the products that read K_j and V_j
  // first, build_next(j), the rest, finish(j).
  __device__ T* k_tile(int j) const { return kv + (j & 1) * 2 * kSmall * LD; }
  __device__ T* v_tile(int j) const { return k_tile(j) + kSmall * LD; }
  __device__ void begin(int tiles) {
    start();
    if (staged) arrive();
    build(0, k_tile(0), v_tile(0));
    __syncthreads();
    if (staged && tiles > 1) prefetch(1);
  }
  // Pair (j + 1) % 2 is free: its last readers finished tile j - 1 before finish(j - 1)'s barrier.
  __device__ void build_next(int j, int tiles) {
    if (staged) arrive();
    if (j + 1 < tiles) build(j + 1, k_tile(j + 1), v_tile(j + 1));
  }
  // Tile j + 1 is built and the stage area free: start staging tile j + 2.
  __device__ void finish(int j, int tiles) {
    __syncthreads();
    if (staged && j + 2 < tiles) prefetch(j + 2);
  }
};

// ---------------------------------------------------------------------------------------------------
// Fragments (see ops/tpa_mma.cuh for the m16n8k16 layouts). Tiles are row-major with LD elements a row.

// A (16 x 16) at rows r0.., columns k0..
template <int LD, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* t, int r0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, t + (r0 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
}
// B for the n-tiles n0 and n0 + 8, k16 at k0, from a tile stored n-major (row n holds k): b[0..1] for n0,
// b[2..3] for n0 + 8.
template <int LD, class T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* t, int n0, int k0) {
  const int lane = threadIdx.x % 32, m = lane >> 3;
  ldmatrix_x4(b, t + (n0 + (lane & 7) + (m >> 1) * 8) * LD + k0 + (m & 1) * 8);
}
// The same from a tile stored k-major (row k holds n), through the transposing load.
template <int LD, class T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* t, int k0, int n0) {
  const int lane = threadIdx.x % 32, m = lane >> 3;
  ldmatrix_x4_trans(b, t + (k0 + (lane & 7) + (m & 1) * 8) * LD + n0 + (m >> 1) * 8);
}

// acc (16 x 64, eight n-tiles) = A rows r0.. of `a` times the 64 rows of `b` (both HD wide), transposed.
template <class T, int HD>
__device__ __forceinline__ void rows_times_rows_t(float (&acc)[8][4], const T* a, int r0, const T* b) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t fa[4];
    load_a<LD>(fa, a, r0, kk * 16);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t fb[4];
      load_b_nk<LD>(fb, b, np * 16, kk * 16);
      mma16816<T>(acc[2 * np], fa, fb[0], fb[1]);
      mma16816<T>(acc[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
}

// The same with the A fragments (16 x HD) already in registers.
template <class T, int HD>
__device__ __forceinline__ void frags_times_rows_t(float (&acc)[8][4], const uint32_t (&fa)[HD / 16][4],
                                                   const T* b) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t fb[4];
      load_b_nk<LD>(fb, b, np * 16, kk * 16);
      mma16816<T>(acc[2 * np], fa[kk], fb[0], fb[1]);
      mma16816<T>(acc[2 * np + 1], fa[kk], fb[2], fb[3]);
    }
}

// acc (16 x HD) += P (16 x 64, accumulator layout, rounded to T) times the 64 x HD tile x (k-major).
template <class T, int HD>
__device__ __forceinline__ void probs_times_rows(float (&acc)[HD / 8][4], const float (&p)[8][4], const T* x) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t fa[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int ep = 0; ep < HD / 16; ++ep) {
      uint32_t fb[4];
      load_b_kn<LD>(fb, x, kk * 16, ep * 16);
      mma16816<T>(acc[2 * ep], fa, fb[0], fb[1]);
      mma16816<T>(acc[2 * ep + 1], fa, fb[2], fb[3]);
    }
  }
}

template <int HD>
__device__ __forceinline__ void zero(float (&acc)[HD / 8][4]) {
#pragma unroll
  for (int t = 0; t < HD / 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
}

// Writes a warp's 16 x HD accumulator (rows r0..) into an f32 tile with HD + 4 floats a row.
template <int HD>
__device__ __forceinline__ void store_acc(float* t, const float (&acc)[HD / 8][4], int r0) {
  constexpr int LDF = HD + 4;
  const int lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int e = 0; e < HD / 8; ++e) {
    *reinterpret_cast<float2*>(t + (r0 + g) * LDF + e * 8 + c) = make_float2(acc[e][0], acc[e][1]);
    *reinterpret_cast<float2*>(t + (r0 + g + 8) * LDF + e * 8 + c) = make_float2(acc[e][2], acc[e][3]);
  }
}

// From an f32 tile dx (kBig rows from row0, HD + 4 floats a row) of one head, the factor gradients of its
// pair: da[t, h, r] = inv_r dx[t] . b[t, r] (written) and db[t, r, :] += inv_r a[t, h, r] dx[t] (f32 atomics).
template <class T, int HD>
__device__ void factor_grads(const float* dx, const Pair<T>& f, T* da, float* db, int64_t bb, int h, int H,
                             int row0) {
  constexpr int LDF = HD + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < kBig; i += kWarps) {
    const int n = row0 + i;
    if (n >= f.L) break;
    const int64_t t = bb * f.L + n;
    float x[HD / 32];
#pragma unroll
    for (int e = 0; e < HD / 32; ++e) x[e] = dx[i * LDF + lane + 32 * e];
    for (int r = 0; r < f.R; ++r) {
      const T* br = f.b + (t * f.R + r) * HD;
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < HD / 32; ++e) dot += x[e] * to_acc(br[lane + 32 * e]);
#pragma unroll
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const int64_t ai = (t * H + h) * f.R + r;
      if (lane == 0) da[ai] = from_acc<T>(dot * f.inv_r);
      const float w = to_acc(f.a[ai]) * f.inv_r;
      float* dbr = db + (t * f.R + r) * HD;
#pragma unroll
      for (int e = 0; e < HD / 32; ++e) atomicAdd(dbr + lane + 32 * e, w * x[e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward: a block per (query tile of kBig rows, head, batch entry); causal tiles heaviest first.

template <int HD>
constexpr size_t fwd_smem() {
  return size_t(kBig + 4 * kSmall) * (HD + 8) * 2 + kMixMax * 4 + kStageBytes;
}

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd(const Params<T> p) {
  constexpr int LD = HD + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  KvTiles<T, HD> kv;
  kv.kv = qs + kBig * LD;
  kv.mix_s = reinterpret_cast<float*>(kv.kv + 4 * kSmall * LD);
  kv.stage = reinterpret_cast<T*>(kv.mix_s + kMixMax);
  const int nq = (p.N + kBig - 1) / kBig;
  const int qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = blockIdx.z;
  const int q0 = qt * kBig;
  kv.k = {p.ak, p.bk, p.M, p.Rk, p.inv_rk};
  kv.v = {p.av, p.bv, p.M, p.Rv, p.inv_rv};
  kv.bb = bb;
  kv.h = h;
  kv.H = p.H;
  kv.staged = p.stage_kv;
  build_global<T, HD, kBig>(qs, Pair<T>{p.aq, p.bq, p.N, p.Rq, p.inv_rq}, bb, h, p.H, q0);
  const int kv_all = (p.M + kSmall - 1) / kSmall;
  const int tiles = p.causal ? min(kv_all, (q0 + kBig + kSmall - 1) / kSmall) : kv_all;
  kv.begin(tiles);  // its barriers also publish Q
  const int row_a = q0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8
  float o[HD / 8][4];
  zero<HD>(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[HD / 16][4];  // this warp's Q rows as A fragments, loaded once
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) load_a<LD>(qf[kk], qs, warp * 16, kk * 16);
  for (int j = 0; j < tiles; ++j) {
    float s[8][4];
    frags_times_rows_t<T, HD>(s, qf, kv.k_tile(j));
    kv.build_next(j, tiles);
    const int k0 = j * kSmall;
    const bool mask = k0 + kSmall > p.M || (p.causal && k0 + kSmall - 1 > q0 + warp * 16);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + t * 8 + c + (e & 1), row = row_a + (e >> 1) * 8;
        const bool ok = !mask || (col < p.M && (!p.causal || col <= row));
        s[t][e] = ok ? s[t][e] * p.sl2 : -INFINITY;
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < 8; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * rr], s[t][2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[rr], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[rr] - base);
      m[rr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        s[t][2 * rr] = exp2f(s[t][2 * rr] - base);
        s[t][2 * rr + 1] = exp2f(s[t][2 * rr + 1] - base);
        sum += s[t][2 * rr] + s[t][2 * rr + 1];
      }
      l[rr] = l[rr] * alpha + sum;
#pragma unroll
      for (int e = 0; e < HD / 8; ++e) {
        o[e][2 * rr] *= alpha;
        o[e][2 * rr + 1] *= alpha;
      }
    }
    probs_times_rows<T, HD>(o, s, kv.v_tile(j));
    kv.finish(j, tiles);
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    const int n = row_a + rr * 8;
    if (n >= p.N) continue;
    const float inv = 1.f / l[rr];
    T* orow = p.out + ((bb * p.N + n) * p.H + h) * HD + c;
#pragma unroll
    for (int e = 0; e < HD / 8; ++e)
      *reinterpret_cast<uint32_t*>(orow + e * 8) = pack2<T>(o[e][2 * rr] * inv, o[e][2 * rr + 1] * inv);
    if ((lane & 3) == 0) p.lse[(bb * p.N + n) * p.H + h] = m[rr] + log2f(l[rr]);
  }
}

// delta[row] = sum_e dout[row, e] out[row, e]: a warp per row of (B N H) rows.
template <class T>
__global__ void attention_delta(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta,
                                int64_t rows, int E) {
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int e = 2 * lane; e < E; e += 64) {
    const float2 a = unpack2<T>(*reinterpret_cast<const uint32_t*>(out + row * E + e));
    const float2 b = unpack2<T>(*reinterpret_cast<const uint32_t*>(dout + row * E + e));
    s += a.x * b.x + a.y * b.y;
  }
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) delta[row] = s;
}

// ---------------------------------------------------------------------------------------------------
// dK/dV pass: a block per (key tile of kBig rows, head, batch entry), over the query tiles that see it.

template <int HD>
constexpr size_t bwd_kv_smem() {
  return size_t(2 * kBig + 3 * kSmall) * (HD + 8) * 2 + kMixMax * 4 + 4 * kSmall * 4 + kStageBytes;
}

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) attention_bwd_kv(const Params<T> p) {
  constexpr int LD = HD + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kBig * LD;
  T* qs = vs + kBig * LD;
  T* dos = qs + kSmall * LD;  // two buffers
  float* mix_s = reinterpret_cast<float*>(dos + 2 * kSmall * LD);
  float* stats = mix_s + kMixMax;  // two buffers of kSmall lse then kSmall delta values
  T* stage = reinterpret_cast<T*>(stats + 4 * kSmall);
  const int kt = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2,
            c = (lane & 3) * 2;
  const int64_t bb = blockIdx.z;
  const int k0 = kt * kBig;
  const Pair<T> fq{p.aq, p.bq, p.N, p.Rq, p.inv_rq}, fk{p.ak, p.bk, p.M, p.Rk, p.inv_rk},
      fv{p.av, p.bv, p.M, p.Rv, p.inv_rv};
  const int first = p.causal ? k0 / kSmall : 0, last = (p.N + kSmall - 1) / kSmall;
  float mix[kMixMax / kThreads] = {};
  float stat = 0.f;  // lse (threads < kSmall) or delta (the next kSmall) of the next query tile's rows
  auto prefetch = [&](int i) {
    const int q0 = i * kSmall;
    if (p.stage_q) stage_pair<T, HD, kSmall>(stage, mix, 0, fq, bb, h, p.H, q0);
    copy_rows_async<T, HD, kSmall>(dos + (i & 1) * kSmall * LD, p.dout, bb, h, p.H, p.N, q0);
    cp_async_commit();
    const int r = threadIdx.x % kSmall, n = q0 + r;
    if (threadIdx.x < 2 * kSmall && n < p.N)
      stat = (threadIdx.x < kSmall ? p.lse : p.delta)[(bb * p.N + n) * p.H + h];
    else
      stat = 0.f;
  };
  if (first < last) prefetch(first);
  build_global<T, HD, kBig>(ks, fk, bb, h, p.H, k0);
  build_global<T, HD, kBig>(vs, fv, bb, h, p.H, k0);

  float dk[HD / 8][4], dv[HD / 8][4];
  zero<HD>(dk);
  zero<HD>(dv);
  const int key_a = k0 + warp * 16 + g;  // this thread's keys: key_a and key_a + 8
  for (int i = first; i < last; ++i) {
    const int q0 = i * kSmall;
    cp_async_wait<0>();
    if (p.stage_q)
#pragma unroll
      for (int q = 0; q < kMixMax / kThreads; ++q) mix_s[threadIdx.x + q * kThreads] = mix[q];
    // Two stats buffers: a slow warp may still read tile i - 1's while a fast one writes tile i's.
    const float* lse_s = stats + (i & 1) * 2 * kSmall;
    const float* delta_s = lse_s + kSmall;
    if (threadIdx.x < 2 * kSmall) stats[(i & 1) * 2 * kSmall + threadIdx.x] = stat;
    __syncthreads();
    // Two chunks at a time: dK and dV hold 128 registers across the build.
    constexpr int G = 2;
    if (p.stage_q)
      build_tile<T, HD, kSmall, G>(qs, stage, mix_s, fq.R, fq.R, fq.inv_r, min(kSmall, p.N - q0));
    else
      build_global<T, HD, kSmall, G>(qs, fq, bb, h, p.H, q0);
    __syncthreads();
    if (i + 1 < last) prefetch(i + 1);
    const T* dcur = dos + (i & 1) * kSmall * LD;
    float st[8][4], dpt[8][4];
    rows_times_rows_t<T, HD>(st, ks, warp * 16, qs);     // S^T = K Q^T
    rows_times_rows_t<T, HD>(dpt, vs, warp * 16, dcur);  // dP^T = V dO^T
    const bool mask = q0 + kSmall > p.N || k0 + kBig > p.M || (p.causal && k0 + warp * 16 + 15 > q0);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = q0 + t * 8 + c + (e & 1), key = key_a + (e >> 1) * 8;
        const bool ok = !mask || (col < p.N && key < p.M && (!p.causal || key <= col));
        const int qc = t * 8 + c + (e & 1);
        const float pv = ok ? exp2f(st[t][e] * p.sl2 - lse_s[qc]) : 0.f;
        st[t][e] = pv;
        dpt[t][e] = pv * (dpt[t][e] - delta_s[qc]) * p.scale;
      }
    probs_times_rows<T, HD>(dv, st, dcur);  // dV += P^T dO
    probs_times_rows<T, HD>(dk, dpt, qs);   // dK += dS^T Q
  }
  __syncthreads();  // the stage area is free: stage the f32 results there
  float* fs = reinterpret_cast<float*>(stage);
  store_acc<HD>(fs, dk, warp * 16);
  __syncthreads();
  factor_grads<T, HD>(fs, fk, p.dak, p.dbk, bb, h, p.H, k0);
  __syncthreads();
  store_acc<HD>(fs, dv, warp * 16);
  __syncthreads();
  factor_grads<T, HD>(fs, fv, p.dav, p.dbv, bb, h, p.H, k0);
}

// ---------------------------------------------------------------------------------------------------
// dQ pass: a block per (query tile of kBig rows, head, batch entry), over the key tiles it sees.

template <int HD>
constexpr size_t bwd_q_smem() {
  return size_t(2 * kBig + 4 * kSmall) * (HD + 8) * 2 + kMixMax * 4 + kStageBytesDq;
}
// The passes stage kBig x (HD + 4) f32 results in the stage area (dK/dV pass) or the two K, V pairs
// (dQ pass).
static_assert(size_t(kBig) * (128 + 4) * 4 <= size_t(kStageBytes), "f32 results fit the stage area");
static_assert(size_t(kBig) * (128 + 4) * 4 <= size_t(4 * kSmall) * (128 + 8) * 2, "f32 results fit the pairs");
static_assert(size_t(kBig) * (64 + 4) * 4 <= size_t(4 * kSmall) * (64 + 8) * 2, "f32 results fit the pairs");

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) attention_bwd_q(const Params<T> p) {
  constexpr int LD = HD + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* dos = qs + kBig * LD;
  KvTiles<T, HD> kv;
  kv.kv = dos + kBig * LD;
  kv.mix_s = reinterpret_cast<float*>(kv.kv + 4 * kSmall * LD);
  kv.stage = reinterpret_cast<T*>(kv.mix_s + kMixMax);
  const int nq = (p.N + kBig - 1) / kBig;
  const int qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = blockIdx.z;
  const int q0 = qt * kBig;
  const Pair<T> fq{p.aq, p.bq, p.N, p.Rq, p.inv_rq};
  kv.k = {p.ak, p.bk, p.M, p.Rk, p.inv_rk};
  kv.v = {p.av, p.bv, p.M, p.Rv, p.inv_rv};
  kv.bb = bb;
  kv.h = h;
  kv.H = p.H;
  kv.staged = p.stage_kv_dq;
  copy_rows_async<T, HD, kBig>(dos, p.dout, bb, h, p.H, p.N, q0);
  cp_async_commit();
  build_global<T, HD, kBig>(qs, fq, bb, h, p.H, q0);
  const int row_a = q0 + warp * 16 + g;
  float lse[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int n = row_a + rr * 8;
    lse[rr] = n < p.N ? p.lse[(bb * p.N + n) * p.H + h] : 0.f;
    delta[rr] = n < p.N ? p.delta[(bb * p.N + n) * p.H + h] : 0.f;
  }
  const int kv_all = (p.M + kSmall - 1) / kSmall;
  const int tiles = p.causal ? min(kv_all, (q0 + kBig + kSmall - 1) / kSmall) : kv_all;
  if (!kv.staged) cp_async_wait<0>();  // dO (the staged path waits in begin)
  kv.begin(tiles);                     // its barriers also publish Q and dO
  float dq[HD / 8][4];
  zero<HD>(dq);
  for (int j = 0; j < tiles; ++j) {
    float s[8][4], dp[8][4];
    rows_times_rows_t<T, HD>(s, qs, warp * 16, kv.k_tile(j));    // S = Q K^T
    rows_times_rows_t<T, HD>(dp, dos, warp * 16, kv.v_tile(j));  // dP = dO V^T
    kv.build_next(j, tiles);
    const int k0 = j * kSmall;
    const bool mask = k0 + kSmall > p.M || row_a - g + 15 >= p.N || (p.causal && k0 + kSmall - 1 > q0 + warp * 16);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + t * 8 + c + (e & 1), row = row_a + (e >> 1) * 8;
        const bool ok = !mask || (row < p.N && col < p.M && (!p.causal || col <= row));
        const float pv = ok ? exp2f(s[t][e] * p.sl2 - lse[e >> 1]) : 0.f;
        s[t][e] = pv * (dp[t][e] - delta[e >> 1]) * p.scale;
      }
    probs_times_rows<T, HD>(dq, s, kv.k_tile(j));  // dQ += dS K
    kv.finish(j, tiles);
  }
  float* fs = reinterpret_cast<float*>(kv.kv);  // free after the last finish's barrier
  store_acc<HD>(fs, dq, warp * 16);
  __syncthreads();
  factor_grads<T, HD>(fs, fq, p.daq, p.dbq, bb, h, p.H, q0);
}

// ---------------------------------------------------------------------------------------------------
// Launchers.

template <class T>
Params<T> make_params(const AttentionArgs& a) {
  Params<T> p{};
  p.aq = static_cast<const T*>(a.aq.data());
  p.bq = static_cast<const T*>(a.bq.data());
  p.ak = static_cast<const T*>(a.ak.data());
  p.bk = static_cast<const T*>(a.bk.data());
  p.av = static_cast<const T*>(a.av.data());
  p.bv = static_cast<const T*>(a.bv.data());
  p.N = int(a.aq.size(1));
  p.M = int(a.ak.size(1));
  p.H = int(a.aq.size(2));
  p.Rq = int(a.aq.size(3));
  p.Rk = int(a.ak.size(3));
  p.Rv = int(a.av.size(3));
  p.inv_rq = 1.f / float(p.Rq);
  p.inv_rk = 1.f / float(p.Rk);
  p.inv_rv = 1.f / float(p.Rv);
  p.scale = float(a.scale);
  p.sl2 = float(a.scale) * kLog2e;
  p.causal = a.causal;
  const int64_t D = a.bq.size(3);
  p.stage_kv = int64_t(kSmall) * (p.Rk + p.Rv) * D * 2 <= kStageBytes;
  p.stage_kv_dq = int64_t(kSmall) * (p.Rk + p.Rv) * D * 2 <= kStageBytesDq;
  p.stage_q = int64_t(kSmall) * p.Rq * D * 2 <= kStageBytes;
  return p;
}

// Raises a kernel's dynamic shared memory limit once per process.
template <class Kernel>
void allow_smem(Kernel kernel, size_t smem, bool& configured) {
  if (!configured) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
}

template <class T, int HD>
void forward_typed(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  Params<T> p = make_params<T>(a);
  p.out = static_cast<T*>(out.data());
  p.lse = lse.data_ptr<float>();
  const dim3 grid(unsigned((p.N + kBig - 1) / kBig), unsigned(p.H), unsigned(a.aq.size(0)));
  static bool configured = false;
  allow_smem(attention_fwd<T, HD>, fwd_smem<HD>(), configured);
  attention_fwd<T, HD><<<grid, kThreads, fwd_smem<HD>(), stream(a.aq.device().index)>>>(p);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int HD>
void backward_typed(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                    FactorGrads& g) {
  const Device dev = a.aq.device();
  cudaStream_t st = stream(dev.index);
  Params<T> p = make_params<T>(a);
  const int64_t B = a.aq.size(0), rows = B * p.N * p.H;
  Tensor delta = empty({B, p.N, p.H}, DType::F32, dev);
  attention_delta<T><<<grid_for(rows, kThreads / 32), kThreads, 0, st>>>(
      static_cast<const T*>(out.data()), static_cast<const T*>(dout.data()), delta.data_ptr<float>(), rows, HD);
  LT_CUDA_CHECK_LAUNCH();
  // One zeroed f32 workspace for the three basis gradients, cast into g's tensors at the end.
  const int64_t nq = B * p.N * p.Rq * HD, nk = B * p.M * p.Rk * HD, nv = B * p.M * p.Rv * HD;
  Tensor ws = zeros({nq + nk + nv}, DType::F32, dev);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = static_cast<const T*>(dout.data());
  p.delta = delta.data_ptr<float>();
  p.daq = static_cast<T*>(g.aq.data());
  p.dak = static_cast<T*>(g.ak.data());
  p.dav = static_cast<T*>(g.av.data());
  p.dbq = ws.data_ptr<float>();
  p.dbk = p.dbq + nq;
  p.dbv = p.dbk + nk;
  static bool kv_configured = false, q_configured = false;
  const dim3 kv_grid(unsigned((p.M + kBig - 1) / kBig), unsigned(p.H), unsigned(B));
  allow_smem(attention_bwd_kv<T, HD>, bwd_kv_smem<HD>(), kv_configured);
  attention_bwd_kv<T, HD><<<kv_grid, kThreads, bwd_kv_smem<HD>(), st>>>(p);
  LT_CUDA_CHECK_LAUNCH();
  const dim3 q_grid(unsigned((p.N + kBig - 1) / kBig), unsigned(p.H), unsigned(B));
  allow_smem(attention_bwd_q<T, HD>, bwd_q_smem<HD>(), q_configured);
  attention_bwd_q<T, HD><<<q_grid, kThreads, bwd_q_smem<HD>(), st>>>(p);
  LT_CUDA_CHECK_LAUNCH();
  g.bq.copy_(ws.narrow(0, 0, nq).view(g.bq.shape()));
  g.bk.copy_(ws.narrow(0, nq, nk).view(g.bk.shape()));
  g.bv.copy_(ws.narrow(0, nq + nk, nv).view(g.bv.shape()));
}

}  // namespace

std::string attention_unsupported(DType dtype, int64_t D, int64_t E, int64_t Rq, int64_t Rk, int64_t Rv) {
  if (dtype != DType::BF16 && dtype != DType::F16)
    return str("bf16 or f16 factors (tensor cores); got ", dtype_name(dtype));
  if (D != E || (D != 64 && D != 128)) return str("D == E, 64 or 128; got D = ", D, ", E = ", E);
  if (Rq > 16 || Rk > 16 || Rv > 16) return str("ranks up to 16; got (", Rq, ", ", Rk, ", ", Rv, ")");
  return "";
}

void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16) wide ? forward_typed<__nv_bfloat16, 128>(a, out, lse) : forward_typed<__nv_bfloat16, 64>(a, out, lse);
  else wide ? forward_typed<__half, 128>(a, out, lse) : forward_typed<__half, 64>(a, out, lse);
}

void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        FactorGrads& g) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16)
    wide ? backward_typed<__nv_bfloat16, 128>(a, out, lse, dout, g) : backward_typed<__nv_bfloat16, 64>(a, out, lse, dout, g);
  else
    wide ? backward_typed<__half, 128>(a, out, lse, dout, g) : backward_typed<__half, 64>(a, out, lse, dout, g);
}

}  // namespace lintape::tpa_cuda
