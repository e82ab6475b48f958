// Internal to ops/elementwise*. The per-element math lives here once, as small functors that the CPU
// loops (elementwise.cpp) and the CUDA kernels (elementwise.cu) both instantiate, so the two devices
// compute the same formulas; below them, the CUDA launchers.
#pragma once
#include <cmath>
#include "core/strided.h"
#include "core/tensor.h"

namespace lintape::elementwise {

enum class UnaryOp { Neg, Exp, Log, Sqrt, Rsqrt, Tanh, Cos, Sin, Relu, Sigmoid, Silu, Gelu, AddScalar, MulScalar };

// Two operands, broadcast against each other: the arithmetic ops, and the activations' backward rules,
// each one pass over (a = the saved input or output of the forward, b = dy).
enum class BinaryOp {
  Add, Sub, Mul, Div,
  ExpBackward, LogBackward, SqrtBackward, RsqrtBackward, TanhBackward, CosBackward, SinBackward,
  ReluBackward, SigmoidBackward, SiluBackward, GeluBackward,
};

// C is the compute type: float for the 16- and 32-bit floats, double for double.
struct Neg { template <class C> LT_HD C operator()(C x) const { return -x; } };
struct Exp { template <class C> LT_HD C operator()(C x) const { return std::exp(x); } };
struct Log { template <class C> LT_HD C operator()(C x) const { return std::log(x); } };
struct Sqrt { template <class C> LT_HD C operator()(C x) const { return std::sqrt(x); } };
struct Rsqrt { template <class C> LT_HD C operator()(C x) const { return C(1) / std::sqrt(x); } };
struct Tanh { template <class C> LT_HD C operator()(C x) const { return std::tanh(x); } };
struct Cos { template <class C> LT_HD C operator()(C x) const { return std::cos(x); } };
struct Sin { template <class C> LT_HD C operator()(C x) const { return std::sin(x); } };
struct Relu { template <class C> LT_HD C operator()(C x) const { return x < C(0) ? C(0) : x; } };
struct Sigmoid { template <class C> LT_HD C operator()(C x) const { return C(1) / (C(1) + std::exp(-x)); } };
struct Silu { template <class C> LT_HD C operator()(C x) const { return x / (C(1) + std::exp(-x)); } };
// gelu(x) = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
struct Gelu {
  template <class C> LT_HD C operator()(C x) const {
    C u = C(0.7978845608028654) * (x + C(0.044715) * x * x * x);
    return C(0.5) * x * (C(1) + std::tanh(u));
  }
};
template <class C> struct AddScalar { C s; LT_HD C operator()(C x) const { return x + s; } };
template <class C> struct MulScalar { C s; LT_HD C operator()(C x) const { return x * s; } };

struct Add { template <class C> LT_HD C operator()(C a, C b) const { return a + b; } };
struct Sub { template <class C> LT_HD C operator()(C a, C b) const { return a - b; } };
struct Mul { template <class C> LT_HD C operator()(C a, C b) const { return a * b; } };
struct Div { template <class C> LT_HD C operator()(C a, C b) const { return a / b; } };

// Backward rules: y is the saved output, x the saved input.
struct ExpBackward { template <class C> LT_HD C operator()(C y, C dy) const { return dy * y; } };
struct LogBackward { template <class C> LT_HD C operator()(C x, C dy) const { return dy / x; } };
struct SqrtBackward { template <class C> LT_HD C operator()(C y, C dy) const { return C(0.5) * dy / y; } };
struct RsqrtBackward { template <class C> LT_HD C operator()(C y, C dy) const { return C(-0.5) * dy * y * y * y; } };
struct TanhBackward { template <class C> LT_HD C operator()(C y, C dy) const { return dy * (C(1) - y * y); } };
struct CosBackward { template <class C> LT_HD C operator()(C x, C dy) const { return -dy * std::sin(x); } };
struct SinBackward { template <class C> LT_HD C operator()(C x, C dy) const { return dy * std::cos(x); } };
struct ReluBackward { template <class C> LT_HD C operator()(C x, C dy) const { return x > C(0) ? dy : C(0); } };
struct SigmoidBackward { template <class C> LT_HD C operator()(C y, C dy) const { return dy * y * (C(1) - y); } };
struct SiluBackward {
  template <class C> LT_HD C operator()(C x, C dy) const {
    C s = C(1) / (C(1) + std::exp(-x));
    return dy * s * (C(1) + x * (C(1) - s));
  }
};
struct GeluBackward {
  template <class C> LT_HD C operator()(C x, C dy) const {
    C t = std::tanh(C(0.7978845608028654) * (x + C(0.044715) * x * x * x));
    C du = C(0.7978845608028654) * (C(1) + C(3 * 0.044715) * x * x);
    return dy * (C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * du);
  }
};

// Calls fn with the functor of op (computing in C); the one map from op to math for both devices.
template <class C, class Fn>
void visit(UnaryOp op, double scalar, Fn&& fn) {
  switch (op) {
    case UnaryOp::Neg: return fn(Neg{});
    case UnaryOp::Exp: return fn(Exp{});
    case UnaryOp::Log: return fn(Log{});
    case UnaryOp::Sqrt: return fn(Sqrt{});
    case UnaryOp::Rsqrt: return fn(Rsqrt{});
    case UnaryOp::Tanh: return fn(Tanh{});
    case UnaryOp::Cos: return fn(Cos{});
    case UnaryOp::Sin: return fn(Sin{});
    case UnaryOp::Relu: return fn(Relu{});
    case UnaryOp::Sigmoid: return fn(Sigmoid{});
    case UnaryOp::Silu: return fn(Silu{});
    case UnaryOp::Gelu: return fn(Gelu{});
    case UnaryOp::AddScalar: return fn(AddScalar<C>{C(scalar)});
    case UnaryOp::MulScalar: return fn(MulScalar<C>{C(scalar)});
  }
}

template <class Fn>
void visit(BinaryOp op, Fn&& fn) {
  switch (op) {
    case BinaryOp::Add: return fn(Add{});
    case BinaryOp::Sub: return fn(Sub{});
    case BinaryOp::Mul: return fn(Mul{});
    case BinaryOp::Div: return fn(Div{});
    case BinaryOp::ExpBackward: return fn(ExpBackward{});
    case BinaryOp::LogBackward: return fn(LogBackward{});
    case BinaryOp::SqrtBackward: return fn(SqrtBackward{});
    case BinaryOp::RsqrtBackward: return fn(RsqrtBackward{});
    case BinaryOp::TanhBackward: return fn(TanhBackward{});
    case BinaryOp::CosBackward: return fn(CosBackward{});
    case BinaryOp::SinBackward: return fn(SinBackward{});
    case BinaryOp::ReluBackward: return fn(ReluBackward{});
    case BinaryOp::SigmoidBackward: return fn(SigmoidBackward{});
    case BinaryOp::SiluBackward: return fn(SiluBackward{});
    case BinaryOp::GeluBackward: return fn(GeluBackward{});
  }
}

#if LINTAPE_WITH_CUDA
// out: contiguous, of the broadcast shape; a and b: its dtype and device, any strides, broadcastable.
void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
// out: contiguous, x's shape, dtype and device; x: any strides.
void unary_cuda(UnaryOp op, double scalar, const Tensor& out, const Tensor& x);
// SwiGLU over rows: h (rows, 2F) contiguous, out (rows, F); backward dy (rows, F), dh (rows, 2F), all
// contiguous, one dtype.
void swiglu_forward_cuda(const Tensor& h, const Tensor& out);
// dh from h and dy; with `recomputed` defined, also the forward's output written there (swiglu_linear).
void swiglu_backward_cuda(const Tensor& h, const Tensor& dy, const Tensor& dh, const Tensor& recomputed = Tensor());
// swiglu_linear's backward in one kernel (ops/mlp_gemm.cu): dh = swiglu_backward(h, dy w) and, with s defined,
// s = swiglu(h), the product on the tensor cores and ds never stored. dy (rows, C), w (C, F), h and dh (rows, 2F),
// s (rows, F). False, with nothing written, unless: bf16 or f16, one dtype and CUDA device of compute capability
// 9.0 with sm_90a kernels built, all contiguous and 16-byte aligned, C % 64 == 0 and F % 128 == 0.
bool swiglu_grad_product_cuda(const Tensor& dy, const Tensor& w, const Tensor& h, const Tensor& dh, const Tensor& s);
#endif

}  // namespace lintape::elementwise
