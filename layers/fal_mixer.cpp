#include "layers/fal_mixer.h"

#include <array>
#include <cmath>
#include <vector>

#include "layers/language_model.h"
#include "ops/fal/fal.h"
#include "ops/lrpe/lrpe.h"
#include "ops/rms_norm.h"
#include "ops/shape.h"

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
FalOptions fal_options(const FalMixer& m, int64_t position, const Documents& docs = {}) {
  FalOptions o;
  o.q = o.k = o.g = ActSpec{Act::Silu, ActDim::None};
  o.lrpe = FalLrpe::Cosine;
  o.theta = m.theta;
  o.offset = position;
  o.causal = true;
  o.decay = m.decay;
  o.documents = docs;
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
  const Tensor rows = mixed.reshape({mixed.size(0), mixed.size(1), heads * head_dim});
  if (keep_normed_rows()) return out.forward(norm.forward(mixed).reshape(rows.shape()));
  // The norm is per head: over each D of the H D row, its normed rows made again in the backward.
  return rms_norm_linear(rows, weight_as(norm.weight, mixed), weight_as(out.weight, mixed), norm.eps);
}

Tensor FalMixer::forward(const Tensor& x, const Documents& docs) const {
  LT_CHECK(x.dim() == 3, "[FalMixer] x must be (B, N, C); got ", shape_str(x.shape()));
  const auto [q, k, v, g] = project(x);
  return finish(fal(q, k, v, g, fal_options(*this, 0, docs), impl));
}

std::unique_ptr<MixerState> FalMixer::start_decoding(int64_t batch, DType) const {
  auto s = std::make_unique<FalState>();
  const DType state_dtype = out.weight.dtype() == DType::F64 ? DType::F64 : DType::F32;
  s->state = zeros({batch, heads, fal_state_rows(FalLrpe::Cosine, head_dim), head_dim}, state_dtype,
                   out.weight.device());
  return s;
}

Tensor FalMixer::prefill(const Tensor& x, MixerState& state, int64_t position) const {
  LT_CHECK(x.dim() == 3, "[FalMixer] prefill takes x (B, N, C); got ", shape_str(x.shape()));
  Tensor& s = dynamic_cast<FalState&>(state).state;
  const auto [q, k, v, g] = project(x);
  auto [mixed, next] = fal_with_state(q, k, v, g, s, fal_options(*this, position), impl);
  s = next;
  return finish(mixed);
}

Tensor FalMixer::step(const Tensor& x_t, MixerState& state, int64_t position) const {
  LT_CHECK(x_t.dim() == 3 && x_t.size(1) == 1, "[FalMixer] a decoding step takes x_t (B, 1, C); got ",
           shape_str(x_t.shape()));
  const auto [q, k, v, g] = project(x_t);
  return finish(fal_step(dynamic_cast<FalState&>(state).state, q, k, v, g, fal_options(*this, position)));
}

std::unique_ptr<Mixer> make_fal_mixer(const ModelConfig& c, double init_std, double out_std, uint64_t seed) {
  return std::make_unique<FalMixer>(c.width, c.heads, c.head_dim, c.norm_eps, init_std, out_std, seed);
}

double fal_train_flops_per_token(const ModelConfig& c, double /*context*/) {
  return 24.0 * double(c.heads) * double(c.head_dim) * double(c.head_dim);
}

}  // namespace lintape
