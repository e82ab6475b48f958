// TPA decode on tensor cores: one query token per sequence over a cache of factor rows, reading each
// row's (ak, bk, av, bv) once, never building k or v.
//
// A block (4 warps) takes one sequence b and one split of its cache: the split's tiles of 32 rows are
// split, split + S, split + 2 S, ... (S splits), so the blocks of a sequence stream one region of the
// cache together. Tiles go into shared memory by cp.async, up to four stages, one barrier per tile.
// Warps 2 r and 2 r + 1 take the 16 rows 16 r .. of each tile and split the heads between them (all E
// columns each; with H <= 16 they split the columns instead), so no warp waits for another within a
// tile. Per 16 rows and rank rk:
//   A. C (16 rows x 16 rq) = bk[., rk, :] bq^T                       tensor cores, f32; both warps
//   B. S^T (heads x 16 rows) = aq C^T, C split into a bf16 high and low part so that the product keeps
//      f32 accuracy; scores = ak[., h, rk] S^T summed over rk (ranks 1, H a multiple of 16: ak and av
//      by transposed ldmatrix)
//   C. online softmax per head in registers (a head's 16 rows sit on 4 neighbouring lanes, the scale
//      folded into the exponent), then acc (heads x E) = alpha acc + (p av) bv on tensor cores; acc is
//      rescaled only when a maximum moved, and 1 / R_v is applied at the end.
// The two row groups merge at the end. With several splits (flash-decoding) each block writes its
// unnormalised accumulator and (max, sum) per head; the last block of a sequence to finish (a counter
// per sequence, reset by that block) combines them, so a call is always one launch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>
#include "core/cuda.h"
#include "core/cuda_types.cuh"
#include "ops/tpa_cuda.h"
#include "ops/tpa_decode.cuh"
#include "ops/tpa_mma.cuh"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 128;     // 4 warps: 2 row groups x 2 halves of the heads (or of the columns)
constexpr int kRows = 32;         // cache rows per tile, 16 per row group
constexpr int kMaxStages = 4;     // tiles in shared memory
constexpr int kPad = 8;           // 16-bit elements of padding per shared row: conflict-free ldmatrix
constexpr int kMaxSplits = 64;
constexpr int kMaxDevices = 16;
constexpr int kTwoBlocksSmem = 112 * 1024;  // per block, for two blocks on an SM
constexpr int kMaxSmem = 200 * 1024;
constexpr float kLog2e = 1.4426950408889634f;

struct Geo {
  int H, Rq, Rk, Rv, D, E, splits, stages;
  int64_t ak_b, bk_b, av_b, bv_b;  // batch strides in elements
  float q_mix;                     // scale log2(e) / (R_q R_k): scores in base 2
  float inv_rv;
  int ak_stride, bk_stride, av_stride, bv_stride, bq_stride;  // shared row strides in elements
  // Shared memory in bytes: `stages` stages of (ak, bk, av, bv), then bq.
  int st_ak, st_bk, st_av, st_bv, stage, bq, total;
};

Geo make_geo(const DecodeArgs& a) {
  Geo g{};
  g.H = int(a.aq.size(2));
  g.Rq = int(a.aq.size(3));
  g.Rk = int(a.ak.size(3));
  g.Rv = int(a.av.size(3));
  g.D = int(a.bq.size(3));
  g.E = int(a.bv.size(3));
  g.ak_b = a.ak.strides()[0];
  g.bk_b = a.bk.strides()[0];
  g.av_b = a.av.strides()[0];
  g.bv_b = a.bv.strides()[0];
  g.q_mix = float(a.scale) * kLog2e / float(g.Rq * g.Rk);
  g.inv_rv = 1.f / float(g.Rv);
  g.ak_stride = g.H * g.Rk + kPad;
  g.av_stride = g.H * g.Rv + kPad;
  g.bq_stride = g.bk_stride = g.D + kPad;
  g.bv_stride = g.E + kPad;
  const int e2 = 2;  // bytes per element
  g.st_ak = 0;
  g.st_bk = g.st_ak + kRows * g.ak_stride * e2;
  g.st_av = g.st_bk + kRows * g.Rk * g.bk_stride * e2;
  g.st_bv = g.st_av + kRows * g.av_stride * e2;
  g.stage = g.st_bv + kRows * g.Rv * g.bv_stride * e2;
  // The merge of the row groups and the combine of the splits reuse the stages.
  const int reuse = std::max((4 * g.H + g.H * g.E) * 4, 2 * kMaxSplits * g.H * 4);
  auto total_for = [&](int stages) { return std::max(stages * g.stage + 16 * g.bq_stride * e2, reuse); };
  g.stages = kMaxStages;
  while (g.stages > 2 && total_for(g.stages) > (g.stages == kMaxStages ? kTwoBlocksSmem : kMaxSmem)) --g.stages;
  g.bq = g.stages * g.stage;
  g.total = total_for(g.stages);
  return g;
}

