// Internal to ops/tpa/attention_bwd.cu: the backward on warpgroup products (wgmma, sm_90a), D = 128. The
// schedule of attention_bwd (a block per (key tile of kBig keys, head, batch entry), the query tiles of kSmall
// rows last to first, dQ and the basis gradients summed across blocks in their turns), with its products on
// two warpgroups, warpgroup w owning keys 64 w.. of the tile:
//   S^T = K Q^T and dP^T = V dO^T (64 keys x kSmall queries each, both operands from shared memory),
//   P and dS' = P (dP - Delta) in registers,
//   dV += P^T dO and dK += dS'^T Q (64 x D, A from registers, B from shared memory, MN-major),
//   dQ = dS' K (kSmall queries x 64 columns, warpgroup w columns 64 w..: A dS'^T from shared memory, MN-major,
//   written by both warpgroups; B K, MN-major), in the next tile's barrier interval as in attention_bwd, issued
//   before that tile's S^T and dP^T and added to the workspace while they run.
// SPLIT: the block ends by writing its dK / scale and dV rows into workspaces (DkvRow), which a bandwidth-bound kernel
// contracts to the factors per token, as it does dQ; otherwise the block contracts them itself (basis_turns).
// Every tile is stored with the 128-byte swizzle (attention_tma::SwizzleTile): K and V built from their
// factors, Q (built once per launch) and dO copied by cp.async, double-buffered, and dS'^T (kBig keys x
// kSmall queries, one 64-column box). One barrier a query tile.
#pragma once
#include "ops/tpa/attention_tma.cuh"

namespace lintape::tpa_cuda::attention_bwd_wg {
using namespace attention_parts;
using attention_tma::kBox;
using attention_tma::SwizzleTile;

constexpr int kWgKeys = kBig / 2;  // keys a warpgroup
static_assert(kSmall == kBox && kWgKeys == 64, "a query tile is one box of dS'^T; a warpgroup 64 keys");

// K, V, two Q, dO pairs, two dS'^T tiles, two lse, Delta pairs, from a 1024-byte boundary.
template <int HD>
constexpr size_t smem_bytes() {
  return size_t(2 * kBig * HD + 4 * kSmall * HD + 2 * kBig * kSmall) * 2 + 4 * kSmall * 4 + 1024;
}
static_assert(smem_bytes<128>() <= 227 * 1024, "a block fits an sm_90 multiprocessor");
// At the end the f32 dK and dV tiles (kBig x (HD + 4)) and the rank weights (2 kBig x 16 floats at most) go
// through the 16-bit tiles.
static_assert(size_t(2 * kBig) * (128 + 4 + 16) * 4 <=
                  size_t(2 * kBig * 128 + 4 * kSmall * 128 + 2 * kBig * kSmall) * 2,
              "f32 results fit");

// A warpgroup's 64 x HD accumulator (rows r0.. for this warp) times mul into an f32 tile, HD + 4 floats a row.
template <int HD>
__device__ __forceinline__ void store_wg_acc(float* t, const float (&acc)[HD / 2], int r0, float mul) {
  constexpr int LDF = HD + 4;
  const int lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
    *reinterpret_cast<float2*>(t + (r0 + g) * LDF + j * 8 + c) = make_float2(acc[4 * j] * mul, acc[4 * j + 1] * mul);
    *reinterpret_cast<float2*>(t + (r0 + g + 8) * LDF + j * 8 + c) =
        make_float2(acc[4 * j + 2] * mul, acc[4 * j + 3] * mul);
  }
}

