// Noncausal FAL chunk kernels (ops/fal/noncausal.cuh): the row passes, out = gb o (qb kv) and the gradients.
#include "ops/fal/noncausal.cuh"

namespace lintape::fal_cuda::noncausal {

namespace {

constexpr int64_t kMinRowChunks = 4;  // the fewest chunks of a run (each (b, h) it enters reloads the state)
constexpr int kOutThreads = 256, kGradThreads = 512;  // the output pass runs two blocks an SM

template <class T>
__device__ __forceinline__ void unpack2(uint32_t u, float& x0, float& x1) {
  const T* e = reinterpret_cast<const T*>(&u);
  x0 = cuda::to_acc(e[0]);
  x1 = cuda::to_acc(e[1]);
}

// The block's tiles: X (kC x (P + kPad) in T), W (P x (EP + kPad) in T), in the gradient passes U (gb o dO or
// vb, kC x (EP + kPad) in T) and the f32 gradient of the raw rows (kC x (DP + 4)), then the angle table
// (kAngleRows x DP f32) and, in the gradient passes, the threads' first-row angles.
template <class T, int DP, int EP, bool Grads>
struct RowSmem {
  static constexpr int ldG = DP + 4;
  __host__ __device__ static size_t x_bytes(int P) { return sizeof(T) * size_t(kC) * size_t(P + kPad); }
  __host__ __device__ static size_t w_bytes(int P) { return sizeof(T) * size_t(P) * size_t(EP + kPad); }
  __host__ __device__ static size_t u_bytes() { return Grads ? sizeof(T) * size_t(kC * (EP + kPad)) : 0; }
  __host__ __device__ static size_t g_bytes() { return Grads ? sizeof(float) * size_t(kC * ldG) : 0; }
  __host__ __device__ static size_t angles_kept_bytes() { return Grads ? FirstRowAngles<DP, kGradThreads>::kBytes : 0; }
  __host__ __device__ static size_t bytes(int P) {
    return x_bytes(P) + w_bytes(P) + u_bytes() + g_bytes() + sizeof(float) * kAngleRows * DP + angles_kept_bytes();
  }
};

// A run of items (b, h, chunk), item w = bh nC + chunk. Warps: WR groups of 16 MT rows of the chunk by 4 groups
// of columns (a quarter of E for Y, of D for the rows' gradient).
template <class T, int DP, int EP, int Pass, int NThr>
__global__ void __launch_bounds__(NThr, Pass == kOut ? 2 : 1)
    row_kernel(Args a, const float* __restrict__ state, int64_t per, int64_t total) {
  constexpr bool Grads = Pass != kOut;
  using Smem = RowSmem<T, DP, EP, Grads>;
  constexpr int WR = NThr / 128, MT = 4 / WR, NE = EP / 32, ND = DP / 32;
  constexpr int ldW = EP + kPad, ldU = EP + kPad, ldG = Smem::ldG;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const size_t xw = Smem::x_bytes(a.P) + Smem::w_bytes(a.P);
  T* xs = reinterpret_cast<T*>(smem_raw);
  T* ws = reinterpret_cast<T*>(smem_raw + Smem::x_bytes(a.P));
  T* us = reinterpret_cast<T*>(smem_raw + xw);
  float* gs = reinterpret_cast<float*>(smem_raw + xw + Smem::u_bytes());
  float* angles = reinterpret_cast<float*>(smem_raw + xw + Smem::u_bytes() + Smem::g_bytes());
  const int ldX = a.P + kPad;
  const int warp = threadIdx.x >> 5;
  const int m0 = 16 * MT * (warp % WR), wc = warp / WR, e0 = wc * (EP / 4), d0 = wc * (DP / 4);
  const bool cosine = a.lrpe == FalStepSpec::kCosine;
  const int64_t begin = int64_t(blockIdx.x) * per, end = min(begin + per, total);
  const int64_t dts = int64_t(a.H) * a.E;  // out's and dout's token stride
  const int act_x = Pass == kKeyGrads ? a.act_k : a.act_q;

  Raw<DP, NThr> xr;
  Raw<EP, NThr> ur, dr;
  auto fetch_item = [&](const Item& it) {
    const int64_t b = it.b, t0 = it.t0();
    const int h = it.h;
    if (Pass == kKeyGrads) {
      chunk::fetch(a, chunk::at_head<T>(a.k, b, a.sk_b, h, a.D), a.sk_t, t0, 0, a.D, xr);
      chunk::fetch(a, chunk::at_head<T>(a.v, b, a.sv_b, h, a.E), a.sv_t, t0, 0, a.E, ur);
    } else {
      chunk::fetch(a, chunk::at_head<T>(a.q, b, a.sq_b, h, a.D), a.sq_t, t0, 0, a.D, xr);
      if (Pass == kQueryGrads) {
        chunk::fetch(a, chunk::at_head<T>(a.g, b, a.sg_b, h, a.E), a.sg_t, t0, 0, a.E, ur);
        chunk::fetch(a, static_cast<const T*>(a.dout) + b * a.N * dts + h * a.E, dts, t0, 0, a.E, dr);
      }
    }
  };
  // The (b, h)'s state, f32 (P x E) into W in T; columns past E are zeros.
  auto load_state = [&](int64_t bh) {
    const float* src = state + bh * int64_t(a.P) * a.E;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < a.P * (EP / 8); idx += NThr) {
      const int p = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
      float x[8];
      if (c8 < a.E) {
        const float4 lo = *reinterpret_cast<const float4*>(src + int64_t(p) * a.E + c8);
        const float4 hi = *reinterpret_cast<const float4*>(src + int64_t(p) * a.E + c8 + 4);
        x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) x[u] = 0.0f;
      }
      chunk::store8(ws + p * ldW + c8, x);
    }
  };

