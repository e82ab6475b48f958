// Chunk-parallel causal FAL (ops/fal/chunk.cuh): the backward. Both state passes (S_c forward, R_(c+1)
// reverse), then one block per (chunk, b, h) for dq, dk, dv and dg; with the forward's half states
// (Args::half_states) an odd chunk's block first advances S_(c-1) across chunk c - 1.
#include "ops/fal/chunk.cuh"

namespace lintape::fal_cuda::chunk {

namespace {

// The block's tiles in shared memory.
template <class T, int EP>
struct GradSmem {
  static constexpr int ldE = EP + kPad;
  T* qs;  // [2][kC][kLdS]   Q, both halves of the angle slice
  T* ks;  // [2][kC][kLdS]   K
  T* ss;  // [2][2][kSlice][ldE] S_c rows of the slice, by the slice's parity (the next one loads meanwhile)
  T* rs;  // [2][2][kSlice][ldE] R_(c+1) rows of the slice, likewise
  T* vs;  // [kC][ldE]       V
  T* ys;  // [kC][ldE]       dY = dO o gb
  T* am;  // [kC][kLdC]      (Q K^T) o M
  T* bm;  // [kC][kLdC]      (dY V^T) o M
  float* rates;  // [2 kSlice]   the head's LRPE rates (D <= 128)
  float* gate_q;  // [kC]        documents: whether S_c reaches row i (gamma's gate, chunk.cuh)
  float* gate_k;  // [kC]        documents: whether key j reaches R_(c+1) (delta's gate)
  int* st;        // [kC]        documents: the rows' document starts
  __device__ explicit GradSmem(T* base) {
    qs = base;
    ks = qs + 2 * kC * kLdS;
    ss = ks + 2 * kC * kLdS;
    rs = ss + 4 * kSlice * ldE;
    vs = rs + 4 * kSlice * ldE;
    ys = vs + kC * ldE;
    am = ys + kC * ldE;
    bm = am + kC * kLdC;
    rates = reinterpret_cast<float*>(bm + kC * kLdC);
    gate_q = rates + 2 * kSlice;
    gate_k = gate_q + kC;
    st = reinterpret_cast<int*>(gate_k + kC);
  }
  static constexpr size_t bytes() {
    return sizeof(T) * size_t(4 * kC * kLdS + 8 * kSlice * ldE + 2 * kC * ldE + 2 * kC * kLdC) +
           sizeof(float) * (2 * kSlice + 2 * kC) + sizeof(int) * kC;
  }
};

// Row i of acc times lambda^(base + sign i), and times gate[i] when given (documents).
template <int NT>
__device__ __forceinline__ void scale_rows(Acc<1, NT>& acc, int m0, float log2_lam, int base, int sign,
                                           const float* gate) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = m0 + acc.row(0, r);
    const float f = decay_pow(log2_lam, base + sign * i) * (gate ? gate[i] : 1.0f);
#pragma unroll
    for (int n = 0; n < NT; ++n) acc.x[0][n][r] *= f;
  }
}

// One slice's gradient of the encoded rows (half hf) folded into the raw rows' gradient x through the
// transposed LRPE: dx = cos dx_0 + sin dx_1 (without LRPE cos = 1 and one half).
template <int NT>
__device__ __forceinline__ void fold(Acc<1, NT>& x, const Acc<1, NT>& d, const float (&cs)[4 * NT],
                                     const float (&sn)[4 * NT], int hf) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) x.x[0][n][r] += (hf == 0 ? cs[4 * n + r] : sn[4 * n + r]) * d.x[0][n][r];
}

// The raw x values of a warp's 16 x 8 NT tile of the raw rows' gradient (rows m0, columns col0), two a word
// (zeros past the sequence): loaded before the products that the gradient waits for.
template <class T, int NT>
__device__ __forceinline__ void fetch_raw(const Args& a, const T* x, int64_t xts, int64_t t0, int m0, int col0,
                                          uint32_t (&raw)[NT][2]) {
  const int64_t t_lo = t0 + m0 + Acc<1, NT>::row(0, 0), t_hi = t0 + m0 + Acc<1, NT>::row(0, 2);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = col0 + Acc<1, NT>::col(n, 0);
    raw[n][0] = t_lo < a.N ? *reinterpret_cast<const uint32_t*>(x + t_lo * xts + col) : 0u;
    raw[n][1] = t_hi < a.N ? *reinterpret_cast<const uint32_t*>(x + t_hi * xts + col) : 0u;
  }
}

