// Internal to the fused TPA attention (ops/tpa/attention.cu, ops/tpa/attention_bwd.cu): the shared
// device pieces. Tiles built in shared memory from the factors, x[i, :] = (1/R) sum_r a[i, h, r] b[i, r, :]
// in f32, rounded once, and staged through cp.async; m16n8k16 fragments and the products of the
// flash-attention 2 layout (8 warps, each owning 16 rows of its block's tile); the contraction of an f32
// gradient tile to its factors; the turns that order the backward's sums across blocks; the kernels'
// parameters.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include "core/cuda.h"
#include "core/cuda_acts.cuh"
#include "core/cuda_types.cuh"
#include "core/cuda_wgmma.cuh"
#include "ops/tpa/launch.h"
#include "core/cuda_mma.cuh"
#include "core/cuda_reduce.cuh"

namespace lintape::tpa_cuda::attention_parts {
using namespace lintape::cuda;
using namespace lintape::cuda_device;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBig = 16 * kWarps;  // the rows a block owns: queries (forward) or keys (backward)
constexpr int kSmall = 64;         // the rows of each repeated tile
constexpr float kLog2e = 1.4426950408889634f;

// One factor pair: a (B, L, H, R) and b (B, L, R, HD), read in place through token strides (the mixer's
// views of its two projections): a[t, h, r] at a + t a_tok + h a_head + r and b[t, r, :] at
// b + t b_tok + r HD, t = entry L + row.
template <class T>
struct Pair {
  const T* a;
  const T* b;
  int L, R;
  float inv_r;
  int64_t a_tok, b_tok;
  int a_head;
  __device__ __forceinline__ const T* a_at(int64_t t, int h) const { return a + t * a_tok + h * a_head; }
  __device__ __forceinline__ const T* b_at(int64_t t) const { return b + t * b_tok; }
};

// The split backward's dK and dV rows: bf16 for bf16 factors (f32's range; rounded as einsum + SDPA's dK and dV
// are), f32 for f16 factors (f16 would flush small gradients: a one-token document's dK lost 2-100% of itself).
template <class T>
using DkvRow = std::conditional_t<std::is_same<T, __nv_bfloat16>::value, __nv_bfloat16, float>;

template <class T>
struct Params {
  Pair<T> fq, fk, fv;
  T* out;
  float* lse;
  const T* dout;
  const float* delta;
  T *daq, *dak, *dav;        // written once per (token, head, rank)
  float *dbk, *dbv;          // f32 workspaces, zeroed, summed over heads in head order
  float* dq;                 // f32 workspace (batch entries, N, H, HD), zeroed: dQ summed over key tiles in order
  DkvRow<T> *dk_rows, *dv_rows;  // the split backward's workspaces (batch entries, M, H, HD): dK / scale, dV
  int* dq_turn;              // zeroed, a counter per (batch entry, head, query tile): see wait_turn
  int* db_turn;              // zeroed, a counter per (batch entry, key tile, chunk of 16 keys)
  int* ticket;               // zeroed: hands the blocks their places in the grid in the order they start
  bool ordered;              // false: the turns never wait (the sums' order varies; for timing their cost)
  const T* q;                // Q of the backward launch's batch entries (N, H, HD each), built once
  const T *k, *v;            // K and V of the forward launch's batch entries (M, H, HD each), built once
  int64_t b0;                // a launch's first batch entry: where its workspaces start
  int N, M, H;
  float scale, sl2;  // sl2 = scale log2(e)
  bool causal;
  // Documents (N == M): starts (B, N), query n sees key m iff starts[n] <= m <= n (causal), or iff
  // starts[n] <= m and starts[m] <= n (not causal: the same document); null without. The kernels read it
  // only where compiled for documents (their DOCS parameter).
  const int32_t* starts;
};

// ---------------------------------------------------------------------------------------------------
// Tiles in shared memory: rows of HD 16-bit values with a 16-byte pad (ldmatrix without bank conflicts),
// or blocks of 8 columns for wgmma. A layout maps (row i, 8-column chunk c8) to the chunk's first element.

template <int LD>
struct RowTile {
  __device__ __forceinline__ int operator()(int i, int c8) const { return i * LD + c8 * 8; }
};
// Blocks of 8 columns, each the ROWS rows' 16 bytes one after the other, then 16 bytes of padding (the 8
// chunks of a row land in distinct banks): core matrices (8 rows x 16 bytes) of wgmma's layouts without
// swizzle (core/cuda_wgmma.cuh). K-major (rows along M or N): LBO one block, SBO 128 bytes; MN-major (rows
// along K): LBO 128 bytes, SBO one block.
template <int ROWS>
struct BlockTile {
  static constexpr int kBlock = ROWS * 8 + 8;  // elements from one 8-column block to the next
  __device__ __forceinline__ int operator()(int i, int c8) const { return c8 * kBlock + i * 8; }
};

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
// dst[i, :] = inv_r sum_r a[i a_stride + r] b[i b_stride + r HD + :] for i < valid, 0 for the other rows up
// to ROWS. Each thread owns PER 16-byte chunks and issues the loads of G of them together, rank by rank, or
// with RU > 1 unrolled RU ranks deep (G < PER saves registers; more loads in flight shorten the chain of load
// latencies).
template <class T, int HD, int ROWS, int G = ROWS * (HD / 8) / kThreads, class At = RowTile<HD + 8>, int RU = 1>
__device__ void build_tile(T* dst, const T* b, const T* a, int64_t a_stride, int64_t b_stride, int R, float inv_r,
                           int valid, At at = At{}) {
  constexpr int CH = HD / 8, PER = ROWS * CH / kThreads;
  static_assert(ROWS * CH % kThreads == 0 && PER % G == 0, "whole chunks per thread and per group");
#pragma unroll 1
  for (int k0 = 0; k0 < PER; k0 += G) {
    float acc[G][8];
#pragma unroll
    for (int k = 0; k < G; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[k][e] = 0.f;
    auto rank = [&](int r) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int idx = int(threadIdx.x) + (k0 + k) * kThreads, i = idx / CH, c8 = idx % CH;
        if (i < valid) {
          const float w = to_acc(a[i * a_stride + r]);
          const uint4 v = *reinterpret_cast<const uint4*>(b + i * b_stride + r * HD + c8 * 8);
          const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = unpack2<T>(u[e]);
            acc[k][2 * e] += w * f.x;
            acc[k][2 * e + 1] += w * f.y;
          }
        }
      }
    };
    if constexpr (RU == 1) {
      for (int r = 0; r < R; ++r) rank(r);  // the compiler's own unrolling
    } else {
#pragma unroll RU
      for (int r = 0; r < R; ++r) rank(r);
    }
#pragma unroll
    for (int k = 0; k < G; ++k) {
      const int idx = int(threadIdx.x) + (k0 + k) * kThreads, i = idx / CH, c8 = idx % CH;
      uint4 o;
      o.x = pack2<T>(acc[k][0] * inv_r, acc[k][1] * inv_r);
      o.y = pack2<T>(acc[k][2] * inv_r, acc[k][3] * inv_r);
      o.z = pack2<T>(acc[k][4] * inv_r, acc[k][5] * inv_r);
      o.w = pack2<T>(acc[k][6] * inv_r, acc[k][7] * inv_r);
      *reinterpret_cast<uint4*>(dst + at(i, c8)) = o;
    }
  }
}

