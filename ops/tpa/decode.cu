// Fused TPA decode: one query token per sequence over a cache of factor rows, never building k or v.
// decode() runs the tensor-core kernel (ops/tpa/decode_tc.cu) where it applies (16-bit factors, the
// usual ranks and dims) and otherwise this general kernel (f32, any ranks and dims).
//
// A block takes one sequence b and one split of its cache rows, in tiles of kTile rows. Per tile it
// contracts bq with bk (Rq x Rk dots of length D per row; a warp holds one bk row in registers for all
// Rq dots), stages the tile's av and bv in shared memory, mixes C with aq and ak per head into the
// scores, runs an online softmax per head, and accumulates bv weighted by av and the probabilities
// into an (H, E) f32 accumulator in shared memory. Every global load of a tile is issued in its first
// phase, so a tile waits on memory about once; many small splits keep several blocks on each SM. With one split the block writes the output; with
// several (flash-decoding, when B alone cannot fill the GPU) it writes its unnormalised accumulator, max
// and sum, and a reduction kernel combines the splits.
#include <algorithm>
#include <cmath>
#include "core/cuda.h"
#include "core/cuda_reduce.cuh"
#include "core/cuda_types.cuh"
#include "ops/tpa/launch.h"
#include "ops/tpa/decode.cuh"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;
constexpr int kTile = 16;  // cache rows per tile
constexpr int kMaxDPerLane = 8;  // D <= 256: a bk row is 8 registers per lane at most

struct Geometry {
  int H, Rq, Rk, Rv, D, E, M, splits, split_rows;
  int64_t ak_b, bk_b, av_b, bv_b;  // batch strides in elements
  float scale;
};

// Shared memory layout, in floats.
struct Smem {
  int bq, aq, c, s, pw, bv, alpha, mx, sum, acc, total;
  __host__ __device__ explicit Smem(const Geometry& g) {
    bq = 0;
    aq = bq + g.Rq * g.D;
    c = aq + g.H * g.Rq;
    s = c + kTile * g.Rq * g.Rk;
    pw = s + kTile * g.H;
    bv = pw + kTile * g.H * g.Rv;
    alpha = bv + kTile * g.Rv * g.E;
    mx = alpha + g.H;
    sum = mx + g.H;
    acc = sum + g.H;
    total = acc + g.H * g.E;
  }
};

