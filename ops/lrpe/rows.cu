// Fused LRPE kernels: act + positional encoding forward, and its backward, in one pass over memory.
//
// Layout: x is (B, N, H, D), seen as rows of D features, one row per (b, t, h); it may be a view with
// packed features (Geo's batch, token and head strides), read in place; out, dout and dx are contiguous.
// A group of `lpr` lanes (a power of two <= 32) handles one (t, h) with vectors of VEC elements (16 bytes
// when D and x's strides allow) for a group of g.bchunk batch rows: the angles depend on (t, h, feature)
// only, so each lane computes its cos/sin once and reuses them for every b of its group. With documents
// (g.starts) they depend on t's place in its document, which may differ between batch rows: a lane
// recomputes them when it does (never when every row is cut alike). A lane's "unit"
// is VEC consecutive angle indices j: for the cosine kinds x[j] -> out[j], out[D + j]; for rotate the
// pair x[j], x[D/2 + j] -> out[j], out[D/2 + j]. The kernels are memory-bound; the row kernels are kept within
// 64 to 80 registers, so that 24 to 32 warps per SM keep enough loads in flight.
//
// Softmax over the feature dim reduces across a row's lanes with shuffles. Softmax over the sequence is
// two-pass: a statistics kernel (online max / sum-exp per (b, N-chunk, h, d)) and a finalize kernel
// give the per-(b, h, d) log-sum-exp, which the apply kernel and the backward use. Its backward first
// sums y * dy over N the same way. With documents, per document (ops/lrpe/doc_stats.cuh). Everything is
// computed in f32 but the angle reduction (double).
#include "ops/lrpe/device.cuh"
#include "ops/lrpe/doc_stats.cuh"
#include "ops/lrpe/seq_stats.cuh"

namespace lintape::lrpe_cuda {
using namespace lintape::cuda;

namespace {

// With documents: c and s for position `at` (a token's place in its document), recomputed only when it
// differs from `pos`, the one they hold (rows cut alike share them).
template <int NV, int VEC>
__device__ __forceinline__ void move_to_document(const Geo& g, int64_t at, int64_t h, int lane, int lpr,
                                                 const bool (&ok)[NV], int64_t& pos, float (&c)[NV][VEC],
                                                 float (&s)[NV][VEC]) {
  if (at == pos) return;
  pos = at;
#pragma unroll
  for (int i = 0; i < NV; ++i)
    if (ok[i]) unit_sincos<VEC>(g, at, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
}

// The row kernels: one (t, h) row per lane group, the batch rows b0 .. b1 - 1 of blockIdx.y. The rows are
// grid-strided; the loops over rows and batch rows are uniform across a block, so that the softmax shuffles
// always see the whole warp. Each is compiled with documents (DOCS) and without (the code as it was before
// documents, so rows without them keep their speed). The forward with one unit per lane loads batch rows in
// tiles of two 16-byte vectors per lane, in flight together; it fits in 64 registers (32 warps per SM),
// rotate with a softmax in 80. With documents (the starts, the position held and its recompute) 80 (24
// warps), where 64 spilled.
template <class T, int VEC, int NV, bool ROT, int CLS, bool DOCS>
__global__ void __launch_bounds__(kThreads, NV > 1 ? 1 : DOCS || (ROT && (CLS == kFeature || CLS == kSequence)) ? 6 : 8)
    forward_kernel(const T* __restrict__ x, T* __restrict__ out, Geo g) {
  constexpr int P = ROT ? 2 : 1, BT = NV == 1 ? 2 / P : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  const int64_t b0 = int64_t(blockIdx.y) * g.bchunk, b1 = min(g.B, b0 + g.bchunk);
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) ok[i] = row < rows && lane + i * lpr < units;
    float c[NV][VEC], s[NV][VEC];
    int64_t pos = t;  // the position (in its document) that c and s are for
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    // The lane's x and out in batch row b, stepped per tile (fewer registers than indexing each row).
    const T* xb = x + x_row(g, b0, t, h) + lane * VEC;
    T* ob = out + (b0 * rows + row) * g.out_row + lane * VEC;
    for (int64_t b = b0; b < b1; b += BT, xb += BT * g.x_batch, ob += BT * rows * g.out_row) {
      // x of batch rows b .. b + BT - 1 (those below b1), every unit.
      Vec<T, VEC> raw[BT][NV][P];
      int32_t start[BT];  // documents: the tokens' document starts, loaded beside x
#pragma unroll
      for (int k = 0; k < BT; ++k)
        if (DOCS && row < rows && b + k < b1) start[k] = g.starts[(b + k) * g.N + t];
#pragma unroll
      for (int k = 0; k < BT; ++k)
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
            if (ok[i] && b + k < b1)
              raw[k][i][p] = load_raw<VEC>(xb + k * g.x_batch + p * g.half + i * lpr * VEC);
#pragma unroll
      for (int k = 0; k < BT; ++k) {
        if (b + k >= b1) break;
        if (DOCS && row < rows) move_to_document(g, t - start[k], h, lane, lpr, ok, pos, c, s);
        float v[NV][P][VEC];
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p) to_float(raw[k][i][p], v[i][p]);
        if (feature_softmax<CLS>(g.act)) {
          softmax_feature<NV, P, VEC>(v, ok, lpr);
        } else if (sequence_softmax<CLS>(g.act)) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
            if (ok[i])
              softmax_sequence<P, VEC>(g, stat_row<DOCS>(g, b + k, DOCS ? start[k] : 0), h,
                                       int64_t(lane + i * lpr) * VEC, v[i]);
        } else if (has_act<CLS>(g.act)) {
          with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
            for (int i = 0; i < NV; ++i)
#pragma unroll
              for (int p = 0; p < P; ++p)
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[i][p][e] = act_forward<A.value>(v[i][p][e]);
          });
        }
        T* orow = ob + k * rows * g.out_row;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (!ok[i]) continue;
          float o0[VEC], o1[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if constexpr (ROT) {
              o0[e] = v[i][0][e] * c[i][e] - v[i][1][e] * s[i][e];
              o1[e] = v[i][0][e] * s[i][e] + v[i][1][e] * c[i][e];
            } else {
              o0[e] = v[i][0][e] * c[i][e];
              o1[e] = v[i][0][e] * s[i][e];
            }
          }
          T* o = orow + i * lpr * VEC;
          store<VEC>(o, o0);
          store<VEC>(o + g.out_half, o1);
        }
      }
    }
  }
}

