// Internal to ops/tpa/attention.cu: the forward on warpgroup products fed by a producer warp (sm_90a), the
// structure of FlashAttention-3. A block of 384 threads per (query tile of kWgRows, head, batch entry): two
// consumer warpgroups of 64 query rows each (warps 0-7) and a producer warpgroup (warps 8-11) whose one
// thread copies K and V tiles of kWgKeys rows (built once per launch, as for the other kernels) by the tensor
// copy engine (TMA) into a ring of kStages slots, each completing on an mbarrier; the consumers give a slot
// back by arriving on its "empty" mbarrier, so no block-wide barrier runs inside the loop. setmaxnreg moves
// registers from the producer (24) to the consumers (240). Tiles are stored with the 128-byte swizzle (boxes
// of 64 columns), Q too: the consumers build it from its factors in the same pattern.
//
// Per tile and consumer warpgroup, as in attention_wg.cuh: S = Q K^T issued together with the previous
// tile's O += P V, the softmax while the second runs. PINGPONG: the two warpgroups take turns issuing their
// products (named barriers 2 and 3), so one's softmax runs while the other's products hold the tensor cores.
#pragma once
#include "core/cuda_tma.cuh"
#include "ops/tpa/attention_wg.cuh"

namespace lintape::tpa_cuda::attention_tma {
using namespace attention_parts;
using attention_wg::kWgKeys;
using attention_wg::kWgRows;

constexpr int kStages = 2;                  // K and V slots each
constexpr int kTmaThreads = 384;            // two consumer warpgroups, then the producer's
constexpr int kBox = 64;                    // columns a box: 128 bytes, the swizzle's width
constexpr int kConsumerRegs = 240, kProducerRegs = 24;

// Rows of 128 bytes of a 64-column box of ROWS rows, the 16-byte chunks swizzled: column block c8 / 8's box,
// row i, chunk (c8 % 8) ^ (i % 8).
template <int ROWS>
struct SwizzleTile {
  __device__ __forceinline__ int operator()(int i, int c8) const {
    return (c8 >> 3) * ROWS * kBox + i * kBox + (((c8 & 7) ^ (i & 7)) << 3);
  }
};

template <int HD>
constexpr int tile_elems() {
  return kWgKeys * HD;
}
// Q, then kStages K slots, then kStages V slots, from a 1024-byte boundary (1024 bytes of slack to find it).
template <int HD>
constexpr size_t smem_bytes() {
  return size_t(kWgRows * HD + 2 * kStages * tile_elems<HD>()) * 2 + 1024;
}

#ifdef LINTAPE_WGMMA
// S (this warpgroup's 64 rows x kWgKeys) = Q K^T, both K-major, issued and committed.
template <class T, int HD>
__device__ __forceinline__ void issue_scores(float (&s)[kWgKeys / 2], const T* qa, const T* ks) {
#pragma unroll
  for (int i = 0; i < kWgKeys / 2; ++i) s[i] = 0.f;
  wgmma_fence_operand(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const int box = kk / 4, col = (kk % 4) * 16;  // a k-step's 32 bytes inside its box's 128-byte rows
    wgmma_mma<T, kWgKeys, 0, 0>(s, wgmma_desc_sw128(qa + box * kWgRows * kBox + col, 16, 1024),
                                wgmma_desc_sw128(ks + box * kWgKeys * kBox + col, 16, 1024));
  }
  wgmma_commit();
}

// O += P V (P's fragments in registers; V MN-major, its 64-column boxes kWgKeys rows apart), issued and
// committed.
template <class T, int HD>
__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&pa)[kWgKeys / 16][4], const T* vs) {
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kWgKeys / 16; ++kk)
    wgmma_rs<T, HD, 1>(o, pa[kk], wgmma_desc_sw128(vs + kk * 16 * kBox, kWgKeys * kBox * 2, 1024));
  wgmma_commit();
}
#endif

// The producer's thread: K and V tiles 0..tiles-1 into the ring, K_j before V_j (the consumers need K_j and
// V_{j-1} together), each slot when its consumers have given it back.
template <int HD>
__device__ __forceinline__ void produce(const CUtensorMap* tk, const CUtensorMap* tv, void* kslots, void* vslots,
                                        uint64_t* full_k, uint64_t* full_v, uint64_t* empty_k, uint64_t* empty_v,
                                        int h, int tiles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint32_t kTileBytes = tile_elems<HD>() * 2, kBoxBytes = kWgKeys * kBox * 2;
  auto load = [&](const CUtensorMap* map, void* slots, uint64_t* full, uint64_t* empty, int j) {
    const int s = j % kStages;
    mbarrier_wait(&empty[s], ((j / kStages) & 1) ^ 1);
    mbarrier_arrive_expect_tx(&full[s], kTileBytes);
    unsigned char* dst = static_cast<unsigned char*>(slots) + size_t(s) * kTileBytes;
#pragma unroll
    for (int b = 0; b < HD / kBox; ++b)
      tma_load_4d(dst + b * kBoxBytes, map, &full[s], b * kBox, h, j * kWgKeys, int(blockIdx.z));
  };
  for (int j = 0; j < tiles; ++j) {
    load(tk, kslots, full_k, empty_k, j);
    load(tv, vslots, full_v, empty_v, j);
  }
#endif
}

