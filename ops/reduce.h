// Reductions and normalisations over dims, CPU and CUDA, recorded by autograd. Accumulation in f32
// (f64 for f64). dims may be negative; an empty dims list reduces over all dims.
#pragma once
#include <vector>
#include "../core/tensor.h"

namespace lintape {

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

struct MaxResult {
  Tensor values;   // differentiable: the gradient goes to the (first) maximum
  Tensor indices;  // i64, not differentiable
};
MaxResult max(const Tensor& x, int64_t dim, bool keepdim = false);

Tensor softmax(const Tensor& x, int64_t dim);      // saves its output for backward
Tensor log_softmax(const Tensor& x, int64_t dim);  // saves its output for backward

}  // namespace lintape
