// Fused TPA attention on tensor cores (mma.sync m16n8k16, 16-bit inputs, f32 accumulation), forward and
// backward in the flash-attention 2 layout: 8 warps, each owning 16 rows of its block's tile; scores,
// probabilities and the accumulators stay in registers (an S accumulator pair is the next multiply's A
// fragment); online softmax in f32, base 2 (scale log2 e folded in, lse stored in base 2).
//
// q, k and v are never saved: x[i, :] = (1/R) sum_r a[i, h, r] b[i, r, :] in f32, rounded once, is built
// from the factors where it is used (ops/tpa/attention_parts.cuh). The tile a block owns is built in
// shared memory; the repeated tiles are built once per launch into a workspace that lives for that launch
// (a part of the batch at a time: see batch_launches) and copied tile by tile by cp.async.
//   forward (this file): K and V built; query tile of 256 rows (32 a warp); per key tile of 64:
//            S = Q K^T, online softmax, O = alpha O + P V. On Hopper built for sm_90a (the default there
//            without documents), the same on warpgroup products fed by a TMA producer warp
//            (ops/tpa/attention_tma.cuh); the first warpgroup version (attention_wg.cuh) on request.
//   backward (ops/tpa/attention_bwd.cu): Delta = rowsum(dO o O) and Q once, then one pass over key tiles
//            of 128; on Hopper (sm_90a, D = 128, the default there without documents) on warpgroup products.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include "ops/tpa/attention_parts.cuh"
#include "ops/tpa/attention_rows.cuh"
#include "ops/tpa/attention_tma.cuh"