// Backward: per batch row, dout's two halves and (behind an act) x, all in flight together. Behind an
// act the cosine kind needs up to 72 registers and rotate 80 (28 and 24 warps per SM); no act fits in 64.
// With documents: 80, and 96 for rotate behind an act (24 and 20 warps), where the bounds without spilled
// (rotate behind a softmax still spills 4 to 8 bytes; at 80, 32 to 100). backward_blocks: the bound.
template <int NV, bool ROT, int CLS, bool DOCS>
constexpr int backward_blocks() {
  if (NV > 1) return 1;
  if (DOCS) return ROT && CLS != kNoAct ? 5 : 6;
  return CLS == kNoAct ? 8 : ROT ? 6 : 7;
}

template <class T, int VEC, int NV, bool ROT, int CLS, bool DOCS>
__global__ void __launch_bounds__(kThreads, backward_blocks<NV, ROT, CLS, DOCS>())
    backward_kernel(const T* __restrict__ x, const T* __restrict__ dout, T* __restrict__ dx, Geo g) {
  constexpr int P = ROT ? 2 : 1;
  const int lpr = g.lpr, lane = int(threadIdx.x) & (lpr - 1), rpb = kThreads / lpr;
  const int64_t rows = g.N * g.H, units = g.A / VEC;
  const int64_t b0 = int64_t(blockIdx.y) * g.bchunk, b1 = min(g.B, b0 + g.bchunk);
  const bool need_x = has_act<CLS>(g.act);
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t row = base + threadIdx.x / lpr, t = row / g.H, h = row - t * g.H;
    bool ok[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) ok[i] = row < rows && lane + i * lpr < units;
    float c[NV][VEC], s[NV][VEC];
    int64_t pos = t;
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (ok[i]) unit_sincos<VEC>(g, t, h, int64_t(lane + i * lpr) * VEC, c[i], s[i]);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = (b * g.N + t) * g.H + h;
      const int32_t start = DOCS && row < rows ? g.starts[b * g.N + t] : 0;  // loaded beside dout
      // gr: the gradient of act(x) (the inverse rotation of dout); v: x, then y for softmax.
      float gr[NV][P][VEC], v[NV][P][VEC];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (!ok[i]) continue;
        const int64_t j0 = int64_t(lane + i * lpr) * VEC;
        const Vec<T, VEC> r0 = load_raw<VEC>(dout + r * g.out_row + j0);
        const Vec<T, VEC> r1 = load_raw<VEC>(dout + r * g.out_row + g.out_half + j0);
        Vec<T, VEC> rx[P];
        if (need_x)
#pragma unroll
          for (int p = 0; p < P; ++p) rx[p] = load_raw<VEC>(x + x_row(g, b, t, h) + p * g.half + j0);
        // Documents: every unit's c and s for this row, once its loads are in flight (ok[0] holds here).
        if (DOCS && i == 0) move_to_document(g, t - start, h, lane, lpr, ok, pos, c, s);
        float d0[VEC], d1[VEC];
        to_float(r0, d0);
        to_float(r1, d1);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          gr[i][0][e] = d0[e] * c[i][e] + d1[e] * s[i][e];
          if constexpr (ROT) gr[i][P - 1][e] = d1[e] * c[i][e] - d0[e] * s[i][e];
        }
        if (need_x)