template <class T>
__global__ void __launch_bounds__(kThreads) decode_split(const T* __restrict__ aq, const T* __restrict__ bq,
                                                         const T* __restrict__ ak, const T* __restrict__ bk,
                                                         const T* __restrict__ av, const T* __restrict__ bv,
                                                         const DecodeLengths lengths, T* __restrict__ out,
                                                         float* __restrict__ part_acc, float* __restrict__ part_stat,
                                                         Geometry g) {
  extern __shared__ float smem[];
  const Smem L(g);
  float* bq_s = smem + L.bq;
  float* aq_s = smem + L.aq;
  float* c_s = smem + L.c;
  float* s_s = smem + L.s;
  float* pw_s = smem + L.pw;
  float* bv_s = smem + L.bv;
  float* alpha_s = smem + L.alpha;
  float* mx_s = smem + L.mx;
  float* sum_s = smem + L.sum;
  float* acc_s = smem + L.acc;
  const int b = blockIdx.y, split = blockIdx.x, tid = threadIdx.x;
  const int H = g.H, Rq = g.Rq, Rk = g.Rk, Rv = g.Rv, D = g.D, E = g.E;
  const int len = lengths.get(b);
  const int row0 = split * g.split_rows, row1 = min(len, row0 + g.split_rows);

  for (int i = tid; i < Rq * D; i += kThreads) bq_s[i] = to_acc(bq[int64_t(b) * Rq * D + i]);
  // aq with both 1/Rq, 1/Rk and the score scale folded in.
  const float mix = g.scale / float(Rq * Rk);
  for (int i = tid; i < H * Rq; i += kThreads) aq_s[i] = to_acc(aq[int64_t(b) * H * Rq + i]) * mix;
  for (int i = tid; i < H; i += kThreads) {
    mx_s[i] = -INFINITY;
    sum_s[i] = 0.f;
  }
  for (int i = tid; i < H * E; i += kThreads) acc_s[i] = 0.f;
  __syncthreads();

  const T* akb = ak + int64_t(b) * g.ak_b;
  const T* bkb = bk + int64_t(b) * g.bk_b;
  const T* avb = av + int64_t(b) * g.av_b;
  const T* bvb = bv + int64_t(b) * g.bv_b;
  for (int t0 = row0; t0 < row1; t0 += kTile) {
    const int rows = min(kTile, row1 - t0);
    // The tile's av (raw, 0 past the rows) and bv into shared memory, coalesced.
    for (int i = tid; i < kTile * H * Rv; i += kThreads)
      pw_s[i] = i / (H * Rv) < rows ? to_acc(avb[int64_t(t0) * H * Rv + i]) : 0.f;
    for (int i = tid; i < rows * Rv * E; i += kThreads) bv_s[i] = to_acc(bvb[int64_t(t0) * Rv * E + i]);
    // C[m, rq, rk] = bq[rq] . bk[t0 + m, rk]: a warp loads one bk row and does its Rq dots.
    const int warp = tid / 32, lane = tid % 32;
    for (int i = warp; i < rows * Rk; i += kThreads / 32) {
      const T* krow = bkb + (int64_t(t0) * Rk + i) * D;
      float kv[kMaxDPerLane];
#pragma unroll
      for (int j = 0; j < kMaxDPerLane; ++j) kv[j] = lane + 32 * j < D ? to_acc(krow[lane + 32 * j]) : 0.f;
      const int m = i / Rk, rk = i % Rk;
      for (int rq = 0; rq < Rq; ++rq) {
        const float* qrow = bq_s + rq * D;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < kMaxDPerLane; ++j)
          if (lane + 32 * j < D) dot += qrow[lane + 32 * j] * kv[j];
        dot = cuda_device::warp_sum(dot);
        if (lane == 0) c_s[(m * Rq + rq) * Rk + rk] = dot;
      }
    }
    __syncthreads();
    // s[m, h] = sum_{rq, rk} aq[h, rq] C[m, rq, rk] ak[t0 + m, h, rk] (scaled).
    for (int i = tid; i < kTile * H; i += kThreads) {
      const int m = i / H, h = i % H;
      float s = -INFINITY;
      if (m < rows) {
        s = 0.f;
        const T* akr = akb + (int64_t(t0 + m) * H + h) * Rk;
        for (int rk = 0; rk < Rk; ++rk) {
          float inner = 0.f;
          for (int rq = 0; rq < Rq; ++rq) inner += aq_s[h * Rq + rq] * c_s[(m * Rq + rq) * Rk + rk];
          s += inner * to_acc(akr[rk]);
        }
      }
      s_s[i] = s;
    }
    __syncthreads();
    // Online softmax per head; pw[m, h, rv] = p * av / Rv.
    for (int h = tid; h < H; h += kThreads) {
      float tile_max = -INFINITY;
      for (int m = 0; m < rows; ++m) tile_max = fmaxf(tile_max, s_s[m * H + h]);
      const float new_max = fmaxf(mx_s[h], tile_max);
      const float alpha = __expf(mx_s[h] - new_max);  // 0 on the first tile (max was -inf)
      float tile_sum = 0.f;
      for (int m = 0; m < rows; ++m) {
        const float p = __expf(s_s[m * H + h] - new_max);
        tile_sum += p;
        for (int rv = 0; rv < Rv; ++rv) pw_s[(m * H + h) * Rv + rv] *= p / float(Rv);
      }
      alpha_s[h] = alpha;
      mx_s[h] = new_max;
      sum_s[h] = sum_s[h] * alpha + tile_sum;
    }
    __syncthreads();
    // acc[h, e] = alpha acc[h, e] + sum_{m, rv} pw[m, h, rv] bv[t0 + m, rv, e]; consecutive threads take
    // consecutive e, so bv rows are read coalesced.
    for (int i = tid; i < H * E; i += kThreads) {
      const int h = i / E, e = i % E;
      float a = acc_s[i] * alpha_s[h];
      for (int m = 0; m < rows; ++m)
        for (int rv = 0; rv < Rv; ++rv)
          a += pw_s[(m * H + h) * Rv + rv] * bv_s[(m * Rv + rv) * E + e];
      acc_s[i] = a;
    }
    __syncthreads();
  }

  if (g.splits == 1) {
    for (int i = tid; i < H * E; i += kThreads)
      out[int64_t(b) * H * E + i] = from_acc<T>(acc_s[i] / sum_s[i / E]);
    return;
  }
  const int64_t slot = int64_t(b) * g.splits + split;
  for (int i = tid; i < H * E; i += kThreads) part_acc[slot * H * E + i] = acc_s[i];
  for (int h = tid; h < H; h += kThreads) {
    part_stat[(slot * H + h) * 2] = mx_s[h];  // -inf for a split past the sequence's length
    part_stat[(slot * H + h) * 2 + 1] = sum_s[h];
  }
}

