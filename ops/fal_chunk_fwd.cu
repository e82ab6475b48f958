// Chunk-parallel causal FAL (ops/fal_chunk.cuh): the state pass, both ways, and the forward outputs.
#include "ops/fal_chunk.cuh"

namespace lintape::fal_cuda::chunk {

namespace {

constexpr int kEtile = 64;  // E columns of a state block


// Sequential over chunks, one block per (b, h, angle slice, 64 columns of E). Forward: X = K (act_k, LRPE),
// Z = V (act_v) times delta; reverse: X = Q, Z = dO o gb times gamma. The block's state tile is the rows of
// D' that the angle slice gives (64 or 128) times 64 columns, a 16 x 64 f32 tile per warp in registers:
//   forward  store S_c; S <- lambda^cl S + X^T Z       (c = 0 ... nC-1, from S0; S_final after)
//   reverse  store R_(c+1); R <- lambda^cl R + X^T Z   (c = nC-1 ... 0, from dS_final; dS0 after)
// The state tiles in shared memory.
template <class T>
struct StateSmem {
  __align__(16) T xs[2][kC * kLdS];
  __align__(16) T zs[kC * (kEtile + kPad)];
  float scale[kC];
};

template <class T, bool Reverse>
__device__ __forceinline__ void state_body(const Args& a, int e0, StateSmem<T>& sm) {
  auto& xs = sm.xs;
  auto& zs = sm.zs;
  auto& scale = sm.scale;
  const int warp = threadIdx.x >> 5;
  const int64_t bh = blockIdx.x, b = bh / a.H;
  const int h = int(bh % a.H), slice = int(blockIdx.y);
  const int halves = a.lrpe == FalStepSpec::kNoLrpe ? 1 : 2;
  const int half = warp / 4, m0 = 16 * (warp % 4);
  const bool active = half < halves;
  const int p_row = (half == 0 ? 0 : a.D) + slice * kSlice + m0;  // first state row of this warp
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  const size_t PE = size_t(a.P) * a.E;

  const T* x = Reverse ? at_head<T>(a.q, b, a.sq_b, h, a.D) : at_head<T>(a.k, b, a.sk_b, h, a.D);
  const int64_t xts = Reverse ? a.sq_t : a.sk_t;
  const T* z = Reverse ? at_head<T>(a.g, b, a.sg_b, h, a.E) : at_head<T>(a.v, b, a.sv_b, h, a.E);
  const int64_t zts = Reverse ? a.sg_t : a.sv_t;
  const T* dout = Reverse ? static_cast<const T*>(a.dout) + b * a.N * a.H * a.E + h * a.E : nullptr;
  const int64_t dts = int64_t(a.H) * a.E;

  Acc<1, kEtile / 8> acc;
  const float* start = Reverse ? a.dS_final : a.S0;
  float* last = Reverse ? a.dS0 : a.S_final;
#pragma unroll
  for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
      acc.x[0][n][r] = start && active && e < a.E ? start[bh * PE + size_t(p) * a.E + e] : 0.0f;
    }
  T* states = static_cast<T*>(Reverse ? a.rstates : a.states) + bh * a.nC * PE;

