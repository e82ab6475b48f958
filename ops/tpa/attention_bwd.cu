// Backward of the fused TPA attention (see ops/tpa/attention.cu): Delta = rowsum(dO o O) and Q (built once
// from its factors into a workspace of the launch's batch entries), then one pass over key tiles in the
// flash-attention 2 layout, recomputing P = 2^(S scale log2 e - lse) and
// dS = P (dP - Delta) scale per (key tile, query tile). dK and dV stay in registers and are contracted to
// their factors at the end of the block: da (this head's values, written once) and db (a sum over heads:
// f32 atomics into a workspace, head by head in order). dQ is summed over key tiles by f32 atomics into a
// workspace, key tile by key tile in order, then a second kernel contracts it to aq and bq per token, over
// all heads at once. The fixed orders (attention_parts' turns) make the gradients the same bits run to run.
// On Hopper (sm_90a builds, D = 128, no documents) the same schedule on warpgroup products
// (ops/tpa/attention_bwd_wg.cuh); its split form writes dK and dV rows to workspaces instead (bf16 for bf16 factors,
// else f32: DkvRow), contracted per token as dQ is (no head turns in the tensor-core kernel; N H D floats and 2 M H D
// rows a batch entry). The default there: the
// split form fed by a producer warpgroup (ops/tpa/attention_bwd_tma.cuh), with K and V rows built beforehand
// like Q's (M H D each a batch entry) and dQ staged for bulk reductions. The rows (Q, K and V in one launch) and
// the per-token contractions (dQ, then dK and dV in one launch): ops/tpa/attention_rows.cuh;
// LINTAPE_TPA_BWD_ROWS=old runs build_rows and rows_factor_grads, a launch a pair (the same bits).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include "ops/tpa/attention_bwd_tma.cuh"
#include "ops/tpa/attention_rows.cuh"

