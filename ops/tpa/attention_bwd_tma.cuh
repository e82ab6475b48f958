// Internal to ops/tpa/attention_bwd.cu: the split warpgroup backward (attention_bwd_wg.cuh with SPLIT) fed by a
// producer warp, as the TMA forward is (attention_tma.cuh). A block of 384 threads: two consumer warpgroups of
// 64 keys each (warps 0-7, the products and the schedule of attention_bwd_wg) and a producer warpgroup (warps
// 8-11). Warp 8 first brings the block's K and V tiles from rows built beforehand by build_rows (on one
// mbarrier; built by the consumers from the factors, a chain of global loads in a prologue nothing hides with
// one block an SM, they took about a fifth of the block's time), then each query tile's Q and dO (boxes of 64
// columns x kSmall rows by the tensor copy engine, 128-byte swizzle) and its lse and Delta rows (ordinary loads
// of its 32 lanes) into a ring of kStages slots, each completing on a "full" mbarrier; the consumers give a slot
// back by arriving on its "empty" one.
// No block-wide barrier inside the loop: the two consumer warpgroups meet only through dS'^T, whose buffers
// each complete on an mbarrier of the 256 consumer threads (a warpgroup's dQ product reads both warpgroups'
// rows). dQ of tile i + kLag is issued at tile i (the split form: i + 1), so a warpgroup waits only for the
// other's dS'^T of kLag tiles before and may run up to about kLag - 1/2 tiles ahead of it: room for one's
// exponentials to run under the other's products. Its rows then stay kLag tiles in their buffer, and the
// buffer written at tile i was read last by both warpgroups' dQ products at tile i + kLag (each done before
// its warpgroup's arrival there), hence 2 kLag buffers. setmaxnreg moves registers from the producer
// warpgroup to the consumers.
//
// dQ: each consumer thread stores its dQ rows of a tile into one f32 tile in shared memory, laid out as four TMA
// boxes of 32 columns, and arrives on an mbarrier; one thread of warp 9 waits for it and for the tile's turn,
// adds the boxes to the workspace by bulk tensor reductions (the copy engine adds in L2 whole lines at a time),
// gives the buffer back once they have read it and counts the turn once they are complete. Per-thread float4
// atomics by three reducer warps (before) kept the consumers waiting for the buffer about a fifth of their time
// (bench/notes/tpa-hopper.md section 9). The block ends as the split form does (dK and dV rows to their
// workspaces, contracted per token by rows_factor_grads).
#pragma once
#include "ops/tpa/attention_bwd_wg.cuh"

