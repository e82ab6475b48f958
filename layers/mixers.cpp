#include "layers/mixers.h"

#include <array>
#include <cmath>
#include <vector>

#include "ops/fal/fal.h"
#include "ops/matmul.h"
#include "ops/lrpe/lrpe.h"
#include "ops/shape.h"
#include "ops/tpa/tpa.h"

namespace lintape {

FalMixer::FalMixer(int64_t width, int64_t heads, int64_t head_dim, double eps, double init_std, double out_std,
                   uint64_t seed)
    : qkvg(width, 4 * heads * head_dim, init_std, seed),
      norm(head_dim, eps),
      out(heads * head_dim, width, out_std, seed + 1),
      heads(heads),
      head_dim(head_dim) {
  register_module("qkvg", qkvg);
  register_module("norm", norm);
  register_module("out", out);
  theta = lrpe_theta(heads, head_dim);
  std::vector<double> lambda(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) lambda[size_t(h)] = 1.0 - std::ldexp(1.0, int(-5 - h));
  decay = from_vector(lambda, {heads});
  register_buffer("theta", theta);
  register_buffer("decay", decay);
}

namespace {
// MODEL.md's FAL: silu on q, k and g, LRPE cosine, causal with the per-head decay.
FalOptions fal_options(const FalMixer& m, int64_t position) {
  FalOptions o;
  o.q = o.k = o.g = ActSpec{Act::Silu, ActDim::None};
  o.lrpe = FalLrpe::Cosine;
  o.theta = m.theta;
  o.offset = position;
  o.causal = true;
  o.decay = m.decay;
  return o;
}
}  // namespace

// q, k, v, g (B, N, H, D) of x (B, N, C), from one projection.
std::array<Tensor, 4> FalMixer::project(const Tensor& x) const {
  const int64_t B = x.size(0), N = x.size(1), HD = heads * head_dim;
  const std::vector<Tensor> y = split(qkvg.forward(x), {HD, HD, HD, HD}, -1);
  auto part = [&](int64_t i) { return y[size_t(i)].reshape({B, N, heads, head_dim}); };
  return {part(0), part(1), part(2), part(3)};
}

Tensor FalMixer::finish(const Tensor& mixed) const {
  return out.forward(norm.forward(mixed).reshape({mixed.size(0), mixed.size(1), heads * head_dim}));
}

Tensor FalMixer::forward(const Tensor& x) const {
  LT_CHECK(x.dim() == 3, "[FalMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  const auto [q, k, v, g] = project(x);
  return finish(fal(q, k, v, g, fal_options(*this, 0), impl));
}

Tensor FalMixer::prefill(const Tensor& x, Tensor& state, int64_t position) const {
  LT_CHECK(x.dim() == 3, "[FalMixer] prefill takes x (B, N, C); got ", shape_str(x.shape()));
  const auto [q, k, v, g] = project(x);
  auto [mixed, next] = fal_with_state(q, k, v, g, state, fal_options(*this, position), impl);
  state = next;
  return finish(mixed);
}

Tensor FalMixer::step(const Tensor& x_t, Tensor& state, int64_t position) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[FalMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const auto [q, k, v, g] = project(x_t);
  return finish(fal_step(state, q, k, v, g, fal_options(*this, position)));
}

TpaMixer::TpaMixer(int64_t width, int64_t heads, int64_t head_dim, int64_t rank_q, int64_t rank_k, int64_t rank_v,
                   double init_std, double out_std, uint64_t seed)
    : a(width, heads * (rank_q + rank_k + rank_v), init_std, seed),
      b(width, (rank_q + rank_k + rank_v) * head_dim, init_std, seed + 1),
      out(heads * head_dim, width, out_std, seed + 2),
      heads(heads),
      head_dim(head_dim),
      rank_q(rank_q),
      rank_k(rank_k),
      rank_v(rank_v) {
  LT_CHECK(rank_q > 0 && rank_k > 0 && rank_v > 0, "[TpaMixer] ranks must be positive; got [", rank_q, ", ",
           rank_k, ", ", rank_v, "]");
  LT_CHECK(head_dim % 2 == 0, "[TpaMixer] head_dim must be even (rotary); got ", head_dim);
  register_module("a", a);
  register_module("b", b);
  register_module("out", out);
  theta = lrpe_theta(1, head_dim / 2);
  register_buffer("theta", theta);
}

std::array<Tensor, 6> TpaMixer::factors(const Tensor& x, int64_t position) const {
  const int64_t B = x.size(0), N = x.size(1), R = rank_q + rank_k + rank_v, D = head_dim, Ra = heads * R;
  // One product for both projections, its rows [b; a; zero padding]: every token's row, and in it each
  // factor's basis rows, start 16-byte aligned, so the fused ops read the factors in place (views).
  const int64_t per16 = 16 / int64_t(dtype_size(x.dtype())), pad = (per16 - (R * D + Ra) % per16) % per16;
  std::vector<Tensor> rows{weight_as(b.weight, x), weight_as(a.weight, x)};
  std::vector<int64_t> widths{rank_q * D, rank_k * D, rank_v * D, Ra};
  if (pad > 0) {
    rows.push_back(zeros({pad, x.size(2)}, x.dtype(), x.device()));
    widths.push_back(pad);
  }
  const std::vector<Tensor> y = split(matmul(x, cat(rows, 0), false, true), widths, -1);
  const std::vector<Tensor> as = split(y[3].view({B, N, heads, R}), {rank_q, rank_k, rank_v}, 3);
  LrpeOptions at;
  at.offset = position;
  const Impl rotate_impl = impl == Impl::Composed ? Impl::Composed : Impl::Auto;
  const Tensor bq = lrpe_rotate(y[0].view({B, N, rank_q, D}), theta, at, rotate_impl);
  return {as[0], bq, as[1], y[1].view({B, N, rank_k, D}), as[2], y[2].view({B, N, rank_v, D})};
}

// Causal attention over the tokens of x alone (B, N) and the output projection.
Tensor TpaMixer::attend(const std::array<Tensor, 6>& f) const {
  const auto& [aq, bq, ak, bk, av, bv] = f;
  const Tensor bk_rotated = lrpe_rotate(bk, theta, {}, impl == Impl::Composed ? Impl::Composed : Impl::Auto);
  TpaOptions o;
  o.causal = true;
  const Tensor mixed = tpa_attention(aq, bq, ak, bk_rotated, av, bv, o, impl);
  return out.forward(mixed.reshape({aq.size(0), aq.size(1), heads * head_dim}));
}

Tensor TpaMixer::forward(const Tensor& x) const {
  LT_CHECK(x.dim() == 3, "[TpaMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  return attend(factors(x, 0));
}

Tensor TpaMixer::prefill(const Tensor& x, TpaCache& cache) const {
  LT_CHECK(x.dim() == 3, "[TpaMixer] prefill takes x (B, N, C); got ", shape_str(x.shape()));
  LT_CHECK(cache.max_length() == 0, "[TpaMixer] prefill starts a sequence: the cache must be empty; it holds ",
           cache.max_length(), " tokens");
  const std::array<Tensor, 6> f = factors(x, 0);
  // The cache takes one token per append and rotates bk itself, at each token's position.
  for (int64_t t = 0; t < x.size(1); ++t)
    cache.append(f[2].narrow(1, t, 1), f[3].narrow(1, t, 1), f[4].narrow(1, t, 1), f[5].narrow(1, t, 1));
  return attend(f);
}

TpaCache TpaMixer::make_cache(int64_t batch, DType dtype) const {
  return TpaCache(batch, heads, rank_k, rank_v, head_dim, head_dim, dtype, out.weight.device(), theta);
}

Tensor TpaMixer::step(const Tensor& x_t, TpaCache& cache) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[TpaMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const auto [aq, bq, ak, bk, av, bv] = factors(x_t, cache.max_length());
  cache.append(ak, bk, av, bv);
  const Tensor mixed = tpa_decode(aq, bq, cache);
  return out.forward(mixed.reshape({x_t.size(0), 1, heads * head_dim}));
}

}  // namespace lintape
