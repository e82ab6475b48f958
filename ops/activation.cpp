#include "ops/activation.h"
#include <algorithm>
#include <cmath>
#include "ops/elementwise.h"
#include "ops/reduce.h"

namespace lintape {

Act act_from_name(const std::string& name) {
  if (name == "none") return Act::None;
  if (name == "relu") return Act::Relu;
  if (name == "sigmoid") return Act::Sigmoid;
  if (name == "silu") return Act::Silu;
  if (name == "softmax") return Act::Softmax;
  fail(str("[act] unknown activation '", name, "'; expected none, relu, sigmoid, silu or softmax"));
}

ActDim act_dim_from_name(const std::string& name) {
  if (name == "none") return ActDim::None;
  if (name == "feature") return ActDim::Feature;
  if (name == "sequence") return ActDim::Sequence;
  fail(str("[act] unknown activation dim '", name, "'; expected none, feature or sequence"));
}

const char* act_name(Act a) {
  switch (a) {
    case Act::None: return "none";
    case Act::Relu: return "relu";
    case Act::Sigmoid: return "sigmoid";
    case Act::Silu: return "silu";
    case Act::Softmax: return "softmax";
  }
  return "?";
}

const char* act_dim_name(ActDim d) {
  switch (d) {
    case ActDim::None: return "none";
    case ActDim::Feature: return "feature";
    case ActDim::Sequence: return "sequence";
  }
  return "?";
}

void check_act(Act act, ActDim dim, const char* op) {
  LT_CHECK(act != Act::Softmax || dim != ActDim::None, "[", op,
           "] act softmax needs a dim (feature or sequence); got dim none");
  LT_CHECK(act == Act::Softmax || dim == ActDim::None, "[", op, "] act ", act_name(act),
           " is elementwise and takes no dim; got dim ", act_dim_name(dim));
}

Tensor apply_act(const Tensor& x, Act act, ActDim dim) {
  check_act(act, dim, "apply_act");
  LT_CHECK(x.dim() == 4, "[apply_act] x must be (B, N, H, D); got ", shape_str(x.shape()));
  switch (act) {
    case Act::None: return x;
    case Act::Relu: return relu(x);
    case Act::Sigmoid: return sigmoid(x);
    case Act::Silu: return silu(x);
    case Act::Softmax: return softmax(x, dim == ActDim::Feature ? 3 : 1);
  }
  return x;
}

namespace {
double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

std::vector<double> act_reference(const std::vector<double>& x, const Shape& s, Act act, ActDim dim) {
  const int64_t B = s[0], N = s[1], HD = s[2] * s[3], D = s[3];
  std::vector<double> y(x.size());
  switch (act) {
    case Act::None: return x;
    case Act::Relu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = std::max(x[i], 0.0);
      return y;
    case Act::Sigmoid:
      for (size_t i = 0; i < x.size(); ++i) y[i] = sigmoid_d(x[i]);
      return y;
    case Act::Silu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sigmoid_d(x[i]);
      return y;
    case Act::Softmax: break;
  }
  // Softmax groups: feature = D contiguous values; sequence = N values at stride H*D.
  const bool feature = dim == ActDim::Feature;
  const int64_t groups = feature ? B * N * s[2] : B * HD, len = feature ? D : N, stride = feature ? 1 : HD;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t base = feature ? gi * D : (gi / HD) * N * HD + gi % HD;
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, x[size_t(base + j * stride)]);
    for (int64_t j = 0; j < len; ++j)
      sum += (y[size_t(base + j * stride)] = std::exp(x[size_t(base + j * stride)] - m));
    for (int64_t j = 0; j < len; ++j) y[size_t(base + j * stride)] /= sum;
  }
  return y;
}

std::vector<double> act_reference_backward(const std::vector<double>& x, const std::vector<double>& dy,
                                           const Shape& s, Act act, ActDim dim) {
  std::vector<double> dx(x.size());
  switch (act) {
    case Act::None: return dy;
    case Act::Relu:
      for (size_t i = 0; i < x.size(); ++i) dx[i] = x[i] > 0 ? dy[i] : 0.0;
      return dx;
    case Act::Sigmoid:
      for (size_t i = 0; i < x.size(); ++i) {
        const double y = sigmoid_d(x[i]);
        dx[i] = dy[i] * y * (1 - y);
      }
      return dx;
    case Act::Silu:
      for (size_t i = 0; i < x.size(); ++i) {
        const double sg = sigmoid_d(x[i]);
        dx[i] = dy[i] * sg * (1 + x[i] * (1 - sg));
      }
      return dx;
    case Act::Softmax: break;
  }
  const std::vector<double> y = act_reference(x, s, act, dim);
  const int64_t B = s[0], N = s[1], HD = s[2] * s[3], D = s[3];
  const bool feature = dim == ActDim::Feature;
  const int64_t groups = feature ? B * N * s[2] : B * HD, len = feature ? D : N, stride = feature ? 1 : HD;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t base = feature ? gi * D : (gi / HD) * N * HD + gi % HD;
    double dot = 0;
    for (int64_t j = 0; j < len; ++j) dot += y[size_t(base + j * stride)] * dy[size_t(base + j * stride)];
    for (int64_t j = 0; j < len; ++j) {
      const size_t i = size_t(base + j * stride);
      dx[i] = y[i] * (dy[i] - dot);
    }
  }
  return dx;
}

}  // namespace lintape
