// Internal to ops/reduce*: how a reduction sees its input, and the CUDA launchers.
#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape::reduce {

// A contiguous tensor viewed as (outer, len, inner), reduced over len: element (o, j, i) sits at
// (o * len + j) * inner + i, and the result (o, i) at o * inner + i.
struct Dims3 {
  int64_t outer = 1, len = 1, inner = 1;
};

#if LINTAPE_WITH_CUDA
// out = scale * sum over len; x and out contiguous, len >= 1.
void sum_cuda(const Tensor& out, const Tensor& x, Dims3 d, double scale);
// values and indices (i64) of the first maximum over len (NaN counts as the largest); len >= 1.
void max_cuda(const Tensor& values, const Tensor& indices, const Tensor& x, Dims3 d);
// dx (the shape of x) = dy at the saved index, 0 elsewhere; dy and indices (outer, inner).
void max_backward_cuda(const Tensor& dx, const Tensor& dy, const Tensor& indices, Dims3 d);
// y = softmax or log_softmax of x over len.
void softmax_cuda(const Tensor& y, const Tensor& x, Dims3 d, bool log);
// dx = y * (dy - sum(y * dy)), or for log_softmax dx = dy - exp(y) * sum(dy); all contiguous.
void softmax_backward_cuda(const Tensor& dx, const Tensor& y, const Tensor& dy, Dims3 d, bool log);
#endif

}  // namespace lintape::reduce
