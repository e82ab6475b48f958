// Internal: the CUDA kernels of embedding.
#pragma once
#if LINTAPE_WITH_CUDA
#include "core/tensor.h"

namespace lintape::ops_cuda {

// out (n, C) = weight[ids] for contiguous weight (V, C), ids (n) and out. An id outside [0, V) gives a
// zero row and is recorded in `bad` (2 x i64, zeroed by the caller) as (position + 1, id).
void embedding_forward_cuda(const Tensor& weight, const Tensor& ids, const Tensor& out, const Tensor& bad);
// dweight (V, C, zeroed by the caller) += dout (n, C) scattered by ids (known to be in range; one out of
// range adds nothing). dweight is f32 for a 16-bit dout, else dout's dtype. Deterministic: each row's
// contributions are added in position order.
void embedding_backward_cuda(const Tensor& dout, const Tensor& ids, const Tensor& dweight);

}  // namespace lintape::ops_cuda
#endif
