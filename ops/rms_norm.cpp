// rms_norm: y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) per row.
// Backward, with s = sum_c dy_c w_c x_c per row:  dx = r w dy - (r^3 s / C) x,  dw = sum_rows dy x r.
// add_rms_norm normalises x + residual the same way, and its dx also carries the sum's own gradient.
#include "ops/rms_norm.h"
#include <cmath>
#include <type_traits>
#include "autograd/tape.h"
#include "ops/matmul.h"
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

// The rows of s = x, or x + residual (rounded as `add`) when residual is defined, normalised: y and the
// reciprocal rms a row. Every tensor contiguous, x (rows, C) or any shape ending in C.
struct Normed {
  Tensor s, y, rstd;
};

Normed normalise(const char* op, const Tensor& x, const Tensor& residual, const Tensor& w, double eps) {
  const bool fused_add = residual.defined();
  const int64_t cols = x.size(-1), rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  const DType rdt = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Normed n{fused_add ? empty(x.shape(), x.dtype(), x.device()) : x, empty(x.shape(), x.dtype(), x.device()),
           empty({rows}, rdt, x.device())};
#if LINTAPE_WITH_CUDA
  if (x.is_cuda())
    ops_cuda::rms_norm_forward_cuda(x, residual, fused_add ? n.s : Tensor(), w, eps, n.y, n.rstd);
  else
#endif
    LT_DISPATCH_FLOAT(x.dtype(), op, T, {
      if (fused_add) add_cpu(x.data_ptr<T>(), residual.data_ptr<T>(), n.s.data_ptr<T>(), x.numel());
      forward_cpu(n.s.data_ptr<T>(), w.data_ptr<T>(), n.y.data_ptr<T>(), n.rstd.data_ptr<rstd_t<T>>(), rows, cols,
                  eps);
    });
  return n;
}

// The norm's gradients for dy (contiguous, s's shape): dx (plus dsum when defined) and dw, each only when
// wanted; dw is zero when dy is undefined (only the sum was used), and dx is then dsum itself.
std::pair<Tensor, Tensor> normalise_grad(const char* op, const Tensor& dy, const Tensor& dsum, const Tensor& s,
                                         const Tensor& w, const Tensor& rstd, bool want_x, bool want_w) {
  Tensor dw = want_w ? empty(w.shape(), w.dtype(), w.device()) : Tensor();
  if (!dy.defined()) {
    if (want_w) dw.zero_();
    return {dsum, dw};
  }
  Tensor dx = want_x ? empty(s.shape(), s.dtype(), s.device()) : Tensor();
#if LINTAPE_WITH_CUDA
  if (dy.is_cuda())
    ops_cuda::rms_norm_backward_cuda(dy, dsum, s, w, rstd, dx, dw);
  else
#endif
    LT_DISPATCH_FLOAT(dy.dtype(), op, T, {
      const int64_t cols = s.size(-1), rows = cols == 0 ? 0 : s.numel() / cols;
      backward_cpu(dy.data_ptr<T>(), dsum.defined() ? dsum.data_ptr<T>() : nullptr, s.data_ptr<T>(),
                   w.data_ptr<T>(), rstd.data_ptr<rstd_t<T>>(), ptr_or_null<T>(dx), ptr_or_null<T>(dw), rows, cols);
    });
  return {dx, dw};
}

// The norm of s (= x, or x + residual when residual is defined: then the sum is returned in `sum`), and
// its tape node: gradients to x (and residual) and weight.
Tensor norm_forward(const char* op, const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                    Tensor* sum) {
  const bool fused_add = residual.defined();
  const Tensor wc = weight.detach().contiguous();
  const Normed n = normalise(op, x.detach().contiguous(), fused_add ? residual.detach().contiguous() : Tensor(), wc,
                             eps);
  if (sum) *sum = n.s;
  std::vector<autograd::Input> inputs{x};
  if (fused_add) inputs.emplace_back(residual);
  inputs.emplace_back(weight);
  if (!autograd::needs_grad(fused_add ? std::vector<Tensor>{x, residual, weight} : std::vector<Tensor>{x, weight}))
    return n.y;
  const bool want_x = x.requires_grad() || (fused_add && residual.requires_grad()), want_w = weight.requires_grad();
  std::vector<Tensor> outputs{n.y};
  if (fused_add) outputs.insert(outputs.begin(), n.s);
  const Tensor saved = n.s.detach(), rstd = n.rstd;
  autograd::record(op, inputs, outputs, [op, saved, wc, rstd, want_x, want_w, fused_add](const Grads& g) -> Grads {
    // g: (dsum, dy) for add_rms_norm, (dy) for rms_norm; either of add_rms_norm's may be undefined.
    const Tensor dsum = fused_add && g[0].defined() ? g[0].detach().contiguous() : Tensor();
    const Tensor& gy = g[fused_add ? 1 : 0];
    const auto [dx, dw] =
        normalise_grad(op, gy.defined() ? gy.detach().contiguous() : Tensor(), dsum, saved, wc, rstd, want_x, want_w);
    if (fused_add) return {dx, dx, dw};  // x and residual get the same gradient (the tape copies on a sum)
    return {dx, dw};
  });
  return n.y;
}

