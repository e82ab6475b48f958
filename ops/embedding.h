#pragma once
#include "core/tensor.h"

namespace lintape {

// weight (V, C), ids (...) of i64 or i32 -> (..., C). Backward scatter-adds into the weight's gradient;
// ids are not differentiable. An id outside [0, V) is an error.
Tensor embedding(const Tensor& weight, const Tensor& ids);

}  // namespace lintape
