// The activations fused in front of LRPE and FAL: none, relu, sigmoid, silu, and softmax over the
// feature dim (D, per token and head) or over the sequence dim (N, per batch, head and feature).
#pragma once
#include <string>
#include <vector>
#include "../core/tensor.h"

namespace lintape {

enum class Act { None, Relu, Sigmoid, Silu, Softmax };
enum class ActDim { None, Feature, Sequence };

Act act_from_name(const std::string& name);        // "none", "relu", "sigmoid", "silu", "softmax"
ActDim act_dim_from_name(const std::string& name);  // "none", "feature", "sequence"
const char* act_name(Act a);
const char* act_dim_name(ActDim d);

// Softmax needs a dim; an elementwise act must not have one. Throws naming `op` otherwise.
void check_act(Act act, ActDim dim, const char* op);

// act(x) for x of shape (B, N, H, D) through primitive ops (recorded by autograd): the composed path.
Tensor apply_act(const Tensor& x, Act act, ActDim dim);

// The float64 reference of act for the fused families' Impl::Reference paths, on the values of x (B, N, H, D) in
// row-major order: act(x), and dx from dy (softmax recomputes act(x) from x). relu keeps -0 and NaN as relu does.
std::vector<double> act_reference(const std::vector<double>& x, const Shape& shape, Act act, ActDim dim);
std::vector<double> act_reference_backward(const std::vector<double>& x, const std::vector<double>& dy,
                                           const Shape& shape, Act act, ActDim dim);

}  // namespace lintape