// The norm (over groups of C = norm_weight's size) then the product with weight^T, as one tape node that
// keeps s and rstd rather than the normed rows: its backward normalises s again (the same kernel, so the
// same bits), takes the product's two gradients as matmul's backward does, then the norm's.
std::pair<Tensor, Tensor> norm_linear(const char* op, const Tensor& x, const Tensor& residual,
                                      const Tensor& norm_weight, const Tensor& weight, double eps) {
  const bool fused_add = residual.defined();
  const Shape shape = x.shape();
  const int64_t C = norm_weight.size(0), rows = x.numel() / C;  // C > 0 (check_linear)
  const Tensor wc = norm_weight.detach().contiguous(), W = weight.detach();
  const Normed n = normalise(op, x.detach().contiguous().view({rows, C}),
                             fused_add ? residual.detach().contiguous().view({rows, C}) : Tensor(), wc, eps);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = matmul(n.y.view(shape), W, false, true);
  }
  const Tensor sum = fused_add ? n.s.view(shape) : x;
  std::vector<Tensor> ins{x};
  if (fused_add) ins.push_back(residual);
  ins.push_back(norm_weight);
  ins.push_back(weight);
  if (!autograd::needs_grad(ins)) return {sum, out};
  const bool want_x = x.requires_grad() || (fused_add && residual.requires_grad());
  const bool want_norm_w = norm_weight.requires_grad(), want_w = weight.requires_grad();
  std::vector<autograd::Input> inputs(ins.begin(), ins.end());
  std::vector<Tensor> outputs{out};
  if (fused_add) outputs.insert(outputs.begin(), sum);
  const Tensor saved = n.s.detach(), rstd = n.rstd;
  autograd::record(op, inputs, outputs,
                   [=](const Grads& g) -> Grads {
                     const Tensor dsum = fused_add && g[0].defined() ? g[0].detach().contiguous().view({rows, C})
                                                                    : Tensor();
                     const Tensor& gout = g[fused_add ? 1 : 0];
                     Tensor dW, dy;
                     if (gout.defined()) {
                       const Tensor dc = gout.detach().contiguous();
                       if (want_w) {  // the normed rows, made again, are needed for the weight's gradient only
                         const Tensor y = normalise(op, saved, Tensor(), wc, eps).y;
                         dW = matmul(dc.view({-1, dc.size(-1)}), y.view({-1, shape.back()}), true, false);
                       }
                       if (want_x || want_norm_w) dy = matmul(dc, W, false, false).view({rows, C});
                     }
                     auto [dx, dnw] = normalise_grad(op, dy, dsum, saved, wc, rstd, want_x, want_norm_w);
                     if (dx.defined()) dx = dx.view(shape);
                     if (fused_add) return {dx, dx, dnw, dW};
                     return {dx, dnw, dW};
                   });
  return {sum, out};
}

void check_linear(const char* op, const Tensor& x, const Tensor& norm_weight, const Tensor& weight, double eps) {
  LT_CHECK(x.dim() >= 1 && is_floating(x.dtype()), "[", op, "] x must be a float (..., K) tensor; got ",
           shape_str(x.shape()), " ", dtype_name(x.dtype()));
  const int64_t K = x.size(-1);
  LT_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) > 0 && K % norm_weight.size(0) == 0, "[", op,
           "] norm_weight must be (C) with C dividing x's last dim K = ", K, "; got ", shape_str(norm_weight.shape()));
  LT_CHECK(weight.dim() == 2 && weight.size(1) == K, "[", op, "] weight must be (M, K) with K = ", K, "; got ",
           shape_str(weight.shape()));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"norm_weight", &norm_weight}, {"weight", &weight}}) {
    LT_CHECK(t->dtype() == x.dtype(), "[", op, "] ", name, " must have x's dtype ", dtype_name(x.dtype()), "; got ",
             dtype_name(t->dtype()));
    LT_CHECK(t->device() == x.device(), "[", op, "] ", name, " must be on x's device ", x.device().name(), "; got ",
             t->device().name());
  }
  LT_CHECK(eps >= 0, "[", op, "] eps must be >= 0; got ", eps);
}

void check_residual(const char* op, const Tensor& x, const Tensor& residual) {
  LT_CHECK(residual.shape() == x.shape(), "[", op, "] residual must have x's shape ", shape_str(x.shape()), "; got ",
           shape_str(residual.shape()));
  LT_CHECK(residual.dtype() == x.dtype(), "[", op, "] residual must have x's dtype ", dtype_name(x.dtype()),
           "; got ", dtype_name(residual.dtype()));
  LT_CHECK(residual.device() == x.device(), "[", op, "] residual must be on x's device ", x.device().name(),
           "; got ", residual.device().name());
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_inputs("rms_norm", x, weight, eps);
  return norm_forward("rms_norm", x, Tensor(), weight, eps, nullptr);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  check_inputs("add_rms_norm", x, weight, eps);
  check_residual("add_rms_norm", x, residual);
  Tensor sum;
  Tensor y = norm_forward("add_rms_norm", x, residual, weight, eps, &sum);
  return {sum, y};
}

Tensor rms_norm_linear(const Tensor& x, const Tensor& norm_weight, const Tensor& weight, double eps) {
  check_linear("rms_norm_linear", x, norm_weight, weight, eps);
  return norm_linear("rms_norm_linear", x, Tensor(), norm_weight, weight, eps).second;
}

std::pair<Tensor, Tensor> add_rms_norm_linear(const Tensor& x, const Tensor& residual, const Tensor& norm_weight,
                                              const Tensor& weight, double eps) {
  check_linear("add_rms_norm_linear", x, norm_weight, weight, eps);
  check_residual("add_rms_norm_linear", x, residual);
  return norm_linear("add_rms_norm_linear", x, residual, norm_weight, weight, eps);
}

}  // namespace lintape
