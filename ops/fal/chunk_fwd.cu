// Causal FAL on the tensor cores (ops/fal/chunk.cuh): the state pass, both ways, for the backward, and the
// fused forward.
#include "ops/fal/chunk.cuh"

namespace lintape::fal_cuda::chunk {

namespace {

// Sequential over chunks, one block per (b, h, segment, angle slice, 64 columns of E). Forward: X = K (act_k,
// LRPE), Z = V (act_v) times delta; reverse: X = Q, Z = dO o gb times gamma. The block's state tile is the rows
// of D' that the angle slice gives (64 or 128) times 64 columns, a 16 x 64 f32 tile per warp in registers:
//   forward  store S_c; S <- lambda^cl S + X^T Z       (c = c0 ... c1-1, from S0 or a boundary)
//   reverse  store R_(c+1); R <- lambda^cl R + X^T Z   (c = c1-1 ... c0, from dS_final or a boundary)
// and the state past the walk into S_final / dS0 (the sequence's last walk) or a boundary (a local pass,
// which stores nothing per chunk). Without segments the walk is the whole sequence. With documents delta, gamma
// and lambda^cl take chunk.cuh's gates.
// The state tiles in shared memory.
template <class T>
struct StateSmem {
  __align__(16) T xs[2][kC * kLdS];
  __align__(16) T zs[kC * (kEtile + kPad)];
  float scale[kC];
  float rates[2 * kSlice];  // the head's LRPE rates (D <= 128)
  int st[kC];               // documents: the chunk's rows' document starts
};

template <class T, bool Reverse, bool Whole, bool Docs>
__device__ __forceinline__ void state_body(const Args& a, int64_t walk, int e0, StateSmem<T>& sm) {
  auto& xs = sm.xs;
  auto& zs = sm.zs;
  auto& scale = sm.scale;
  const int warp = threadIdx.x >> 5;
  const Walk w = Whole ? whole_walk(a, walk, Reverse) : walk_of(a, walk, Reverse);
  const int64_t bh = w.bh, b = bh / a.H;
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
#pragma unroll
  for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
      acc.x[0][n][r] = w.start && active && e < a.E ? w.start[size_t(p) * a.E + e] : 0.0f;
    }
  T* states = !Whole && a.local ? nullptr : static_cast<T*>(Reverse ? a.rstates : a.states) + bh * a.nC * PE;

