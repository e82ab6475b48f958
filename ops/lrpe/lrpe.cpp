// The LRPE family: input checks, the CPU reference (plain loops in double, hand-written backward), the
// composed path (primitive ops, differentiated by the tape), and the fused CUDA path (ops/lrpe/rows.cu).
// Every path saves x, not act(x) nor the output; theta never gets a gradient.
#include "ops/lrpe/lrpe.h"
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/lrpe/launch.h"
#include "ops/shape.h"

namespace lintape {
using autograd::Grads;
using autograd::nondiff;
using autograd::record;

namespace {

int64_t grid_tokens(const std::vector<int64_t>& grid) {
  int64_t p = 1;
  for (int64_t n : grid) p *= n;
  return p;
}

void check_inputs(const Tensor& x, const LrpeSpec& spec) {
  const char* op = spec.name();
  const Tensor& theta = spec.theta;
  LT_CHECK(x.defined() && theta.defined(), "[", op, "] x and theta must be defined tensors");
  LT_CHECK(x.dim() == 4, "[", op, "] x must be (B, N, H, D); got ", shape_str(x.shape()));
  LT_CHECK(is_floating(x.dtype()), "[", op, "] x must be a float tensor (f32, f64, bf16, f16); got ",
           dtype_name(x.dtype()));
  LT_CHECK(theta.device() == x.device(), "[", op, "] x and theta must be on the same device; got x on ",
           x.device().name(), " and theta on ", theta.device().name());
  LT_CHECK(theta.dim() == 2 && is_floating(theta.dtype()), "[", op, "] theta must be a 2-D float tensor; got ",
           shape_str(theta.shape()), " ", dtype_name(theta.dtype()));
  check_act(spec.act, spec.dim, op);
  const int64_t N = x.size(1), H = x.size(2), D = x.size(3), rows = theta.size(0), E = theta.size(1);
  const bool heads_ok = rows == H || rows == 1;
  switch (spec.kind) {
    case LrpeSpec::Cosine:
      LT_CHECK(heads_ok && E >= 1 && (E == 1 || E <= D), "[", op,
               "] theta must be (H, E), (1, E) or (H, 1) with H = ", H, " and E <= D = ", D, "; got ",
               shape_str(theta.shape()));
      break;
    case LrpeSpec::Rotate:
      LT_CHECK(D % 2 == 0, "[", op, "] D must be even (x is split in halves); got D = ", D);
      LT_CHECK(heads_ok && E >= 1 && (E == 1 || E <= D / 2), "[", op,
               "] theta must be (H, E), (1, E) or (H, 1) with H = ", H, " and E <= D/2 = ", D / 2, "; got ",
               shape_str(theta.shape()));
      break;
    case LrpeSpec::MdCosine: {
      const int64_t k = int64_t(spec.grid.size());
      LT_CHECK(k >= 1 && k <= 4, "[", op, "] shape must have 1 to 4 dims; got ", k, " dims ", shape_str(spec.grid));
      for (int64_t n : spec.grid)
        LT_CHECK(n >= 1, "[", op, "] shape sizes must be >= 1; got ", shape_str(spec.grid));
      LT_CHECK(spec.extra_tokens >= 0, "[", op, "] extra_tokens must be >= 0; got ", spec.extra_tokens);
      LT_CHECK(grid_tokens(spec.grid) == N - spec.extra_tokens, "[", op, "] shape ", shape_str(spec.grid), " has ",
               grid_tokens(spec.grid), " tokens but x has N - L = ", N, " - ", spec.extra_tokens, " = ",
               N - spec.extra_tokens);
      LT_CHECK(heads_ok && k * E >= D, "[", op, "] theta must be (H, E) or (1, E) with H = ", H,
               " and k * E >= D = ", D, " for a grid of k = ", k, " dims; got ", shape_str(theta.shape()));
      break;
    }
  }
  LT_CHECK(spec.offset >= 0, "[", op, "] offset must be >= 0; got ", spec.offset);
}

// ---------------------------------------------------------------------------------------------------
// Reference: plain loops in double.

// cos and sin of every angle, (N, H, A) with A the angle width (D, or D/2 for rotate).
struct AngleTable {
  std::vector<double> c, s;
};

AngleTable reference_angles(const LrpeSpec& spec, int64_t N, int64_t H, int64_t A) {
  const std::vector<double> th = spec.theta.to_vector<double>();
  const int64_t E = spec.theta.size(1), stride = spec.theta.size(0) == 1 ? 0 : E;
  const int64_t k = int64_t(spec.grid.size()), L = spec.extra_tokens;
  AngleTable tab;
  tab.c.resize(size_t(N * H * A));
  tab.s.resize(size_t(N * H * A));
  std::vector<double> coord(static_cast<size_t>(k));
  for (int64_t t = 0; t < N; ++t) {
    const bool md = spec.kind == LrpeSpec::MdCosine;
    if (md && t >= L) {
      int64_t rest = t - L;
      for (int64_t a = k - 1; a >= 0; --a) {
        coord[size_t(a)] = double(rest % spec.grid[size_t(a)]);
        rest /= spec.grid[size_t(a)];
      }
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < A; ++j) {
        const double* rate = th.data() + h * stride;
        double angle;
        if (md)
          angle = t < L ? 0.0 : coord[size_t(j / E)] * rate[j % E];
        else
          angle = double(spec.offset + t) * (spec.rate_per_head() ? rate[0] : (j < E ? rate[j] : 0.0));
        tab.c[size_t((t * H + h) * A + j)] = std::cos(angle);
        tab.s[size_t((t * H + h) * A + j)] = std::sin(angle);
      }
  }
  return tab;
}

double sigmoid_d(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Softmax over the sequence: per (b, h, d) max and sum of exp(x - max) over N.
struct SeqStats {
  std::vector<double> max, sum;
};

// y = act(x) for x (B, N, H, D) in row-major order; fills stats for softmax over the sequence.
std::vector<double> reference_act(const std::vector<double>& x, const Shape& shape, Act act, ActDim dim,
                                  SeqStats* stats) {
  const int64_t B = shape[0], N = shape[1], H = shape[2], D = shape[3];
  std::vector<double> y(x.size());
  switch (act) {
    case Act::None: y = x; break;
    case Act::Relu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] > 0 ? x[i] : 0.0;
      break;
    case Act::Sigmoid:
      for (size_t i = 0; i < x.size(); ++i) y[i] = sigmoid_d(x[i]);
      break;
    case Act::Silu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sigmoid_d(x[i]);
      break;
    case Act::Softmax:
      if (dim == ActDim::Feature) {
        for (int64_t r = 0; r < B * N * H; ++r) {
          const double* xr = x.data() + r * D;
          double* yr = y.data() + r * D;
          double m = *std::max_element(xr, xr + D), sum = 0;
          for (int64_t d = 0; d < D; ++d) sum += (yr[d] = std::exp(xr[d] - m));
          for (int64_t d = 0; d < D; ++d) yr[d] /= sum;
        }
      } else {
        SeqStats own;
        SeqStats& st = stats ? *stats : own;
        st.max.assign(size_t(B * H * D), -INFINITY);
        st.sum.assign(size_t(B * H * D), 0.0);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < N; ++t)
            for (int64_t k = 0; k < H * D; ++k) {
              double& m = st.max[size_t(b * H * D + k)];
              m = std::max(m, x[size_t((b * N + t) * H * D + k)]);
            }
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < N; ++t)
            for (int64_t k = 0; k < H * D; ++k) {
              const size_t i = size_t((b * N + t) * H * D + k), s = size_t(b * H * D + k);
              y[i] = std::exp(x[i] - st.max[s]);
              st.sum[s] += y[i];
            }
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < N; ++t)
            for (int64_t k = 0; k < H * D; ++k) y[size_t((b * N + t) * H * D + k)] /= st.sum[size_t(b * H * D + k)];
      }
      break;
  }
  return y;
}

