// Internal: the cuBLASLt side of matmul, and the hooks the benchmark uses to time each algorithm.
#pragma once
#if LINTAPE_WITH_CUDA
#include "core/tensor.h"

namespace lintape {

// How many algorithms cuBLASLt's heuristic offers for matmul(a, b, ta, tb) (at most 16).
int matmul_heuristic_count(const Tensor& a, const Tensor& b, bool ta, bool tb);
// c = matmul(a, b, ta, tb) written into c (contiguous, of the product's shape, dtype and device) with
// the heuristic's algorithm number `heuristic_rank` (0: the one matmul() uses). Not recorded by autograd.
void matmul_into(const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb, int heuristic_rank);

namespace ops_cuda {
// The GEMM itself. a and b are contiguous stacks of `batch` matrices, or one matrix (2-D) shared by
// every batch; c is contiguous (batch, M, N), of a's dtype or f32 (for 16-bit a and b). With accumulate,
// c += the product. Shapes were checked by the caller.
void gemm_cuda(const Tensor& a, const Tensor& b, const Tensor& c, int64_t batch, int64_t m, int64_t n, int64_t k,
               bool ta, bool tb, int heuristic_rank, bool accumulate = false);
// The number of algorithms offered for such a product into a freshly allocated (256-byte aligned) c.
int gemm_cuda_heuristic_count(const Tensor& a, const Tensor& b, int64_t batch, int64_t m, int64_t n, int64_t k,
                              bool ta, bool tb);
}  // namespace ops_cuda

}  // namespace lintape
#endif
