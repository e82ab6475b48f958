// Fused FAL, noncausal. bf16/f16 calls that noncausal_chunked takes run the chunk kernels of
// ops/fal/noncausal.cuh: kv = kb^T vb reduced over the key chunks, then o = gb o (qb kv) per query chunk;
// backward dkv = qb^T (gb o dO) over the query chunks, then dq and dg per query chunk (from kv) and dk and dv
// per key chunk (from dkv). They read q, k, v, g in place when each token's heads are contiguous rows.
// The others (f32, rotate, softmax on v or g, other head dims) run the sweep (ops/fal/sweep.cuh: f32 rows in
// shared memory), kv reduced over slices of the keys by separate blocks and summed in a fixed order.
#include <algorithm>
#include <type_traits>
#include "core/config.h"
#include "core/cuda_wgmma.cuh"
#include "ops/fal/chunk_wgmma.cuh"
#include "ops/fal/noncausal.cuh"
#include "ops/fal/sweep.cuh"

namespace lintape::fal_cuda {

namespace noncausal {

namespace {

constexpr int kReduceThreads = 512;
constexpr int64_t kMinReduceChunks = 8;  // the fewest chunks of a reduction run (bounds the partial states)

// The reduction's 16 warps over the P x EP state. mma.sync: WR groups of rows (MT m-tiles each) by WC groups of
// columns. wgmma: the 4 warpgroups, WGM along P (64 rows each) by WGN along E (NW columns each).
template <int PP, int EP>
struct ReduceWarps {
  static constexpr int WR = PP >= 128 ? 8 : 4, WC = 16 / WR;
  static constexpr int MT = PP / 16 / WR, NT = EP / WC / 8;
  static_assert(MT * 16 * WR == PP && NT * 8 * WC == EP && NT % 2 == 0, "whole tiles");
  static constexpr int WGM = PP / 64, WGN = 4 / WGM, NW = EP / WGN;
  static_assert(WGM * WGN == 4 && NW % 16 == 0, "whole warpgroup tiles");
};

// The X and Z tiles of one item, in elements: rows for mma.sync, 8-column blocks for wgmma.
template <int PP, int EP, bool Wg>
struct ReduceTiles {
  static constexpr int kX = Wg ? PP / 8 * chunk::CoreColumnTile::kBlock : kC * (PP + kPad);
  static constexpr int kZ = Wg ? EP / 8 * chunk::CoreColumnTile::kBlock : kC * (EP + kPad);
};

// X and Z tiles twice (the next item's rows are stored while this item's product runs), the angle table, the
// threads' first-row angles and the decay weights of a chunk's rows (the causal pieces' sums).
template <int DP, int PP, int EP, bool Wg>
constexpr size_t reduce_smem_bytes(size_t elem) {
  using Tiles = ReduceTiles<PP, EP, Wg>;
  return 2 * elem * size_t(Tiles::kX + Tiles::kZ) + sizeof(float) * kAngleRows * DP +
         FirstRowAngles<DP, kReduceThreads>::kBytes + sizeof(float) * kC;
}

// A run of items (b, h, chunk), item w = bh nC + chunk, sums X^T Z over its chunks into partial[slot] (P x E
// f32) for each (b, h) it touches, slot = blockIdx.x + bh (distinct: a run starts where the previous one ended).
// Wg: the products run on wgmma, asynchronously, while the threads encode the next item (only where
// LINTAPE_WGMMA was compiled: launch_reduce checks); else on mma.sync, then the encode.
// Pieces (kv only, wgmma): the causal forward's local sums under its balanced cut (chunk::Args::piece): block
// (x - 1) total + r sums run r (`per` chunks) of the piece of items before cut x, the piece's chunks of one (b, h)
// (the items from max(x piece - piece, the (b, h)'s first) to x piece), with the decay: lambda^(end - 1 - t) on
// key t for a run ending at token `end`, into partial[blockIdx.x]; blocks past their piece write nothing.
template <class T, int DP, int PP, int EP, bool Grad, bool Wg, bool Pieces = false>
__global__ void __launch_bounds__(kReduceThreads, 1)
    reduce_kernel(Args a, float* __restrict__ partial, int64_t per, int64_t total, bool model_acts) {
#ifndef LINTAPE_WGMMA
  if constexpr (Wg) __trap();  // launch_reduce picks Wg only where wgmma was compiled
#endif
  static_assert(!Pieces || (Wg && !Grad), "the pieces' sums are kv sums on wgmma");
  using W = ReduceWarps<PP, EP>;
  using Tiles = ReduceTiles<PP, EP, Wg>;
  constexpr int NThr = kReduceThreads, ldX = PP + kPad, ldZ = EP + kPad, kBuffer = Tiles::kX + Tiles::kZ;
  using At = std::conditional_t<Wg, chunk::CoreColumnTile, chunk::RowMajorTile>;
  At at_x, at_z;
  if constexpr (!Wg) at_x = chunk::RowMajorTile{ldX}, at_z = chunk::RowMajorTile{ldZ};
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tiles = reinterpret_cast<T*>(smem_raw);  // buffer i: X at i kBuffer, then Z
  float* angles = reinterpret_cast<float*>(tiles + 2 * kBuffer);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int64_t begin = int64_t(blockIdx.x) * per, end = min(begin + per, total);
  if constexpr (Pieces) {
    const int64_t x = blockIdx.x / total + 1, r = blockIdx.x % total, p = x * a.piece, bh = p / a.nC;
    const int64_t c = p - bh * a.nC, lo = max(c - a.piece, int64_t(0)) + r * per, hi = min(lo + per, c);
    if (lo >= hi) return;  // a cut at a (b, h)'s first chunk (c = 0), or a run past the piece
    begin = bh * a.nC + lo, end = bh * a.nC + hi;
  }
  const int64_t dts = int64_t(a.H) * a.E;  // dout's token stride
  const bool cosine = a.lrpe == FalStepSpec::kCosine;

  Raw<DP, NThr> xr;
  Raw<EP, NThr> zr, dr;
  auto fetch_item = [&](const Item& it) {
    const int64_t b = it.b, t0 = it.t0();
    const int h = it.h;
    if (Grad) {
      chunk::fetch(a, chunk::at_head<T>(a.q, b, a.sq_b, h, a.D), a.sq_t, t0, 0, a.D, xr);
      chunk::fetch(a, chunk::at_head<T>(a.g, b, a.sg_b, h, a.E), a.sg_t, t0, 0, a.E, zr);
      chunk::fetch(a, static_cast<const T*>(a.dout) + b * a.N * dts + h * a.E, dts, t0, 0, a.E, dr);
    } else {
      chunk::fetch(a, chunk::at_head<T>(a.k, b, a.sk_b, h, a.D), a.sk_t, t0, 0, a.D, xr);
      chunk::fetch(a, chunk::at_head<T>(a.v, b, a.sv_b, h, a.E), a.sv_t, t0, 0, a.E, zr);
    }
  };
  // The fetched rows of item `it` into buffer buf. No warp reads the angles here: every encode before this one
  // was followed by a barrier. wgmma reads the tiles through the async proxy: each writer fences.
  int angles_h = -1;
  FirstRowAngles<DP, NThr> first;
  first.kept = angles + kAngleRows * DP;
  float* const delta = angles + kAngleRows * DP + FirstRowAngles<DP, NThr>::kBytes / sizeof(float);
  // model_acts (model_acts_of): the acts as constants, code without dispatch.
  auto encode_item = [&](const Item& it, int buf, auto fixed) {
    constexpr bool kFixed = decltype(fixed)::value;
    const int act_x = kFixed ? int(FalStepSpec::kSilu) : Grad ? a.act_q : a.act_k;
    const int act_z = kFixed ? int(Grad ? FalStepSpec::kSilu : FalStepSpec::kNone) : Grad ? a.act_g : a.act_v;
    T* xs = tiles + buf * kBuffer;
    encode_rows<T, DP, NThr>(a, xr, act_x, angles, first, it.t0(), xs, at_x);
    chunk::store_rows<T, EP, NThr>(a, zr, Grad ? &dr : nullptr, act_z, it.t0(), 0, Pieces ? delta : nullptr,
                                   xs + Tiles::kX, at_z);
  };
  auto store_item = [&](const Item& it, int buf) {
    if (cosine && it.h != angles_h) {
      fill_angles<DP>(a, it.h, NThr / (DP / 8), angles);
      angles_h = it.h;
      __syncthreads();
    }
    if (model_acts)
      encode_item(it, buf, std::true_type{});
    else
      encode_item(it, buf, std::false_type{});
    if (Wg) cuda::fence_proxy_async();
  };

  // mma.sync: warp (m0, n0)'s tile. wgmma: warpgroup (gm, gn)'s 64 x NW tile.
  const int m0 = 16 * W::MT * (warp % W::WR), n0 = 8 * W::NT * (warp / W::WR);
  const int gm = (warp >> 2) % W::WGM, gn = (warp >> 2) / W::WGM;
  chunk::Acc<Wg ? 1 : W::MT, Wg ? 2 : W::NT> acc;
  float wacc[Wg ? W::NW / 2 : 1];
  auto zero = [&] {
    if constexpr (Wg) {
#pragma unroll
      for (int i = 0; i < W::NW / 2; ++i) wacc[i] = 0.0f;
    } else {
      acc.zero();
    }
  };
  // The (b, h)'s partial sum into its slot (a piece's run: the block's).
  auto write = [&](int64_t bh) {
    float* dst = partial + (int64_t(blockIdx.x) + (Pieces ? 0 : bh)) * PP * a.E;
    if constexpr (Wg) {
#pragma unroll
      for (int j = 0; j < W::NW / 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          const int p = 64 * gm + 16 * (warp & 3) + (lane >> 2) + 8 * (r >> 1);
          const int e = gn * W::NW + 8 * j + 2 * (lane & 3);
          if (e < a.E)
            *reinterpret_cast<float2*>(dst + int64_t(p) * a.E + e) = make_float2(wacc[4 * j + r], wacc[4 * j + r + 1]);
        }
    } else {
#pragma unroll
      for (int m = 0; m < W::MT; ++m)
#pragma unroll
        for (int n = 0; n < W::NT; ++n)
#pragma unroll
          for (int r = 0; r < 4; r += 2) {
            const int p = m0 + acc.row(m, r), e = n0 + acc.col(n, r);
            if (e < a.E)
              *reinterpret_cast<float2*>(dst + int64_t(p) * a.E + e) = make_float2(acc.x[m][n][r], acc.x[m][n][r + 1]);
          }
    }
  };

  zero();
  Item cur;
  cur.start(begin, a);  // begin < end: no run is empty
  // A piece's chunks are whole (only a (b, h)'s last chunk can be short, and a piece ends before a cut): key j of
  // a chunk weighs lambda^(kC - 1 - j), and the sum so far lambda^kC more at each next chunk.
  const float log2_lam = Pieces && a.decay ? __log2f(a.decay[cur.h]) : 0.0f;
  if constexpr (Pieces) {
    if (threadIdx.x < kC) delta[threadIdx.x] = chunk::decay_pow(log2_lam, kC - 1 - int(threadIdx.x));
    __syncthreads();
  }
  fetch_item(cur);
  store_item(cur, 0);
  __syncthreads();
  Item next = cur;
  next.step(a);
  if (begin + 1 < end) fetch_item(next);
  int buf = 0;
  // One barrier per item: the product of buffer buf and the next item's rows into the other buffer (whose
  // product ended before the last barrier). With wgmma the encode runs while the product does.
  for (int64_t w = begin; w < end; ++w) {
    const bool more = w + 1 < end;
    const T* xs = tiles + buf * kBuffer;
    if constexpr (Wg) {
#ifdef LINTAPE_WGMMA
      // 16 tokens a step: 16 rows of 16 bytes in every 8-column block.
      const T* xa = xs + gm * 8 * chunk::CoreColumnTile::kBlock;
      const T* zb = xs + Tiles::kX + gn * (W::NW / 8) * chunk::CoreColumnTile::kBlock;
      constexpr uint32_t kLbo = 8 * 16, kSbo = chunk::CoreColumnTile::kBlock * sizeof(T);
      cuda::wgmma_fence_operand(wacc);
      cuda::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kC; kk += 16)
        cuda::wgmma_mma<T, W::NW, 1, 1>(wacc, cuda::wgmma_desc(xa + kk * 8, kLbo, kSbo),
                                        cuda::wgmma_desc(zb + kk * 8, kLbo, kSbo));
      cuda::wgmma_commit();
      if (more) store_item(next, buf ^ 1);
      cuda::wgmma_wait<0>();
      cuda::wgmma_fence_operand(wacc);
      if (Pieces && more) {
        const float carry = chunk::decay_pow(log2_lam, kC);
#pragma unroll
        for (int i = 0; i < W::NW / 2; ++i) wacc[i] *= carry;
      }
#endif
    } else {
      chunk::warp_mma<T, true, true>(acc, xs, ldX, m0, xs + kC * ldX, ldZ, n0, kC);
    }
    if (!more || next.chunk == 0) {  // the last chunk of (b, h) or of the run
      write(cur.bh(a));
      zero();
    }
    if (more) {
      if (!Wg) store_item(next, buf ^ 1);
      __syncthreads();
      cur = next;
      next.step(a);
      if (w + 2 < end) fetch_item(next);  // in flight during the next product
      buf ^= 1;
    }
  }
}

// state (BH, n) = the partial states of (b, h), summed in the order of the runs.
__global__ void sum_partials(const float* __restrict__ partial, float* __restrict__ state, int64_t per, int64_t nC,
                             int64_t n, int64_t count) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t bh = i / n, j = i % n;
  const int64_t first = bh * nC / per, last = ((bh + 1) * nC - 1) / per;
  float s = 0.0f;
  for (int64_t run = first; run <= last; ++run) s += partial[(run + bh) * n + j];
  state[i] = s;
}

template <class T, int DP, int PP, int EP, bool Grad>
void launch_reduce(const Args& a, int64_t BH, float* state, cudaStream_t st, Device dev) {
  const int64_t total = BH * a.nC, n = int64_t(a.P) * a.E;
  if (total == 0) {  // no tokens: a zero state
    LT_CUDA_CHECK(cudaMemsetAsync(state, 0, size_t(BH * n) * sizeof(float), st));
    return;
  }
  const bool wg = cuda::wgmma_runs(dev.index);
  auto kernel = wg ? reduce_kernel<T, DP, PP, EP, Grad, true> : reduce_kernel<T, DP, PP, EP, Grad, false>;
  const size_t smem =
      wg ? reduce_smem_bytes<DP, PP, EP, true>(sizeof(T)) : reduce_smem_bytes<DP, PP, EP, false>(sizeof(T));
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kReduceThreads, smem));
  const Partition part =
      partition(total, int64_t(std::max(per_sm, 1)) * cuda::sm_count(dev.index), kMinReduceChunks);
  Tensor partial = empty({part.blocks + BH, n}, DType::F32, dev);
  kernel<<<unsigned(part.blocks), kReduceThreads, smem, st>>>(a, partial.data_ptr<float>(), part.per, total,
                                                             model_acts_of(a));
  LT_CUDA_CHECK_LAUNCH();
  const int64_t count = BH * n;
  sum_partials<<<unsigned((count + 255) / 256), 256, 0, st>>>(partial.data_ptr<float>(), state, part.per, a.nC, n,
                                                              count);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int DP, int PP, int EP>
