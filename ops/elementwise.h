// Elementwise ops, CPU and CUDA, all recorded by autograd.
// Binary ops broadcast like numpy (trailing dims aligned; a dim of size 1 stretches) and need equal
// dtypes and devices; a scalar operand takes the tensor's dtype. CUDA computes in f32 (f64 for f64).
#pragma once
#include "../core/tensor.h"

namespace lintape {

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor silu(const Tensor& x);
Tensor gelu(const Tensor& x);  // tanh approximation

// SwiGLU in one pass: h (..., 2F) holds [u, gate] along the last dim; out (..., F) = silu(gate) * u.
// Saves h; the backward writes dh = [dy silu(gate), dy u silu'(gate)] in one pass (no views, no zeros).
Tensor swiglu(const Tensor& h);
// swiglu(h) @ w^T for w (C, F), without holding swiglu(h) between forward and backward: saves h and w,
// and the backward's SwiGLU kernel writes swiglu(h) again beside dh (one extra (..., F) write) for dw.
Tensor swiglu_linear(const Tensor& h, const Tensor& w);

// Sums `grad` over the dims that broadcasting stretched, back to `shape` (used by binary backward).
Tensor sum_to_shape(const Tensor& grad, const Shape& shape);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return add(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return mul(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return mul(a, 1.0 / s); }

}  // namespace lintape
