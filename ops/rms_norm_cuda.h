// Internal: the CUDA kernels of rms_norm. All tensors contiguous; x is (rows, C) flattened.
#pragma once
#if LINTAPE_WITH_CUDA
#include "core/tensor.h"

namespace lintape::ops_cuda {

// y = s * rstd * weight with s = x, or for add_rms_norm s = x + residual (rounded to the dtype) written to
// sum; rstd (rows) in f32 (f64 for f64) is written for backward. residual and sum: both or neither.
void rms_norm_forward_cuda(const Tensor& x, const Tensor& residual, const Tensor& sum, const Tensor& weight,
                           double eps, const Tensor& y, const Tensor& rstd);
// x is the normalised input (s). dx (overwritten) = the norm's gradient + dsum when dsum is defined;
// dweight (overwritten, reduced over rows); dx or dweight may be undefined when not wanted.
void rms_norm_backward_cuda(const Tensor& dy, const Tensor& dsum, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd, const Tensor& dx, const Tensor& dweight);

}  // namespace lintape::ops_cuda
#endif