// The same accumulator's rows below M into a workspace x (entries, M, H, HD; X f32 or bf16, DkvRow) at entry e,
// head h; key is this thread's first row (the second 8 further). A quad writes 32 (f32) or 16 contiguous bytes of
// a row; streaming stores (read only by a later launch), so that they evict them first rather than the Q and dO
// rows other blocks reread.
template <int HD, class X>
__device__ __forceinline__ void store_wg_acc_rows(X* x, const float (&acc)[HD / 2], int64_t e, int M, int H, int h,
                                                  int key) {
  const int c = (threadIdx.x % 4) * 2;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    if (key + 8 * rr >= M) break;
    X* row = x + ((e * M + key + 8 * rr) * H + h) * HD + c;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      const float lo = acc[4 * j + 2 * rr], hi = acc[4 * j + 2 * rr + 1];
      if constexpr (std::is_same<X, float>::value)
        __stcs(reinterpret_cast<float2*>(row + j * 8), make_float2(lo, hi));
      else
        __stcs(reinterpret_cast<unsigned*>(row + j * 8), pack2<X>(lo, hi));
    }
  }
}

#ifdef LINTAPE_WGMMA
// acc (64 x kSmall) = A B^T, A this warpgroup's rows of a key tile and B a query tile, both K-major (HD
// along K); issued, not committed.
template <class T, int HD, bool ZERO = true>
__device__ __forceinline__ void issue_rows_t(float (&acc)[kSmall / 2], const T* a, const T* b) {
  if constexpr (ZERO) {
#pragma unroll
    for (int i = 0; i < kSmall / 2; ++i) acc[i] = 0.f;
    wgmma_fence_operand(acc);
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const int box = kk / 4, col = (kk % 4) * 16;  // a k-step's 32 bytes inside its box's 128-byte rows
    wgmma_mma<T, kSmall, 0, 0>(acc, wgmma_desc_sw128(a + box * kBig * kBox + col, 16, 1024),
                               wgmma_desc_sw128(b + box * kSmall * kBox + col, 16, 1024));
  }
}

// acc (64 x HD) += A x, A (64 x kSmall) in registers, x a query tile (MN-major: its boxes kSmall rows apart);
// issued, not committed.
template <class T, int HD>
__device__ __forceinline__ void issue_frags_times(float (&acc)[HD / 2], const uint32_t (&a)[kSmall / 16][4],
                                                  const T* x) {
#pragma unroll
  for (int kk = 0; kk < kSmall / 16; ++kk)
    wgmma_rs<T, HD, 1>(acc, a[kk], wgmma_desc_sw128(x + kk * 16 * kBox, kSmall * kBox * 2, 1024));
}

