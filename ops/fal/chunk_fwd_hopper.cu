// Causal FAL's fused forward on Hopper's warpgroup products (ops/fal/chunk.cuh has the chunk algebra): one
// block of four warpgroups per walk (b, h and segment), sequential over its chunks with the whole D' x E f32
// state in registers, split over the warpgroups as the state pass walks split it (ops/fal/chunk_wgmma.cuh).
// Every product runs on wgmma with both operands in shared memory. Per chunk c, between three barriers:
//   1. S_c (in T) into shared memory;
//   2. issued together: the scores Q K^T (warpgroup g: keys 16 g ... 16 g + 15) and S <- lambda^cl S + K^T
//      diag(delta) V (each warpgroup its own state tiles); meanwhile S_c goes to memory for the backward (when
//      asked) and g's rows toward L2; then the scores masked and decayed into a shared tile, the four
//      warpgroups' key columns making the chunk's scores;
//   3. Y = diag(gamma) Q S_c + (Q K^T o M) V (warpgroup g: E / 4 columns), out = gb o Y;
//   4. the next chunk's rows, brought by the tensor copy engine one chunk ahead (issued after barrier 1, once
//      every thread has read the rows before them), through the acts and the LRPE into the tiles.
// The tiles use CoreColumnTile (8-column blocks of 16-byte rows): read K-major by the scores and Y's products,
// MN-major by the state update. 512 threads at 128 registers hold the state (64 values a thread at D' = 256,
// E = 128) beside the products' accumulators, so the code keeps short live ranges: addresses rebuilt from an
// opaque base each chunk, g's values loaded under Y's products (brought to L2 at the chunk's top), the
// encode 4 columns at a time.
// The mma.sync kernel of ops/fal/chunk_fwd.cu keeps the calls with documents, the local passes of a cut and
// every call where this one does not run. Notes and timings: bench/notes/fal-hopper.md (session 8).
#include <cstdlib>
#include <string>
#include <type_traits>
#include "core/cuda_wgmma.cuh"
#include "ops/fal/chunk_wgmma.cuh"

