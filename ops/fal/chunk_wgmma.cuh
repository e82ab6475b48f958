// Internal to the FAL family: what the chunk kernels on Hopper's warpgroup products share (the state pass walks
// of ops/fal/chunk_state.cu, the forward of ops/fal/chunk_fwd_hopper.cu, the gradient kernel of
// ops/fal/chunk_bwd_hopper.cu, the noncausal row passes of ops/fal/noncausal_rows_hopper.cu): the split of a
// D' x E f32 state over four warpgroups, its shared tile, the tensor maps of the saved states and of the
// inputs' rows, the staging of a chunk's raw rows in shared memory (by cp.async where the tensor copy engine does
// not bring them) and their encode, the epilogues that read and write a thread's elements of an accumulator tile.
#pragma once
#include "core/cuda_tma.cuh"
#include "ops/fal/noncausal.cuh"

namespace lintape::fal_cuda::chunk {

// A wgmma descriptor (core/cuda_wgmma.cuh) moved by `bytes` (a multiple of 16) within shared memory: its start
// address field.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) { return desc + uint64_t(bytes >> 4); }

// The 4 warpgroups over the PP x EP state: WGM along P (64 rows each) by WGN along E (NW columns each).
template <int PP, int EP>
struct StateWarps {
  static constexpr int WGM = PP / 64, WGN = 4 / WGM, NW = EP / WGN;
  static_assert(WGM * WGN == 4 && NW % 16 == 0, "whole warpgroup tiles");
};

// The state in T in shared memory (S_c or R_(c+1)): PP rows by EP columns, EP / 8 blocks of PP rows of 16 bytes
// (wgmma's MN-major layout along E, so that the forward's Y = Q S_c reads it). Pad: elements after each block;
// 8 (16 bytes) where threads copy the tile in 16-byte pieces a row (their accesses then fall on distinct banks),
// none where the tensor copy engine moves it (state_tensor_map: one box a tile).
template <int PP, int EP, int Pad = 8>
struct StateTile {
  static constexpr int kBlock = PP * 8 + Pad, kElems = EP / 8 * kBlock;
};

// The tensor copy engine's view of saved states (`slots` states of P x E in 2-byte elements, row-major, E a
// multiple of 8) as unpadded StateTile blocks: dims (8, P, E / 8, slots), a box of `rows` rows of EP / 8 blocks at
// one slot; blocks past E read as zeros. A zeroed map where there is nothing to read. Host code.
CUtensorMap state_tensor_map(const void* states, const Args& a, int64_t slots, int rows, int EP);
// The same for the rows of one input, read in place as at_head reads it (q, k: D columns a head; v, g, dO: E):
// dims (columns, N, H, B), a box of kC rows of W columns, which lands as stage_raw stages them (rows past N and
// columns past the head's read as zeros). BH = B x H.
enum class RowInput { Q, K, V, G, DOut };
CUtensorMap row_tensor_map(const Args& a, int64_t BH, RowInput x, int W);
// A thread's state values (the accumulator layout of core/cuda_wgmma.cuh: value 4 j + r at row(r), column
// col(j) + r % 2) into the tile. A warp's stores fall on 32 distinct banks.
template <class T, int PP, int EP, int NW, int Pad = 8, class Row, class Col>
__device__ __forceinline__ void state_to_tile(T* tile, const float (&acc)[NW / 2], Row row, Col col) {
#pragma unroll
  for (int j = 0; j < NW / 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; r += 2)
      store2(tile + (col(j) >> 3) * StateTile<PP, EP, Pad>::kBlock + row(r) * 8 + (col(j) & 7), acc[4 * j + r],
             acc[4 * j + r + 1]);
}
// The tile's first E columns to dst (PP rows of E, E a multiple of 8) in 16-byte pieces, a fixed piece of
// every NThr / (EP / 8)-th row per thread. (This form kept the wgmma forward's state in its registers. The tensor
// copy engine's store of the tile, one box of 16-byte rows, made the forward 1.3x and the walks 1.2x slower:
// bench/notes/fal-hopper.md, session 18.)
template <class T, int PP, int EP, int NThr>
__device__ __forceinline__ void tile_to_memory(const T* tile, T* dst, int E) {
  constexpr int kPieces = EP / 8, kRowsPer = NThr / kPieces;  // 16-byte pieces a row; rows a pass
  const int e8 = (threadIdx.x % kPieces) * 8, p0 = threadIdx.x / kPieces;
  if (e8 < E) {
    T* d = dst + size_t(p0) * E + e8;
    const T* src = tile + (e8 >> 3) * StateTile<PP, EP>::kBlock + p0 * 8;
#pragma unroll 4
    for (int p = p0; p < PP; p += kRowsPer, d += kRowsPer * E, src += kRowsPer * 8)
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src);
  }
}

