// The FAL CUDA tests' configurations (tests/test_fal_cuda.cpp, tests/test_fal_memory_cuda.cpp): the ops'
// options of a configuration, the launchers' description of it, and the sequence kernels' configurations.
#pragma once
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/fal/fal.h"
#include "ops/fal/launch.h"

namespace lintape::test::fal_cuda_cases {

struct StepConfig {
  std::string name;
  FalLrpe lrpe;
  int64_t D, E;
  ActSpec q, k, v, g;
  bool decay;
  int64_t theta_cols = 0;  // rotate: theta (H, theta_cols) when > 0, else (1, D/2)
};

inline FalOptions step_options(const StepConfig& c, int64_t H, Device dev) {
  FalOptions o;
  o.q = c.q;
  o.k = c.k;
  o.v = c.v;
  o.g = c.g;
  o.lrpe = c.lrpe;
  o.causal = true;
  if (c.lrpe == FalLrpe::Cosine) o.theta = rates({H, c.D}, dev);
  if (c.lrpe == FalLrpe::Rotate) o.theta = c.theta_cols > 0 ? rates({H, c.theta_cols}, dev) : rates({1, c.D / 2}, dev);
  if (c.decay) {  // 0.9, 0.99, 0.5 over the heads in turn
    std::vector<double> lam;
    for (int64_t h = 0; h < H; ++h) lam.push_back(h % 3 == 0 ? 0.9 : h % 3 == 1 ? 0.99 : 0.5);
    o.decay = from_vector(lam, {H}, DType::F32, dev);
  }
  return o;
}

inline const ActSpec kNone{}, kSilu{Act::Silu, ActDim::None}, kSoft{Act::Softmax, ActDim::Feature},
    kSigmoid{Act::Sigmoid, ActDim::None}, kRelu{Act::Relu, ActDim::None};


#if LINTAPE_WITH_CUDA
// The launchers' description of a StepConfig (as ops/fal/fal.cpp builds it).
inline FalStepSpec kernel_spec(const StepConfig& c, const FalOptions& o) {
  auto code = [](const ActSpec& a) {
    return a.act == Act::Relu      ? FalStepSpec::kRelu
           : a.act == Act::Sigmoid ? FalStepSpec::kSigmoid
           : a.act == Act::Silu    ? FalStepSpec::kSilu
           : a.act == Act::Softmax ? FalStepSpec::kSoftmaxFeature
                                   : FalStepSpec::kNone;
  };
  FalStepSpec spec;
  spec.act_q = code(c.q);
  spec.act_k = code(c.k);
  spec.act_v = code(c.v);
  spec.act_g = code(c.g);
  spec.lrpe = c.lrpe == FalLrpe::Cosine   ? FalStepSpec::kCosine
              : c.lrpe == FalLrpe::Rotate ? FalStepSpec::kRotate
                                          : FalStepSpec::kNoLrpe;
  spec.theta = o.theta;
  spec.position = o.offset;
  spec.decay = o.decay;
  return spec;
}
#endif

inline const std::vector<StepConfig> kSequenceConfigs = {
    {"cosine D 64 E 32 silu decay", FalLrpe::Cosine, 64, 32, kSilu, kSilu, kNone, kSilu, true},
    {"rotate D 128 E 64 softmax q and g, relu v", FalLrpe::Rotate, 128, 64, kSoft, kSilu, kRelu, kSoft, false},
    {"cosine D 128 E 128 sigmoid k, softmax v", FalLrpe::Cosine, 128, 128, kSilu, kSigmoid, kSoft, kSilu, true},
    {"none D 64 E 80 no acts", FalLrpe::None, 64, 80, kNone, kNone, kNone, kNone, true},
};

}  // namespace lintape::test::fal_cuda_cases
