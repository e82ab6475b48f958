// Causal FAL's gradient kernel on Hopper's warpgroup products (ops/fal/chunk.cuh has the chunk algebra; the
// mma.sync kernel of ops/fal/chunk_bwd.cu is the same algebra by 64-row angle slices). One block of four
// warpgroups per (chunk, b, h), every product on wgmma with both operands in shared memory:
//   1. the chunk's raw q, k rows and S_c brought by the tensor copy engine (with half_states an odd chunk first
//      advances S_(c-1) across chunk c - 1, as ops/fal/chunk_bwd.cu does); Q, K (through the acts and the
//      LRPE), V and dY = dO o gb into their tiles; R_(c+1)'s first LRPE half starts loading;
//   2. Am = (Q K^T) o M and Bm = (dY V^T) o M (warpgroup g: keys 16 g ... 16 g + 15) into shared tiles;
//   3. with S_c: Y = diag(gamma) Q S_c + Am V (warpgroup g: E / 4 columns) gives dg; dQ = diag(gamma) dY S_c^T +
//      Bm K, both LRPE halves of D / 4 raw columns, folded through the transposed LRPE into dq; once every
//      warpgroup has read S_c, R_(c+1)'s second half loads into its place;
//   4. with R_(c+1): dV = diag(delta) K R + Am^T dY gives dv; dK = diag(delta) V R^T + Bm^T Q gives dk.
// Tiles use CoreColumnTile (8-column blocks of 16-byte rows), read K-major or MN-major as each product needs; S_c
// and R_(c+1) the state tile of ops/fal/chunk_wgmma.cuh (blocks of 8 E columns), read MN-major by Y and dV and
// K-major by dQ and dK. Thread 0 issues every tensor copy (states, staged rows), each completing on its own
// mbarrier. Calls with documents keep the mma.sync kernel. Notes: bench/notes/fal-hopper.md.
#include <cstdlib>
#include <string>
#include <type_traits>
#include "core/cuda_wgmma.cuh"
#include "ops/fal/chunk_wgmma.cuh"

