// Fused TPA attention on tensor cores (WMMA 16 x 16 x 16, 16-bit inputs, f32 accumulation), forward and
// backward, flash-attention style: q, k and v tiles of 64 tokens are built from the factors in shared
// memory (q = (1/R_q) sum_r aq[r] bq[r] per token and head), scores never leave the chip, and the
// forward keeps only the output and the per-row log-sum-exp.
//
// A block is one (query or key tile, head, batch entry) with 4 warps; each warp owns 16 rows of the
// tile, so between the block-wide tile builds a warp only waits for itself. Scores go through shared
// memory in f32 for the softmax (a lane pair per row), probabilities back in the 16-bit type.
//   forward:  per key tile S = Q K^T, online softmax, O = alpha O + P V (O in shared f32).
//   backward: Delta = rowsum(dO o O); a key-tile pass (dK = sum dS^T Q, dV = sum P^T dO, in registers)
//             and a query-tile pass (dQ = sum dS K, in registers), both recomputing P from the saved
//             log-sum-exp: P = 2^(S scale log2 e - lse), dS = P (dO V^T - Delta) scale.
// Scores are kept in base 2 (scale log2 e folded in); lse is stored in base 2.
#include <mma.h>
#include <algorithm>
#include <cmath>
#include "core/cuda.h"
#include "core/cuda_types.cuh"
#include "ops/tpa_cuda.h"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;
using namespace nvcuda;

namespace {

constexpr int kThreads = 128;
constexpr int kTile = 64;
constexpr int kLdS = kTile + 4;  // f32 score rows
constexpr int kLdP = kTile + 8;  // 16-bit probability rows
constexpr float kLog2e = 1.4426950408889634f;

template <class T>
struct Params {
  const T *aq, *bq, *ak, *bk, *av, *bv;
  T* out;
  float* lse;
  const T* dout;
  const float* delta;
  T *dq, *dk, *dv;
  int N, M, H, Rq, Rk, Rv;
  float inv_rq, inv_rk, inv_rv, scale, sl2;  // sl2 = scale log2(e)
  bool causal;
};

template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// dst[i, :] = (1/R) sum_r a[b, row0 + i, h, r] b[b, row0 + i, r, :] for the tile's rows, 0 past `rows`.
template <class T, int HD>
__device__ void build_tile(T* dst, const T* __restrict__ a, const T* __restrict__ bm, int64_t b, int h, int row0,
                           int rows, int H, int R, float inv_r) {
  constexpr int LD = HD + 8;
  for (int idx = threadIdx.x; idx < kTile * HD; idx += kThreads) {
    const int i = idx / HD, d = idx % HD, n = row0 + i;
    float v = 0.f;
    if (n < rows) {
      const T* ar = a + ((b * rows + n) * H + h) * R;
      const T* br = bm + (b * rows + n) * R * HD + d;
      for (int r = 0; r < R; ++r) v += to_acc(ar[r]) * to_acc(br[r * HD]);
      v *= inv_r;
    }
    dst[i * LD + d] = from_acc<T>(v);
  }
}

// dst[i, :] = x[b, row0 + i, h, :] (HD wide), 0 past `rows`.
template <class T, int HD>
__device__ void load_rows(T* dst, const T* __restrict__ x, int64_t b, int h, int row0, int rows, int H) {
  constexpr int LD = HD + 8;
  for (int idx = threadIdx.x; idx < kTile * HD; idx += kThreads) {
    const int i = idx / HD, d = idx % HD, n = row0 + i;
    dst[i * LD + d] = n < rows ? x[((b * rows + n) * H + h) * HD + d] : from_acc<T>(0.f);
  }
}

// C (16 x 64, f32, row stride kLdS) = A (16 rows, row-major) times B^T, B given as 64 rows: both HD wide.
template <class T, int HD>
__device__ __forceinline__ void rows_times_rows_t(float* c, const T* a, const T* b) {
  constexpr int LD = HD + 8;
#pragma unroll
  for (int ct = 0; ct < kTile / 16; ++ct) {
    FragC acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      FragA<T> fa;
      FragBT<T> fb;
      wmma::load_matrix_sync(fa, a + kk * 16, LD);
      wmma::load_matrix_sync(fb, b + ct * 16 * LD + kk * 16, LD);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + ct * 16, acc, kLdS, wmma::mem_row_major);
  }
}

