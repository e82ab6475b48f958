// rms_norm: y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) per row.
// Backward, with s = sum_c dy_c w_c x_c per row:  dx = r w dy - (r^3 s / C) x,  dw = sum_rows dy x r.
#include "ops/rms_norm.h"
#include <cmath>
#include <type_traits>
#include "autograd/tape.h"
#include "ops/rms_norm_cuda.h"

namespace lintape {
using autograd::Grads;

namespace {

// The saved reciprocal rms: f64 for f64 inputs, else f32.
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
void backward_cpu(const T* dy, const T* x, const T* w, const rstd_t<T>* rstd, T* dx, T* dw, int64_t rows,
                  int64_t cols) {
  std::vector<double> dw_acc(size_t(cols), 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const T *g = dy + i * cols, *xr = x + i * cols;
    double r = double(rstd[i]), s = 0;
    for (int64_t c = 0; c < cols; ++c) s += double(g[c]) * double(w[c]) * double(xr[c]);
    double coef = r * r * r * s / double(cols);
    for (int64_t c = 0; c < cols; ++c) {
      if (dx) dx[i * cols + c] = T(r * double(w[c]) * double(g[c]) - coef * double(xr[c]));
      dw_acc[size_t(c)] += double(g[c]) * double(xr[c]) * r;
    }
  }
  if (dw)
    for (int64_t c = 0; c < cols; ++c) dw[c] = T(dw_acc[size_t(c)]);
}

template <class T> T* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  LT_CHECK(x.dim() >= 1 && is_floating(x.dtype()), "[rms_norm] x must be a float (..., C) tensor; got ",
           shape_str(x.shape()), " ", dtype_name(x.dtype()));
  int64_t cols = x.size(-1);
  LT_CHECK(weight.dim() == 1 && weight.size(0) == cols, "[rms_norm] weight must be (C) with C = ", cols, "; got ",
           shape_str(weight.shape()));
  LT_CHECK(weight.dtype() == x.dtype(), "[rms_norm] weight must have x's dtype ", dtype_name(x.dtype()), "; got ",
           dtype_name(weight.dtype()));
  LT_CHECK(weight.device() == x.device(), "[rms_norm] weight must be on x's device ", x.device().name(), "; got ",
           weight.device().name());
  LT_CHECK(eps >= 0, "[rms_norm] eps must be >= 0; got ", eps);
  Tensor xc = x.detach().contiguous(), wc = weight.detach().contiguous();
  int64_t rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  DType rdt = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor y = empty(x.shape(), x.dtype(), x.device()), rstd = empty({rows}, rdt, x.device());
#if LINTAPE_WITH_CUDA
  if (x.is_cuda())
    cuda_ops::rms_norm_forward_cuda(xc, wc, eps, y, rstd);
  else
#endif
    LT_DISPATCH_FLOAT(x.dtype(), "rms_norm", T, {
      forward_cpu(xc.data_ptr<T>(), wc.data_ptr<T>(), y.data_ptr<T>(), rstd.data_ptr<rstd_t<T>>(), rows, cols, eps);
    });

  if (!autograd::needs_grad({x, weight})) return y;
  bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  autograd::record("rms_norm", {x, weight}, {y}, [xc, wc, rstd, rows, cols, need_x, need_w](const Grads& g) -> Grads {
    Tensor dy = g[0].detach().contiguous();
    Tensor dx = need_x ? empty(xc.shape(), xc.dtype(), xc.device()) : Tensor();
    Tensor dw = need_w ? empty(wc.shape(), wc.dtype(), wc.device()) : Tensor();
#if LINTAPE_WITH_CUDA
    if (dy.is_cuda()) {
      cuda_ops::rms_norm_backward_cuda(dy, xc, wc, rstd, dx, dw);
      return {dx, dw};
    }
#endif
    LT_DISPATCH_FLOAT(dy.dtype(), "rms_norm", T, {
      backward_cpu(dy.data_ptr<T>(), xc.data_ptr<T>(), wc.data_ptr<T>(), rstd.data_ptr<rstd_t<T>>(), ptr_or_null<T>(dx),
                   ptr_or_null<T>(dw), rows, cols);
    });
    return {dx, dw};
  });
  return y;
}

}  // namespace lintape