// Waits until at most n of this thread's cp.async groups are pending (n < kMaxStages).
__device__ __forceinline__ void cp_async_wait_n(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    default: cp_async_wait<2>(); break;
  }
}

// cp.async of a tile's rows: kRows * per_token rows of `width` elements, contiguous in global memory,
// `dst_stride` apart in shared memory; rows of tokens at or past `valid` are zero-filled. When the
// 16-byte chunks of a row divide the block, a thread keeps one column and steps over rows (no division
// per chunk); this is the case for the usual dims.
template <class T>
__device__ __forceinline__ void copy_rows(unsigned char* dst, const T* src, int width, int dst_stride, int per_token,
                                          int valid) {
  const int chunks = width / 8;
  const int rows = kRows * per_token;
  if (kThreads % chunks == 0) {
    const int ch = threadIdx.x % chunks, step = kThreads / chunks;
    for (int row = threadIdx.x / chunks; row < rows; row += step) {
      const bool ok = (per_token == 1 ? row : row / per_token) < valid;
      cp_async16(dst + (row * dst_stride + ch * 8) * int(sizeof(T)),
                 ok ? src + int64_t(row) * width + ch * 8 : src, ok);
    }
    return;
  }
  for (int i = threadIdx.x; i < rows * chunks; i += kThreads) {
    const int row = i / chunks, ch = i - row * chunks;
    const bool ok = row / per_token < valid;
    cp_async16(dst + (row * dst_stride + ch * 8) * int(sizeof(T)), ok ? src + int64_t(row) * width + ch * 8 : src,
               ok);
  }
}

template <class T>
__device__ __forceinline__ uint32_t pack_bits(T lo, T hi) {
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return uint32_t(l) | (uint32_t(h) << 16);
}

// x as a bf16 pair (hi, lo) with hi + lo = x to about 16 bits.
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat16 h0 = __float2bfloat16(x0), h1 = __float2bfloat16(x1);
  hi = pack_bits(h0, h1);
  lo = pack_bits(__float2bfloat16(x0 - __bfloat162float(h0)), __float2bfloat16(x1 - __bfloat162float(h1)));
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x, 0 for -inf
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A packed pair of 16-bit values as two floats (the low half first).
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  __half2 h;
  memcpy(&h, &v, 4);
  return __half22float2(h);
}

