// Shape ops: views (view, permute, transpose, narrow are Tensor methods, see core/tensor.h), copies
// (contiguous, reshape, to, clone) and cat. All recorded by autograd.
#pragma once
#include <vector>
#include "../core/tensor.h"

namespace lintape {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
// Normalises a possibly negative dim against a rank; throws naming the op when out of range.
int64_t wrap_dim(int64_t dim, int64_t rank, const char* op);

}  // namespace lintape