namespace lintape::tpa_cuda {

namespace {
using namespace attention_parts;

// ---------------------------------------------------------------------------------------------------
// Forward: a block per (query tile of kQueryRows rows, head, batch entry); causal tiles heaviest first. A
// warp owns kRowBlocks blocks of 16 query rows, so every K and V fragment read from shared memory feeds
// kRowBlocks products (shared-memory reads, not the tensor cores, bound the single-block layout). K and V
// of the launch's batch entries are built beforehand (build_rows); their tiles of kSmall rows are
// double-buffered: tile j + 1 is copied by cp.async while tile j is multiplied, one barrier a tile.

constexpr int kRowBlocks = 2;  // 255 registers at HD = 128 with 52 bytes spilled; 12% faster than one
constexpr int kQueryRows = 16 * kRowBlocks * kWarps;

// acc[rb][n] and acc[rb][n + 1] += a[rb] times the B fragments of n-tiles n and n + 1, for every row block.
template <class T, int RB, int NT>
__device__ __forceinline__ void mma_row_blocks(float (&acc)[RB][NT][4], int n, const uint32_t (&a)[RB][4],
                                               const uint32_t (&fb)[4]) {
#pragma unroll
  for (int rb = 0; rb < RB; ++rb) {
    mma16816<T>(acc[rb][n], a[rb], fb[0], fb[1]);
    mma16816<T>(acc[rb][n + 1], a[rb], fb[2], fb[3]);
  }
}

template <int HD>
constexpr size_t fwd_smem() {
  return size_t(kQueryRows + 4 * kSmall) * (HD + 8) * 2;  // Q, then two K, V pairs
}

// DOCS: compiled for documents (p.starts). The key tiles before the document of the tile's first query are
// skipped (not causal: also those after the document of its last query); a warp skips the tiles none of its
// rows sees, and masks per element the tiles that cross a boundary of its rows' documents.
template <class T, int HD, bool DOCS>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd(const Params<T> p) {
  constexpr int LD = HD + 8, RB = kRowBlocks;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* kv = qs + kQueryRows * LD;  // pair s: K at kv + 2 s kSmall LD, V after it
  const int nq = (p.N + kQueryRows - 1) / kQueryRows;
  const int qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = p.b0 + blockIdx.z;
  const int q0 = qt * kQueryRows;
  const int kv_all = (p.M + kSmall - 1) / kSmall;
  int tiles = p.causal ? min(kv_all, (q0 + kQueryRows + kSmall - 1) / kSmall) : kv_all;
  int j_first = 0;
  const int32_t* doc = DOCS ? p.starts + bb * p.N : nullptr;  // this batch entry's starts (N == M)
  if constexpr (DOCS) {
    j_first = doc[q0] / kSmall;
    if (!p.causal) tiles = tiles_starting_by(doc, kv_all, kSmall, min(q0 + kQueryRows, p.N) - 1);
  }
  auto prefetch = [&](int j) {
    T* kt = kv + 2 * (j & 1) * kSmall * LD;
    copy_rows_async<T, HD, kSmall>(kt, p.k, blockIdx.z, h, p.H, p.M, j * kSmall);
    copy_rows_async<T, HD, kSmall>(kt + kSmall * LD, p.v, blockIdx.z, h, p.H, p.M, j * kSmall);
    cp_async_commit();
  };
  if (tiles > j_first) prefetch(j_first);
  // Q carries the scale's sign, so the scores times |scale log2 e| are the logits and their row maxima
  // can be taken before scaling.
  Pair<T> fq = p.fq;
  if (p.scale < 0) fq.inv_r = -fq.inv_r;
  build_global<T, HD, kQueryRows, 4>(qs, fq, bb, h, q0);
  const float sl2 = fabsf(p.sl2);
  cp_async_wait<0>();
  __syncthreads();  // Q and the first K, V tiles published
  const int r0 = warp * 16 * RB;  // this warp's first row in the tile; a thread's rows: r0 + 16 rb + g (+ 8)
  const int last_row = q0 + r0 + 16 * RB - 1;
  // Documents: the start of this warp's first row's document (its rows see no key before it).
  const int warp_start = DOCS ? doc[min(q0 + r0, p.N - 1)] : 0;
  float o[RB][HD / 8][4];
  float m[RB][2], l[RB][2];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb) {
    zero<HD>(o[rb]);
    m[rb][0] = m[rb][1] = -INFINITY;
    l[rb][0] = l[rb][1] = 0.f;
  }
  for (int j = j_first; j < tiles; ++j) {
    if (j > j_first) {
      cp_async_wait<0>();
      __syncthreads();  // tile j published; every warp is done with tile j - 1, whose pair is free
    }
    if (j + 1 < tiles) prefetch(j + 1);
    const int k0 = j * kSmall;
    if (p.causal && k0 > last_row) continue;  // above all of this warp's rows
    if constexpr (DOCS) {  // before every document of this warp's rows, or (not causal) after
      if (k0 + kSmall <= warp_start || (!p.causal && doc[k0] > min(last_row, p.N - 1))) continue;
    }
    const T* ks = kv + 2 * (j & 1) * kSmall * LD;
    float s[RB][8][4];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int t = 0; t < 8; ++t) s[rb][t][0] = s[rb][t][1] = s[rb][t][2] = s[rb][t][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t qa[RB][4];
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) load_a<LD>(qa[rb], qs, r0 + 16 * rb, kk * 16);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t fb[4];
        load_b_nk<LD>(fb, ks, np * 16, kk * 16);
        mma_row_blocks<T>(s, 2 * np, qa, fb);
      }
    }
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
      const int row_a = q0 + r0 + 16 * rb + g;
      bool mask = k0 + kSmall > p.M || (p.causal && k0 + kSmall - 1 > q0 + r0 + 16 * rb);
      if constexpr (DOCS)  // a key before the last row's document, or (not causal) one after the first row's
        mask = mask || k0 < doc[min(q0 + r0 + 16 * rb + 15, p.N - 1)] ||
               (!p.causal && doc[min(k0 + kSmall, p.M) - 1] > q0 + r0 + 16 * rb);
      if (mask) {
        int row_start[2] = {0, 0};
        if constexpr (DOCS)
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) row_start[rr] = doc[min(row_a + rr * 8, p.N - 1)];
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = k0 + t * 8 + c + (e & 1), row = row_a + (e >> 1) * 8;
            bool hidden = col >= p.M || (p.causal && col > row);
            if constexpr (DOCS)
              hidden = hidden || col < row_start[e >> 1] || (!p.causal && col < p.M && doc[col] > row);
            if (hidden) s[rb][t][e] = -INFINITY;
          }
      }
      // p = 2^(s |scale| log2 e - m): one FFMA and one MUFU an element.
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float mx = -INFINITY;
#pragma unroll
        for (int t = 0; t < 8; ++t) mx = fmaxf(mx, fmaxf(s[rb][t][2 * rr], s[rb][t][2 * rr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[rb][rr], mx * sl2);
        const float base = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2_ftz(m[rb][rr] - base);
        m[rb][rr] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          s[rb][t][2 * rr] = exp2_ftz(fmaf(s[rb][t][2 * rr], sl2, -base));
          s[rb][t][2 * rr + 1] = exp2_ftz(fmaf(s[rb][t][2 * rr + 1], sl2, -base));
          sum += s[rb][t][2 * rr] + s[rb][t][2 * rr + 1];
        }
        l[rb][rr] = l[rb][rr] * alpha + sum;
#pragma unroll
        for (int e = 0; e < HD / 8; ++e) {
          o[rb][e][2 * rr] *= alpha;
          o[rb][e][2 * rr + 1] *= alpha;
        }
      }
    }
    // O += P V: each V fragment feeds every row block.
    const T* vs = ks + kSmall * LD;