// dx = act'(x) g for that tile, x from fetch_raw.
template <class T, int NT>
__device__ __forceinline__ void store_raw_grad(const Args& a, const Acc<1, NT>& gx, const uint32_t (&raw)[NT][2],
                                               T* dx, int64_t dts, int64_t t0, int m0, int col0, int act) {
  const int64_t t_lo = t0 + m0 + gx.row(0, 0), t_hi = t0 + m0 + gx.row(0, 2);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = col0 + gx.col(n, 0);
    float xv[4], d[4];
    load2(reinterpret_cast<const T*>(&raw[n][0]), xv[0], xv[1]);
    load2(reinterpret_cast<const T*>(&raw[n][1]), xv[2], xv[3]);
#pragma unroll
    for (int r = 0; r < 4; ++r) d[r] = gx.x[0][n][r];
    act_grad_n(xv, d, act);
    if (t_lo < a.N) store2(dx + t_lo * dts + col, d[0], d[1]);
    if (t_hi < a.N) store2(dx + t_hi * dts + col, d[2], d[3]);
  }
}

// 16 warps: warp w owns rows 16 (w % 4) of the chunk and quarter w / 4 of the columns of every product. The
// shared tiles allow one block per SM; 16 warps rather than 8 keep each thread's accumulators within 128
// registers and give the SM twice the warps to hide the products' latency.
constexpr int kGradThreads = 512;

// A stored state's rows (S: P x E in T) into ss, each slice's in the buffers of its parity, through cp.async (no
// commit).
template <class T, int EP>
__device__ __forceinline__ void load_whole_state(const Args& a, const GradSmem<T, EP>& sm, const T* S, int halves) {
  for (int slice = 0; slice < a.D / kSlice; ++slice)
    for (int hf = 0; hf < halves; ++hf)
      load_state_async<T, EP, kGradThreads>(a, S, (hf == 0 ? 0 : a.D) + slice * kSlice,
                                            sm.ss + (slice * 2 + hf) * kSlice * GradSmem<T, EP>::ldE);
}

// With Args::half_states, an odd chunk's S_c from the saved S_(c-1) (S): S_c = lambda^kC S_(c-1) + K^T diag(delta) V
// over chunk c - 1 (whole; its first token tp) with the forward's products and roundings (K and diag(delta) V in T,
// f32 accumulation from lambda^kC S_(c-1), the result rounded to T), but from S_(c-1) as saved in T rather than as
// the forward held it in f32: the result may differ from the forward's S_c in the last place. Into ss, the slices'
// buffers as issue_states fills them; K passes through ks (slice 0) and qs (slice 1), diag(delta) V through vs,
// delta through gate_k and the rows' document starts through st, all free until the chunk's own rows load. The
// LRPE rates must be in rates. Ends at a barrier.
template <class T, int EP, bool Docs>
__device__ __forceinline__ void advance_state(const Args& a, const GradSmem<T, EP>& sm, const T* S, int64_t b, int h,
                                              int64_t tp, float log2_lam, int halves) {
  constexpr int NThr = kGradThreads, ldE = GradSmem<T, EP>::ldE;
  const bool two = a.D > kSlice;  // two angle slices
  load_whole_state(a, sm, S, halves);
  cp_async_commit();
  const T* k = at_head<T>(a.k, b, a.sk_b, h, a.D);
  Raw<kSlice, NThr> k0, k1;
  Raw<EP, NThr> vr;
  fetch(a, k, a.sk_t, tp, 0, a.D, k0);
  if (two) fetch(a, k, a.sk_t, tp, kSlice, a.D, k1);
  fetch(a, at_head<T>(a.v, b, a.sv_b, h, a.E), a.sv_t, tp, 0, a.E, vr);
  const int st_last = Docs ? doc_start(a, b, tp + kC - 1) : 0;
  for (int i = threadIdx.x; i < kC; i += NThr) {
    if (Docs) sm.st[i] = doc_start(a, b, tp + i);
    sm.gate_k[i] = tp + i >= st_last ? decay_pow(log2_lam, kC - 1 - i) : 0.0f;
  }
  __syncthreads();
  const int* doc = Docs ? sm.st : nullptr;
  store_encoded<T, NThr, 4>(a, k0, a.act_k, sm.ks, sm.ks + kC * kLdS, nullptr, 0, nullptr, nullptr, h, tp, 0, sm.rates,
                            doc);
  if (two)
    store_encoded<T, NThr, 4>(a, k1, a.act_k, sm.qs, sm.qs + kC * kLdS, nullptr, 0, nullptr, nullptr, h, tp, 1,
                              sm.rates, doc);
  store_rows<T, EP, NThr>(a, vr, nullptr, a.act_v, tp, 0, sm.gate_k, sm.vs);
  const float carry = !Docs || enters(st_last, tp) ? decay_pow(log2_lam, kC) : 0.0f;
  cp_async_wait_all();
  __syncthreads();
  // Warp tiles of 16 rows x 64 columns of each (slice, half)'s kSlice x EP buffer.
  constexpr int kTiles = kSlice / 16 * (EP / 64);
  const int tiles = (two ? 2 : 1) * halves * kTiles;
  for (int tile = int(threadIdx.x >> 5); tile < tiles; tile += NThr / 32) {
    const int part = tile / kTiles, slice = part / halves, hf = part % halves;
    const int m0 = 16 * (tile % kTiles % (kSlice / 16)), n0 = 64 * (tile % kTiles / (kSlice / 16));
    T* s = sm.ss + (slice * 2 + hf) * kSlice * ldE;
    Acc<1, 8> acc;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        load2(s + (m0 + acc.row(0, r)) * ldE + n0 + acc.col(n, r), acc.x[0][n][r], acc.x[0][n][r + 1]);
        acc.x[0][n][r] *= carry;
        acc.x[0][n][r + 1] *= carry;
      }
    warp_mma<T, true, true>(acc, (slice == 0 ? sm.ks : sm.qs) + hf * kC * kLdS, kLdS, m0, sm.vs, ldE, n0, kC);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; r += 2)
        store2(s + (m0 + acc.row(0, r)) * ldE + n0 + acc.col(n, r), acc.x[0][n][r], acc.x[0][n][r + 1]);
  }
  __syncthreads();
}

