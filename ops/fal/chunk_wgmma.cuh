// Internal to the FAL family: what the causal chunk kernels on Hopper's warpgroup products share (the state
// pass walks of ops/fal/chunk_state.cu and the forward of ops/fal/chunk_fwd_hopper.cu): the split of a D' x E
// f32 state over four warpgroups, and the staging of a chunk's raw rows in shared memory by cp.async.
#pragma once
#include "ops/fal/noncausal.cuh"

namespace lintape::fal_cuda::chunk {

// The 4 warpgroups over the PP x EP state: WGM along P (64 rows each) by WGN along E (NW columns each).
template <int PP, int EP>
struct StateWarps {
  static constexpr int WGM = PP / 64, WGN = 4 / WGM, NW = EP / WGN;
  static_assert(WGM * WGN == 4 && NW % 16 == 0, "whole warpgroup tiles");
};

// Rows t0 ... t0 + kC - 1, columns [0, W) of x into stage ([kC][W]) through cp.async, zeros past the sequence
// or past cols. A thread copies the pieces that it reads back (Raw's: fetch's order), so a wait and no barrier
// lets it read them.
template <class T, int W, int NThr>
__device__ __forceinline__ void stage_raw(const Args& a, const T* __restrict__ x, int64_t ts, int64_t t0, int cols,
                                          T* stage) {
#pragma unroll
  for (int it = 0; it < Raw<W, NThr>::kIt; ++it) {
    const int idx = threadIdx.x + it * NThr, i = idx / (W / 8), c = (idx % (W / 8)) * 8;
    if (t0 + i < a.N && c < cols)
      cp_async16(stage + i * W + c, x + (t0 + i) * ts + c);
    else
      *reinterpret_cast<uint4*>(stage + i * W + c) = make_uint4(0, 0, 0, 0);
  }
}
template <class T, int W, int NThr>
__device__ __forceinline__ uint4 staged(const T* stage, int it) {
  const int idx = threadIdx.x + it * NThr;
  return *reinterpret_cast<const uint4*>(stage + idx / (W / 8) * W + (idx % (W / 8)) * 8);
}

// The instantiation of a wgmma chunk kernel for a's shape: f(WgmmaShape<DP, PP, EP>{}) with DP = D, PP = D'
// and EP = E rounded up to 64 or 128 (D 64 or 128; D' = D or 2 D).
template <int DP, int PP, int EP>
struct WgmmaShape {
  static constexpr int kDP = DP, kPP = PP, kEP = EP;
};
template <class F>
void for_wgmma_shape(const Args& a, F&& f) {
  const bool wide = a.E > 64;
  if (a.D == 128) {
    if (a.P == 256)
      wide ? f(WgmmaShape<128, 256, 128>{}) : f(WgmmaShape<128, 256, 64>{});
    else
      wide ? f(WgmmaShape<128, 128, 128>{}) : f(WgmmaShape<128, 128, 64>{});
  } else {
    if (a.P == 128)
      wide ? f(WgmmaShape<64, 128, 128>{}) : f(WgmmaShape<64, 128, 64>{});
    else
      wide ? f(WgmmaShape<64, 64, 128>{}) : f(WgmmaShape<64, 64, 64>{});
  }
}

}  // namespace lintape::fal_cuda::chunk