void launch_pieces(const Args& a, int64_t cuts, int64_t runs, int64_t run_chunks, float* partial, cudaStream_t st) {
  auto kernel = reduce_kernel<T, DP, PP, EP, false, true, true>;
  const size_t smem = reduce_smem_bytes<DP, PP, EP, true>(sizeof(T));
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(cuts * runs), kReduceThreads, smem, st>>>(a, partial, run_chunks, runs, model_acts_of(a));
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int DP, int PP, bool Grad>
void reduce_e(const Args& a, int64_t BH, float* state, cudaStream_t st, Device dev) {
  if (a.E > 64)
    launch_reduce<T, DP, PP, 128, Grad>(a, BH, state, st, dev);
  else
    launch_reduce<T, DP, PP, 64, Grad>(a, BH, state, st, dev);
}

template <class T, bool Grad>
void reduce_t(const Args& a, int64_t BH, float* state, cudaStream_t st, Device dev) {
  const bool cosine = a.lrpe == FalStepSpec::kCosine;
  if (a.D == 128)
    cosine ? reduce_e<T, 128, 256, Grad>(a, BH, state, st, dev) : reduce_e<T, 128, 128, Grad>(a, BH, state, st, dev);
  else
    cosine ? reduce_e<T, 64, 128, Grad>(a, BH, state, st, dev) : reduce_e<T, 64, 64, Grad>(a, BH, state, st, dev);
}

}  // namespace

