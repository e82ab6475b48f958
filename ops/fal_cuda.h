// Internal to the FAL family: the launchers of the fused CUDA kernels (ops/fal_*.cu). ops/fal.cpp checks the
// inputs and calls them; tests call them directly on poisoned outputs.
#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape {

// One decoding step's description, already checked: the act codes, the LRPE rule and the decay.
struct FalStepSpec {
  enum ActCode : int { kNone, kRelu, kSigmoid, kSilu, kSoftmaxFeature };
  enum LrpeCode : int { kNoLrpe, kCosine, kRotate };
  int act_q = kNone, act_k = kNone, act_v = kNone, act_g = kNone;
  int lrpe = kNoLrpe;
  Tensor theta;          // (H or 1, E_t) f32 contiguous on the inputs' device; undefined without LRPE
  int64_t position = 0;  // the token's position (FalOptions::offset)
  Tensor decay;          // (H) f32 on the inputs' device, or undefined (no decay)
};

#if LINTAPE_WITH_CUDA
namespace fal_cuda {

// q, k (B, 1, H, D), v, g (B, 1, H, E) contiguous f32/bf16/f16; state_in, state_out (B, H, D', E) f32
// contiguous (distinct); out (B, 1, H, E) in the inputs' dtype. Writes every element of state_out and out.
void step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
          const Tensor& state_in, const Tensor& state_out, const Tensor& out);

}  // namespace fal_cuda
#endif

}  // namespace lintape