namespace lintape::fal_cuda {

namespace {
ForwardKernel g_forward = ForwardKernel::Auto;
}  // namespace

void set_forward_kernel(ForwardKernel kernel) { g_forward = kernel; }

namespace chunk {

namespace {

constexpr int kHopperThreads = 512;

// p, which the compiler must treat as unknown in each chunk: the addresses and descriptors computed from it are
// computed again there rather than hoisted out of the chunk loop into registers, which the state fills.
template <class T>
__device__ __forceinline__ T* opaque_ptr(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}
constexpr int kBlock = CoreColumnTile::kBlock;

// Shared memory, in elements of T from the start: Q and K (kC x PP), V and diag(delta) V (kC x EP), all in
// CoreColumnTile; S_c (PP x EP, EP / 8 blocks of PP rows of 16 bytes, MN-major along E); the masked scores (kC x
// kC, CoreColumnTile); the raw q, k, v rows of the next chunk; then the LRPE angle table in floats.
template <int DP, int PP, int EP>
struct HopperSmem {
  static constexpr int kTileP = PP / 8 * kBlock, kTileE = EP / 8 * kBlock, kSBlock = StateTile<PP, EP>::kBlock;
  static constexpr int kQ = 0, kK = kQ + kTileP, kV = kK + kTileP, kVd = kV + kTileE, kS = kVd + kTileE;
  static constexpr int kP = kS + StateTile<PP, EP>::kElems, kRawQ = kP + kC / 8 * kBlock, kRawK = kRawQ + kC * DP;
  static constexpr int kRawV = kRawK + kC * DP, kEnd = kRawV + kC * EP;
  static_assert(kRawQ % 64 == 0 && kRawK % 64 == 0 && kRawV % 64 == 0, "the raw rows start on 128 bytes (2-byte T)");
  static constexpr size_t bytes(size_t elem) {  // with the raw rows' mbarrier after the angle table
    return elem * size_t(kEnd) + sizeof(float) * noncausal::kAngleRows * DP + sizeof(uint64_t);
  }
};

// DP = D, PP = D', EP = E rounded up to 64 or 128. Save: a.states receives S_c (every chunk's, or the even
// chunks' with a.half_states). The raw rows come by the tensor copy engine (qmap, kmap, vmap: row_tensor_map of
// q, k, v), one thread issuing. Pieces: the balanced cut (a.piece > 0, forward_walk). Only where LINTAPE_WGMMA was
// compiled (hopper_forward_runs checks).
template <class T, int DP, int PP, int EP, bool Save, bool Pieces>
__global__ void __launch_bounds__(kHopperThreads, 1)
    hopper_forward_kernel(Args a, const __grid_constant__ CUtensorMap qmap, const __grid_constant__ CUtensorMap kmap,
                          const __grid_constant__ CUtensorMap vmap) {
#ifndef LINTAPE_WGMMA
  __trap();
#else
  using W = StateWarps<PP, EP>;
  using L = HopperSmem<DP, PP, EP>;
  constexpr int NThr = kHopperThreads, EO = EP / 4;  // Y's columns per warpgroup
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sm = reinterpret_cast<T*>(smem_raw);
  float* const angles = reinterpret_cast<float*>(sm + L::kEnd);
  uint64_t* const rows_in = reinterpret_cast<uint64_t*>(angles + noncausal::kAngleRows * DP);  // the rows' mbarrier
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const int gm = wg % W::WGM, gn = wg / W::WGM;
  if (threadIdx.x == 0) {
    cuda::mbarrier_init(rows_in, 1);
    cuda::mbarrier_init_fence();
  }
  __syncthreads();  // the mbarrier is set up before any copy completes on it
  // The block's walks (one, or with Pieces, the balanced cut's, the (b, h)s its items touch) one after the other;
  // the copies before a walk's (fetched) set the parity its chunks wait on. The loop is compiled apart: it costs
  // registers.
  int fetched = 0;
  for (int k = 0; Pieces || k == 0; ++k) {
    const Walk w = Pieces ? forward_walk(a, blockIdx.x, k) : walk_of(a, blockIdx.x, false);
    if (w.bh < 0) break;
    const int64_t bh = w.bh, b = bh / a.H;
    const int h = int(bh % a.H);
    const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;

    // State value 4 j + r of this thread: row srow(r), column scol(j) + r % 2 (core/cuda_wgmma.cuh); the chunk
    // row of value r of the scores and of Y.
    float acc[W::NW / 2];
    auto srow = [&](int r) { return 64 * gm + 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1); };
    auto scol = [&](int j) { return gn * W::NW + 8 * j + 2 * (lane & 3); };
    auto trow = [&](int r) { return 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1); };
#pragma unroll
    for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int e = scol(j) + (r & 1);
        acc[4 * j + r] = w.start && e < a.E ? w.start[size_t(srow(r)) * a.E + e] : 0.0f;
      }

