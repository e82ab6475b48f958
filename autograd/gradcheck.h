// gradcheck: the tape's full Jacobian (one backward per output element, one-hot output gradients)
// against central differences, on the CPU in float64.
#pragma once
#include <functional>
#include <string>
#include <vector>
#include "../core/tensor.h"

namespace lintape {

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;  // largest |analytic - numeric| over all Jacobian entries
  std::string message;       // the first mismatch (input, element, output, both values), if any
};

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;  // an entry passes when |analytic - numeric| <= atol + rtol * |numeric|
};

// f maps the inputs to one output tensor. Inputs that require grad are checked; they must be f64 CPU
// leaves. Other inputs (indices, theta, positions) are passed through unchanged.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs,
                          const GradcheckOptions& options = {});

}  // namespace lintape