// MTW m-tiles of 16 heads and NTW n-tiles of 8 output columns per warp. With H > 16 the two warps of
// a row group split the heads (each all E columns), else the columns (each all heads).
template <class T, int MTW, int NTW>
__global__ void __launch_bounds__(kThreads) decode_tc(const T* __restrict__ aq, const T* __restrict__ bq,
                                                      const T* __restrict__ ak, const T* __restrict__ bk,
                                                      const T* __restrict__ av, const T* __restrict__ bv,
                                                      const DecodeLengths lengths, T* __restrict__ out,
                                                      float* __restrict__ part_acc, float* __restrict__ part_stat,
                                                      int* __restrict__ counters, const Geo g) {
  constexpr bool kF16 = std::is_same_v<T, __half>;  // aq needs a low bf16 part too
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = warp / 2, half = warp % 2;
  const int H = g.H, Rq = g.Rq, Rk = g.Rk, Rv = g.Rv, D = g.D, E = g.E;
  const bool head_split = H > 16;
  const int h0 = head_split ? half * 16 * MTW : 0, col0 = head_split ? 0 : half * NTW * 8;
  const bool rank1 = Rk == 1 && Rv == 1 && H % 16 == 0;  // ak, av by transposed ldmatrix
  const int gr = lane / 4, gc = 2 * (lane % 4);
  const int b = blockIdx.y, split = blockIdx.x, S = g.splits;
  const int len = lengths.get(b);
  const int seq_tiles = (len + kRows - 1) / kRows;
  const int tiles = split < seq_tiles ? (seq_tiles - split + S - 1) / S : 0;

  T* bq_s = reinterpret_cast<T*>(smem + g.bq);
  const T* akb = ak + int64_t(b) * g.ak_b;
  const T* bkb = bk + int64_t(b) * g.bk_b;
  const T* avb = av + int64_t(b) * g.av_b;
  const T* bvb = bv + int64_t(b) * g.bv_b;

  auto load_tile = [&](int i) {  // the block's i-th tile
    unsigned char* st = smem + (i % g.stages) * g.stage;
    const int r0 = (split + i * S) * kRows, valid = min(kRows, len - r0);
    copy_rows(st + g.st_ak, akb + int64_t(r0) * H * Rk, H * Rk, g.ak_stride, 1, valid);
    copy_rows(st + g.st_bk, bkb + int64_t(r0) * Rk * D, D, g.bk_stride, Rk, valid);
    copy_rows(st + g.st_av, avb + int64_t(r0) * H * Rv, H * Rv, g.av_stride, 1, valid);
    copy_rows(st + g.st_bv, bvb + int64_t(r0) * Rv * E, E, g.bv_stride, Rv, valid);
  };
  // bq (rows past R_q zeroed) joins the first tile's group.
  for (int i = tid; i < 16 * (D / 8); i += kThreads) {
    const int r = i / (D / 8), ch = i - r * (D / 8);
    cp_async16(bq_s + r * g.bq_stride + ch * 8, bq + (int64_t(b) * Rq + min(r, Rq - 1)) * D + ch * 8, r < Rq);
  }
  for (int i = 0; i < g.stages - 1; ++i) {
    if (i < tiles) load_tile(i);
    cp_async_commit();
  }

  // aq as the A operand of phase B (rows = this warp's heads, columns = rq) in bf16, with the sign of
  // the score scale folded in so that the scale applied later (q_mix) is positive.
  const float sign = g.q_mix < 0.f ? -1.f : 1.f, q_mix = fabsf(g.q_mix);
  uint32_t aq_hi[MTW][4], aq_lo[MTW][4];
#pragma unroll
  for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int h = h0 + mw * 16 + gr + (j % 2) * 8, r = gc + (j / 2) * 8;
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e)
        x[e] = h < H && r + e < Rq ? sign * to_acc(aq[(int64_t(b) * H + h) * Rq + r + e]) : 0.f;
      split_bf16(x[0], x[1], aq_hi[mw][j], aq_lo[mw][j]);
    }

  // Per lane: heads h0 + 16 mw + gr + 8 hh, rows 8 nt + gc + e of the group's 16 (scores), output
  // columns col0 + 8 nt + gc + e (acc). m_run is in scaled units (base 2), the scores s are not.
  float acc[MTW][NTW][4];
#pragma unroll
  for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mw][nt][j] = 0.f;
  float m_run[MTW][2], l_run[MTW][2];