// Builds rows row0.. of a pair's tile straight from global memory.
template <class T, int HD, int ROWS, int G = ROWS * (HD / 8) / kThreads, class At = RowTile<HD + 8>, int RU = 1>
__device__ void build_global(T* dst, const Pair<T>& f, int64_t bb, int h, int row0, At at = At{}) {
  const int64_t t0 = bb * f.L + row0;
  build_tile<T, HD, ROWS, G, At, RU>(dst, f.b_at(t0), f.a_at(t0, h), f.a_tok, f.b_tok, f.R, f.inv_r,
                                     min(ROWS, f.L - row0), at);
}

// x (entries, L, H, HD) of a launch's batch entries from a pair's factors: x[t, h] = inv_r sum_r a[t, h, r]
// b[t, r] in f32, rounded once (the arithmetic of build_tile), for tokens t0.. (t0 = first entry L). A
// thread per (token, 8 columns), all heads; its basis chunks stay in L1 across the heads.
template <class T, int HD>
__global__ void build_rows(const Pair<T> f, T* __restrict__ x, int64_t t0, int64_t tokens, int H) {
  constexpr int CH = HD / 8;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x, w = idx / CH;
  if (w >= tokens) return;
  const int c8 = int(idx % CH);
  const int64_t t = t0 + w;
  for (int h = 0; h < H; ++h) {
    float acc[8] = {};
    for (int r = 0; r < f.R; ++r) {
      const float ar = to_acc(f.a_at(t, h)[r]);
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(f.b_at(t) + r * HD + c8 * 8));
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(u[e]);
        acc[2 * e] += ar * f.x;
        acc[2 * e + 1] += ar * f.y;
      }
    }
    uint4 o;
    o.x = pack2<T>(acc[0] * f.inv_r, acc[1] * f.inv_r);
    o.y = pack2<T>(acc[2] * f.inv_r, acc[3] * f.inv_r);
    o.z = pack2<T>(acc[4] * f.inv_r, acc[5] * f.inv_r);
    o.w = pack2<T>(acc[6] * f.inv_r, acc[7] * f.inv_r);
    *reinterpret_cast<uint4*>(x + (w * H + h) * HD + c8 * 8) = o;
  }
}

