// Shape ops: views (view, permute, transpose, narrow are Tensor methods, see core/tensor.h), copies
// (contiguous, reshape, to, clone), cat and split. All recorded by autograd.
#pragma once
#include <vector>
#include "../core/tensor.h"

namespace lintape {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
// Consecutive views of x along dim, of the given sizes (they must add up to its size there): one recorded
// node whose backward writes one gradient of x's shape from the pieces' (zeros where a piece got none),
// where separate narrows would each zero-fill x's shape and then be added together.
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
// Normalises a possibly negative dim against a rank; throws naming the op when out of range.
int64_t wrap_dim(int64_t dim, int64_t rank, const char* op);

}  // namespace lintape