namespace lintape::fal_cuda {

namespace {
GradientKernel g_gradient = GradientKernel::Auto;
}  // namespace

void set_gradient_kernel(GradientKernel kernel) { g_gradient = kernel; }

namespace chunk {

namespace {

constexpr int kGradWgThreads = 512;
constexpr int kBlock = CoreColumnTile::kBlock;


// Shared memory in elements of T: Q, K (kC x PP), V, dY (kC x EP), Am, Bm (kC x kC), all CoreColumnTile; S_c
// (StateTile<PP, EP>); R_(c+1)'s first LRPE half (StateTile<DP, EP>; its second half takes S_c's place); then
// the LRPE angle table in floats and the tensor copies' mbarriers (S_c, R's two halves, q and k, an advance's
// rows). The state tiles are unpadded (the tensor copy engine writes them). The raw q and k rows are staged over
// V, dY and the scores (free until they are encoded); an advance's raw k and v rows of chunk c - 1 over R's first
// half.
template <int DP, int PP, int EP>
struct GradTiles {
  using STile = StateTile<PP, EP, 0>;
  using RTile = StateTile<DP, EP, 0>;
  static constexpr int kTileP = PP / 8 * kBlock, kTileE = EP / 8 * kBlock, kTileC = kC / 8 * kBlock;
  static constexpr int kSBlock = STile::kBlock, kRBlock = RTile::kBlock;
  static constexpr int kQ = 0, kK = kQ + kTileP, kV = kK + kTileP, kDY = kV + kTileE, kAm = kDY + kTileE;
  // S_c's place also holds an advance's diag(delta) V tile (larger than an unpadded state tile at P = kC).
  static constexpr int kSPlace = STile::kElems > kTileE ? STile::kElems : kTileE;
  static constexpr int kBm = kAm + kTileC, kS = kBm + kTileC, kR0 = kS + kSPlace;
  static constexpr int kPrev = kC * (DP + EP), kR0Elems = RTile::kElems;
  static constexpr int kEnd = kR0 + (kR0Elems > kPrev ? kR0Elems : kPrev);
  static_assert(2 * kC * DP <= kS - kV, "the raw q and k rows fit over V, dY and the scores");
  static_assert(RTile::kElems <= kSPlace, "R's second half fits S_c's place");
  static_assert(kS % 64 == 0 && kR0 % 64 == 0 && kV % 64 == 0 && kC * DP % 64 == 0,
                "the state tiles and the staged rows start on 128 bytes (2-byte T), as tensor copies need");
  static_assert(kEnd % 4 == 0, "the mbarriers after the angle table are 8-byte aligned");
  static constexpr size_t bytes(size_t elem) {
    return elem * size_t(kEnd) + sizeof(float) * noncausal::kAngleRows * DP + 5 * sizeof(uint64_t);
  }
};

// Row r's values (value 4 j + r of the accumulator layout) of one accumulator tile and of two others times
// f(r): the decays gamma and delta of the chunk's rows.
template <int NE, int ND, class F>
__device__ __forceinline__ void scale_acc_rows(float (&e)[NE], float (&d0)[ND], float (&d1)[ND], F f) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float x = f(r);
#pragma unroll
    for (int j = 0; j < NE / 4; ++j) e[4 * j + r] *= x;
#pragma unroll
    for (int j = 0; j < ND / 4; ++j) d0[4 * j + r] *= x, d1[4 * j + r] *= x;
  }
}

// The states and the staged raw rows come by the tensor copy engine, one thread issuing: smap, rmap are
// state_tensor_map of a.states (a box of PP rows) and of a.rstates (DP rows: an LRPE half); qmap, kmap, vmap
// row_tensor_map of q, k, v.
template <class T, int DP, int PP, int EP, bool Half>
__global__ void __launch_bounds__(kGradWgThreads, 1)
    hopper_grad_kernel(Args a, const __grid_constant__ CUtensorMap smap, const __grid_constant__ CUtensorMap rmap,
                       const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                       const __grid_constant__ CUtensorMap vmap) {
#ifndef LINTAPE_WGMMA
  __trap();
#else
  using L = GradTiles<DP, PP, EP>;
  constexpr int NThr = kGradWgThreads, EO = EP / 4, DO = DP / 4;  // a warpgroup's E and raw D columns
  constexpr bool kTwo = PP == 2 * DP;                              // the cosine LRPE's two halves
  constexpr uint32_t kRows8 = 8 * 16, kTileBytes = kBlock * sizeof(T);
  constexpr uint32_t kSBytes = L::kSBlock * sizeof(T), kRBytes = L::kRBlock * sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sm = reinterpret_cast<T*>(smem_raw);
  float* const tab = reinterpret_cast<float*>(sm + L::kEnd);
  uint64_t* const bars = reinterpret_cast<uint64_t*>(tab + noncausal::kAngleRows * DP);  // GradTiles' order
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = cuda::warpgroup_index();
  const int64_t c = blockIdx.x, bh = blockIdx.y, b = bh / a.H, t0 = c * kC;
  const int h = int(bh % a.H);
  const int cl = int(a.N - t0 < kC ? a.N - t0 : kC);
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  const int64_t out_ts = int64_t(a.H) * a.E;  // dO's token stride
  const bool cosine = kTwo;
  const bool advance = Half && (c & 1);  // the saved state is S_(c-1): advance it across chunk c - 1
  const T* q = at_head<T>(a.q, b, a.sq_b, h, a.D);
  const T* k = at_head<T>(a.k, b, a.sk_b, h, a.D);
  const T* v = at_head<T>(a.v, b, a.sv_b, h, a.E);
  const T* g = at_head<T>(a.g, b, a.sg_b, h, a.E);
  const T* dout = static_cast<const T*>(a.dout) + b * a.N * out_ts + h * a.E;
  const int64_t s_slot = bh * saved_chunks(a) + saved_slot(a, c), r_slot = bh * a.nC + c;
  const T* S = static_cast<const T*>(a.states) + s_slot * int64_t(a.P) * a.E;  // an advance reads S_(c-1) itself
  // A state box by the tensor copy engine, one thread issuing: rows p0 ... of the slot's state into dst.
  auto tma_state = [&](const CUtensorMap* map, uint64_t* bar, T* dst, int rows, int p0, int64_t slot) {
    cuda::mbarrier_arrive_expect_tx(bar, uint32_t(rows * EP * sizeof(T)));
    cuda::tma_load_4d(dst, map, bar, 0, p0, 0, int(slot));
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < 5; ++i) cuda::mbarrier_init(&bars[i], 1);
    cuda::mbarrier_init_fence();
  }
  __syncthreads();  // the mbarriers are set up before any copy completes on them
  // Staged rows t ... t + kC - 1 (kC x W) by the tensor copy engine into dst, completing on bar.
  auto tma_rows = [&](const CUtensorMap* map, uint64_t* bar, T* dst, int64_t t) {
    cuda::tma_load_4d(dst, map, bar, 0, int(t), h, int(b));
  };
  // The chunk row of accumulator value r (core/cuda_wgmma.cuh), and a warpgroup's column of value 4 j + r (and
  // the next one) among its n columns from c0.
  auto trow = [&](int r) { return 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1); };
  auto tcol = [&](int c0, int j) { return c0 + 8 * j + 2 * (lane & 3); };

  // 1. The raw q, k rows, then S_c unless it is advanced here (then chunk c - 1's raw k and v rows come first).
  // The angle table after the copies are issued.
  auto stage_qk = [&] {
    if (threadIdx.x == 0) {
      cuda::mbarrier_arrive_expect_tx(&bars[3], uint32_t(2 * kC * DP * sizeof(T)));
      tma_rows(&qmap, &bars[3], sm + L::kV, t0);
      tma_rows(&kmap, &bars[3], sm + L::kV + kC * DP, t0);
    }
  };
  if (!advance) {
    stage_qk();
    if (threadIdx.x == 0) tma_state(&smap, &bars[0], sm + L::kS, PP, 0, s_slot);
    if (cosine) noncausal::fill_angles<DP>(a, h, NThr / (DP / 8), tab);
  } else {
    // S_c = lambda^kC S_(c-1) + K^T diag(delta) V over chunk c - 1 (whole: it is not the last), the forward's
    // products and roundings from S_(c-1) as saved in T, the state split over the warpgroups as the walks split
    // it. K passes through K's tile, diag(delta) V through S_c's place (Q's is too narrow where E > D').
    using W = StateWarps<PP, EP>;
    const int gm = wg % W::WGM, gn = wg / W::WGM;
    const int64_t tp = t0 - kC;
    if (threadIdx.x == 0) {
      cuda::mbarrier_arrive_expect_tx(&bars[4], uint32_t(kC * (DP + EP) * sizeof(T)));
      tma_rows(&kmap, &bars[4], sm + L::kR0, tp);
      tma_rows(&vmap, &bars[4], sm + L::kR0 + kC * DP, tp);
    }
    stage_qk();
    if (cosine) noncausal::fill_angles<DP>(a, h, NThr / (DP / 8), tab);
    auto srow = [&](int r) { return 64 * gm + 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1); };
    auto scol = [&](int j) { return gn * W::NW + 8 * j + 2 * (lane & 3); };
    // S_(c-1)'s values of this thread as loaded (two a word), unpacked once the encode has hidden their latency.
    uint32_t sraw[W::NW / 4];