template <class T, int HD, bool SPLIT>
__global__ void __launch_bounds__(kThreads, 1) backward(const Params<T> p) {
  static_assert(HD == 2 * kBox, "dQ's columns: a box a warpgroup");
  constexpr int KT = kBig * HD, QT = kSmall * HD, DT = kBig * kSmall;
  using KTile = SwizzleTile<kBig>;
  using QTile = SwizzleTile<kSmall>;
  extern __shared__ unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(cuda::smem_aligned<1024>(smem_raw));
  T* vs = ks + KT;
  T* qdo = vs + KT;        // pair s: Q at qdo + 2 s QT, dO after it
  T* dst = qdo + 4 * QT;   // buffer s: dS'^T at dst + s DT
  float* stats = reinterpret_cast<float*>(dst + 2 * DT);  // pair s: lse at stats + 2 s kSmall, Delta after
  // Places as in attention_bwd: handed out as blocks start, so every block a turn waits for is running.
  __shared__ int place;
  if (threadIdx.x == 0) place = atomicAdd(p.ticket, 1);
  __syncthreads();
  const int h = place % int(gridDim.x), kt = place / int(gridDim.x * gridDim.y), warp = threadIdx.x / 32,
            lane = threadIdx.x % 32, wg = warp / 4, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = p.b0 + (place / int(gridDim.x)) % int(gridDim.y);
  const int k0 = kt * kBig;
  const int q_tiles = (p.N + kSmall - 1) / kSmall;
  const int first = p.causal ? k0 / kSmall : 0, last = q_tiles;
  float stat = 0.f;  // lse (threads < kSmall) or Delta (the next kSmall) of the next query tile's rows
  auto prefetch = [&](int i) {
    const int q0 = i * kSmall;
    T* qt = qdo + 2 * (i & 1) * QT;
    copy_rows_async<T, HD, kSmall, QTile>(qt, p.q, bb - p.b0, h, p.H, p.N, q0, QTile{});
    copy_rows_async<T, HD, kSmall, QTile>(qt + QT, p.dout, bb, h, p.H, p.N, q0, QTile{});
    cp_async_commit();
    const int n = q0 + int(threadIdx.x) % kSmall;
    stat = threadIdx.x < 2 * kSmall && n < p.N ? (threadIdx.x < kSmall ? p.lse : p.delta)[(bb * p.N + n) * p.H + h]
                                               : 0.f;
  };
  if (first < last) prefetch(last - 1);
  for (int e = int(threadIdx.x); e < DT / 8; e += kThreads)  // the dS'^T buffer of tile `last` (see dq_issue)
    reinterpret_cast<uint4*>(dst + (last & 1) * DT)[e] = make_uint4(0, 0, 0, 0);
  build_global<T, HD, kBig, kBig * (HD / 8) / kThreads, KTile>(ks, p.fk, bb, h, k0, KTile{});
  build_global<T, HD, kBig, kBig * (HD / 8) / kThreads, KTile>(vs, p.fv, bb, h, k0, KTile{});

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.f;
  const int wrow = wg * kWgKeys + (warp & 3) * 16;  // this warp's first key row in the tile
  const int key_a = k0 + wrow + g;                  // this thread's keys: key_a and key_a + 8
  const T* kw = ks + wg * kWgKeys * kBox;           // this warpgroup's rows in each box of K and of V
  const T* vw = vs + wg * kWgKeys * kBox;
  int* dq_turn = p.dq_turn + ((bb - p.b0) * p.H + h) * q_tiles;
  // dQ / scale of query tile i (this warpgroup's 64 columns): the product issued and committed (dq_issue), then
  // added to the workspace in its turn once it is done (dq_add).
  auto dq_issue = [&](float (&dq)[kBox / 2], int i) {
    const T* ds = dst + (i & 1) * DT;
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
  auto dq_add = [&](const float (&dq)[kBox / 2], int i, int seen) {
    wait_turn(dq_turn + i, p.ordered ? kt : 0, seen);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int n = i * kSmall + (warp & 3) * 16 + g + rr * 8;
      if (n >= p.N) continue;
      float* row = p.dq + (((bb - p.b0) * p.N + n) * p.H + h) * HD + wg * kBox + c;
#pragma unroll
      for (int j = 0; j < kBox / 8; ++j) atomic_add_vec<2>(row + j * 8, dq + 4 * j + 2 * rr);
    }
  };
  int added = -1;  // as in attention_bwd: counted by one thread after the next barrier
  auto count_added = [&] {
    if (threadIdx.x == 0 && added >= 0) count_turn(dq_turn + added);
    added = -1;
  };
  for (int i = last - 1; i >= first; --i) {
    const int q0 = i * kSmall;
    const T* qs = qdo + 2 * (i & 1) * QT;
    const T* dos = qs + QT;
    T* ds = dst + (i & 1) * DT;
    float* lse_s = stats + 2 * (i & 1) * kSmall;
    const float* delta_s = lse_s + kSmall;
    if (threadIdx.x < 2 * kSmall) lse_s[threadIdx.x] = stat;
    cp_async_wait<0>();
    fence_proxy_async();  // K, V (first tile), dS'^T of tile i + 1, Q and dO of tile i: for the tensor cores
    __syncthreads();      // tile i and dS'^T of tile i + 1 published; the buffers of tile i + 1 free
    count_added();
    if (i > first) prefetch(i - 1);
    // dQ of tile i + 1 issued first and added while S^T of tile i runs; then dP^T, the probabilities computed
    // while it runs, and dV's product while dS' is computed. dQ is issued at every tile (before the first on
    // the zeroed buffer, not added) and S^T zeroed before it: otherwise ptxas waits for dQ before S^T (C7517)
    // or serialises the products (C7514).
    float dq[kBox / 2], st[kSmall / 2], dpt[kSmall / 2];
    const int seen = i < last - 1 ? poll_turn(dq_turn + i + 1) : 0;
#pragma unroll
    for (int e = 0; e < kSmall / 2; ++e) st[e] = 0.f;
    wgmma_fence_operand(st);
    dq_issue(dq, i + 1);
    issue_rows_t<T, HD, false>(st, kw, qs);  // S^T = K Q^T
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(dq);
    if (i < last - 1) {
      dq_add(dq, i + 1, seen);
      added = i + 1;
    }
    issue_rows_t<T, HD>(dpt, vw, dos);  // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<1>();
    wgmma_fence_operand(st);
    // P^T from the base-2 logits; the bounds and the causal rule only where this warp's rows need them.
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
      // The A fragments of the 16 queries 16 (t / 2)..: t % 2 picks the 8 columns, u = 2 (t % 2) + rows.
      pa[t / 2][2 * (t % 2)] = pack2<T>(exp2_ftz(st[4 * t]), exp2_ftz(st[4 * t + 1]));
      pa[t / 2][2 * (t % 2) + 1] = pack2<T>(exp2_ftz(st[4 * t + 2]), exp2_ftz(st[4 * t + 3]));
    }
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
      // dS' from the probabilities rounded as in dV's product.
      da[t / 2][2 * (t % 2)] = pack2<T>(p0.x * (dpt[4 * t] - delta.x), p0.y * (dpt[4 * t + 1] - delta.y));
      da[t / 2][2 * (t % 2) + 1] = pack2<T>(p1.x * (dpt[4 * t + 2] - delta.x), p1.y * (dpt[4 * t + 3] - delta.y));
      // dS'^T, rounded as in dK's product.
      *reinterpret_cast<uint32_t*>(ds + KTile{}(wrow + g, t) + c) = da[t / 2][2 * (t % 2)];
      *reinterpret_cast<uint32_t*>(ds + KTile{}(wrow + g + 8, t) + c) = da[t / 2][2 * (t % 2) + 1];
    }
    wgmma_fence_operand(dk);
    wgmma_fence();
    issue_frags_times<T, HD>(dk, da, qs);  // dK += dS'^T Q
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
  }
  if constexpr (SPLIT) {  // issued before the last dQ product and its turn, drained while they run
    store_wg_acc_rows<HD>(p.dk_rows, dk, bb - p.b0, p.M, p.H, h, key_a);
    store_wg_acc_rows<HD>(p.dv_rows, dv, bb - p.b0, p.M, p.H, h, key_a);
  }
  fence_proxy_async();
  __syncthreads();  // dS'^T of the last tile published
  count_added();
  if (first < last) {
    const int seen = poll_turn(dq_turn + first);
    float dq[kBox / 2];
    dq_issue(dq, first);
    wgmma_wait<0>();
    wgmma_fence_operand(dq);
    dq_add(dq, first, seen);
    added = first;
  }
  __syncthreads();  // every warp done with the 16-bit tiles
  count_added();
  if constexpr (SPLIT) return;
  float* fk = reinterpret_cast<float*>(ks);
  float* fv = fk + kBig * (HD + 4);
  float* wk = fv + kBig * (HD + 4);
  float* wv = wk + kBig * p.fk.R;
  store_wg_acc<HD>(fk, dk, warp * 16, p.scale);
  store_wg_acc<HD>(fv, dv, warp * 16, 1.f);
  rank_weights(wk, p.fk, bb, h, k0);
  rank_weights(wv, p.fv, bb, h, k0);
  __syncthreads();
  basis_turns<T, HD>(fk, fv, wk, wv, p, bb, h, kt, k0);
}
#else
template <class T, int HD, bool SPLIT>
__global__ void backward(const Params<T>) {
  __trap();  // attention_backward picks this kernel only where wgmma was compiled
}
#endif

}  // namespace lintape::tpa_cuda::attention_bwd_wg
