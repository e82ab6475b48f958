// Causal FAL's state passes on Hopper's warpgroup products (ops/fal/chunk.cuh): one block of four warpgroups
// per walk (b, h and segment) holds the whole D' x E f32 state in registers and multiplies on wgmma,
// asynchronously, while its threads encode the next chunk's rows into the other of two shared-memory buffers
// (the pattern of the noncausal reduction, ops/fal/noncausal.cu, with its encoder). Per chunk c of the walk:
//   forward  store S_c;     S <- lambda^cl S + K^T diag(delta) V      (c = c0 ... c1 - 1)
//   reverse  store R_(c+1); R <- lambda^cl R + Q^T diag(gamma) dY     (c = c1 - 1 ... c0, dY = dO o gb)
// as the slices' state kernel of ops/fal/chunk_fwd.cu does, which every call with documents keeps. The default
// where it runs (LINTAPE_FAL_STATE_PASS=slices runs the slices): on an H200 the backward is 1.06-1.10x faster
// than with the slices (bench/notes/fal-hopper.md, session 8). Each chunk's state goes to memory through a
// shared tile in 16-byte pieces while the product runs (as a chain of 4-byte stores from the registers it made
// the walks 1.6x slower than the slices on an H100, session 4), and the rows, brought by the tensor copy engine,
// are encoded as the wgmma forward encodes them (ops/fal/chunk_wgmma.cuh), their angles afresh each chunk.
#include <cstdlib>
#include <string>
#include <type_traits>
#include "core/cuda_wgmma.cuh"
#include "ops/fal/chunk_wgmma.cuh"

namespace lintape::fal_cuda {

namespace {
StatePassKernel g_state_pass = StatePassKernel::Auto;
}  // namespace

void set_state_pass_kernel(StatePassKernel kernel) { g_state_pass = kernel; }

namespace chunk {

namespace {

constexpr int kWalkThreads = 512;

// One buffer's X (kC x PP) and Z (kC x EP) tiles in 8-column blocks (CoreColumnTile), in elements.
template <int PP, int EP>
struct WalkTiles {
  static constexpr int kX = PP / 8 * CoreColumnTile::kBlock, kZ = EP / 8 * CoreColumnTile::kBlock;
};

// Two buffers of tiles, the raw rows of the next chunk (x, z and, in reverse, dO), the state tile on its way to
// memory, the angle table and the raw rows' mbarrier.
template <int DP, int PP, int EP>
constexpr size_t walk_smem_bytes(size_t elem) {
  return elem * size_t(2 * (WalkTiles<PP, EP>::kX + WalkTiles<PP, EP>::kZ) + kC * (DP + 2 * EP) +
                       StateTile<PP, EP>::kElems) +
         sizeof(float) * noncausal::kAngleRows * DP + sizeof(uint64_t);
}

// DP = D, PP = D', EP = E rounded up to 64 or 128. The raw rows come by the tensor copy engine (xmap, zmap, dmap:
// row_tensor_map of x, z and dO), one thread issuing. Only where LINTAPE_WGMMA was compiled (walk_runs checks).
template <class T, int DP, int PP, int EP, bool Reverse>
__global__ void __launch_bounds__(kWalkThreads, 1)
    walk_kernel(Args a, bool model_acts, const __grid_constant__ CUtensorMap xmap,
                const __grid_constant__ CUtensorMap zmap, const __grid_constant__ CUtensorMap dmap) {
#ifndef LINTAPE_WGMMA
  __trap();
#else
  using W = StateWarps<PP, EP>;
  using Tiles = WalkTiles<PP, EP>;
  constexpr int NThr = kWalkThreads, kBuffer = Tiles::kX + Tiles::kZ, kBlock = CoreColumnTile::kBlock;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tiles = reinterpret_cast<T*>(smem_raw);  // buffer i: X at i kBuffer, then Z
  T* raw_x = tiles + 2 * kBuffer;
  T* raw_z = raw_x + kC * DP;
  T* raw_d = raw_z + kC * EP;
  T* stile = raw_d + kC * EP;
  float* angles = reinterpret_cast<float*>(stile + StateTile<PP, EP>::kElems);
  uint64_t* rows_in = reinterpret_cast<uint64_t*>(angles + noncausal::kAngleRows * DP);  // the rows' mbarrier
  static_assert(2 * kBuffer % 64 == 0 && kC * DP % 64 == 0 && kC * EP % 64 == 0,
                "the raw rows start on 128 bytes (2-byte T)");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = cuda::warpgroup_index(), gm = wg % W::WGM, gn = wg / W::WGM;
  const Walk w = walk_of(a, blockIdx.x, Reverse);
  const int64_t bh = w.bh, b = bh / a.H;
  const int h = int(bh % a.H);
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  const size_t PE = size_t(a.P) * a.E;
  T* states = a.local ? nullptr : static_cast<T*>(Reverse ? a.rstates : a.states) + bh * a.nC * PE;

  // Accumulator value 4 j + r of this thread: state row row(r), column col(j) + r % 2 (core/cuda_wgmma.cuh).
  float acc[W::NW / 2];
  auto row = [&](int r) { return 64 * gm + 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1); };
  auto col = [&](int j) { return gn * W::NW + 8 * j + 2 * (lane & 3); };
#pragma unroll
  for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = col(j) + (r & 1);
      acc[4 * j + r] = w.start && e < a.E ? w.start[size_t(row(r)) * a.E + e] : 0.0f;
    }