template <class T, int HD>
__global__ void __launch_bounds__(kThreads) attention_fwd(const Params<T> p) {
  constexpr int LD = HD + 8, LDO = HD + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = qs + kTile * LD;
  T* vs = ks + kTile * LD;
  float* ss = reinterpret_cast<float*>(vs + kTile * LD);
  T* ps = reinterpret_cast<T*>(ss + kTile * kLdS);
  float* os = reinterpret_cast<float*>(ps + kTile * kLdP);
  const int qt = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z;
  const int q0 = qt * kTile;
  build_tile<T, HD>(qs, p.aq, p.bq, b, h, q0, p.N, p.H, p.Rq, p.inv_rq);
  for (int i = threadIdx.x; i < kTile * LDO; i += kThreads) os[i] = 0.f;
  const int row = warp * 16 + lane / 2, half = lane % 2, n = q0 + row;
  float* srow = ss + row * kLdS + half * 32;
  T* prow = ps + row * kLdP + half * 32;
  float* orow = os + row * LDO + half * (HD / 2);
  float m_i = -INFINITY, l_i = 0.f;
  const int kv_all = (p.M + kTile - 1) / kTile;
  const int kv_tiles = p.causal ? min(qt + 1, kv_all) : kv_all;
  for (int j = 0; j < kv_tiles; ++j) {
    __syncthreads();  // the previous tile's K and V are no longer read
    build_tile<T, HD>(ks, p.ak, p.bk, b, h, j * kTile, p.M, p.H, p.Rk, p.inv_rk);
    build_tile<T, HD>(vs, p.av, p.bv, b, h, j * kTile, p.M, p.H, p.Rv, p.inv_rv);
    __syncthreads();
    rows_times_rows_t<T, HD>(ss + warp * 16 * kLdS, qs + warp * 16 * LD, ks);
    __syncwarp();
    const int kv0 = j * kTile + half * 32;
    float tmax = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      const int kv = kv0 + c;
      const float s = kv < p.M && (!p.causal || kv <= n) ? srow[c] * p.sl2 : -INFINITY;
      srow[c] = s;
      tmax = fmaxf(tmax, s);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float m_new = fmaxf(m_i, tmax);
    const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_i - m_new);
    float sum = 0.f;
    for (int c = 0; c < 32; ++c) {
      const float s = srow[c];
      const float pv = s == -INFINITY ? 0.f : exp2f(s - m_new);
      prow[c] = from_acc<T>(pv);
      sum += pv;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l_i = l_i * alpha + sum;
    m_i = m_new;
    for (int e = 0; e < HD / 2; ++e) orow[e] *= alpha;
    __syncwarp();
#pragma unroll
    for (int et = 0; et < HD / 16; ++et) {
      FragC acc;
      wmma::load_matrix_sync(acc, os + warp * 16 * LDO + et * 16, LDO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> fa;
        FragB<T> fb;
        wmma::load_matrix_sync(fa, ps + warp * 16 * kLdP + kk * 16, kLdP);
        wmma::load_matrix_sync(fb, vs + kk * 16 * LD + et * 16, LD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(os + warp * 16 * LDO + et * 16, acc, LDO, wmma::mem_row_major);
    }
    __syncwarp();
  }
  if (n < p.N) {
    const float inv = 1.f / l_i;
    T* o = p.out + ((b * p.N + n) * p.H + h) * HD + half * (HD / 2);
    for (int e = 0; e < HD / 2; ++e) o[e] = from_acc<T>(orow[e] * inv);
    if (half == 0) p.lse[(b * p.N + n) * p.H + h] = m_i + log2f(l_i);
  }
}

// delta[row] = sum_e dout[row, e] out[row, e]: a warp per row of (B N H) rows.
template <class T>
__global__ void attention_delta(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta,
                                int64_t rows, int E) {
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int e = lane; e < E; e += 32) s += to_acc(out[row * E + e]) * to_acc(dout[row * E + e]);
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) delta[row] = s;
}

// One key tile: dK and dV over every query tile that sees it.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads) attention_bwd_kv(const Params<T> p) {
  constexpr int LD = HD + 8, LDO = HD + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kTile * LD;
  T* qs = vs + kTile * LD;
  T* dos = qs + kTile * LD;
  float* st = reinterpret_cast<float*>(dos + kTile * LD);  // S^T, then P^T's f32 source
  float* dpt = st + kTile * kLdS;
  T* pt = reinterpret_cast<T*>(dpt + kTile * kLdS);
  T* dst = pt + kTile * kLdP;
  float* lse_s = reinterpret_cast<float*>(dst + kTile * kLdP);
  float* delta_s = lse_s + kTile;
  const int kt = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z;
  const int kv0 = kt * kTile;
  build_tile<T, HD>(ks, p.ak, p.bk, b, h, kv0, p.M, p.H, p.Rk, p.inv_rk);
  build_tile<T, HD>(vs, p.av, p.bv, b, h, kv0, p.M, p.H, p.Rv, p.inv_rv);
  FragC dk[HD / 16], dv[HD / 16];