// Docs: a.starts is set (a kernel apart, so that the calls without documents keep their registers). Half:
// a.half_states (a kernel apart too).
template <class T, int EP, bool Docs, bool Half>
__global__ void __launch_bounds__(kGradThreads, 1) grad_kernel(Args a) {
  constexpr int NThr = kGradThreads, kParts = NThr / 128;
  using Smem = GradSmem<T, EP>;
  constexpr int ldE = Smem::ldE, NT = EP / (8 * kParts), NS = kC / (8 * kParts);  // n-tiles of E and of a slice
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem sm(reinterpret_cast<T*>(smem_raw));
  const int warp = threadIdx.x >> 5, m0 = 16 * (warp % 4), wc = warp / 4;
  const int ec = wc * EP / kParts, sc0 = wc * kC / kParts;  // the warp's first column of E and of a slice
  const int64_t c = blockIdx.x, bh = blockIdx.y, b = bh / a.H, t0 = c * kC;
  const int h = int(bh % a.H);
  const int cl = int(a.N - t0 < kC ? a.N - t0 : kC);
  const int halves = a.lrpe == FalStepSpec::kNoLrpe ? 1 : 2;
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  const size_t PE = size_t(a.P) * a.E;
  const int64_t out_ts = int64_t(a.H) * a.E;  // dout's token stride
  const T* q = at_head<T>(a.q, b, a.sq_b, h, a.D);
  const T* k = at_head<T>(a.k, b, a.sk_b, h, a.D);
  const T* v = at_head<T>(a.v, b, a.sv_b, h, a.E);
  const T* g = at_head<T>(a.g, b, a.sg_b, h, a.E);
  const T* dout = static_cast<const T*>(a.dout) + b * a.N * out_ts + h * a.E;
  const T* S = static_cast<const T*>(a.states) + (bh * (Half ? (a.nC + 1) / 2 : a.nC) + (Half ? c / 2 : c)) * PE;
  const bool advance = Half && (c & 1);  // S holds S_(c-1): advance_state makes S_c of it
  const T* R = static_cast<const T*>(a.rstates) + (bh * a.nC + c) * PE;

  const int slices = a.D / kSlice;
  // The S_c and R_(c+1) rows of a slice into the buffers of its parity, one cp.async group. Half: S_c is whole in
  // ss by then (loaded or advanced first; S is not held across the slices' loop).
  auto issue_states = [&](int slice) {
    for (int hf = 0; hf < halves; ++hf) {
      const int p0 = (hf == 0 ? 0 : a.D) + slice * kSlice, buf = (slice & 1) * 2 + hf;
      if (!Half) load_state_async<T, EP, NThr>(a, S, p0, sm.ss + buf * kSlice * ldE);
      load_state_async<T, EP, NThr>(a, R, p0, sm.rs + buf * kSlice * ldE);
    }
    cp_async_commit();
  };
  // Q and K of an angle slice, encoded, into qs and ks.
  auto fetch_qk = [&](int slice, Raw<kSlice, NThr>& qr, Raw<kSlice, NThr>& kr) {
    fetch(a, q, a.sq_t, t0, slice * kSlice, a.D, qr);
    fetch(a, k, a.sk_t, t0, slice * kSlice, a.D, kr);
  };
  const int* doc = Docs ? sm.st : nullptr;
  const float* gate_q = Docs ? sm.gate_q : nullptr;
  const float* gate_k = Docs ? sm.gate_k : nullptr;
  auto store_qk = [&](int slice, const Raw<kSlice, NThr>& qr, const Raw<kSlice, NThr>& kr) {
    store_encoded<T, NThr, 4>(a, qr, a.act_q, sm.qs, sm.qs + kC * kLdS, &kr, a.act_k, sm.ks, sm.ks + kC * kLdS, h, t0,
                              slice, sm.rates, doc);
  };
  if (a.lrpe == FalStepSpec::kCosine)
    for (int j = threadIdx.x; j < a.D; j += NThr) sm.rates[j] = rate_of(a, h, j);
  // The first slice's q and k rows load with v, g and dO; in the Half kernels before S_c is loaded or advanced
  // (their latency under it), else after the barrier.
  Raw<kSlice, NThr> qr, kr;
  Raw<EP, NThr> vr, gr, dr;
  auto fetch_rows = [&] {
    fetch_qk(0, qr, kr);
    fetch(a, v, a.sv_t, t0, 0, a.E, vr);
    fetch(a, g, a.sg_t, t0, 0, a.E, gr);
    fetch(a, dout, out_ts, t0, 0, a.E, dr);
  };
  if (Half) {
    fetch_rows();
    issue_states(0);
    if (advance) {
      advance_state<T, EP, Docs>(a, sm, S, b, h, t0 - kC, log2_lam, halves);
    } else {
      load_whole_state(a, sm, S, halves);
      cp_async_commit();
    }
  }
  if (Docs) {
    const int st_last = doc_start(a, b, t0 + cl - 1);
    for (int i = threadIdx.x; i < kC; i += NThr) {
      const int st = doc_start(a, b, t0 + i);
      sm.st[i] = st;
      sm.gate_q[i] = enters(st, t0) ? 1.0f : 0.0f;
      sm.gate_k[i] = t0 + i >= st_last ? 1.0f : 0.0f;
    }
  }
  if (a.lrpe == FalStepSpec::kCosine || Docs) __syncthreads();
  if (!Half) {
    issue_states(0);
    fetch_rows();
  }
  store_qk(0, qr, kr);
  store_rows<T, EP, NThr>(a, vr, nullptr, a.act_v, t0, 0, nullptr, sm.vs);
  store_rows<T, EP, NThr>(a, gr, &dr, a.act_g, t0, 0, nullptr, sm.ys);
  __syncthreads();
  {
    Acc<1, NS> bsc;
    bsc.zero();
    warp_mma<T, false, false>(bsc, sm.ys, ldE, m0, sm.vs, ldE, sc0, EP);
    store_masked(bsc, sm.bm, m0, sc0, log2_lam, doc, t0);
  }

  Acc<1, NS> sc;   // Q K^T: rows m0, columns sc0
  Acc<1, NT> y;    // Y: rows m0, columns ec
  Acc<1, NT> dvo;  // dV
  sc.zero();
  y.zero();
  dvo.zero();
  for (int slice = 0; slice < slices; ++slice) {
    __syncthreads();  // bm written; the previous slice's tiles are consumed
    if (slice + 1 < slices) issue_states(slice + 1);
    if (slice > 0) {
      Raw<kSlice, NThr> qr, kr;
      fetch_qk(slice, qr, kr);
      store_qk(slice, qr, kr);
    }
    if (slice + 1 < slices)
      cp_async_wait<1>();  // this slice's group has landed; the next one's may still be in flight
    else
      cp_async_wait<0>();
    __syncthreads();
    auto half_tile = [&](const T* base, int hf, int rows, int ld) { return base + ((slice & 1) * 2 + hf) * rows * ld; };
    for (int hf = 0; hf < halves; ++hf) {
      const T* qh = sm.qs + hf * kC * kLdS;
      const T* kh = sm.ks + hf * kC * kLdS;
      warp_mma<T, false, false>(sc, qh, kLdS, m0, kh, kLdS, sc0, kSlice);
      warp_mma<T, false, true>(y, qh, kLdS, m0, half_tile(sm.ss, hf, kSlice, ldE), ldE, ec, kSlice);
      warp_mma<T, false, true>(dvo, kh, kLdS, m0, half_tile(sm.rs, hf, kSlice, ldE), ldE, ec, kSlice);
    }
    // The angles of this thread's elements of the slice's 16 x 8 NS gradient tiles.
    float cs[4 * NS], sn[4 * NS];
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        cs[4 * n + r] = 1.0f, sn[4 * n + r] = 0.0f;
        if (a.lrpe != FalStepSpec::kNoLrpe)
          angle_cs(sm.rates[slice * kSlice + sc0 + Acc<1, NS>::col(n, r)],
                   a.position + t0 + m0 + Acc<1, NS>::row(0, r) - (doc ? doc[m0 + Acc<1, NS>::row(0, r)] : 0),
                   cs[4 * n + r], sn[4 * n + r]);
      }
    // dQ = diag(gamma) dY S^T + Bm K, then dK = diag(delta) V R^T + Bm^T Q, each over both halves and folded
    // through the transposed LRPE into the raw rows' gradient (one of them live at a time).
    const int col0 = slice * kSlice + sc0;
    for (int which = 0; which < 2; ++which) {
      const T* left = which == 0 ? sm.ys : sm.vs;    // dY or V
      const T* state = which == 0 ? sm.ss : sm.rs;   // S_c or R_(c+1)
      const T* rows = which == 0 ? sm.ks : sm.qs;    // K or Q, by halves
      const int base = which == 0 ? 1 : cl - 1, sign = which == 0 ? 1 : -1;
      const float* gate = which == 0 ? gate_q : gate_k;
      uint32_t raw[NS][2];  // the raw q (dQ) or k (dK) values, in flight during the products
      if (which == 0)
        fetch_raw(a, q, a.sq_t, t0, m0, col0, raw);
      else
        fetch_raw(a, k, a.sk_t, t0, m0, col0, raw);
      Acc<1, NS> gx, d0, d1;
      gx.zero();
      d0.zero();
      d1.zero();
      if (halves == 2) {  // both halves at once: two independent chains
        warp_mma2<T, false, false>(d0, d1, left, ldE, m0, half_tile(state, 0, kSlice, ldE),
                                   half_tile(state, 1, kSlice, ldE), ldE, sc0, EP);
        scale_rows(d0, m0, log2_lam, base, sign, gate);
        scale_rows(d1, m0, log2_lam, base, sign, gate);
        if (which == 0)
          warp_mma2<T, false, true>(d0, d1, sm.bm, kLdC, m0, rows, rows + kC * kLdS, kLdS, sc0, kC);
        else
          warp_mma2<T, true, true>(d0, d1, sm.bm, kLdC, m0, rows, rows + kC * kLdS, kLdS, sc0, kC);
        fold(gx, d0, cs, sn, 0);
        fold(gx, d1, cs, sn, 1);
      } else {
        warp_mma<T, false, false>(d0, left, ldE, m0, half_tile(state, 0, kSlice, ldE), ldE, sc0, EP);
        scale_rows(d0, m0, log2_lam, base, sign, gate);
        if (which == 0)
          warp_mma<T, false, true>(d0, sm.bm, kLdC, m0, rows, kLdS, sc0, kC);
        else
          warp_mma<T, true, true>(d0, sm.bm, kLdC, m0, rows, kLdS, sc0, kC);
        fold(gx, d0, cs, sn, 0);
      }
      if (which == 0)
        store_raw_grad(a, gx, raw, at_head<T>(a.dq, b, a.sdq_b, h, a.D), a.sdq_t, t0, m0, col0, a.act_q);
      else
        store_raw_grad(a, gx, raw, at_head<T>(a.dk, b, a.sdk_b, h, a.D), a.sdk_t, t0, m0, col0, a.act_k);
    }
  }
  // The raw g, dO and v values of this thread's dg and dv elements load while the intra-chunk terms multiply:
  // Y += Am V, dV = diag(delta) K R + Am^T dY.
  uint32_t graw[NT][2], draw[NT][2], vraw[NT][2];
  const bool v_act = a.act_v != FalStepSpec::kNone;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      const int64_t t = t0 + m0 + y.row(0, r);
      const int e = ec + y.col(n, 0);
      const bool in = t < a.N && e < a.E;
      graw[n][r / 2] = in ? *reinterpret_cast<const uint32_t*>(g + t * a.sg_t + e) : 0u;
      draw[n][r / 2] = in ? *reinterpret_cast<const uint32_t*>(dout + t * out_ts + e) : 0u;
      vraw[n][r / 2] = in && v_act ? *reinterpret_cast<const uint32_t*>(v + t * a.sv_t + e) : 0u;
    }
  store_masked(sc, sm.am, m0, sc0, log2_lam, doc, t0);
  scale_rows(y, m0, log2_lam, 1, 1, gate_q);
  scale_rows(dvo, m0, log2_lam, cl - 1, -1, gate_k);
  __syncthreads();
  warp_mma<T, false, true>(y, sm.am, kLdC, m0, sm.vs, ldE, ec, kC);
  warp_mma<T, true, true>(dvo, sm.am, kLdC, m0, sm.ys, ldE, ec, kC);
  T* dv = at_head<T>(a.dv, b, a.sdv_b, h, a.E);
  T* dg = at_head<T>(a.dg, b, a.sdg_b, h, a.E);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int e = ec + y.col(n, 0);
    if (e >= a.E) continue;
    float gv[4], vv[4], dov[4], dgv[4], dvv[4];
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      load2(reinterpret_cast<const T*>(&graw[n][r / 2]), gv[r], gv[r + 1]);
      load2(reinterpret_cast<const T*>(&draw[n][r / 2]), dov[r], dov[r + 1]);
      load2(reinterpret_cast<const T*>(&vraw[n][r / 2]), vv[r], vv[r + 1]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) dgv[r] = dov[r] * y.x[0][n][r], dvv[r] = dvo.x[0][n][r];
    act_grad_n(gv, dgv, a.act_g);
    act_grad_n(vv, dvv, a.act_v);
