// The LRPE family's reference: plain loops in double with a hand-written backward; the acts are
// ops/activation.h's act_reference. Any float dtype (f64 for gradient checks), on the CPU.
#include <algorithm>
#include <cmath>
#include <vector>
#include "autograd/tape.h"
#include "ops/documents.h"
#include "ops/lrpe/paths.h"
#include "ops/shape.h"

namespace lintape::lrpe_paths {
using autograd::Grads;
using autograd::nondiff;
using autograd::record;

namespace {

// cos and sin of every angle, (N, H, A) with A the angle width (D, or D/2 for rotate), indexed by the token's
// place t (md) or its position in its document (1d; t without documents).
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

// Calls fn(i, ia, o0, o1) for every unit: x index i, angle index ia into the table, output indices o0
// and o1 (the cos and sin halves for the cosine kinds; for rotate i is in the first half, i + D/2 is the
// partner and o0, o1 are the two output halves).
template <class Fn>
void for_each_unit(const Shape& xs, const LrpeSpec& spec, Fn&& fn) {
  const int64_t B = xs[0], N = xs[1], H = xs[2], D = xs[3];
  const int64_t A = spec.rotate() ? D / 2 : D, orow = spec.rotate() ? D : 2 * D;
  std::vector<int32_t> starts;  // documents: each token's place in its document is t - starts[b, t]
  if (spec.starts.defined()) starts = spec.starts.to_vector<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < N; ++t) {
      const int64_t pos = starts.empty() ? t : t - starts[size_t(b * N + t)];
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = (b * N + t) * H + h;
        for (int64_t j = 0; j < A; ++j) fn(size_t(r * D + j), size_t((pos * H + h) * A + j), size_t(r * orow + j),
                                           size_t(r * orow + A + j));
      }
    }
}

// Calls fn(first element, tokens) for every document of x's rows (B, N, H, D) contiguous: for softmax over the
// sequence with documents, which normalises each document on its own; else once for the whole tensor.
template <class Fn>
void for_each_act_span(const Shape& xs, const LrpeSpec& spec, Fn&& fn) {
  if (!(spec.seq_softmax() && spec.starts.defined())) return fn(size_t(0), Shape(xs));
  // The documents over the flattened rows: each one's first token and length.
  const std::vector<int64_t> cu = documents_cu_seqlens(Documents::from_starts(spec.starts), xs[0], xs[1]);
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    fn(size_t(cu[i] * xs[2] * xs[3]), Shape{1, cu[i + 1] - cu[i], xs[2], xs[3]});
}

// act(x) over the whole of x, or over each document (for_each_act_span).
std::vector<double> act_spans(const std::vector<double>& x, const Shape& xs, const LrpeSpec& spec) {
  std::vector<double> y(x.size());
  for_each_act_span(xs, spec, [&](size_t first, const Shape& part) {
    const size_t n = size_t(shape_numel(part));
    const std::vector<double> in(x.begin() + long(first), x.begin() + long(first + n));
    const std::vector<double> out = act_reference(in, part, spec.act, spec.dim);
    std::copy(out.begin(), out.end(), y.begin() + long(first));
  });
  return y;
}

std::vector<double> act_spans_backward(const std::vector<double>& x, const std::vector<double>& g, const Shape& xs,
                                       const LrpeSpec& spec) {
  std::vector<double> dx(x.size());
  for_each_act_span(xs, spec, [&](size_t first, const Shape& part) {
    const size_t n = size_t(shape_numel(part));
    const std::vector<double> in(x.begin() + long(first), x.begin() + long(first + n));
    const std::vector<double> gin(g.begin() + long(first), g.begin() + long(first + n));
    const std::vector<double> out = act_reference_backward(in, gin, part, spec.act, spec.dim);
    std::copy(out.begin(), out.end(), dx.begin() + long(first));
  });
  return dx;
}

Tensor reference_forward(const Tensor& x, const LrpeSpec& spec) {
  const Shape& xs = x.shape();
  const int64_t D = xs[3], A = spec.rotate() ? D / 2 : D;
  const std::vector<double> y = act_spans(x.to_vector<double>(), xs, spec);
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

Tensor reference_backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec) {
  const Shape& xs = x.shape();
  const int64_t N = xs[1], H = xs[2], D = xs[3], A = spec.rotate() ? D / 2 : D;
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
  return from_vector(act_spans_backward(x.to_vector<double>(), g, xs, spec), xs, x.dtype());
}

}  // namespace

Tensor run_reference(const Tensor& x, LrpeSpec spec, const Tensor& theta) {
  spec.theta = theta.detach();
  Tensor out = reference_forward(x, spec);
  Tensor xs = x.detach();
  record(spec.name(), {x, nondiff(theta, "theta")}, {out}, [xs, spec](const Grads& g) -> Grads {
    return {reference_backward(xs, g[0], spec), Tensor()};
  });
  return out;
}

}  // namespace lintape::lrpe_paths