  int64_t loaded = -1;
  int angles_h = -1;
  FirstRowAngles<DP, NThr> first;  // kept only by the gradient passes: the output pass's two blocks an SM lack the room
  if (Grads) first.kept = angles + kAngleRows * DP;
  Item cur;
  cur.start(begin, a);
  if (begin < end) fetch_item(cur);
  for (int64_t w = begin; w < end; ++w) {
    const int64_t bh = cur.bh(a), b = cur.b, t0 = cur.t0();
    const int h = cur.h;
    __syncthreads();  // the previous item is done with the tiles
    if (bh != loaded) {
      load_state(bh);
      loaded = bh;
    }
    if (cosine && h != angles_h) {
      fill_angles<DP>(a, h, NThr / (DP / 8), angles);
      angles_h = h;
      __syncthreads();
    }
    encode_rows<T, DP, NThr>(a, xr, act_x, angles, first, t0, xs, chunk::RowMajorTile{ldX});
    if (Pass == kQueryGrads) chunk::store_rows<T, EP, NThr>(a, ur, &dr, a.act_g, t0, 0, nullptr, us);
    if (Pass == kKeyGrads) chunk::store_rows<T, EP, NThr>(a, ur, nullptr, a.act_v, t0, 0, nullptr, us);
    const Raw<DP, NThr> xraw = xr;  // the act's backward needs the raw rows
    __syncthreads();

    // The epilogue's inputs at this warp's elements of Y (g; g and dO; v), then the next item's rows: all in
    // flight during the products.
    const T* in1 = Pass == kKeyGrads ? chunk::at_head<T>(a.v, b, a.sv_b, h, a.E) : chunk::at_head<T>(a.g, b, a.sg_b, h, a.E);
    const int64_t in1_ts = Pass == kKeyGrads ? a.sv_t : a.sg_t;
    const T* in2 = static_cast<const T*>(a.dout) + b * a.N * dts + h * a.E;
    uint32_t x1[MT][NE][2], x2[MT][NE][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NE; ++n)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int64_t t = t0 + m0 + chunk::Acc<MT, NE>::row(m, 2 * rr);
          const int e = e0 + chunk::Acc<MT, NE>::col(n, 0);
          const bool live = t < a.N && e < a.E;
          x1[m][n][rr] = live ? *reinterpret_cast<const uint32_t*>(in1 + t * in1_ts + e) : 0u;
          if (Pass == kQueryGrads) x2[m][n][rr] = live ? *reinterpret_cast<const uint32_t*>(in2 + t * dts + e) : 0u;
        }
    Item next = cur;
    next.step(a);
    cur = next;
    if (w + 1 < end) fetch_item(next);

