#pragma once
#include <utility>
#include "../core/tensor.h"

namespace lintape {

// y = x / sqrt(mean(x^2 over the last dim) + eps) * weight;  x (..., C), weight (C), same dtype.
// Fused kernel; saves x and the reciprocal rms (f32, f64 for f64; one per row) for backward, which
// computes dx and dweight (summed over rows in f32) in one pass over the rows and a small reduction.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);

// A residual add fused with the norm after it: returns {sum, y} with sum = x + residual (rounded to the
// dtype exactly as add(x, residual)) and y = rms_norm(sum, weight, eps), in one pass over memory.
// Backward: x and residual both get dsum + the norm's gradient, formed in one pass. Saves sum and rstd.
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                       double eps = 1e-6);

}  // namespace lintape
