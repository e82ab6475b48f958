// Internal to ops/tpa/attention.cu and attention_bwd.cu: the bandwidth kernels around the main kernels, organised
// for bandwidth. build_rows_wide builds the Q, K and V rows of a launch's batch entries in one launch (a thread per
// (token, 8 heads, 16-byte chunk), its basis chunks in registers across the heads);
// factor_grads_qkv contracts the gradient rows to their factors up to 8 ranks a pass (dQ's 6 ranks in one read of
// dQ), dQ, dK and dV in one launch. Both give the same bits as build_rows and rows_factor_grads
// (attention_parts.cuh, attention_bwd.cu): the same f32 products summed in the same order.
// LINTAPE_TPA_FWD_ROWS=old / LINTAPE_TPA_BWD_ROWS=old (or AttentionArgs::old_rows) runs those instead.
#pragma once
#include "ops/tpa/attention_parts.cuh"

namespace lintape::tpa_cuda::attention_rows {
using namespace attention_parts;

// x (tokens, H, HD) of one pair from token t0 (see build_rows); a null x: no such job.
template <class T>
struct RowsJob {
  Pair<T> f;
  T* x;
  int64_t t0, tokens;
};

constexpr int kRowHeads = 8;  // the heads of a thread

// x[t, h] = inv_r sum_r a[t, h, r] b[t, r] in f32, rounded once, for job first + blockIdx.y (q, k, v). A thread per
// (token, group of kRowHeads heads, 8 columns): the basis chunks of its first RB ranks are read once, kept in f32
// registers across its heads (ranks past RB come from L1 head by head, as in build_rows); a warp writes two
// heads' rows (HD = 128) or four (64) at a time. The products and their order are build_rows': the same bits.
template <class T, int HD, int RB>
__global__ void __launch_bounds__(kThreads, 2) build_rows_wide(const RowsJob<T> q, const RowsJob<T> k,
                                                           const RowsJob<T> v, int H, int first) {
  constexpr int CH = HD / 8;
  const int job = first + int(blockIdx.y);
  const RowsJob<T> j = job == 0 ? q : job == 1 ? k : v;
  const int groups = (H + kRowHeads - 1) / kRowHeads;
  const int64_t idx = int64_t(blockIdx.x) * kThreads + threadIdx.x, rest = idx / CH, w = rest / groups;
  if (w >= j.tokens) return;
  const int c8 = int(idx % CH), h0 = int(rest % groups) * kRowHeads, R = j.f.R;
  const int64_t t = j.t0 + w;
  const T* b = j.f.b_at(t) + c8 * 8;
  // The ranks from R to RB add products -0 x +0 = -0, which leave every sum as it is (x + -0 = x, -0 included):
  // the same bits without a branch per rank.
  float bf[RB][8];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const uint4 u = r < R ? __ldg(reinterpret_cast<const uint4*>(b + r * HD)) : make_uint4(0, 0, 0, 0);
    const uint32_t us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = unpack2<T>(us[e]);
      bf[r][2 * e] = f.x;
      bf[r][2 * e + 1] = f.y;
    }
  }
  // The first RB weights of head h + 1 are loaded before head h's row is stored (the compiler would not move
  // them across the store); kept in T, each load lands in its own register.
  const int h1 = min(H, h0 + kRowHeads);
  T an[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) an[r] = r < R ? j.f.a_at(t, h0)[r] : from_acc<T>(-0.f);
#pragma unroll 1
  for (int h = h0; h < h1; ++h) {
    const T* a = j.f.a_at(t, h);
    const T* next = j.f.a_at(t, min(h + 1, h1 - 1));  // the last head reads its own row again
    float ar[RB], acc[8] = {};
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      ar[r] = to_acc(an[r]);
      if (r < R) an[r] = next[r];
    }
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += ar[r] * bf[r][e];
    for (int r = RB; r < R; ++r) {
      const float wr = to_acc(a[r]);
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(b + r * HD));
      const uint32_t us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(us[e]);
        acc[2 * e] += wr * f.x;
        acc[2 * e + 1] += wr * f.y;
      }
    }
    uint4 o;
    o.x = pack2<T>(acc[0] * j.f.inv_r, acc[1] * j.f.inv_r);
    o.y = pack2<T>(acc[2] * j.f.inv_r, acc[3] * j.f.inv_r);
    o.z = pack2<T>(acc[4] * j.f.inv_r, acc[5] * j.f.inv_r);
    o.w = pack2<T>(acc[6] * j.f.inv_r, acc[7] * j.f.inv_r);
    *reinterpret_cast<uint4*>(j.x + (w * H + h) * HD + c8 * 8) = o;
  }
}