#pragma unroll
    for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int e = scol(j);
        sraw[2 * j + r / 2] = e < a.E ? *reinterpret_cast<const uint32_t*>(S + size_t(srow(r)) * a.E + e) : 0u;
      }
    cuda::mbarrier_wait(&bars[4], 0);  // chunk c - 1's rows (the chunk's own q and k may still be in flight)
    __syncthreads();                   // the angle table
    encode_qk<T, DP, NThr>(a, sm + L::kR0, nullptr, tab, tp, sm + L::kK, nullptr, a.act_k, a.act_k, cosine);
#pragma unroll
    for (int it = 0; it < Raw<EP, NThr>::kIt; ++it) {
      const int idx = threadIdx.x + it * NThr, i = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
      float y[8];
      unpack8<T>(staged<T, EP, NThr>(sm + L::kR0 + kC * DP, it), y);
      act_n(y, a.act_v, c8 < a.E);
      const float f = decay_pow(log2_lam, kC - 1 - i);
#pragma unroll
      for (int u = 0; u < 8; ++u) y[u] *= f;
      store8(sm + L::kS + CoreColumnTile{}(i, c8), y);
    }
    cuda::fence_proxy_async();
    float acc[W::NW / 2];
    const float carry = decay_pow(log2_lam, kC);