// Calls fn(i, ia, o0, o1) for every unit: x index i, angle index ia into the table, output indices o0
// and o1 (the cos and sin halves for the cosine kinds; for rotate i is in the first half, i + D/2 is the
// partner and o0, o1 are the two output halves).
template <class Fn>
void for_each_unit(const Shape& xs, const LrpeSpec& spec, Fn&& fn) {
  const int64_t B = xs[0], N = xs[1], H = xs[2], D = xs[3];
  const int64_t A = spec.rotate() ? D / 2 : D, orow = spec.rotate() ? D : 2 * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = (b * N + t) * H + h;
        for (int64_t j = 0; j < A; ++j) fn(size_t(r * D + j), size_t((t * H + h) * A + j), size_t(r * orow + j),
                                           size_t(r * orow + A + j));
      }
}

Tensor reference_forward(const Tensor& x, const LrpeSpec& spec, SeqStats& stats) {
  const Shape& xs = x.shape();
  const int64_t D = xs[3], A = spec.rotate() ? D / 2 : D;
  const std::vector<double> y = reference_act(x.to_vector<double>(), xs, spec.act, spec.dim, &stats);
  const AngleTable tab = reference_angles(spec, xs[1], xs[2], A);
  const Shape os = spec.out_shape(x.shape());
  std::vector<double> out(size_t(shape_numel(os)));
  for_each_unit(xs, spec, [&](size_t i, size_t ia, size_t o0, size_t o1) {
    const double c = tab.c[ia], s = tab.s[ia];
    if (spec.rotate()) {
      const double y1 = y[i], y2 = y[i + size_t(A)];
      out[o0] = y1 * c - y2 * s;
      out[o1] = y1 * s + y2 * c;
    } else {
      out[o0] = y[i] * c;
      out[o1] = y[i] * s;
    }
  });
  return from_vector(out, os, x.dtype());
}