// Launches build_rows_wide over the jobs with x set (q, k and v; q alone; or k and v), RB the largest of their
// ranks rounded up to 2, 4, 6 or 8.
template <class T, int HD>
void launch_build_rows(const RowsJob<T>& q, const RowsJob<T>& k, const RowsJob<T>& v, int H, cudaStream_t st) {
  const int first = q.x ? 0 : 1, jobs = (k.x ? 3 : 1) - first, groups = (H + kRowHeads - 1) / kRowHeads;
  const int r = std::max(q.x ? q.f.R : 0, k.x ? std::max(k.f.R, v.f.R) : 0);
  const int rb = r <= 2 ? 2 : r <= 4 ? 4 : r <= 6 ? 6 : 8;
  const int64_t tokens = std::max(q.x ? q.tokens : 0, k.x ? std::max(k.tokens, v.tokens) : 0);
  if (jobs <= 0 || tokens == 0) return;
  const dim3 grid(unsigned(grid_for(tokens * groups * (HD / 8), kThreads)), unsigned(jobs));
  if (rb == 2)
    build_rows_wide<T, HD, 2><<<grid, kThreads, 0, st>>>(q, k, v, H, first);
  else if (rb == 4)
    build_rows_wide<T, HD, 4><<<grid, kThreads, 0, st>>>(q, k, v, H, first);
  else if (rb == 6)
    build_rows_wide<T, HD, 6><<<grid, kThreads, 0, st>>>(q, k, v, H, first);
  else
    build_rows_wide<T, HD, 8><<<grid, kThreads, 0, st>>>(q, k, v, H, first);
  LT_CUDA_CHECK_LAUNCH();
}

constexpr int kAhead = 3;  // the rows a warp of factor_grads_qkv keeps in flight beyond the one it reduces

// The warp sums of G values per lane (G a power of two up to 32) by the butterfly (xor 16, 8, .., 1), each lane
// keeping only the sums it ends with: at each of the first log2 G steps a lane keeps half of its values (the upper
// half where its lane bit is set) and swaps the other half with its partner, so lane l ends with the sum of value
// l >> (5 - log2 G). Every sum pairs the same lanes in the same order as G separate butterflies: the same bits,
// with G - 1 + 5 - log2 G shuffles instead of 5 G.
template <int G>
__device__ __forceinline__ float butterfly_scatter(float (&v)[G], int lane) {
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a power of two up to 32");
  int n = G;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    if (n > 1) {
      const int half = n / 2;
      const bool up = lane & o;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = up ? v[i] : v[i + half], keep = up ? v[i + half] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
      }
      n = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    }
  }
  return v[0];
}

// Gradient rows x (X: f32 for dQ, DkvRow<T> for dK and dV; (tokens, H, HD) from token t0) of one pair, to da and db
// scaled by mul (see rows_factor_grads).
template <class T, class X = float>
struct GradsJob {
  const X* x;
  Pair<T> f;
  T *da, *db;
  int64_t t0, tokens;
  float mul;
};