#pragma unroll
          for (int p = 0; p < P; ++p) to_float(rx[p], v[i][p]);
      }
      if (feature_softmax<CLS>(g.act)) {
        softmax_feature<NV, P, VEC>(v, ok, lpr);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              if (ok[i]) dot += v[i][p][e] * gr[i][p][e];
        dot = group_sum(dot, lpr);
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int p = 0; p < P; ++p)
#pragma unroll
            for (int e = 0; e < VEC; ++e) gr[i][p][e] = v[i][p][e] * (gr[i][p][e] - dot);
      } else if (sequence_softmax<CLS>(g.act)) {
        const int64_t srow = stat_row<DOCS>(g, b, start);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (!ok[i]) continue;
          const int64_t j0 = int64_t(lane + i * lpr) * VEC;
          softmax_sequence<P, VEC>(g, srow, h, j0, v[i]);
#pragma unroll
          for (int p = 0; p < P; ++p) {
            float q[VEC];
            load_f32<VEC>(g.q + (srow * g.H + h) * g.D + p * g.half + j0, q);
#pragma unroll
            for (int e = 0; e < VEC; ++e) gr[i][p][e] = v[i][p][e] * (gr[i][p][e] - q[e]);
          }
        }
      } else if (need_x) {
        with_elementwise_act(g.act, [&](auto A) {
#pragma unroll
          for (int i = 0; i < NV; ++i)
#pragma unroll
            for (int p = 0; p < P; ++p)
#pragma unroll
              for (int e = 0; e < VEC; ++e) gr[i][p][e] = act_backward<A.value>(v[i][p][e], gr[i][p][e]);
        });
      }
      T* drow = dx + b * g.dx_batch + t * g.dx_tok + h * g.dx_head;
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int p = 0; p < P; ++p)
          if (ok[i]) store<VEC>(drow + p * g.half + (lane + i * lpr) * VEC, gr[i][p]);
    }
  }
}

__global__ void table_kernel(float* __restrict__ table, Geo g) {
  const int64_t n = g.P * g.H * g.D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % g.D, r = i / g.D, h = r % g.H, p = r / g.H;
    float c[1], s[1];
    unit_sincos<1>(g, g.L + p, h, d, c, s);
    table[i] = c[0];
    table[n + i] = s[0];
  }
}

// ---------------------------------------------------------------------------------------------------
// Host side


int act_code(const LrpeSpec& spec) {
  switch (spec.act) {
    case Act::None: return kNone;
    case Act::Relu: return kRelu;
    case Act::Sigmoid: return kSigmoid;
    case Act::Silu: return kSilu;
    case Act::Softmax: return spec.dim == ActDim::Feature ? kSoftmaxFeature : kSoftmaxSequence;
  }
  return kNone;
}

Geo make_geo(const Shape& xs, const LrpeSpec& spec) {
  const char* op = spec.name();
  const Tensor& th = spec.theta;
  LT_CHECK(th.defined() && th.dim() == 2 && th.dtype() == DType::F32 && th.is_cuda() && th.is_contiguous(), "[", op,
           "] the kernels need theta as a contiguous f32 CUDA tensor (H or 1, E)");
  Geo g{};
  g.B = xs[0], g.N = xs[1], g.H = xs[2], g.D = xs[3];
  g.x_batch = g.N * g.H * g.D;
  g.x_tok = g.H * g.D;
  g.x_head = g.D;
  g.A = spec.rotate() ? g.D / 2 : g.D;
  g.half = g.D / 2;
  g.out_row = spec.rotate() ? g.D : 2 * g.D;
  g.out_half = spec.rotate() ? g.D / 2 : g.D;
  g.theta = th.data_ptr<float>();
  g.E = int(th.size(1));
  g.theta_stride = th.size(0) == 1 ? 0 : th.size(1);
  g.rate_per_head = spec.rate_per_head();
  g.offset = spec.offset;
  g.starts = spec.starts.defined() ? spec.starts.data_ptr<int32_t>() : nullptr;
  if (spec.kind == LrpeSpec::MdCosine) {
    g.md_k = int(spec.grid.size());
    for (int a = 0; a < g.md_k; ++a) g.grid[a] = spec.grid[size_t(a)];
    g.L = spec.extra_tokens;
    g.P = g.N - g.L;
    if (spec.table.defined()) g.table = spec.table.data_ptr<float>();
  }
  g.act = act_code(spec);
  return g;
}

