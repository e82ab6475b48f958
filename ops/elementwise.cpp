// Elementwise ops: input checks, the CPU loops, CUDA dispatch and the backward rules. The math of each
// op is in ops/elementwise_cuda.h, shared with the CUDA kernels.
#include "ops/elementwise.h"
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include "autograd/tape.h"
#include "core/strided.h"
#include "ops/elementwise_cuda.h"
#include "ops/matmul.h"
#include "ops/reduce.h"

namespace lintape {
using autograd::Grads;
using autograd::record;
using elementwise::BinaryOp;
using elementwise::UnaryOp;

namespace {

template <class T> using cpu_compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

void check_float(const Tensor& x, const char* op) {
  LT_CHECK(is_floating(x.dtype()), "[", op, "] expected a float dtype (f32, f64, bf16, f16); got ",
           dtype_name(x.dtype()));
}

Shape broadcast_shape(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t k = 0; k < n; ++k) {  // k-th dim from the right
    int64_t da = k < a.size() ? a[a.size() - 1 - k] : 1, db = k < b.size() ? b[b.size() - 1 - k] : 1;
    LT_CHECK(da == db || da == 1 || db == 1, "[", op, "] shapes ", shape_str(a), " and ", shape_str(b),
             " do not broadcast: expected equal sizes or 1 in dim ", -int64_t(k) - 1, "; got ", da, " and ", db);
    out[n - 1 - k] = da == 1 ? db : da;
  }
  return out;
}

template <class T>
void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  using C = cpu_compute_t<T>;
  const T* pa = static_cast<const T*>(a.data());
  const T* pb = static_cast<const T*>(b.data());
  T* po = static_cast<T*>(out.data());
  int64_t n = out.numel();
  bool flat = a.shape() == out.shape() && b.shape() == out.shape() && a.is_contiguous() && b.is_contiguous();
  StridedIndex ai(a, out.shape()), bi(b, out.shape());
  elementwise::visit(op, [&](auto f) {
    for (int64_t i = 0; i < n; ++i) {
      C x = C(flat ? pa[i] : pa[ai.offset(i)]), y = C(flat ? pb[i] : pb[bi.offset(i)]);
      po[i] = T(f(x, y));
    }
  });
}

template <class T>
void unary_cpu(UnaryOp op, double scalar, const Tensor& out, const Tensor& x) {
  using C = cpu_compute_t<T>;
  const T* px = static_cast<const T*>(x.data());
  T* po = static_cast<T*>(out.data());
  int64_t n = out.numel();
  bool flat = x.is_contiguous();
  StridedIndex xi(x);
  elementwise::visit<C>(op, scalar, [&](auto f) {
    for (int64_t i = 0; i < n; ++i) po[i] = T(f(C(flat ? px[i] : px[xi.offset(i)])));
  });
}

// a (op) b, broadcast, into a new contiguous tensor; not recorded.
Tensor binary_raw(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  LT_CHECK(a.dtype() == b.dtype(), "[", name, "] expected operands of one dtype; got ", dtype_name(a.dtype()),
           " and ", dtype_name(b.dtype()));
  LT_CHECK(a.device() == b.device(), "[", name, "] expected operands on one device; got ", a.device().name(),
           " and ", b.device().name());
  check_float(a, name);
  Tensor out = empty(broadcast_shape(a.shape(), b.shape(), name), a.dtype(), a.device());
  if (out.numel() == 0) return out;
#if LINTAPE_WITH_CUDA
  if (out.is_cuda()) {
    elementwise::binary_cuda(op, out, a, b);
    return out;
  }
#endif
  LT_DISPATCH_FLOAT(a.dtype(), name, T, { binary_cpu<T>(op, out, a, b); });
  return out;
}

// op(x) into a new contiguous tensor; not recorded.
Tensor unary_raw(UnaryOp op, const char* name, const Tensor& x, double scalar = 0.0) {
  check_float(x, name);
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  if (out.numel() == 0) return out;
#if LINTAPE_WITH_CUDA
  if (out.is_cuda()) {
    elementwise::unary_cuda(op, scalar, out, x);
    return out;
  }
#endif
  LT_DISPATCH_FLOAT(x.dtype(), name, T, { unary_cpu<T>(op, scalar, out, x); });
  return out;
}