#pragma unroll
  for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      m_run[mw][hh] = -INFINITY;
      l_run[mw][hh] = 0.f;
    }
  const int ksteps = D / 16;
  // ldmatrix row addresses (in elements from the group's first row): bk rows for A, bq for B, and
  // for the rank-1 mixing factors (rows = cache rows, columns = heads) transposed 16 x 16 blocks.
  const int a_row = (lane % 16) * Rk, a_col = (lane / 16) * 8;
  const T* brow = bq_s + ((lane / 16) * 8 + lane % 8) * g.bq_stride + ((lane / 8) % 2) * 8;
  const int t_row = (lane / 16) * 8 + lane % 8, t_col = h0 + ((lane / 8) % 2) * 8;
  const int v_row = lane % 8 + ((lane / 8) % 2) * 8, v_col = col0 + (lane / 16) * 8;

  for (int i = 0; i < tiles; ++i) {
    cp_async_wait_n(g.stages - 2);
    __syncthreads();
    if (i + g.stages - 1 < tiles) load_tile(i + g.stages - 1);
    cp_async_commit();
    const int valid = min(kRows, len - (split + i * S) * kRows) - group * 16;  // rows of this group
    if (valid <= 0) continue;
    const unsigned char* st = smem + (i % g.stages) * g.stage;
    const T* ak_s = reinterpret_cast<const T*>(st + g.st_ak) + group * 16 * g.ak_stride;
    const T* bk_s = reinterpret_cast<const T*>(st + g.st_bk) + group * 16 * Rk * g.bk_stride;
    const T* av_s = reinterpret_cast<const T*>(st + g.st_av) + group * 16 * g.av_stride;
    const T* bv_s = reinterpret_cast<const T*>(st + g.st_bv) + group * 16 * Rv * g.bv_stride;

    float s[MTW][2][4];
#pragma unroll
    for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[mw][nt][j] = 0.f;
    for (int rk = 0; rk < Rk; ++rk) {
      // A. C = bk bq^T; even and odd k-steps in separate accumulators (two short chains).
      float c[2][2][4] = {};
      const T* arow = bk_s + (a_row + rk) * g.bk_stride + a_col;
      for (int k = 0; k < ksteps; k += 2) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          if (p == 1 && k + 1 >= ksteps) break;
          uint32_t a[4], bb[4];
          ldmatrix_x4(a, arow + (k + p) * 16);
          ldmatrix_x4(bb, brow + (k + p) * 16);
          mma16816<T>(c[p][0], a, bb[0], bb[1]);
          mma16816<T>(c[p][1], a, bb[2], bb[3]);
        }
      }
      // B. S^T = aq C^T: C's accumulator layout is already the B operand (k = rq, n = row).
      uint32_t hi[2][2], lo[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 2; ++q)
          split_bf16(c[0][q][2 * nt] + c[1][q][2 * nt], c[0][q][2 * nt + 1] + c[1][q][2 * nt + 1], hi[nt][q],
                     lo[nt][q]);
#pragma unroll
      for (int mw = 0; mw < MTW; ++mw) {
        uint32_t akf[4] = {};  // rank 1: ak^T (heads x rows) in the accumulator's layout, register 2 nt + hh
        if (rank1) ldmatrix_x4_trans(akf, ak_s + t_row * g.ak_stride + t_col + mw * 16);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float sr[4] = {};
          mma16816<__nv_bfloat16>(sr, aq_hi[mw], hi[nt][0], hi[nt][1]);
          mma16816<__nv_bfloat16>(sr, aq_hi[mw], lo[nt][0], lo[nt][1]);
          if constexpr (kF16) mma16816<__nv_bfloat16>(sr, aq_lo[mw], hi[nt][0], hi[nt][1]);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            float2 a_k;
            if (rank1) {
              a_k = unpack2<T>(akf[2 * nt + hh]);
            } else {
              const int h = min(h0 + mw * 16 + gr + hh * 8, H - 1), m = nt * 8 + gc;
              a_k = make_float2(to_acc(ak_s[m * g.ak_stride + h * Rk + rk]),
                                to_acc(ak_s[(m + 1) * g.ak_stride + h * Rk + rk]));
            }
            s[mw][nt][hh * 2] += a_k.x * sr[hh * 2];
            s[mw][nt][hh * 2 + 1] += a_k.y * sr[hh * 2 + 1];
          }
        }
      }
    }

    // C. Online softmax per head over the group's rows (4 lanes of a head hold 4 rows each).
    if (valid < 16)
