// Fused TPA attention on tensor cores (mma.sync m16n8k16, 16-bit inputs, f32 accumulation), forward and
// backward in the flash-attention 2 layout: 8 warps, each owning 16 rows of its block's tile; scores,
// probabilities and the accumulators stay in registers (an S accumulator pair is the next multiply's A
// fragment); online softmax in f32, base 2 (scale log2 e folded in, lse stored in base 2).
//
// k and v never exist in global memory, q only as a workspace of the backward (for a third of the batch at
// a time) and never saved: a tile is built in shared memory from its factors,
// x[i, :] = (1/R) sum_r a[i, h, r] b[i, r, :] in f32, rounded once (ops/tpa_attention_parts.cuh). The
// repeated tiles are pipelined: the next tile's basis rows (contiguous over tokens, shared by all heads)
// go global -> shared by cp.async and its mixing values into registers while the current tile is
// multiplied; ranks too large for the stage area build straight from global memory.
//   forward (this file): query tile of 128 rows; per key tile of 64: S = Q K^T, online softmax,
//            O = alpha O + P V. It keeps two K, V pairs and builds tile j + 1 between the products of
//            tile j, so the builds overlap the tensor-core work.
//   backward (ops/tpa_attention_bwd.cu): Delta = rowsum(dO o O) and Q once, then one pass over key tiles
//            of 128.
#include "ops/tpa_attention_parts.cuh"

namespace lintape::tpa_cuda {

namespace {
using namespace attention_parts;

// The repeated K and V tiles of the forward: staged (prefetch, then build) or built from
// global memory. Shared memory: mix_s (kMixMax f32), stage, and two K, V pairs (kv).
template <class T, int HD>
struct KvTiles {
  static constexpr int LD = HD + 8, SLOTS = kMixMax / kThreads;
  T* kv;  // two K, V pairs
  float* mix_s;
  T* stage;
  float mix[SLOTS];
  // What each of this thread's mixing slots (slot thread + s kThreads of mix_s) stages, the same for every
  // tile: K's value (row, rank) = (slot / R_k, slot % R_k) below kSmall R_k, then V's; its row (kSmall: none)
  // and offset from the tile's first value; bit s of mix_v: a V value.
  int mix_row[SLOTS], mix_off[SLOTS];
  uint32_t mix_v;
  Pair<T> k, v;
  int64_t bb;
  int h, H;
  bool staged;