    chunk::Acc<MT, NE> y;
    y.zero();
    chunk::warp_mma<T, false, true>(y, xs, ldX, m0, ws, ldW, e0, a.P);
    T* o1 = Pass == kOut          ? static_cast<T*>(a.out) + b * a.N * dts + h * a.E
            : Pass == kQueryGrads ? chunk::at_head<T>(a.dg, b, a.sdg_b, h, a.E)
                                  : chunk::at_head<T>(a.dv, b, a.sdv_b, h, a.E);
    const int64_t o1_ts = Pass == kOut ? dts : Pass == kQueryGrads ? a.sdg_t : a.sdv_t;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NE; ++n)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int r = 2 * rr;
          const int64_t t = t0 + m0 + y.row(m, r);
          const int e = e0 + y.col(n, r);
          if (t >= a.N || e >= a.E) continue;
          float u0, u1;
          unpack2<T>(x1[m][n][rr], u0, u1);
          const float y0 = y.x[m][n][r], y1 = y.x[m][n][r + 1];
          T* dst = o1 + t * o1_ts + e;
          if (Pass == kOut) {
            chunk::store2(dst, chunk::act_f(u0, a.act_g) * y0, chunk::act_f(u1, a.act_g) * y1);
          } else if (Pass == kQueryGrads) {
            float d0, d1;
            unpack2<T>(x2[m][n][rr], d0, d1);
            chunk::store2(dst, chunk::act_grad(u0, d0 * y0, a.act_g), chunk::act_grad(u1, d1 * y1, a.act_g));
          } else {
            chunk::store2(dst, chunk::act_grad(u0, y0, a.act_v), chunk::act_grad(u1, y1, a.act_v));
          }
        }
    if (!Grads) continue;

    // The encoded rows' gradient U W^T, both halves, folded through the transposed LRPE: dx = cos d0 + sin d1.
    chunk::Acc<MT, ND> gx;
    gx.zero();
    chunk::warp_mma<T, false, false>(gx, us, ldU, m0, ws, ldW, d0, EP);
    if (cosine) {
      chunk::Acc<MT, ND> gsin;
      gsin.zero();
      chunk::warp_mma<T, false, false>(gsin, us, ldU, m0, ws, ldW, DP + d0, EP);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
          for (int r = 0; r < 2; ++r) {  // rows r / 2 and 8 below: one angle, then turned by 8 tokens
            const int d = d0 + gx.col(n, r);
            float c, s;
            chunk::angle_cs(angles[d], a.position + t0 + m0 + gx.row(m, r), c, s);
            gx.x[m][n][r] = c * gx.x[m][n][r] + s * gsin.x[m][n][r];
            rotate(c, s, angles[3 * DP + d], angles[4 * DP + d]);
            gx.x[m][n][r + 2] = c * gx.x[m][n][r + 2] + s * gsin.x[m][n][r + 2];
          }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int r = 0; r < 4; r += 2)
          *reinterpret_cast<float2*>(gs + (m0 + gx.row(m, r)) * ldG + d0 + gx.col(n, r)) =
              make_float2(gx.x[m][n][r], gx.x[m][n][r + 1]);
    __syncthreads();
    // Through the act's backward (softmax: y o (g - g . y) over the row), row by row as encode_rows holds them.
    T* dx = Pass == kKeyGrads ? chunk::at_head<T>(a.dk, b, a.sdk_b, h, a.D) : chunk::at_head<T>(a.dq, b, a.sdq_b, h, a.D);
    const int64_t dx_ts = Pass == kKeyGrads ? a.sdk_t : a.sdq_t;
    const int c8 = (threadIdx.x % (DP / 8)) * 8;
#pragma unroll
    for (int it = 0; it < Raw<DP, NThr>::kIt; ++it) {
      const int i = (threadIdx.x + it * NThr) / (DP / 8);
      const int64_t t = t0 + i;
      const float4 lo = *reinterpret_cast<const float4*>(gs + i * ldG + c8);
      const float4 hi = *reinterpret_cast<const float4*>(gs + i * ldG + c8 + 4);
      const float gg[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      float x[8], d[8];
      chunk::unpack8<T>(xraw.u[it], x);
      if (act_x == FalStepSpec::kSoftmaxFeature) {
        row_act<DP>(x, act_x);
        float dot = 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) dot += gg[u] * x[u];
        dot = row_sum<DP>(dot);
#pragma unroll
        for (int u = 0; u < 8; ++u) d[u] = x[u] * (gg[u] - dot);
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) d[u] = gg[u];
        chunk::act_grad_n(x, d, act_x);
      }
      if (t < a.N) chunk::store8(dx + t * dx_ts + c8, d);
    }
  }
}

template <class T, int DP, int EP, int Pass>
void launch_rows(const Args& a, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  constexpr int NThr = Pass == kOut ? kOutThreads : kGradThreads;
  const int64_t total = BH * a.nC;
  if (total == 0) return;
  auto kernel = row_kernel<T, DP, EP, Pass, NThr>;
  const size_t smem = RowSmem<T, DP, EP, Pass != kOut>::bytes(a.P);
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int per_sm = 0;
  LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, NThr, smem));
  const Partition part =
      partition(total, int64_t(per_sm > 1 ? per_sm : 1) * cuda::sm_count(dev.index), kMinRowChunks);
  kernel<<<unsigned(part.blocks), NThr, smem, st>>>(a, state, part.per, total);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int DP, int EP>
void rows_pass(const Args& a, int pass, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  if (pass == kOut)
    launch_rows<T, DP, EP, kOut>(a, BH, state, st, dev);
  else if (pass == kQueryGrads)
    launch_rows<T, DP, EP, kQueryGrads>(a, BH, state, st, dev);
  else
    launch_rows<T, DP, EP, kKeyGrads>(a, BH, state, st, dev);
}

template <class T>
void rows_t(const Args& a, int pass, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  const bool wide = a.E > 64;
  if (a.D == 128)
    wide ? rows_pass<T, 128, 128>(a, pass, BH, state, st, dev) : rows_pass<T, 128, 64>(a, pass, BH, state, st, dev);
  else
    wide ? rows_pass<T, 64, 128>(a, pass, BH, state, st, dev) : rows_pass<T, 64, 64>(a, pass, BH, state, st, dev);
}

}  // namespace

void rows(const Args& a, int pass, DType dtype, int64_t BH, const float* state, cudaStream_t st, Device dev) {
  if (hopper_rows_take(a, pass, dev)) {
    hopper_rows(a, pass, dtype, BH, state, st, dev);
    return;
  }
  if (dtype == DType::BF16)
    rows_t<__nv_bfloat16>(a, pass, BH, state, st, dev);
  else
    rows_t<__half>(a, pass, BH, state, st, dev);
}

}  // namespace lintape::fal_cuda::noncausal