// Rows t0 ... t0 + kC - 1, columns [0, W) of x into stage ([kC][W]) through cp.async, zeros past the sequence
// or past cols. A thread copies the pieces that it reads back (Raw's: fetch's order), so a wait and no barrier
// lets it read them. tid: the thread's index among the NThr that share the work (its block's, by default).
template <class T, int W, int NThr>
__device__ __forceinline__ void stage_raw(const Args& a, const T* __restrict__ x, int64_t ts, int64_t t0, int cols,
                                          T* stage, int tid = int(threadIdx.x)) {
#pragma unroll
  for (int it = 0; it < Raw<W, NThr>::kIt; ++it) {
    const int idx = tid + it * NThr, i = idx / (W / 8), c = (idx % (W / 8)) * 8;
    if (t0 + i < a.N && c < cols)
      cp_async16(stage + i * W + c, x + (t0 + i) * ts + c);
    else
      *reinterpret_cast<uint4*>(stage + i * W + c) = make_uint4(0, 0, 0, 0);
  }
}
template <class T, int W, int NThr>
__device__ __forceinline__ uint4 staged(const T* stage, int it, int tid = int(threadIdx.x)) {
  const int idx = tid + it * NThr;
  return *reinterpret_cast<const uint4*>(stage + idx / (W / 8) * W + (idx % (W / 8)) * 8);
}

// The staged q and k rows t0 ... t0 + kC - 1 (stage_raw's pieces of this thread) through their acts and the LRPE
// into Q and K (CoreColumnTile), as noncausal::encode_rows does (elementwise acts: the chunk kernels take no
// softmax); with raw_k null, q's alone. A thread's pieces of q and k sit at the same positions and share the
// angles, computed afresh at its first row and turned to the next ones; each piece is read from shared memory
// where it is used, 4 columns at a time (the state holds most registers). Rows past a.N are zeros. act_q,
// act_k and cosine are a's, passed apart so that a caller with constants gets code without dispatch.
template <class T, int DP, int NThr>
__device__ __forceinline__ void encode_qk(const Args& a, const T* raw_q, const T* raw_k, const float* tab,
                                          int64_t t0, T* qt, T* kt, int act_q, int act_k, bool cosine,
                                          int tid = int(threadIdx.x)) {
  constexpr int kStep = NThr / (DP / 8);
  const int i0 = tid / (DP / 8);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int c8 = (tid % (DP / 8)) * 8, c4 = c8 + 4 * half;
    float c[4], s[4];
    if (cosine)
#pragma unroll
      for (int u = 0; u < 4; ++u) angle_cs(tab[c4 + u], a.position + t0 + i0, c[u], s[u]);
#pragma unroll
    for (int it = 0; it < Raw<DP, NThr>::kIt; ++it) {
      const int i = i0 + it * kStep;
      const bool live = t0 + i < a.N;
      if (cosine && it > 0)
#pragma unroll
        for (int u = 0; u < 4; ++u) noncausal::rotate(c[u], s[u], tab[DP + c4 + u], tab[2 * DP + c4 + u]);
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        if (which == 1 && !raw_k) break;
        float x[4];
        unpack_part<T, 4>(staged<T, DP, NThr>(which == 0 ? raw_q : raw_k, it, tid), 4 * half, x);
        act_n(x, which == 0 ? act_q : act_k, live);
        T* tile = which == 0 ? qt : kt;
        if (cosine) {
          float xs[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) xs[u] = x[u] * s[u];
          store_part<T, 4>(tile + CoreColumnTile{}(i, DP + c8) + 4 * half, xs);
#pragma unroll
          for (int u = 0; u < 4; ++u) x[u] *= c[u];
        }
        store_part<T, 4>(tile + CoreColumnTile{}(i, c8) + 4 * half, x);
      }
    }
  }
}

