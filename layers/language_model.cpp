#include "layers/language_model.h"

#include <cmath>
#include <sstream>
#include <tuple>

#include "autograd/tape.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/rms_norm.h"

namespace lintape {

namespace {
constexpr double kInitStd = 0.02;
// Each layer draws its weights from seeds of its own: seed + kSeedStride * (layer + 1) + k.
constexpr uint64_t kSeedStride = 16;
}  // namespace

ModelConfig ModelConfig::preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") return c;
  if (name == "small") {
    c.vocab_size = 256;
    c.width = 768;
    c.layers = 12;
    c.mixers = {"fal"};
    c.heads = 6;
    c.head_dim = 128;
    c.mlp_hidden = 2048;
    c.tpa_ranks = {6, 2, 2};
    c.seq_len = 2048;
    return c;
  }
  fail(str("[config] unknown preset '", name, "'; expected tiny or small"));
}

std::vector<std::string> ModelConfig::mixers_from_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string item; std::getline(s, item, ',');) out.push_back(item);
  return out;
}

void ModelConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    LT_CHECK(v > 0, "[config] ", key, " must be positive; got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("width", width);
  positive("layers", layers);
  positive("heads", heads);
  positive("head_dim", head_dim);
  positive("mlp_hidden", mlp_hidden);
  positive("seq_len", seq_len);
  LT_CHECK(norm_eps > 0, "[config] norm_eps must be positive; got ", norm_eps);
  LT_CHECK(!mixers.empty(), "[config] mixers must name at least one mixer (", mixer_names(), "); got an empty list");
  for (const std::string& m : mixers) mixer_kind(m);  // throws for an unknown name
  LT_CHECK(tpa_ranks.size() == 3, "[config] tpa_ranks must be [R_q, R_k, R_v]; got ", tpa_ranks.size(),
           " values");
  for (int64_t r : tpa_ranks) positive("tpa_ranks entry", r);
  LT_CHECK(head_dim % 2 == 0, "[config] head_dim must be even (rotary in tpa); got ", head_dim);
}

Block::Block(const ModelConfig& c, int64_t layer, uint64_t seed)
    : norm1(c.width, c.norm_eps),
      norm2(c.width, c.norm_eps),
      mlp(c.width, c.mlp_hidden, kInitStd, kInitStd / std::sqrt(2.0 * double(c.layers)), seed) {
  const double out_std = kInitStd / std::sqrt(2.0 * double(c.layers));
  register_module("norm1", norm1);
  register_module("norm2", norm2);
  register_module("mlp", mlp);
  const MixerKind& kind = mixer_kind(c.mixer(layer));
  mixer = kind.make(c, kInitStd, out_std, seed + 4);
  register_module(kind.name, *mixer);
}

Tensor Block::mix(const Tensor& h, const Documents& docs) const { return mixer->forward(h, docs); }

Tensor Block::mix_prefill(const Tensor& h, DecodeState& state, size_t layer) const {
  return mixer->prefill(h, *state.layers[layer], state.position);
}

Tensor Block::mix_step(const Tensor& h, DecodeState& state, size_t layer) const {
  return mixer->step(h, *state.layers[layer], state.position);
}

std::pair<Tensor, Tensor> Block::finish(const Tensor& x, const Tensor& mixed, const RMSNorm& next) const {
  const auto [y, mlp_out] = mlp.forward_after(norm2, x, mixed);
  return next.forward_sum(y, mlp_out);
}

Tensor Block::forward(const Tensor& x, const Documents& docs) const {
  const auto [y, mlp_out] = mlp.forward_after(norm2, x, mix(norm1.forward(x), docs));
  return add(y, mlp_out);
}

void Block::set_impl(Impl impl) { mixer->impl = impl; }

LanguageModel::LanguageModel(const ModelConfig& config, uint64_t seed)
    : norm(config.width, config.norm_eps), config_(config) {
  config.validate();
  wte = normal_init({config.vocab_size, config.width}, kInitStd, seed);
  register_parameter("wte", wte);
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks.push_back(std::make_unique<Block>(config, i, seed + kSeedStride * uint64_t(i + 1)));
    register_module("blocks." + std::to_string(i), *blocks.back());
  }
  register_module("norm", norm);
}

