// Internal to ops/tpa/attention.cu: the forward on Hopper's warpgroup products (wgmma, sm_90a). A block of
// kWgRows queries (two warpgroups of 64 rows, 4 warps each) per (query tile, head, batch entry). Q is built
// from its factors straight into shared memory in wgmma's 8-column block layout; K and V (built once per
// launch, as for the mma.sync kernel) come by cp.async in tiles of kWgKeys rows, double-buffered, one
// barrier a tile. Per tile and warpgroup: S = Q K^T (64 x kWgKeys, both operands from shared memory), the
// online softmax in registers, and O += P V with P's accumulators rounded to 16 bits as the A operand in
// registers and V from shared memory. Causal: only the tiles up to the diagonal, the diagonal masked (with
// kWgRows == kWgKeys no warpgroup meets a tile wholly above its rows). Pipelined within each warpgroup: a
// tile's softmax runs while the tensor cores do the previous tile's P V (waiting for each product instead
// was 5% slower). Slower than the mma.sync kernel on an H100 (bench/notes/tpa-hopper.md): only with
// LINTAPE_TPA_FWD=wgmma; attention_tma.cuh is its successor, and uses its softmax and stores.
#pragma once
#include "core/cuda_wgmma_rs.cuh"
#include "ops/tpa/attention_parts.cuh"

namespace lintape::tpa_cuda::attention_wg {
using namespace attention_parts;

constexpr int kWgRows = 128;  // queries a block
constexpr int kWgKeys = 128;  // keys a tile
using QTile = BlockTile<kWgRows>;
using KvTile = BlockTile<kWgKeys>;

template <int HD>
constexpr size_t smem_bytes() {
  return size_t(HD / 8) * (QTile::kBlock + 4 * KvTile::kBlock) * 2;  // Q, then two K, V pairs
}

// The online softmax of one tile's scores s (64 x kWgKeys, the accumulator layout: s[4 t + e] at row
// row_a + 8 (e >> 1), key k0 + 8 t + c + (e & 1)), in place into probabilities 2^(s |scale| log2 e - m); m
// and l updated; alpha[rr], the factor of the output accumulators of row row_a + 8 rr, returned.
template <class T>
__device__ __forceinline__ void softmax_scores(const Params<T>& p, float (&s)[kWgKeys / 2], float (&m)[2],
                                               float (&l)[2], float (&alpha)[2], int k0, int wrow0, int row_a,
                                               int c, float sl2) {
  if (k0 + kWgKeys > p.M || (p.causal && k0 + kWgKeys - 1 > wrow0))
#pragma unroll
    for (int t = 0; t < kWgKeys / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + t * 8 + c + (e & 1), row = row_a + (e >> 1) * 8;
        if (col >= p.M || (p.causal && col > row)) s[4 * t + e] = -INFINITY;
      }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -INFINITY;
#pragma unroll
    for (int t = 0; t < kWgKeys / 8; ++t) mx = fmaxf(mx, fmaxf(s[4 * t + 2 * rr], s[4 * t + 2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[rr], mx * sl2);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    alpha[rr] = exp2_ftz(m[rr] - base);
    m[rr] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int t = 0; t < kWgKeys / 8; ++t) {
      float& s0 = s[4 * t + 2 * rr];
      float& s1 = s[4 * t + 2 * rr + 1];
      s0 = exp2_ftz(fmaf(s0, sl2, -base));
      s1 = exp2_ftz(fmaf(s1, sl2, -base));
      sum += s0 + s1;
    }
    l[rr] = l[rr] * alpha[rr] + sum;
  }
}

// o (a thread's accumulators of rows row_a and row_a + 8) times alpha of its row.
template <int HD>
__device__ __forceinline__ void rescale(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int e = 0; e < HD / 8; ++e) {
    o[4 * e] *= alpha[0];
    o[4 * e + 1] *= alpha[0];
    o[4 * e + 2] *= alpha[1];
    o[4 * e + 3] *= alpha[1];
  }
}

// Probabilities (accumulator layout) rounded to T as the A fragments of O += P V, one per 16 keys.
template <class T>
__device__ __forceinline__ void probs_to_frags(uint32_t (&pa)[kWgKeys / 16][4], const float (&s)[kWgKeys / 2]) {
#pragma unroll
  for (int kk = 0; kk < kWgKeys / 16; ++kk)
#pragma unroll
    for (int u = 0; u < 4; ++u) pa[kk][u] = pack2<T>(s[8 * kk + 2 * u], s[8 * kk + 2 * u + 1]);
}

// out and lse of a thread's two rows (after the last tile).
template <class T, int HD>
__device__ __forceinline__ void store_rows(const Params<T>& p, const float (&o)[HD / 2], const float (&m)[2],
                                           float (&l)[2], int64_t bb, int h, int row_a, int c) {
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
      *reinterpret_cast<uint32_t*>(orow + e * 8) = pack2<T>(o[4 * e + 2 * rr] * inv, o[4 * e + 2 * rr + 1] * inv);
    if ((threadIdx.x & 3) == 0) p.lse[(bb * p.N + n) * p.H + h] = m[rr] + log2f(l[rr]);
  }
}

