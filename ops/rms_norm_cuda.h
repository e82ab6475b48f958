// Internal: the CUDA kernels of rms_norm. All tensors contiguous; x is (rows, C) flattened.
#pragma once
#if LINTAPE_WITH_CUDA
#include "core/tensor.h"

namespace lintape::cuda_ops {

// y = x * rstd * weight; rstd (rows) in f32 (f64 for f64) is written for backward.
void rms_norm_forward_cuda(const Tensor& x, const Tensor& weight, double eps, const Tensor& y, const Tensor& rstd);
// dx (overwritten) and dweight (overwritten, reduced over rows); either may be undefined when not wanted.
void rms_norm_backward_cuda(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                            const Tensor& dx, const Tensor& dweight);

}  // namespace lintape::cuda_ops
#endif