// out[b, h, e] = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m), m the largest split max.
template <class T>
__global__ void __launch_bounds__(kThreads) combine_splits(const float* __restrict__ part_acc,
                                                           const float* __restrict__ part_stat, T* __restrict__ out,
                                                           Geometry g) {
  const int b = blockIdx.y;
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= g.H * g.E) return;
  const int h = i / g.E;
  float m = -INFINITY;
  for (int s = 0; s < g.splits; ++s) m = fmaxf(m, part_stat[((int64_t(b) * g.splits + s) * g.H + h) * 2]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < g.splits; ++s) {
    const int64_t slot = int64_t(b) * g.splits + s;
    const float ms = part_stat[(slot * g.H + h) * 2];
    if (ms == -INFINITY) continue;
    const float w = __expf(ms - m);
    den += w * part_stat[(slot * g.H + h) * 2 + 1];
    num += w * part_acc[slot * g.H * g.E + i];
  }
  out[int64_t(b) * g.H * g.E + i] = from_acc<T>(num / den);
}

}  // namespace

void decode(const DecodeArgs& a, Tensor& out) {
  const char* op = "tpa_decode";
  LT_CHECK(int64_t(a.lengths.size()) == a.aq.size(0), "[", op, "] lengths must have B = ", a.aq.size(0),
           " entries; got ", a.lengths.size());
  if (decode_uses_tensor_cores(a)) return decode_tensor_cores(a, out);
  const Device dev = a.aq.device();
  Geometry g{};
  fill_decode_dims(g, a);
  g.M = int(a.ak.size(1));
  g.scale = float(a.scale);
  const int64_t B = a.aq.size(0);
  LT_CHECK(g.D <= 32 * kMaxDPerLane, "[", op, "] the fused decode supports D <= ", 32 * kMaxDPerLane, "; got D = ",
           g.D);
  // Splits: about 8 blocks per SM (several resident at once hide each tile's memory wait), at least 64
  // rows per split so that the combine stays small.
  int64_t rows = a.split_rows;
  if (rows <= 0) {
    const int64_t want = std::max<int64_t>(1, 8 * sm_count(dev.index) / std::max<int64_t>(B, 1));
    rows = std::max<int64_t>(64, (g.M + want - 1) / want);
  }
  rows = (rows + kTile - 1) / kTile * kTile;
  g.split_rows = int(rows);
  g.splits = int((g.M + rows - 1) / rows);

  const Smem L(g);
  const size_t smem = size_t(L.total) * sizeof(float);
  LT_CHECK(smem <= 227 * 1024, "[", op, "] the shapes need ", smem / 1024,
           " KiB of shared memory per block (more than 227 KiB): H * E or R_q * D is too large");
  Tensor part_acc, part_stat, length_storage;
  const DecodeLengths lengths = make_decode_lengths(a.lengths, dev, length_storage);
  if (g.splits > 1) {
    part_acc = empty({B, g.splits, g.H, g.E}, DType::F32, dev);
    part_stat = empty({B, g.splits, g.H, 2}, DType::F32, dev);
  }
  cudaStream_t st = stream(dev.index);
  LT_DISPATCH_FLOAT_CUDA(a.aq.dtype(), op, T, {
    auto kernel = decode_split<T>;
    static size_t allowed = 0;  // raised only when a call needs more, not on every launch
    if (allowed < smem) {
      LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      allowed = smem;
    }
    float* pa = g.splits > 1 ? part_acc.data_ptr<float>() : nullptr;
    float* ps = g.splits > 1 ? part_stat.data_ptr<float>() : nullptr;
    kernel<<<dim3(unsigned(g.splits), unsigned(B)), kThreads, smem, st>>>(
        static_cast<const T*>(a.aq.data()), static_cast<const T*>(a.bq.data()), static_cast<const T*>(a.ak.data()),
        static_cast<const T*>(a.bk.data()), static_cast<const T*>(a.av.data()), static_cast<const T*>(a.bv.data()),
        lengths, static_cast<T*>(out.data()), pa, ps, g);
    LT_CUDA_CHECK_LAUNCH();
    if (g.splits > 1) {
      combine_splits<T><<<dim3(grid_for(int64_t(g.H) * g.E, kThreads), unsigned(B)), kThreads, 0, st>>>(
          pa, ps, static_cast<T*>(out.data()), g);
      LT_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace lintape::tpa_cuda