    auto chunk_len = [&](int c) { return int(a.N - int64_t(c) * kC < kC ? a.N - int64_t(c) * kC : kC); };
    // Chunk c's raw rows by thread 0 alone, once every thread has read the previous chunk's (after a barrier): the
    // k-th fetch of the walk completes phase k of rows_in. (b and h made opaque: held across the chunk loop, they
    // would take registers from the state.)
    auto fetch_chunk = [&](int c) {
      if (threadIdx.x == 0) {
        const int bo = int(opaque_index(b)), ho = int(opaque_index(h)), t0 = c * kC;
        cuda::mbarrier_arrive_expect_tx(rows_in, uint32_t(kC * (2 * DP + EP) * sizeof(T)));
        cuda::tma_load_4d(sm + L::kRawQ, &qmap, rows_in, 0, t0, ho, bo);
        cuda::tma_load_4d(sm + L::kRawK, &kmap, rows_in, 0, t0, ho, bo);
        cuda::tma_load_4d(sm + L::kRawV, &vmap, rows_in, 0, t0, ho, bo);
      }
    };
    // Chunk c's fetched rows into the tiles; wgmma reads them through the async proxy, so each writer fences. The
    // model's acts (silu on q, k and g, none on v) and the cosine LRPE are compiled as constants: the encode without
    // dispatch, its chains free to interleave.
    const bool model_acts = noncausal::model_acts_of(a) && a.lrpe == FalStepSpec::kCosine;
    auto encode_acts = [&](int c, auto fixed) {
      constexpr bool kFixed = decltype(fixed)::value;
      const int64_t t0 = int64_t(c) * kC;
      const int cl = chunk_len(c);
      const int act_v = kFixed ? int(FalStepSpec::kNone) : a.act_v;
      cuda::mbarrier_wait(rows_in, uint32_t((fetched + c - w.c0) & 1));
      encode_qk<T, DP, NThr>(a, sm + L::kRawQ, sm + L::kRawK, angles, t0, sm + L::kQ, sm + L::kK,
                             kFixed ? int(FalStepSpec::kSilu) : a.act_q, kFixed ? int(FalStepSpec::kSilu) : a.act_k,
                             kFixed || a.lrpe == FalStepSpec::kCosine);
#pragma unroll
      for (int it = 0; it < Raw<EP, NThr>::kIt; ++it) {
        const int idx = threadIdx.x + it * NThr, i = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
        float y[8];
        unpack8<T>(staged<T, EP, NThr>(sm + L::kRawV, it), y);
        act_n(y, act_v, i < cl && c8 < a.E);
        store8(sm + L::kV + CoreColumnTile{}(i, c8), y);
        const float f = decay_pow(log2_lam, cl - 1 - i);
#pragma unroll
        for (int u = 0; u < 8; ++u) y[u] *= f;
        store8(sm + L::kVd + CoreColumnTile{}(i, c8), y);
      }
      cuda::fence_proxy_async();
    };
    auto encode_chunk = [&](int c) {
      if (model_acts)
        encode_acts(c, std::true_type{});
      else
        encode_acts(c, std::false_type{});
    };