#pragma unroll
  for (int et = 0; et < HD / 16; ++et) {
    wmma::fill_fragment(dk[et], 0.f);
    wmma::fill_fragment(dv[et], 0.f);
  }
  const int row = warp * 16 + lane / 2, half = lane % 2, kv = kv0 + row;
  const int q_tiles = (p.N + kTile - 1) / kTile;
  for (int i = p.causal ? kt : 0; i < q_tiles; ++i) {
    const int q0 = i * kTile;
    __syncthreads();
    build_tile<T, HD>(qs, p.aq, p.bq, b, h, q0, p.N, p.H, p.Rq, p.inv_rq);
    load_rows<T, HD>(dos, p.dout, b, h, q0, p.N, p.H);
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      const int n = q0 + r;
      lse_s[r] = n < p.N ? p.lse[(b * p.N + n) * p.H + h] : 0.f;
      delta_s[r] = n < p.N ? p.delta[(b * p.N + n) * p.H + h] : 0.f;
    }
    __syncthreads();
    rows_times_rows_t<T, HD>(st + warp * 16 * kLdS, ks + warp * 16 * LD, qs);    // S^T = K Q^T
    rows_times_rows_t<T, HD>(dpt + warp * 16 * kLdS, vs + warp * 16 * LD, dos);  // dP^T = V dO^T
    __syncwarp();
    for (int c = 0; c < 32; ++c) {
      const int qc = half * 32 + c, n = q0 + qc;
      const bool valid = n < p.N && kv < p.M && (!p.causal || kv <= n);
      const float pv = valid ? exp2f(st[row * kLdS + qc] * p.sl2 - lse_s[qc]) : 0.f;
      pt[row * kLdP + qc] = from_acc<T>(pv);
      dst[row * kLdP + qc] = from_acc<T>(pv * (dpt[row * kLdS + qc] - delta_s[qc]) * p.scale);
    }
    __syncwarp();
#pragma unroll
    for (int et = 0; et < HD / 16; ++et)
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> fa;
        FragB<T> fb;
        wmma::load_matrix_sync(fa, pt + warp * 16 * kLdP + kk * 16, kLdP);
        wmma::load_matrix_sync(fb, dos + kk * 16 * LD + et * 16, LD);
        wmma::mma_sync(dv[et], fa, fb, dv[et]);
        wmma::load_matrix_sync(fa, dst + warp * 16 * kLdP + kk * 16, kLdP);
        wmma::load_matrix_sync(fb, qs + kk * 16 * LD + et * 16, LD);
        wmma::mma_sync(dk[et], fa, fb, dk[et]);
      }
  }
  __syncthreads();
  float* stage = reinterpret_cast<float*>(qs);  // qs and dos: 64 x (HD + 4) floats fit in them
  float* srow = stage + row * LDO + half * (HD / 2);
  auto write = [&](FragC(&acc)[HD / 16], T* grad) {
#pragma unroll
    for (int et = 0; et < HD / 16; ++et)
      wmma::store_matrix_sync(stage + warp * 16 * LDO + et * 16, acc[et], LDO, wmma::mem_row_major);
    __syncwarp();
    if (kv < p.M) {
      T* g = grad + ((b * p.M + kv) * p.H + h) * HD + half * (HD / 2);
      for (int e = 0; e < HD / 2; ++e) g[e] = from_acc<T>(srow[e]);
    }
    __syncwarp();
  };
  write(dk, p.dk);
  write(dv, p.dv);
}

