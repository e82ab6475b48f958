#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape {

// Mean over tokens of -log softmax(logits)[target]; logits (T, V), targets (T) of i64 or i32.
// Tokens whose target == ignore_index are left out of the sum and the count. Fused softmax + NLL:
// forward saves per-row log-sum-exp (f32); backward writes only the logits' gradient.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);

}  // namespace lintape
