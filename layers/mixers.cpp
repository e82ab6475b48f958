#include "layers/mixers.h"

#include <cmath>
#include <vector>

#include "ops/fal.h"
#include "ops/lrpe.h"
#include "ops/tpa.h"

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

Tensor FalMixer::forward(const Tensor& x) const {
  LT_CHECK(x.dim() == 3, "[FalMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  const int64_t B = x.size(0), N = x.size(1), HD = heads * head_dim;
  const Tensor y = qkvg.forward(x);
  auto part = [&](int64_t i) { return y.narrow(-1, i * HD, HD).reshape({B, N, heads, head_dim}); };
  FalOptions o;
  o.q = o.k = o.g = ActSpec{Act::Silu, ActDim::None};
  o.lrpe = FalLrpe::Cosine;
  o.theta = theta;
  o.causal = true;
  o.decay = decay;
  const Tensor mixed = fal(part(0), part(1), part(2), part(3), o, impl);
  return out.forward(norm.forward(mixed).reshape({B, N, HD}));
}

Tensor FalMixer::step(const Tensor& x_t, Tensor& state, int64_t position) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[FalMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const int64_t B = x_t.size(0), HD = heads * head_dim;
  const Tensor y = qkvg.forward(x_t);
  auto part = [&](int64_t i) { return y.narrow(-1, i * HD, HD).reshape({B, 1, heads, head_dim}); };
  FalOptions o;
  o.q = o.k = o.g = ActSpec{Act::Silu, ActDim::None};
  o.lrpe = FalLrpe::Cosine;
  o.theta = theta;
  o.offset = position;
  o.causal = true;
  o.decay = decay;
  const Tensor mixed = fal_step(state, part(0), part(1), part(2), part(3), o);
  return out.forward(norm.forward(mixed).reshape({B, 1, HD}));
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

Tensor TpaMixer::forward(const Tensor& x) const {
  LT_CHECK(x.dim() == 3, "[TpaMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  const int64_t B = x.size(0), N = x.size(1), R = rank_q + rank_k + rank_v;
  const Tensor fa = a.forward(x).view({B, N, heads, R});
  const Tensor fb = b.forward(x).view({B, N, R, head_dim});
  auto a_part = [&](int64_t start, int64_t len) { return fa.narrow(3, start, len).contiguous(); };
  auto b_part = [&](int64_t start, int64_t len) { return fb.narrow(2, start, len).contiguous(); };
  const Tensor bq = lrpe_rotate(b_part(0, rank_q), theta, {}, impl == Impl::Composed ? Impl::Composed : Impl::Auto);
  const Tensor bk =
      lrpe_rotate(b_part(rank_q, rank_k), theta, {}, impl == Impl::Composed ? Impl::Composed : Impl::Auto);
  TpaOptions o;
  o.causal = true;
  const Tensor mixed = tpa_attention(a_part(0, rank_q), bq, a_part(rank_q, rank_k), bk,
                                     a_part(rank_q + rank_k, rank_v), b_part(rank_q + rank_k, rank_v), o, impl);
  return out.forward(mixed.reshape({B, N, heads * head_dim}));
}

}  // namespace lintape

namespace lintape {

TpaCache TpaMixer::make_cache(int64_t batch) const {
  return TpaCache(batch, heads, rank_k, rank_v, head_dim, head_dim, out.weight.dtype(), out.weight.device(), theta);
}

Tensor TpaMixer::step(const Tensor& x_t, TpaCache& cache) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[TpaMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const int64_t B = x_t.size(0), R = rank_q + rank_k + rank_v;
  const Tensor fa = a.forward(x_t).view({B, 1, heads, R});
  const Tensor fb = b.forward(x_t).view({B, 1, R, head_dim});
  auto a_part = [&](int64_t start, int64_t len) { return fa.narrow(3, start, len).contiguous(); };
  auto b_part = [&](int64_t start, int64_t len) { return fb.narrow(2, start, len).contiguous(); };
  LrpeOptions at_position;
  at_position.offset = cache.max_length();
  const Tensor bq = lrpe_rotate(b_part(0, rank_q), theta, at_position);
  cache.append(a_part(rank_q, rank_k), b_part(rank_q, rank_k), a_part(rank_q + rank_k, rank_v),
               b_part(rank_q + rank_k, rank_v));
  const Tensor mixed = tpa_decode(a_part(0, rank_q), bq, cache);
  return out.forward(mixed.reshape({B, 1, heads * head_dim}));
}

}  // namespace lintape