// One query tile: dQ over every key tile it sees.
template <class T, int HD>
__global__ void __launch_bounds__(kThreads) attention_bwd_q(const Params<T> p) {
  constexpr int LD = HD + 8, LDO = HD + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* dos = qs + kTile * LD;
  T* ks = dos + kTile * LD;
  T* vs = ks + kTile * LD;
  float* ss = reinterpret_cast<float*>(vs + kTile * LD);
  float* dps = ss + kTile * kLdS;
  T* dss = reinterpret_cast<T*>(dps + kTile * kLdS);
  const int qt = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z;
  const int q0 = qt * kTile;
  build_tile<T, HD>(qs, p.aq, p.bq, b, h, q0, p.N, p.H, p.Rq, p.inv_rq);
  load_rows<T, HD>(dos, p.dout, b, h, q0, p.N, p.H);
  const int row = warp * 16 + lane / 2, half = lane % 2, n = q0 + row;
  const float lse = n < p.N ? p.lse[(b * p.N + n) * p.H + h] : 0.f;
  const float delta = n < p.N ? p.delta[(b * p.N + n) * p.H + h] : 0.f;
  FragC dq[HD / 16];
#pragma unroll
  for (int et = 0; et < HD / 16; ++et) wmma::fill_fragment(dq[et], 0.f);
  const int kv_all = (p.M + kTile - 1) / kTile;
  const int kv_tiles = p.causal ? min(qt + 1, kv_all) : kv_all;
  for (int j = 0; j < kv_tiles; ++j) {
    __syncthreads();
    build_tile<T, HD>(ks, p.ak, p.bk, b, h, j * kTile, p.M, p.H, p.Rk, p.inv_rk);
    build_tile<T, HD>(vs, p.av, p.bv, b, h, j * kTile, p.M, p.H, p.Rv, p.inv_rv);
    __syncthreads();
    rows_times_rows_t<T, HD>(ss + warp * 16 * kLdS, qs + warp * 16 * LD, ks);    // S = Q K^T
    rows_times_rows_t<T, HD>(dps + warp * 16 * kLdS, dos + warp * 16 * LD, vs);  // dP = dO V^T
    __syncwarp();
    for (int c = 0; c < 32; ++c) {
      const int kc = half * 32 + c, kv = j * kTile + kc;
      const bool valid = n < p.N && kv < p.M && (!p.causal || kv <= n);
      const float pv = valid ? exp2f(ss[row * kLdS + kc] * p.sl2 - lse) : 0.f;
      dss[row * kLdP + kc] = from_acc<T>(pv * (dps[row * kLdS + kc] - delta) * p.scale);
    }
    __syncwarp();
#pragma unroll
    for (int et = 0; et < HD / 16; ++et)
#pragma unroll
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<T> fa;
        FragB<T> fb;
        wmma::load_matrix_sync(fa, dss + warp * 16 * kLdP + kk * 16, kLdP);
        wmma::load_matrix_sync(fb, ks + kk * 16 * LD + et * 16, LD);
        wmma::mma_sync(dq[et], fa, fb, dq[et]);
      }
  }
  __syncthreads();
  float* stage = ss;  // ss and dps: 64 x (HD + 4) floats fit in them
#pragma unroll
  for (int et = 0; et < HD / 16; ++et)
    wmma::store_matrix_sync(stage + warp * 16 * LDO + et * 16, dq[et], LDO, wmma::mem_row_major);
  __syncwarp();
  if (n < p.N) {
    const float* srow = stage + row * LDO + half * (HD / 2);
    T* g = p.dq + ((b * p.N + n) * p.H + h) * HD + half * (HD / 2);
    for (int e = 0; e < HD / 2; ++e) g[e] = from_acc<T>(srow[e]);
  }
}

template <int HD>
constexpr size_t fwd_smem() {
  return 3 * kTile * (HD + 8) * 2 + kTile * kLdS * 4 + kTile * kLdP * 2 + kTile * (HD + 4) * 4;
}
template <int HD>
constexpr size_t bwd_kv_smem() {
  return 4 * kTile * (HD + 8) * 2 + 2 * kTile * kLdS * 4 + 2 * kTile * kLdP * 2 + 2 * kTile * 4;
}
template <int HD>
constexpr size_t bwd_q_smem() {
  return 4 * kTile * (HD + 8) * 2 + 2 * kTile * kLdS * 4 + kTile * kLdP * 2;
}
// The backward kernels stage 64 x (HD + 4) f32 results in two of their tiles once the loop is done.
static_assert(2 * (128 + 8) * 2 >= (128 + 4) * 4 && 2 * (64 + 8) * 2 >= (64 + 4) * 4, "dK/dV staging fits");
static_assert(2 * kLdS * 4 >= (128 + 4) * 4, "dQ staging fits in the two score tiles");