// Copies rows row0.. of x (B, L, H, HD) for head h into a padded tile by cp.async, zero past L. A thread
// copies one 16-byte column of rows kThreads / CH apart: one address computed, the rest by adding.
template <class T, int HD, int ROWS, class At = RowTile<HD + 8>>
__device__ __forceinline__ void copy_rows_async(T* dst, const T* x, int64_t bb, int h, int H, int L, int row0,
                                                At at = At{}) {
  constexpr int CH = HD / 8, STEP = kThreads / CH, PER = ROWS * CH / kThreads;
  static_assert(kThreads % CH == 0 && ROWS * CH % kThreads == 0, "whole rows per pass, whole passes");
  const int i0 = int(threadIdx.x / CH), c8 = int(threadIdx.x % CH);
  const int64_t step = int64_t(STEP) * H * HD;
  const T* src = x + ((bb * L + row0 + i0) * H + h) * HD + c8 * 8;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const bool ok = row0 + i0 + k * STEP < L;
    cp_async16(dst + at(i0 + k * STEP, c8), ok ? src + k * step : x, ok);
  }
}

// ---------------------------------------------------------------------------------------------------
// Fragments (see core/cuda_mma.cuh for the m16n8k16 layouts). Tiles are row-major with LD elements a row.

// A (16 x 16) at rows r0.., columns k0..
template <int LD, class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* t, int r0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, t + (r0 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
}
// A (16 x 16) at rows m0.., columns k0.. from a tile stored k-major (row k holds m), through the
// transposing load.
template <int LD, class T>
__device__ __forceinline__ void load_a_km(uint32_t (&a)[4], const T* t, int k0, int m0) {
  const int lane = threadIdx.x % 32, m = lane >> 3;
  ldmatrix_x4_trans(a, t + (k0 + (lane & 7) + (m >> 1) * 8) * LD + m0 + (m & 1) * 8);
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

// acc (16 x 8 NT, NT n-tiles) = A rows r0.. of `a` times rows n0.. of `b` (both HD wide), transposed.
template <class T, int HD, int NT = 8>
__device__ __forceinline__ void rows_times_rows_t(float (&acc)[NT][4], const T* a, int r0, const T* b, int n0 = 0) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t fa[4];
    load_a<LD>(fa, a, r0, kk * 16);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t fb[4];
      load_b_nk<LD>(fb, b, n0 + np * 16, kk * 16);
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

// acc (16 x HD) += P (16 x 16 KT, accumulator layout, rounded to T) times rows k0.. of the HD-wide tile x
// (k-major).
template <class T, int HD, int KT = 4>
__device__ __forceinline__ void probs_times_rows(float (&acc)[HD / 8][4], const float (&p)[2 * KT][4], const T* x,
                                                 int k0 = 0) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    const uint32_t fa[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int ep = 0; ep < HD / 16; ++ep) {
      uint32_t fb[4];
      load_b_kn<LD>(fb, x, k0 + kk * 16, ep * 16);
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

// Writes a warp's 16 x HD accumulator (rows r0..) times mul into an f32 tile with HD + 4 floats a row.
template <int HD>
__device__ __forceinline__ void store_acc(float* t, const float (&acc)[HD / 8][4], int r0, float mul) {
  constexpr int LDF = HD + 4;
  const int lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int e = 0; e < HD / 8; ++e) {
    *reinterpret_cast<float2*>(t + (r0 + g) * LDF + e * 8 + c) = make_float2(acc[e][0] * mul, acc[e][1] * mul);
    *reinterpret_cast<float2*>(t + (r0 + g + 8) * LDF + e * 8 + c) =
        make_float2(acc[e][2] * mul, acc[e][3] * mul);
  }
}

// The backward's f32 tiles (kBig rows) go to their factors in chunks of 16 rows (one turn each, see
// wait_turn); warp w takes rows 16 c + 2 w and 16 c + 2 w + 1 of chunk c.
constexpr int kChunks = kBig / 16;
static_assert(kWarps * 2 == 16, "two rows a warp in a chunk");

// From an f32 tile dx (kBig rows from row0, HD + 4 floats a row) of one head, the rank weights of its pair
// for the rows of chunk c: da[t, h, r] = inv_r dx[t] . b[t, r], each written once.
template <class T, int HD>
__device__ void factor_da(const float* dx, const Pair<T>& f, T* da, int64_t bb, int h, int H, int row0, int c) {
  constexpr int LDF = HD + 4, E = HD / 32, U = 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float x[U][E];
  int64_t t[U];
  bool ok[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = 16 * c + 2 * warp + u, n = row0 + i;
    ok[u] = n < f.L;
    t[u] = bb * f.L + (ok[u] ? n : 0);
#pragma unroll
    for (int e = 0; e < E; ++e) x[u][e] = dx[i * LDF + lane + 32 * e];
  }
#pragma unroll 1
  for (int r = 0; r < f.R; ++r) {
    float dot[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* br = f.b_at(t[u]) + r * HD;
      dot[u] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot[u] += x[u][e] * to_acc(br[lane + 32 * e]);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
#pragma unroll
      for (int u = 0; u < U; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (ok[u] && lane == 0) da[(t[u] * H + h) * f.R + r] = from_acc<T>(dot[u] * f.inv_r);
  }
}

// dst[0..V) += v[0..V) by one vector atomic (sm_90 has float2 and float4 global atomics).
template <int V>
__device__ __forceinline__ void atomic_add_vec(float* dst, const float* v) {
#if __CUDA_ARCH__ >= 900
  if constexpr (V == 4) atomicAdd(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));
  else atomicAdd(reinterpret_cast<float2*>(dst), make_float2(v[0], v[1]));
#else
#pragma unroll
  for (int e = 0; e < V; ++e) atomicAdd(dst + e, v[e]);
#endif
}

// The same tile's share of the basis gradient summed over heads, rows of chunk c: db[t, r, :] += w[i, r] dx[t]
// (f32 atomics into a workspace that starts at batch entry b0), w (kBig x R in shared memory) =
// inv_r a[t, h, r] (see rank_weights). A lane adds HD / 32 adjacent columns at once; no global load waits
// between the adds.
template <class T, int HD>
__device__ void factor_db(const float* dx, const float* w, const Pair<T>& f, float* db, int64_t bb, int64_t b0,
                          int row0, int c) {
  constexpr int LDF = HD + 4, V = HD / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = 16 * c + 2 * warp + u, n = row0 + i;
    if (n >= f.L) break;
    float x[V];
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = dx[i * LDF + lane * V + e];
    float* dbt = db + ((bb - b0) * f.L + n) * f.R * HD + lane * V;
#pragma unroll 1
    for (int r = 0; r < f.R; ++r) {
      const float wr = w[i * f.R + r];
      float v[V];
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = wr * x[e];
      atomic_add_vec<V>(dbt + r * HD, v);
    }
  }
}

// w[i, r] = inv_r a[t, h, r] for the kBig rows from row0 (0 past L), into shared memory.
template <class T>
__device__ void rank_weights(float* w, const Pair<T>& f, int64_t bb, int h, int row0) {
  for (int k = threadIdx.x; k < kBig * f.R; k += kThreads) {
    const int i = k / f.R, n = row0 + i;
    w[k] = n < f.L ? to_acc(f.a_at(bb * f.L + n, h)[k % f.R]) * f.inv_r : 0.f;
  }
}

// Sums across blocks in a fixed order, so the backward's results are the same bits run to run. A counter
// (zeroed) per summed tile: block k of its chain adds once blocks 0..k-1 have added and counted (k count
// units each: one a block, or one a warp). A warp reads the counter early (poll_turn: lane 0's load is in
// flight while the warp computes what it will add), waits for the turn (wait_turn), adds, and the block or
// the warp counts itself after a barrier (count_turn: a release, which covers the adds of every thread that
// passed the barrier). The loads are relaxed: the adds depend on the value read, and a block's count is
// released only after its adds were performed. A block only waits for blocks of lower linear index
// (earlier in the grid's launch order), so every block it waits for has started: no deadlock.
__device__ __forceinline__ int poll_turn(const int* turn) {
  int v = 0;
  if (threadIdx.x % 32 == 0) asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(turn) : "memory");
  return v;
}
__device__ __forceinline__ void wait_turn(const int* turn, int target, int seen) {
  if (threadIdx.x % 32 == 0)
    while (seen < target) asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(turn) : "memory");
  __syncwarp();
}
__device__ __forceinline__ void count_turn(int* turn) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" : : "l"(turn) : "memory");
}