void reduce_pieces(const Args& a, DType dtype, int64_t cuts, int64_t runs, int64_t run_chunks, float* partial,
                   cudaStream_t st) {
  chunk::for_wgmma_shape(a, [&](auto shape) {
    using S = decltype(shape);
    if (dtype == DType::BF16)
      launch_pieces<__nv_bfloat16, S::kDP, S::kPP, S::kEP>(a, cuts, runs, run_chunks, partial, st);
    else
      launch_pieces<__half, S::kDP, S::kPP, S::kEP>(a, cuts, runs, run_chunks, partial, st);
  });
}

void reduce(const Args& a, bool grad, DType dtype, int64_t BH, float* state, cudaStream_t st, Device dev) {
  if (dtype == DType::BF16)
    grad ? reduce_t<__nv_bfloat16, true>(a, BH, state, st, dev) : reduce_t<__nv_bfloat16, false>(a, BH, state, st, dev);
  else
    grad ? reduce_t<__half, true>(a, BH, state, st, dev) : reduce_t<__half, false>(a, BH, state, st, dev);
}

}  // namespace noncausal

namespace {

// ---------------------------------------------------------------------------------------------------
// The sweep (f32 and the calls the chunk kernels do not take).

constexpr int64_t kRowTokens = 256;      // query or key tokens per block of a row pass
constexpr int64_t kMinSliceTokens = 64;  // the fewest tokens per slice of a reduction
constexpr int64_t kTargetBlocks = 264;   // two blocks per SM on an H100/H200

// sum over the slices: out (BH, n) = sum_s part (BH, slices, n), in slice order.
__global__ void sum_slices(const float* __restrict__ part, float* __restrict__ out, int64_t slices, int64_t n,
                           int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t bh = i / n, j = i % n;
  const float* src = part + bh * slices * n + j;
  float s = 0;
  for (int64_t r = 0; r < slices; ++r) s += src[r * n];
  out[i] = s;
}

// dst (BH, P, E) = sum over tokens of the pass's rows, split into slices of the sequence.
void sweep_reduce(SweepArgs a, int pass, int64_t tokens, int64_t BH, const Tensor& dst, DType dtype, cudaStream_t st,
                  Device dev) {
  const int64_t max_slices = std::max<int64_t>(1, (tokens + kMinSliceTokens - 1) / kMinSliceTokens);
  const int64_t slices = std::min(max_slices, std::max<int64_t>(1, (kTargetBlocks + BH - 1) / BH));
  a.pass = pass;
  a.causal = false;
  a.tokens_per_block = (tokens + slices - 1) / slices;
  const int64_t n = int64_t(a.P) * a.E;
  if (slices == 1) {
    a.state_out = dst.data_ptr<float>();
    launch_sweep(a, dtype, dim3(unsigned(BH), 1), st, "fal");
    return;
  }
  Tensor part = empty({BH, slices, a.P, a.E}, DType::F32, dev);
  a.state_out = part.data_ptr<float>();
  launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(slices)), st, "fal");
  const int64_t total = BH * n;
  sum_slices<<<unsigned((total + 255) / 256), 256, 0, st>>>(part.data_ptr<float>(), dst.data_ptr<float>(), slices,
                                                            n, total);
  LT_CUDA_CHECK_LAUNCH();
}

