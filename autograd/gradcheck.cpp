#include "autograd/gradcheck.h"
#include <cmath>
#include "autograd/tape.h"

namespace lintape {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs,
                          const GradcheckOptions& opt) {
  std::vector<size_t> checked;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor& t = inputs[i];
    if (!t.defined() || !t.requires_grad()) continue;
    LT_CHECK(t.dtype() == DType::F64 && !t.is_cuda() && t.is_leaf() && t.is_contiguous(), "[gradcheck] input ", i,
             " must be a contiguous f64 CPU leaf; got ", dtype_name(t.dtype()), " on ", t.device().name());
    checked.push_back(i);
  }
  LT_CHECK(!checked.empty(), "[gradcheck] no input requires grad");

  Tensor y = f(inputs);
  LT_CHECK(y.dtype() == DType::F64, "[gradcheck] the function must return f64; got ", dtype_name(y.dtype()));
  int64_t n_out = y.numel();

  // analytic[k][j * n_in + i] = d y_j / d x_k,i, one backward per output element
  std::vector<std::vector<double>> analytic(inputs.size());
  for (size_t k : checked) analytic[k].assign(size_t(n_out * inputs[k].numel()), 0.0);
  for (int64_t j = 0; j < n_out; ++j) {
    for (size_t k : checked) inputs[k].set_grad(Tensor());
    std::vector<double> onehot(size_t(n_out), 0.0);
    onehot[size_t(j)] = 1.0;
    if (y.requires_grad()) backward(y, from_vector(onehot, y.shape(), DType::F64), /*retain_graph=*/true);
    for (size_t k : checked) {
      Tensor g = inputs[k].grad();
      if (!g.defined()) continue;  // no path from this input to y: zero column
      std::vector<double> gv = g.to_vector<double>();
      for (size_t i = 0; i < gv.size(); ++i) analytic[k][size_t(j) * gv.size() + i] = gv[i];
    }
  }
  for (size_t k : checked) inputs[k].set_grad(Tensor());

  GradcheckResult res;
  NoGradGuard no_grad;
  for (size_t k : checked) {
    double* x = inputs[k].data_ptr<double>();
    int64_t n_in = inputs[k].numel();
    for (int64_t i = 0; i < n_in; ++i) {
      double orig = x[i];
      x[i] = orig + opt.eps;
      std::vector<double> plus = f(inputs).to_vector<double>();
      x[i] = orig - opt.eps;
      std::vector<double> minus = f(inputs).to_vector<double>();
      x[i] = orig;
      for (int64_t j = 0; j < n_out; ++j) {
        double numeric = (plus[size_t(j)] - minus[size_t(j)]) / (2 * opt.eps);
        double a = analytic[k][size_t(j * n_in + i)];
        double err = std::fabs(a - numeric);
        if (!(err <= res.max_abs_error)) res.max_abs_error = std::isnan(err) ? INFINITY : err;
        if (res.ok && !(err <= opt.atol + opt.rtol * std::fabs(numeric))) {
          res.ok = false;
          res.message = str("input ", k, " element ", i, ", output element ", j, ": tape gives ", a,
                            ", finite differences give ", numeric);
        }
      }
    }
  }
  return res;
}

}  // namespace lintape
