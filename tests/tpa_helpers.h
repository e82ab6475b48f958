// TPA attention in the tests: the output and the six factor gradients of one call, shared by the CPU and
// CUDA cases.
#pragma once
#include <vector>
#include "autograd/tape.h"
#include "helpers.h"
#include "ops/tpa/tpa.h"

namespace lintape::test {

// The output and the six factor gradients for the upstream gradient w (the same values on every side), all
// on the CPU.
inline std::vector<Tensor> attention_and_grads(const std::vector<Tensor>& factors, const TpaOptions& o, Impl impl,
                                               const Tensor& w) {
  std::vector<Tensor> leaves;
  for (const Tensor& t : factors) leaves.push_back(t.detach().requires_grad_());
  Tensor out = tpa_attention(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], o, impl);
  backward(out, w.to(out.device()).to(out.dtype()));
  std::vector<Tensor> r{out.detach().to(Device::cpu())};
  for (const Tensor& t : leaves) r.push_back(t.grad().to(Device::cpu()));
  return r;
}

}  // namespace lintape::test