// The end of a backward block (key tile kt from row k0, head h): from its f32 dK and dV tiles fk, fv (kBig
// rows, HD + 4 floats a row, dK scaled) and their rank weights wk, wv (rank_weights), chunk by chunk, the
// rank weights' gradients (written once), then the basis gradients summed over heads, head by head, each warp
// counting itself. A chunk's chain of heads runs while the next chunk's weights are computed, so head h waits
// about h chunks' adds, not h whole tiles' (the H blocks of a key tile end together).
template <class T, int HD>
__device__ void basis_turns(const float* fk, const float* fv, const float* wk, const float* wv, const Params<T>& p,
                            int64_t bb, int h, int kt, int k0) {
  int* db_turn = p.db_turn + ((bb - p.b0) * gridDim.z + kt) * kChunks;
#pragma unroll 1
  for (int c = 0; c < kChunks; ++c) {
    const int seen = poll_turn(db_turn + c);
    factor_da<T, HD>(fk, p.fk, p.dak, bb, h, p.H, k0, c);
    factor_da<T, HD>(fv, p.fv, p.dav, bb, h, p.H, k0, c);
    wait_turn(db_turn + c, p.ordered ? h * kWarps : 0, seen);
    factor_db<T, HD>(fk, wk, p.fk, p.dbk, bb, p.b0, k0, c);
    factor_db<T, HD>(fv, wv, p.fv, p.dbv, bb, p.b0, k0, c);
    __syncwarp();
    if (threadIdx.x % 32 == 0) count_turn(db_turn + c);
  }
}