Tensor reference_backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec, const SeqStats& stats) {
  const Shape& xs = x.shape();
  const int64_t B = xs[0], N = xs[1], H = xs[2], D = xs[3], A = spec.rotate() ? D / 2 : D;
  const AngleTable tab = reference_angles(spec, N, H, A);
  const std::vector<double> go = dout.to_vector<double>();
  // g: the gradient of act(x), the inverse rotation of dout.
  std::vector<double> g(size_t(x.numel()));
  for_each_unit(xs, spec, [&](size_t i, size_t ia, size_t o0, size_t o1) {
    const double c = tab.c[ia], s = tab.s[ia];
    g[i] = go[o0] * c + go[o1] * s;
    if (spec.rotate()) g[i + size_t(A)] = -go[o0] * s + go[o1] * c;
  });
  if (spec.act == Act::None) return from_vector(g, xs, x.dtype());

  const std::vector<double> xv = x.to_vector<double>();
  std::vector<double> dx(g.size());
  switch (spec.act) {
    case Act::Relu:
      for (size_t i = 0; i < g.size(); ++i) dx[i] = xv[i] > 0 ? g[i] : 0.0;
      break;
    case Act::Sigmoid:
      for (size_t i = 0; i < g.size(); ++i) {
        const double y = sigmoid_d(xv[i]);
        dx[i] = g[i] * y * (1 - y);
      }
      break;
    case Act::Silu:
      for (size_t i = 0; i < g.size(); ++i) {
        const double sg = sigmoid_d(xv[i]);
        dx[i] = g[i] * sg * (1 + xv[i] * (1 - sg));
      }
      break;
    case Act::Softmax:
      if (spec.dim == ActDim::Feature) {
        const std::vector<double> y = reference_act(xv, xs, spec.act, spec.dim, nullptr);
        for (int64_t r = 0; r < B * N * H; ++r) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += y[size_t(r * D + d)] * g[size_t(r * D + d)];
          for (int64_t d = 0; d < D; ++d) {
            const size_t i = size_t(r * D + d);
            dx[i] = y[i] * (g[i] - dot);
          }
        }
      } else {
        // y from the saved statistics; q = sum over N of y * g per (b, h, d).
        std::vector<double> y(g.size()), q(size_t(B * H * D), 0.0);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < N; ++t)
            for (int64_t k = 0; k < H * D; ++k) {
              const size_t i = size_t((b * N + t) * H * D + k), s = size_t(b * H * D + k);
              y[i] = std::exp(xv[i] - stats.max[s]) / stats.sum[s];
              q[s] += y[i] * g[i];
            }
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < N; ++t)
            for (int64_t k = 0; k < H * D; ++k) {
              const size_t i = size_t((b * N + t) * H * D + k);
              dx[i] = y[i] * (g[i] - q[size_t(b * H * D + k)]);
            }
      }
      break;
    case Act::None: break;
  }
  return from_vector(dx, xs, x.dtype());
}

