#pragma once
#include "../core/tensor.h"

namespace lintape {

// y = x / sqrt(mean(x^2 over the last dim) + eps) * weight;  x (..., C), weight (C), same dtype.
// Fused kernel; saves x and the reciprocal rms (f32, f64 for f64; one per row) for backward, which
// computes dx and dweight (summed over rows in f32) in one pass over the rows and a small reduction.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);

}  // namespace lintape