namespace lintape::tpa_cuda {

namespace {
using namespace attention_parts;

// delta[row] = sum_e dout[row, e] out[row, e]: a warp per row of (B N H) rows.
template <class T>
__global__ void attention_delta(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta,
                                int64_t rows, int E) {
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int e = 2 * lane; e < E; e += 64) {
    const float2 a = unpack2<T>(*reinterpret_cast<const uint32_t*>(out + row * E + e));
    const float2 b = unpack2<T>(*reinterpret_cast<const uint32_t*>(dout + row * E + e));
    s += a.x * b.x + a.y * b.y;
  }
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// ---------------------------------------------------------------------------------------------------
// Backward: a block per (key tile of kBig rows, head, batch entry), over the query tiles of kSmall rows
// that see it. Per query tile: S^T = K Q^T and dP^T = V dO^T (a warp per 16 keys), P and
// dS' = P (dP - Delta) (the scale is applied to dK here and to dQ by the factor kernel); dV += P^T dO and
// dK += dS'^T Q stay in registers; dS'^T goes to shared memory and dQ = dS' K (a warp per 16 queries x
// HD / 2 columns, in the next tile's barrier interval) is added to an f32 workspace by atomics, once the
// blocks of the lower key tiles have added theirs. The query tiles run last to first, so every key tile's
// block reaches a query tile after the same number of tiles: the blocks of one query tile's chain arrive
// at nearly the same time, in order, and a turn rarely waits. Q (built once per launch), dO and dS'^T are
// double-buffered: tile i - 1 is copied by cp.async while tile i is multiplied, and each tile pair needs
// one barrier. The grid's slowest dimension counts the key tiles, so causal blocks start heaviest first
// across all heads and batch entries (and a chain's earlier blocks start first).

template <int HD>
constexpr size_t bwd_smem() {
  // K, V (kBig rows); two Q, dO pairs (kSmall rows); two dS'^T (kBig x kSmall); two lse, Delta pairs.
  return size_t(2 * kBig + 4 * kSmall) * (HD + 8) * 2 + size_t(2 * kBig) * (kSmall + 8) * 2 + 4 * kSmall * 4;
}
static_assert(bwd_smem<128>() <= 227 * 1024, "a block fits an sm_90 multiprocessor");
// The f32 dK and dV tiles (kBig x (HD + 4)) go through the Q, dO buffers and the K, V tiles at the end, the
// rank weights (2 kBig x 16 floats at most) through the dS'^T buffers.
static_assert(size_t(kBig) * (128 + 4) * 4 <= size_t(4 * kSmall) * (128 + 8) * 2, "f32 results fit");
static_assert(size_t(kBig) * (64 + 4) * 4 <= size_t(4 * kSmall) * (64 + 8) * 2, "f32 results fit");
static_assert(size_t(kBig) * (128 + 4) * 4 <= size_t(2 * kBig) * (128 + 8) * 2, "f32 results fit");
static_assert(size_t(kBig) * (64 + 4) * 4 <= size_t(2 * kBig) * (64 + 8) * 2, "f32 results fit");
static_assert(size_t(2 * kBig) * 16 * 4 <= size_t(2 * kBig) * (kSmall + 8) * 2, "rank weights fit");

// DOCS: compiled for documents (p.starts). A block skips the query tiles whose first query's document starts
// after its last key (not causal: also those before its first key's document); the dQ turns of query tile i
// are then taken by the key tiles from starts[i's first query] / kBig on, which count from 0.
template <class T, int HD, bool DOCS>
__global__ void __launch_bounds__(kThreads, 1) attention_bwd(const Params<T> p) {
  constexpr int LD = HD + 8, LDS = kSmall + 8, QW = kSmall / 2;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kBig * LD;
  T* qdo = vs + kBig * LD;        // pair s: Q at qdo + 2 s kSmall LD, dO after it
  T* dst = qdo + 4 * kSmall * LD;  // buffer s: dS'^T (kBig keys x kSmall queries) at dst + s kBig LDS
  float* stats = reinterpret_cast<float*>(dst + 2 * kBig * LDS);  // pair s: lse at stats + 2 s kSmall, Delta after
  // A turn waits only for blocks earlier in the grid's order. Places are handed out as blocks start (not
  // taken from blockIdx, whose start order CUDA does not promise), so every block waited for is running.
  __shared__ int place;
  if (threadIdx.x == 0) place = atomicAdd(p.ticket, 1);
  __syncthreads();
  const int h = place % int(gridDim.x), kt = place / int(gridDim.x * gridDim.y), warp = threadIdx.x / 32,
            lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = p.b0 + (place / int(gridDim.x)) % int(gridDim.y);
  const int k0 = kt * kBig;
  const int q_tiles = (p.N + kSmall - 1) / kSmall;
  int first = p.causal ? k0 / kSmall : 0, last = q_tiles;
  const int32_t* doc = DOCS ? p.starts + bb * p.N : nullptr;  // this batch entry's starts (N == M)
  if constexpr (DOCS) {
    last = tiles_starting_by(doc, q_tiles, kSmall, min(k0 + kBig, p.M) - 1);
    if (!p.causal) first = doc[k0] / kSmall;
  }
  float stat = 0.f;  // lse (threads < kSmall) or Delta (the next kSmall) of the next query tile's rows
  auto prefetch = [&](int i) {
    const int q0 = i * kSmall;
    T* qt = qdo + 2 * (i & 1) * kSmall * LD;
    copy_rows_async<T, HD, kSmall>(qt, p.q, bb - p.b0, h, p.H, p.N, q0);
    copy_rows_async<T, HD, kSmall>(qt + kSmall * LD, p.dout, bb, h, p.H, p.N, q0);
    cp_async_commit();
    const int n = q0 + int(threadIdx.x) % kSmall;
    stat = threadIdx.x < 2 * kSmall && n < p.N ? (threadIdx.x < kSmall ? p.lse : p.delta)[(bb * p.N + n) * p.H + h]
                                               : 0.f;
  };
  if (first < last) prefetch(last - 1);
  build_global<T, HD, kBig>(ks, p.fk, bb, h, k0);
  build_global<T, HD, kBig>(vs, p.fv, bb, h, k0);

  float dk[HD / 8][4], dv[HD / 8][4];
  zero<HD>(dk);
  zero<HD>(dv);
  const int key_a = k0 + warp * 16 + g;  // this thread's keys: key_a and key_a + 8
  int key_start[2] = {0, 0};             // documents: where their documents start
  if constexpr (DOCS)
#pragma unroll
    for (int e = 0; e < 2; ++e) key_start[e] = doc[min(key_a + 8 * e, p.M - 1)];
  const int dq_row = (warp & 3) * 16, dq_col = (warp >> 2) * (HD / 2);  // this warp's part of dQ
  // dQ / scale = dS' K of query tile i (rows dq_row.., columns dq_col..) added to the workspace in its
  // turn. It runs in the next tile's barrier interval: one barrier a tile pair.
  int* dq_turn = p.dq_turn + ((bb - p.b0) * p.H + h) * q_tiles;
  auto dq_tile = [&](int i) {
    const int seen = poll_turn(dq_turn + i);
    const T* ds = dst + (i & 1) * kBig * LDS;
    float dq[HD / 16][4];
#pragma unroll
    for (int t = 0; t < HD / 16; ++t) dq[t][0] = dq[t][1] = dq[t][2] = dq[t][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kBig / 16; ++kk) {
      uint32_t fa[4];
      load_a_km<LDS>(fa, ds, kk * 16, dq_row);
#pragma unroll
      for (int np = 0; np < HD / 32; ++np) {
        uint32_t fb[4];
        load_b_kn<LD>(fb, ks, kk * 16, dq_col + np * 16);
        mma16816<T>(dq[2 * np], fa, fb[0], fb[1]);
        mma16816<T>(dq[2 * np + 1], fa, fb[2], fb[3]);
      }
    }
    // Every key tile from 0 (documents: from the first that reaches tile i's first document) sees query tile i.
    const int turn = DOCS ? kt - doc[i * kSmall] / kBig : kt;
    wait_turn(dq_turn + i, p.ordered ? turn : 0, seen);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int n = i * kSmall + dq_row + g + rr * 8;
      if (n >= p.N) continue;
      float* row = p.dq + (((bb - p.b0) * p.N + n) * p.H + h) * HD + dq_col + c;
#pragma unroll
      for (int t = 0; t < HD / 16; ++t) atomic_add_vec<2>(row + t * 8, dq[t] + 2 * rr);
    }
  };
  // The tile whose dQ was added before the last barrier: counted by one thread, a tile later than the adds,
  // so that its release rarely waits for them.
  int added = -1;
  auto count_added = [&] {
    if (threadIdx.x == 0 && added >= 0) count_turn(dq_turn + added);
    added = -1;
  };
  for (int i = last - 1; i >= first; --i) {
    const int q0 = i * kSmall;
    const T* qs = qdo + 2 * (i & 1) * kSmall * LD;
    const T* dos = qs + kSmall * LD;
    T* ds = dst + (i & 1) * kBig * LDS;
    float* lse_s = stats + 2 * (i & 1) * kSmall;
    const float* delta_s = lse_s + kSmall;
    if (threadIdx.x < 2 * kSmall) lse_s[threadIdx.x] = stat;  // lse_s, then delta_s
    cp_async_wait<0>();
    __syncthreads();  // tile i and dS'^T of tile i + 1 published; the buffers of tile i + 1 free
    count_added();
    if (i > first) prefetch(i - 1);
    if (i < last - 1) {
      dq_tile(i + 1);
      added = i + 1;
    }
    // The query tile in two halves of QW columns: fewer live registers beside dK and dV.
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const int c0 = part * QW;
      float st[QW / 8][4], dpt[QW / 8][4];
      rows_times_rows_t<T, HD, QW / 8>(st, ks, warp * 16, qs, c0);    // S^T = K Q^T
      rows_times_rows_t<T, HD, QW / 8>(dpt, vs, warp * 16, dos, c0);  // dP^T = V dO^T
      bool mask = q0 + c0 + QW > p.N || k0 + kBig > p.M || (p.causal && k0 + warp * 16 + 15 > q0 + c0);
      if constexpr (DOCS)  // a key before the last query's document, or (not causal) one after the first's
        mask = mask || k0 + warp * 16 < doc[min(q0 + c0 + QW, p.N) - 1] ||
               (!p.causal && doc[min(k0 + warp * 16 + 15, p.M - 1)] > q0 + c0);
      // Base-2 logits; the bounds and the causal rule only where this warp's part of the tile needs them
      // (evaluating them everywhere cost 13% of the pass).
#pragma unroll
      for (int t = 0; t < QW / 8; ++t) {
        const float2 lse = *reinterpret_cast<const float2*>(lse_s + c0 + t * 8 + c);
#pragma unroll
        for (int e = 0; e < 4; ++e) st[t][e] = st[t][e] * p.sl2 - (e & 1 ? lse.y : lse.x);
      }
      if (mask)
#pragma unroll
        for (int t = 0; t < QW / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = q0 + c0 + t * 8 + c + (e & 1), key = key_a + (e >> 1) * 8;
            bool hidden = col >= p.N || key >= p.M || (p.causal && key > col);
            if constexpr (DOCS)
              hidden = hidden || (col < p.N && key < doc[col]) || (!p.causal && key_start[e >> 1] > col);
            if (hidden) st[t][e] = -INFINITY;
          }
#pragma unroll
      for (int t = 0; t < QW / 8; ++t) {
        const float2 delta = *reinterpret_cast<const float2*>(delta_s + c0 + t * 8 + c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = exp2_ftz(st[t][e]);
          st[t][e] = pv;
          dpt[t][e] = pv * (dpt[t][e] - (e & 1 ? delta.y : delta.x));
        }
      }
      probs_times_rows<T, HD, QW / 16>(dv, st, dos, c0);  // dV += P^T dO
      probs_times_rows<T, HD, QW / 16>(dk, dpt, qs, c0);  // dK += dS'^T Q
#pragma unroll
      for (int t = 0; t < QW / 8; ++t) {  // dS'^T, rounded as in dK's product
        const int col = c0 + t * 8 + c;
        *reinterpret_cast<uint32_t*>(ds + (warp * 16 + g) * LDS + col) = pack2<T>(dpt[t][0], dpt[t][1]);
        *reinterpret_cast<uint32_t*>(ds + (warp * 16 + g + 8) * LDS + col) = pack2<T>(dpt[t][2], dpt[t][3]);
      }
    }
  }
  __syncthreads();  // dS'^T of the last tile published; the Q, dO buffers free
  count_added();
  if (first < last) {
    dq_tile(first);
    added = first;
  }
  // The f32 results go through the Q, dO buffers and the K, V tiles; the rank weights of the basis
  // gradients through the dS'^T buffers.
  float* fk = reinterpret_cast<float*>(qdo);
  float* fv = reinterpret_cast<float*>(ks);
  float* wk = reinterpret_cast<float*>(dst);
  float* wv = wk + kBig * p.fk.R;
  store_acc<HD>(fk, dk, warp * 16, p.scale);
  __syncthreads();  // every warp done with K and dS'^T
  count_added();
  store_acc<HD>(fv, dv, warp * 16, 1.f);
  rank_weights(wk, p.fk, bb, h, k0);
  rank_weights(wv, p.fv, bb, h, k0);
  __syncthreads();
  basis_turns<T, HD>(fk, fv, wk, wv, p, bb, h, kt, k0);
}