void sweep_rows(SweepArgs a, int pass, int64_t tokens, int64_t BH, DType dtype, cudaStream_t st) {
  a.pass = pass;
  a.causal = false;
  a.tokens_per_block = kRowTokens;
  const int64_t blocks = (tokens + kRowTokens - 1) / kRowTokens;
  if (blocks > 0) launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(blocks)), st, "fal");
}


}  // namespace

bool sequence_supported(int64_t D, int64_t P, int64_t E) {
  return D <= kMaxHeadDim && E <= kMaxHeadDim && sweep_smem_floats(D, P, E) * sizeof(float) <= kMaxSharedBytes;
}

bool noncausal_chunked(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec) {
  if (dtype != DType::BF16 && dtype != DType::F16) return false;
  if (spec.lrpe == FalStepSpec::kRotate || (D != 64 && D != 128) || E % 8 != 0 || E > 128 || E == 0) return false;
  return spec.act_v != FalStepSpec::kSoftmaxFeature && spec.act_g != FalStepSpec::kSoftmaxFeature;
}

void noncausal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                       const Tensor& kv, const Tensor& out) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0 || v.size(3) == 0) return;
  const Device dev = q.device();
  cudaStream_t st = cuda::stream(dev.index);
  if (noncausal_chunked(q.dtype(), q.size(3), v.size(3), spec)) {
    const Tensor qr = chunk_input(q), kr = chunk_input(k), vr = chunk_input(v), gr = chunk_input(g);
    chunk::Args a = chunk_args(qr, kr, vr, gr, spec);
    a.out = out.data();
    noncausal::reduce(over_tokens(a, k.size(1)), false, q.dtype(), BH, kv.data_ptr<float>(), st, dev);
    noncausal::rows(over_tokens(a, q.size(1)), noncausal::kOut, q.dtype(), BH, kv.data_ptr<float>(), st, dev);
    return;
  }
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  SweepArgs a = sweep_args(qc, kc, vc, gc, spec);
  sweep_reduce(a, kReduceKV, k.size(1), BH, kv, q.dtype(), st, dev);
  a.state_in = kv.data_ptr<float>();
  a.out = out.data();
  sweep_rows(a, kForward, q.size(1), BH, q.dtype(), st);
}