    const int c0 = w.c0, c1 = w.c1;
    if (c0 < c1) fetch_chunk(c0);  // the previous walk's last barrier: every thread is done with the rows
    if (a.lrpe == FalStepSpec::kCosine) noncausal::fill_angles<DP>(a, h, NThr / (DP / 8), angles);
    __syncthreads();  // the angles are in
    if (c0 < c1) encode_chunk(c0);  // the next chunk's rows are fetched after the next barrier, in the chunk loop
    // Descriptors (core/cuda_wgmma.cuh): K-major tiles step 8 columns a block along K and 8 rows (128 bytes)
    // along M / N; MN-major ones 8 rows along K and a block along M / N.
    constexpr uint32_t kRows8 = 8 * 16, kTileBlock = kBlock * sizeof(T), kStateBlock = L::kSBlock * sizeof(T);
    for (int c = c0; c < c1; ++c) {
      const int64_t t0 = int64_t(c) * kC;
      const int cl = chunk_len(c);
      // Shared memory's addresses from one opaque base per chunk (hoisted out of the loop, they would take
      // registers from the state).
      T* const base = opaque_ptr(sm);
      T* const sbc = base + L::kS;
      // g's rows of this chunk toward L2 for the epilogue, one prefetch a 128-byte line (64 elements). (This form
      // of the loop, at the chunk's top, left the state's registers alone; others made ptxas spill.)
      for (int idx = threadIdx.x; idx < kC * (EP / 8); idx += NThr) {
        const int i = idx / (EP / 8), e8 = (idx % (EP / 8)) * 8;
        if (t0 + i < a.N && e8 < a.E && e8 % 64 == 0)
          cuda::prefetch_l2(at_head<T>(a.g, opaque_index(b), a.sg_b, opaque_index(h), a.E) + (t0 + i) * a.sg_t + e8);
      }
      // 1. S_c into shared memory; the barrier also publishes chunk c's tiles.
      state_to_tile<T, PP, EP, W::NW>(sbc, acc, srow, scol);
      cuda::fence_proxy_async();
      __syncthreads();
      if (c + 1 < c1) fetch_chunk(c + 1);  // every thread has encoded chunk c's rows

      // 2. The scores and the state update (S_c is in shared memory).
      const float carry = decay_pow(log2_lam, cl);
#pragma unroll
      for (int i = 0; i < W::NW / 2; ++i) acc[i] *= carry;
      float sc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) sc[i] = 0.0f;
      {
        const uint64_t q_k = cuda::wgmma_desc(base + L::kQ, kTileBlock, kRows8);
        const uint64_t k_k = cuda::wgmma_desc(base + L::kK + 16 * wg * 8, kTileBlock, kRows8);
        const uint64_t k_mn = cuda::wgmma_desc(base + L::kK + gm * 8 * kBlock, kRows8, kTileBlock);
        const uint64_t vd_mn = cuda::wgmma_desc(base + L::kVd + gn * (W::NW / 8) * kBlock, kRows8, kTileBlock);
        cuda::wgmma_fence_operand(acc);
        cuda::wgmma_fence_operand(sc);
        cuda::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < PP / 16; ++ks)
          cuda::wgmma_mma<T, 16, 0, 0>(sc, desc_at(q_k, 2 * ks * kTileBlock), desc_at(k_k, 2 * ks * kTileBlock));
        cuda::wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < kC; kk += 16)
          cuda::wgmma_mma<T, W::NW, 1, 1>(acc, desc_at(k_mn, kk * 16), desc_at(vd_mn, kk * 16));
        cuda::wgmma_commit();
      }
      // S_c to memory for the backward while the products run (with half_states, the even chunks' only); the
      // next chunk's barriers guard its shared copy.
      if (Save && !(a.half_states && (c & 1))) {
        T* dst = static_cast<T*>(a.states) +
                 (opaque_index(bh) * saved_chunks(a) + saved_slot(a, c)) * int64_t(a.P) * a.E;
        tile_to_memory<T, PP, EP, NThr>(sbc, dst, a.E);
      }

      // The masked, decayed scores of this warpgroup's keys into the chunk's score tile.
      T* const pc = base + L::kP;
      cuda::wgmma_wait<1>();
      cuda::wgmma_fence_operand(sc);
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          const int t = trow(r), s = 16 * wg + 8 * j + 2 * (lane & 3);
          const float w0 = s <= t ? decay_pow(log2_lam, t - s) : 0.0f;
          const float w1 = s + 1 <= t ? decay_pow(log2_lam, t - s - 1) : 0.0f;
          store2(pc + (s >> 3) * kBlock + t * 8 + (s & 7), sc[4 * j + r] * w0, sc[4 * j + r + 1] * w1);
        }
      cuda::fence_proxy_async();
      __syncthreads();  // every warpgroup's scores are in
      // g's values of this thread's out elements, loaded under Y's products (rows trow(0) and trow(0) + 8, two a
      // word), so that the epilogue does not wait on them.
      uint32_t graw[EO / 8][2];
      load_pairs<T, EO>(a, at_head<T>(a.g, opaque_index(b), a.sg_b, opaque_index(h), a.E), a.sg_t, t0 + trow(0),
                        wg * EO, a.E, graw);

      // 3. Y = diag(gamma) Q S_c + (Q K^T o M) V, this warpgroup's E / 4 columns.
      float y[EO / 2];
#pragma unroll
      for (int i = 0; i < EO / 2; ++i) y[i] = 0.0f;
      {
        const uint64_t q_k = cuda::wgmma_desc(base + L::kQ, kTileBlock, kRows8);
        const uint64_t s_mn = cuda::wgmma_desc(sbc + (wg * EO / 8) * L::kSBlock, kRows8, kStateBlock);
        cuda::wgmma_fence_operand(y);
        cuda::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < PP / 16; ++ks)
          cuda::wgmma_mma<T, EO, 0, 1>(y, desc_at(q_k, 2 * ks * kTileBlock), desc_at(s_mn, 2 * ks * kRows8));
        cuda::wgmma_commit();
      }

      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(y);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float gamma = decay_pow(log2_lam, trow(r) + 1);
