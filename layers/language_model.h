// The language model of MODEL.md: byte or token embedding (tied with the output head), L blocks of
// pre-norm mixer + SwiGLU MLP, a final RMSNorm. Parameter names and shapes are MODEL.md's.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include "../core/tensor.h"
#include "../ops/impl.h"
#include "layers.h"
#include "mixer.h"
#include "module.h"

namespace lintape {

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t width = 128;
  int64_t layers = 4;
  std::vector<std::string> mixers = {"fal", "fal", "fal", "tpa"};  // a shorter list repeats
  int64_t heads = 2;
  int64_t head_dim = 64;
  int64_t mlp_hidden = 384;
  std::vector<int64_t> tpa_ranks = {4, 2, 2};
  int64_t seq_len = 256;
  double norm_eps = 1e-6;

  static ModelConfig preset(const std::string& name);  // "tiny" or "small"
  // Throws naming the key and the value for zero or negative sizes and unknown mixer names.
  void validate() const;
  const std::string& mixer(int64_t layer) const { return mixers[size_t(layer) % mixers.size()]; }
  // "fal,tpa" -> {"fal", "tpa"} (a command line's --mixers; validate() checks the names).
  static std::vector<std::string> mixers_from_list(const std::string& text);
};

// What decoding carries between tokens: per layer its mixer's state.
struct DecodeState {
  std::vector<std::unique_ptr<MixerState>> layers;  // by layer
  int64_t position = 0;                             // tokens consumed so far
};

// x + mixer(norm1(x)), then x + mlp(norm2(x)). The mixer is the config's kind for the layer, registered
// under the kind's name ("blocks.0.fal").
class Block : public Module {
 public:
  Block(const ModelConfig& config, int64_t layer, uint64_t seed);
  Tensor forward(const Tensor& x, const Documents& docs = {}) const;  // the block alone
  // The mixer on h = norm1(x): for training (with the rows' documents), for a prefill (h (B, N, C), from
  // position 0) and for one decoding step (h (B, 1, C)).
  Tensor mix(const Tensor& h, const Documents& docs = {}) const;
  Tensor mix_prefill(const Tensor& h, DecodeState& state, size_t layer) const;
  Tensor mix_step(const Tensor& h, DecodeState& state, size_t layer) const;
  // The rest of the block inside the model, given the mixer's output: returns the residual stream after
  // the block and `next` of it (the next block's norm1 or the final norm). Each residual add runs inside
  // the norm after it (add_rms_norm).
  std::pair<Tensor, Tensor> finish(const Tensor& x, const Tensor& mixed, const RMSNorm& next) const;
  void set_impl(Impl impl);
  RMSNorm norm1, norm2;
  SwiGluMlp mlp;
  std::unique_ptr<Mixer> mixer;
};

class LanguageModel : public Module {
 public:
  explicit LanguageModel(const ModelConfig& config, uint64_t seed = 0);
  // tokens (B, N) integer ids -> logits (B, N, V) in the compute dtype. `docs`: the documents packed in the
  // rows (ops/documents.h, starts on the model's device), passed to every mixer: a token sees only its own
  // document. Undefined: each row is one sequence.
  Tensor forward(const Tensor& tokens, const Documents& docs = {}) const;
  // Mean cross-entropy over the targets (B, N) that are not -1; float32 (float64 for f64 parameters),
  // whatever the compute dtype. With documents, a document's last token should have target -1 (the data
  // does so): its next token belongs to another document.
  Tensor loss(const Tensor& tokens, const Tensor& targets, const Documents& docs = {}) const;
  // The tied head and the loss on the final norm's output h (B, N, C), with w = wte in the compute dtype:
  // linear_cross_entropy, so the (B, N, V) logits are never held (loss() is normed_hidden + this).
  Tensor head_loss(const Tensor& h, const Tensor& w, const Tensor& targets) const;

  // Mixed precision: the parameters stay as they are (the float32 master weights the optimizer updates);
  // forward casts wte to `dtype` once (a recorded cast, used by the embedding and the tied head), so the
  // activations and every layer's matrix products run in `dtype` (layers.h). Unset: the parameters' dtype.
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const;

  // Decoding. start_decoding makes the empty per-layer states; prefill runs the first tokens (B, N)
  // through the mixers' whole-sequence ops and decode_step one more token (B, 1)
  // through their decoding steps. Both return the logits of their tokens,
  // equal to the full forward's at those positions. No gradient is recorded.
  DecodeState start_decoding(int64_t batch) const;
  Tensor prefill(const Tensor& tokens, DecodeState& state) const;
  Tensor decode_step(const Tensor& tokens_t, DecodeState& state) const;
  // Which implementation the mixers' ops run (tests: Composed against the reference).
  void set_impl(Impl impl);
  const ModelConfig& config() const { return config_; }

  Tensor wte;  // (V, C)
  std::vector<std::unique_ptr<Block>> blocks;
  RMSNorm norm;

 private:
  // Embedding, blocks and the final norm: (B, N, C) in the compute dtype; w is wte in that dtype.
  Tensor normed_hidden(const Tensor& tokens, const Tensor& w, const Documents& docs) const;
  ModelConfig config_;
  bool has_compute_dtype_ = false;
  DType compute_dtype_ = DType::F32;
};

}  // namespace lintape
