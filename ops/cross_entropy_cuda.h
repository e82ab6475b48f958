// Internal: the CUDA kernels of cross_entropy. logits (T, V) and targets (T) contiguous.
#pragma once
#if LINTAPE_WITH_CUDA
#include <cstdint>
#include "core/tensor.h"

namespace lintape::cuda_ops {

// Writes lse (T; f32, f64 for f64), count (1 x i64: the rows not ignored) and loss (() in the logits'
// dtype). A target out of range is recorded in `bad` (2 x i64, zeroed by the caller) as (row + 1, target).
void cross_entropy_forward_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                                const Tensor& lse, const Tensor& count, const Tensor& bad);
// dlogits (T, V) = (softmax - onehot) * dloss / count; rows ignored (or all, when count is 0) get 0.
void cross_entropy_backward_cuda(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                                 int64_t ignore_index, const Tensor& lse, const Tensor& count, const Tensor& dlogits);

}  // namespace lintape::cuda_ops
#endif
