// tpa_factors: the TPA mixer's six factors out of its one projection, with the rotary embedding on bq and bk.
// On CUDA the rotation of bq and bk is one launch of the LRPE family's rotate kernel (ops/lrpe/launch.h), and
// the backward writes the projection's gradient in one buffer: the rotation's backward straight into the bq and
// bk columns, bv's gradient copied into its columns, the rank gradients gathered into theirs by one kernel
// (ops/tpa/factors.cu). Elsewhere (the CPU, f64, Impl::Composed) the
// factors come from split, views and lrpe_rotate, each recorded on the tape; both give the same bits.
#include <array>
#include <cstdlib>
#include <string>
#include <vector>
#include "autograd/tape.h"
#include "ops/lrpe/lrpe.h"
#include "ops/shape.h"
#include "ops/tpa/tpa.h"
#if LINTAPE_WITH_CUDA
#include "ops/lrpe/launch.h"
#include "ops/tpa/launch.h"
#endif

namespace lintape {
namespace {

struct Layout {
  int64_t B, N, W, H, Rq, Rk, Rv, D, E;
  int64_t rotated() const { return (Rq + Rk) * D; }       // bq and bk, side by side
  int64_t a_at() const { return rotated() + Rv * E; }      // the per-head ranks
  int64_t used() const { return a_at() + H * (Rq + Rk + Rv); }
};

std::array<Tensor, 6> composed_factors(const Tensor& y, const Layout& l, const Tensor& theta, int64_t offset,
                                       const Documents& docs, Impl impl) {
  std::vector<int64_t> widths{l.Rq * l.D, l.Rk * l.D, l.Rv * l.E, l.H * (l.Rq + l.Rk + l.Rv)};
  if (l.W > l.used()) widths.push_back(l.W - l.used());
  const std::vector<Tensor> parts = split(y, widths, -1);
  const std::vector<Tensor> as = split(parts[3].view({l.B, l.N, l.H, l.Rq + l.Rk + l.Rv}), {l.Rq, l.Rk, l.Rv}, 3);
  LrpeOptions at;
  at.offset = offset;
  at.documents = docs;
  const Impl rotate_impl = impl == Impl::Composed ? Impl::Composed : Impl::Auto;
  return {as[0], lrpe_rotate(parts[0].view({l.B, l.N, l.Rq, l.D}), theta, at, rotate_impl),
          as[1], lrpe_rotate(parts[1].view({l.B, l.N, l.Rk, l.D}), theta, at, rotate_impl),
          as[2], parts[2].view({l.B, l.N, l.Rv, l.E})};
}

#if LINTAPE_WITH_CUDA
// x's columns [at, at + len) as (B, N, len / width, width).
Tensor columns(const Tensor& x, const Layout& l, int64_t at, int64_t len, int64_t width) {
  return x.narrow(2, at, len).view({l.B, l.N, len / width, width});
}

std::array<Tensor, 6> fused_factors(const Tensor& y, const Layout& l, const Tensor& theta, int64_t offset,
                                    const Documents& docs) {
  LrpeSpec spec;
  spec.kind = LrpeSpec::Rotate;
  spec.theta = theta.detach().to(DType::F32).contiguous();
  spec.offset = offset;
  if (docs.defined()) spec.starts = docs.starts().contiguous();
  const Tensor yd = y.detach();
  const Tensor b_rows = columns(yd, l, 0, l.rotated(), l.D);  // bq and bk as (B, N, Rq + Rk, D)
  Tensor rotated = empty(b_rows.shape(), y.dtype(), y.device());
  lrpe_cuda::forward(lrpe_cuda::reads_in_place(b_rows) ? b_rows : b_rows.contiguous(), spec, rotated, Tensor());
  std::array<Tensor, 6> f;
  {
    autograd::NoGradGuard no_grad;  // the six are recorded below, together
    const Tensor a = columns(y, l, l.a_at(), l.H * (l.Rq + l.Rk + l.Rv), l.Rq + l.Rk + l.Rv);
    f = {a.narrow(3, 0, l.Rq),         rotated.narrow(2, 0, l.Rq),
         a.narrow(3, l.Rq, l.Rk),      rotated.narrow(2, l.Rq, l.Rk),
         a.narrow(3, l.Rq + l.Rk, l.Rv), columns(y, l, l.rotated(), l.Rv * l.E, l.E)};
  }
  autograd::record("tpa_factors", {y, autograd::nondiff(theta, "theta")}, {f.begin(), f.end()},
                   [l, spec, b_rows](const autograd::Grads& g) -> autograd::Grads {
                     const DType dt = b_rows.dtype();
                     Tensor dy = empty({l.B, l.N, l.W}, dt, b_rows.device());
                     // bq, bk: the inverse rotation written into their columns.
                     const int64_t ranks[2] = {l.Rq, l.Rk};
                     for (int64_t i = 0, at = 0; i < 2; at += ranks[i] * l.D, ++i) {
                       Tensor dst = columns(dy, l, at, ranks[i] * l.D, l.D);
                       const Tensor& gi = g[size_t(2 * i + 1)];  // dbq, dbk
                       if (!gi.defined()) {
                         dst.zero_();
                         continue;
                       }
                       const Tensor x = b_rows.narrow(2, i == 0 ? 0 : l.Rq, ranks[i]);
                       lrpe_cuda::backward(lrpe_cuda::reads_in_place(x) ? x : x.contiguous(),
                                           gi.to(dt).contiguous(), spec, Tensor(), dst);
                     }
                     Tensor dbv = columns(dy, l, l.rotated(), l.Rv * l.E, l.E);
                     if (g[5].defined())
                       dbv.copy_(g[5]);
                     else
                       dbv.zero_();
                     // The rank gradients into their columns and the padding's zeros, one launch.
                     auto packed = [&](const Tensor& gi) { return gi.defined() ? gi.to(dt).contiguous() : Tensor(); };
                     tpa_cuda::scatter_rank_grads(dy, l.a_at(), l.H, l.Rq, l.Rk, l.Rv, packed(g[0]),
                                                  packed(g[2]), packed(g[4]));
                     return {dy, Tensor()};
                   });
  return f;
}
#endif

}  // namespace

std::array<Tensor, 6> tpa_factors(const Tensor& y, int64_t heads, int64_t rank_q, int64_t rank_k, int64_t rank_v,
                                  int64_t head_dim, int64_t value_dim, const Tensor& theta, int64_t offset,
                                  const Documents& docs, Impl impl) {
  const char* op = "tpa_factors";
  LT_CHECK(y.defined() && y.dim() == 3, "[", op, "] y must be (B, N, W); got ",
           y.defined() ? shape_str(y.shape()) : std::string("an undefined tensor"));
  LT_CHECK(heads > 0 && rank_q > 0 && rank_k > 0 && rank_v > 0 && head_dim > 0 && head_dim % 2 == 0 && value_dim > 0,
           "[", op, "] heads and ranks must be positive and head_dim positive and even; got heads ", heads, ", ranks [",
           rank_q, ", ", rank_k, ", ", rank_v, "], head_dim ", head_dim, ", value_dim ", value_dim);
  const Layout l{y.size(0), y.size(1), y.size(2), heads, rank_q, rank_k, rank_v, head_dim, value_dim};
  LT_CHECK(l.W >= l.used(), "[", op, "] y's rows hold ", l.W, " values; the factors need (R_q + R_k) D + R_v E + H R = ",
           l.used());
  LT_CHECK(theta.defined() && theta.dim() == 2 && theta.size(0) == 1 && theta.size(1) == head_dim / 2, "[", op,
           "] theta must be (1, head_dim / 2) = (1, ", head_dim / 2, "); got ",
           theta.defined() ? shape_str(theta.shape()) : std::string("an undefined tensor"));
  LT_CHECK(offset >= 0, "[", op, "] offset must be >= 0; got ", offset);
  docs.check(op, l.B, l.N, y.device());
#if LINTAPE_WITH_CUDA
  // LINTAPE_TPA_FACTORS=split: Impl::Auto takes split, views and lrpe_rotate (for timing the two against each other).
  static const bool auto_splits = [] {
    const char* v = std::getenv("LINTAPE_TPA_FACTORS");
    return v && std::string(v) == "split";
  }();
  const bool kernels = y.is_cuda() && y.dtype() != DType::F64 && y.strides()[2] == 1 && l.B * l.N > 0;
  if (kernels && (impl == Impl::Fused || (impl == Impl::Auto && !auto_splits)))
    return fused_factors(y, l, theta, offset, docs);
#endif
  LT_CHECK(impl != Impl::Fused, "[", op, "] Impl::Fused needs y on a CUDA device in f32, bf16 or f16 with packed rows; got ",
           dtype_name(y.dtype()), " on ", y.device().name());
  return composed_factors(y, l, theta, offset, docs, impl);
}

}  // namespace lintape