  const int c0 = w.c0, steps = w.c1 - w.c0;
  auto chunk_at = [&](int s) { return Reverse ? c0 + steps - 1 - s : c0 + s; };
  auto chunk_len = [&](int c) { return int(a.N - int64_t(c) * kC < kC ? a.N - int64_t(c) * kC : kC); };
  // The raw rows of chunk c into shared memory (rather than registers, which the state fills) by thread 0 alone,
  // once every thread has read the previous chunk's (after a barrier): the fetch of step s completes phase s of
  // rows_in. (b and h made opaque: held across the loop, they would take registers from the state.)
  auto fetch_chunk = [&](int c) {
    if (threadIdx.x == 0) {
      const int bo = int(opaque_index(b)), ho = int(opaque_index(h)), t0 = c * kC;
      cuda::mbarrier_arrive_expect_tx(rows_in, uint32_t(kC * (DP + (Reverse ? 2 : 1) * EP) * sizeof(T)));
      cuda::tma_load_4d(raw_x, &xmap, rows_in, 0, t0, ho, bo);
      cuda::tma_load_4d(raw_z, &zmap, rows_in, 0, t0, ho, bo);
      if (Reverse) cuda::tma_load_4d(raw_d, &dmap, rows_in, 0, t0, ho, bo);
    }
  };
  // The fetched rows of chunk c into buffer buf: X through the act and the LRPE, Z through its act (times dO in
  // reverse) and the row's decay (gamma_i reverse, delta_i forward; zeros past the sequence). wgmma reads them
  // through the async proxy: each writer fences.
  // model_acts (noncausal::model_acts_of): the acts as constants, code without dispatch.
  auto encode_chunk = [&](int c, int buf, auto fixed) {
    constexpr bool kFixed = decltype(fixed)::value;
    const int act_x = kFixed ? int(FalStepSpec::kSilu) : Reverse ? a.act_q : a.act_k;
    const int act_z = kFixed ? int(Reverse ? FalStepSpec::kSilu : FalStepSpec::kNone) : Reverse ? a.act_g : a.act_v;
    const int64_t t0 = int64_t(c) * kC;
    const int cl = chunk_len(c);
    T* xs = tiles + buf * kBuffer;
    encode_qk<T, DP, NThr>(a, raw_x, nullptr, angles, t0, xs, nullptr, act_x, 0, a.lrpe == FalStepSpec::kCosine);
#pragma unroll
    for (int it = 0; it < Raw<EP, NThr>::kIt; ++it) {
      const int idx = threadIdx.x + it * NThr, i = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
      float y[8];
      unpack8<T>(staged<T, EP, NThr>(raw_z, it), y);
      act_n(y, act_z, i < cl && c8 < a.E);
      const float f = decay_pow(log2_lam, Reverse ? i + 1 : cl - 1 - i);
      if (Reverse) {
        float d[8];
        unpack8<T>(staged<T, EP, NThr>(raw_d, it), d);
#pragma unroll
        for (int u = 0; u < 8; ++u) y[u] *= d[u] * f;
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) y[u] *= f;
      }
      store8(xs + Tiles::kX + CoreColumnTile{}(i, c8), y);
    }
  };
  auto store_chunk = [&](int s, int buf) {
    const int c = chunk_at(s);
    cuda::mbarrier_wait(rows_in, uint32_t(s & 1));
    if (model_acts)
      encode_chunk(c, buf, std::true_type{});
    else
      encode_chunk(c, buf, std::false_type{});
    cuda::fence_proxy_async();
  };

