// Internal to ops/tpa/attention.cu: the forward on warpgroup products fed by a producer warp (sm_90a), the
// structure of FlashAttention-3. A block of 384 threads: two consumer warpgroups of 64 query rows each (warps
// 0-7) and a producer warpgroup (warps 8-11) whose one thread copies K and V tiles of kWgKeys rows (built once
// per launch, as for the other kernels) by the tensor copy engine (TMA) into a ring of kStages slots, each
// completing on an mbarrier; the consumers give a slot back by arriving on its "empty" mbarrier, so no
// block-wide barrier runs inside the loop. setmaxnreg moves registers from the producer (24) to the consumers
// (240). Tiles are stored with the 128-byte swizzle (boxes of 64 columns), Q too. A block runs work items
// (query tile of kWgRows, head, batch entry): one, or persistent, a grid of one block an SM walking them, the
// producer copying the next item's tiles (and with QTMA its Q) while the consumers finish the last.
//
// Per tile and consumer warpgroup, as in attention_wg.cuh: S = Q K^T issued together with the previous
// tile's O += P V, the softmax while the second runs. PINGPONG: the two warpgroups take turns issuing their
// products (named barriers 2 and 3), so one's softmax runs while the other's products hold the tensor cores.
#pragma once
#include "core/cuda_tma.cuh"
#include "ops/tpa/attention_wg.cuh"

namespace lintape::tpa_cuda {
// x (entries, L, H, HD) 16-bit (K or V of a launch's batch entries, Q in the forward's output or the backward's
// workspace, dO) as a 4-D tensor map read in boxes of 64 columns x `rows` rows of one head and entry, stored with
// the 128-byte swizzle; rows past L read as zeros. x 16-byte aligned (ops/tpa/attention.cu).
CUtensorMap rows_tensor_map(const void* x, int64_t entries, int L, int H, int HD, bool bf16, int rows);
// The same over f32 rows (the backward's dQ workspace), boxes of 32 columns (128 bytes) x `rows` rows.
CUtensorMap f32_rows_tensor_map(const void* x, int64_t entries, int L, int H, int HD, int rows);
}  // namespace lintape::tpa_cuda

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

// A block's work item w (0 <= w < query tiles x H x entries): in sections of kSection (head, batch entry) pairs
// (whose K and V stay in L2 while the blocks running at once read them), the query tiles heaviest first when
// causal, the pairs fastest (head, then the launch's batch entry z).
constexpr int kSection = 4;
struct Item {
  int qt, h, z, q0, tiles;
  int64_t bb;
  template <class T>
  __device__ __forceinline__ Item(const Params<T>& p, int w, int entries) {
    const int nq = (p.N + kWgRows - 1) / kWgRows, sec = w / (kSection * nq), first = sec * kSection;
    const int count = min(kSection, p.H * entries - first), rem = w - first * nq, r = rem / count;
    const int pair = first + rem % count;
    qt = p.causal ? nq - 1 - r : r;
    h = pair % p.H;
    z = pair / p.H;
    bb = p.b0 + z;
    q0 = qt * kWgRows;
    const int kv_all = (p.M + kWgKeys - 1) / kWgKeys;
    tiles = p.causal ? min(kv_all, (q0 + kWgRows + kWgKeys - 1) / kWgKeys) : kv_all;
  }
};

// The mbarriers: a full / empty pair per slot of K, of V, and (QTMA) of Q.
struct Ring {
  uint64_t full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages], full_q, empty_q;
};

// The producer's thread, over the block's items: K and V tiles into the ring (the consumers need K_j and
// V_{j-1} together), each slot when its consumers have given it back; QTMA: the item's Q (built beforehand
// into the output, whose rows the item overwrites only after it has read them) after its first K tile, once
// the consumers are done with the previous item's Q. The ring's slots and phases run on across items.
template <class T, int HD, bool QTMA>
__device__ __forceinline__ void produce(const Params<T>& p, const CUtensorMap* tq,
                                        const CUtensorMap* tk, const CUtensorMap* tv, void* qs, void* kslots,
                                        void* vslots, Ring& ring, int items, int entries) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint32_t kTileBytes = tile_elems<HD>() * 2, kBoxBytes = kWgKeys * kBox * 2;
  int n = 0;  // tiles produced
  auto load = [&](const CUtensorMap* map, void* slots, uint64_t* full, uint64_t* empty, int h, int z, int j) {
    const int s = n % kStages;
    mbarrier_wait(&empty[s], ((n / kStages) & 1) ^ 1);
    mbarrier_arrive_expect_tx(&full[s], kTileBytes);
    unsigned char* dst = static_cast<unsigned char*>(slots) + size_t(s) * kTileBytes;
#pragma unroll
    for (int b = 0; b < HD / kBox; ++b) tma_load_4d(dst + b * kBoxBytes, map, &full[s], b * kBox, h, j * kWgKeys, z);
  };
  int qn = 0;  // items begun
  for (int w = blockIdx.x; w < items; w += gridDim.x, ++qn) {
    const Item it(p, w, entries);
    for (int j = 0; j < it.tiles; ++j, ++n) {
      load(tk, kslots, ring.full_k, ring.empty_k, it.h, it.z, j);
      if (QTMA && j == 0) {
        mbarrier_wait(&ring.empty_q, (qn & 1) ^ 1);
        mbarrier_arrive_expect_tx(&ring.full_q, kWgRows * HD * 2);
#pragma unroll
        for (int b = 0; b < HD / kBox; ++b)
          tma_load_4d(static_cast<unsigned char*>(qs) + b * kWgRows * kBox * 2, tq, &ring.full_q, b * kBox, it.h,
                      it.q0, int(it.bb));
      }
      load(tv, vslots, ring.full_v, ring.empty_v, it.h, it.z, j);
    }
  }