// This thread's pairs of x in the accumulator layout of an n-column warpgroup tile (core/cuda_wgmma.cuh): rows
// t_first and t_first + 8, columns col0 + 8 j + 2 (lane % 4) and the next, as loaded (two a word; zeros past the
// sequence or past cols).
template <class T, int NCOL>
__device__ __forceinline__ void load_pairs(const Args& a, const T* __restrict__ x, int64_t ts, int64_t t_first,
                                           int col0, int cols, uint32_t (&raw)[NCOL / 8][2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t t = t_first + 8 * r;
#pragma unroll
    for (int j = 0; j < NCOL / 8; ++j) {
      const int col = col0 + 8 * j + 2 * (lane & 3);
      raw[j][r] = t < a.N && col < cols ? *reinterpret_cast<const uint32_t*>(x + t * ts + col) : 0u;
    }
  }
}

// dst = act'(x) d for those elements, d = acc (o mul when given); x and mul from load_pairs.
template <class T, int NCOL>
__device__ __forceinline__ void store_act_grad(const Args& a, const float (&acc)[NCOL / 2],
                                               const uint32_t (&raw)[NCOL / 8][2], const uint32_t (*mul)[NCOL / 8][2],
                                               int act, T* dst, int64_t ts, int64_t t_first, int col0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t t = t_first + 8 * r;
#pragma unroll
    for (int j = 0; j < NCOL / 8; ++j) {
      const int col = col0 + 8 * j + 2 * (lane & 3);
      float x[2], d[2] = {acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]};
      load2(reinterpret_cast<const T*>(&raw[j][r]), x[0], x[1]);
      if (mul) {
        float m[2];
        load2(reinterpret_cast<const T*>(&(*mul)[j][r]), m[0], m[1]);
        d[0] *= m[0], d[1] *= m[1];
      }
      act_grad_n(x, d, act);
      if (t < a.N && col < a.E) store2(dst + t * ts + col, d[0], d[1]);
    }
  }
}

// The raw rows' gradient dst = act'(x) (cos d0 + sin d1) for those elements of DO raw columns from col0 (d0 alone
// without the LRPE): the transposed LRPE folds both halves of the encoded rows' gradient. The angles at the thread's first
// row are turned by 8 tokens (tab: noncausal::fill_angles) for its second.
template <class T, int DP, int DO, bool Two>
__device__ __forceinline__ void store_folded(const Args& a, const float (&d0)[DO / 2], const float (&d1)[DO / 2],
                                             const uint32_t (&raw)[DO / 8][2], const float* tab, int act, T* dst,
                                             int64_t ts, int64_t t_first, int col0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < DO / 8; ++j) {
    const int col = col0 + 8 * j + 2 * (lane & 3);
    float cs[2] = {1.0f, 1.0f}, sn[2] = {0.0f, 0.0f};
    if (Two)
#pragma unroll
      for (int u = 0; u < 2; ++u) angle_cs(tab[col + u], a.position + t_first, cs[u], sn[u]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (Two && r == 1)
#pragma unroll
        for (int u = 0; u < 2; ++u) noncausal::rotate(cs[u], sn[u], tab[3 * DP + col + u], tab[4 * DP + col + u]);
      float x[2], gx[2];
      load2(reinterpret_cast<const T*>(&raw[j][r]), x[0], x[1]);
#pragma unroll
      for (int u = 0; u < 2; ++u)
        gx[u] = Two ? cs[u] * d0[4 * j + 2 * r + u] + sn[u] * d1[4 * j + 2 * r + u] : d0[4 * j + 2 * r + u];
      act_grad_n(x, gx, act);
      const int64_t t = t_first + 8 * r;
      if (t < a.N) store2(dst + t * ts + col, gx[0], gx[1]);
    }
  }
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