// An activation whose backward is one pass of `backward_op` over (saved, dy); saved is the output
// when the derivative is cheaper from it (exp, sqrt, rsqrt, tanh, sigmoid), else the input.
Tensor activation(UnaryOp op, BinaryOp backward_op, bool save_output, const char* name, const Tensor& x) {
  Tensor y = unary_raw(op, name, x);
  if (autograd::needs_grad({x})) {
    Tensor saved = (save_output ? y : x).detach();
    record(name, {x}, {y}, [saved, backward_op, name](const Grads& g) -> Grads {
      return {binary_raw(backward_op, name, saved, g[0])};
    });
  }
  return y;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Add, "add", a, b);
  bool ga = a.requires_grad(), gb = b.requires_grad();
  Shape sa = a.shape(), sb = b.shape();
  record("add", {a, b}, {out}, [=](const Grads& g) -> Grads {
    return {ga ? sum_to_shape(g[0], sa) : Tensor(), gb ? sum_to_shape(g[0], sb) : Tensor()};
  });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Sub, "sub", a, b);
  bool ga = a.requires_grad(), gb = b.requires_grad();
  Shape sa = a.shape(), sb = b.shape();
  record("sub", {a, b}, {out}, [=](const Grads& g) -> Grads {
    return {ga ? sum_to_shape(g[0], sa) : Tensor(), gb ? neg(sum_to_shape(g[0], sb)) : Tensor()};
  });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Mul, "mul", a, b);
  if (autograd::needs_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    Tensor ad = gb ? a.detach() : Tensor(), bd = ga ? b.detach() : Tensor();
    Shape sa = a.shape(), sb = b.shape();
    record("mul", {a, b}, {out}, [=](const Grads& g) -> Grads {
      return {ga ? sum_to_shape(mul(g[0], bd), sa) : Tensor(), gb ? sum_to_shape(mul(g[0], ad), sb) : Tensor()};
    });
  }
  return out;
}

// d(a/b)/db = -a/b^2 = -out/b: saves the output rather than a.
Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Div, "div", a, b);
  if (autograd::needs_grad({a, b})) {
    bool ga = a.requires_grad(), gb = b.requires_grad();
    Tensor bd = b.detach(), od = gb ? out.detach() : Tensor();
    Shape sa = a.shape(), sb = b.shape();
    record("div", {a, b}, {out}, [=](const Grads& g) -> Grads {
      return {ga ? sum_to_shape(div(g[0], bd), sa) : Tensor(),
              gb ? neg(sum_to_shape(div(mul(g[0], od), bd), sb)) : Tensor()};
    });
  }
  return out;
}

