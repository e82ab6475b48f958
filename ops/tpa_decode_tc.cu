// TPA decode on tensor cores: one query token per sequence over a cache of factor rows, reading each
// row's (ak, bk, av, bv) once, never building k or v.
//
// A block (4 warps) takes one sequence b and one split of its cache, in tiles of 32 rows streamed into
// shared memory by cp.async, three tiles in flight. Per tile:
//   A. C[m, rk, :] = bk[m, rk] . bq^T           (32 Rk x D) x (D x 16) on tensor cores, R_q padded to 16
//   B. s[m, h] = sum_rk ak[m, h, rk] sum_rq aq'[h, rq] C[m, rk, rq]; a thread per (head, quarter of the
//      rows) with aq' in registers, online softmax in base 2, W[h, (m, rv)] = p av / R_v into shared
//   C. acc (H x E) = alpha acc + W (H x 32 Rv) x bv (32 Rv x E) on tensor cores, acc in registers.
// The arithmetic per row is R_k (R_q D + H R_q) + H R_v E multiply-adds, two thirds of it on tensor
// cores, so the kernel stays memory-bound. With several splits (flash-decoding), each block writes its
// unnormalised accumulator and (max, sum) per head; the last block of a sequence to finish (a counter
// per sequence, reset by that block) combines them, so a call is always one launch.
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>
#include "core/cuda.h"
#include "core/cuda_types.cuh"
#include "ops/tpa_cuda.h"
#include "ops/tpa_decode.cuh"
#include "ops/tpa_mma.cuh"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kRows = 32;      // cache rows per tile
constexpr int kStages = 3;     // tiles in flight
constexpr int kPad = 8;        // 16-bit elements of padding per shared row: conflict-free ldmatrix
constexpr int kMaxSplits = 64;
constexpr int kMaxDevices = 16;
constexpr float kLog2e = 1.4426950408889634f;

struct Geo {
  int H, Rq, Rk, Rv, D, E, splits, split_rows;
  int64_t ak_b, bk_b, av_b, bv_b;  // batch strides in elements
  float q_mix;                     // scale log2(e) / (R_q R_k): scores in base 2
  float inv_rv;
  // Shared memory in bytes: kStages stages of (ak, bk, av, bv), then bq, C, W, alpha, max, sum.
  int st_ak, st_bk, st_av, st_bv, stage, bq, c, w, alpha, mstat, lstat, total;
  int bq_stride, bk_stride, bv_stride, c_stride, w_stride;  // row strides in elements
};

