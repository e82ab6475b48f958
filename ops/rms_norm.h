#pragma once
#include "core/tensor.h"

namespace lintape {

// y = x / sqrt(mean(x^2 over the last dim) + eps) * weight;  x (..., C), weight (C).
// Fused kernel; saves x and the reciprocal rms (f32, one per row) for backward.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);

}  // namespace lintape