// rows_factor_grads for token w of job j (a warp), G ranks a pass (G = 8: ranks up to 8 read the rows once).
// The dot products of a row go through butterfly_scatter (G values reduced by about G + 3 shuffles, each of G
// lanes writing one); the sums, their order and the writes are rows_factor_grads': the same bits.
template <class T, int HD, int G, class X>
__device__ __forceinline__ void factor_grads_token(const GradsJob<T, X> j, int H, int64_t w) {
  constexpr int E = HD / 32, LOG = G == 2 ? 1 : G == 4 ? 2 : 3;
  static_assert(G == 2 || G == 4 || G == 8, "2, 4 or 8 ranks a pass");
  if (w >= j.tokens) return;
  const int lane = threadIdx.x % 32, mine = lane >> (5 - LOG);  // the rank of this lane's dot products
  const bool writer = lane % (32 / G) == 0;
  const int64_t t = j.t0 + w;
  const int R = j.f.R;
  for (int r0 = 0; r0 < R; r0 += G) {
    float b[G][E], acc[G][E];
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        b[u][e] = r0 + u < R ? to_acc(j.f.b_at(t)[(r0 + u) * HD + lane + 32 * e]) : 0.f;
        acc[u][e] = 0.f;
      }
    // Rows h + 1 .. h + kAhead in flight while row h is reduced (issued before row h's stores, which the
    // compiler would not move them across).
    float ahead[kAhead][E];
#pragma unroll
    for (int i = 0; i < kAhead; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) ahead[i][e] = i < H ? to_acc(j.x[(w * H + i) * HD + lane + 32 * e]) : 0.f;
#pragma unroll 2
    for (int h = 0; h < H; ++h) {
      float xv[E], dot[G], wr[G];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        xv[e] = ahead[0][e];
#pragma unroll
        for (int i = 0; i + 1 < kAhead; ++i) ahead[i][e] = ahead[i + 1][e];
        ahead[kAhead - 1][e] = h + kAhead < H ? to_acc(j.x[(w * H + h + kAhead) * HD + lane + 32 * e]) : 0.f;
      }
      const T* ah = j.f.a_at(t, h);
#pragma unroll
      for (int u = 0; u < G; ++u) wr[u] = r0 + u < R ? to_acc(ah[r0 + u]) * j.mul : 0.f;
#pragma unroll
      for (int u = 0; u < G; ++u) {
        dot[u] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot[u] += xv[e] * b[u][e];
      }
      const float sum = butterfly_scatter<G>(dot, lane);
      if (writer && r0 + mine < R) j.da[(t * H + h) * R + r0 + mine] = from_acc<T>(sum * j.mul);
#pragma unroll
      for (int u = 0; u < G; ++u)  // no branch: the unused ranks add zeros to sums never written
#pragma unroll
        for (int e = 0; e < E; ++e) acc[u][e] += wr[u] * xv[e];
    }
#pragma unroll
    for (int u = 0; u < G; ++u) {
      if (r0 + u >= R) break;
#pragma unroll
      for (int e = 0; e < E; ++e) j.db[(t * R + r0 + u) * HD + lane + 32 * e] = from_acc<T>(acc[u][e]);
    }
  }
}

// The split backward's three contractions in one launch: dQ (blockIdx.y 0; f32 rows, GQ ranks a pass) and dK, dV
// (1 and 2; rows in X, GKV ranks a pass), each a warp a token; each job's arithmetic is the one it had alone.
// One launch instead of two (dQ, then dK and dV): H100, the backward 1.3-2.6% faster at N 2048.
template <class T, int HD, int GQ, int GKV, class X>
__global__ void __launch_bounds__(kThreads, 2) factor_grads_qkv(const GradsJob<T> jq, const GradsJob<T, X> jk,
                                                             const GradsJob<T, X> jv, int H) {
  const int64_t w = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (blockIdx.y == 0)
    factor_grads_token<T, HD, GQ>(jq, H, w);
  else
    factor_grads_token<T, HD, GKV>(blockIdx.y == 1 ? jk : jv, H, w);
}

// Ranks a pass for R ranks: 2, 4 or 8.
constexpr int grads_pass(int r) { return r <= 2 ? 2 : r <= 4 ? 4 : 8; }

template <class T, int HD, int GQ, class X>
void launch_factor_grads_kv(const dim3& grid, const GradsJob<T>& jq, const GradsJob<T, X>& jk, const GradsJob<T, X>& jv,
                            int H, cudaStream_t st) {
  const int gkv = grads_pass(std::max(jk.f.R, jv.f.R));
  if (gkv == 2)
    factor_grads_qkv<T, HD, GQ, 2, X><<<grid, kThreads, 0, st>>>(jq, jk, jv, H);
  else if (gkv == 4)
    factor_grads_qkv<T, HD, GQ, 4, X><<<grid, kThreads, 0, st>>>(jq, jk, jv, H);
  else
    factor_grads_qkv<T, HD, GQ, 8, X><<<grid, kThreads, 0, st>>>(jq, jk, jv, H);
}

// Launches factor_grads_qkv over the three jobs.
template <class T, int HD, class X>
void launch_factor_grads(const GradsJob<T>& jq, const GradsJob<T, X>& jk, const GradsJob<T, X>& jv, int H,
                         cudaStream_t st) {
  const int64_t tokens = std::max({jq.tokens, jk.tokens, jv.tokens});
  const dim3 grid(unsigned(grid_for(tokens, kWarps)), 3u);
  const int gq = grads_pass(jq.f.R);
  if (gq == 2)
    launch_factor_grads_kv<T, HD, 2>(grid, jq, jk, jv, H, st);
  else if (gq == 4)
    launch_factor_grads_kv<T, HD, 4>(grid, jq, jk, jv, H, st);
  else
    launch_factor_grads_kv<T, HD, 8>(grid, jq, jk, jv, H, st);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::tpa_cuda::attention_rows