namespace lintape::tpa_cuda::attention_bwd_tma {
using namespace attention_parts;
using attention_bwd_wg::kWgKeys;
using attention_tma::kBox;
using attention_tma::kTmaThreads;
using attention_tma::SwizzleTile;

constexpr int kStages = 2;  // Q, dO, lse, Delta slots (a third would not leave room for the dQ tile)
constexpr int kLag = 2;     // tiles between a tile's dS'^T and its dQ product
constexpr int kDsBuffers = 2 * kLag;
// The producer's lanes: 33 arrivals a full phase (one with the copies' bytes, then each lane's after its stores).
constexpr int kFullArrivals = 33;

// Registers a thread (setmaxnreg): the producer warpgroup keeps 40, the consumers 232 (no spills).
constexpr int kBwdProducerRegs = 40, kBwdConsumerRegs = 232;
// The staged dQ tile's boxes: kDqBox f32 columns (128 bytes, the swizzle's width) x kSmall rows each.
constexpr int kDqBox = 32;
static_assert(2 * 128 * kBwdConsumerRegs + 128 * kBwdProducerRegs <= 65536, "the register file");

// K, V, kStages Q, dO pairs, kDsBuffers dS'^T tiles, kStages lse, Delta pairs, the dQ tile (kSmall x HD f32),
// from a 1024-byte boundary.
template <int HD>
constexpr size_t smem_bytes() {
  return size_t(2 * kBig * HD + 2 * kStages * kSmall * HD + kDsBuffers * kBig * kSmall) * 2 +
         2 * kStages * kSmall * 4 + size_t(kSmall) * HD * 4 + 1024;
}
static_assert(smem_bytes<128>() <= 227 * 1024 - 128, "a block and its mbarriers fit an sm_90 multiprocessor");

// The mbarriers: a full / empty pair per slot, one per dS'^T buffer (both warpgroups' rows written), and K and V.
struct Ring {
  uint64_t full[kStages], empty[kStages], ds[kDsBuffers], kv;
  uint64_t dq_full, dq_empty;  // the staged dQ tile written (the consumers) and read (the reducers)
};

#ifdef LINTAPE_WGMMA
// Warp 8, over the block's query tiles last to first (the n-th into slot n % kStages): once the slot is free,
// lane 0 copies Q (tq: the launch's built Q, entry bb - b0) and dO (tdo: entry bb) of the tile by TMA, rows
// past N zero-filled, and each lane stores two lse and two Delta values (0 past N).
template <class T, int HD>
__device__ __forceinline__ void produce(const Params<T>& p, const CUtensorMap* tq, const CUtensorMap* tdo, T* slots,
                                        float* stats, Ring& ring, int64_t bb, int h, int first, int last) {
  constexpr int QT = kSmall * HD;
  constexpr uint32_t kBoxBytes = kSmall * kBox * 2;
  const int lane = threadIdx.x % 32;
  for (int i = last - 1, n = 0; i >= first; --i, ++n) {
    const int s = n % kStages, q0 = i * kSmall;
    mbarrier_wait(&ring.empty[s], ((n / kStages) & 1) ^ 1);
    if (lane == 0) {
      mbarrier_arrive_expect_tx(&ring.full[s], 2 * QT * 2);
      unsigned char* dst = reinterpret_cast<unsigned char*>(slots + 2 * s * QT);
#pragma unroll
      for (int b = 0; b < HD / kBox; ++b) {
        tma_load_4d(dst + b * kBoxBytes, tq, &ring.full[s], b * kBox, h, q0, int(bb - p.b0));
        tma_load_4d(dst + QT * 2 + b * kBoxBytes, tdo, &ring.full[s], b * kBox, h, q0, int(bb));
      }
    }
    float* st = stats + 2 * s * kSmall;
#pragma unroll
    for (int k = 0; k < kSmall / 32; ++k) {
      const int r = lane + 32 * k;
      const int64_t row = (bb * p.N + q0 + r) * p.H + h;
      const bool ok = q0 + r < p.N;
      st[r] = ok ? p.lse[row] : 0.f;
      st[kSmall + r] = ok ? p.delta[row] : 0.f;
    }
    mbarrier_arrive(&ring.full[s]);
  }
}

// Element (row, column) of the staged dQ tile: box column / 32 (kSmall rows of 128 bytes), in it TMA's 128-byte
// swizzle (16-byte chunk c of row r at c ^ (r % 8)); the consumers' float2 stores (8 rows x 4 column pairs a
// warp) fall in distinct banks.
__device__ __forceinline__ int dq_at(int row, int col) {
  const int cb = col % kDqBox;
  return col / kDqBox * (kSmall * kDqBox) + row * kDqBox + ((cb / 4) ^ (row & 7)) * 4 + cb % 4;
}

// One thread (warp 9's lane 0), over the block's dQ tiles in the consumers' order (the tiles last - 1 down to
// first, the m-th in phase m): waits for the staged tile and for its turn, adds the tile's boxes to the f32
// workspace (tdq: (entries, N, H, HD), boxes of kDqBox columns x kSmall rows; rows past N are skipped), gives the
// buffer back once they have been read, and counts the turn once they are complete: the next block's adds to
// the tile then come after these, the same order every run.
template <int HD, class P>
__device__ __forceinline__ void reduce_dq(const P& p, const CUtensorMap* tdq, const float* dqs, Ring& ring,
                                          int* dq_turn, int64_t bb, int h, int kt, int first, int last) {
  for (int i = last - 1, m = 0; i >= first; --i, ++m) {
    mbarrier_wait(&ring.dq_full, m & 1);
    if (p.ordered) {
      int seen;
      do asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(dq_turn + i) : "memory");
      while (seen < kt);
      fence_proxy_async_global();  // the earlier blocks' adds (seen through the count) before these
    }
#pragma unroll
    for (int b = 0; b < HD / kDqBox; ++b)
      tma_reduce_add_4d(tdq, dqs + b * kSmall * kDqBox, b * kDqBox, h, i * kSmall, int(bb - p.b0));
    bulk_commit();
    bulk_wait_read();
    mbarrier_arrive(&ring.dq_empty);
    bulk_wait();
    fence_proxy_async_global();
    count_turn(dq_turn + i);
  }
}
#endif

