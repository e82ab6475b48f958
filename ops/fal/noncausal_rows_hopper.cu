// Noncausal FAL's row passes on Hopper's warpgroup products (ops/fal/noncausal.cuh has the passes' algebra; the
// mma.sync kernel of ops/fal/noncausal_rows.cu is the same algebra). A block of kWarpgroups warpgroups shares one
// (b, h)'s state W (f32 in memory, rounded to T into the state tile of ops/fal/chunk_wgmma.cuh) and each
// warpgroup runs every kWarpgroups-th chunk of the block's run on its own, start to end:
//   1. the chunk's raw q rows (k in the key pass), staged by cp.async while the warpgroup's previous chunk ran,
//      through the act and the LRPE into the warpgroup's X tile; the next chunk's rows start loading;
//   2. Y = X W on wgmma (X K-major, W MN-major), the epilogue's inputs at this thread's elements of Y loading
//      meanwhile;
//   3. out = act_g(g) o Y; or dg = act_g'(g) (dO o Y) and U = act_g(g) o dO; or dv = act_v'(v) Y and U = act_v(v);
//   4. in the gradient passes U, rounded to T where the thread holds it (the A operand's register layout), is
//      multiplied by W^T (W read K-major) 64 raw columns at a time, both LRPE halves, and folded through the
//      transposed LRPE and the act's backward into dq or dk.
// The warpgroups wait for each other only where the block moves to the next (b, h) (a new W). The X act must be
// elementwise (the encode of ops/fal/chunk_wgmma.cuh); softmax over q or k keeps the mma.sync kernel.
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include "core/cuda_mma.cuh"
#include "core/cuda_tma.cuh"
#include "core/cuda_wgmma_rs.cuh"
#include "ops/fal/chunk_wgmma.cuh"

