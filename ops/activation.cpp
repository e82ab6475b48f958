#include "ops/activation.h"
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

}  // namespace lintape