// The grid, the places and the products of attention_bwd_wg::backward (SPLIT); tq and tdo as for produce; tk and
// tv: the K and V rows of the launch's entries, boxes of kBig rows.
template <class T, int HD>
__global__ void __launch_bounds__(kTmaThreads, 1)
    backward(const Params<T> p, const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
             const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
             const __grid_constant__ CUtensorMap tdq) {
#ifndef LINTAPE_WGMMA
  __trap();  // attention_backward picks this kernel only where wgmma was compiled
#else
  using attention_bwd_wg::issue_frags_times;
  using attention_bwd_wg::issue_rows_t;
  static_assert(HD == 2 * kBox && kSmall == kBox, "dQ's columns: a box a warpgroup; a query tile one box");
  static_assert(kThreads == 256 && kTmaThreads == kThreads + 128, "two consumer warpgroups, then the producer's");
  static_assert(((2 * kBig * HD + 2 * kStages * kSmall * HD + kDsBuffers * kBig * kSmall) * 2 + 2 * kStages * kSmall * 4) %
                        1024 == 0,
                "the staged dQ tile starts on a 1024-byte boundary (the swizzle's period)");
  constexpr int KT = kBig * HD, QT = kSmall * HD, DT = kBig * kSmall;
  using KTile = SwizzleTile<kBig>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ Ring ring;
  __shared__ int place;
  T* ks = reinterpret_cast<T*>(cuda::smem_aligned<1024>(smem_raw));
  T* vs = ks + KT;
  T* slots = vs + KT;                                     // slot s: Q at slots + 2 s QT, dO after it
  T* dst = slots + 2 * kStages * QT;  // buffer b: dS'^T (tile i: b = i % kDsBuffers) at dst + b DT
  float* stats = reinterpret_cast<float*>(dst + kDsBuffers * DT);  // slot s: lse at stats + 2 s kSmall, Delta after
  float* dqs = stats + 2 * kStages * kSmall;  // the staged dQ tile (dq_at), on a 1024-byte boundary
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = cuda::warpgroup_index();
  if (threadIdx.x == 0) {
    place = atomicAdd(p.ticket, 1);  // as in attention_bwd: every block a turn waits for is running
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&ring.full[s], kFullArrivals);
      mbarrier_init(&ring.empty[s], kThreads);
    }
    for (int b = 0; b < kDsBuffers; ++b) mbarrier_init(&ring.ds[b], kThreads);
    mbarrier_init(&ring.kv, 1);
    mbarrier_init(&ring.dq_full, kThreads);
    mbarrier_init(&ring.dq_empty, 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  const int h = place % int(gridDim.x), kt = place / int(gridDim.x * gridDim.y);
  const int64_t bb = p.b0 + (place / int(gridDim.x)) % int(gridDim.y);
  const int k0 = kt * kBig;
  const int q_tiles = (p.N + kSmall - 1) / kSmall;
  const int first = p.causal ? k0 / kSmall : 0, last = q_tiles;
  int* dq_turn = p.dq_turn + ((bb - p.b0) * p.H + h) * q_tiles;
  if (wg == 2) {
    setmaxnreg_dec<kBwdProducerRegs>();
    if (warp == 8 && lane == 0) {  // K and V: HD / kBox boxes of kBig rows each, as KTile lays them
      mbarrier_arrive_expect_tx(&ring.kv, 2 * KT * 2);
#pragma unroll
      for (int b = 0; b < HD / kBox; ++b) {
        tma_load_4d(ks + b * kBig * kBox, &tk, &ring.kv, b * kBox, h, k0, int(bb - p.b0));
        tma_load_4d(vs + b * kBig * kBox, &tv, &ring.kv, b * kBox, h, k0, int(bb - p.b0));
      }
    }
    if (warp == 8)
      produce<T, HD>(p, &tq, &tdo, slots, stats, ring, bb, h, first, last);
    else if (warp == 9 && lane == 0)
      reduce_dq<HD>(p, &tdq, dqs, ring, dq_turn, bb, h, kt, first, last);
    return;
  }
  setmaxnreg_inc<kBwdConsumerRegs>();
  const int g = lane >> 2, c = (lane & 3) * 2;
  for (int r = 0; r < kLag; ++r)  // the dS'^T buffers of tiles last.. last + kLag - 1 (see dq_issue)
    for (int e = int(threadIdx.x); e < DT / 8; e += kThreads)
      reinterpret_cast<uint4*>(dst + (last + r) % kDsBuffers * DT)[e] = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  bar_sync(1, kThreads);  // the zeroed buffers: for both warpgroups' tensor cores
  mbarrier_wait(&ring.kv, 0);

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.f;
  const int wrow = wg * kWgKeys + (warp & 3) * 16;  // this warp's first key row in the tile
  const int key_a = k0 + wrow + g;                  // this thread's keys: key_a and key_a + 8
  const T* kw = ks + wg * kWgKeys * kBox;           // this warpgroup's rows in each box of K and of V
  const T* vw = vs + wg * kWgKeys * kBox;
  // dQ / scale of query tile i (this warpgroup's 64 columns), as in attention_bwd_wg: issued and committed, then
  // staged for the reducers once done.
  auto dq_issue = [&](float (&dq)[kBox / 2], int i) {
    const T* ds = dst + i % kDsBuffers * DT;
#pragma unroll
    for (int e = 0; e < kBox / 2; ++e) dq[e] = 0.f;
    wgmma_fence_operand(dq);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBig / 16; ++kk)
      wgmma_mma<T, kBox, 1, 1>(dq, wgmma_desc_sw128(ds + kk * 16 * kBox, kBig * kBox * 2, 1024),
                               wgmma_desc_sw128(ks + wg * kBig * kBox + kk * 16 * kBox, kBig * kBox * 2, 1024));
    wgmma_commit();
  };
  // The m-th dQ tile (this warpgroup's columns) into shared memory once the reducers have read the (m - 1)-th,
  // for them to add in its turn.
  auto dq_stage = [&](const float (&dq)[kBox / 2], int m) {
    mbarrier_wait(&ring.dq_empty, (m & 1) ^ 1);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = (warp & 3) * 16 + g + rr * 8;
#pragma unroll
      for (int j = 0; j < kBox / 8; ++j)
        *reinterpret_cast<float2*>(dqs + dq_at(row, wg * kBox + c + j * 8)) =
            make_float2(dq[4 * j + 2 * rr], dq[4 * j + 2 * rr + 1]);
    }
    fence_proxy_async();  // the staged tile, for the bulk reductions
    mbarrier_arrive(&ring.dq_full);
  };
  // dS'^T of tile i (the n-th tile; its buffer's earlier phases were the tiles n - kDsBuffers, ...) complete.
  auto ds_ready = [&](int i, int n) { mbarrier_wait(&ring.ds[i % kDsBuffers], (n / kDsBuffers) & 1); };
  int n = 0;  // tiles consumed
  for (int i = last - 1; i >= first; --i, ++n) {
    const int q0 = i * kSmall, s = n % kStages;
    const T* qs = slots + 2 * s * QT;
    const T* dos = qs + QT;
    T* ds = dst + i % kDsBuffers * DT;
    const float* lse_s = stats + 2 * s * kSmall;
    const float* delta_s = lse_s + kSmall;
    if (n >= kLag) ds_ready(i + kLag, n - kLag);
    mbarrier_wait(&ring.full[s], (n / kStages) & 1);
    // dQ of tile i + kLag issued first and staged while S^T of tile i runs; then the probabilities, and dP^T
    // with dV's product while dS' waits for the first. dQ at every tile (the first kLag on zeroed buffers, not
    // added) and S^T zeroed before it, so that ptxas neither waits nor serialises. Unlike
    // attention_bwd_wg, S^T is not live beside dP^T (240 registers, not 255); the other warpgroup's products
    // fill the gap.
    float dq[kBox / 2], st[kSmall / 2], dpt[kSmall / 2];
#pragma unroll
    for (int e = 0; e < kSmall / 2; ++e) st[e] = 0.f;
    wgmma_fence_operand(st);
    dq_issue(dq, i + kLag);
    issue_rows_t<T, HD, false>(st, kw, qs);  // S^T = K Q^T
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(dq);
    if (n >= kLag) dq_stage(dq, n - kLag);
    wgmma_wait<0>();
    wgmma_fence_operand(st);
#pragma unroll
    for (int t = 0; t < kSmall / 8; ++t) {
      const float2 lse = *reinterpret_cast<const float2*>(lse_s + t * 8 + c);
#pragma unroll
      for (int e = 0; e < 4; ++e) st[4 * t + e] = st[4 * t + e] * p.sl2 - (e & 1 ? lse.y : lse.x);
    }
    if (q0 + kSmall > p.N || k0 + kBig > p.M || (p.causal && k0 + wrow + 15 > q0))
#pragma unroll
      for (int t = 0; t < kSmall / 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = q0 + t * 8 + c + (e & 1), key = key_a + (e >> 1) * 8;
          if (col >= p.N || key >= p.M || (p.causal && key > col)) st[4 * t + e] = -INFINITY;
        }
    uint32_t pa[kSmall / 16][4], da[kSmall / 16][4];
#pragma unroll
    for (int t = 0; t < kSmall / 8; ++t) {
      pa[t / 2][2 * (t % 2)] = pack2<T>(exp2_ftz(st[4 * t]), exp2_ftz(st[4 * t + 1]));
      pa[t / 2][2 * (t % 2) + 1] = pack2<T>(exp2_ftz(st[4 * t + 2]), exp2_ftz(st[4 * t + 3]));
    }
    issue_rows_t<T, HD>(dpt, vw, dos);  // dP^T = V dO^T
    wgmma_commit();
    wgmma_fence_operand(dv);
    wgmma_fence();
    issue_frags_times<T, HD>(dv, pa, dos);  // dV += P^T dO, while dS' is computed
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(dpt);
#pragma unroll
    for (int t = 0; t < kSmall / 8; ++t) {
      const float2 delta = *reinterpret_cast<const float2*>(delta_s + t * 8 + c);
      const float2 p0 = unpack2<T>(pa[t / 2][2 * (t % 2)]), p1 = unpack2<T>(pa[t / 2][2 * (t % 2) + 1]);
      da[t / 2][2 * (t % 2)] = pack2<T>(p0.x * (dpt[4 * t] - delta.x), p0.y * (dpt[4 * t + 1] - delta.y));
      da[t / 2][2 * (t % 2) + 1] = pack2<T>(p1.x * (dpt[4 * t + 2] - delta.x), p1.y * (dpt[4 * t + 3] - delta.y));
      *reinterpret_cast<uint32_t*>(ds + KTile{}(wrow + g, t) + c) = da[t / 2][2 * (t % 2)];
      *reinterpret_cast<uint32_t*>(ds + KTile{}(wrow + g + 8, t) + c) = da[t / 2][2 * (t % 2) + 1];
    }
    fence_proxy_async();  // dS'^T, for the tensor cores of both warpgroups
    mbarrier_arrive(&ring.ds[i % kDsBuffers]);
    wgmma_fence_operand(dk);
    wgmma_fence();
    issue_frags_times<T, HD>(dk, da, qs);  // dK += dS'^T Q
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
    mbarrier_arrive(&ring.empty[s]);  // Q, dO, lse and Delta of the slot read
  }
  // Issued before the last dQ product and its turn, drained while they run.
  attention_bwd_wg::store_wg_acc_rows<HD>(p.dk_rows, dk, bb - p.b0, p.M, p.H, h, key_a);
  attention_bwd_wg::store_wg_acc_rows<HD>(p.dv_rows, dv, bb - p.b0, p.M, p.H, h, key_a);
  // The last kLag tiles' dQ (first + kLag - 1 down to first; the (n - 1 - r)-th staged).
#pragma unroll
  for (int r = kLag - 1; r >= 0; --r) {
    if (n - 1 - r < 0) continue;
    ds_ready(first + r, n - 1 - r);
    float dq[kBox / 2];
    dq_issue(dq, first + r);
    wgmma_wait<0>();
    wgmma_fence_operand(dq);
    dq_stage(dq, n - 1 - r);
  }
#endif
}

}  // namespace lintape::tpa_cuda::attention_bwd_tma