namespace lintape::fal_cuda::noncausal {

namespace {

using chunk::CoreColumnTile;
using chunk::desc_at;
using chunk::StateTile;

constexpr int kWarpgroups = 3, kThreads = 128 * kWarpgroups;
constexpr int kFoldCols = 64;  // raw columns of dq or dk a product of the fold

// Shared memory in elements of T: W (StateTile<PP, EP>), then per warpgroup its X tile (kC x PP, CoreColumnTile)
// and its staged raw rows (kC x DP); then the LRPE angle table in floats.
template <int DP, int PP, int EP>
struct RowTiles {
  static constexpr int kX = PP / 8 * CoreColumnTile::kBlock, kStage = kC * DP;
  static constexpr int kW = 0, kFirst = StateTile<PP, EP>::kElems, kPer = kX + kStage;
  static constexpr int kEnd = kFirst + kWarpgroups * kPer;
  static constexpr size_t bytes(size_t elem) { return elem * size_t(kEnd) + sizeof(float) * kAngleRows * DP; }
};

template <class T, int DP, int PP, int EP, int Pass>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_row_kernel(Args a, const float* __restrict__ state, int64_t per, int64_t total, bool model_acts) {
#ifndef LINTAPE_WGMMA
  __trap();
#else
  using L = RowTiles<DP, PP, EP>;
  constexpr bool kTwo = PP == 2 * DP;  // the cosine LRPE's two halves
  constexpr int kSBlock = StateTile<PP, EP>::kBlock;
  constexpr uint32_t kRows8 = 8 * 16, kTileBytes = CoreColumnTile::kBlock * sizeof(T), kSBytes = kSBlock * sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sm = reinterpret_cast<T*>(smem_raw);
  T* const ws = sm + L::kW;
  float* const tab = reinterpret_cast<float*>(sm + L::kEnd);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2, tid = threadIdx.x & 127;
  T* const xs = sm + L::kFirst + wg * L::kPer;
  T* const stage = xs + L::kX;
  const int64_t begin = int64_t(blockIdx.x) * per, end = min(begin + per, total);
  const int64_t dts = int64_t(a.H) * a.E;  // out's and dout's token stride
  const int row0 = 16 * (warp & 3) + (lane >> 2);  // the thread's first row of an accumulator tile

  int angles_h = -1;
  for (int64_t s0 = begin; s0 < end;) {
    const int64_t bh = s0 / a.nC, s1 = min(end, (bh + 1) * a.nC), b = bh / a.H;
    const int h = int(bh - b * a.H);
    __syncthreads();  // every warpgroup is done with the previous W
    {
      const float* src = state + bh * int64_t(PP) * a.E;
      for (int idx = threadIdx.x; idx < PP * (EP / 8); idx += kThreads) {
        const int p = idx / (EP / 8), e8 = (idx % (EP / 8)) * 8;
        float x[8];
        if (e8 < a.E) {
          const float4 lo = *reinterpret_cast<const float4*>(src + int64_t(p) * a.E + e8);
          const float4 hi = *reinterpret_cast<const float4*>(src + int64_t(p) * a.E + e8 + 4);
          x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
        } else {
#pragma unroll
          for (int u = 0; u < 8; ++u) x[u] = 0.0f;
        }
        chunk::store8(ws + (e8 >> 3) * kSBlock + p * 8, x);
      }
      if (kTwo && h != angles_h) {
        fill_angles<DP>(a, h, 128 / (DP / 8), tab);
        angles_h = h;
      }
      cuda::fence_proxy_async();
    }
    __syncthreads();

    const T* x_raw = Pass == kKeyGrads ? chunk::at_head<T>(a.k, b, a.sk_b, h, a.D) : chunk::at_head<T>(a.q, b, a.sq_b, h, a.D);
    const int64_t x_ts = Pass == kKeyGrads ? a.sk_t : a.sq_t;
    const T* in1 = Pass == kKeyGrads ? chunk::at_head<T>(a.v, b, a.sv_b, h, a.E) : chunk::at_head<T>(a.g, b, a.sg_b, h, a.E);
    const int64_t in1_ts = Pass == kKeyGrads ? a.sv_t : a.sg_t;
    const T* dout = static_cast<const T*>(a.dout) + b * a.N * dts + h * a.E;
    auto stage_chunk = [&](int64_t w) {
      chunk::stage_raw<T, DP, 128>(a, x_raw, x_ts, (w - bh * a.nC) * kC, a.D, stage, tid);
      cuda::cp_async_commit();
    };
    // One chunk. Fixed: the model's acts (model_acts_of) as constants, code without dispatch.
    auto run_chunk = [&](int64_t w, auto fixed) {
      constexpr bool kFixed = decltype(fixed)::value;
      const int act_x = kFixed ? int(FalStepSpec::kSilu) : Pass == kKeyGrads ? a.act_k : a.act_q;
      const int act_g = kFixed ? int(FalStepSpec::kSilu) : a.act_g;
      const int64_t t0 = (w - bh * a.nC) * kC, t_first = t0 + row0;
      cuda::cp_async_wait<0>();
      cuda::bar_sync(1 + wg, 128);  // the warpgroup's previous products are done with X
      chunk::encode_qk<T, DP, 128>(a, stage, nullptr, tab, t0, xs, nullptr, act_x, act_x, kTwo, tid);
      cuda::fence_proxy_async();
      cuda::bar_sync(1 + wg, 128);  // X is whole
      if (w + kWarpgroups < s1) stage_chunk(w + kWarpgroups);  // over this thread's own staged pieces, read above

      float y[EP / 2];
#pragma unroll
      for (int i = 0; i < EP / 2; ++i) y[i] = 0.0f;
      uint32_t raw1[EP / 8][2], raw2[EP / 8][2];
      {
        const uint64_t x_k = cuda::wgmma_desc(xs, kTileBytes, kRows8);
        const uint64_t w_mn = cuda::wgmma_desc(ws, kRows8, kSBytes);
        cuda::wgmma_fence_operand(y);
        cuda::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < PP / 16; ++ks)
          cuda::wgmma_mma<T, EP, 0, 1>(y, desc_at(x_k, 2 * ks * kTileBytes), desc_at(w_mn, 2 * ks * kRows8));
        cuda::wgmma_commit();
        chunk::load_pairs<T, EP>(a, in1, in1_ts, t_first, 0, a.E, raw1);
        if (Pass == kQueryGrads) chunk::load_pairs<T, EP>(a, dout, dts, t_first, 0, a.E, raw2);
        cuda::wgmma_wait<0>();
        cuda::wgmma_fence_operand(y);
      }
      if constexpr (Pass == kOut) {
        T* o = static_cast<T*>(a.out) + b * a.N * dts + h * a.E;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t t = t_first + 8 * r;
#pragma unroll
          for (int j = 0; j < EP / 8; ++j) {
            const int col = 8 * j + 2 * (lane & 3);
            float g[2];
            chunk::load2(reinterpret_cast<const T*>(&raw1[j][r]), g[0], g[1]);
            if (t < a.N && col < a.E)
              chunk::store2(o + t * dts + col, chunk::act_f(g[0], act_g) * y[4 * j + 2 * r],
                            chunk::act_f(g[1], act_g) * y[4 * j + 2 * r + 1]);
          }
        }
      } else {
        // dg = act_g'(g) (dO o Y) and U = act_g(g) o dO, or dv = act_v'(v) Y and U = act_v(v), in one pass (the
        // act's sigmoid once for both); U as the A operand: k-step ks holds columns 16 ks ... 16 ks + 15, i.e. the
        // value pairs j = 2 ks and 2 ks + 1.
        constexpr bool kQuery = Pass == kQueryGrads;
        const int act_u = kQuery ? act_g : kFixed ? int(FalStepSpec::kNone) : a.act_v;
        T* d1 = kQuery ? chunk::at_head<T>(a.dg, b, a.sdg_b, h, a.E) : chunk::at_head<T>(a.dv, b, a.sdv_b, h, a.E);
        const int64_t d1_ts = kQuery ? a.sdg_t : a.sdv_t;
        uint32_t ua[EP / 16][4];
#pragma unroll
        for (int ks = 0; ks < EP / 16; ++ks)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int j = 2 * ks + half, col = 8 * j + 2 * (lane & 3);
              const int64_t t = t_first + 8 * r;
              float x[2], d[2] = {1.0f, 1.0f}, grad[2], u[2];
              chunk::load2(reinterpret_cast<const T*>(&raw1[j][r]), x[0], x[1]);
              if (kQuery) chunk::load2(reinterpret_cast<const T*>(&raw2[j][r]), d[0], d[1]);
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                grad[e] = chunk::act_grad(x[e], d[e] * y[4 * j + 2 * r + e], act_u);
                u[e] = chunk::act_f(x[e], act_u) * d[e];
              }
              if (t < a.N && col < a.E) chunk::store2(d1 + t * d1_ts + col, grad[0], grad[1]);
              ua[ks][2 * half + r] = cuda_device::pack2<T>(u[0], u[1]);
            }
        T* dx = Pass == kKeyGrads ? chunk::at_head<T>(a.dk, b, a.sdk_b, h, a.D) : chunk::at_head<T>(a.dq, b, a.sdq_b, h, a.D);
        const int64_t dx_ts = Pass == kKeyGrads ? a.sdk_t : a.sdq_t;
#pragma unroll 1
        for (int c0 = 0; c0 < DP; c0 += kFoldCols) {
          float f0[kFoldCols / 2], f1[kFoldCols / 2];
#pragma unroll
          for (int i = 0; i < kFoldCols / 2; ++i) f0[i] = f1[i] = 0.0f;
          uint32_t xr[kFoldCols / 8][2];
          const uint64_t w_k = cuda::wgmma_desc(ws + c0 * 8, kSBytes, kRows8);
          cuda::wgmma_fence_operand(f0);
          cuda::wgmma_fence_operand(f1);
          cuda::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < EP / 16; ++ks) cuda::wgmma_rs<T, kFoldCols, 0>(f0, ua[ks], desc_at(w_k, 2 * ks * kSBytes));
          if constexpr (kTwo)
#pragma unroll
            for (int ks = 0; ks < EP / 16; ++ks)
              cuda::wgmma_rs<T, kFoldCols, 0>(f1, ua[ks], desc_at(w_k, DP * 16 + 2 * ks * kSBytes));
          cuda::wgmma_commit();
          chunk::load_pairs<T, kFoldCols>(a, x_raw, x_ts, t_first, c0, a.D, xr);
          cuda::wgmma_wait<0>();
          cuda::wgmma_fence_operand(f0);
          cuda::wgmma_fence_operand(f1);
          chunk::store_folded<T, DP, kFoldCols, kTwo>(a, f0, f1, xr, tab, act_x, dx, dx_ts, t_first, c0);
        }
      }
    };
    if (s0 + wg < s1) stage_chunk(s0 + wg);
    for (int64_t w = s0 + wg; w < s1; w += kWarpgroups) {
      if (model_acts)
        run_chunk(w, std::true_type{});
      else
        run_chunk(w, std::false_type{});
    }
    s0 = s1;
  }