#pragma unroll
      for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (nt * 8 + gc + j % 2 >= valid) s[mw][nt][j] = -INFINITY;
    bool rescale = false;
    float alpha[MTW][2];
#pragma unroll
    for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = fmaxf(fmaxf(s[mw][0][hh * 2], s[mw][0][hh * 2 + 1]), fmaxf(s[mw][1][hh * 2], s[mw][1][hh * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mw][hh], mx * q_mix);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[mw][hh] = fast_exp2(m_run[mw][hh] - m_use);  // 0 before the first row
        rescale |= m_new != m_run[mw][hh];
        m_run[mw][hh] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[mw][nt][hh * 2 + e];
            v = fast_exp2(fmaf(v, q_mix, -m_use));
            sum += v;
          }
        l_run[mw][hh] = l_run[mw][hh] * alpha[mw][hh] + sum;  // this lane's rows; the quad is summed at the end
      }
    if (__any_sync(0xffffffffu, rescale))
#pragma unroll
      for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[mw][nt][j] *= alpha[mw][j / 2];
    for (int rv = 0; rv < Rv; ++rv) {
      // W = p av as the A operand (rows = heads, k = the group's 16 rows): register j = 2 nt + hh.
#pragma unroll
      for (int mw = 0; mw < MTW; ++mw) {
        uint32_t avf[4] = {}, w[4];
        if (rank1) ldmatrix_x4_trans(avf, av_s + t_row * g.av_stride + t_col + mw * 16);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int nt = j / 2, hh = j % 2;
          float2 a_v;
          if (rank1) {
            a_v = unpack2<T>(avf[j]);
          } else {
            const int h = min(h0 + mw * 16 + gr + hh * 8, H - 1), m = nt * 8 + gc;
            a_v = make_float2(to_acc(av_s[m * g.av_stride + h * Rv + rv]),
                              to_acc(av_s[(m + 1) * g.av_stride + h * Rv + rv]));
          }
          w[j] = pack2<T>(s[mw][nt][hh * 2] * a_v.x, s[mw][nt][hh * 2 + 1] * a_v.y);
        }
#pragma unroll
        for (int np = 0; np < NTW / 2; ++np) {
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, bv_s + (v_row * Rv + rv) * g.bv_stride + v_col + np * 16);
          mma16816<T>(acc[mw][2 * np], w, bb[0], bb[1]);
          mma16816<T>(acc[mw][2 * np + 1], w, bb[2], bb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Merge the two row groups: group 1 hands its (max, sum) and rescaled accumulator to group 0.
#pragma unroll
  for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l_run[mw][hh] += __shfl_xor_sync(0xffffffffu, l_run[mw][hh], 1);
      l_run[mw][hh] += __shfl_xor_sync(0xffffffffu, l_run[mw][hh], 2);
    }
  __syncthreads();  // every warp is done with the stages
  float* mrg_m = reinterpret_cast<float*>(smem);  // [2][H]
  float* mrg_l = mrg_m + 2 * H;                   // [2][H]
  float* mrg_acc = mrg_l + 2 * H;                 // [H][E]
  const bool owns_stats = (head_split || half == 0) && gc == 0;  // one lane per (group, head)
  if (owns_stats)
#pragma unroll
    for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int h = h0 + mw * 16 + gr + hh * 8;
        if (h < H) {
          mrg_m[group * H + h] = m_run[mw][hh];
          mrg_l[group * H + h] = l_run[mw][hh];
        }
      }
  __syncthreads();
  float m_fin[MTW][2], l_fin[MTW][2];
#pragma unroll
  for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = min(h0 + mw * 16 + gr + hh * 8, H - 1);
      const float m0 = mrg_m[h], m1 = mrg_m[H + h];
      const float m = fmaxf(m0, m1), m_use = m == -INFINITY ? 0.f : m;
      const float own = fast_exp2(m_run[mw][hh] - m_use) * g.inv_rv;  // the 1 / R_v of W too
      m_fin[mw][hh] = m;
      l_fin[mw][hh] = mrg_l[h] * fast_exp2(m0 - m_use) + mrg_l[H + h] * fast_exp2(m1 - m_use);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        acc[mw][nt][hh * 2] *= own;
        acc[mw][nt][hh * 2 + 1] *= own;
      }
    }
  if (group == 1)