// dQ (f32 dQ / scale, batch entries from t0 / N) to its factors, a warp per token, every value written once:
// daq[t, h, r] = mul dq[t, h] . bq[t, r] and dbq[t, r, :] = mul sum_h aq[t, h, r] dq[t, h, :], mul = scale / R.
// The token's dq rows are read once per rank; after the first they come from L1.
template <class T, int HD>
__global__ void attention_q_factor_grads(const float* __restrict__ dq, const Pair<T> fq, T* __restrict__ daq,
                                         T* __restrict__ dbq, int64_t t0, int64_t tokens, int H, float mul) {
  constexpr int E = HD / 32;
  const int64_t w = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (w >= tokens) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = t0 + w;
  const int R = fq.R;
  for (int r = 0; r < R; ++r) {
    float b[E], db[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      b[e] = to_acc(fq.b_at(t)[r * HD + lane + 32 * e]);
      db[e] = 0.f;
    }
    for (int h = 0; h < H; ++h) {
      float x[E], dot = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        x[e] = dq[(w * H + h) * HD + lane + 32 * e];
        dot += x[e] * b[e];
      }
      dot = warp_sum(dot);
      const int64_t ai = (t * H + h) * R + r;
      if (lane == 0) daq[ai] = from_acc<T>(dot * mul);
      const float wr = to_acc(fq.a_at(t, h)[r]) * mul;
#pragma unroll
      for (int e = 0; e < E; ++e) db[e] += wr * x[e];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) dbq[(t * R + r) * HD + lane + 32 * e] = from_acc<T>(db[e]);
  }
}

