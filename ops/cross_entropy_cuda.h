// Internal: the CUDA kernels of cross_entropy. logits (T, V) and targets (T) contiguous.
#pragma once
#if LINTAPE_WITH_CUDA
#include <cstdint>
#include "core/tensor.h"

namespace lintape::ops_cuda {

// Writes lse (T; f32, f64 for f64), count (1 x i64: the rows not ignored) and loss (() in the logits'
// dtype). A target out of range is recorded in `bad` (2 x i64, zeroed by the caller) as (row + 1, target).
void cross_entropy_forward_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                                const Tensor& lse, const Tensor& count, const Tensor& bad);
// The forward's two halves. Rows: lse and row_loss (T each, contiguous) for a chunk of rows whose first row
// is row `row_offset` of the whole (for `bad`). Reduce: loss = sum(row_loss) / count over the rows not
// ignored, and count; with row_loss and loss undefined it only counts. acc_dtype: f32, or f64 for f64.
void cross_entropy_rows_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index, const Tensor& lse,
                             const Tensor& row_loss, const Tensor& bad, int64_t row_offset);
void cross_entropy_reduce_cuda(const Tensor& row_loss, const Tensor& targets, int64_t ignore_index, const Tensor& loss,
                               const Tensor& count, DType acc_dtype);
// The rows' half of the forward and then the backward, in place (logits become dlogits), reading each row once:
// the same bits as cross_entropy_rows_cuda then cross_entropy_backward_cuda. count must be known (reduce first).
// Returns false, doing nothing, for f64 and where a row is too long for it (over 32768 classes in bf16 / f16,
// 16384 in f32).
bool cross_entropy_rows_gradient_cuda(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                                      const Tensor& lse, const Tensor& row_loss, const Tensor& bad, int64_t row_offset,
                                      const Tensor& dloss, const Tensor& count);
// dlogits (T, V) = (softmax - onehot) * dloss / count; rows ignored (or all, when count is 0) get 0.
void cross_entropy_backward_cuda(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                                 int64_t ignore_index, const Tensor& lse, const Tensor& count, const Tensor& dlogits);

}  // namespace lintape::ops_cuda
#endif
