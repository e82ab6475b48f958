#include "ops/matmul.h"
#include <Eigen/Core>
#include "autograd/tape.h"
#include "ops/matmul_cuda.h"

namespace lintape {
using autograd::Grads;

namespace {

// A GEMM operand: contiguous storage, read as stored or transposed.
struct Operand {
  Tensor t;
  bool trans;
};

// The sizes of one product; a 2-D operand facing a batched one is shared by every batch.
struct Dims {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool shared_a = false, shared_b = false;
  Shape out;
};

// A plain transpose of the last two dims is folded into the flag; any other layout is copied.
Operand operand(const Tensor& x, bool trans) {
  if (x.is_contiguous()) return {x.detach(), trans};
  Tensor xt = x.detach().transpose(-2, -1);
  if (xt.is_contiguous()) return {xt, !trans};
  return {x.detach().contiguous(), trans};
}

std::string desc(const char* name, const Tensor& x) { return str(name, " ", shape_str(x.shape())); }

// The public rules: float dtypes, same dtype and device, rank >= 2, equal batch dims or b 2-D.
void check_inputs(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  LT_CHECK(a.dim() >= 2 && b.dim() >= 2, "[matmul] a and b must have at least 2 dims; got ", desc("a", a), " and ",
           desc("b", b));
  LT_CHECK(a.dtype() == b.dtype(), "[matmul] a and b must have the same dtype; got ", desc("a", a), " ",
           dtype_name(a.dtype()), " and ", desc("b", b), " ", dtype_name(b.dtype()));
  LT_CHECK(is_floating(a.dtype()), "[matmul] expected float tensors (f32, f64, bf16, f16); got ", desc("a", a), " and ",
           desc("b", b), " of ", dtype_name(a.dtype()));
  LT_CHECK(a.device() == b.device(), "[matmul] a and b must be on the same device; got ", desc("a", a), " on ",
           a.device().name(), " and ", desc("b", b), " on ", b.device().name());
  bool same_batch = a.dim() == b.dim() && std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin());
  LT_CHECK(same_batch || b.dim() == 2, "[matmul] batch dims must be equal, or b 2-D (shared by every batch); got ",
           desc("a", a), " and ", desc("b", b));
  int64_t ka = a.size(ta ? -2 : -1), kb = b.size(tb ? -1 : -2);
  LT_CHECK(ka == kb, "[matmul] inner dims differ: ", desc("a", a), " with transpose_a = ", ta, " has K = ", ka, ", ",
           desc("b", b), " with transpose_b = ", tb, " has K = ", kb);
}

// Sizes of op(a) @ op(b) for inputs already checked; either operand may be the shared 2-D one.
Dims dims_of(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  Dims d;
  d.m = a.size(ta ? -1 : -2);
  d.k = a.size(ta ? -2 : -1);
  d.n = b.size(tb ? -2 : -1);
  d.shared_a = a.dim() == 2 && b.dim() > 2;
  d.shared_b = b.dim() == 2 && a.dim() > 2;
  const Tensor& batched = d.shared_a ? b : a;
  d.out = Shape(batched.shape().begin(), batched.shape().end() - 2);
  d.batch = shape_numel(d.out);
  d.out.push_back(d.m);
  d.out.push_back(d.n);
  return d;
}

// c = op(a) op(b), or c += it with accumulate.
void gemm_eigen(const double* a, const double* b, double* c, const Dims& d, bool ta, bool tb, bool accumulate) {
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  int64_t sa = d.shared_a ? 0 : d.m * d.k, sb = d.shared_b ? 0 : d.k * d.n;
  for (int64_t i = 0; i < d.batch; ++i) {
    Eigen::Map<const Mat> A(a + i * sa, ta ? d.k : d.m, ta ? d.m : d.k);
    Eigen::Map<const Mat> B(b + i * sb, tb ? d.n : d.k, tb ? d.k : d.n);
    Eigen::Map<Mat> C(c + i * d.m * d.n, d.m, d.n);
    auto store = [&](const auto& product) {
      if (accumulate)
        C.noalias() += product;
      else
        C.noalias() = product;
    };
    if (ta && tb)
      store(A.transpose() * B.transpose());
    else if (ta)
      store(A.transpose() * B);
    else if (tb)
      store(A * B.transpose());
    else
      store(A * B);
  }
}

// c (contiguous, shape d.out) = op(a) @ op(b), or += with accumulate.
void gemm(const Operand& a, const Operand& b, Tensor c, const Dims& d, int rank, bool accumulate = false) {
  if (c.numel() == 0) return;
#if LINTAPE_WITH_CUDA
  if (c.is_cuda())
    return ops_cuda::gemm_cuda(a.t, b.t, c, d.batch, d.m, d.n, d.k, a.trans, b.trans, rank, accumulate);
#endif
  LT_CHECK(rank == 0, "[matmul] the CPU has one algorithm; heuristic_rank must be 0, got ", rank);
  if (a.t.dtype() == DType::F64) {
    gemm_eigen(a.t.data_ptr<double>(), b.t.data_ptr<double>(), c.data_ptr<double>(), d, a.trans, b.trans, accumulate);
    return;
  }
  // f32, bf16, f16: through f64 copies, as every CPU path accumulates. Eigen's f32 product (no FMA in a
  // generic x86-64 build) rounds about twice as much as a tuned BLAS, and the language model's gradient
  // carries that rounding into training (docs/BENCHMARKS.md, "Correctness against PyTorch").
  Tensor a64 = a.t.to(DType::F64), b64 = b.t.to(DType::F64);
  Tensor c64 = accumulate ? c.to(DType::F64) : empty(c.shape(), DType::F64);
  gemm_eigen(a64.data_ptr<double>(), b64.data_ptr<double>(), c64.data_ptr<double>(), d, a.trans, b.trans, accumulate);
  c.copy_(c64);
}

// op(a) @ op(b) without autograd; either operand may be 2-D and shared (backward needs a shared a).
Tensor product(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  Dims d = dims_of(a, b, ta, tb);
  Tensor c = empty(d.out, a.dtype(), a.device());
  gemm(operand(a, ta), operand(b, tb), c, d, 0);
  return c;
}

// db for a b shared by every batch: sum_i op(a_i)^T dc_i (or its transpose) as one GEMM over the rows
// of all batches. A transposed a is copied to (..., M, K) first so that the batches stack.
Tensor shared_b_grad(const Tensor& a, const Tensor& dc, bool ta, bool tb) {
  Tensor at = (ta ? a.transpose(-2, -1) : a).detach().contiguous();
  Tensor af = at.view({-1, at.size(-1)});
  Tensor dcf = dc.detach().contiguous().view({-1, dc.size(-1)});
  return tb ? product(dcf, af, true, false) : product(af, dcf, true, false);
}

// The sizes of op(a) @ op(b) written into c: c must be contiguous, of the product's shape and device, and of
// a's dtype (or f32 for 16-bit inputs, when allowed).
Dims checked_output(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb, bool f32_for_16_bit) {
  check_inputs(a, b, ta, tb);
  Dims d = dims_of(a, b, ta, tb);
  const bool wide = f32_for_16_bit && is_float16(a.dtype());
  LT_CHECK(c.shape() == d.out && (c.dtype() == a.dtype() || (wide && c.dtype() == DType::F32)) &&
               c.device() == a.device() && c.is_contiguous(),
           "[matmul] the output must be a contiguous ", shape_str(d.out), " tensor of ", dtype_name(a.dtype()),
           wide ? " (or f32)" : "", " on ", a.device().name(), "; got ", shape_str(c.shape()), " ",
           dtype_name(c.dtype()), " on ", c.device().name(), c.is_contiguous() ? "" : " (not contiguous)");
  return d;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  check_inputs(a, b, ta, tb);
  Tensor c = product(a, b, ta, tb);
  if (autograd::needs_grad({a, b})) {
    Tensor as = a.detach(), bs = b.detach();
    bool need_a = a.requires_grad(), need_b = b.requires_grad();
    bool shared_b = b.dim() == 2 && a.dim() > 2;
    // With A = op(a), B = op(b): dA = dC B^T, dB = A^T dC; a transposed operand takes the transpose.
    autograd::record("matmul", {a, b}, {c}, [=](const Grads& g) -> Grads {
      const Tensor& dc = g[0];
      Tensor da, db;
      if (need_a) da = ta ? product(bs, dc, tb, true) : product(dc, bs, false, !tb);
      if (need_b) {
        if (shared_b)
          db = shared_b_grad(as, dc, ta, tb);
        else
          db = tb ? product(dc, as, true, ta) : product(as, dc, !ta, false);
      }
      return {da, db};
    });
  }
  return c;
}

void matmul_out(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb, bool accumulate) {
  const Dims d = checked_output(a, b, c, ta, tb, /*f32_for_16_bit=*/true);
  c.storage().version++;
  gemm(operand(a, ta), operand(b, tb), c, d, 0, accumulate);
}

#if LINTAPE_WITH_CUDA
int matmul_heuristic_count(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  check_inputs(a, b, ta, tb);
  LT_CHECK(a.is_cuda(), "[matmul] matmul_heuristic_count needs CUDA tensors; got a on ", a.device().name());
  Dims d = dims_of(a, b, ta, tb);
  Operand oa = operand(a, ta), ob = operand(b, tb);
  return ops_cuda::gemm_cuda_heuristic_count(oa.t, ob.t, d.batch, d.m, d.n, d.k, oa.trans, ob.trans);
}

void matmul_into(const Tensor& a, const Tensor& b, Tensor& c, bool ta, bool tb, int heuristic_rank) {
  const Dims d = checked_output(a, b, c, ta, tb, /*f32_for_16_bit=*/false);
  c.storage().version++;
  gemm(operand(a, ta), operand(b, tb), c, d, heuristic_rank);
}
#endif

}  // namespace lintape