#pragma unroll
    for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int h = h0 + mw * 16 + gr + hh * 8;
        if (h < H)
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt)
            *reinterpret_cast<float2*>(mrg_acc + h * E + col0 + nt * 8 + gc) =
                make_float2(acc[mw][nt][hh * 2], acc[mw][nt][hh * 2 + 1]);
      }
  __syncthreads();
  if (group == 0)
#pragma unroll
    for (int mw = 0; mw < MTW; ++mw)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int h = h0 + mw * 16 + gr + hh * 8;
        if (h >= H) continue;
        const float inv = 1.f / l_fin[mw][hh];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          const float2 o = *reinterpret_cast<const float2*>(mrg_acc + h * E + col0 + nt * 8 + gc);
          const float x0 = acc[mw][nt][hh * 2] + o.x, x1 = acc[mw][nt][hh * 2 + 1] + o.y;
          if (S == 1)
            *reinterpret_cast<uint32_t*>(out + (int64_t(b) * H + h) * E + col0 + nt * 8 + gc) =
                pack2<T>(x0 * inv, x1 * inv);
          else
            *reinterpret_cast<float2*>(part_acc + ((int64_t(b) * S + split) * H + h) * E + col0 + nt * 8 + gc) =
                make_float2(x0, x1);
        }
        if (S > 1 && owns_stats) {
          const int64_t slot = (int64_t(b) * S + split) * H + h;
          part_stat[slot * 2] = m_fin[mw][hh];  // -inf for a split past the sequence's length
          part_stat[slot * 2 + 1] = l_fin[mw][hh];
        }
      }
  if (S == 1) return;

  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(counters + b, 1) == S - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // The combine: weight of split s for head h = 2^(m_s - m) / sum_s' l_s' 2^(m_s' - m).
  float* wm = reinterpret_cast<float*>(smem);
  float* wl = wm + S * H;
  const float* stat = part_stat + int64_t(b) * S * H * 2;
  for (int j = tid; j < S * H; j += kThreads) {
    wm[j] = __ldcg(stat + 2 * j);
    wl[j] = __ldcg(stat + 2 * j + 1);
  }
  __syncthreads();
  // Four lanes per head, each over every fourth split.
  for (int h0c = 0; h0c < H; h0c += kThreads / 4) {
    const int h = h0c + tid / 4, part = tid % 4;
    const bool active = h < H;
    float mx = -INFINITY;
    if (active)
      for (int s = part; s < S; s += 4) mx = fmaxf(mx, wm[s * H + h]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float den = 0.f;
    if (active)
      for (int s = part; s < S; s += 4) {
        const float ms = wm[s * H + h];
        const float w = ms == -INFINITY ? 0.f : fast_exp2(ms - mx);
        wm[s * H + h] = w;
        den += w * wl[s * H + h];
      }
    den += __shfl_xor_sync(0xffffffffu, den, 1);
    den += __shfl_xor_sync(0xffffffffu, den, 2);
    const float inv = 1.f / den;
    if (active)
      for (int s = part; s < S; s += 4) wm[s * H + h] *= inv;
  }
  __syncthreads();
  // Eight quads per thread at once, four splits unrolled: many L2 reads in flight.
  constexpr int kQuads = 8;
  const int quads = H * E / 4;
  const float4* pa = reinterpret_cast<const float4*>(part_acc + int64_t(b) * S * H * E);
  for (int i0 = tid; i0 < quads; i0 += kQuads * kThreads) {
    float4 o[kQuads];
#pragma unroll
    for (int q = 0; q < kQuads; ++q) o[q] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < S; ++s)
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int i = i0 + q * kThreads;
        if (i < quads) {
          const float w = wm[s * H + i * 4 / E];
          const float4 v = __ldcg(pa + int64_t(s) * quads + i);
          o[q].x += w * v.x;
          o[q].y += w * v.y;
          o[q].z += w * v.z;
          o[q].w += w * v.w;
        }
      }
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
      const int i = i0 + q * kThreads;
      if (i < quads)
        *reinterpret_cast<uint2*>(out + int64_t(b) * H * E + i * 4) =
            make_uint2(pack2<T>(o[q].x, o[q].y), pack2<T>(o[q].z, o[q].w));
    }
  }
  if (tid == 0) counters[b] = 0;  // ready for the next call
}