#pragma unroll
    for (int i = 0; i < W::NW / 4; ++i) {
      load2(reinterpret_cast<const T*>(&sraw[i]), acc[2 * i], acc[2 * i + 1]);
      acc[2 * i] *= carry;
      acc[2 * i + 1] *= carry;
    }
    __syncthreads();
    {
      const uint64_t k_mn = cuda::wgmma_desc(sm + L::kK + gm * 8 * kBlock, kRows8, kTileBytes);
      const uint64_t vd_mn = cuda::wgmma_desc(sm + L::kS + gn * (W::NW / 8) * kBlock, kRows8, kTileBytes);
      cuda::wgmma_fence_operand(acc);
      cuda::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kC; kk += 16)
        cuda::wgmma_mma<T, W::NW, 1, 1>(acc, desc_at(k_mn, kk * 16), desc_at(vd_mn, kk * 16));
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(acc);
    }
    __syncthreads();  // every warpgroup's product has read diag(delta) V: S_c takes its place
    state_to_tile<T, PP, EP, W::NW, 0>(sm + L::kS, acc, srow, scol);
    cuda::fence_proxy_async();
  }
  Raw<EP, NThr> vr, gr, dr;
  fetch(a, v, a.sv_t, t0, 0, a.E, vr);
  fetch(a, g, a.sg_t, t0, 0, a.E, gr);
  fetch(a, dout, out_ts, t0, 0, a.E, dr);
  cuda::mbarrier_wait(&bars[3], 0);  // q and k are in; S_c may still be in flight
  __syncthreads();       // the angle table; an advance is done with the tiles it borrowed
  encode_qk<T, DP, NThr>(a, sm + L::kV, sm + L::kV + kC * DP, tab, t0, sm + L::kQ, sm + L::kK, a.act_q, a.act_k,
                         cosine);
  __syncthreads();  // the raw rows are read: V and dY take their place
  store_rows<T, EP, NThr, CoreColumnTile>(a, vr, nullptr, a.act_v, t0, 0, nullptr, sm + L::kV, CoreColumnTile{});
  store_rows<T, EP, NThr, CoreColumnTile>(a, gr, &dr, a.act_g, t0, 0, nullptr, sm + L::kDY, CoreColumnTile{});
  cuda::fence_proxy_async();
  if (threadIdx.x == 0) tma_state(&rmap, &bars[1], sm + L::kR0, DP, 0, r_slot);  // R_(c+1)'s first half
  __syncthreads();  // Q, K, V, dY

  // 2. The masked, decayed scores Am and Bm, this warpgroup's keys.
  {
    float sc[8], bc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sc[i] = bc[i] = 0.0f;
    const uint64_t q_k = cuda::wgmma_desc(sm + L::kQ, kTileBytes, kRows8);
    const uint64_t k_k = cuda::wgmma_desc(sm + L::kK + 16 * wg * 8, kTileBytes, kRows8);
    const uint64_t dy_k = cuda::wgmma_desc(sm + L::kDY, kTileBytes, kRows8);
    const uint64_t v_k = cuda::wgmma_desc(sm + L::kV + 16 * wg * 8, kTileBytes, kRows8);
    cuda::wgmma_fence_operand(sc);
    cuda::wgmma_fence_operand(bc);
    cuda::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < PP / 16; ++ks)
      cuda::wgmma_mma<T, 16, 0, 0>(sc, desc_at(q_k, 2 * ks * kTileBytes), desc_at(k_k, 2 * ks * kTileBytes));