void LanguageModel::set_compute_dtype(DType dtype) {
  LT_CHECK(is_floating(dtype), "[LanguageModel] the compute dtype must be a float type; got ", dtype_name(dtype));
  has_compute_dtype_ = true;
  compute_dtype_ = dtype;
}

DType LanguageModel::compute_dtype() const { return has_compute_dtype_ ? compute_dtype_ : wte.dtype(); }

namespace {
// The embedded tokens x through the blocks and the final norm; mix(block, layer, h) is a block's mixer.
template <class Mix>
Tensor through_blocks(const std::vector<std::unique_ptr<Block>>& blocks, const RMSNorm& final_norm, Tensor x,
                      Mix&& mix) {
  Tensor h = blocks.front()->norm1.forward(x);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const RMSNorm& next = i + 1 < blocks.size() ? blocks[i + 1]->norm1 : final_norm;
    std::tie(x, h) = blocks[i]->finish(x, mix(*blocks[i], i, h), next);
  }
  return h;
}
}  // namespace

Tensor LanguageModel::normed_hidden(const Tensor& tokens, const Tensor& w, const Documents& docs) const {
  LT_CHECK(tokens.dim() == 2, "[LanguageModel] tokens must be (B, N); got ", shape_str(tokens.shape()));
  docs.check("LanguageModel", tokens.size(0), tokens.size(1), tokens.device());
  return through_blocks(blocks, norm, embedding(w, tokens),
                        [&docs](const Block& b, size_t, const Tensor& h) { return b.mix(h, docs); });
}

Tensor LanguageModel::forward(const Tensor& tokens, const Documents& docs) const {
  const Tensor w = wte.to(compute_dtype());
  return matmul(normed_hidden(tokens, w, docs), w, false, true);
}

Tensor LanguageModel::loss(const Tensor& tokens, const Tensor& targets, const Documents& docs) const {
  LT_CHECK(targets.shape() == tokens.shape(), "[LanguageModel] targets must have the tokens' shape ",
           shape_str(tokens.shape()), "; got ", shape_str(targets.shape()));
  const Tensor w = wte.to(compute_dtype());
  return head_loss(normed_hidden(tokens, w, docs), w, targets);
}

Tensor LanguageModel::head_loss(const Tensor& h, const Tensor& w, const Tensor& targets) const {
  // The loss and its softmax statistics are float32 even under 16-bit activations; the logits exist one
  // chunk of rows at a time (linear_cross_entropy).
  const int64_t rows = targets.numel();
  return linear_cross_entropy(h.reshape({rows, config_.width}), w, targets.reshape({rows}), -1);
}

DecodeState LanguageModel::start_decoding(int64_t batch) const {
  DecodeState s;
  for (const auto& block : blocks) s.layers.push_back(block->mixer->start_decoding(batch, compute_dtype()));
  return s;
}

Tensor LanguageModel::prefill(const Tensor& tokens, DecodeState& state) const {
  LT_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1, "[LanguageModel] prefill takes tokens (B, N); got ",
           shape_str(tokens.shape()));
  LT_CHECK(state.position == 0, "[LanguageModel] prefill starts a sequence; this state has consumed ",
           state.position, " tokens (continue with decode_step)");
  NoGradGuard no_grad;
  const Tensor w = wte.to(compute_dtype());
  const auto prefill_mixer = [&state](const Block& b, size_t i, const Tensor& h) {
    return b.mix_prefill(h, state, i);
  };
  const Tensor h = through_blocks(blocks, norm, embedding(w, tokens), prefill_mixer);
  state.position += tokens.size(1);
  return matmul(h, w, false, true);
}

Tensor LanguageModel::decode_step(const Tensor& tokens_t, DecodeState& state) const {
  LT_CHECK(tokens_t.dim() == 2 && tokens_t.size(1) == 1, "[LanguageModel] decode_step takes tokens (B, 1); got ",
           shape_str(tokens_t.shape()));
  NoGradGuard no_grad;
  const Tensor w = wte.to(compute_dtype());
  const auto step_mixer = [&state](const Block& b, size_t i, const Tensor& h_t) { return b.mix_step(h_t, state, i); };
  const Tensor h = through_blocks(blocks, norm, embedding(w, tokens_t), step_mixer);
  ++state.position;
  return matmul(h, w, false, true);
}

void LanguageModel::set_impl(Impl impl) {
  for (auto& block : blocks) block->set_impl(impl);
}

}  // namespace lintape