void check_tensor(const Tensor& t, const Shape& shape, DType dtype, Device device, const char* op, const char* name) {
  LT_CHECK(t.defined() && t.shape() == shape && t.dtype() == dtype && t.device() == device && t.is_contiguous(), "[",
           op, "] ", name, " must be ", shape_str(shape), " ", dtype_name(dtype), " contiguous on ", device.name(),
           "; got ",
           t.defined() ? str(shape_str(t.shape()), " ", dtype_name(t.dtype()), t.is_contiguous() ? "" : " strided",
                             " on ", t.device().name())
                       : std::string("an undefined tensor"));
}

// Documents: starts (B, N) int32 contiguous on x's device, for the 1d kinds.
void check_starts(const LrpeSpec& spec, const Tensor& x, const char* op) {
  if (!spec.starts.defined()) return;
  LT_CHECK(spec.kind != LrpeSpec::MdCosine, "[", op, "] the kernels take documents for lrpe_cosine and lrpe_rotate");
  check_tensor(spec.starts, {x.size(0), x.size(1)}, DType::I32, x.device(), op, "starts");
}

// Softmax over the sequence: stats (B, H, D) f32, or (B, N, H, D) with documents (launch.h).
void check_stats(const LrpeSpec& spec, const Tensor& x, const Tensor& stats, const char* op) {
  if (!spec.seq_softmax()) return;
  const Shape shape = spec.starts.defined() ? Shape{x.size(0), x.size(1), x.size(2), x.size(3)}
                                            : Shape{x.size(0), x.size(2), x.size(3)};
  check_tensor(stats, shape, DType::F32, x.device(), op, "stats");
}

// x's features are packed (stride 1); its other strides may be anything.
bool packed(const Tensor& x) { return x.dim() == 4 && (x.size(3) == 1 || x.strides()[3] == 1); }

void check_x(const Tensor& x, const char* op) {
  LT_CHECK(packed(x) && x.is_cuda(), "[", op,
           "] the kernels need x (B, N, H, D) on a CUDA device with packed features (stride 1); got ",
           shape_str(x.shape()), " strides ", shape_str(x.strides()), " on ", x.device().name());
}

// x's batch, token and head strides into g; 0 for a dim of size 1, whose stride may be anything.
void set_x_strides(Geo& g, const Tensor& x) {
  const Shape& st = x.strides();
  g.x_batch = g.B > 1 ? st[0] : 0;
  g.x_tok = g.N > 1 ? st[1] : 0;
  g.x_head = g.H > 1 ? st[2] : 0;
}

// dx's likewise (the backward writes dx where it lies).
void set_dx_strides(Geo& g, const Tensor& dx) {
  const Shape& st = dx.strides();
  g.dx_batch = g.B > 1 ? st[0] : 0;
  g.dx_tok = g.N > 1 ? st[1] : 0;
  g.dx_head = g.H > 1 ? st[2] : 0;
}

// The widest vector (16 bytes at most) that divides every width (and stride) and keeps every pointer
// aligned.
template <class T>
int pick_vec(std::initializer_list<int64_t> widths, std::initializer_list<const void*> ptrs) {
  for (int vec = int(16 / sizeof(T)); vec > 1; vec /= 2) {
    bool fits = true;
    for (int64_t w : widths) fits = fits && w % vec == 0;
    for (const void* p : ptrs) fits = fits && reinterpret_cast<uintptr_t>(p) % (vec * sizeof(T)) == 0;
    if (fits) return vec;
  }
  return 1;
}