#pragma unroll
    for (int ks = 0; ks < EP / 16; ++ks)
      cuda::wgmma_mma<T, 16, 0, 0>(bc, desc_at(dy_k, 2 * ks * kTileBytes), desc_at(v_k, 2 * ks * kTileBytes));
    cuda::wgmma_commit();
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operand(sc);
    cuda::wgmma_fence_operand(bc);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int t = trow(r), s = tcol(16 * wg, j);
        const float w0 = s <= t ? decay_pow(log2_lam, t - s) : 0.0f;
        const float w1 = s + 1 <= t ? decay_pow(log2_lam, t - s - 1) : 0.0f;
        const int at = (s >> 3) * kBlock + t * 8 + (s & 7);
        store2(sm + L::kAm + at, sc[4 * j + r] * w0, sc[4 * j + r + 1] * w1);
        store2(sm + L::kBm + at, bc[4 * j + r] * w0, bc[4 * j + r + 1] * w1);
      }
    cuda::fence_proxy_async();
  }
  if (!advance) cuda::mbarrier_wait(&bars[0], 0);  // S_c is in (R's first half may still be in flight)
  cuda::fence_proxy_async();
  __syncthreads();

  // 3. Y and dQ from S_c. The raw g, dO and q values of this thread's dg and dq elements load after the first
  // products (during them, ptxas spills), ahead of R's second half.
  const bool model_acts = noncausal::model_acts_of(a);
  const int64_t t_first = t0 + trow(0);  // the thread's rows: t_first and t_first + 8
  {
    float y[EO / 2], d0[DO / 2], d1[DO / 2];
#pragma unroll
    for (int i = 0; i < EO / 2; ++i) y[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < DO / 2; ++i) d0[i] = d1[i] = 0.0f;
    uint32_t graw[EO / 8][2], draw[EO / 8][2], qraw[DO / 8][2];
    {
      const uint64_t q_k = cuda::wgmma_desc(sm + L::kQ, kTileBytes, kRows8);
      const uint64_t s_mn = cuda::wgmma_desc(sm + L::kS + (wg * EO / 8) * L::kSBlock, kRows8, kSBytes);
      const uint64_t dy_k = cuda::wgmma_desc(sm + L::kDY, kTileBytes, kRows8);
      const uint64_t s_k = cuda::wgmma_desc(sm + L::kS + wg * DO * 8, kSBytes, kRows8);
      cuda::wgmma_fence_operand(y);
      cuda::wgmma_fence_operand(d0);
      cuda::wgmma_fence_operand(d1);
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < PP / 16; ++ks)
        cuda::wgmma_mma<T, EO, 0, 1>(y, desc_at(q_k, 2 * ks * kTileBytes), desc_at(s_mn, 2 * ks * kRows8));
#pragma unroll
      for (int ks = 0; ks < EP / 16; ++ks)
        cuda::wgmma_mma<T, DO, 0, 0>(d0, desc_at(dy_k, 2 * ks * kTileBytes), desc_at(s_k, 2 * ks * kSBytes));
      if constexpr (kTwo)
#pragma unroll
        for (int ks = 0; ks < EP / 16; ++ks)
          cuda::wgmma_mma<T, DO, 0, 0>(d1, desc_at(dy_k, 2 * ks * kTileBytes),
                                       desc_at(s_k, DP * 16 + 2 * ks * kSBytes));
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(y);
      cuda::wgmma_fence_operand(d0);
      cuda::wgmma_fence_operand(d1);
    }
    __syncthreads();  // every warpgroup has read S_c: R's second half takes its place (group 4)
    // The raw values ahead of R's second half, whose 32 KiB would otherwise queue before them.
    load_pairs<T, EO>(a, g, a.sg_t, t_first, wg * EO, a.E, graw);
    load_pairs<T, EO>(a, dout, out_ts, t_first, wg * EO, a.E, draw);
    load_pairs<T, DO>(a, q, a.sq_t, t_first, wg * DO, a.D, qraw);
    if (kTwo && threadIdx.x == 0) tma_state(&rmap, &bars[2], sm + L::kS, DP, DP, r_slot);
    scale_acc_rows(y, d0, d1, [&](int r) { return decay_pow(log2_lam, trow(r) + 1); });  // gamma
    {
      const uint64_t am_k = cuda::wgmma_desc(sm + L::kAm, kTileBytes, kRows8);
      const uint64_t v_mn = cuda::wgmma_desc(sm + L::kV + (wg * EO / 8) * kBlock, kRows8, kTileBytes);
      const uint64_t bm_k = cuda::wgmma_desc(sm + L::kBm, kTileBytes, kRows8);
      const uint64_t k_mn = cuda::wgmma_desc(sm + L::kK + (wg * DO / 8) * kBlock, kRows8, kTileBytes);
      cuda::wgmma_fence_operand(y);
      cuda::wgmma_fence_operand(d0);
      cuda::wgmma_fence_operand(d1);
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        cuda::wgmma_mma<T, EO, 0, 1>(y, desc_at(am_k, 2 * ks * kTileBytes), desc_at(v_mn, 2 * ks * kRows8));
        cuda::wgmma_mma<T, DO, 0, 1>(d0, desc_at(bm_k, 2 * ks * kTileBytes), desc_at(k_mn, 2 * ks * kRows8));
        if constexpr (kTwo)
          cuda::wgmma_mma<T, DO, 0, 1>(d1, desc_at(bm_k, 2 * ks * kTileBytes),
                                       desc_at(k_mn, DP / 8 * kTileBytes + 2 * ks * kRows8));
      }
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(y);
      cuda::wgmma_fence_operand(d0);
      cuda::wgmma_fence_operand(d1);
    }
    // dg = act_g'(g) (dO o Y); dq = act_q'(q) (cos dQ_0 + sin dQ_1). The model's acts as constants: code without
    // dispatch.
    T* dg = at_head<T>(a.dg, b, a.sdg_b, h, a.E);
    T* dq = at_head<T>(a.dq, b, a.sdq_b, h, a.D);
    auto epilogue = [&](auto fixed) {
      constexpr bool kFixed = decltype(fixed)::value;
      store_act_grad<T, EO>(a, y, graw, &draw, kFixed ? int(FalStepSpec::kSilu) : a.act_g, dg, a.sdg_t, t_first,
                            wg * EO);
      store_folded<T, DP, DO, kTwo>(a, d0, d1, qraw, tab, kFixed ? int(FalStepSpec::kSilu) : a.act_q, dq, a.sdq_t,
                                    t_first, wg * DO);
    };
    if (model_acts)
      epilogue(std::true_type{});
    else
      epilogue(std::false_type{});
  }
  cuda::mbarrier_wait(&bars[1], 0);  // R_(c+1) is in
  if (kTwo) cuda::mbarrier_wait(&bars[2], 0);
  cuda::fence_proxy_async();
  __syncthreads();

  // 4. dV and dK from R_(c+1): its first half in R0's place, its second in S_c's. The raw v (when it has an act)
  // and k values of this thread's dv and dk elements load meanwhile.
  {
    const T* r_half[2] = {sm + L::kR0, sm + L::kS};
    float dvo[EO / 2], k0[DO / 2], k1[DO / 2];
#pragma unroll
    for (int i = 0; i < EO / 2; ++i) dvo[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < DO / 2; ++i) k0[i] = k1[i] = 0.0f;
    uint32_t vraw[EO / 8][2], kraw[DO / 8][2];
    {
      const uint64_t v_k = cuda::wgmma_desc(sm + L::kV, kTileBytes, kRows8);
      cuda::wgmma_fence_operand(dvo);
      cuda::wgmma_fence_operand(k0);
      cuda::wgmma_fence_operand(k1);
      cuda::wgmma_fence();
#pragma unroll
      for (int hf = 0; hf < (kTwo ? 2 : 1); ++hf) {
        const uint64_t k_k = cuda::wgmma_desc(sm + L::kK + hf * (DP / 8) * kBlock, kTileBytes, kRows8);
        const uint64_t r_mn = cuda::wgmma_desc(r_half[hf] + (wg * EO / 8) * L::kRBlock, kRows8, kRBytes);
        const uint64_t r_k = cuda::wgmma_desc(r_half[hf] + wg * DO * 8, kRBytes, kRows8);
#pragma unroll
        for (int ks = 0; ks < DP / 16; ++ks)
          cuda::wgmma_mma<T, EO, 0, 1>(dvo, desc_at(k_k, 2 * ks * kTileBytes), desc_at(r_mn, 2 * ks * kRows8));
#pragma unroll
        for (int ks = 0; ks < EP / 16; ++ks) {
          if (hf == 0)
            cuda::wgmma_mma<T, DO, 0, 0>(k0, desc_at(v_k, 2 * ks * kTileBytes), desc_at(r_k, 2 * ks * kRBytes));
          else
            cuda::wgmma_mma<T, DO, 0, 0>(k1, desc_at(v_k, 2 * ks * kTileBytes), desc_at(r_k, 2 * ks * kRBytes));
        }
      }
      cuda::wgmma_commit();
      if (a.act_v != FalStepSpec::kNone) load_pairs<T, EO>(a, v, a.sv_t, t_first, wg * EO, a.E, vraw);
      load_pairs<T, DO>(a, k, a.sk_t, t_first, wg * DO, a.D, kraw);
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(dvo);
      cuda::wgmma_fence_operand(k0);
      cuda::wgmma_fence_operand(k1);
    }
    scale_acc_rows(dvo, k0, k1, [&](int r) { return decay_pow(log2_lam, cl - 1 - trow(r)); });  // delta
    {
      const uint64_t am_mn = cuda::wgmma_desc(sm + L::kAm, kRows8, kTileBytes);
      const uint64_t dy_mn = cuda::wgmma_desc(sm + L::kDY + (wg * EO / 8) * kBlock, kRows8, kTileBytes);
      const uint64_t bm_mn = cuda::wgmma_desc(sm + L::kBm, kRows8, kTileBytes);
      const uint64_t q_mn = cuda::wgmma_desc(sm + L::kQ + (wg * DO / 8) * kBlock, kRows8, kTileBytes);
      cuda::wgmma_fence_operand(dvo);
      cuda::wgmma_fence_operand(k0);
      cuda::wgmma_fence_operand(k1);
      cuda::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kC / 16; ++ks) {
        cuda::wgmma_mma<T, EO, 1, 1>(dvo, desc_at(am_mn, 2 * ks * kRows8), desc_at(dy_mn, 2 * ks * kRows8));
        cuda::wgmma_mma<T, DO, 1, 1>(k0, desc_at(bm_mn, 2 * ks * kRows8), desc_at(q_mn, 2 * ks * kRows8));
        if constexpr (kTwo)
          cuda::wgmma_mma<T, DO, 1, 1>(k1, desc_at(bm_mn, 2 * ks * kRows8),
                                       desc_at(q_mn, DP / 8 * kTileBytes + 2 * ks * kRows8));
      }
      cuda::wgmma_commit();
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(dvo);
      cuda::wgmma_fence_operand(k0);
      cuda::wgmma_fence_operand(k1);
    }
    T* dv = at_head<T>(a.dv, b, a.sdv_b, h, a.E);
    T* dk = at_head<T>(a.dk, b, a.sdk_b, h, a.D);
    auto epilogue = [&](auto fixed) {
      constexpr bool kFixed = decltype(fixed)::value;
      store_act_grad<T, EO>(a, dvo, vraw, nullptr, kFixed ? int(FalStepSpec::kNone) : a.act_v, dv, a.sdv_t, t_first,
                            wg * EO);
      store_folded<T, DP, DO, kTwo>(a, k0, k1, kraw, tab, kFixed ? int(FalStepSpec::kSilu) : a.act_k, dk, a.sdk_t,
                                    t_first, wg * DO);
    };
    if (model_acts)
      epilogue(std::true_type{});
    else
      epilogue(std::false_type{});
  }
