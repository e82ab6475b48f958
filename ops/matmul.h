// Matrix products. CPU: Eigen in f64 (other dtypes through f64 copies, rounded once at the end). CUDA:
// cuBLASLt with f32 accumulation, transposes folded into the call, a cached workspace.
#pragma once
#include "../core/tensor.h"

namespace lintape {

// a (..., M, K) @ b (..., K, N) -> (..., M, N); with transpose_a, a is (..., K, M); with transpose_b,
// b is (..., N, K). Batch dims must be equal, or b may be 2-D (one matrix shared by every batch).
// An input that is a transposed view of its last two dims is read in place; other non-contiguous
// inputs are copied first. Backward: da = dc b^T, db = a^T dc (for a shared b, one GEMM over the
// flattened batch).
Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false, bool transpose_b = false);

// The same product written into c without autograd: c = op(a) @ op(b), or c += it with accumulate. c is
// contiguous, of the product's shape and device, and of a's dtype, or f32 for bf16/f16 inputs (the sum
// kept in f32 across calls).
void matmul_out(const Tensor& a, const Tensor& b, const Tensor& c, bool transpose_a, bool transpose_b,
                bool accumulate = false);

}  // namespace lintape
