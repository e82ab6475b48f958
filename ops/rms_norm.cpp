// rms_norm: y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) per row.
// Backward, with s = sum_c dy_c w_c x_c per row:  dx = r w dy - (r^3 s / C) x,  dw = sum_rows dy x r.
// add_rms_norm normalises x + residual the same way, and its dx also carries the sum's own gradient.
#include "ops/rms_norm.h"
#include <cmath>
#include <type_traits>
#include "autograd/tape.h"
#include "ops/rms_norm_cuda.h"

namespace lintape {
using autograd::Grads;

namespace {

// The saved reciprocal rms, and the residual sum's arithmetic (as `add`): f64 for f64 inputs, else f32.
template <class T> using rstd_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
void forward_cpu(const T* x, const T* w, T* y, rstd_t<T>* rstd, int64_t rows, int64_t cols, double eps) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * cols;
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += double(xr[c]) * double(xr[c]);
    double r = 1.0 / std::sqrt(ss / double(cols) + eps);
    rstd[i] = rstd_t<T>(r);
    for (int64_t c = 0; c < cols; ++c) y[i * cols + c] = T(double(xr[c]) * r * double(w[c]));
  }
}

template <class T>
void add_cpu(const T* x, const T* residual, T* sum, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] = T(rstd_t<T>(x[i]) + rstd_t<T>(residual[i]));
}

// dsum (the residual stream's gradient) may be null; it is added to dx.
template <class T>
void backward_cpu(const T* dy, const T* dsum, const T* x, const T* w, const rstd_t<T>* rstd, T* dx, T* dw,
                  int64_t rows, int64_t cols) {
  std::vector<double> dw_acc(size_t(cols), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const T *g = dy + i * cols, *xr = x + i * cols;
    double r = double(rstd[i]), s = 0;
    for (int64_t c = 0; c < cols; ++c) s += double(g[c]) * double(w[c]) * double(xr[c]);
    double coef = r * r * r * s / double(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const double carried = dsum ? double(dsum[i * cols + c]) : 0.0;
      if (dx) dx[i * cols + c] = T(r * double(w[c]) * double(g[c]) - coef * double(xr[c]) + carried);
      dw_acc[size_t(c)] += double(g[c]) * double(xr[c]) * r;
    }
  }
  if (dw)
    for (int64_t c = 0; c < cols; ++c) dw[c] = T(dw_acc[size_t(c)]);
}

template <class T> T* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

void check_inputs(const char* op, const Tensor& x, const Tensor& weight, double eps) {
  LT_CHECK(x.dim() >= 1 && is_floating(x.dtype()), "[", op, "] x must be a float (..., C) tensor; got ",
           shape_str(x.shape()), " ", dtype_name(x.dtype()));
  const int64_t cols = x.size(-1);
  LT_CHECK(weight.dim() == 1 && weight.size(0) == cols, "[", op, "] weight must be (C) with C = ", cols, "; got ",
           shape_str(weight.shape()));
  LT_CHECK(weight.dtype() == x.dtype(), "[", op, "] weight must have x's dtype ", dtype_name(x.dtype()), "; got ",
           dtype_name(weight.dtype()));
  LT_CHECK(weight.device() == x.device(), "[", op, "] weight must be on x's device ", x.device().name(), "; got ",
           weight.device().name());
  LT_CHECK(eps >= 0, "[", op, "] eps must be >= 0; got ", eps);
}