#endif
}

template <class T, int DP, int PP, int EP>
void launch_hopper_grad(const Args& a, int64_t BH, cudaStream_t st) {
  constexpr size_t smem = GradTiles<DP, PP, EP>::bytes(sizeof(T));
  auto kernel = a.half_states ? hopper_grad_kernel<T, DP, PP, EP, true> : hopper_grad_kernel<T, DP, PP, EP, false>;
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const CUtensorMap smap = state_tensor_map(a.states, a, BH * saved_chunks(a), PP, EP);
  const CUtensorMap rmap = state_tensor_map(a.rstates, a, BH * a.nC, DP, EP);
  kernel<<<dim3(unsigned(a.nC), unsigned(BH)), kGradWgThreads, smem, st>>>(
      a, smap, rmap, row_tensor_map(a, BH, RowInput::Q, DP), row_tensor_map(a, BH, RowInput::K, DP),
      row_tensor_map(a, BH, RowInput::V, EP));
  LT_CUDA_CHECK_LAUNCH();
}

// Whether the process asked for the mma.sync gradient kernel (LINTAPE_FAL_GRADIENT=chunks), read once.
bool env_wants_chunks() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_FAL_GRADIENT");
    return v && std::string(v) == "chunks";
  }();
  return on;
}

}  // namespace

bool hopper_gradients_run(const Args& a) {
  const GradientKernel k = g_gradient;
  if (k == GradientKernel::Chunks || (k == GradientKernel::Auto && env_wants_chunks())) return false;
  if (a.starts) return false;
  int dev = 0;
  LT_CUDA_CHECK(cudaGetDevice(&dev));
  return cuda::wgmma_runs(dev);
}

void hopper_gradients(const Args& a, DType dtype, int64_t BH, cudaStream_t st) {
  for_wgmma_shape(a, [&](auto shape) {
    using S = decltype(shape);
    if (dtype == DType::BF16)
      launch_hopper_grad<__nv_bfloat16, S::kDP, S::kPP, S::kEP>(a, BH, st);
    else
      launch_hopper_grad<__half, S::kDP, S::kPP, S::kEP>(a, BH, st);
  });
}

}  // namespace chunk

}  // namespace lintape::fal_cuda