void noncausal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                        const Tensor& kv, const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dg) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0) return;
  const Device dev = q.device();
  cudaStream_t st = cuda::stream(dev.index);
  Tensor dkv = empty(kv.shape(), DType::F32, dev);
  if (noncausal_chunked(q.dtype(), q.size(3), v.size(3), spec)) {
    const Tensor qr = chunk_input(q), kr = chunk_input(k), vr = chunk_input(v), gr = chunk_input(g);
    chunk::Args a = chunk_args(qr, kr, vr, gr, spec);
    set_gradients(a, dout, dq, dk, dv, dg);
    const chunk::Args queries = over_tokens(a, q.size(1)), keys = over_tokens(a, k.size(1));
    noncausal::reduce(queries, true, q.dtype(), BH, dkv.data_ptr<float>(), st, dev);
    noncausal::rows(queries, noncausal::kQueryGrads, q.dtype(), BH, kv.data_ptr<float>(), st, dev);
    noncausal::rows(keys, noncausal::kKeyGrads, q.dtype(), BH, dkv.data_ptr<float>(), st, dev);
    return;
  }
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  SweepArgs a = sweep_args(qc, kc, vc, gc, spec);
  set_gradient_pointers(a, dout, dq, dk, dv, dg);
  sweep_reduce(a, kReduceDKV, q.size(1), BH, dkv, q.dtype(), st, dev);
  a.state_in = kv.data_ptr<float>();
  sweep_rows(a, kQueryGrad, q.size(1), BH, q.dtype(), st);
  a.state_in = dkv.data_ptr<float>();
  sweep_rows(a, kKeyGrad, k.size(1), BH, q.dtype(), st);
}

}  // namespace lintape::fal_cuda