// The norm of s (= x, or x + residual when residual is defined: then the sum is returned in `sum`), and
// its tape node: gradients to x (and residual) and weight.
Tensor norm_forward(const char* op, const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                    Tensor* sum) {
  const bool fused_add = residual.defined();
  const Tensor xc = x.detach().contiguous(), wc = weight.detach().contiguous();
  const Tensor rc = fused_add ? residual.detach().contiguous() : Tensor();
  const int64_t cols = x.size(-1), rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  const DType rdt = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor y = empty(x.shape(), x.dtype(), x.device()), rstd = empty({rows}, rdt, x.device());
  Tensor s = fused_add ? empty(x.shape(), x.dtype(), x.device()) : xc;  // the rows normalised
#if LINTAPE_WITH_CUDA
  if (x.is_cuda())
    ops_cuda::rms_norm_forward_cuda(xc, rc, fused_add ? s : Tensor(), wc, eps, y, rstd);
  else
#endif
    LT_DISPATCH_FLOAT(x.dtype(), op, T, {
      if (fused_add) add_cpu(xc.data_ptr<T>(), rc.data_ptr<T>(), s.data_ptr<T>(), xc.numel());
      forward_cpu(s.data_ptr<T>(), wc.data_ptr<T>(), y.data_ptr<T>(), rstd.data_ptr<rstd_t<T>>(), rows, cols, eps);
    });
  if (sum) *sum = s;

  std::vector<autograd::Input> inputs{x};
  if (fused_add) inputs.emplace_back(residual);
  inputs.emplace_back(weight);
  const bool want_x = x.requires_grad() || (fused_add && residual.requires_grad());
  if (!autograd::needs_grad(fused_add ? std::vector<Tensor>{x, residual, weight} : std::vector<Tensor>{x, weight}))
    return y;
  const bool want_w = weight.requires_grad();
  std::vector<Tensor> outputs{y};
  if (fused_add) outputs.insert(outputs.begin(), s);
  const Tensor saved = s.detach();
  autograd::record(op, inputs, outputs,
                   [saved, wc, rstd, rows, cols, want_x, want_w, fused_add](const Grads& g) -> Grads {
    // g: (dsum, dy) for add_rms_norm, (dy) for rms_norm; either of add_rms_norm's may be undefined.
    const Tensor dsum = fused_add && g[0].defined() ? g[0].detach().contiguous() : Tensor();
    const Tensor& gy = g[fused_add ? 1 : 0];
    Tensor dx, dw = want_w ? empty(wc.shape(), wc.dtype(), wc.device()) : Tensor();
    if (!gy.defined()) {  // only the sum was used: its gradient passes to x and residual unchanged
      dx = dsum;
      if (want_w) dw.zero_();
    } else {
      const Tensor dy = gy.detach().contiguous();
      if (want_x) dx = empty(saved.shape(), saved.dtype(), saved.device());
#if LINTAPE_WITH_CUDA
      if (dy.is_cuda())
        ops_cuda::rms_norm_backward_cuda(dy, dsum, saved, wc, rstd, dx, dw);
      else
#endif
        LT_DISPATCH_FLOAT(dy.dtype(), "rms_norm", T, {
          backward_cpu(dy.data_ptr<T>(), dsum.defined() ? dsum.data_ptr<T>() : nullptr, saved.data_ptr<T>(),
                       wc.data_ptr<T>(), rstd.data_ptr<rstd_t<T>>(), ptr_or_null<T>(dx), ptr_or_null<T>(dw), rows,
                       cols);
        });
    }
    if (fused_add) return {dx, dx, dw};  // x and residual get the same gradient (the tape copies on a sum)
    return {dx, dw};
  });
  return y;
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_inputs("rms_norm", x, weight, eps);
  return norm_forward("rms_norm", x, Tensor(), weight, eps, nullptr);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  check_inputs("add_rms_norm", x, weight, eps);
  LT_CHECK(residual.shape() == x.shape(), "[add_rms_norm] residual must have x's shape ", shape_str(x.shape()),
           "; got ", shape_str(residual.shape()));
  LT_CHECK(residual.dtype() == x.dtype(), "[add_rms_norm] residual must have x's dtype ", dtype_name(x.dtype()),
           "; got ", dtype_name(residual.dtype()));
  LT_CHECK(residual.device() == x.device(), "[add_rms_norm] residual must be on x's device ", x.device().name(),
           "; got ", residual.device().name());
  Tensor sum;
  Tensor y = norm_forward("add_rms_norm", x, residual, weight, eps, &sum);
  return {sum, y};
}

}  // namespace lintape