Geo make_geo(const DecodeArgs& a, int mt) {
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
  g.bq_stride = g.bk_stride = g.D + kPad;
  g.bv_stride = g.E + kPad;
  g.c_stride = g.Rk * 16 + 4;  // floats; the 4 spread the rows of a quarter-warp over the banks
  g.w_stride = kRows * g.Rv + kPad;
  const int e2 = 2;  // bytes per element
  g.st_ak = 0;
  g.st_bk = g.st_ak + kRows * g.H * g.Rk * e2;
  g.st_av = g.st_bk + kRows * g.Rk * g.bk_stride * e2;
  g.st_bv = g.st_av + kRows * g.H * g.Rv * e2;
  g.stage = g.st_bv + kRows * g.Rv * g.bv_stride * e2;
  g.bq = kStages * g.stage;
  g.c = g.bq + 16 * g.bq_stride * e2;
  g.w = g.c + kRows * g.c_stride * 4;
  g.alpha = g.w + mt * 16 * g.w_stride * e2;
  g.mstat = g.alpha + mt * 16 * 4;
  g.lstat = g.mstat + g.H * 4;
  g.total = std::max(g.lstat + g.H * 4, 2 * kMaxSplits * g.H * 4);  // the combine reuses the stages
  return g;
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

template <class T, int MT, int NT>
__global__ void __launch_bounds__(kThreads) decode_tc(const T* __restrict__ aq, const T* __restrict__ bq,
                                                      const T* __restrict__ ak, const T* __restrict__ bk,
                                                      const T* __restrict__ av, const T* __restrict__ bv,
                                                      const DecodeLengths lengths, T* __restrict__ out,
                                                      float* __restrict__ part_acc, float* __restrict__ part_stat,
                                                      int* __restrict__ counters, const Geo g) {
  constexpr int HG = (MT + 1) / 2;  // groups of 32 heads in the score phase
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = blockIdx.y, split = blockIdx.x;
  const int H = g.H, Rq = g.Rq, Rk = g.Rk, Rv = g.Rv, D = g.D, E = g.E;
  const int len = lengths.get(b);
  const int row0 = split * g.split_rows, row1 = min(len, row0 + g.split_rows);
  const int tiles = row1 > row0 ? (row1 - row0 + kRows - 1) / kRows : 0;

  T* bq_s = reinterpret_cast<T*>(smem + g.bq);
  float* c_s = reinterpret_cast<float*>(smem + g.c);
  T* w_s = reinterpret_cast<T*>(smem + g.w);
  float* alpha_s = reinterpret_cast<float*>(smem + g.alpha);
  float* m_s = reinterpret_cast<float*>(smem + g.mstat);
  float* l_s = reinterpret_cast<float*>(smem + g.lstat);
  const T* akb = ak + int64_t(b) * g.ak_b;
  const T* bkb = bk + int64_t(b) * g.bk_b;
  const T* avb = av + int64_t(b) * g.av_b;
  const T* bvb = bv + int64_t(b) * g.bv_b;

  auto load_tile = [&](int t) {
    unsigned char* st = smem + (t % kStages) * g.stage;
    const int r0 = row0 + t * kRows, valid = min(kRows, row1 - r0);
    copy_rows(st + g.st_ak, akb + int64_t(r0) * H * Rk, H * Rk, H * Rk, 1, valid);
    copy_rows(st + g.st_bk, bkb + int64_t(r0) * Rk * D, D, g.bk_stride, Rk, valid);
    copy_rows(st + g.st_av, avb + int64_t(r0) * H * Rv, H * Rv, H * Rv, 1, valid);
    copy_rows(st + g.st_bv, bvb + int64_t(r0) * Rv * E, E, g.bv_stride, Rv, valid);
  };
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < tiles) load_tile(t);
    cp_async_commit();
  }

  // bq with rows past R_q zeroed; W zeroed (rows past H stay 0); aq' in registers.
  for (int i = tid; i < 16 * g.bq_stride; i += kThreads) {
    const int r = i / g.bq_stride, d = i - r * g.bq_stride;
    bq_s[i] = r < Rq && d < D ? bq[(int64_t(b) * Rq + r) * D + d] : from_acc<T>(0.f);
  }
  for (int i = tid; i < MT * 16 * g.w_stride; i += kThreads) w_s[i] = from_acc<T>(0.f);
  for (int i = tid; i < MT * 16; i += kThreads) alpha_s[i] = 0.f;
  const int hq = tid / 4, quarter = tid % 4;
  float aqr[HG][16], m_run[HG], l_run[HG];