  // Each chunk's rows load after the barrier and go straight to shared memory: with three blocks per SM the
  // others hide the latency, and the registers stay with the state tile.
  const int x_act = Reverse ? a.act_q : a.act_k, z_act = Reverse ? a.act_g : a.act_v;
  for (int64_t step = 0; step < a.nC; ++step) {
    const int64_t c = Reverse ? a.nC - 1 - step : step, t0 = c * kC;
    const int cl = int(a.N - t0 < kC ? a.N - t0 : kC);
    for (int i = threadIdx.x; i < kC; i += kThreads)
      scale[i] = Reverse ? decay_pow(log2_lam, i + 1) : (i < cl ? decay_pow(log2_lam, cl - 1 - i) : 0.0f);
    __syncthreads();  // scale written; the previous chunk's product is done with xs and zs
    {
      Raw<kSlice> xr;
      Raw<kEtile> zr, dr;
      fetch(a, x, xts, t0, slice * kSlice, a.D, xr);
      fetch(a, z, zts, t0, e0, a.E, zr);
      if (Reverse) fetch(a, dout, dts, t0, e0, a.E, dr);
      store_encoded<T, kThreads>(a, xr, x_act, xs[0], xs[1], nullptr, 0, nullptr, nullptr, h, t0, slice);
      store_rows<T, kEtile, kThreads>(a, zr, Reverse ? &dr : nullptr, z_act, t0, e0, scale, zs);
    }
    if (active) {
      T* dst = states + c * PE;
#pragma unroll
      for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
          if (e < a.E) store2(dst + size_t(p) * a.E + e, acc.x[0][n][r], acc.x[0][n][r + 1]);
        }
      const float carry = decay_pow(log2_lam, cl);
#pragma unroll
      for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc.x[0][n][r] *= carry;
    }
    __syncthreads();
    if (active) warp_mma<T, true, true>(acc, xs[half], kLdS, m0, zs, kEtile + kPad, 0, kC);
  }
  if (last && active)
#pragma unroll
    for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
        if (e < a.E) last[bh * PE + size_t(p) * a.E + e] = acc.x[0][n][r];
      }
}

template <class T, bool Reverse>
__global__ void __launch_bounds__(kThreads, 3) state_kernel(Args a) {
  __shared__ StateSmem<T> sm;
  state_body<T, Reverse>(a, int(blockIdx.z) * kEtile, sm);
}

// One block per (chunk, b, h): Y = diag(gamma) Q S_c + (Q K^T o M) V, out = gb o Y. Warp w owns rows 16 (w % 4)
// of the chunk and half w / 4 of the columns (of E for Y, of the chunk for the scores).
template <class T, int EP>
__global__ void __launch_bounds__(kThreads, 2) output_kernel(Args a) {
  constexpr int ldE = EP + kPad, NT = EP / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);  // [2][kC][kLdS]
  T* ks = qs + 2 * kC * kLdS;              // [2][kC][kLdS]
  T* ss = ks + 2 * kC * kLdS;              // [2][kSlice][ldE]
  T* vs = ss + 2 * kSlice * ldE;           // [kC][ldE]
  T* as = vs + kC * ldE;                   // [kC][kLdC]
  const int warp = threadIdx.x >> 5, m0 = 16 * (warp % 4), wc = warp / 4;
  const int64_t c = blockIdx.x, bh = blockIdx.y, b = bh / a.H, t0 = c * kC;
  const int h = int(bh % a.H);
  const int halves = a.lrpe == FalStepSpec::kNoLrpe ? 1 : 2;
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  const size_t PE = size_t(a.P) * a.E;
  const T* q = at_head<T>(a.q, b, a.sq_b, h, a.D);
  const T* k = at_head<T>(a.k, b, a.sk_b, h, a.D);
  const T* state = static_cast<const T*>(a.states) + (bh * a.nC + c) * PE;

  // The first slice's state rows are in flight while v's rows load.
  auto issue_state = [&](int slice) {
    for (int hf = 0; hf < halves; ++hf)
      load_state_async<T, EP>(a, state, (hf == 0 ? 0 : a.D) + slice * kSlice, ss + hf * kSlice * ldE);
  };
  issue_state(0);
  {
    Raw<EP> vr;
    fetch(a, at_head<T>(a.v, b, a.sv_b, h, a.E), a.sv_t, t0, 0, a.E, vr);
    store_rows<T, EP, kThreads>(a, vr, nullptr, a.act_v, t0, 0, nullptr, vs);
  }
  Acc<1, 4> sc;  // scores: rows m0, columns 32 wc
  Acc<1, NT> y;  // rows m0, columns wc EP / 2
  sc.zero();
  y.zero();
  for (int slice = 0; slice < a.D / kSlice; ++slice) {
    if (slice > 0) {
      __syncthreads();
      issue_state(slice);
    }
    Raw<kSlice> qr, kr;
    fetch(a, q, a.sq_t, t0, slice * kSlice, a.D, qr);
    fetch(a, k, a.sk_t, t0, slice * kSlice, a.D, kr);
    store_encoded(a, qr, a.act_q, qs, qs + kC * kLdS, &kr, a.act_k, ks, ks + kC * kLdS, h, t0, slice);
    cp_async_wait_all();
    __syncthreads();
    for (int hf = 0; hf < halves; ++hf) {
      warp_mma<T, false, false>(sc, qs + hf * kC * kLdS, kLdS, m0, ks + hf * kC * kLdS, kLdS, 32 * wc, kSlice);
      warp_mma<T, false, true>(y, qs + hf * kC * kLdS, kLdS, m0, ss + hf * kSlice * ldE, ldE, wc * EP / 2, kSlice);
    }
  }
  // Masked, decayed scores into shared memory; the state term times gamma.
  store_masked(sc, as, m0, 32 * wc, log2_lam);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float gm = decay_pow(log2_lam, m0 + y.row(0, r) + 1);