  if (threadIdx.x == 0) {
    cuda::mbarrier_init(rows_in, 1);
    cuda::mbarrier_init_fence();
  }
  if (a.lrpe == FalStepSpec::kCosine) noncausal::fill_angles<DP>(a, h, NThr / (DP / 8), angles);
  __syncthreads();  // the angles are in (and the mbarrier set up)
  if (steps > 0) {
    fetch_chunk(chunk_at(0));
    store_chunk(0, 0);
  }
  __syncthreads();
  if (steps > 1) fetch_chunk(chunk_at(1));
  int buf = 0;
  // 16 tokens a k-step: 16 rows of 16 bytes in every 8-column block.
  constexpr uint32_t kLbo = 8 * 16, kSbo = kBlock * sizeof(T);
  for (int s = 0; s < steps; ++s) {
    const int c = chunk_at(s);
    // The state entering this step into the shared tile, then to memory in 16-byte pieces while the product
    // runs (as 4-byte stores straight from the registers, each waited on the one before: 60% of the samples).
    if (states) {
      state_to_tile<T, PP, EP, W::NW>(stile, acc, row, col);
      __syncthreads();
    }
    const float carry = decay_pow(log2_lam, chunk_len(c));
#pragma unroll
    for (int i = 0; i < W::NW / 2; ++i) acc[i] *= carry;
    const T* xs = tiles + buf * kBuffer;
    const T* xa = xs + gm * 8 * kBlock;
    const T* zb = xs + Tiles::kX + gn * (W::NW / 8) * kBlock;
    cuda::wgmma_fence_operand(acc);
    cuda::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kC; kk += 16)
      cuda::wgmma_mma<T, W::NW, 1, 1>(acc, cuda::wgmma_desc(xa + kk * 8, kLbo, kSbo),
                                      cuda::wgmma_desc(zb + kk * 8, kLbo, kSbo));
    cuda::wgmma_commit();
    if (states) tile_to_memory<T, PP, EP, NThr>(stile, states + int64_t(c) * PE, a.E);  // before the next barrier
    const bool more = s + 1 < steps;
    if (more) store_chunk(s + 1, buf ^ 1);
    cuda::wgmma_wait<0>();
    cuda::wgmma_fence_operand(acc);
    if (more) {
      __syncthreads();  // the next buffer is written; this one's product is done
      if (s + 2 < steps) fetch_chunk(chunk_at(s + 2));  // in flight during the next product and encode
      buf ^= 1;
    }
  }
  // The walk's end, found again (held across the loop, its address would take registers).
  float* last = walk_of(a, opaque_index(blockIdx.x), Reverse).last;
  if (last)
#pragma unroll
    for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int e = col(j) + (r & 1);
        if (e < a.E) last[size_t(row(r)) * a.E + e] = acc[4 * j + r];
      }
#endif
}