#pragma unroll
  for (int gi = 0; gi < HG; ++gi) {
    const int h = hq + 32 * gi;
#pragma unroll
    for (int r = 0; r < 16; ++r)
      aqr[gi][r] = h < H && r < Rq ? to_acc(aq[(int64_t(b) * H + h) * Rq + r]) * g.q_mix : 0.f;
    m_run[gi] = -INFINITY;
    l_run[gi] = 0.f;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;
  const int nb = warp * NT * 8;  // this warp's first output column

  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < tiles) load_tile(t + kStages - 1);
    cp_async_commit();
    const unsigned char* st = smem + (t % kStages) * g.stage;
    const T* ak_s = reinterpret_cast<const T*>(st + g.st_ak);
    const T* bk_s = reinterpret_cast<const T*>(st + g.st_bk);
    const T* av_s = reinterpret_cast<const T*>(st + g.st_av);
    const T* bv_s = reinterpret_cast<const T*>(st + g.st_bv);
    const int valid = min(kRows, row1 - (row0 + t * kRows));

    // A. C = bk bq^T, 16 bk rows per warp and step.
    for (int mt = warp; mt < 2 * Rk; mt += 4) {
      float c[2][4] = {};
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[4], bb[4];
        ldmatrix_x4(a, bk_s + (mt * 16 + lane % 16) * g.bk_stride + k0 + (lane / 16) * 8);
        ldmatrix_x4(bb, bq_s + ((lane / 16) * 8 + lane % 8) * g.bq_stride + k0 + ((lane / 8) % 2) * 8);
        mma16816<T>(c[0], a, bb[0], bb[1]);
        mma16816<T>(c[1], a, bb[2], bb[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = mt * 16 + lane / 4 + half * 8;  // bk row of the tile: token r / Rk, rank r % Rk
          float* dst = c_s + (r / Rk) * g.c_stride + (r % Rk) * 16 + nt * 8 + 2 * (lane % 4);
          dst[0] = c[nt][half * 2];
          dst[1] = c[nt][half * 2 + 1];
        }
    }
    __syncthreads();

    // B. Scores, online softmax, W. Rows quarter, quarter + 4, ... keep a quarter-warp's C reads on
    // distinct banks; the four threads of a head are neighbouring lanes.
#pragma unroll
    for (int gi = 0; gi < HG; ++gi) {
      const int h = hq + 32 * gi;
      const bool active = h < H;
      const int hc = active ? h : 0;
      float s[8];
      float tmax = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = quarter + 4 * i;
        const float* crow = c_s + m * g.c_stride;
        float sc = 0.f;
        for (int rk = 0; rk < Rk; ++rk) {
          float inner = 0.f;
#pragma unroll
          for (int r = 0; r < 16; r += 4) {
            const float4 cv = *reinterpret_cast<const float4*>(crow + rk * 16 + r);
            inner += aqr[gi][r] * cv.x + aqr[gi][r + 1] * cv.y + aqr[gi][r + 2] * cv.z + aqr[gi][r + 3] * cv.w;
          }
          sc += inner * to_acc(ak_s[(m * H + hc) * Rk + rk]);
        }
        s[i] = active && m < valid ? sc : -INFINITY;
        tmax = fmaxf(tmax, s[i]);
      }
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      const float m_new = fmaxf(m_run[gi], tmax);
      const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_run[gi] - m_new);  // 0 on the first tile
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = quarter + 4 * i;
        const float p = s[i] == -INFINITY ? 0.f : exp2f(s[i] - m_new);
        sum += p;
        if (active)
          for (int rv = 0; rv < Rv; ++rv)
            w_s[h * g.w_stride + m * Rv + rv] = from_acc<T>(p * g.inv_rv * to_acc(av_s[(m * H + h) * Rv + rv]));
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l_run[gi] = l_run[gi] * alpha + sum;
      m_run[gi] = m_new;
      if (active && quarter == 0) alpha_s[h] = alpha;
    }
    __syncthreads();

    // C. acc = alpha acc + W bv; warp w owns columns [w NT 8, (w + 1) NT 8).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float a0 = alpha_s[mt * 16 + lane / 4], a1 = alpha_s[mt * 16 + lane / 4 + 8];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[mt][nt][0] *= a0;
        acc[mt][nt][1] *= a0;
        acc[mt][nt][2] *= a1;
        acc[mt][nt][3] *= a1;
      }
    }
    for (int k0 = 0; k0 < kRows * Rv; k0 += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], w_s + (mt * 16 + lane % 16) * g.w_stride + k0 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bb[4];
        ldmatrix_x4_trans(bb, bv_s + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * g.bv_stride + nb + np * 16 +
                                  (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(acc[mt][2 * np], a[mt], bb[0], bb[1]);
          mma16816<T>(acc[mt][2 * np + 1], a[mt], bb[2], bb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  if (quarter == 0)
#pragma unroll
    for (int gi = 0; gi < HG; ++gi) {
      const int h = hq + 32 * gi;
      if (h < H) {
        m_s[h] = m_run[gi];
        l_s[h] = l_run[gi];
      }
    }
  __syncthreads();
  const int gr = lane / 4, gc = 2 * (lane % 4);
  if (g.splits == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int h = mt * 16 + gr + half * 8;
        if (h >= H) continue;
        const float inv = 1.f / l_s[h];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          *reinterpret_cast<uint32_t*>(out + (int64_t(b) * H + h) * E + nb + nt * 8 + gc) =
              pack2<T>(acc[mt][nt][half * 2] * inv, acc[mt][nt][half * 2 + 1] * inv);
      }
    return;
  }

  const int64_t slot = int64_t(b) * g.splits + split;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = mt * 16 + gr + half * 8;
      if (h >= H) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<float2*>(part_acc + (slot * H + h) * E + nb + nt * 8 + gc) =
            make_float2(acc[mt][nt][half * 2], acc[mt][nt][half * 2 + 1]);
    }
  for (int h = tid; h < H; h += kThreads) {
    part_stat[(slot * H + h) * 2] = m_s[h];  // -inf for a split past the sequence's length
    part_stat[(slot * H + h) * 2 + 1] = l_s[h];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(counters + b, 1) == g.splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  // The combine: weight of split s for head h = 2^(m_s - m) / sum_s' l_s' 2^(m_s' - m).
  const int S = g.splits;
  float* wm = reinterpret_cast<float*>(smem);
  float* wl = wm + S * H;
  const float* stat = part_stat + int64_t(b) * S * H * 2;
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
  const float4* pa = reinterpret_cast<const float4*>(part_acc + int64_t(b) * S * H * E);
  for (int i = tid; i < quads; i += kThreads) {
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
    *reinterpret_cast<uint2*>(out + int64_t(b) * H * E + i * 4) = make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
  }
  if (tid == 0) counters[b] = 0;  // ready for the next call
}

// Splits from a cost model in microseconds. Blocks stream their tiles at the SM's share of the copy
// bandwidth (a lone block on an SM keeps too few bytes in flight: 3/4 of it); with several splits the
// last block of a sequence reads every split's partial sums from L2, plus a fixed wait.
int choose_splits(int64_t B, int64_t M, int sms, const Geo& g) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  const double tile_us = double(g.stage) / (3.0e6 / sms);  // bytes / (bytes per us per SM)
  const double split_us = double(g.H) * g.E * 4 / 1.2e5;   // one split's partial sums at ~120 GB/s
  const int most = int(std::min<int64_t>(tiles, kMaxSplits));
  std::vector<double> cost(size_t(most) + 1);
  double best = 1e300;
  for (int s = 1; s <= most; ++s) {
    const double per_sm = std::ceil(double(B) * s / sms);  // blocks sharing an SM
    const double share = per_sm >= 2 ? 1.0 : 0.75;
    const double stream = per_sm * double((tiles + s - 1) / s) * tile_us / share;
    cost[size_t(s)] = stream + (s > 1 ? 1.0 + split_us * s : 0.0);
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

template <class T, int MT, int NT>
void launch(const DecodeArgs& a, const Geo& g, const DecodeLengths& lengths, Tensor& out, float* pa, float* ps,
            int* counters, int device) {
  auto kernel = decode_tc<T, MT, NT>;
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

template <class T>
void launch_for_shape(const DecodeArgs& a, const Geo& g, const DecodeLengths& lengths, Tensor& out, float* pa,
                      float* ps, int* counters, int device) {
  const int mt = (g.H + 15) / 16;
  const bool wide = g.E == 128;
  if (mt == 1) wide ? launch<T, 1, 4>(a, g, lengths, out, pa, ps, counters, device)
                    : launch<T, 1, 2>(a, g, lengths, out, pa, ps, counters, device);
  else if (mt == 2) wide ? launch<T, 2, 4>(a, g, lengths, out, pa, ps, counters, device)
                         : launch<T, 2, 2>(a, g, lengths, out, pa, ps, counters, device);
  else wide ? launch<T, 4, 4>(a, g, lengths, out, pa, ps, counters, device)
            : launch<T, 4, 2>(a, g, lengths, out, pa, ps, counters, device);
}

int m_tiles(int64_t H) { return H <= 16 ? 1 : H <= 32 ? 2 : 4; }

}  // namespace

bool decode_uses_tensor_cores(const DecodeArgs& a) {
  if (!a.allow_tensor_cores) return false;
  const DType dt = a.aq.dtype();
  if (dt != DType::BF16 && dt != DType::F16) return false;
  const int64_t H = a.aq.size(2), Rq = a.aq.size(3), Rk = a.ak.size(3), Rv = a.av.size(3), D = a.bq.size(3),
                E = a.bv.size(3);
  if (Rq > 16 || Rk > 4 || Rv > 4 || H > 64 || D % 16 != 0 || D > 256 || (E != 64 && E != 128)) return false;
  if ((H * Rk) % 8 != 0 || (H * Rv) % 8 != 0) return false;
  for (const Tensor* t : {&a.ak, &a.bk, &a.av, &a.bv})
    if (t->strides()[0] % 8 != 0 || reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return make_geo(a, m_tiles(H)).total <= 200 * 1024;
}

void decode_tensor_cores(const DecodeArgs& a, Tensor& out) {
  const Device dev = a.aq.device();
  const int64_t B = a.aq.size(0), M = a.ak.size(1);
  Geo g = make_geo(a, m_tiles(a.aq.size(2)));
  int64_t rows = a.split_rows;
  if (rows > 0) {
    rows = (rows + kRows - 1) / kRows * kRows;
    rows = std::max(rows, (M + kMaxSplits - 1) / kMaxSplits);
  } else {
    const int s = choose_splits(B, M, sm_count(dev.index), g);
    rows = ((M + s - 1) / s + kRows - 1) / kRows * kRows;
  }
  g.split_rows = int(rows);
  g.splits = int((M + rows - 1) / rows);
  Tensor length_storage, part_acc, part_stat;
  const DecodeLengths lengths = make_decode_lengths(a.lengths, dev, length_storage);
  float* pa = nullptr;
  float* ps = nullptr;
  int* counters = nullptr;
  if (g.splits > 1) {
    part_acc = empty({B, g.splits, g.H, g.E}, DType::F32, dev);
    part_stat = empty({B, g.splits, g.H, 2}, DType::F32, dev);
    pa = part_acc.data_ptr<float>();
    ps = part_stat.data_ptr<float>();
    counters = split_counters(dev.index, B);
  }
  if (a.aq.dtype() == DType::BF16)
    launch_for_shape<__nv_bfloat16>(a, g, lengths, out, pa, ps, counters, dev.index);
  else
    launch_for_shape<__half>(a, g, lengths, out, pa, ps, counters, dev.index);
}

}  // namespace lintape::tpa_cuda