#pragma unroll
    for (int kk = 0; kk < kSmall / 16; ++kk) {
      uint32_t pa[RB][4];
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) {
        pa[rb][0] = pack2<T>(s[rb][2 * kk][0], s[rb][2 * kk][1]);
        pa[rb][1] = pack2<T>(s[rb][2 * kk][2], s[rb][2 * kk][3]);
        pa[rb][2] = pack2<T>(s[rb][2 * kk + 1][0], s[rb][2 * kk + 1][1]);
        pa[rb][3] = pack2<T>(s[rb][2 * kk + 1][2], s[rb][2 * kk + 1][3]);
      }
#pragma unroll
      for (int ep = 0; ep < HD / 16; ++ep) {
        uint32_t fb[4];
        load_b_kn<LD>(fb, vs, kk * 16, ep * 16);
        mma_row_blocks<T>(o, 2 * ep, pa, fb);
      }
    }
  }
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      l[rb][rr] += __shfl_xor_sync(0xffffffffu, l[rb][rr], 1);
      l[rb][rr] += __shfl_xor_sync(0xffffffffu, l[rb][rr], 2);
      const int n = q0 + r0 + 16 * rb + g + rr * 8;
      if (n >= p.N) continue;
      const float inv = 1.f / l[rb][rr];
      T* orow = p.out + ((bb * p.N + n) * p.H + h) * HD + c;
#pragma unroll
      for (int e = 0; e < HD / 8; ++e)
        *reinterpret_cast<uint32_t*>(orow + e * 8) = pack2<T>(o[rb][e][2 * rr] * inv, o[rb][e][2 * rr + 1] * inv);
      if ((lane & 3) == 0) p.lse[(bb * p.N + n) * p.H + h] = m[rb][rr] + log2f(l[rb][rr]);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Launcher: per launch of up to `chunk` batch entries, K and V (entries, M, H, HD) built from their
// factors into a workspace, then the attention over them.

namespace {
// (entries, L, H, HD) rows of `bytes`-byte elements as a 4-D tensor map, boxes of 128 bytes of a row x `rows`
// rows of one head, with the 128-byte swizzle.
CUtensorMap head_rows_map(const void* x, int64_t entries, int L, int H, int HD, CUtensorMapDataType type, int bytes,
                          int rows) {
  const cuuint64_t b = cuuint64_t(bytes);
  const cuuint64_t dims[4] = {cuuint64_t(HD), cuuint64_t(H), cuuint64_t(L), cuuint64_t(entries)};
  const cuuint64_t strides[3] = {cuuint64_t(HD) * b, cuuint64_t(H) * HD * b, cuuint64_t(L) * H * HD * b};
  const cuuint32_t box[4] = {cuuint32_t(128 / bytes), 1, cuuint32_t(rows), 1};
  return swizzled_tensor_map(x, type, 4, dims, strides, box, "tpa_attention");
}
}  // namespace

CUtensorMap rows_tensor_map(const void* x, int64_t entries, int L, int H, int HD, bool bf16, int rows) {
  static_assert(attention_tma::kBox == 64, "a box: 64 16-bit columns");
  return head_rows_map(x, entries, L, H, HD, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                       2, rows);
}

CUtensorMap f32_rows_tensor_map(const void* x, int64_t entries, int L, int H, int HD, int rows) {
  return head_rows_map(x, entries, L, H, HD, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, rows);
}