#endif
}

// QTMA: Q comes by TMA from the output (built there beforehand), through tq; else the consumers build it from
// its factors. The grid runs items blockIdx.x, + gridDim.x, ... (a block per item, or persistent).
template <class T, int HD, bool PINGPONG, bool QTMA>
__global__ void __launch_bounds__(kTmaThreads, 1)
    forward(const Params<T> p, const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
            const __grid_constant__ CUtensorMap tv, int items, int entries) {
#ifndef LINTAPE_WGMMA
  __trap();  // attention_forward picks this kernel only where wgmma was compiled
#else
  static_assert(kThreads == 256, "the consumers build Q as the block of kThreads threads");
  constexpr int KT = tile_elems<HD>();
  constexpr int QG = kWgRows * (HD / 8) / kThreads;
  extern __shared__ unsigned char smem_raw[];
  __shared__ Ring ring;
  // Aligned through an integer, so accesses through qs are generic: addressing it as shared memory (as the
  // backward kernels do) made the non-ping-pong form 8-15% slower at N 8192 on an H200 (bench/notes/tpa-hopper.md
  // section 6).
  T* qs = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  T* kslots = qs + kWgRows * HD;
  T* vslots = kslots + kStages * KT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&ring.full_k[s], 1);
      mbarrier_init(&ring.full_v[s], 1);
      mbarrier_init(&ring.empty_k[s], kThreads);
      mbarrier_init(&ring.empty_v[s], kThreads);
    }
    mbarrier_init(&ring.full_q, 1);
    mbarrier_init(&ring.empty_q, kThreads);
    mbarrier_init_fence();
  }
  __syncthreads();
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 8 && lane == 0)
      produce<T, HD, QTMA>(p, &tq, &tk, &tv, qs, kslots, vslots, ring, items, entries);
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int g = lane >> 2, c = (lane & 3) * 2;
  const float sl2 = fabsf(p.sl2);
  const T* qa = qs + wg * 64 * kBox;  // this warpgroup's rows in each box
  // PINGPONG: warpgroup w issues after bar_sync(2 + w) and hands the turn on after each issue; the first turn is
  // warpgroup 0's, and its last bar_sync takes the second's last hand-over (every arrival met by one sync).
  auto take_turn = [&] {
    if constexpr (PINGPONG) bar_sync(2 + wg, kThreads);
  };
  auto pass_turn = [&] {
    if constexpr (PINGPONG) bar_arrive(3 - wg, kThreads);
  };
  if (PINGPONG && wg == 1) bar_arrive(2, kThreads);
  int n = 0, qn = 0;  // tiles and items consumed
  for (int w = blockIdx.x; w < items; w += gridDim.x, ++qn) {
    const Item it(p, w, entries);
    if constexpr (QTMA) {
      mbarrier_wait(&ring.full_q, qn & 1);
    } else {
      Pair<T> fq = p.fq;
      if (p.scale < 0) fq.inv_r = -fq.inv_r;  // Q carries the scale's sign (as in attention_fwd)
      if (qn > 0) bar_sync(1, kThreads);      // both warpgroups done with the previous item's Q
      build_global<T, HD, kWgRows, QG, SwizzleTile<kWgRows>, 2>(qs, fq, it.bb, it.h, it.q0, SwizzleTile<kWgRows>{});
      fence_proxy_async();
      bar_sync(1, kThreads);  // Q built by both consumer warpgroups
    }
    const int wrow0 = it.q0 + wg * 64, row_a = wrow0 + (warp & 3) * 16 + g;
    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    uint32_t pa[kWgKeys / 16][4];
    for (int j = 0; j < it.tiles; ++j) {
      const int s = (n + j) % kStages, sv = (n + j + kStages - 1) % kStages;
      mbarrier_wait(&ring.full_k[s], ((n + j) / kStages) & 1);
      float sc[kWgKeys / 2];
      take_turn();
      issue_scores<T, HD>(sc, qa, kslots + s * KT);
      if (j > 0) {
        mbarrier_wait(&ring.full_v[sv], ((n + j - 1) / kStages) & 1);
        issue_pv<T, HD>(o, pa, vslots + sv * KT);
        pass_turn();
        wgmma_wait<1>();  // S (committed first) done; P V may still run
      } else {
        pass_turn();
        wgmma_wait<0>();
      }
      mbarrier_arrive(&ring.empty_k[s]);
      if (QTMA && j == it.tiles - 1) mbarrier_arrive(&ring.empty_q);
      wgmma_fence_operand(sc);
      float alpha[2];
      attention_wg::softmax_scores<T>(p, sc, m, l, alpha, j * kWgKeys, wrow0, row_a, c, sl2);
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      if (j > 0) mbarrier_arrive(&ring.empty_v[sv]);
      attention_wg::rescale<HD>(o, alpha);
      attention_wg::probs_to_frags<T>(pa, sc);
    }
    n += it.tiles;
    const int sv = (n - 1) % kStages;
    mbarrier_wait(&ring.full_v[sv], ((n - 1) / kStages) & 1);
    take_turn();
    issue_pv<T, HD>(o, pa, vslots + sv * KT);
    pass_turn();
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    mbarrier_arrive(&ring.empty_v[sv]);
    attention_wg::store_rows<T, HD>(p, o, m, l, it.bb, it.h, row_a, c);
  }
  if (PINGPONG && wg == 0) bar_sync(2, kThreads);
#endif
}

}  // namespace lintape::tpa_cuda::attention_tma