template <class T, int HD, bool PINGPONG>
__global__ void __launch_bounds__(kTmaThreads, 1)
    forward(const Params<T> p, const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
#ifndef LINTAPE_WGMMA
  __trap();  // attention_forward picks this kernel only where wgmma was compiled
#else
  static_assert(kThreads == 256, "the consumers build Q as the block of kThreads threads");
  constexpr int KT = tile_elems<HD>();
  constexpr int QG = kWgRows * (HD / 8) / kThreads;
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t bars[4 * kStages];  // full K, full V, empty K, empty V
  T* qs = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* kslots = qs + kWgRows * HD;
  T* vslots = kslots + kStages * KT;
  uint64_t *full_k = bars, *full_v = bars + kStages, *empty_k = bars + 2 * kStages, *empty_v = bars + 3 * kStages;
  const attention_wg::Block blk(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full_k[s], 1);
      mbarrier_init(&full_v[s], 1);
      mbarrier_init(&empty_k[s], kThreads);
      mbarrier_init(&empty_v[s], kThreads);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 8 && lane == 0) produce<HD>(&tk, &tv, kslots, vslots, full_k, full_v, empty_k, empty_v, blk.h,
                                            blk.tiles);
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int g = lane >> 2, c = (lane & 3) * 2;
  Pair<T> fq = p.fq;
  if (p.scale < 0) fq.inv_r = -fq.inv_r;  // Q carries the scale's sign (as in attention_fwd)
  build_global<T, HD, kWgRows, QG, SwizzleTile<kWgRows>, 2>(qs, fq, blk.bb, blk.h, blk.q0, SwizzleTile<kWgRows>{});
  fence_proxy_async();
  bar_sync(1, kThreads);  // Q built by both consumer warpgroups
  const float sl2 = fabsf(p.sl2);
  const int wrow0 = blk.q0 + wg * 64, row_a = wrow0 + (warp & 3) * 16 + g;
  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t pa[kWgKeys / 16][4];
  const T* qa = qs + wg * 64 * kBox;  // this warpgroup's rows in each box
  // PINGPONG: warpgroup w issues after bar_sync(2 + w); the other's turn is handed on after each issue but
  // the second warpgroup's last (every sync matched by one arrival; the first turn is warpgroup 0's).
  const int rounds = blk.tiles + 1;
  int round = 0;
  auto take_turn = [&] {
    if constexpr (PINGPONG) bar_sync(2 + wg, kThreads);
  };
  auto pass_turn = [&] {
    if constexpr (PINGPONG) {
      if (wg == 0 || ++round < rounds) bar_arrive(3 - wg, kThreads);
    }
  };
  if (PINGPONG && wg == 1) bar_arrive(2, kThreads);
  for (int j = 0; j < blk.tiles; ++j) {
    const int s = j % kStages;
    mbarrier_wait(&full_k[s], (j / kStages) & 1);
    float sc[kWgKeys / 2];
    take_turn();
    issue_scores<T, HD>(sc, qa, kslots + s * KT);
    const int sv = (j + kStages - 1) % kStages;
    if (j > 0) {
      mbarrier_wait(&full_v[sv], ((j - 1) / kStages) & 1);
      issue_pv<T, HD>(o, pa, vslots + sv * KT);
      pass_turn();
      wgmma_wait<1>();  // S (committed first) done; P V may still run
    } else {
      pass_turn();
      wgmma_wait<0>();
    }
    mbarrier_arrive(&empty_k[s]);
    wgmma_fence_operand(sc);
    float alpha[2];
    attention_wg::softmax_scores<T>(p, sc, m, l, alpha, j * kWgKeys, wrow0, row_a, c, sl2);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    if (j > 0) mbarrier_arrive(&empty_v[sv]);
    attention_wg::rescale<HD>(o, alpha);
    attention_wg::probs_to_frags<T>(pa, sc);
  }
  if (blk.tiles > 0) {
    const int j = blk.tiles - 1, sv = j % kStages;
    mbarrier_wait(&full_v[sv], (j / kStages) & 1);
    take_turn();
    issue_pv<T, HD>(o, pa, vslots + sv * KT);
    pass_turn();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
  }
  attention_wg::store_rows<T, HD>(p, o, m, l, blk.bb, blk.h, row_a, c);
#endif
}

}  // namespace lintape::tpa_cuda::attention_tma