Tensor run_reference(const Tensor& x, LrpeSpec spec, const Tensor& theta) {
  spec.theta = theta.detach();
  auto stats = std::make_shared<SeqStats>();
  Tensor out = reference_forward(x, spec, *stats);
  Tensor xs = x.detach();
  record(spec.name(), {x, nondiff(theta, "theta")}, {out}, [xs, spec, stats](const Grads& g) -> Grads {
    return {reference_backward(xs, g[0], spec, *stats), Tensor()};
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Composed: primitive ops, recorded by the tape.

Tensor run_composed(const Tensor& x, const LrpeSpec& spec) {
  const int64_t N = x.size(1), D = x.size(3), A = spec.rotate() ? D / 2 : D;
  const DType ct = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Device dev = x.device();
  Tensor c, s;  // (N, 1 or H, A or 1), in x's dtype
  {
    NoGradGuard no_grad;  // theta gets no gradient
    Tensor th = spec.theta.detach().to(ct);
    const int64_t R = th.size(0), E = th.size(1);
    th = th.view({1, R, E});
    Tensor angle;
    if (spec.kind == LrpeSpec::MdCosine) {
      const int64_t L = spec.extra_tokens, P = N - L, k = int64_t(spec.grid.size());
      std::vector<Tensor> axes;
      int64_t inner = P;
      for (int64_t a = 0; a < k; ++a) {
        const int64_t n = spec.grid[size_t(a)];
        inner /= n;
        std::vector<double> coord(static_cast<size_t>(P));
        for (int64_t p = 0; p < P; ++p) coord[size_t(p)] = double((p / inner) % n);
        axes.push_back(from_vector(coord, {P, 1, 1}, ct, dev) * th);
      }
      angle = cat(axes, 2).narrow(2, 0, D);
      if (L > 0) angle = cat({zeros({L, R, D}, ct, dev), angle}, 0);
    } else {
      angle = arange(spec.offset, spec.offset + N, ct, dev).view({N, 1, 1}) * th;
      if (!spec.rate_per_head() && E < A) angle = cat({angle, zeros({N, R, A - E}, ct, dev)}, 2);
    }
    c = cos(angle).to(x.dtype());
    s = sin(angle).to(x.dtype());
  }
  Tensor xb = apply_act(x, spec.act, spec.dim);
  if (spec.rotate()) {
    Tensor x1 = xb.narrow(3, 0, A), x2 = xb.narrow(3, A, A);
    return cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
  }
  return cat({xb * c, xb * s}, 3);
}

// ---------------------------------------------------------------------------------------------------
// Fused: the CUDA kernels. They read x in place where they can (a contiguous x, or a view such as a
// narrow over heads: lrpe_cuda::reads_in_place), else a contiguous copy.

#if LINTAPE_WITH_CUDA
// md cached mode: the (2, P, H, D) cos/sin table, kept per (grid, L, H, D, theta's storage, offset and
// version, device). An entry whose theta storage died is stale even if a new one reuses its address.
Tensor cached_table(const LrpeSpec& spec, const Tensor& theta, int64_t H, int64_t D) {
  struct Entry {
    std::vector<int64_t> grid;
    int64_t L, H, D, offset;
    std::weak_ptr<Storage> storage;
    uint64_t version;
    Shape theta_shape;
    DType theta_dtype;
    Tensor table;
  };
  static std::mutex mu;
  static auto* entries = new std::vector<Entry>();  // never destroyed: its tensors outlive exit order
  const std::shared_ptr<Storage>& st = theta.impl()->storage;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : *entries)
    if (e.grid == spec.grid && e.L == spec.extra_tokens && e.H == H && e.D == D && e.offset == theta.offset() &&
        e.storage.lock() == st && e.version == st->version && e.theta_shape == theta.shape() &&
        e.theta_dtype == theta.dtype())
      return e.table;
  Tensor table = empty({2, grid_tokens(spec.grid), H, D}, DType::F32, theta.device());
  lrpe_cuda::build_table(spec, H, D, table);
  constexpr size_t kMaxEntries = 8;
  if (entries->size() >= kMaxEntries) entries->erase(entries->begin());
  entries->push_back({spec.grid, spec.extra_tokens, H, D, theta.offset(), st, st->version, theta.shape(),
                      theta.dtype(), table});
  return table;
}
#endif

Tensor run_fused(const Tensor& x_in, LrpeSpec spec, const Tensor& theta, bool cache_angles) {
  const char* op = spec.name();
  LT_CHECK(x_in.is_cuda(), "[", op, "] Impl::Fused needs x on a CUDA device; got x on ", x_in.device().name());
  LT_CHECK(x_in.dtype() != DType::F64, "[", op, "] Impl::Fused supports f32, bf16 and f16; got f64");
#if LINTAPE_WITH_CUDA
  const Tensor x = lrpe_cuda::reads_in_place(x_in) ? x_in : x_in.contiguous();
  spec.theta = theta.detach().to(DType::F32).contiguous();
  if (cache_angles) spec.table = cached_table(spec, theta, x.size(2), x.size(3));
  Tensor out = empty(spec.out_shape(x.shape()), x.dtype(), x.device());
  Tensor stats = spec.seq_softmax() ? empty({x.size(0), x.size(2), x.size(3)}, DType::F32, x.device()) : Tensor();
  lrpe_cuda::forward(x, spec, out, stats);
  Tensor xs = x.detach();  // a view stays one: backward reads it in place too
  record(op, {x, nondiff(theta, "theta")}, {out}, [xs, spec, stats](const Grads& g) -> Grads {
    Tensor dout = g[0].to(xs.dtype()).contiguous();
    Tensor dx = empty_like(xs);
    lrpe_cuda::backward(xs, dout, spec, stats, dx);
    return {dx, Tensor()};
  });
  return out;
#else
  (void)theta;
  (void)cache_angles;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

Tensor run(const Tensor& x_in, const LrpeSpec& spec, Impl impl, bool cache_angles = false) {
  check_inputs(x_in, spec);
  const char* op = spec.name();
  if (impl == Impl::Auto)
    impl = !x_in.is_cuda() ? Impl::Reference : x_in.dtype() == DType::F64 ? Impl::Composed : Impl::Fused;
  if (impl == Impl::Composed) return run_composed(x_in, spec);
  if (impl == Impl::Fused) return run_fused(x_in, spec, spec.theta, cache_angles);
  const Tensor x = x_in.contiguous();
  LT_CHECK(!x.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got x on ", x.device().name());
  return run_reference(x, spec, spec.theta);
}

}  // namespace

namespace {
LrpeSpec spec_1d(LrpeSpec::Kind kind, const Tensor& theta, const LrpeOptions& options) {
  LrpeSpec spec;
  spec.kind = kind;
  spec.theta = theta;
  spec.offset = options.offset;
  spec.act = options.act;
  spec.dim = options.dim;
  return spec;
}
}  // namespace

Tensor lrpe_cosine(const Tensor& x, const Tensor& theta, const LrpeOptions& options, Impl impl) {
  return run(x, spec_1d(LrpeSpec::Cosine, theta, options), impl);
}

Tensor lrpe_rotate(const Tensor& x, const Tensor& theta, const LrpeOptions& options, Impl impl) {
  return run(x, spec_1d(LrpeSpec::Rotate, theta, options), impl);
}

Tensor md_lrpe_cosine(const Tensor& x, const Tensor& theta, const MdLrpeOptions& options, Impl impl) {
  LrpeSpec spec;
  spec.kind = LrpeSpec::MdCosine;
  spec.theta = theta;
  spec.grid = options.shape;
  spec.extra_tokens = options.extra_tokens;
  spec.act = options.act;
  spec.dim = options.dim;
  return run(x, spec, impl, options.cache_angles);
}

Tensor lrpe_theta(int64_t H, int64_t E, double base, Device device) {
  LT_CHECK(H >= 1 && E >= 1, "[lrpe_theta] H and E must be >= 1; got H = ", H, ", E = ", E);
  LT_CHECK(base > 1, "[lrpe_theta] base must be > 1; got ", base);
  std::vector<double> values(static_cast<size_t>(H * E));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < E; ++k) values[h * E + k] = std::pow(base, -static_cast<double>(k) / E);
  return from_vector(values, {H, E}, DType::F32, device);
}

}  // namespace lintape
