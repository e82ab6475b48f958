// The token mixer interface of MODEL.md's blocks and the registry of mixer kinds. A mixer maps (B, N, C) ->
// (B, N, C) over a whole sequence (training), and decodes: prefill runs the first tokens, step one more,
// both carrying the mixer's own MixerState. A kind is one file pair (its Mixer subclass and a factory)
// and one line in the registry (mixer.cpp), which maps the config's mixer name to the factory.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "../core/tensor.h"
#include "../ops/documents.h"
#include "../ops/impl.h"
#include "module.h"

namespace lintape {

struct ModelConfig;

// What one layer's mixer carries between decoded tokens (a FAL state, a TPA factor cache, ...).
struct MixerState {
  virtual ~MixerState() = default;
};

class Mixer : public Module {
 public:
  // x (B, N, C) -> (B, N, C), causal over the sequence, recorded for the gradient. `docs`: the documents
  // packed in the rows (ops/documents.h); a token mixes only with its own document's earlier tokens, and
  // positions restart at each document start. Undefined: each row is one sequence. (The overrides repeat
  // the default.)
  virtual Tensor forward(const Tensor& x, const Documents& docs = {}) const = 0;
  // The empty state before the first token, for `batch` sequences of activations in `dtype`.
  virtual std::unique_ptr<MixerState> start_decoding(int64_t batch, DType dtype) const = 0;
  // prefill: x (B, N, C), the first tokens (position 0); step: one token x_t (B, 1, C) at `position`.
  // Both update `state` (made by this mixer's start_decoding).
  virtual Tensor prefill(const Tensor& x, MixerState& state, int64_t position) const = 0;
  virtual Tensor step(const Tensor& x_t, MixerState& state, int64_t position) const = 0;
  Impl impl = Impl::Auto;  // which implementation the ops run (tests: Composed against the reference)
};

// A mixer of layer's config: init_std for the input projections, out_std for the output one.
using MixerFactory = std::unique_ptr<Mixer> (*)(const ModelConfig& config, double init_std, double out_std,
                                                uint64_t seed);

struct MixerKind {
  const char* name;  // the config's mixer name, and the block's module name ("blocks.0.fal")
  MixerFactory make;
  // The mixing's training FLOPs per token (forward and backward) beyond 6 x its parameters; `context`: the
  // tokens' mean causal context (mean_causal_context, ops/documents.h: seq_len / 2 without documents).
  double (*train_flops_per_token)(const ModelConfig& config, double context);
};

// The registered kinds; mixer_kind throws for an unknown name.
const std::vector<MixerKind>& mixer_kinds();
const MixerKind& mixer_kind(const std::string& name);
bool is_mixer_name(const std::string& name);
std::string mixer_names();  // "fal or tpa"

}  // namespace lintape