// The same contraction for any pair, ranks G at a time: the token's rows (x, X: f32 for dQ, DkvRow<T> for dK and dV;
// (tokens, H, HD) from token t0) are read once per G ranks, and the G dot products of a row reduced together. The
// same arithmetic in the same order as attention_q_factor_grads. The split backward's three contractions.
template <class T, int HD, class X>
__global__ void rows_factor_grads(const X* __restrict__ x, const Pair<T> f, T* __restrict__ da,
                                  T* __restrict__ db, int64_t t0, int64_t tokens, int H, float mul) {
  constexpr int E = HD / 32, G = 4;
  const int64_t w = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (w >= tokens) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = t0 + w;
  const int R = f.R;
  for (int r0 = 0; r0 < R; r0 += G) {
    float b[G][E], acc[G][E];
#pragma unroll
    for (int u = 0; u < G; ++u)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        b[u][e] = r0 + u < R ? to_acc(f.b_at(t)[(r0 + u) * HD + lane + 32 * e]) : 0.f;
        acc[u][e] = 0.f;
      }
#pragma unroll 2
    for (int h = 0; h < H; ++h) {
      float xv[E], dot[G];
#pragma unroll
      for (int e = 0; e < E; ++e) xv[e] = to_acc(x[(w * H + h) * HD + lane + 32 * e]);
#pragma unroll
      for (int u = 0; u < G; ++u) {
        dot[u] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot[u] += xv[e] * b[u][e];
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2)
#pragma unroll
        for (int u = 0; u < G; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
      const T* ah = f.a_at(t, h);
#pragma unroll
      for (int u = 0; u < G; ++u) {
        if (r0 + u >= R) break;
        if (lane == 0) da[(t * H + h) * R + r0 + u] = from_acc<T>(dot[u] * mul);
        const float wr = to_acc(ah[r0 + u]) * mul;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[u][e] += wr * xv[e];
      }
    }
#pragma unroll
    for (int u = 0; u < G; ++u) {
      if (r0 + u >= R) break;
#pragma unroll
      for (int e = 0; e < E; ++e) db[(t * R + r0 + u) * HD + lane + 32 * e] = from_acc<T>(acc[u][e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Launcher.

// WG: the warpgroup kernel (attention_bwd_wg.cuh) instead of attention_bwd; SPLIT: its split form; TMA: the split
// form fed by a producer warp (attention_bwd_tma.cuh).
template <class T, int HD, bool DOCS, bool WG, bool SPLIT = false, bool TMA = false>
void backward_typed(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                    FactorGrads& g) {
  static_assert(!WG || (HD == 128 && !DOCS), "the warpgroup kernel: D = 128, no documents");
  static_assert(WG || !SPLIT, "the split form is the warpgroup kernel's");
  static_assert(SPLIT || !TMA, "the producer warp feeds the split form");
  const Device dev = a.aq.device();
  cudaStream_t st = stream(dev.index);
  Params<T> p = make_params<T>(a);
  const char* order = std::getenv("LINTAPE_TPA_BWD_ORDER");  // "0": unordered sums, to time the turns
  p.ordered = !(order && std::strcmp(order, "0") == 0);
  const char* rows_env = std::getenv("LINTAPE_TPA_BWD_ROWS");  // "old": build_rows, rows_factor_grads
  const bool old_rows = a.old_rows || (rows_env && std::strcmp(rows_env, "old") == 0);
  const int64_t B = a.aq.size(0), rows = B * p.N * p.H;
  Tensor delta = empty({B, p.N, p.H}, DType::F32, dev);
  attention_delta<T><<<grid_for(rows, kThreads / 32), kThreads, 0, st>>>(
      static_cast<const T*>(out.data()), static_cast<const T*>(dout.data()), delta.data_ptr<float>(), rows, HD);
  LT_CUDA_CHECK_LAUNCH();
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = static_cast<const T*>(dout.data());
  p.delta = delta.data_ptr<float>();
  p.daq = static_cast<T*>(g.aq.data());
  p.dak = static_cast<T*>(g.ak.data());
  p.dav = static_cast<T*>(g.av.data());
  // Per launch of up to `chunk` batch entries: a zeroed f32 workspace, dQ (N H HD a batch entry, summed
  // over key tiles) and the k, v basis gradients (M (R_k + R_v) HD, summed over heads), cast into g.bk,
  // g.bv, then the turns' counters (H query tiles + kChunks a key tile, a batch entry) and the blocks'
  // ticket; and Q (N H HD in T a batch entry). SPLIT: no basis workspaces (the per-token kernel writes g.bk,
  // g.bv) but dK / scale and dV (M H HD each a batch entry, every row written once, not zeroed; in DkvRow<T>, bf16
  // for bf16 factors: 22% less workspace than f32 rows at the model's shape and 1-3% faster, bench/notes/
  // tpa-hopper.md section 10).
  using Row = DkvRow<T>;
  const int64_t dq_len = int64_t(p.N) * p.H * HD, dbk_len = SPLIT ? 0 : int64_t(p.M) * p.fk.R * HD,
                dbv_len = SPLIT ? 0 : int64_t(p.M) * p.fv.R * HD, key_tiles = (p.M + kBig - 1) / kBig,
                turns = p.H * ((p.N + kSmall - 1) / kSmall) + key_tiles * kChunks + 1,
                ws_len = dq_len + dbk_len + dbv_len + turns, rows_len = SPLIT ? int64_t(p.M) * p.H * HD : 0;
  // TMA: K and V rows too (M H HD in T each a batch entry), built beforehand and brought in by the producer. With
  // bf16 rows, dK and dV overwrite them: a block loads its own K and V tile (its keys, one head) once, waits for it
  // before its first product, and writes dK and dV for those keys and that head at its end; no other block reads
  // them. That leaves 15 instead of 21 MiB a batch entry at the model's shape: four launches instead of six, and the
  // backward 5% faster there (H200; bench/notes/tpa-hopper.md section 12).
  const int64_t kv_len = TMA ? int64_t(p.M) * p.H * HD : 0;
  constexpr bool dkv_in_kv = TMA && std::is_same<Row, T>::value;
  const int64_t own_rows = dkv_in_kv ? 0 : rows_len;
  const int64_t entry_bytes = ws_len * 4 + 2 * own_rows * int64_t(sizeof(Row)) + (dq_len + 2 * kv_len) * 2;
  const int64_t launches =
      batch_launches(B, entry_bytes, B * dq_len * 2, key_tiles * p.H, dev.index, a.batch_per_launch);
  const int64_t chunk = (B + launches - 1) / launches;
  Tensor ws = empty({chunk * ws_len}, DType::F32, dev);
  const DType row_dtype = sizeof(Row) == 4 ? DType::F32 : DType::BF16;
  Tensor rows_ws = own_rows ? empty({chunk * 2 * own_rows}, row_dtype, dev) : Tensor();
  Tensor qbuf = empty({chunk * dq_len}, a.aq.dtype(), dev);
  Tensor kbuf = TMA ? empty({chunk * kv_len}, a.aq.dtype(), dev) : Tensor();
  Tensor vbuf = TMA ? empty({chunk * kv_len}, a.aq.dtype(), dev) : Tensor();
  p.q = static_cast<const T*>(qbuf.data());
  CUtensorMap tq{}, tdo{}, tk{}, tv{}, tdq{};  // TMA: Q, K, V and the dQ workspace of the launch's entries, dO of all
  if constexpr (TMA) {
    constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    tdq = f32_rows_tensor_map(ws.data(), chunk, p.N, p.H, HD, kSmall);  // every launch's dQ starts at ws
    tq = rows_tensor_map(qbuf.data(), chunk, p.N, p.H, HD, bf16, kSmall);
    tdo = rows_tensor_map(dout.data(), B, p.N, p.H, HD, bf16, kSmall);
    tk = rows_tensor_map(kbuf.data(), chunk, p.M, p.H, HD, bf16, kBig);
    tv = rows_tensor_map(vbuf.data(), chunk, p.M, p.H, HD, bf16, kBig);
  }
  static bool configured = false;
  if constexpr (TMA) {
    allow_smem(attention_bwd_tma::backward<T, HD>, attention_bwd_tma::smem_bytes<HD>(), configured);
  } else if constexpr (WG) {
    allow_smem(attention_bwd_wg::backward<T, HD, SPLIT>, attention_bwd_wg::smem_bytes<HD>(), configured);
  } else {
    allow_smem(attention_bwd<T, HD, DOCS>, bwd_smem<HD>(), configured);
  }
  for (int64_t l = 0, b0 = 0; l < launches; ++l) {
    const int64_t n = B / launches + (l < B % launches ? 1 : 0), tokens = n * p.N;
    p.b0 = b0;
    p.dq = ws.data_ptr<float>();
    p.dbk = p.dq + n * dq_len;
    p.dbv = p.dbk + n * dbk_len;
    p.dq_turn = reinterpret_cast<int*>(p.dbv + n * dbv_len);
    p.db_turn = p.dq_turn + n * p.H * ((p.N + kSmall - 1) / kSmall);
    p.ticket = p.db_turn + n * key_tiles * kChunks;
    if constexpr (dkv_in_kv) {
      p.dk_rows = reinterpret_cast<Row*>(kbuf.data());
      p.dv_rows = reinterpret_cast<Row*>(vbuf.data());
    } else if constexpr (SPLIT) {
      p.dk_rows = static_cast<Row*>(rows_ws.data());
      p.dv_rows = p.dk_rows + n * rows_len;
    }
    LT_CUDA_CHECK(cudaMemsetAsync(p.dq, 0, size_t(n * ws_len) * 4, st));
    const int64_t keys = n * p.M;
    if (old_rows) {
      build_rows<T, HD><<<grid_for(tokens * (HD / 8), kThreads), kThreads, 0, st>>>(
          p.fq, static_cast<T*>(qbuf.data()), b0 * p.N, tokens, p.H);
      LT_CUDA_CHECK_LAUNCH();
      if constexpr (TMA) {
        build_rows<T, HD><<<grid_for(keys * (HD / 8), kThreads), kThreads, 0, st>>>(
            p.fk, static_cast<T*>(kbuf.data()), b0 * p.M, keys, p.H);
        LT_CUDA_CHECK_LAUNCH();
        build_rows<T, HD><<<grid_for(keys * (HD / 8), kThreads), kThreads, 0, st>>>(
            p.fv, static_cast<T*>(vbuf.data()), b0 * p.M, keys, p.H);
        LT_CUDA_CHECK_LAUNCH();
      }
    } else {  // Q (and with TMA K and V) in one launch
      using attention_rows::RowsJob;
      const RowsJob<T> jq{p.fq, static_cast<T*>(qbuf.data()), b0 * p.N, tokens},
          jk{p.fk, TMA ? static_cast<T*>(kbuf.data()) : nullptr, b0 * p.M, keys},
          jv{p.fv, TMA ? static_cast<T*>(vbuf.data()) : nullptr, b0 * p.M, keys};
      attention_rows::launch_build_rows<T, HD>(jq, jk, jv, p.H, st);
    }
    const dim3 grid(unsigned(p.H), unsigned(n), unsigned(key_tiles));
    if constexpr (TMA) {
      constexpr size_t smem = attention_bwd_tma::smem_bytes<HD>();
      attention_bwd_tma::backward<T, HD><<<grid, attention_tma::kTmaThreads, smem, st>>>(p, tq, tdo, tk, tv, tdq);
    } else if constexpr (WG) {
      attention_bwd_wg::backward<T, HD, SPLIT><<<grid, kThreads, attention_bwd_wg::smem_bytes<HD>(), st>>>(p);
    } else {
      attention_bwd<T, HD, DOCS><<<grid, kThreads, bwd_smem<HD>(), st>>>(p);
    }
    LT_CUDA_CHECK_LAUNCH();
    if constexpr (SPLIT) {
      if (!old_rows) {  // dQ, dK (dK / scale, as dQ) and dV in one launch
        using attention_rows::GradsJob;
        T* const dbq = static_cast<T*>(g.bq.data());
        const GradsJob<T> jq{p.dq, p.fq, p.daq, dbq, b0 * p.N, tokens, p.fq.inv_r * p.scale};
        const GradsJob<T, Row> jk{p.dk_rows, p.fk, p.dak, static_cast<T*>(g.bk.data()), b0 * p.M, keys,
                                p.fk.inv_r * p.scale},
            jv{p.dv_rows, p.fv, p.dav, static_cast<T*>(g.bv.data()), b0 * p.M, keys, p.fv.inv_r};
        attention_rows::launch_factor_grads<T, HD>(jq, jk, jv, p.H, st);
      } else {  // dK is dK / scale, as dQ
        rows_factor_grads<T, HD><<<grid_for(tokens, kWarps), kThreads, 0, st>>>(
            p.dq, p.fq, p.daq, static_cast<T*>(g.bq.data()), b0 * p.N, tokens, p.H, p.fq.inv_r * p.scale);
        LT_CUDA_CHECK_LAUNCH();
        rows_factor_grads<T, HD><<<grid_for(keys, kWarps), kThreads, 0, st>>>(
            p.dk_rows, p.fk, p.dak, static_cast<T*>(g.bk.data()), b0 * p.M, keys, p.H, p.fk.inv_r * p.scale);
        LT_CUDA_CHECK_LAUNCH();
        rows_factor_grads<T, HD><<<grid_for(keys, kWarps), kThreads, 0, st>>>(
            p.dv_rows, p.fv, p.dav, static_cast<T*>(g.bv.data()), b0 * p.M, keys, p.H, p.fv.inv_r);
        LT_CUDA_CHECK_LAUNCH();
      }
    } else {
      attention_q_factor_grads<T, HD><<<grid_for(tokens, kWarps), kThreads, 0, st>>>(
          p.dq, p.fq, p.daq, static_cast<T*>(g.bq.data()), b0 * p.N, tokens, p.H, p.fq.inv_r * p.scale);
      LT_CUDA_CHECK_LAUNCH();
      Tensor dbk = g.bk.narrow(0, b0, n), dbv = g.bv.narrow(0, b0, n);
      dbk.copy_(ws.narrow(0, n * dq_len, n * dbk_len).view(dbk.shape()));
      dbv.copy_(ws.narrow(0, n * (dq_len + dbk_len), n * dbv_len).view(dbv.shape()));
    }
    b0 += n;
  }
}

}  // namespace

namespace {
template <bool DOCS>
void backward_dispatch(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                       FactorGrads& g) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16)
    wide ? backward_typed<__nv_bfloat16, 128, DOCS, false>(a, out, lse, dout, g)
         : backward_typed<__nv_bfloat16, 64, DOCS, false>(a, out, lse, dout, g);
  else
    wide ? backward_typed<__half, 128, DOCS, false>(a, out, lse, dout, g)
         : backward_typed<__half, 64, DOCS, false>(a, out, lse, dout, g);
}

// LINTAPE_TPA_BWD's kernel, else Auto.
BackwardKernel backward_kernel_from_env() {
  const char* env = std::getenv("LINTAPE_TPA_BWD");
  if (!env) return BackwardKernel::Auto;
  const std::string e = env;
  if (e == "mma") return BackwardKernel::MmaSync;
  if (e == "wgmma") return BackwardKernel::Warpgroup;
  if (e == "wgmma-split") return BackwardKernel::WarpgroupSplit;
  if (e == "tma") return BackwardKernel::WarpgroupTma;
  LT_CHECK(false, "[tpa_attention] LINTAPE_TPA_BWD is mma, wgmma, wgmma-split or tma; got ", e);
  return BackwardKernel::Auto;
}
}  // namespace

std::vector<BackwardKernel> backward_kernels(int device) {
  if (!wgmma_runs(device)) return {BackwardKernel::MmaSync};
  return {BackwardKernel::MmaSync, BackwardKernel::Warpgroup, BackwardKernel::WarpgroupSplit,
          BackwardKernel::WarpgroupTma};
}

void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        FactorGrads& g) {
  if (a.starts.defined()) return backward_dispatch<true>(a, out, lse, dout, g);
  BackwardKernel k = a.backward_kernel == BackwardKernel::Auto ? backward_kernel_from_env() : a.backward_kernel;
  const std::vector<BackwardKernel> ok = backward_kernels(a.aq.device().index);
  if (k == BackwardKernel::Auto) k = BackwardKernel::WarpgroupTma;  // where it runs: fastest at every shape measured
  if (k == BackwardKernel::MmaSync || a.bq.size(3) != 128 || std::find(ok.begin(), ok.end(), k) == ok.end())
    return backward_dispatch<false>(a, out, lse, dout, g);
  const bool bf16 = a.aq.dtype() == DType::BF16;
  // The tensor copies read dO in place: its rows 16-byte aligned, else the same form without them.
  if (k == BackwardKernel::WarpgroupTma && reinterpret_cast<uintptr_t>(dout.data()) % 16 != 0)
    k = BackwardKernel::WarpgroupSplit;
  if (k == BackwardKernel::WarpgroupTma)
    bf16 ? backward_typed<__nv_bfloat16, 128, false, true, true, true>(a, out, lse, dout, g)
         : backward_typed<__half, 128, false, true, true, true>(a, out, lse, dout, g);
  else if (k == BackwardKernel::WarpgroupSplit)
    bf16 ? backward_typed<__nv_bfloat16, 128, false, true, true>(a, out, lse, dout, g)
         : backward_typed<__half, 128, false, true, true>(a, out, lse, dout, g);
  else
    bf16 ? backward_typed<__nv_bfloat16, 128, false, true>(a, out, lse, dout, g)
         : backward_typed<__half, 128, false, true>(a, out, lse, dout, g);
}

}  // namespace lintape::tpa_cuda