// Splits from a cost model in microseconds. A block streams its tiles at its SM's share of the copy
// bandwidth, or at the compute time of a tile when that is longer; with several splits the last block
// of a sequence reads every split's partial sums from L2 (~100 GB/s for one SM), plus a fixed wait.
int choose_splits(int64_t B, int64_t M, int sms, const Geo& g) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  const double row_bytes = 2.0 * (g.H * (g.Rk + g.Rv) + g.Rk * g.D + g.Rv * g.E);
  const double tile_us = kRows * row_bytes / (3.0e6 / sms);  // bytes / (bytes per us per SM)
  const double compute_us = 1.2;  // a block's tile when it is alone on its SM
  const double split_us = double(g.H) * g.E * 4 / 1.0e5;
  const int per_sm_max = g.total <= kTwoBlocksSmem ? 2 : 1;
  const int most = int(std::min<int64_t>(tiles, kMaxSplits));
  std::vector<double> cost(size_t(most) + 1);
  double best = 1e300;
  for (int s = 1; s <= most; ++s) {
    const int64_t blocks = B * s;
    const int64_t per_sm = std::min<int64_t>((blocks + sms - 1) / sms, per_sm_max);
    const int64_t waves = (blocks + int64_t(sms) * per_sm_max - 1) / (int64_t(sms) * per_sm_max);
    const double per_tile = std::max(compute_us, double(per_sm) * tile_us);
    cost[size_t(s)] = double(waves) * double((tiles + s - 1) / s) * per_tile + (s > 1 ? 1.0 + split_us * s : 0.0);
    best = std::min(best, cost[size_t(s)]);
  }
  for (int s = 1; s <= most; ++s)  // the fewest splits within 2% of the best: less partial memory
    if (cost[size_t(s)] <= 1.02 * best) return s;
  return most;
}

int sm_count(int device) {
  static int cached[kMaxDevices] = {};
  if (device < kMaxDevices && cached[device]) return cached[device];
  int n = 0;
  LT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < kMaxDevices) cached[device] = n;
  return n;
}

// Zeroed counters (one per sequence) that the last block of each sequence resets: kept for the life
// of the process, outside the tensor allocator (a few KiB), grown when a larger batch comes.
int* split_counters(int device, int64_t B) {
  static std::mutex mu;
  static int* ptr[kMaxDevices] = {};
  static int64_t cap[kMaxDevices] = {};
  LT_CHECK(device < kMaxDevices, "[tpa_decode] devices 0..", kMaxDevices - 1, " are supported; got ", device);
  std::lock_guard<std::mutex> lock(mu);
  if (cap[device] < B) {
    const int previous = current_device();
    set_device(device);
    if (ptr[device]) LT_CUDA_CHECK(cudaFree(ptr[device]));
    const int64_t n = std::max<int64_t>(B, 1024);
    LT_CUDA_CHECK(cudaMalloc(&ptr[device], size_t(n) * sizeof(int)));
    LT_CUDA_CHECK(cudaMemsetAsync(ptr[device], 0, size_t(n) * sizeof(int), stream(device)));
    cap[device] = n;
    set_device(previous);
  }
  return ptr[device];
}