#pragma unroll
    for (int r = 0; r < 4; r += 2) {
      const int64_t t = t0 + m0 + y.row(0, r);
      if (t >= a.N) continue;
      store2(dg + t * a.sdg_t + e, dgv[r], dgv[r + 1]);
      store2(dv + t * a.sdv_t + e, dvv[r], dvv[r + 1]);
    }
  }
}

template <class T, int EP>
void launch_grad(const Args& a, int64_t BH, cudaStream_t st) {
  const size_t smem = GradSmem<T, EP>::bytes();
  auto kernel = a.starts ? (a.half_states ? grad_kernel<T, EP, true, true> : grad_kernel<T, EP, true, false>)
                         : (a.half_states ? grad_kernel<T, EP, false, true> : grad_kernel<T, EP, false, false>);
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<dim3(unsigned(a.nC), unsigned(BH)), kGradThreads, smem, st>>>(a);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gradients(const Args& a, DType dtype, int64_t BH, cudaStream_t st) {
  if (a.nC == 0 || BH == 0) return;  // no tokens: no input gradients (an empty grid is no launch)
  if (hopper_gradients_run(a)) {
    hopper_gradients(a, dtype, BH, st);
    return;
  }
  const bool wide = a.E > 64;
  if (dtype == DType::BF16)
    wide ? launch_grad<__nv_bfloat16, 128>(a, BH, st) : launch_grad<__nv_bfloat16, 64>(a, BH, st);
  else
    wide ? launch_grad<__half, 128>(a, BH, st) : launch_grad<__half, 64>(a, BH, st);
}

}  // namespace lintape::fal_cuda::chunk
