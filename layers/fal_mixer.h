// MODEL.md's FAL mixer: causal FAL with per-head decay and LRPE cosine, (B, N, C) -> (B, N, C).
// `impl` picks the op's implementation (Auto: the reference on the CPU, the fused kernels on CUDA);
// tests set Composed to check the two paths against each other.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include "../core/tensor.h"
#include "layers.h"
#include "mixer.h"

namespace lintape {

// The decoding state: (B, H, 2D, D), f32 (f64 for f64 weights).
struct FalState : MixerState {
  Tensor state;
};

class FalMixer : public Mixer {
 public:
  FalMixer(int64_t width, int64_t heads, int64_t head_dim, double eps, double init_std, double out_std,
           uint64_t seed);
  Tensor forward(const Tensor& x, const Documents& docs = {}) const override;
  // Decoding. The state (FalState) is zeros before the first token and replaced by the state after the
  // tokens given. prefill: x (B, N, C) at positions position.. position + N - 1 through the chunked
  // causal op with state (fal_with_state); step: one token x_t (B, 1, C) at `position` through fal_step.
  std::unique_ptr<MixerState> start_decoding(int64_t batch, DType dtype) const override;
  Tensor prefill(const Tensor& x, MixerState& state, int64_t position) const override;
  Tensor step(const Tensor& x_t, MixerState& state, int64_t position) const override;
  Linear qkvg;   // (4 H D, C): q, k, v, g blocks of H D rows
  RMSNorm norm;  // over D, per head
  Linear out;    // (C, H D)
  Tensor theta;  // buffer (H, D): 10000^(-j / D)
  Tensor decay;  // buffer (H): 1 - 2^(-5 - h)
  int64_t heads, head_dim;

 private:
  std::array<Tensor, 4> project(const Tensor& x) const;  // q, k, v, g (B, N, H, D)
  Tensor finish(const Tensor& mixed) const;              // per-head norm, then out
};

std::unique_ptr<Mixer> make_fal_mixer(const ModelConfig& config, double init_std, double out_std, uint64_t seed);
// 24 H D^2: the state's products, whatever the context.
double fal_train_flops_per_token(const ModelConfig& config, double context);

}  // namespace lintape