// Documents: the tiles [0, count) of `tiles` tiles of `rows` rows whose first row's document starts at or
// before `limit` (starts is nondecreasing, so they come first); every thread of the block gets the count.
__device__ __forceinline__ int tiles_starting_by(const int32_t* starts, int tiles, int rows, int limit) {
  int count = 0;
  for (int j0 = 0; j0 < tiles; j0 += kThreads) {
    const int j = j0 + int(threadIdx.x);
    count += __syncthreads_count(j < tiles && starts[int64_t(j) * rows] <= limit);
  }
  return count;
}

// ---------------------------------------------------------------------------------------------------
// Launchers.

template <class T>
Pair<T> make_pair(const Tensor& a, const Tensor& b) {
  Pair<T> f;
  f.a = static_cast<const T*>(a.data());
  f.b = static_cast<const T*>(b.data());
  f.L = int(a.size(1));
  f.R = int(a.size(3));
  f.inv_r = 1.f / float(f.R);
  f.a_tok = a.strides()[1];
  f.a_head = int(a.strides()[2]);
  f.b_tok = b.strides()[1];
  return f;
}

template <class T>
Params<T> make_params(const AttentionArgs& a) {
  Params<T> p{};
  p.fq = make_pair<T>(a.aq, a.bq);
  p.fk = make_pair<T>(a.ak, a.bk);
  p.fv = make_pair<T>(a.av, a.bv);
  p.N = int(a.aq.size(1));
  p.M = int(a.ak.size(1));
  p.H = int(a.aq.size(2));
  p.scale = float(a.scale);
  p.sl2 = float(a.scale) * kLog2e;
  p.causal = a.causal;
  p.starts = a.starts.defined() ? a.starts.data_ptr<int32_t>() : nullptr;
  return p;
}

