#pragma once
#include <cstdint>
#include "../core/tensor.h"

namespace lintape {

// Mean over tokens of -log softmax(logits)[target]; logits (T, V), targets (T) of i64 or i32. The result
// has shape () and is f32 (f64 for f64 logits), accumulated so: bf16 or f16 logits give the loss of their
// f32 values without an f32 copy of the logits; the gradient comes back in the logits' dtype.
// Tokens whose target == ignore_index are left out of the sum and the count; when every token is
// ignored the loss is 0 and the gradient is 0 (not NaN), so such a batch leaves the weights alone.
// A target outside [0, V) that is not ignore_index is an error (on CUDA found through a device flag
// read back after the forward kernels, which waits for the stream once per call).
// Fused softmax + NLL: forward saves the per-row log-sum-exp (f32; f64 for f64); backward writes
// dlogits = (softmax - onehot) * dloss / count in one pass and allocates nothing else of logits' size.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);

// cross_entropy(x @ weight^T, targets, ignore_index) without the (T, V) logits in memory: x (T, C),
// weight (V, C) of x's dtype. The rows go in chunks (chunk_rows of them; 0 picks about 512 MiB of logits);
// while a chunk's logits exist, its terms of dx and dweight are computed, so the op saves only dx (T, C)
// and dweight (V, C, summed in f32; f64 for f64) instead of the logits, and its backward scales them by
// dloss. The same three products as cross_entropy(matmul(x, weight, false, true)) and its backward,
// all run in the forward.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index = -100,
                            int64_t chunk_rows = 0);

}  // namespace lintape