  // Each chunk's rows load after the barrier and go straight to shared memory: with three blocks per SM the
  // others hide the latency, and the registers stay with the state tile.
  const int x_act = Reverse ? a.act_q : a.act_k, z_act = Reverse ? a.act_g : a.act_v;
  if (a.lrpe == FalStepSpec::kCosine)
    for (int j = threadIdx.x; j < a.D; j += kThreads) sm.rates[j] = rate_of(a, h, j);
  for (int step = 0; step < w.c1 - w.c0; ++step) {
    const int c = Reverse ? w.c1 - 1 - step : w.c0 + step;
    const int64_t t0 = int64_t(c) * kC;
    const int cl = int(a.N - t0 < kC ? a.N - t0 : kC);
    // With documents: the start of the last token's document, and whether the entering state crosses the chunk.
    const int st_last = Docs ? doc_start(a, b, t0 + cl - 1) : 0;
    const bool crosses = !Docs || enters(st_last, t0);
    for (int i = threadIdx.x; i < kC; i += kThreads) {
      float f = Reverse ? decay_pow(log2_lam, i + 1) : (i < cl ? decay_pow(log2_lam, cl - 1 - i) : 0.0f);
      if (Docs) {
        const int st = doc_start(a, b, t0 + i);
        sm.st[i] = st;
        if (Reverse ? !enters(st, t0) : t0 + i < st_last) f = 0.0f;
      }
      scale[i] = f;
    }
    __syncthreads();  // scale written; the previous chunk's product is done with xs and zs
    {
      Raw<kSlice> xr;
      Raw<kEtile> zr, dr;
      fetch(a, x, xts, t0, slice * kSlice, a.D, xr);
      fetch(a, z, zts, t0, e0, a.E, zr);
      if (Reverse) fetch(a, dout, dts, t0, e0, a.E, dr);
      store_encoded<T, kThreads, 4>(a, xr, x_act, xs[0], xs[1], nullptr, 0, nullptr, nullptr, h, t0, slice,
                                    sm.rates, Docs ? sm.st : nullptr);
      store_rows<T, kEtile, kThreads>(a, zr, Reverse ? &dr : nullptr, z_act, t0, e0, scale, zs);
    }
    if (active) {
      if (Whole || states) {
        T* dst = states + c * PE;
#pragma unroll
        for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
          for (int r = 0; r < 4; r += 2) {
            const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
            if (e < a.E) store2(dst + size_t(p) * a.E + e, acc.x[0][n][r], acc.x[0][n][r + 1]);
          }
      }
      const float carry = crosses ? decay_pow(log2_lam, cl) : 0.0f;
#pragma unroll
      for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc.x[0][n][r] *= carry;
    }
    __syncthreads();
    if (active) warp_mma<T, true, true>(acc, xs[half], kLdS, m0, zs, kEtile + kPad, 0, kC);
  }
  // The walk's end, found again: held across the chunk loop, its address would take registers from the state.
  const int64_t self = opaque_index(walk);
  float* last = (Whole ? whole_walk(a, self, Reverse) : walk_of(a, self, Reverse)).last;
  if (last && active)
#pragma unroll
    for (int n = 0; n < kEtile / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int p = p_row + acc.row(0, r), e = e0 + acc.col(n, r);
        if (e < a.E) last[size_t(p) * a.E + e] = acc.x[0][n][r];
      }
}

template <class T, bool Reverse, bool Whole, bool Docs>
__global__ void __launch_bounds__(kThreads, 3) state_kernel(Args a) {
  __shared__ StateSmem<T> sm;
  state_body<T, Reverse, Whole, Docs>(a, a.walks_in_z ? blockIdx.z : blockIdx.x,
                                int(a.walks_in_z ? blockIdx.x : blockIdx.z) * kEtile, sm);
}

// The forward, fused: one block per (b, h) and segment, sequential over its chunks with the whole D' x E state
// in registers (f32), from S0 or the boundary state before the segment. Per-chunk states go to memory only when
// the backward asks for them (Save, below).
// Per chunk:
//   A. its raw q, k, v rows (staged in shared memory by cp.async while the previous chunk multiplied) go
//      through the acts and the LRPE into Q, K (C x D'), V and diag(delta) V; the state is copied to shared
//      memory in T; then the next chunk's rows are requested;
//   B. Y = diag(gamma) Q S_c + (Q K^T o M) V, out = gb o Y, and S <- lambda^cl S + K^T diag(delta) V.
// Warp w: rows 16 (w % 4) of the chunk and column group w / 4 of Y and of the scores; state rows 16 (w % 4)
// of half w / (warps / 2) of each angle slice. With 8 warps a thread holds 2 E / 8 state values per slice,
// which needs more than the 128 registers that 16 warps would leave.
constexpr int kFusedThreads = 512, kFusedWarps = kFusedThreads / 32;
constexpr int kColGroups = kFusedWarps / 4;   // of Y and the scores
constexpr int kStateGroups = kFusedWarps / 8;  // of the state's columns within a half

template <class T, int EP, int Slices>
struct FusedSmem {
  static constexpr int D = Slices * kSlice, ldE = EP + kPad;
  static constexpr int kTile = kC * kLdS;  // one half of an angle slice's encoded rows
  T* raw_q;   // [kC][D]  the next chunk's rows as loaded
  T* raw_k;   // [kC][D]
  T* raw_v;   // [kC][EP]
  T* qs;      // [Slices][2][kC][kLdS]
  T* ks;      // [Slices][2][kC][kLdS]; after the products, (Q K^T) o M as [kC][kLdC]
  T* ss;      // [2 D][ldE] S_c
  T* vs;      // [kC][ldE] V
  T* vd;      // [kC][ldE] diag(delta) V
  float* delta;  // [kC]
  float* rates;  // [D] the head's LRPE rates
  int* st;       // [2][kC] documents: the rows' document starts, by the chunk's parity (chunk.cuh)
  __device__ explicit FusedSmem(T* base) {
    raw_q = base;
    raw_k = raw_q + kC * D;
    raw_v = raw_k + kC * D;
    qs = raw_v + kC * EP;
    ks = qs + Slices * 2 * kTile;
    ss = ks + Slices * 2 * kTile;
    vs = ss + 2 * D * ldE;
    vd = vs + kC * ldE;
    delta = reinterpret_cast<float*>(vd + kC * ldE);
    rates = delta + kC;
    st = reinterpret_cast<int*>(rates + D);
  }
  static constexpr size_t bytes() {
    return sizeof(T) * size_t(2 * kC * D + kC * EP + 4 * Slices * kTile + 2 * D * ldE + 2 * kC * ldE) +
           sizeof(float) * (kC + D) + sizeof(int) * 2 * kC;
  }
};

// Rows t0 ... t0 + kC - 1, columns [0, W) of x into stage ([kC][W]) through cp.async; rows past the sequence
// and columns past cols are left as they are (the encoding zeroes them).
template <class T, int W>
__device__ __forceinline__ void stage_rows(const Args& a, const T* __restrict__ x, int64_t ts, int64_t t0, int cols,
                                           T* stage) {
#pragma unroll
  for (int it = 0; it < kC * (W / 8) / kFusedThreads; ++it) {
    const int idx = threadIdx.x + it * kFusedThreads, i = idx / (W / 8), c = (idx % (W / 8)) * 8;
    if (t0 + i < a.N && c < cols) cp_async16(stage + i * W + c, x + (t0 + i) * ts + c);
  }
}

// A staged tile's columns [c0, c0 + W) as fetch would have loaded them (row length LD).
template <int LD, int W>
__device__ __forceinline__ void from_stage(const void* stage, int c0, Raw<W, kFusedThreads>& r) {
  const uint16_t* s = static_cast<const uint16_t*>(stage);
#pragma unroll
  for (int it = 0; it < Raw<W, kFusedThreads>::kIt; ++it) {
    const int idx = threadIdx.x + it * kFusedThreads, i = idx / (W / 8), c = c0 + (idx % (W / 8)) * 8;
    r.u[it] = *reinterpret_cast<const uint4*>(s + i * LD + c);
  }
}

// S_c as staged for the products (rows of LD elements) into its slot of a.states (P x E in T) for the backward,
// in 16-byte pieces.
template <class T, int EP, int LD>
__device__ __forceinline__ void save_state(const Args& a, const T* ss, T* dst) {
  constexpr int kPieces = EP / 8;
  for (int idx = threadIdx.x; idx < a.P * kPieces; idx += kFusedThreads) {
    const int p = idx / kPieces, c8 = (idx % kPieces) * 8;
    if (c8 < a.E)
      *reinterpret_cast<uint4*>(dst + size_t(p) * a.E + c8) = *reinterpret_cast<const uint4*>(ss + p * LD + c8);
  }
}

// v rows through the act into V and diag(delta) V (one act for both tiles; V only when delta is null).
template <class T, int EP>
__device__ __forceinline__ void store_values(const Args& a, const Raw<EP, kFusedThreads>& r, int64_t t0,
                                             const float* delta, T* vs, T* vd) {
#pragma unroll
  for (int it = 0; it < Raw<EP, kFusedThreads>::kIt; ++it) {
    const int idx = threadIdx.x + it * kFusedThreads, i = idx / (EP / 8), c8 = (idx % (EP / 8)) * 8;
    float y[8];
    unpack8<T>(r.u[it], y);
    act_n(y, a.act_v, t0 + i < a.N && c8 < a.E);
    if (vs) store8(vs + i * (EP + kPad) + c8, y);
#pragma unroll
    for (int u = 0; u < 8; ++u) y[u] *= delta[i];
    store8(vd + i * (EP + kPad) + c8, y);
  }
}

// Local: the local pass of a cut sequence (a.local): only K, diag(delta) V and the state update, each segment's
// sum from zero into its boundary slot. Save (not local): every chunk's entering state S_c (or the even chunks',
// Args::half_states) is saved to a.states in T for the backward, which then skips its forward state pass (a kernel
// apart: the stores take registers). Docs:
// a.starts is set (a kernel apart too, so that the calls without documents keep their registers).
template <class T, int EP, int Slices, bool Local, bool Save, bool Docs>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_forward_kernel(Args a) {
  using Sm = FusedSmem<T, EP, Slices>;
  constexpr int D = Sm::D, ldE = Sm::ldE, SCT = 8 / kColGroups, YT = EP / 8 / kColGroups;
  constexpr int ST = EP / 8 / kStateGroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Sm sm(reinterpret_cast<T*>(smem_raw));
  const int warp = threadIdx.x >> 5, m0 = 16 * (warp % 4), sc_n0 = 8 * SCT * (warp / 4), y_n0 = 8 * YT * (warp / 4);
  const int half = warp / (kFusedWarps / 2), s_m0 = m0, s_n0 = 8 * ST * ((warp / 4) % kStateGroups);
  const Walk w = walk_of(a, blockIdx.x, false);
  const int64_t bh = w.bh, b = bh / a.H;
  const int h = int(bh % a.H);
  const int halves = a.lrpe == FalStepSpec::kNoLrpe ? 1 : 2;
  const bool owns_state = half < halves;
  const float log2_lam = a.decay ? __log2f(a.decay[h]) : 0.0f;
  // The rows' addresses are rebuilt where they are used (b and h made opaque): held across the chunk loop,
  // they would push the state out of the registers.
  auto opaque = [](int x) {
    asm volatile("" : "+r"(x));
    return x;
  };
  auto state_row = [&](int s, int r) { return half * D + s * kSlice + s_m0 + Acc<1, ST>::row(0, r); };

  Acc<1, ST> st[Slices];
  // f(value, its index in a (P, E) f32 state) for each of this thread's state values within E.
  auto each_state = [&](auto&& f) {
    if (!owns_state) return;
#pragma unroll
    for (int s = 0; s < Slices; ++s)
#pragma unroll
      for (int n = 0; n < ST; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e = s_n0 + st[s].col(n, r);
          if (e < a.E) f(st[s].x[0][n][r], size_t(state_row(s, r)) * a.E + e);
        }
  };
#pragma unroll
  for (int s = 0; s < Slices; ++s) st[s].zero();
  if (w.start) each_state([&](float& x, size_t i) { x = w.start[i]; });

  auto stage_chunk = [&](int64_t t0) {
    const int bo = opaque(int(b)), ho = opaque(h);
    const T* k = at_head<T>(a.k, bo, a.sk_b, ho, a.D);
    const T* v = at_head<T>(a.v, bo, a.sv_b, ho, a.E);
    if (!Local) stage_rows<T, D>(a, at_head<T>(a.q, bo, a.sq_b, ho, a.D), a.sq_t, t0, a.D, sm.raw_q);
    stage_rows<T, D>(a, k, a.sk_t, t0, a.D, sm.raw_k);
    stage_rows<T, EP>(a, v, a.sv_t, t0, a.E, sm.raw_v);
    cp_async_commit();
  };
  stage_chunk(w.c0 * kC);
  if (a.lrpe == FalStepSpec::kCosine)
    for (int j = threadIdx.x; j < a.D; j += kFusedThreads) sm.rates[j] = rate_of(a, h, j);
  for (int c = w.c0; c < w.c1; ++c) {
    const int64_t t0 = int64_t(c) * kC;
    const int cl = int(a.N - t0 < kC ? a.N - t0 : kC);
    // A. Encode. delta's previous readers passed a barrier since; st's (step B) read the other parity. With
    // documents, delta keeps the keys of the last token's document only.
    int* doc = Docs ? sm.st + (c & 1) * kC : nullptr;
    const int st_last = doc ? doc_start(a, opaque(int(b)), t0 + cl - 1) : 0;
    for (int i = threadIdx.x; i < kC; i += kFusedThreads) {
      sm.delta[i] = i < cl && t0 + i >= st_last ? decay_pow(log2_lam, cl - 1 - i) : 0.0f;
      if (doc) doc[i] = doc_start(a, opaque(int(b)), t0 + i);
    }
    cp_async_wait_all();
    __syncthreads();  // the raw rows and delta are in; the previous chunk's products are done with every tile
    {
      Raw<EP, kFusedThreads> vr;
      from_stage<EP>(sm.raw_v, 0, vr);
      store_values<T, EP>(a, vr, t0, sm.delta, Local ? nullptr : sm.vs, sm.vd);
    }
#pragma unroll
    for (int s = 0; s < Slices; ++s) {
      Raw<kSlice, kFusedThreads> qr, kr;
      from_stage<D>(sm.raw_k, s * kSlice, kr);
      T* qh = sm.qs + s * 2 * Sm::kTile;
      T* kh = sm.ks + s * 2 * Sm::kTile;
      if (Local) {
        store_encoded<T, kFusedThreads, 4>(a, kr, a.act_k, kh, kh + Sm::kTile, nullptr, 0, nullptr, nullptr, h, t0, s,
                                           sm.rates, doc);
      } else {
        from_stage<D>(sm.raw_q, s * kSlice, qr);
        store_encoded<T, kFusedThreads, 4>(a, qr, a.act_q, qh, qh + Sm::kTile, &kr, a.act_k, kh, kh + Sm::kTile, h, t0,
                                           s, sm.rates, doc);
      }
    }
    if (!Local && owns_state)
#pragma unroll
      for (int s = 0; s < Slices; ++s)
#pragma unroll
        for (int n = 0; n < ST; ++n)
#pragma unroll
          for (int r = 0; r < 4; r += 2)
            store2(sm.ss + state_row(s, r) * ldE + s_n0 + st[s].col(n, r), st[s].x[0][n][r], st[s].x[0][n][r + 1]);
    __syncthreads();
    if (c + 1 < w.c1) stage_chunk(t0 + kC);
    // S_c to memory while the products run (with half_states, the even chunks' only); the next chunk's first
    // barrier guards ss.
    if (Save && !(a.half_states && (c & 1)))
      save_state<T, EP, ldE>(a, sm.ss,
                             static_cast<T*>(a.states) +
                                 ((int64_t(opaque(int(b))) * a.H + opaque(h)) * saved_chunks(a) + saved_slot(a, c)) *
                                     int64_t(a.P) * a.E);

    // B. The scores, then the state update (the old state is in shared memory), then Y, so that at most two
    // accumulators are live beside the state.
    Acc<1, SCT> sc;
    sc.zero();
    if (!Local)
#pragma unroll
      for (int s = 0; s < Slices; ++s)
        for (int hf = 0; hf < halves; ++hf)
          warp_mma<T, false, false>(sc, sm.qs + (s * 2 + hf) * Sm::kTile, kLdS, m0, sm.ks + (s * 2 + hf) * Sm::kTile,
                                    kLdS, sc_n0, kSlice);
    if (owns_state) {
      const float carry = !doc || enters(doc[cl - 1], t0) ? decay_pow(log2_lam, cl) : 0.0f;
#pragma unroll
      for (int s = 0; s < Slices; ++s) {
#pragma unroll
        for (int n = 0; n < ST; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) st[s].x[0][n][r] *= carry;
        warp_mma<T, true, true>(st[s], sm.ks + (s * 2 + half) * Sm::kTile, kLdS, s_m0, sm.vd, ldE, s_n0, kC);
      }
    }
    if (Local) continue;  // the next chunk's first barrier keeps K and V until every warp is done with them
    __syncthreads();  // every warp is done with K: the masked scores take its place
    T* am = sm.ks;
    store_masked(sc, am, m0, sc_n0, log2_lam, doc, t0);
    // The gate's rows load while Y's products run.
    const T* g = at_head<T>(a.g, opaque(int(b)), a.sg_b, opaque(h), a.E);
    uint32_t graw[YT][2];
#pragma unroll
    for (int n = 0; n < YT; ++n)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int64_t t = t0 + m0 + Acc<1, YT>::row(0, r);
        const int e = y_n0 + Acc<1, YT>::col(n, r);
        graw[n][r / 2] = t < a.N && e < a.E ? *reinterpret_cast<const uint32_t*>(g + t * a.sg_t + e) : 0u;
      }
    Acc<1, YT> y;
    y.zero();
#pragma unroll
    for (int s = 0; s < Slices; ++s)
      for (int hf = 0; hf < halves; ++hf)
        warp_mma<T, false, true>(y, sm.qs + (s * 2 + hf) * Sm::kTile, kLdS, m0, sm.ss + (hf * D + s * kSlice) * ldE,
                                 ldE, y_n0, kSlice);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = m0 + y.row(0, r);
      const float gm = !doc || enters(doc[i], t0) ? decay_pow(log2_lam, i + 1) : 0.0f;
#pragma unroll
      for (int n = 0; n < YT; ++n) y.x[0][n][r] *= gm;
    }
    __syncthreads();  // the masked scores are in
    warp_mma<T, false, true>(y, am, kLdC, m0, sm.vs, ldE, y_n0, kC);
    T* out = static_cast<T*>(a.out) + (int64_t(opaque(int(b))) * a.N * a.H + opaque(h)) * a.E;
#pragma unroll
    for (int n = 0; n < YT; ++n) {
      float gb[4];
      load2(reinterpret_cast<const T*>(&graw[n][0]), gb[0], gb[1]);
      load2(reinterpret_cast<const T*>(&graw[n][1]), gb[2], gb[3]);
      act_n(gb, a.act_g, true);
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int64_t t = t0 + m0 + y.row(0, r);
        const int e = y_n0 + y.col(n, r);
        if (t < a.N && e < a.E) store2(out + t * a.H * a.E + e, gb[r] * y.x[0][n][r], gb[r + 1] * y.x[0][n][r + 1]);
      }
    }
  }
  float* last = walk_of(a, opaque(int(blockIdx.x)), false).last;  // found again, as the rows' addresses are
  if (last) each_state([&](float& x, size_t i) { last[i] = x; });
}

