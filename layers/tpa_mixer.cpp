#include "layers/tpa_mixer.h"

#include <array>
#include <vector>

#include "layers/language_model.h"
#include "ops/lrpe/lrpe.h"
#include "ops/matmul.h"
#include "ops/shape.h"
#include "ops/tpa/tpa.h"

namespace lintape {

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

Tensor TpaMixer::projection(const Tensor& x) const {
  const int64_t R = rank_q + rank_k + rank_v, D = head_dim, Ra = heads * R;
  // One product for both projections, its rows [b; a; zero padding]: every token's row, and in it each
  // factor's basis rows, start 16-byte aligned, so the fused ops read the factors in place (views).
  const int64_t per16 = 16 / int64_t(dtype_size(x.dtype())), pad = (per16 - (R * D + Ra) % per16) % per16;
  std::vector<Tensor> rows{weight_as(b.weight, x), weight_as(a.weight, x)};
  if (pad > 0) rows.push_back(zeros({pad, x.size(2)}, x.dtype(), x.device()));
  return matmul(x, cat(rows, 0), false, true);
}

std::array<Tensor, 6> TpaMixer::factors(const Tensor& y, int64_t position, const Documents& docs) const {
  return tpa_factors(y, heads, rank_q, rank_k, rank_v, head_dim, head_dim, theta, position, docs,
                     impl == Impl::Composed ? Impl::Composed : Impl::Auto);
}

Tensor TpaMixer::unrotated_bk(const Tensor& y) const {
  return y.narrow(2, rank_q * head_dim, rank_k * head_dim).view({y.size(0), y.size(1), rank_k, head_dim});
}

// Causal attention over the tokens of x alone (B, N) and the output projection.
Tensor TpaMixer::attend(const std::array<Tensor, 6>& f, const Documents& docs) const {
  const auto& [aq, bq, ak, bk, av, bv] = f;
  TpaOptions o;
  o.causal = true;
  o.documents = docs;
  const Tensor mixed = tpa_attention(aq, bq, ak, bk, av, bv, o, impl);
  return out.forward(mixed.reshape({aq.size(0), aq.size(1), heads * head_dim}));
}

Tensor TpaMixer::forward(const Tensor& x, const Documents& docs) const {
  LT_CHECK(x.dim() == 3, "[TpaMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  return attend(factors(projection(x), 0, docs), docs);
}

Tensor TpaMixer::prefill(const Tensor& x, TpaCache& cache) const {
  LT_CHECK(x.dim() == 3, "[TpaMixer] prefill takes x (B, N, C); got ", shape_str(x.shape()));
  LT_CHECK(cache.max_length() == 0, "[TpaMixer] prefill starts a sequence: the cache must be empty; it holds ",
           cache.max_length(), " tokens");
  const Tensor y = projection(x);
  const std::array<Tensor, 6> f = factors(y, 0);
  const Tensor bk = unrotated_bk(y);
  // The cache takes one token per append and rotates bk itself, at each token's position.
  for (int64_t t = 0; t < x.size(1); ++t)
    cache.append(f[2].narrow(1, t, 1), bk.narrow(1, t, 1), f[4].narrow(1, t, 1), f[5].narrow(1, t, 1));
  return attend(f);
}

std::unique_ptr<MixerState> TpaMixer::start_decoding(int64_t batch, DType dtype) const {
  return std::make_unique<TpaState>(make_cache(batch, dtype));
}

Tensor TpaMixer::prefill(const Tensor& x, MixerState& state, int64_t) const {
  return prefill(x, dynamic_cast<TpaState&>(state).cache);
}

Tensor TpaMixer::step(const Tensor& x_t, MixerState& state, int64_t) const {
  return step(x_t, dynamic_cast<TpaState&>(state).cache);
}

TpaCache TpaMixer::make_cache(int64_t batch, DType dtype) const {
  return TpaCache(batch, heads, rank_k, rank_v, head_dim, head_dim, dtype, out.weight.device(), theta);
}

Tensor TpaMixer::step(const Tensor& x_t, TpaCache& cache) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[TpaMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const Tensor y = projection(x_t);
  const auto [aq, bq, ak, bk, av, bv] = factors(y, cache.max_length());
  cache.append(ak, unrotated_bk(y), av, bv);
  const Tensor mixed = tpa_decode(aq, bq, cache);
  return out.forward(mixed.reshape({x_t.size(0), 1, heads * head_dim}));
}


std::unique_ptr<Mixer> make_tpa_mixer(const ModelConfig& c, double init_std, double out_std, uint64_t seed) {
  return std::make_unique<TpaMixer>(c.width, c.heads, c.head_dim, c.tpa_ranks[0], c.tpa_ranks[1], c.tpa_ranks[2],
                                    init_std, out_std, seed);
}

double tpa_train_flops_per_token(const ModelConfig& c, double context) {
  return 12.0 * double(c.heads) * double(c.head_dim) * context;
}

}  // namespace lintape
