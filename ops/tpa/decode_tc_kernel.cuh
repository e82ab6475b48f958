// Internal to ops/tpa/decode_tc.cu: the tensor-core decode kernel (its head comment there describes the kernel
// and its schedules), its shared-memory geometry and its tile copies.
#pragma once
#include <cooperative_groups.h>
#include <algorithm>
#include <cmath>
#include <utility>
#include "core/cuda_acts.cuh"
#include "core/cuda_mma.cuh"
#include "core/cuda_types.cuh"
#include "ops/tpa/decode.cuh"

namespace lintape::tpa_cuda::decode_tc_kernel {
using namespace lintape::cuda;
using namespace lintape::cuda_device;
constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kPad = 8;  // 16-bit elements of padding per shared row: conflict-free ldmatrix
constexpr int kMaxSplits = 64;
constexpr int kMaxCluster = 8;  // the portable cluster size
constexpr int kMaxWhole = 16;   // the largest (non-portable) cluster: one a sequence, when the splits fit
constexpr int kGather = 8;      // partial results a thread loads at once in the gathering combine
constexpr int kMaxDevices = 16;
constexpr int kTwoBlocksBytes = 113 * 1024;  // shared memory that leaves room for two blocks per SM
constexpr int kMaxSharedBytes = 200 * 1024;
constexpr float kLog2e = 1.4426950408889634f;

struct Geo {
  int H, Rq, Rk, Rv, D, E;
  int chunks, rows;                // 16-row chunks a warp takes of each tile; rows a tile
  int stages, splits, split_rows;  // split_rows: cache rows a split
  int cluster;                     // blocks a cluster (cluster schedule; splits is a multiple of it), else 0
  bool gather;                     // cluster 9..16: the combines issue their loads of several slots together
  int64_t ak_b, bk_b, av_b, bv_b;  // batch strides in elements
  float q_mix;                     // scale log2(e) / (R_q R_k): scores in base 2
  float inv_rv;
  // Shared memory in bytes: `stages` stages of (ak, bk, av, bv), then bq; the merge of the row groups and
  // the combine of the splits reuse the stages.
  int st_ak, st_bk, st_av, st_bv, stage, bq, o_stride, res, total;  // res: a block's merged result
  int bq_stride, bk_stride, bv_stride;  // row strides in elements
};

int head_groups(int64_t H) { return H <= 16 ? 1 : H <= 32 ? 2 : 4; }

// heads: the slices of the heads a sequence's blocks are split into (each block's H is the slice's).
Geo make_geo(const DecodeArgs& a, int ch, int heads = 1) {
  Geo g{};
  fill_decode_dims(g, a);
  g.H /= heads;
  g.chunks = ch;
  g.rows = 16 * (kWarps / head_groups(g.H)) * ch;
  g.q_mix = float(a.scale) * kLog2e / float(g.Rq * g.Rk);
  g.inv_rv = 1.f / float(g.Rv);
  g.bq_stride = g.bk_stride = g.D + kPad;
  g.bv_stride = g.E + kPad;
  g.o_stride = g.E + 4;  // floats
  const int e2 = 2;      // bytes per element
  g.st_ak = 0;
  g.st_bk = g.st_ak + g.rows * g.H * g.Rk * e2;
  g.st_av = g.st_bk + g.rows * g.Rk * g.bk_stride * e2;
  g.st_bv = g.st_av + g.rows * g.H * g.Rv * e2;
  g.stage = g.st_bv + g.rows * g.Rv * g.bv_stride * e2;
  const int merge = kWarps * 16 * (g.o_stride + 2) * 4;  // each warp's acc, max and sum
  const int combine = 2 * kMaxSplits * g.H * 4;
  g.res = merge;                                 // after the row groups' values, which the merge reads
  const int result = merge + (g.H * g.E + 2 * g.H) * 4;
  auto total_for = [&](int stages) {
    return std::max({stages * g.stage + 16 * g.bq_stride * e2, merge, combine, result});
  };
  // The deepest pipeline that keeps two blocks per SM (two stages only with two chunks a warp, whose tiles
  // are twice as long), else the deepest that fits.
  for (int st : {4, 3, 2})
    if (!g.stages && (st >= 3 || ch == 2) && total_for(st) <= kTwoBlocksBytes) g.stages = st;
  for (int st : {4, 3, 2})
    if (!g.stages && total_for(st) <= kMaxSharedBytes) g.stages = st;
  if (!g.stages) g.stages = 2;  // too large: decode_uses_tensor_cores declines it
  g.bq = g.stages * g.stage;
  g.total = total_for(g.stages);
  return g;
}

// One array's share of a tile copy for this thread: rows of `width` elements, contiguous in global
// memory, `dst_stride` apart in shared memory. When the 16-byte chunks of a row divide the block (the
// usual dims), a thread keeps one column and steps over rows: worked out once, so a tile's copy does no
// division.
struct CopyPlan {
  int width, dst_stride, rows, chunks, ch, first, step;
  bool fast;
};

__device__ __forceinline__ CopyPlan copy_plan(int width, int dst_stride, int rows) {
  CopyPlan p{width, dst_stride, rows, width / 8, 0, 0, 0, false};
  p.fast = kThreads % p.chunks == 0;
  if (p.fast) {
    p.ch = int(threadIdx.x) % p.chunks;
    p.first = int(threadIdx.x) / p.chunks;
    p.step = kThreads / p.chunks;
  }
  return p;
}

// cp.async of a tile's rows; rows at or past `valid_rows` are zero-filled. The loops stay rolled: unrolled, they
// made the kernel 7800 instructions instead of 5700, most of which a block runs once (instruction-cache misses). With
// a fixed column a thread, the addresses step by a row's stride instead of being worked out a row (a 64-bit multiply
// and a branch a copy: 40% of a tile's instructions went to its copies; stepped, B 8 M 128-1024 took 0.6-0.8 us less
// and M 32768 6% less on an H200).
template <class T>
__device__ __forceinline__ void copy_rows(unsigned char* dst, const T* src, const CopyPlan& p, int valid_rows) {
  if (p.fast) {
    uint32_t d = smem_addr(dst) + uint32_t((p.first * p.dst_stride + p.ch * 8) * int(sizeof(T)));
    const uint32_t d_step = uint32_t(p.step * p.dst_stride * int(sizeof(T)));
    const T* s = src + int64_t(p.first) * p.width + p.ch * 8;
    const int64_t s_step = int64_t(p.step) * p.width;
#pragma unroll 1
    for (int row = p.first; row < p.rows; row += p.step, d += d_step, s += s_step) {
      const bool ok = row < valid_rows;
      cp_async16_at(d, ok ? s : src, ok);
    }
    return;
  }
#pragma unroll 1
  for (int i = threadIdx.x; i < p.rows * p.chunks; i += kThreads) {
    const int row = i / p.chunks, ch = i - row * p.chunks;
    const bool ok = row < valid_rows;
    cp_async16(dst + (row * p.dst_stride + ch * 8) * int(sizeof(T)), ok ? src + int64_t(row) * p.width + ch * 8 : src,
               ok);
  }
}

template <class T, int WIDTH, int DST_STRIDE, int SRC_STRIDE, int... I>
__device__ __forceinline__ void copy_full_rows(uint32_t d, const T* s, std::integer_sequence<int, I...>) {
  constexpr int STEP = kThreads / (WIDTH / 8), E = int(sizeof(T));
  (cp_async16_at<I * STEP * DST_STRIDE * E, I * STEP * SRC_STRIDE * E>(d, s), ...);
}

// copy_rows for a shape known at compile time (the seeds' instance): a tile with all its rows valid takes ROWS /
// (kThreads / (WIDTH / 8)) copies a thread with their offsets in the instructions; the last, partial tile of a
// split the loop with the zero-fill. Rows of WIDTH elements, SRC_STRIDE apart in global memory (a head slice's
// columns of ak or av).
template <class T, int ROWS, int WIDTH, int DST_STRIDE, int SRC_STRIDE = WIDTH>
__device__ __forceinline__ void copy_rows_fixed(unsigned char* dst, const T* src, int valid_rows) {
  constexpr int CHUNKS = WIDTH / 8, STEP = kThreads / CHUNKS, E = int(sizeof(T));
  static_assert(kThreads % CHUNKS == 0 && ROWS % STEP == 0, "whole rows a step, whole steps a tile");
  const int ch = int(threadIdx.x) % CHUNKS, first = int(threadIdx.x) / CHUNKS;
  const uint32_t d = smem_addr(dst) + uint32_t((first * DST_STRIDE + ch * 8) * E);
  const T* s = src + first * SRC_STRIDE + ch * 8;
  if (valid_rows >= ROWS) {
    copy_full_rows<T, WIDTH, DST_STRIDE, SRC_STRIDE>(d, s, std::make_integer_sequence<int, ROWS / STEP>{});
    return;
  }
#pragma unroll 1
  for (int i = 0; i < ROWS / STEP; ++i) {
    const bool ok = first + i * STEP < valid_rows;
    cp_async16_at(d + uint32_t(i * STEP * DST_STRIDE * E), ok ? s + i * STEP * SRC_STRIDE : src, ok);
  }
}

// cp.async.wait_group with a count known at run time (0 .. 3).
__device__ __forceinline__ void cp_async_wait_upto(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

// Two f32 values as a 16-bit pair `hi` and the pair of what rounding left out, `lo` (hi + lo carries
// about 16 bits of mantissa).
template <class T>
__device__ __forceinline__ void split_pair(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(x, y);
  const T* h = reinterpret_cast<const T*>(&hi);
  lo = pack2<T>(x - to_acc(h[0]), y - to_acc(h[1]));
}

// Registers capped as for three blocks an SM (168 at HG = 2, no spills): shared memory keeps two resident,
// and they ran 2-4% faster than at the uncapped 204. SEEDS: the seeds' shape's dims as constants (H 32, R_k = R_v 1,
// D 128; E is NT's), so the rank and dimension loops unroll and the index arithmetic folds, a whole tile's copies
// carry their offsets in their instructions (copy_rows_fixed), and the tile loop's exponentials skip exp2f's fix-up
// for subnormal results (exp2_ftz: those weights become 0).
template <class T, int HG, int NT, int CH, bool CL, bool SEEDS = false, int HS = 1>
__global__ void __launch_bounds__(kThreads, CH == 1 ? 3 : 2) decode_tc(const T* __restrict__ aq, const T* __restrict__ bq,
                                                         const T* __restrict__ ak, const T* __restrict__ bk,
                                                         const T* __restrict__ av, const T* __restrict__ bv,
                                                         const DecodeLengths lengths, T* __restrict__ out,
                                                         float* __restrict__ part_acc, float* __restrict__ part_stat,
                                                         int* __restrict__ counters, const Geo g) {
  constexpr int RG = kWarps / HG;  // row groups
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int hg = warp % HG, rg = warp / HG;  // this warp's heads; its rows: chunks rg + c RG of 16
  const int gr = lane / 4, gc = 2 * (lane % 4);
  static_assert(HS == 1 || (SEEDS && CL), "head slices: the seeds' instance under the cluster schedule");
  // b: the sequence; bs: its slice of heads (blockIdx.z of HS), the index of everything kept per head (aq, the
  // output, the partial results and the counters: a slice's heads are contiguous there).
  const int b = blockIdx.y, split = blockIdx.x, bs = b * HS + int(blockIdx.z);
  const int H = SEEDS ? 32 / HS : g.H, Rq = g.Rq, Rk = SEEDS ? 1 : g.Rk, Rv = SEEDS ? 1 : g.Rv, D = SEEDS ? 128 : g.D,
            E = g.E, R = g.rows;
  const int bq_stride = SEEDS ? D + kPad : g.bq_stride, bk_stride = SEEDS ? D + kPad : g.bk_stride,
            bv_stride = SEEDS ? E + kPad : g.bv_stride;
  const int len = lengths.get(b);
  const int row0 = split * g.split_rows, row1 = min(len, row0 + g.split_rows);
  const int tiles = row1 > row0 ? (row1 - row0 + R - 1) / R : 0;

  T* bq_s = reinterpret_cast<T*>(smem + g.bq);
  const T* akb = ak + int64_t(b) * g.ak_b + int(blockIdx.z) * H * Rk;
  const T* bkb = bk + int64_t(b) * g.bk_b;
  const T* avb = av + int64_t(b) * g.av_b + int(blockIdx.z) * H * Rv;
  const T* bvb = bv + int64_t(b) * g.bv_b;

  const CopyPlan plan_ak = copy_plan(H * Rk, H * Rk, R), plan_bk = copy_plan(D, bk_stride, R * Rk),
                 plan_av = copy_plan(H * Rv, H * Rv, R), plan_bv = copy_plan(E, bv_stride, R * Rv);
  auto load_tile = [&](int t, int stage) {
    unsigned char* st = smem + stage * g.stage;
    const int r0 = row0 + t * R, valid = min(R, row1 - r0);
    if constexpr (SEEDS) {  // rows of 32 (ak, av; a slice's 32 / HS of them), D = 128 (bk) and E (bv)
      constexpr int kRows = 16 * (kWarps / HG) * CH, kD = 128, kE = NT * 8, kA = 32 / HS;  // g.rows, D, E, H
      copy_rows_fixed<T, kRows, kA, kA, 32>(st + g.st_ak, akb + int64_t(r0) * 32, valid);
      copy_rows_fixed<T, kRows, kD, kD + kPad>(st + g.st_bk, bkb + int64_t(r0) * kD, valid);
      copy_rows_fixed<T, kRows, kA, kA, 32>(st + g.st_av, avb + int64_t(r0) * 32, valid);
      copy_rows_fixed<T, kRows, kE, kE + kPad>(st + g.st_bv, bvb + int64_t(r0) * kE, valid);
      return;
    }
    copy_rows(st + g.st_ak, akb + int64_t(r0) * H * Rk, plan_ak, valid);
    copy_rows(st + g.st_bk, bkb + int64_t(r0) * Rk * D, plan_bk, valid * Rk);
    copy_rows(st + g.st_av, avb + int64_t(r0) * H * Rv, plan_av, valid);
    copy_rows(st + g.st_bv, bvb + int64_t(r0) * Rv * E, plan_bv, valid * Rv);
  };
  if constexpr (CL) {  // bq (rows past R_q zero-filled) at the head of the first tile's group
    const int chunks = D / 8;
    for (int i = tid; i < 16 * chunks; i += kThreads) {
      const int r = i / chunks, c = i - r * chunks;
      cp_async16(bq_s + r * bq_stride + c * 8, r < Rq ? bq + (int64_t(b) * Rq + r) * D + c * 8 : bq, r < Rq);
    }
  }
#pragma unroll 1
  for (int t = 0; t < g.stages - 1; ++t) {
    if (t < tiles) load_tile(t, t);
    cp_async_commit();
  }

  // bq with rows past R_q zeroed; aq of this warp's 16 heads as an A operand (heads x ranks), zero past
  // H and R_q.
  if constexpr (!CL)
    for (int i = tid; i < 16 * bq_stride; i += kThreads) {
      const int r = i / bq_stride, d = i - r * bq_stride;
      bq_s[i] = r < Rq && d < D ? bq[(int64_t(b) * Rq + r) * D + d] : from_acc<T>(0.f);
    }
  const int h0 = hg * 16 + gr, h1 = h0 + 8;
  // The cluster schedule loads every aq value unconditionally (at a clamped index), so the eight loads
  // go out together; a load under its condition waits for the one before it.
  auto aq_at = [&](int h, int r) {
    if constexpr (CL) {
      const float v = to_acc(aq[(int64_t(bs) * H + min(h, H - 1)) * Rq + min(r, Rq - 1)]);
      return h < H && r < Rq ? v : 0.f;
    }
    return h < H && r < Rq ? to_acc(aq[(int64_t(bs) * H + h) * Rq + r]) : 0.f;
  };
  const uint32_t qa[4] = {pack2<T>(aq_at(h0, gc), aq_at(h0, gc + 1)), pack2<T>(aq_at(h1, gc), aq_at(h1, gc + 1)),
                          pack2<T>(aq_at(h0, gc + 8), aq_at(h0, gc + 9)),
                          pack2<T>(aq_at(h1, gc + 8), aq_at(h1, gc + 9))};
  const int hc0 = min(h0, H - 1), hc1 = min(h1, H - 1);  // in-range columns for the ak, av reads

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // heads h0, h1 (l: this lane's terms)

  // Tile t sits in stage t % stages; the tile loaded at step t goes to the stage that tile t - 1 used.
  for (int t = 0, stage = 0, prev = g.stages - 1; t < tiles; ++t, prev = stage, stage = stage + 1 == g.stages ? 0 : stage + 1) {
    cp_async_wait_upto(g.stages - 2);
    __syncthreads();
    if (t + g.stages - 1 < tiles) load_tile(t + g.stages - 1, prev);
    cp_async_commit();
    const int valid = min(R, row1 - (row0 + t * R));  // rows in the tile
    if (rg * 16 >= valid) continue;                     // none in this warp's chunks
    const unsigned char* st = smem + stage * g.stage;
    const T* ak_s = reinterpret_cast<const T*>(st + g.st_ak);
    const T* bk_s = reinterpret_cast<const T*>(st + g.st_bk);
    const T* av_s = reinterpret_cast<const T*>(st + g.st_av);
    const T* bv_s = reinterpret_cast<const T*>(st + g.st_bv);
    int tok0[CH];  // the tile row of this lane's first score column in each chunk
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) tok0[ch] = (rg + ch * RG) * 16 + gc;

    // s[ch][j]: S^T for rows j * 8 + gc + (0, 1) of chunk ch: elements 0, 1 of head h0, 2, 3 of head h1.
    float s[CH][2][4] = {};
    for (int rk = 0; rk < Rk; ++rk) {
      float c[CH][2][4] = {};
      const T* brow = bq_s + ((lane / 16) * 8 + lane % 8) * bq_stride + ((lane / 8) % 2) * 8;
      const T* arow = bk_s + (((rg * 16 + lane % 16) * Rk + rk) * bk_stride + (lane / 16) * 8);
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t bb[4];
        ldmatrix_x4(bb, brow + k0);
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {  // the chunks' chains interleave
          uint32_t a[4];
          ldmatrix_x4(a, arow + ch * RG * 16 * Rk * bk_stride + k0);
          mma16816<T>(c[ch][0], a, bb[0], bb[1]);
          mma16816<T>(c[ch][1], a, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t b0h, b0l, b1h, b1l;
          split_pair<T>(c[ch][0][2 * j], c[ch][0][2 * j + 1], b0h, b0l);
          split_pair<T>(c[ch][1][2 * j], c[ch][1][2 * j + 1], b1h, b1l);
          float sr[4] = {};
          mma16816<T>(sr, qa, b0h, b1h);
          mma16816<T>(sr, qa, b0l, b1l);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = tok0[ch] + j * 8 + e;
            s[ch][j][e] += sr[e] * to_acc(ak_s[(tok * H + hc0) * Rk + rk]);
            s[ch][j][2 + e] += sr[2 + e] * to_acc(ak_s[(tok * H + hc1) * Rk + rk]);
          }
        }
    }

    // Online softmax in base 2 over this tile's rows; rows past the valid ones weigh 0.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int ch = 0; ch < CH; ++ch)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = tok0[ch] + j * 8 + (e & 1) < valid;
          s[ch][j][e] = ok ? s[ch][j][e] * g.q_mix : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], s[ch][j][e]);
        }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      const float m_new = fmaxf(m_run[i], mx[i]);
      alpha[i] = m_new == -INFINITY ? 1.f : (SEEDS ? exp2_ftz(m_run[i] - m_new) : exp2f(m_run[i] - m_new));
      m_run[i] = m_new;
      l_run[i] *= alpha[i];
    }