#endif
}

template <class T, int DP, int PP, int EP, int Pass>
void launch(const Args& a, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  const int64_t total = BH * a.nC;
  if (total == 0) return;
  auto kernel = hopper_row_kernel<T, DP, PP, EP, Pass>;
  const size_t smem = RowTiles<DP, PP, EP>::bytes(sizeof(T));
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const Partition part = partition(total, cuda::sm_count(dev.index), kWarpgroups);
  kernel<<<unsigned(part.blocks), kThreads, smem, st>>>(a, state, part.per, total, model_acts_of(a));
  LT_CUDA_CHECK_LAUNCH();
}

template <class T>
void rows_t(const Args& a, int pass, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  chunk::for_wgmma_shape(a, [&](auto shape) {
    using S = decltype(shape);
    if (pass == kOut)
      launch<T, S::kDP, S::kPP, S::kEP, kOut>(a, BH, state, st, dev);
    else if (pass == kQueryGrads)
      launch<T, S::kDP, S::kPP, S::kEP, kQueryGrads>(a, BH, state, st, dev);
    else
      launch<T, S::kDP, S::kPP, S::kEP, kKeyGrads>(a, BH, state, st, dev);
  });
}

}  // namespace

bool hopper_rows_take(const Args& a, int pass, Device dev) {
  static const bool off = [] {
    const char* v = std::getenv("LINTAPE_FAL_NONCAUSAL_ROWS");
    return v && std::strcmp(v, "mma") == 0;
  }();
  const int act_x = pass == kKeyGrads ? a.act_k : a.act_q;
  return !off && act_x != FalStepSpec::kSoftmaxFeature && cuda::wgmma_runs(dev.index);
}

void hopper_rows(const Args& a, int pass, DType dtype, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  if (dtype == DType::BF16)
    rows_t<__nv_bfloat16>(a, pass, BH, state, st, dev);
  else
    rows_t<__half>(a, pass, BH, state, st, dev);
}

}  // namespace lintape::fal_cuda::noncausal