// Calls fn(IC<VEC>, IC<NV>, IC<act class>) for the instantiated shapes: the full 16-byte vector with one
// unit per lane, compiled per act class; 4 units per lane, and the narrower vectors (D not a multiple of
// the full one), compiled once for every act.
template <class T, class Fn>
void with_row_shape(int vec, int nv, int act, Fn&& fn) {
  constexpr int kFull = int(16 / sizeof(T));
  if (vec == kFull && nv == 1) {
    if (act == kSoftmaxFeature) return fn(IC<kFull>(), IC<1>(), IC<kFeature>());
    if (act == kSoftmaxSequence) return fn(IC<kFull>(), IC<1>(), IC<kSequence>());
    if (act == kNone) return fn(IC<kFull>(), IC<1>(), IC<kNoAct>());
    return fn(IC<kFull>(), IC<1>(), IC<kElementwise>());
  }
  if (vec == kFull) return fn(IC<kFull>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  if constexpr (kFull > 4) {
    if (vec == 4) return fn(IC<4>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  }
  if (vec == 2) return fn(IC<2>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
  return fn(IC<1>(), IC<kMaxUnitsPerLane>(), IC<kAnyAct>());
}

// The same with fn's fourth argument std::true_type with documents, std::false_type without: each shape is
// compiled both ways.
template <class T, class Fn>
void with_row_shape(int vec, int nv, int act, bool docs, Fn&& fn) {
  if (docs)
    with_row_shape<T>(vec, nv, act, [&](auto V, auto NV, auto CLS) { fn(V, NV, CLS, std::true_type()); });
  else
    with_row_shape<T>(vec, nv, act, [&](auto V, auto NV, auto CLS) { fn(V, NV, CLS, std::false_type()); });
}

template <class T, class Fn>
void with_vec(int vec, Fn&& fn) {
  constexpr int kFull = int(16 / sizeof(T));
  if (vec == kFull) return fn(IC<kFull>());
  if constexpr (kFull > 4) {
    if (vec == 4) return fn(IC<4>());
  }
  if (vec == 2) return fn(IC<2>());
  return fn(IC<1>());
}

// Resident blocks of Kernel per SM at `threads` threads per block (asked once per kernel).
template <auto Kernel>
int blocks_per_sm(int threads) {
  static const int n = [threads] {
    int v = 0;
    LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, threads, 0));
    return std::max(v, 1);
  }();
  return n;
}

// Lanes per row (g.lpr) for rows of A / vec vectors; returns the units per lane the kernels need.
int row_lanes(Geo& g, int vec, const char* op) {
  const int64_t units = g.A / vec;
  int lpr = 1;
  while (lpr < 32 && lpr < units) lpr *= 2;
  g.lpr = lpr;
  const int64_t nv = (units + lpr - 1) / lpr;
  LT_CHECK(nv <= kMaxUnitsPerLane, "[", op, "] the fused kernels handle rows of at most ", 32 * kMaxUnitsPerLane,
           " vectors of ", vec, " elements (D up to ", (g.A == g.D ? 1 : 2) * 32 * kMaxUnitsPerLane * vec,
           " here); got D = ", g.D);
  return nv == 1 ? 1 : kMaxUnitsPerLane;
}

// The row kernels' grid: row blocks x batch groups of g.bchunk rows. A lane computes its angles once per
// row and batch group, and works through its group's rows one after the other; so the batch is split
// only as far as the GPU needs: when the row blocks fit in the resident slots, into as many groups as
// still fit in one wave (a second, partial wave would cost a whole block's latency chain); else into
// enough groups for kRowWaves waves. No group gets fewer than kGroupRows rows (the angles would cost
// more than the rows' memory traffic). batch_rows > 0 sets the group size instead (tests).
dim3 row_grid(Geo& g, int64_t slots, int64_t batch_rows) {
  const int64_t rpb = kThreads / g.lpr, row_blocks = (g.N * g.H + rpb - 1) / rpb;
  int64_t groups = row_blocks <= slots ? slots / row_blocks : (kRowWaves * slots + row_blocks - 1) / row_blocks;
  groups = std::clamp<int64_t>(groups, 1, std::max<int64_t>(1, g.B / kGroupRows));
  g.bchunk = batch_rows > 0 ? std::min(batch_rows, g.B) : (g.B + groups - 1) / groups;
  g.bchunk = std::max(g.bchunk, (g.B + 65534) / 65535);  // gridDim.y <= 65535
  groups = (g.B + g.bchunk - 1) / g.bchunk;
  return dim3(unsigned(std::min<int64_t>(row_blocks, INT_MAX)), unsigned(groups));
}

template <auto Kernel, class... Args>
void launch_rows(Geo g, int64_t batch_rows, int sms, cudaStream_t st, Args... args) {
  const dim3 grid = row_grid(g, int64_t(sms) * blocks_per_sm<Kernel>(kThreads), batch_rows);
  Kernel<<<grid, kThreads, 0, st>>>(args..., g);
  LT_CUDA_CHECK_LAUNCH();
}

// Token chunks for the statistics kernels: about kStatWaves waves of resident blocks, at least 32 tokens
// per chunk; `forced` > 0 sets the chunk instead (tests).
int64_t stat_chunks(int64_t blocks_per_chunk, int64_t N, int64_t slots, int64_t forced, int64_t& chunk) {
  const int64_t want = std::max<int64_t>(1, kStatWaves * slots / std::max<int64_t>(1, blocks_per_chunk));
  const int64_t c = std::min((N + 31) / 32, want);
  chunk = forced > 0 ? std::min(forced, N) : (N + c - 1) / c;
  return (N + chunk - 1) / chunk;
}

unsigned flat_blocks(int64_t n) { return unsigned(std::min<int64_t>(std::max<int64_t>(1, (n + 255) / 256), 4096)); }

template <class T>
void seq_stats_forward(const T* x, const Geo& g, int64_t forced_chunk, const Tensor& lse, Device dev, int sms,
                       cudaStream_t st) {
  const int64_t HD = g.H * g.D;
  const int vec = pick_vec<T>({g.D, g.x_batch, g.x_tok, g.x_head}, {x});
  const int64_t gx = (HD / vec + 31) / 32;
  Tensor part;
  int64_t C = 0;
  with_vec<T>(vec, [&](auto V) {
    constexpr auto kernel = seq_stats_forward_kernel<T, V.value>;
    int64_t chunk = 0;
    C = stat_chunks(gx * g.B, g.N, int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows), forced_chunk, chunk);
    part = empty({2, g.B, C, HD}, DType::F32, dev);
    const dim3 grid{unsigned(gx), unsigned(C), unsigned(g.B)}, block{32, kStatRows};
    kernel<<<grid, block, 0, st>>>(x, part.data_ptr<float>(), g, chunk);
    LT_CUDA_CHECK_LAUNCH();
  });
  const dim3 fgrid{unsigned((HD + 31) / 32), unsigned(g.B)}, fblock{32, kStatRows};
  seq_stats_forward_finalize<<<fgrid, fblock, 0, st>>>(part.data_ptr<float>(), lse.data_ptr<float>(), C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

// q (B, H, D) for the backward of softmax over the sequence; vec is the row kernels' vector width.
template <class T, int VEC, bool ROT>
void seq_stats_backward(const T* x, const T* dout, const Geo& g, int64_t forced_chunk, const Tensor& q, Device dev,
                        int sms, cudaStream_t st) {
  constexpr auto kernel = seq_stats_backward_kernel<T, VEC, ROT>;
  constexpr int64_t bt = stat_batch_tile<VEC, ROT>();
  const int64_t HD = g.H * g.D, gx = (g.H * (g.A / VEC) + 31) / 32, gz = (g.B + bt - 1) / bt;
  int64_t chunk = 0;
  const int64_t C =
      stat_chunks(gx * gz, g.N, int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows), forced_chunk, chunk);
  Tensor part = empty({g.B, C, HD}, DType::F32, dev);
  const dim3 grid{unsigned(gx), unsigned(C), unsigned(gz)}, block{32, kStatRows};
  kernel<<<grid, block, 0, st>>>(x, dout, part.data_ptr<float>(), g, chunk);
  LT_CUDA_CHECK_LAUNCH();
  const dim3 fgrid{unsigned((HD + 31) / 32), unsigned(g.B)}, fblock{32, kStatRows};
  seq_stats_backward_finalize<<<fgrid, fblock, 0, st>>>(part.data_ptr<float>(), q.data_ptr<float>(), C, HD);
  LT_CUDA_CHECK_LAUNCH();
}

// Documents (ops/lrpe/doc_stats.cuh): tokens per piece, for about kWaves waves of resident warps over
// warps_per_piece warps per piece, at least kMinPiece tokens (each piece costs its partials: a short piece
// would move more partials than x); the finalize grid holds at most 65535 pieces. `forced` > 0 sets it (tests).
int64_t doc_piece(int64_t warps_per_piece, int64_t N, int64_t resident_warps, int64_t forced) {
  constexpr int64_t kMinPiece = 16, kWaves = 2;
  int64_t piece = forced;
  if (piece <= 0) {
    const int64_t want = std::max<int64_t>(1, kWaves * resident_warps / std::max<int64_t>(1, warps_per_piece));
    piece = std::max(kMinPiece, (N + want - 1) / want);
  }
  return std::max(std::min(piece, N), (N + 65534) / 65535);
}

template <class T>
void doc_stats_forward(const T* x, const Geo& g, int64_t forced_piece, const Tensor& lse, Device dev, int sms,
                       cudaStream_t st) {
  const int64_t HD = g.H * g.D;
  const int vec = pick_vec<T>({g.D, g.x_batch, g.x_tok, g.x_head}, {x});
  const int64_t gx = (HD / vec + 31) / 32;
  with_vec<T>(vec, [&](auto V) {
    constexpr auto kernel = doc_stats_forward_kernel<T, V.value>;
    const int64_t resident = int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows) * kStatRows;
    const int64_t piece = doc_piece(gx * g.B, g.N, resident, forced_piece), pieces = (g.N + piece - 1) / piece;
    Tensor part = empty({4, g.B, pieces, HD}, DType::F32, dev);
    const dim3 grid{unsigned(gx), unsigned((pieces + kStatRows - 1) / kStatRows), unsigned(g.B)};
    kernel<<<grid, dim3(32, kStatRows), 0, st>>>(x, part.data_ptr<float>(), lse.data_ptr<float>(), g, piece);
    LT_CUDA_CHECK_LAUNCH();
    const dim3 fgrid{unsigned((HD + 127) / 128), unsigned(pieces), unsigned(g.B)};
    doc_stats_finalize<true>
        <<<fgrid, 128, 0, st>>>(part.data_ptr<float>(), lse.data_ptr<float>(), g.starts, g.N, HD, piece);
    LT_CUDA_CHECK_LAUNCH();
  });
}