namespace {

template <class T, int HD, ForwardKernel K, bool DOCS>
void forward_typed(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  static_assert(K == ForwardKernel::MmaSync || !DOCS, "only the mma.sync kernel takes documents");
  constexpr bool pingpong = K == ForwardKernel::WarpgroupPingPong || K == ForwardKernel::WarpgroupPersistentPingPong;
  constexpr bool persistent =
      K == ForwardKernel::WarpgroupPersistent || K == ForwardKernel::WarpgroupPersistentPingPong;
  constexpr bool tma = persistent || K == ForwardKernel::WarpgroupTma || K == ForwardKernel::WarpgroupPingPong;
  Params<T> p = make_params<T>(a);
  p.out = static_cast<T*>(out.data());
  p.lse = lse.data_ptr<float>();
  const Device dev = a.aq.device();
  cudaStream_t st = stream(dev.index);
  constexpr int rows = K == ForwardKernel::MmaSync ? kQueryRows : attention_wg::kWgRows;
  const int64_t B = a.aq.size(0), kv_len = int64_t(p.M) * p.H * HD, query_tiles = (p.N + rows - 1) / rows;
  const int64_t launches =
      batch_launches(B, 2 * kv_len * int64_t(sizeof(T)), B * p.N * p.H * HD * int64_t(sizeof(T)), query_tiles * p.H,
                     dev.index, a.batch_per_launch);
  const int64_t chunk = (B + launches - 1) / launches;
  Tensor kv = empty({2 * chunk * kv_len}, a.aq.dtype(), dev);
  T* k = static_cast<T*>(kv.data());
  T* v = k + chunk * kv_len;
  p.k = k;
  p.v = v;
  CUtensorMap tq{}, tk{}, tv{};
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (tma) {
    tk = rows_tensor_map(k, chunk, p.M, p.H, HD, bf16, attention_wg::kWgKeys);
    tv = rows_tensor_map(v, chunk, p.M, p.H, HD, bf16, attention_wg::kWgKeys);
  }
  if constexpr (persistent) tq = rows_tensor_map(p.out, B, p.N, p.H, HD, bf16, attention_wg::kWgKeys);
  Pair<T> fq = p.fq;
  if (p.scale < 0) fq.inv_r = -fq.inv_r;  // Q carries the scale's sign (as in the kernels that build it)
  int blocks = sm_count(dev.index);  // the persistent grid: one block an SM
  if (a.persistent_blocks > 0) blocks = std::min(blocks, a.persistent_blocks);
  static bool configured = false;
  size_t smem = 0;
  if constexpr (tma) {
    smem = attention_tma::smem_bytes<HD>();
    allow_smem(attention_tma::forward<T, HD, pingpong, persistent>, smem, configured);
  } else if constexpr (K == ForwardKernel::Warpgroup) {
    smem = attention_wg::smem_bytes<HD>();
    allow_smem(attention_wg::forward<T, HD>, smem, configured);
  } else {
    smem = fwd_smem<HD>();
    allow_smem(attention_fwd<T, HD, DOCS>, smem, configured);
  }
  const char* rows_env = std::getenv("LINTAPE_TPA_FWD_ROWS");  // "old": one build_rows launch a factor
  const bool old_rows = a.old_rows || (rows_env && std::strcmp(rows_env, "old") == 0);
  for (int64_t l = 0, b0 = 0; l < launches; ++l) {
    const int64_t n = B / launches + (l < B % launches ? 1 : 0), tokens = n * p.M;
    p.b0 = b0;
    // K and V rows (and for the persistent kernels Q's, into the output's rows of these entries, read back by TMA).
    T* q_rows = persistent ? p.out + b0 * p.N * p.H * HD : nullptr;
    if (old_rows) {
      const unsigned build_blocks = grid_for(tokens * (HD / 8), kThreads);
      build_rows<T, HD><<<build_blocks, kThreads, 0, st>>>(p.fk, k, b0 * p.M, tokens, p.H);
      LT_CUDA_CHECK_LAUNCH();
      build_rows<T, HD><<<build_blocks, kThreads, 0, st>>>(p.fv, v, b0 * p.M, tokens, p.H);
      LT_CUDA_CHECK_LAUNCH();
      if (q_rows) {
        build_rows<T, HD><<<grid_for(n * p.N * (HD / 8), kThreads), kThreads, 0, st>>>(fq, q_rows, b0 * p.N, n * p.N,
                                                                                      p.H);
        LT_CUDA_CHECK_LAUNCH();
      }
    } else {
      using attention_rows::RowsJob;
      attention_rows::launch_build_rows<T, HD>(RowsJob<T>{fq, q_rows, b0 * p.N, q_rows ? n * p.N : 0},
                                               RowsJob<T>{p.fk, k, b0 * p.M, tokens},
                                               RowsJob<T>{p.fv, v, b0 * p.M, tokens}, p.H, st);
    }
    const dim3 grid(unsigned(query_tiles), unsigned(p.H), unsigned(n));
    const int items = int(query_tiles * p.H * n);
    if constexpr (tma)
      attention_tma::forward<T, HD, pingpong, persistent>
          <<<persistent ? std::min(items, blocks) : items, attention_tma::kTmaThreads, smem, st>>>(p, tq, tk, tv,
                                                                                                 items, int(n));
    else if constexpr (K == ForwardKernel::Warpgroup)
      attention_wg::forward<T, HD><<<grid, kThreads, smem, st>>>(p);
    else
      attention_fwd<T, HD, DOCS><<<grid, kThreads, smem, st>>>(p);
    LT_CUDA_CHECK_LAUNCH();
    b0 += n;
  }
}

}  // namespace

