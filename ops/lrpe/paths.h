// Internal to the LRPE family: what its files share. lrpe.cpp checks the inputs, picks the path and calls one
// of reference.cpp (plain loops in double, hand-written backward), composed.cpp (primitive ops, differentiated
// by the tape) or fused.cpp (the CUDA kernels through launch.h). Every path saves x, not act(x) nor the
// output; theta never gets a gradient.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"
#include "ops/lrpe/launch.h"

namespace lintape::lrpe_paths {

// The tokens of a grid: the product of its sizes.
inline int64_t grid_tokens(const std::vector<int64_t>& grid) {
  int64_t p = 1;
  for (int64_t n : grid) p *= n;
  return p;
}

// Each path takes checked inputs, records its backward on the tape and returns out.
Tensor run_reference(const Tensor& x, LrpeSpec spec, const Tensor& theta);  // x contiguous, on the CPU
Tensor run_composed(const Tensor& x, const LrpeSpec& spec);
#if LINTAPE_WITH_CUDA
// x on CUDA, f32/bf16/f16. cache_angles: md_lrpe_cosine's MdLrpeOptions::cache_angles.
Tensor run_fused(const Tensor& x_in, LrpeSpec spec, const Tensor& theta, bool cache_angles);
#endif

}  // namespace lintape::lrpe_paths