#pragma unroll
    for (int n = 0; n < NT; ++n) y.x[0][n][r] *= gm;
  }
  __syncthreads();
  warp_mma<T, false, true>(y, as, kLdC, m0, vs, ldE, wc * EP / 2, kC);
  const T* g = at_head<T>(a.g, b, a.sg_b, h, a.E);
  T* out = static_cast<T*>(a.out) + b * a.N * a.H * a.E + h * a.E;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      const int64_t t = t0 + m0 + y.row(0, r);
      const int e = wc * EP / 2 + y.col(n, r);
      if (t >= a.N || e >= a.E) continue;
      float g0, g1;
      load2(g + t * a.sg_t + e, g0, g1);
      store2(out + t * a.H * a.E + e, act_f(g0, a.act_g) * y.x[0][n][r], act_f(g1, a.act_g) * y.x[0][n][r + 1]);
    }
}

template <class T, int EP>
size_t output_smem() {
  return sizeof(T) * size_t(4 * kC * kLdS + 2 * kSlice * (EP + kPad) + kC * (EP + kPad) + kC * kLdC);
}

template <class T>
void launch_state(const Args& a, int64_t BH, bool reverse, cudaStream_t st) {
  const dim3 grid(unsigned(BH), unsigned(a.D / kSlice), unsigned((a.E + kEtile - 1) / kEtile));
  if (reverse)
    state_kernel<T, true><<<grid, kThreads, 0, st>>>(a);
  else
    state_kernel<T, false><<<grid, kThreads, 0, st>>>(a);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int EP>
void launch_output(const Args& a, int64_t BH, cudaStream_t st) {
  const size_t smem = output_smem<T, EP>();
  LT_CUDA_CHECK(cudaFuncSetAttribute(output_kernel<T, EP>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  output_kernel<T, EP><<<dim3(unsigned(a.nC), unsigned(BH)), kThreads, smem, st>>>(a);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool supported(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec) {
  if (dtype != DType::BF16 && dtype != DType::F16) return false;
  if (spec.lrpe == FalStepSpec::kRotate || D % kSlice != 0 || D > 128 || E % 8 != 0 || E > 128 || E == 0)
    return false;
  for (int act : {spec.act_q, spec.act_k, spec.act_v, spec.act_g})
    if (act == FalStepSpec::kSoftmaxFeature) return false;
  return true;
}

void state_pass(const Args& a, DType dtype, int64_t BH, bool reverse, cudaStream_t st) {
  if (dtype == DType::BF16)
    launch_state<__nv_bfloat16>(a, BH, reverse, st);
  else
    launch_state<__half>(a, BH, reverse, st);
}

void forward(const Args& a, DType dtype, int64_t BH, cudaStream_t st) {
  state_pass(a, dtype, BH, false, st);
  const bool wide = a.E > 64;
  if (dtype == DType::BF16)
    wide ? launch_output<__nv_bfloat16, 128>(a, BH, st) : launch_output<__nv_bfloat16, 64>(a, BH, st);
  else
    wide ? launch_output<__half, 128>(a, BH, st) : launch_output<__half, 64>(a, BH, st);
}

}  // namespace lintape::fal_cuda::chunk