std::string attention_unsupported(DType dtype, int64_t D, int64_t E, int64_t Rq, int64_t Rk, int64_t Rv) {
  if (dtype != DType::BF16 && dtype != DType::F16)
    return str("bf16 or f16 factors (tensor cores); got ", dtype_name(dtype));
  if (D != E || (D != 64 && D != 128)) return str("D == E, 64 or 128; got D = ", D, ", E = ", E);
  if (Rq > 16 || Rk > 16 || Rv > 16) return str("ranks up to 16; got (", Rq, ", ", Rk, ", ", Rv, ")");
  return "";
}

namespace {
template <ForwardKernel K, bool DOCS>
void forward_dispatch(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  const bool bf16 = a.aq.dtype() == DType::BF16;
  const bool wide = a.bq.size(3) == 128;
  if (bf16)
    wide ? forward_typed<__nv_bfloat16, 128, K, DOCS>(a, out, lse)
         : forward_typed<__nv_bfloat16, 64, K, DOCS>(a, out, lse);
  else
    wide ? forward_typed<__half, 128, K, DOCS>(a, out, lse) : forward_typed<__half, 64, K, DOCS>(a, out, lse);
}

// Auto's kernel for N queries where the device runs the warpgroup kernels: the fastest measured on an H200
// (bench/notes/tpa-hopper.md, section 3), ping-pong at N = 2048 (6-7% ahead), the producer warp alone at
// N = 8192 (4-5% ahead).
ForwardKernel default_warpgroup_kernel(int64_t N) {
  return N <= 2048 ? ForwardKernel::WarpgroupPingPong : ForwardKernel::WarpgroupTma;
}

// LINTAPE_TPA_FWD's kernel, else Auto.
ForwardKernel kernel_from_env() {
  const char* env = std::getenv("LINTAPE_TPA_FWD");
  if (!env) return ForwardKernel::Auto;
  const std::string e = env;
  if (e == "mma") return ForwardKernel::MmaSync;
  if (e == "wgmma") return ForwardKernel::Warpgroup;
  if (e == "tma") return ForwardKernel::WarpgroupTma;
  if (e == "pingpong") return ForwardKernel::WarpgroupPingPong;
  if (e == "persist") return ForwardKernel::WarpgroupPersistent;
  if (e == "persist-pingpong") return ForwardKernel::WarpgroupPersistentPingPong;
  LT_CHECK(false, "[tpa_attention] LINTAPE_TPA_FWD is mma, wgmma, tma, pingpong, persist or persist-pingpong; got ", e);
  return ForwardKernel::Auto;
}
}  // namespace

std::vector<ForwardKernel> forward_kernels(int device) {
  if (!wgmma_runs(device)) return {ForwardKernel::MmaSync};
  return {ForwardKernel::MmaSync,      ForwardKernel::Warpgroup,           ForwardKernel::WarpgroupTma,
          ForwardKernel::WarpgroupPingPong, ForwardKernel::WarpgroupPersistent,
          ForwardKernel::WarpgroupPersistentPingPong};
}

void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  // Documents run the mma.sync kernel: the warpgroup kernels take none.
  if (a.starts.defined()) return forward_dispatch<ForwardKernel::MmaSync, true>(a, out, lse);
  const int device = a.aq.device().index;
  ForwardKernel k = a.forward_kernel == ForwardKernel::Auto ? kernel_from_env() : a.forward_kernel;
  const std::vector<ForwardKernel> ok = forward_kernels(device);
  if (k == ForwardKernel::Auto) k = default_warpgroup_kernel(a.aq.size(1));
  if (std::find(ok.begin(), ok.end(), k) == ok.end()) k = ForwardKernel::MmaSync;
  switch (k) {
    case ForwardKernel::Warpgroup:
      return forward_dispatch<ForwardKernel::Warpgroup, false>(a, out, lse);
    case ForwardKernel::WarpgroupTma:
      return forward_dispatch<ForwardKernel::WarpgroupTma, false>(a, out, lse);
    case ForwardKernel::WarpgroupPingPong:
      return forward_dispatch<ForwardKernel::WarpgroupPingPong, false>(a, out, lse);
    case ForwardKernel::WarpgroupPersistent:
      return forward_dispatch<ForwardKernel::WarpgroupPersistent, false>(a, out, lse);
    case ForwardKernel::WarpgroupPersistentPingPong:
      return forward_dispatch<ForwardKernel::WarpgroupPersistentPingPong, false>(a, out, lse);
    default:
      return forward_dispatch<ForwardKernel::MmaSync, false>(a, out, lse);
  }
}

}  // namespace lintape::tpa_cuda