#ifdef LINTAPE_WGMMA
// S (this warpgroup's 64 rows x kWgKeys) = Q K^T, issued and committed, not waited for.
template <class T, int HD>
__device__ __forceinline__ void issue_scores(float (&s)[kWgKeys / 2], const T* qa, const T* ks) {
  constexpr uint32_t kBlockBytes = KvTile::kBlock * 2;
#pragma unroll
  for (int i = 0; i < kWgKeys / 2; ++i) s[i] = 0.f;
  wgmma_fence_operand(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    wgmma_mma<T, kWgKeys, 0, 0>(s, wgmma_desc(qa + 2 * kk * QTile::kBlock, kBlockBytes, 128),
                                wgmma_desc(ks + 2 * kk * KvTile::kBlock, kBlockBytes, 128));
  wgmma_commit();
}

// O += P V (P's fragments in registers, V MN-major: its rows run along the keys), issued and committed.
template <class T, int HD>
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&pa)[kWgKeys / 16][4], const T* vs) {
  constexpr uint32_t kBlockBytes = KvTile::kBlock * 2;
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kWgKeys / 16; ++kk)
    wgmma_rs<T, HD, 1>(o, pa[kk], wgmma_desc(vs + kk * 16 * 8, 128, kBlockBytes));
  wgmma_commit();
}
#endif

// The block's coordinates and its tile counts.
struct Block {
  int qt, h, q0, tiles;
  int64_t bb;
  template <class T>
  __device__ __forceinline__ Block(const Params<T>& p) {
    const int nq = (p.N + kWgRows - 1) / kWgRows;
    qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
    h = blockIdx.y;
    bb = p.b0 + blockIdx.z;
    q0 = qt * kWgRows;
    const int kv_all = (p.M + kWgKeys - 1) / kWgKeys;
    tiles = p.causal ? min(kv_all, (q0 + kWgRows + kWgKeys - 1) / kWgKeys) : kv_all;
  }
};

// Pipelined within each warpgroup: tile j's S = Q K_j is issued together with O += P_{j-1} V_{j-1}, and
// tile j's softmax runs while the tensor cores do the second. K and V have two slots each, copied one tile
// apart: at tile j's barrier K_j and V_{j-1} have landed, and K_{j+1} and V_j are started (their slots held
// K_{j-1} and V_{j-2}, which every warpgroup is done with).
template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) forward(const Params<T> p) {
#ifndef LINTAPE_WGMMA
  __trap();  // attention_forward picks this kernel only where wgmma was compiled
#else
  static_assert(kThreads == 256, "two warpgroups");
  constexpr int QT = HD / 8 * QTile::kBlock, KT = HD / 8 * KvTile::kBlock;
  constexpr int QG = kWgRows * (HD / 8) / kThreads;  // Q's chunks a thread: all loads of two ranks in flight
  static_assert(QTile::kBlock == KvTile::kBlock, "Q and K share the descriptors' strides");
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* kslot = qs + QT;         // K slot s at kslot + s KT
  T* vslot = kslot + 2 * KT;  // V slot s at vslot + s KT
  const Block blk(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2, wg = warp / 4;
  auto copy = [&](T* slots, const T* x, int j) {
    copy_rows_async<T, HD, kWgKeys>(slots + (j & 1) * KT, x, blockIdx.z, blk.h, p.H, p.M, j * kWgKeys, KvTile{});
  };
  copy(kslot, p.k, 0);
  cp_async_commit();
  Pair<T> fq = p.fq;
  if (p.scale < 0) fq.inv_r = -fq.inv_r;  // Q carries the scale's sign (as in attention_fwd)
  build_global<T, HD, kWgRows, QG, QTile, 2>(qs, fq, blk.bb, blk.h, blk.q0, QTile{});
  const float sl2 = fabsf(p.sl2);
  const int wrow0 = blk.q0 + wg * 64, row_a = wrow0 + (warp & 3) * 16 + g;
  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t pa[kWgKeys / 16][4];
  const T* qa = qs + wg * 64 * 8;
  for (int j = 0; j < blk.tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (j + 1 < blk.tiles) copy(kslot, p.k, j + 1);
    copy(vslot, p.v, j);
    cp_async_commit();
    float s[kWgKeys / 2];
    issue_scores<T, HD>(s, qa, kslot + (j & 1) * KT);
    if (j > 0) {
      issue_pv<T, HD>(o, pa, vslot + ((j - 1) & 1) * KT);
      wgmma_wait<1>();  // S (committed first) done; P V may still run
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operand(s);
    // The softmax, o's rescaling held back until P_{j-1} V_{j-1} is done.
    float alpha[2];
    softmax_scores<T>(p, s, m, l, alpha, j * kWgKeys, wrow0, row_a, c, sl2);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    rescale<HD>(o, alpha);
    probs_to_frags<T>(pa, s);
  }
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // V of the last tile landed
  if (blk.tiles > 0) {
    issue_pv<T, HD>(o, pa, vslot + ((blk.tiles - 1) & 1) * KT);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
  }
  store_rows<T, HD>(p, o, m, l, blk.bb, blk.h, row_a, c);
#endif
}

}  // namespace lintape::tpa_cuda::attention_wg