// Launches over the batch for kernels with per-launch workspaces. A launch's workspace stays within
// max(budget_bytes, kWorkspaceFloor), budget_bytes being the output's (or its gradient's) bytes, as long as
// the launch still fills the device twice over; the launches share the batch evenly (their sizes differ by
// at most one entry). The floor keeps small batches in one launch. It was 256 MiB: at the model's shape
// (B = 16, H = 6, N = 2048) the backward's workspace was then 45% of its peak; at 64 MiB it runs six launches
// instead of two, 4% slower, and its peak is 0.58x einsum + SDPA's (0.77x at 256 MiB with the same rows).
constexpr int64_t kWorkspaceFloor = int64_t(64) << 20;
// per_launch > 0 caps a launch's entries (AttentionArgs::batch_per_launch: tests run several launches).
inline int64_t batch_launches(int64_t B, int64_t ws_entry_bytes, int64_t budget_bytes, int64_t entry_blocks,
                              int device, int64_t per_launch = 0) {
  const int sms = sm_count(device);
  // LINTAPE_TPA_WORKSPACE_MIB sets the floor instead, in MiB (0: the built-in one), read once.
  static const int64_t floor_bytes = [] {
    const char* env = std::getenv("LINTAPE_TPA_WORKSPACE_MIB");
    if (!env || !*env) return kWorkspaceFloor;
    char* end = nullptr;
    const long long mib = std::strtoll(env, &end, 10);
    LT_CHECK(*end == '\0' && mib >= 0 && mib <= (int64_t(1) << 30),
             "[tpa_attention] LINTAPE_TPA_WORKSPACE_MIB is a whole number of MiB (0: the built-in ",
             kWorkspaceFloor >> 20, "); got '", env, "'");
    return mib > 0 ? int64_t(mib) << 20 : kWorkspaceFloor;
  }();
  const int64_t by_memory = std::max<int64_t>(1, std::max(budget_bytes, floor_bytes) / ws_entry_bytes);
  const int64_t to_fill = (2 * int64_t(sms) + entry_blocks - 1) / entry_blocks;
  const int64_t chunk = std::min(per_launch > 0 ? std::min(B, per_launch) : B, std::max(by_memory, to_fill));
  return (B + chunk - 1) / chunk;
}

using cuda::is_hopper;
using cuda::wgmma_compiled;

// Raises a kernel's dynamic shared memory limit once per process.
template <class Kernel>
void allow_smem(Kernel kernel, size_t smem, bool& configured) {
  if (!configured) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
}

}  // namespace lintape::tpa_cuda::attention_parts