  __device__ void prefetch(int j) {
    const int row0 = j * kSmall, valid = min(kSmall, k.L - row0);
    stage_basis<T, HD, kSmall>(stage, k, bb, row0);
    stage_basis<T, HD, kSmall>(stage + kSmall * k.R * HD, v, bb, row0);
    cp_async_commit();
    const T* ka = k.a + ((bb * k.L + row0) * H + h) * k.R;
    const T* va = v.a + ((bb * v.L + row0) * H + h) * v.R;
#pragma unroll
    for (int q = 0; q < SLOTS; ++q)
      mix[q] = mix_row[q] < valid ? to_acc(((mix_v >> q) & 1 ? va : ka)[mix_off[q]]) : 0.f;
  }
  // Waits for the staged tile and publishes its mixing values (block-wide: ends in a barrier).
  __device__ void arrive() {
    cp_async_wait<0>();
#pragma unroll
    for (int q = 0; q < SLOTS; ++q) mix_s[threadIdx.x + q * kThreads] = mix[q];
    __syncthreads();
  }
  // Builds tile j into kd, vd: from the stage area (after arrive) or from global memory.
  __device__ void build(int j, T* kd, T* vd) {
    if (staged) {
      const int valid = min(kSmall, k.L - j * kSmall);
      build_tile<T, HD, kSmall>(kd, stage, mix_s, k.R, k.R, k.inv_r, valid);
      build_tile<T, HD, kSmall>(vd, stage + kSmall * k.R * HD, mix_s + kSmall * k.R, v.R, v.R, v.inv_r, valid);
    } else {
      build_global<T, HD, kSmall>(kd, k, bb, h, H, j * kSmall);
      build_global<T, HD, kSmall>(vd, v, bb, h, H, j * kSmall);
    }
  }
  __device__ void start() {
    mix_v = 0;
#pragma unroll
    for (int q = 0; q < SLOTS; ++q) {
      mix[q] = 0.f;
      int slot = int(threadIdx.x) + q * kThreads, R = k.R;
      if (slot >= kSmall * k.R) {
        slot -= kSmall * k.R;
        R = v.R;
        mix_v |= 1u << q;
      }
      mix_row[q] = slot < kSmall * R ? slot / R : kSmall;
      mix_off[q] = slot < kSmall * R ? (slot / R) * H * R + slot % R : 0;
    }
    if (staged) prefetch(0);
  }
  // Tile j lives in pair j % 2, and tile j + 1 is built while tile j is multiplied, so the build's
  // loads and arithmetic overlap the tensor-core work. Per tile j: the products that read K_j and V_j
  // first, build_next(j), the rest, finish(j).
  __device__ T* k_tile(int j) const { return kv + (j & 1) * 2 * kSmall * LD; }
  __device__ T* v_tile(int j) const { return k_tile(j) + kSmall * LD; }
  __device__ void begin(int tiles) {
    start();
    if (staged) arrive();
    build(0, k_tile(0), v_tile(0));
    __syncthreads();
    if (staged && tiles > 1) prefetch(1);
  }
  // Pair (j + 1) % 2 is free: its last readers finished tile j - 1 before finish(j - 1)'s barrier.
  __device__ void build_next(int j, int tiles) {
    if (staged) arrive();
    if (j + 1 < tiles) build(j + 1, k_tile(j + 1), v_tile(j + 1));
  }
  // Tile j + 1 is built and the stage area free: start staging tile j + 2.
  __device__ void finish(int j, int tiles) {
    __syncthreads();
    if (staged && j + 2 < tiles) prefetch(j + 2);
  }
};

// ---------------------------------------------------------------------------------------------------
// Forward: a block per (query tile of kBig rows, head, batch entry); causal tiles heaviest first.

template <int HD>
constexpr size_t fwd_smem() {
  return size_t(kBig + 4 * kSmall) * (HD + 8) * 2 + kMixMax * 4 + kStageBytes;
}

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd(const Params<T> p) {
  constexpr int LD = HD + 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  KvTiles<T, HD> kv;
  kv.kv = qs + kBig * LD;
  kv.mix_s = reinterpret_cast<float*>(kv.kv + 4 * kSmall * LD);
  kv.stage = reinterpret_cast<T*>(kv.mix_s + kMixMax);
  const int nq = (p.N + kBig - 1) / kBig;
  const int qt = p.causal ? nq - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = (lane & 3) * 2;
  const int64_t bb = blockIdx.z;
  const int q0 = qt * kBig;
  kv.k = {p.ak, p.bk, p.M, p.Rk, p.inv_rk};
  kv.v = {p.av, p.bv, p.M, p.Rv, p.inv_rv};
  kv.bb = bb;
  kv.h = h;
  kv.H = p.H;
  kv.staged = p.stage_kv;
  // Q carries the scale's sign, so the scores times |scale log2 e| are the logits and their row maxima
  // can be taken before scaling.
  build_global<T, HD, kBig>(qs, Pair<T>{p.aq, p.bq, p.N, p.Rq, p.scale < 0 ? -p.inv_rq : p.inv_rq}, bb, h, p.H, q0);
  const float sl2 = fabsf(p.sl2);
  const int kv_all = (p.M + kSmall - 1) / kSmall;
  const int tiles = p.causal ? min(kv_all, (q0 + kBig + kSmall - 1) / kSmall) : kv_all;
  kv.begin(tiles);  // its barriers also publish Q
  const int row_a = q0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8
  float o[HD / 8][4];
  zero<HD>(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[HD / 16][4];  // this warp's Q rows as A fragments, loaded once
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) load_a<LD>(qf[kk], qs, warp * 16, kk * 16);
  for (int j = 0; j < tiles; ++j) {
    float s[8][4];
    frags_times_rows_t<T, HD>(s, qf, kv.k_tile(j));
    kv.build_next(j, tiles);
    const int k0 = j * kSmall;
    const bool mask = k0 + kSmall > p.M || (p.causal && k0 + kSmall - 1 > q0 + warp * 16);
    if (mask)
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = k0 + t * 8 + c + (e & 1), row = row_a + (e >> 1) * 8;
          if (col >= p.M || (p.causal && col > row)) s[t][e] = -INFINITY;
        }
    // p = 2^(s |scale| log2 e - m): one FFMA and one MUFU an element.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < 8; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * rr], s[t][2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[rr], mx * sl2);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m[rr] - base);
      m[rr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        s[t][2 * rr] = fast_exp2(fmaf(s[t][2 * rr], sl2, -base));
        s[t][2 * rr + 1] = fast_exp2(fmaf(s[t][2 * rr + 1], sl2, -base));
        sum += s[t][2 * rr] + s[t][2 * rr + 1];
      }
      l[rr] = l[rr] * alpha + sum;
#pragma unroll
      for (int e = 0; e < HD / 8; ++e) {
        o[e][2 * rr] *= alpha;
        o[e][2 * rr + 1] *= alpha;
      }
    }
    probs_times_rows<T, HD>(o, s, kv.v_tile(j));
    kv.finish(j, tiles);
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    const int n = row_a + rr * 8;
    if (n >= p.N) continue;
    const float inv = 1.f / l[rr];
    T* orow = p.out + ((bb * p.N + n) * p.H + h) * HD + c;
#pragma unroll
    for (int e = 0; e < HD / 8; ++e)
      *reinterpret_cast<uint32_t*>(orow + e * 8) = pack2<T>(o[e][2 * rr] * inv, o[e][2 * rr + 1] * inv);
    if ((lane & 3) == 0) p.lse[(bb * p.N + n) * p.H + h] = m[rr] + log2f(l[rr]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Launcher.

template <class T, int HD>
void forward_typed(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  Params<T> p = make_params<T>(a);
  p.out = static_cast<T*>(out.data());
  p.lse = lse.data_ptr<float>();
  const dim3 grid(unsigned((p.N + kBig - 1) / kBig), unsigned(p.H), unsigned(a.aq.size(0)));
  static bool configured = false;
  allow_smem(attention_fwd<T, HD>, fwd_smem<HD>(), configured);
  attention_fwd<T, HD><<<grid, kThreads, fwd_smem<HD>(), stream(a.aq.device().index)>>>(p);
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

}  // namespace lintape::tpa_cuda
