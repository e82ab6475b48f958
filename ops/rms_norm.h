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

// rms_norm then a product with weight^T, y = rms_norm(x, norm_weight) @ weight^T, without holding the normed
// rows for the backward: it makes them again from x and the saved reciprocal rms (one activation of x's size
// less a call, for one more pass of the norm in the backward). x (..., K) is normalised in groups of C =
// norm_weight's size (K a multiple of C: C = K is the usual norm, C = D the FAL mixer's per-head norm over its
// heads laid side by side); weight (M, K); y (..., M). Values and gradients have the bits of rms_norm (on x
// viewed as (..., K / C, C)) then matmul(normed, weight, false, true).
Tensor rms_norm_linear(const Tensor& x, const Tensor& norm_weight, const Tensor& weight, double eps = 1e-6);

// add_rms_norm's {sum, normed} with the normed rows replaced by their product with weight^T, holding neither
// them nor anything but sum and the reciprocal rms, as rms_norm_linear: {x + residual, rms_norm(x + residual,
// norm_weight) @ weight^T}.
std::pair<Tensor, Tensor> add_rms_norm_linear(const Tensor& x, const Tensor& residual, const Tensor& norm_weight,
                                              const Tensor& weight, double eps = 1e-6);

}  // namespace lintape