template <class T>
Params<T> make_params(const AttentionArgs& a) {
  Params<T> p{};
  p.aq = static_cast<const T*>(a.aq.data());
  p.bq = static_cast<const T*>(a.bq.data());
  p.ak = static_cast<const T*>(a.ak.data());
  p.bk = static_cast<const T*>(a.bk.data());
  p.av = static_cast<const T*>(a.av.data());
  p.bv = static_cast<const T*>(a.bv.data());
  p.N = int(a.aq.size(1));
  p.M = int(a.ak.size(1));
  p.H = int(a.aq.size(2));
  p.Rq = int(a.aq.size(3));
  p.Rk = int(a.ak.size(3));
  p.Rv = int(a.av.size(3));
  p.inv_rq = 1.f / float(p.Rq);
  p.inv_rk = 1.f / float(p.Rk);
  p.inv_rv = 1.f / float(p.Rv);
  p.scale = float(a.scale);
  p.sl2 = float(a.scale) * kLog2e;
  p.causal = a.causal;
  return p;
}

// Raises a kernel's dynamic shared memory limit once per process.
template <class Kernel>
void allow_smem(Kernel kernel, size_t smem, bool& configured) {
  if (!configured) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
}

template <class T, int HD>
void forward_typed(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  Params<T> p = make_params<T>(a);
  p.out = static_cast<T*>(out.data());
  p.lse = lse.data_ptr<float>();
  const dim3 grid(unsigned((p.N + kTile - 1) / kTile), unsigned(p.H), unsigned(a.aq.size(0)));
  static bool configured = false;
  allow_smem(attention_fwd<T, HD>, fwd_smem<HD>(), configured);
  attention_fwd<T, HD><<<grid, kThreads, fwd_smem<HD>(), stream(a.aq.device().index)>>>(p);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int HD>
void backward_typed(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                    Tensor& dk, Tensor& dv) {
  const Device dev = a.aq.device();
  cudaStream_t st = stream(dev.index);
  Params<T> p = make_params<T>(a);
  const int64_t B = a.aq.size(0), rows = B * p.N * p.H;
  Tensor delta = empty({B, p.N, p.H}, DType::F32, dev);
  attention_delta<T><<<grid_for(rows, kThreads / 32), kThreads, 0, st>>>(
      static_cast<const T*>(out.data()), static_cast<const T*>(dout.data()), delta.data_ptr<float>(), rows, HD);
  LT_CUDA_CHECK_LAUNCH();
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = static_cast<const T*>(dout.data());
  p.delta = delta.data_ptr<float>();
  p.dq = static_cast<T*>(dq.data());
  p.dk = static_cast<T*>(dk.data());
  p.dv = static_cast<T*>(dv.data());
  static bool kv_configured = false, q_configured = false;
  const dim3 kv_grid(unsigned((p.M + kTile - 1) / kTile), unsigned(p.H), unsigned(B));
  allow_smem(attention_bwd_kv<T, HD>, bwd_kv_smem<HD>(), kv_configured);
  attention_bwd_kv<T, HD><<<kv_grid, kThreads, bwd_kv_smem<HD>(), st>>>(p);
  LT_CUDA_CHECK_LAUNCH();
  const dim3 q_grid(unsigned((p.N + kTile - 1) / kTile), unsigned(p.H), unsigned(B));
  allow_smem(attention_bwd_q<T, HD>, bwd_q_smem<HD>(), q_configured);
  attention_bwd_q<T, HD><<<q_grid, kThreads, bwd_q_smem<HD>(), st>>>(p);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::string attention_unsupported(DType dtype, int64_t D, int64_t E, int64_t Rq, int64_t Rk, int64_t Rv) {
  if (dtype != DType::BF16 && dtype != DType::F16)
    return str("bf16 or f16 factors (tensor cores); got ", dtype_name(dtype));
  if (D != E || (D != 64 && D != 128)) return str("D == E, 64 or 128; got D = ", D, ", E = ", E);
  if (Rq > 16 || Rk > 16 || Rv > 16) return str("ranks up to 16; got (", Rq, ", ", Rk, ", ", Rv, ")");
  return "";
}

void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16) wide ? forward_typed<__nv_bfloat16, 128>(a, out, lse) : forward_typed<__nv_bfloat16, 64>(a, out, lse);
  else wide ? forward_typed<__half, 128>(a, out, lse) : forward_typed<__half, 64>(a, out, lse);
}

void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq,
                        Tensor& dk, Tensor& dv) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16)
    wide ? backward_typed<__nv_bfloat16, 128>(a, out, lse, dout, dq, dk, dv)
         : backward_typed<__nv_bfloat16, 64>(a, out, lse, dout, dq, dk, dv);
  else
    wide ? backward_typed<__half, 128>(a, out, lse, dout, dq, dk, dv)
         : backward_typed<__half, 64>(a, out, lse, dout, dq, dk, dv);
}

}  // namespace lintape::tpa_cuda
