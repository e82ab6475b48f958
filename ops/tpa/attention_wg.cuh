// Internal to ops/tpa/attention.cu: the forward on Hopper's warpgroup products (wgmma, sm_90a). A block of
// kWgRows queries (two warpgroups of 64 rows, 4 warps each) per (query tile, head, batch entry). Q is built
// from its factors straight into shared memory in wgmma's 8-column block layout; K and V (built once per
// launch, as for the mma.sync kernel) come by cp.async in tiles of kWgKeys rows, double-buffered, one
// barrier a tile. Per tile and warpgroup: S = Q K^T (64 x kWgKeys, both operands from shared memory), the
// online softmax in registers, then O += P V with P's accumulators rounded to 16 bits as the A operand in
// registers and V from shared memory. Causal: tiles above a warpgroup's rows skipped, the diagonal masked.
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

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) forward(const Params<T> p) {
#ifndef LINTAPE_WGMMA
  __trap();  // attention_forward picks this kernel only where wgmma was compiled
#else
  static_assert(kThreads == 256, "two warpgroups");
  constexpr int QT = HD / 8 * QTile::kBlock, KT = HD / 8 * KvTile::kBlock, NS = kWgKeys / 2;
  constexpr uint32_t kBlockBytes = KvTile::kBlock * 2;
  static_assert(QTile::kBlock == KvTile::kBlock, "Q and K share the descriptors' strides");
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* kv = qs + QT;  // pair s: K at kv + 2 s KT, V after it
  const int nq = (p.N + kWgRows - 1) / kWgRows;
  const int qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int wg = warp / 4;
  const int64_t bb = p.b0 + blockIdx.z;
  const int q0 = qt * kWgRows;
  const int kv_all = (p.M + kWgKeys - 1) / kWgKeys;
  const int tiles = p.causal ? min(kv_all, (q0 + kWgRows + kWgKeys - 1) / kWgKeys) : kv_all;
  auto prefetch = [&](int j) {
    T* kt = kv + 2 * (j & 1) * KT;
    copy_rows_async<T, HD, kWgKeys>(kt, p.k, blockIdx.z, h, p.H, p.M, j * kWgKeys, KvTile{});
    copy_rows_async<T, HD, kWgKeys>(kt + KT, p.v, blockIdx.z, h, p.H, p.M, j * kWgKeys, KvTile{});
    cp_async_commit();
  };
  if (tiles > 0) prefetch(0);
  // Q carries the scale's sign, so the scores times |scale log2 e| are the logits (as in attention_fwd).
  Pair<T> fq = p.fq;
  if (p.scale < 0) fq.inv_r = -fq.inv_r;
  build_global<T, HD, kWgRows, 4>(qs, fq, bb, h, q0, QTile{});
  const float sl2 = fabsf(p.sl2);
  const int wrow0 = q0 + wg * 64, row_a = wrow0 + (warp & 3) * 16 + g;  // rows row_a and row_a + 8
  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const T* qa = qs + wg * 64 * 8;  // this warpgroup's 64 rows
  for (int j = 0; j < tiles; ++j) {
    cp_async_wait<0>();
    fence_proxy_async();  // Q's stores and tile j's copies, read next by wgmma
    __syncthreads();      // tile j published; every warpgroup is done with tile j - 1, whose pair is free
    if (j + 1 < tiles) prefetch(j + 1);
    const int k0 = j * kWgKeys;
    if (p.causal && k0 > wrow0 + 63) continue;  // above all of this warpgroup's rows
    const T* ks = kv + 2 * (j & 1) * KT;
    const T* vs = ks + KT;
    float s[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = 0.f;
    wgmma_fence_operand(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_mma<T, kWgKeys, 0, 0>(s, wgmma_desc(qa + 2 * kk * QTile::kBlock, kBlockBytes, 128),
                                  wgmma_desc(ks + 2 * kk * KvTile::kBlock, kBlockBytes, 128));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    // s[4 t + e]: row row_a + 8 (e >> 1), key k0 + 8 t + c + (e & 1).
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
      const float alpha = fast_exp2(m[rr] - base);
      m[rr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < kWgKeys / 8; ++t) {
        float& s0 = s[4 * t + 2 * rr];
        float& s1 = s[4 * t + 2 * rr + 1];
        s0 = fast_exp2(fmaf(s0, sl2, -base));
        s1 = fast_exp2(fmaf(s1, sl2, -base));
        sum += s0 + s1;
      }
      l[rr] = l[rr] * alpha + sum;
#pragma unroll
      for (int e = 0; e < HD / 8; ++e) {
        o[4 * e + 2 * rr] *= alpha;
        o[4 * e + 2 * rr + 1] *= alpha;
      }
    }
    // O += P V: P's accumulators, rounded, are the A fragments; V MN-major (its rows run along the keys).
    uint32_t pa[kWgKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk)
#pragma unroll
      for (int u = 0; u < 4; ++u) pa[kk][u] = pack2<T>(s[8 * kk + 2 * u], s[8 * kk + 2 * u + 1]);
    wgmma_fence_operand(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk)
      wgmma_rs<T, HD, 1>(o, pa[kk], wgmma_desc(vs + kk * 16 * 8, 128, kBlockBytes));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
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
      *reinterpret_cast<uint32_t*>(orow + e * 8) = pack2<T>(o[4 * e + 2 * rr] * inv, o[4 * e + 2 * rr + 1] * inv);
    if ((lane & 3) == 0) p.lse[(bb * p.N + n) * p.H + h] = m[rr] + log2f(l[rr]);
  }
#endif
}

}  // namespace lintape::tpa_cuda::attention_wg