template <class T, int MTW, int NTW>
void launch(const DecodeArgs& a, const Geo& g, const DecodeLengths& lengths, Tensor& out, float* pa, float* ps,
            int* counters, int device) {
  auto kernel = decode_tc<T, MTW, NTW>;
  static int allowed[kMaxDevices] = {};  // raised only when a call needs more, not on every launch
  if (allowed[device] < g.total) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, g.total));
    allowed[device] = g.total;
  }
  kernel<<<dim3(unsigned(g.splits), unsigned(a.aq.size(0))), kThreads, size_t(g.total), stream(device)>>>(
      static_cast<const T*>(a.aq.data()), static_cast<const T*>(a.bq.data()), static_cast<const T*>(a.ak.data()),
      static_cast<const T*>(a.bk.data()), static_cast<const T*>(a.av.data()), static_cast<const T*>(a.bv.data()),
      lengths, static_cast<T*>(out.data()), pa, ps, counters, g);
  LT_CUDA_CHECK_LAUNCH();
}

// With H > 16 a warp takes half of the heads' m-tiles and all E columns, else all heads and half of E.
template <class T>
void launch_for_shape(const DecodeArgs& a, const Geo& g, const DecodeLengths& lengths, Tensor& out, float* pa,
                      float* ps, int* counters, int device) {
  const bool wide = g.E == 128;
  if (g.H <= 16) wide ? launch<T, 1, 8>(a, g, lengths, out, pa, ps, counters, device)
                      : launch<T, 1, 4>(a, g, lengths, out, pa, ps, counters, device);
  else if (g.H <= 32) wide ? launch<T, 1, 16>(a, g, lengths, out, pa, ps, counters, device)
                           : launch<T, 1, 8>(a, g, lengths, out, pa, ps, counters, device);
  else wide ? launch<T, 2, 16>(a, g, lengths, out, pa, ps, counters, device)
            : launch<T, 2, 8>(a, g, lengths, out, pa, ps, counters, device);
}

}  // namespace

bool decode_uses_tensor_cores(const DecodeArgs& a) {
  if (!a.allow_tensor_cores) return false;
  const DType dt = a.aq.dtype();
  if (dt != DType::BF16 && dt != DType::F16) return false;
  const int64_t H = a.aq.size(2), Rq = a.aq.size(3), Rk = a.ak.size(3), Rv = a.av.size(3), D = a.bq.size(3),
                E = a.bv.size(3);
  if (Rq > 16 || Rk > 4 || Rv > 4 || H > 64 || D % 16 != 0 || D > 256 || (E != 64 && E != 128)) return false;
  if ((H * Rk) % 8 != 0 || (H * Rv) % 8 != 0) return false;
  if (reinterpret_cast<uintptr_t>(a.bq.data()) % 16 != 0) return false;
  for (const Tensor* t : {&a.ak, &a.bk, &a.av, &a.bv})
    if (t->strides()[0] % 8 != 0 || reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return make_geo(a).total <= kMaxSmem;
}

void decode_tensor_cores(const DecodeArgs& a, Tensor& out) {
  const Device dev = a.aq.device();
  const int64_t B = a.aq.size(0), M = a.ak.size(1);
  Geo g = make_geo(a);
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t splits = a.split_rows > 0 ? (M + a.split_rows - 1) / a.split_rows
                                          : int64_t(choose_splits(B, M, sm_count(dev.index), g));
  g.splits = int(std::clamp<int64_t>(splits, 1, std::min<int64_t>(tiles, kMaxSplits)));
  Tensor length_storage, partials;
  const DecodeLengths lengths = make_decode_lengths(a.lengths, dev, length_storage);
  float* pa = nullptr;
  float* ps = nullptr;
  int* counters = nullptr;
  if (g.splits > 1) {  // one allocation: the accumulators (B, S, H, E), then (max, sum) (B, S, H, 2)
    partials = empty({B * g.splits * g.H * (g.E + 2)}, DType::F32, dev);
    pa = partials.data_ptr<float>();
    ps = pa + B * g.splits * g.H * g.E;
    counters = split_counters(dev.index, B);
  }
  if (a.aq.dtype() == DType::BF16)
    launch_for_shape<__nv_bfloat16>(a, g, lengths, out, pa, ps, counters, dev.index);
  else
    launch_for_shape<__half>(a, g, lengths, out, pa, ps, counters, dev.index);
}

}  // namespace lintape::tpa_cuda