// q (B, N, H, D) for the backward with documents; vec is the row kernels' vector width.
template <class T, int VEC, bool ROT>
void doc_stats_backward(const T* x, const T* dout, const Geo& g, int64_t forced_piece, const Tensor& q, Device dev,
                        int sms, cudaStream_t st) {
  constexpr auto kernel = doc_stats_backward_kernel<T, VEC, ROT>;
  const int64_t HD = g.H * g.D, gx = (g.H * (g.A / VEC) + 31) / 32;
  const int64_t resident = int64_t(sms) * blocks_per_sm<kernel>(32 * kStatRows) * kStatRows;
  const int64_t piece = doc_piece(gx * g.B, g.N, resident, forced_piece), pieces = (g.N + piece - 1) / piece;
  Tensor part = empty({2, g.B, pieces, HD}, DType::F32, dev);
  const dim3 grid{unsigned(gx), unsigned((pieces + kStatRows - 1) / kStatRows), unsigned(g.B)};
  kernel<<<grid, dim3(32, kStatRows), 0, st>>>(x, dout, part.data_ptr<float>(), q.data_ptr<float>(), g, piece);
  LT_CUDA_CHECK_LAUNCH();
  const dim3 fgrid{unsigned((HD + 127) / 128), unsigned(pieces), unsigned(g.B)};
  doc_stats_finalize<false>
      <<<fgrid, 128, 0, st>>>(part.data_ptr<float>(), q.data_ptr<float>(), g.starts, g.N, HD, piece);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool reads_in_place(const Tensor& x) {
  if (x.is_contiguous()) return true;
  if (!packed(x)) return false;
  const int64_t es = int64_t(dtype_size(x.dtype()));
  bool aligned = reinterpret_cast<uintptr_t>(x.data()) % 16 == 0;
  for (int d = 0; d < 3; ++d) aligned = aligned && (x.size(d) == 1 || x.strides()[size_t(d)] * es % 16 == 0);
  return aligned;
}

void forward(const Tensor& x, const LrpeSpec& spec, const Tensor& out, const Tensor& stats) {
  const char* op = spec.name();
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(out, spec.out_shape(x.shape()), x.dtype(), dev, op, "out");
  check_starts(spec, x, op);
  check_stats(spec, x, stats, op);
  Geo g = make_geo(x.shape(), spec);
  set_x_strides(g, x);
  if (x.numel() == 0) return;
  const int sms = sm_count(dev.index);
  cudaStream_t st = stream(dev.index);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), op, T, {
    if constexpr (std::is_same_v<T, double>) {
      fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got f64"));
    } else {
      const T* xp = static_cast<const T*>(x.data());
      T* op_ = static_cast<T*>(out.data());
      if (spec.seq_softmax()) {
        if (g.starts)
          doc_stats_forward<T>(xp, g, spec.stat_chunk, stats, dev, sms, st);
        else
          seq_stats_forward<T>(xp, g, spec.stat_chunk, stats, dev, sms, st);
        g.lse = stats.data_ptr<float>();
      }
      const int vec = pick_vec<T>({g.A, g.x_batch, g.x_tok, g.x_head}, {xp, op_});
      const int nv = row_lanes(g, vec, op);
      with_row_shape<T>(vec, nv, g.act, g.starts != nullptr, [&](auto V, auto NV, auto CLS, auto DOCS) {
        constexpr int v = V.value, n = NV.value, cls = CLS.value;
        constexpr bool docs = DOCS.value;
        if (spec.rotate())
          launch_rows<forward_kernel<T, v, n, true, cls, docs>>(g, spec.batch_rows, sms, st, xp, op_);
        else
          launch_rows<forward_kernel<T, v, n, false, cls, docs>>(g, spec.batch_rows, sms, st, xp, op_);
      });
    }
  });
}

void backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec, const Tensor& stats, const Tensor& dx) {
  const char* op = spec.name();
  check_x(x, op);
  const Device dev = x.device();
  check_tensor(dout, spec.out_shape(x.shape()), x.dtype(), dev, op, "dout");
  LT_CHECK(dx.defined() && dx.shape() == x.shape() && dx.dtype() == x.dtype() && dx.device() == dev && packed(dx),
           "[", op, "] dx must be ", shape_str(x.shape()), " ", dtype_name(x.dtype()), " on ", dev.name(),
           " with packed features (stride 1); got ",
           dx.defined() ? str(shape_str(dx.shape()), " strides ", shape_str(dx.strides()), " ", dtype_name(dx.dtype()),
                              " on ", dx.device().name())
                        : std::string("an undefined tensor"));
  check_starts(spec, x, op);
  check_stats(spec, x, stats, op);
  Geo g = make_geo(x.shape(), spec);
  set_x_strides(g, x);
  set_dx_strides(g, dx);
  if (x.numel() == 0) return;
  const int sms = sm_count(dev.index);
  cudaStream_t st = stream(dev.index);
  LT_DISPATCH_FLOAT_CUDA(x.dtype(), op, T, {
    if constexpr (std::is_same_v<T, double>) {
      fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got f64"));
    } else {
      const T* xp = static_cast<const T*>(x.data());
      const T* dp = static_cast<const T*>(dout.data());
      T* dxp = static_cast<T*>(dx.data());
      const int vec = pick_vec<T>({g.A, g.x_batch, g.x_tok, g.x_head, g.dx_batch, g.dx_tok, g.dx_head}, {xp, dp, dxp});
      Tensor q;
      if (spec.seq_softmax()) {
        g.lse = stats.data_ptr<float>();
        q = empty_like(stats);
        with_vec<T>(vec, [&](auto V) {
          if (g.starts && spec.rotate())
            doc_stats_backward<T, V.value, true>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
          else if (g.starts)
            doc_stats_backward<T, V.value, false>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
          else if (spec.rotate())
            seq_stats_backward<T, V.value, true>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
          else
            seq_stats_backward<T, V.value, false>(xp, dp, g, spec.stat_chunk, q, dev, sms, st);
        });
        g.q = q.data_ptr<float>();
      }
      const int nv = row_lanes(g, vec, op);
      with_row_shape<T>(vec, nv, g.act, g.starts != nullptr, [&](auto V, auto NV, auto CLS, auto DOCS) {
        constexpr int v = V.value, n = NV.value, cls = CLS.value;
        constexpr bool docs = DOCS.value;
        if (spec.rotate())
          launch_rows<backward_kernel<T, v, n, true, cls, docs>>(g, spec.batch_rows, sms, st, xp, dp, dxp);
        else
          launch_rows<backward_kernel<T, v, n, false, cls, docs>>(g, spec.batch_rows, sms, st, xp, dp, dxp);
      });
    }
  });
}

void build_table(const LrpeSpec& spec, int64_t H, int64_t D, const Tensor& table) {
  LT_CHECK(spec.kind == LrpeSpec::MdCosine && !spec.table.defined(),
           "[md_lrpe_cosine] build_table needs an md spec without a table");
  int64_t P = 1;
  for (int64_t n : spec.grid) P *= n;
  check_tensor(table, {2, P, H, D}, DType::F32, spec.theta.device(), "md_lrpe_cosine", "table");
  Geo g = make_geo({1, spec.extra_tokens + P, H, D}, spec);
  if (table.numel() == 0) return;
  table_kernel<<<flat_blocks(P * H * D), 256, 0, stream(table.device().index)>>>(table.data_ptr<float>(), g);
  LT_CUDA_CHECK_LAUNCH();
}

}  // namespace lintape::lrpe_cuda