#pragma unroll
    for (int ch = 0; ch < CH; ++ch)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[ch][j][e] - m_run[e / 2];
          const float p = s[ch][j][e] == -INFINITY ? 0.f : (SEEDS ? exp2_ftz(x) : exp2f(x));
          l_run[e / 2] += p;
          s[ch][j][e] = p;
        }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      acc[nt][0] *= alpha[0];
      acc[nt][1] *= alpha[0];
      acc[nt][2] *= alpha[1];
      acc[nt][3] *= alpha[1];
    }

    // acc += W bv per chunk and rank of v; W (16 heads x 16 rows) = p av is the A operand.
    for (int rv = 0; rv < Rv; ++rv)
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        auto w = [&](int j, int e, int hc) {
          return s[ch][j][e] * to_acc(av_s[((tok0[ch] + j * 8 + (e & 1)) * H + hc) * Rv + rv]);
        };
        const uint32_t wa[4] = {pack2<T>(w(0, 0, hc0), w(0, 1, hc0)), pack2<T>(w(0, 2, hc1), w(0, 3, hc1)),
                                pack2<T>(w(1, 0, hc0), w(1, 1, hc0)), pack2<T>(w(1, 2, hc1), w(1, 3, hc1))};
        const T* vrow = bv_s + ((((rg + ch * RG) * 16 + lane % 8 + ((lane / 8) % 2) * 8) * Rv + rv) * bv_stride +
                                (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, vrow + np * 16);
          mma16816<T>(acc[2 * np], wa, bb[0], bb[1]);
          mma16816<T>(acc[2 * np + 1], wa, bb[2], bb[3]);
        }
      }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Merge the row groups: each warp's (max, sum, acc) into shared memory, then one value per (h, e).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  float* o_s = reinterpret_cast<float*>(smem);        // [warp][16][o_stride]
  float* ml_s = o_s + kWarps * 16 * g.o_stride;        // [warp][2][16]: max, sum
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    *reinterpret_cast<float2*>(o_s + (warp * 16 + gr) * g.o_stride + nt * 8 + gc) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(o_s + (warp * 16 + gr + 8) * g.o_stride + nt * 8 + gc) =
        make_float2(acc[nt][2], acc[nt][3]);
  }
  if (lane % 4 == 0) {
    ml_s[warp * 32 + gr] = m_run[0];
    ml_s[warp * 32 + gr + 8] = m_run[1];
    ml_s[warp * 32 + 16 + gr] = l_run[0];
    ml_s[warp * 32 + 16 + gr + 8] = l_run[1];
  }
  __syncthreads();
  int q_begin = 0, q_end = H * E / 4;  // the quads of the output this block combines over the partial results
  float* res_o = reinterpret_cast<float*>(smem + g.res);  // cluster schedule: [h][e], then max[h], sum[h]
  float* res_m = res_o + H * E;
  float* res_l = res_m + H;
  if constexpr (CL) {
    // Four values of e a thread (E = 8 NT: the divisions are shifts), into this block's result; with one block a
    // sequence (M <= 128), straight into the output: no cluster barrier, no combine (whose loop is unrolled for 16
    // ranks: about a third of the instructions a warp issued at M 1; 12.4 -> 9.0 us at B 8, M 1 on an H200).
    constexpr int EQ = 2 * NT;  // quads of a head's E values
    const bool alone = g.splits == 1;
    for (int q = tid; q < H * EQ; q += kThreads) {
      const int h = q / EQ, e = (q - h * EQ) * 4, r = h % 16, w0 = h / 16;
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < RG; ++c) m = fmaxf(m, ml_s[(w0 + c * HG) * 32 + r]);
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      float l = 0.f;
#pragma unroll
      for (int c = 0; c < RG; ++c) {
        const int w = w0 + c * HG;
        const float mc = ml_s[w * 32 + r], f = mc == -INFINITY ? 0.f : exp2f(mc - m);
        const float4 v = *reinterpret_cast<const float4*>(o_s + (w * 16 + r) * g.o_stride + e);
        o = make_float4(o.x + f * v.x, o.y + f * v.y, o.z + f * v.z, o.w + f * v.w);
        l += f * ml_s[w * 32 + 16 + r];
      }
      const float k = g.inv_rv;
      o = make_float4(o.x * k, o.y * k, o.z * k, o.w * k);
      if (alone) {  // the arithmetic of the combine below with one rank (weight 1): the same bits
        const float n = 1.f / l;
        *reinterpret_cast<uint2*>(out + (int64_t(bs) * H + h) * E + e) =
            make_uint2(pack2<T>(o.x * n, o.y * n), pack2<T>(o.z * n, o.w * n));
        continue;
      }
      *reinterpret_cast<float4*>(res_o + h * E + e) = o;
      if (e == 0) {
        res_m[h] = m;
        res_l[h] = l;
      }
    }
    if (alone) return;
    // Block r of the cluster combines the r-th slice of the (h, e) quads over the cluster's blocks.
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int C = g.cluster, rank = int(cluster.block_rank()), quads = H * EQ, per = (quads + C - 1) / C;
    const bool whole = g.splits == C;  // one cluster a sequence: the output
    const int64_t cslot = int64_t(bs) * (g.splits / C) + split / C;
    // Block c's result, mapped once a rank: its max and sum follow its H x E values.
    auto remote = [&](int c) { return cluster.map_shared_rank(res_o, c); };
    for (int q = rank * per + tid; q < min(quads, (rank + 1) * per); q += kThreads) {
      const int h = q / EQ, i = q * 4;
      float mc[kMaxWhole], m = -INFINITY;  // unrolled: the remote loads go out together
#pragma unroll
      for (int c = 0; c < kMaxWhole; ++c) {
        mc[c] = c < C ? remote(c)[H * E + h] : -INFINITY;
        m = fmaxf(m, mc[c]);
      }
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      float l = 0.f;
      if (g.gather) {
        // Four ranks at a time, loaded unconditionally (past C at rank C - 1, weighing 0), so that the loads
        // go out together instead of one remote round trip a rank behind its condition.
#pragma unroll
        for (int c0 = 0; c0 < kMaxWhole; c0 += 4) {
          if (c0 >= C) break;
          float4 v[4];
          float lc[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int c = min(c0 + j, C - 1);
            v[j] = *reinterpret_cast<const float4*>(remote(c) + i);
            lc[j] = remote(c)[H * E + H + h];
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float f = mc[c0 + j] == -INFINITY ? 0.f : exp2f(mc[c0 + j] - m);
            o = make_float4(o.x + f * v[j].x, o.y + f * v[j].y, o.z + f * v[j].z, o.w + f * v[j].w);
            l += f * lc[j];
          }
        }
      } else {
#pragma unroll
        for (int c = 0; c < kMaxWhole; ++c)
          if (mc[c] != -INFINITY) {
            const float f = exp2f(mc[c] - m);
            const float4 v = *reinterpret_cast<const float4*>(remote(c) + i);
            o = make_float4(o.x + f * v.x, o.y + f * v.y, o.z + f * v.z, o.w + f * v.w);
            l += f * remote(c)[H * E + H + h];
          }
      }
      if (whole) {
        const float k = 1.f / l;
        *reinterpret_cast<uint2*>(out + int64_t(bs) * H * E + i) =
            make_uint2(pack2<T>(o.x * k, o.y * k), pack2<T>(o.z * k, o.w * k));
      } else {
        *reinterpret_cast<float4*>(part_acc + cslot * H * E + i) = o;
        if (i == h * E) {
          part_stat[(cslot * H + h) * 2] = m;  // -inf for a cluster past the sequence's length
          part_stat[(cslot * H + h) * 2 + 1] = l;
        }
      }
    }
    if (whole) {
      cluster.sync();  // no block leaves while another reads its shared memory
      return;
    }
    // The sequence's last cluster to finish combines the partials, each of its blocks a slice of the quads (one
    // block alone took 2 us longer at B 8, M >= 4096 on an H200): rank 0 counts the cluster once every block's
    // slice is out, and tells the others.
    __threadfence();
    cluster.sync();  // also: no block leaves while another reads its shared memory
    if (rank == 0 && tid == 0) {
      const int last = atomicAdd(counters + bs, 1) == g.splits / C - 1;
      for (int c = 0; c < C; ++c) *cluster.map_shared_rank(&is_last, c) = last;
    }
    cluster.sync();
    if (!is_last) return;
    __threadfence();
    q_begin = min(quads, rank * per);
    q_end = min(quads, q_begin + per);
  } else {
    const int64_t slot = int64_t(bs) * g.splits + split;
    for (int i = tid; i < H * E; i += kThreads) {
      const int h = i / E, e = i - h * E, r = h % 16, w0 = h / 16;  // warps w0, w0 + HG, ... hold head h
      float m = -INFINITY;
#pragma unroll
      for (int c = 0; c < RG; ++c) m = fmaxf(m, ml_s[(w0 + c * HG) * 32 + r]);
      float o = 0.f, l = 0.f;
#pragma unroll
      for (int c = 0; c < RG; ++c) {
        const int w = w0 + c * HG;
        const float mc = ml_s[w * 32 + r], f = mc == -INFINITY ? 0.f : exp2f(mc - m);
        o += f * o_s[(w * 16 + r) * g.o_stride + e];
        l += f * ml_s[w * 32 + 16 + r];
      }
      if (g.splits == 1) {
        out[(int64_t(bs) * H + h) * E + e] = from_acc<T>(o * g.inv_rv / l);
      } else {
        part_acc[(slot * H + h) * E + e] = o * g.inv_rv;
        if (e == 0) {
          part_stat[(slot * H + h) * 2] = m;  // -inf for a split past the sequence's length
          part_stat[(slot * H + h) * 2 + 1] = l;
        }
      }
    }
    if (g.splits == 1) return;
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(counters + bs, 1) == g.splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }

  // The combine: weight of slot s for head h = 2^(m_s - m) / sum_s' l_s' 2^(m_s' - m); a slot is a split,
  // or a cluster of splits in the cluster schedule.
  const int S = CL ? g.splits / g.cluster : g.splits;
  float* wm = reinterpret_cast<float*>(smem);
  float* wl = wm + S * H;
  const float* stat = part_stat + int64_t(bs) * S * H * 2;
  for (int j = tid; j < S * H; j += kThreads) {
    wm[j] = __ldcg(stat + 2 * j);
    wl[j] = __ldcg(stat + 2 * j + 1);
  }
  __syncthreads();
  for (int h = tid; h < H; h += kThreads) {
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, wm[s * H + h]);
    float den = 0.f;
    for (int s = 0; s < S; ++s) {
      const float ms = wm[s * H + h];
      const float w = ms == -INFINITY ? 0.f : exp2f(ms - mx);
      wm[s * H + h] = w;
      den += w * wl[s * H + h];
    }
    const float inv = 1.f / den;
    for (int s = 0; s < S; ++s) wm[s * H + h] *= inv;
  }
  __syncthreads();
  const int quads = H * E / 4;
  const float4* pa = reinterpret_cast<const float4*>(part_acc + int64_t(bs) * S * H * E);
  if (g.gather) {
    // Two quads a thread and kGather slots at a time, loaded unconditionally (past S at slot S - 1, weighing
    // 0): one L2 round trip for 2 kGather values, where the loop below, with fewer slots than its unroll of
    // 16, waits on each slot's load in turn.
    for (int i0 = q_begin + tid; i0 < q_end; i0 += 2 * kThreads) {
      const int iq[2] = {i0, min(i0 + kThreads, q_end - 1)};
      float4 o[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
      for (int s0 = 0; s0 < S; s0 += kGather) {
        float4 v[2][kGather];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int j = 0; j < kGather; ++j)
            v[u][j] = __ldcg(pa + int64_t(min(s0 + j, S - 1)) * quads + iq[u]);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int h = iq[u] * 4 / E;
#pragma unroll
          for (int j = 0; j < kGather; ++j) {
            const float w = s0 + j < S ? wm[(s0 + j) * H + h] : 0.f;
            o[u] = make_float4(o[u].x + w * v[u][j].x, o[u].y + w * v[u][j].y, o[u].z + w * v[u][j].z,
                               o[u].w + w * v[u][j].w);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (u == 0 || i0 + kThreads < q_end)
          *reinterpret_cast<uint2*>(out + int64_t(bs) * H * E + iq[u] * 4) =
              make_uint2(pack2<T>(o[u].x, o[u].y), pack2<T>(o[u].z, o[u].w));
    }
  } else {
    for (int i = q_begin + tid; i < q_end; i += kThreads) {
      const int h = i * 4 / E;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
      for (int s = 0; s < S; ++s) {
        const float w = wm[s * H + h];
        const float4 v = __ldcg(pa + int64_t(s) * quads + i);
        o.x += w * v.x;
        o.y += w * v.y;
        o.z += w * v.z;
        o.w += w * v.w;
      }
      *reinterpret_cast<uint2*>(out + int64_t(bs) * H * E + i * 4) =
          make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
    }
  }
  if (tid == 0 && q_begin == 0) counters[bs] = 0;  // ready for the next call
}

}  // namespace lintape::tpa_cuda::decode_tc_kernel