#pragma unroll
        for (int j = 0; j < EO / 8; ++j) y[4 * j + r] *= gamma;
      }
      {
        const uint64_t p_k = cuda::wgmma_desc(pc, kTileBlock, kRows8);
        const uint64_t v_mn = cuda::wgmma_desc(base + L::kV + (wg * EO / 8) * kBlock, kRows8, kTileBlock);
        cuda::wgmma_fence_operand(y);
        cuda::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kC / 16; ++ks)
          cuda::wgmma_mma<T, EO, 0, 1>(y, desc_at(p_k, 2 * ks * kTileBlock), desc_at(v_mn, 2 * ks * kRows8));
        cuda::wgmma_commit();
      }
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(y);
      cuda::wgmma_fence_operand(acc);

      // out = gb o Y.
      {
        T* __restrict__ out = static_cast<T*>(a.out) + (opaque_index(b) * a.N * a.H + opaque_index(h)) * a.E;
        const int act_g = model_acts ? int(FalStepSpec::kSilu) : a.act_g;
#pragma unroll
        for (int j = 0; j < EO / 8; ++j) {
          const int e = wg * EO + 8 * j + 2 * (lane & 3);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t t = t0 + trow(0) + 8 * r;
            float gb[2];
            load2(reinterpret_cast<const T*>(&graw[j][r]), gb[0], gb[1]);
            act_n(gb, act_g, true);
            if (t < a.N && e < a.E)
              store2(out + t * a.H * a.E + e, gb[0] * y[4 * j + 2 * r], gb[1] * y[4 * j + 2 * r + 1]);
          }
        }
      }
      __syncthreads();  // every product is done with the tiles, S_c and the scores
      // 4. The next chunk's tiles; the one after it in flight until then.
      if (c + 1 < c1) encode_chunk(c + 1);
    }
    // The walk's end, found again (held across the loop, its address would take registers).
    float* last = Pieces ? forward_walk(a, opaque_index(blockIdx.x), int(opaque_index(k))).last
                         : walk_of(a, opaque_index(blockIdx.x), false).last;
    if (last)
#pragma unroll
      for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e = scol(j) + (r & 1);
          if (e < a.E) last[size_t(srow(r)) * a.E + e] = acc[4 * j + r];
        }
    fetched += c1 - c0;
  }
#endif
}

template <class T, int DP, int PP, int EP>
void launch_hopper(const Args& a, int64_t BH, cudaStream_t st) {
  constexpr size_t smem = HopperSmem<DP, PP, EP>::bytes(sizeof(T));
  auto kernel = a.piece > 0 ? (a.states ? hopper_forward_kernel<T, DP, PP, EP, true, true>
                                        : hopper_forward_kernel<T, DP, PP, EP, false, true>)
                            : (a.states ? hopper_forward_kernel<T, DP, PP, EP, true, false>
                                        : hopper_forward_kernel<T, DP, PP, EP, false, false>);
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t blocks = a.piece > 0 ? (a.list_end + a.piece - 1) / a.piece : BH * a.G;
  kernel<<<unsigned(blocks), kHopperThreads, smem, st>>>(a, row_tensor_map(a, BH, RowInput::Q, DP),
                                                           row_tensor_map(a, BH, RowInput::K, DP),
                                                           row_tensor_map(a, BH, RowInput::V, EP));
  LT_CUDA_CHECK_LAUNCH();
}

// Whether the process asked for the mma.sync forward (LINTAPE_FAL_FORWARD=chunks), read once.
bool env_wants_chunks() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_FAL_FORWARD");
    return v && std::string(v) == "chunks";
  }();
  return on;
}

}  // namespace

bool hopper_forward_runs(const Args& a) {
  const ForwardKernel k = g_forward;
  if (k == ForwardKernel::Chunks || (k == ForwardKernel::Auto && env_wants_chunks())) return false;
  if (a.local || a.starts) return false;
  int dev = 0;
  LT_CUDA_CHECK(cudaGetDevice(&dev));
  return cuda::wgmma_runs(dev);
}

void hopper_forward(const Args& a, DType dtype, int64_t BH, cudaStream_t st) {
  for_wgmma_shape(a, [&](auto shape) {
    using S = decltype(shape);
    if (dtype == DType::BF16)
      launch_hopper<__nv_bfloat16, S::kDP, S::kPP, S::kEP>(a, BH, st);
    else
      launch_hopper<__half, S::kDP, S::kPP, S::kEP>(a, BH, st);
  });
}

}  // namespace chunk

}  // namespace lintape::fal_cuda