Tensor add(const Tensor& a, double s) {
  Tensor out = unary_raw(UnaryOp::AddScalar, "add", a, s);
  record("add", {a}, {out}, [](const Grads& g) -> Grads { return {g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double s) {
  Tensor out = unary_raw(UnaryOp::MulScalar, "mul", a, s);
  record("mul", {a}, {out}, [s](const Grads& g) -> Grads { return {mul(g[0], s)}; });
  return out;
}

Tensor neg(const Tensor& x) {
  Tensor out = unary_raw(UnaryOp::Neg, "neg", x);
  record("neg", {x}, {out}, [](const Grads& g) -> Grads { return {neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& x) { return activation(UnaryOp::Exp, BinaryOp::ExpBackward, true, "exp", x); }
Tensor log(const Tensor& x) { return activation(UnaryOp::Log, BinaryOp::LogBackward, false, "log", x); }
Tensor sqrt(const Tensor& x) { return activation(UnaryOp::Sqrt, BinaryOp::SqrtBackward, true, "sqrt", x); }
Tensor rsqrt(const Tensor& x) { return activation(UnaryOp::Rsqrt, BinaryOp::RsqrtBackward, true, "rsqrt", x); }
Tensor tanh(const Tensor& x) { return activation(UnaryOp::Tanh, BinaryOp::TanhBackward, true, "tanh", x); }
Tensor cos(const Tensor& x) { return activation(UnaryOp::Cos, BinaryOp::CosBackward, false, "cos", x); }
Tensor sin(const Tensor& x) { return activation(UnaryOp::Sin, BinaryOp::SinBackward, false, "sin", x); }
Tensor relu(const Tensor& x) { return activation(UnaryOp::Relu, BinaryOp::ReluBackward, false, "relu", x); }
Tensor sigmoid(const Tensor& x) {
  return activation(UnaryOp::Sigmoid, BinaryOp::SigmoidBackward, true, "sigmoid", x);
}
Tensor silu(const Tensor& x) { return activation(UnaryOp::Silu, BinaryOp::SiluBackward, false, "silu", x); }
Tensor gelu(const Tensor& x) { return activation(UnaryOp::Gelu, BinaryOp::GeluBackward, false, "gelu", x); }

namespace {
// The CPU SwiGLU, one row at a time: out = silu(g) u, or (dy given) du = dy silu(g), dg = silu'(g) dy u,
// and out = silu(g) u into `recomputed` when it is given.
template <class T>
void swiglu_cpu(const T* h, const T* dy, T* out, T* recomputed, int64_t rows, int64_t F) {
  using C = cpu_compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T *u = h + r * 2 * F, *g = u + F;
    for (int64_t j = 0; j < F; ++j) {
      const C uj = C(u[j]), gj = C(g[j]);
      if (!dy) {
        out[r * F + j] = T(elementwise::Silu{}(gj) * uj);
      } else {
        const C d = C(dy[r * F + j]);
        out[r * 2 * F + j] = T(d * elementwise::Silu{}(gj));
        out[r * 2 * F + F + j] = T(elementwise::SiluBackward{}(gj, d * uj));
        if (recomputed) recomputed[r * F + j] = T(elementwise::Silu{}(gj) * uj);
      }
    }
  }
}

// out = swiglu(h) (h contiguous (rows, 2F), out (rows, F)).
void swiglu_forward(const Tensor& h, const Tensor& out, int64_t rows, int64_t F) {
  if (out.numel() == 0) return;
#if LINTAPE_WITH_CUDA
  if (h.is_cuda()) return elementwise::swiglu_forward_cuda(h, out);
#endif
  LT_DISPATCH_FLOAT(h.dtype(), "swiglu", T,
                    { swiglu_cpu<T>(h.data_ptr<T>(), nullptr, out.data_ptr<T>(), nullptr, rows, F); });
}

// dh (rows, 2F) from h and dy (rows, F); the forward's output into `recomputed` when it is defined.
void swiglu_backward(const Tensor& h, const Tensor& dy, const Tensor& dh, const Tensor& recomputed, int64_t rows,
                     int64_t F) {
  if (dh.numel() == 0) return;
#if LINTAPE_WITH_CUDA
  if (dh.is_cuda()) return elementwise::swiglu_backward_cuda(h, dy, dh, recomputed);
#endif
  LT_DISPATCH_FLOAT(dh.dtype(), "swiglu", T, {
    swiglu_cpu<T>(h.data_ptr<T>(), dy.data_ptr<T>(), dh.data_ptr<T>(),
                  recomputed.defined() ? recomputed.data_ptr<T>() : nullptr, rows, F);
  });
}

// swiglu_linear's dh and s in one CUDA kernel, ds = dy w never stored (ops/mlp_gemm.cu), where it runs and
// LINTAPE_MLP_FUSED=1. Off by default: at the model's shape it is still slower than cuBLASLt's product and the
// SwiGLU backward apart (bench/notes/mlp-gemm.md).
bool swiglu_grad_fused(const Tensor& dy, const Tensor& w, const Tensor& h, const Tensor& dh, const Tensor& s) {
#if LINTAPE_WITH_CUDA
  static const bool enabled = [] {
    const char* v = std::getenv("LINTAPE_MLP_FUSED");
    return v && std::string(v) == "1";
  }();
  return enabled && dh.is_cuda() && elementwise::swiglu_grad_product_cuda(dy, w, h, dh, s);
#else
  (void)dy, (void)w, (void)h, (void)dh, (void)s;
  return false;
#endif
}

int64_t swiglu_width(const Tensor& h, const char* op) {
  check_float(h, op);
  LT_CHECK(h.dim() >= 1 && h.size(-1) % 2 == 0, "[", op, "] h must be (..., 2F) with an even last dim; got ",
           shape_str(h.shape()));
  return h.size(-1) / 2;
}
}  // namespace

Tensor swiglu(const Tensor& h) {
  const int64_t F = swiglu_width(h, "swiglu"), rows = F == 0 ? 0 : h.numel() / (2 * F);
  Shape out_shape = h.shape();
  out_shape.back() = F;
  Tensor hc = h.detach().contiguous(), out = empty(out_shape, h.dtype(), h.device());
  swiglu_forward(hc, out, rows, F);
  if (autograd::needs_grad({h})) {
    record("swiglu", {h}, {out}, [hc, rows, F](const Grads& g) -> Grads {
      Tensor dh = empty(hc.shape(), hc.dtype(), hc.device());
      swiglu_backward(hc, g[0].detach().contiguous(), dh, Tensor(), rows, F);
      return {dh};
    });
  }
  return out;
}

Tensor swiglu_linear(const Tensor& h, const Tensor& w) {
  const int64_t F = swiglu_width(h, "swiglu_linear"), rows = F == 0 ? 0 : h.numel() / (2 * F);
  LT_CHECK(w.dim() == 2 && w.size(1) == F, "[swiglu_linear] w must be (C, F) with F = ", F, " (half of h's last dim ",
           2 * F, "); got ", shape_str(w.shape()));
  LT_CHECK(w.dtype() == h.dtype() && w.device() == h.device(), "[swiglu_linear] w must have h's dtype and device (",
           dtype_name(h.dtype()), " on ", h.device().name(), "); got ", dtype_name(w.dtype()), " on ",
           w.device().name());
  const int64_t C = w.size(0);
  Shape out_shape = h.shape();
  out_shape.back() = C;
  Tensor hc = h.detach().contiguous(), wd = w.detach(), y = empty(out_shape, h.dtype(), h.device());
  {
    Tensor s = empty({rows, F}, h.dtype(), h.device());  // freed on return: the backward makes it again
    swiglu_forward(hc, s, rows, F);
    matmul_out(s, wd, y.view({rows, C}), false, true);
  }
  if (autograd::needs_grad({h, w})) {
    const bool need_w = autograd::needs_grad({w});
    record("swiglu_linear", {h, w}, {y}, [hc, wd, rows, F, C, need_w](const Grads& g) -> Grads {
      Tensor dy = g[0].detach().contiguous().view({rows, C});
      Tensor dh = empty(hc.shape(), hc.dtype(), hc.device());
      Tensor s = need_w ? empty({rows, F}, hc.dtype(), hc.device()) : Tensor(), dw;
      if (!swiglu_grad_fused(dy, wd, hc.view({rows, 2 * F}), dh.view({rows, 2 * F}), s)) {
        Tensor ds = empty({rows, F}, hc.dtype(), hc.device());
        matmul_out(dy, wd, ds, false, false);
        swiglu_backward(hc, ds, dh, s, rows, F);
      }
      if (need_w) {
        dw = empty(wd.shape(), wd.dtype(), wd.device());
        matmul_out(dy, s, dw, true, false);
      }
      return {dh, dw};
    });
  }
  return y;
}

Tensor sum_to_shape(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  int64_t lead = grad.dim() - int64_t(shape.size());
  LT_CHECK(lead >= 0, "[sum_to_shape] expected a shape that broadcasts to ", shape_str(grad.shape()), "; got ",
           shape_str(shape));
  std::vector<int64_t> dims;  // the leading dims, and those where shape has 1 and grad more
  for (int64_t d = 0; d < grad.dim(); ++d) {
    int64_t want = d < lead ? 1 : shape[size_t(d - lead)], have = grad.shape()[size_t(d)];
    LT_CHECK(want == have || want == 1, "[sum_to_shape] expected a shape that broadcasts to ",
             shape_str(grad.shape()), "; got ", shape_str(shape));
    if (d < lead || want != have) dims.push_back(d);
  }
  Tensor s = sum(grad, dims, /*keepdim=*/true);
  return lead > 0 ? s.reshape(shape) : s;
}

}  // namespace lintape
