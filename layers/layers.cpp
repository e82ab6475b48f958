#include "layers/layers.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/rms_norm.h"

namespace lintape {

Tensor normal_init(const Shape& shape, double std, uint64_t seed) {
  return mul(randn(shape, DType::F32, Device::cpu(), seed), std);
}

Tensor weight_as(const Tensor& weight, const Tensor& x) { return weight.to(x.dtype()); }

namespace {
std::atomic<bool>& keep_normed_setting() {
  static std::atomic<bool> keep{[] {
    const char* v = std::getenv("LINTAPE_KEEP_NORMED");
    return v != nullptr && std::string(v) == "1";
  }()};
  return keep;
}
}  // namespace

bool keep_normed_rows() { return keep_normed_setting().load(std::memory_order_relaxed); }

void set_keep_normed_rows(bool keep) { keep_normed_setting().store(keep, std::memory_order_relaxed); }

Linear::Linear(int64_t in_features, int64_t out_features, double init_std, uint64_t seed) {
  LT_CHECK(in_features > 0 && out_features > 0, "[Linear] sizes must be positive; got in_features ",
           in_features, ", out_features ", out_features);
  weight = normal_init({out_features, in_features}, init_std, seed);
  register_parameter("weight", weight);
}

Tensor Linear::forward(const Tensor& x) const {
  LT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "[Linear] x must end in in_features = ", weight.size(1),
           "; got ", shape_str(x.shape()));
  return matmul(x, weight_as(weight, x), false, true);
}

Embedding::Embedding(int64_t vocab, int64_t width, double init_std, uint64_t seed) {
  LT_CHECK(vocab > 0 && width > 0, "[Embedding] sizes must be positive; got vocab ", vocab, ", width ", width);
  weight = normal_init({vocab, width}, init_std, seed);
  register_parameter("weight", weight);
}

Tensor Embedding::forward(const Tensor& ids) const { return embedding(weight, ids); }

RMSNorm::RMSNorm(int64_t width, double eps) : eps(eps) {
  LT_CHECK(width > 0, "[RMSNorm] width must be positive; got ", width);
  weight = ones({width});
  register_parameter("weight", weight);
}

Tensor RMSNorm::forward(const Tensor& x) const { return rms_norm(x, weight_as(weight, x), eps); }

std::pair<Tensor, Tensor> RMSNorm::forward_sum(const Tensor& x, const Tensor& residual) const {
  return add_rms_norm(x, residual, weight_as(weight, x), eps);
}

SwiGluMlp::SwiGluMlp(int64_t width, int64_t hidden, double init_std, double out_std, uint64_t seed)
    : up(width, 2 * hidden, init_std, seed), down(hidden, width, out_std, seed + 1), hidden(hidden) {
  register_module("up", up);
  register_module("down", down);
}

Tensor SwiGluMlp::forward(const Tensor& x) const {
  // up's rows: [u, gate]; the SwiGLU output is made again in the backward rather than held.
  return swiglu_linear(up.forward(x), weight_as(down.weight, x));
}

std::pair<Tensor, Tensor> SwiGluMlp::forward_after(const RMSNorm& norm, const Tensor& x, const Tensor& residual) const {
  if (keep_normed_rows()) {
    const auto [sum, h] = norm.forward_sum(x, residual);
    return {sum, forward(h)};
  }
  const auto [sum, u] = add_rms_norm_linear(x, residual, weight_as(norm.weight, x), weight_as(up.weight, x), norm.eps);
  return {sum, swiglu_linear(u, weight_as(down.weight, x))};
}

}  // namespace lintape