// The state kernel for a direction, a whole walk or segments, and with or without documents.
template <class T>
auto state_kernel_of(bool reverse, bool whole, bool docs) {
  if (docs)
    return reverse ? (whole ? state_kernel<T, true, true, true> : state_kernel<T, true, false, true>)
                   : (whole ? state_kernel<T, false, true, true> : state_kernel<T, false, false, true>);
  return reverse ? (whole ? state_kernel<T, true, true, false> : state_kernel<T, true, false, false>)
                 : (whole ? state_kernel<T, false, true, false> : state_kernel<T, false, false, false>);
}

template <class T>
void launch_state(const Args& a, int64_t BH, bool reverse, cudaStream_t st) {
  const int64_t walks = BH * (a.local ? a.G - 1 : a.G);
  const unsigned slices = unsigned(a.D / kSlice), etiles = unsigned((a.E + kEtile - 1) / kEtile);
  // A walk's blocks next to each other in the launch order, so that they run together and the rows they share
  // (x across the E tiles, z across the slices) come from L2 once fetched; the grid's z holds 65535 walks.
  Args b = a;
  b.walks_in_z = walks <= 65535;
  const dim3 grid = b.walks_in_z ? dim3(etiles, slices, unsigned(walks)) : dim3(unsigned(walks), slices, etiles);
  // The whole sequence's walk (no cut) compiles apart: its loop and pointers come from the arguments.
  const bool whole = a.G == 1;
  state_kernel_of<T>(reverse, whole, a.starts != nullptr)<<<grid, kThreads, 0, st>>>(b);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T, int EP, int Slices>
void launch_fused(const Args& a, int64_t BH, cudaStream_t st) {
  const size_t smem = FusedSmem<T, EP, Slices>::bytes();
  auto kernel = a.starts ? (a.local    ? fused_forward_kernel<T, EP, Slices, true, false, true>
                           : a.states ? fused_forward_kernel<T, EP, Slices, false, true, true>
                                      : fused_forward_kernel<T, EP, Slices, false, false, true>)
                        : (a.local    ? fused_forward_kernel<T, EP, Slices, true, false, false>
                           : a.states ? fused_forward_kernel<T, EP, Slices, false, true, false>
                                      : fused_forward_kernel<T, EP, Slices, false, false, false>);
  LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(BH * (a.local ? a.G - 1 : a.G)), kFusedThreads, smem, st>>>(a);
  LT_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_forward(const Args& a, int64_t BH, cudaStream_t st) {
  const bool wide = a.E > 64, two = a.D > kSlice;
  if (wide)
    two ? launch_fused<T, 128, 2>(a, BH, st) : launch_fused<T, 128, 1>(a, BH, st);
  else
    two ? launch_fused<T, 64, 2>(a, BH, st) : launch_fused<T, 64, 1>(a, BH, st);
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
  if (walk_runs(a)) {
    walk_pass(a, dtype, BH, reverse, st);
    return;
  }
  if (dtype == DType::BF16)
    launch_state<__nv_bfloat16>(a, BH, reverse, st);
  else
    launch_state<__half>(a, BH, reverse, st);
}

void forward(const Args& a, DType dtype, int64_t BH, cudaStream_t st) {
  if (hopper_forward_runs(a)) {
    hopper_forward(a, dtype, BH, st);
    return;
  }
  if (dtype == DType::BF16)
    launch_forward<__nv_bfloat16>(a, BH, st);
  else
    launch_forward<__half>(a, BH, st);
}

}  // namespace lintape::fal_cuda::chunk