template <class T, int DP, int PP, int EP>
void launch_walk(const Args& a, int64_t BH, bool reverse, cudaStream_t st) {
  constexpr size_t smem = walk_smem_bytes<DP, PP, EP>(sizeof(T));
  auto kernel = reverse ? walk_kernel<T, DP, PP, EP, true> : walk_kernel<T, DP, PP, EP, false>;
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const CUtensorMap xmap = row_tensor_map(a, BH, reverse ? RowInput::Q : RowInput::K, DP);
  const CUtensorMap zmap = row_tensor_map(a, BH, reverse ? RowInput::G : RowInput::V, EP);
  const CUtensorMap dmap = reverse ? row_tensor_map(a, BH, RowInput::DOut, EP) : CUtensorMap{};
  kernel<<<unsigned(BH * (a.local ? a.G - 1 : a.G)), kWalkThreads, smem, st>>>(a, noncausal::model_acts_of(a), xmap,
                                                                                 zmap, dmap);
  LT_CUDA_CHECK_LAUNCH();
}

// Whether the process asked for the slices (LINTAPE_FAL_STATE_PASS=slices), read once.
bool env_wants_slices() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_FAL_STATE_PASS");
    return v && std::string(v) == "slices";
  }();
  return on;
}

}  // namespace

CUtensorMap state_tensor_map(const void* states, const Args& a, int64_t slots, int rows, int EP) {
  CUtensorMap map{};
  if (!states || slots <= 0 || a.P <= 0 || a.E <= 0) return map;
  const cuuint64_t dims[4] = {8, cuuint64_t(a.P), cuuint64_t(a.E / 8), cuuint64_t(slots)};
  const cuuint64_t strides[3] = {cuuint64_t(a.E) * 2, 16, cuuint64_t(a.P) * cuuint64_t(a.E) * 2};
  const cuuint32_t box[4] = {8, cuuint32_t(rows), cuuint32_t(EP / 8), 1};
  return cuda::plain_tensor_map(states, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, dims, strides, box, "fal");
}

namespace {
// x at (b, token 0, h, 0), head h at h cols, token stride ts, batch stride sb (elements).
CUtensorMap rows_map(const void* x, const Args& a, int64_t B, int cols, int64_t ts, int64_t sb, int W) {
  CUtensorMap map{};
  if (!x || a.N <= 0 || B <= 0 || cols <= 0) return map;
  if (B == 1) sb = ts * a.N;  // one batch: its stride is never used and may be anything
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(a.N), cuuint64_t(a.H), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(ts) * 2, cuuint64_t(cols) * 2, cuuint64_t(sb) * 2};
  const cuuint32_t box[4] = {cuuint32_t(W), cuuint32_t(kC), 1, 1};
  return cuda::plain_tensor_map(x, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, dims, strides, box, "fal");
}
}  // namespace

CUtensorMap row_tensor_map(const Args& a, int64_t BH, RowInput x, int W) {
  const int64_t B = BH / a.H, dts = int64_t(a.H) * a.E;  // dO: (B, N, H, E) contiguous
  switch (x) {
    case RowInput::Q: return rows_map(a.q, a, B, a.D, a.sq_t, a.sq_b, W);
    case RowInput::K: return rows_map(a.k, a, B, a.D, a.sk_t, a.sk_b, W);
    case RowInput::V: return rows_map(a.v, a, B, a.E, a.sv_t, a.sv_b, W);
    case RowInput::G: return rows_map(a.g, a, B, a.E, a.sg_t, a.sg_b, W);
    case RowInput::DOut: break;
  }
  return rows_map(a.dout, a, B, a.E, dts, a.N * dts, W);
}

bool walk_runs(const Args& a) {
  const StatePassKernel k = g_state_pass;
  if (k == StatePassKernel::Slices || (k == StatePassKernel::Auto && env_wants_slices())) return false;
  if (a.starts) return false;  // documents: the slices' kernel
  int dev = 0;
  LT_CUDA_CHECK(cudaGetDevice(&dev));
  return cuda::wgmma_runs(dev);
}

void walk_pass(const Args& a, DType dtype, int64_t BH, bool reverse, cudaStream_t st) {
  for_wgmma_shape(a, [&](auto shape) {
    using S = decltype(shape);
    if (dtype == DType::BF16)
      launch_walk<__nv_bfloat16, S::kDP, S::kPP, S::kEP>(a, BH, reverse, st);
    else
      launch_walk<__half, S::kDP, S::kPP, S::kEP>(a, BH, reverse, st);
  });
}

}  // namespace chunk

}  // namespace lintape::fal_cuda
