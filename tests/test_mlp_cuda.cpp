// swiglu_linear's fused CUDA gradient (ops/mlp_gemm.cu): dh and s on poisoned outputs against an f64 CPU
// reference of the same math (ds = dy w rounded to the dtype first, as the kernel and the unfused path do), the
// same bits from two runs, no launch for a shape it does not take, and the tape's gradients.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "core/config.h"
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/elementwise_cuda.h"
#include "ops/matmul.h"

using namespace lintape;
using namespace lintape::test;

#if LINTAPE_WITH_CUDA
namespace {

struct MlpShape {
  int64_t rows, C, F;
};

// dy (rows, C), w (C, F) scaled by 1 / sqrt(C), h (rows, 2F): random, of dtype dt, on the GPU.
struct MlpInputs {
  Tensor dy, w, h;
};

MlpInputs mlp_inputs(const MlpShape& s, DType dt, uint64_t seed) {
  auto make = [&](const Shape& shape, uint64_t k, double scale) {
    std::vector<double> v = randn(shape, DType::F64, Device::cpu(), seed + k).to_vector<double>();
    for (double& x : v) x *= scale;
    return from_vector(v, shape, dt, gpu());
  };
  return {make({s.rows, s.C}, 0, 1.0), make({s.C, s.F}, 1, 1.0 / std::sqrt(double(s.C))),
          make({s.rows, 2 * s.F}, 2, 1.0)};
}

std::vector<double> round_to(const std::vector<double>& v, DType dt) {
  return from_vector(v, {int64_t(v.size())}, dt).to_vector<double>();
}

// The kernel's math in f64 on the given rows: ds = dy w rounded to dt, then du = ds silu(g),
// dg = ds u silu'(g) and s = silu(g) u, each rounded to dt; (rows.size(), F) each.
struct MlpRef {
  std::vector<double> du, dg, s;
};

MlpRef mlp_reference(const MlpInputs& in, const std::vector<int64_t>& rows, DType dt) {
  const int64_t C = in.w.size(0), F = in.w.size(1), n = int64_t(rows.size());
  const std::vector<double> dy = in.dy.to_vector<double>(), w = in.w.to_vector<double>(), h = in.h.to_vector<double>();
  std::vector<double> ds(size_t(n * F), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const double a = dy[size_t(rows[size_t(i)] * C + c)];
      for (int64_t j = 0; j < F; ++j) ds[size_t(i * F + j)] += a * w[size_t(c * F + j)];
    }
  ds = round_to(ds, dt);
  MlpRef ref{ds, ds, ds};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < F; ++j) {
      const size_t k = size_t(i * F + j);
      const double u = h[size_t(rows[size_t(i)] * 2 * F + j)], g = h[size_t(rows[size_t(i)] * 2 * F + F + j)];
      const double sig = 1.0 / (1.0 + std::exp(-g));
      ref.du[k] = ds[k] * g * sig;
      ref.dg[k] = ds[k] * u * sig * (1.0 + g * (1.0 - sig));
      ref.s[k] = g * sig * u;
    }
  return {round_to(ref.du, dt), round_to(ref.dg, dt), round_to(ref.s, dt)};
}

// Every row of the small shapes; every 7th (all residues of the 16-row fragments) and the last 48 of the large.
std::vector<int64_t> checked_rows(int64_t rows) {
  std::vector<int64_t> r;
  for (int64_t i = 0; i < rows; ++i)
    if (rows <= 1024 || i % 7 == 0 || i >= rows - 48) r.push_back(i);
  return r;
}

// out (all rows, row length ld) at column offset `off` against ref on the checked rows: |out - ref| <=
// tol (|ref| + rms(ref)), tol two units of the dtype's last place (a flipped rounding of ds, then the output's).
void check_part(const char* name, const std::vector<double>& out, int64_t ld, int64_t off,
                const std::vector<int64_t>& rows, const std::vector<double>& ref, int64_t F, DType dt) {
  double ss = 0;
  for (double v : ref) ss += v * v;
  const double scale = std::sqrt(ss / double(ref.size())), tol = dt == DType::BF16 ? 0x1p-6 : 0x1p-9;
  int64_t bad = 0, bad_row = -1, bad_col = -1;
  double bad_out = 0, bad_ref = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t j = 0; j < F; ++j) {
      const double o = out[size_t(rows[i] * ld + off + j)], r = ref[i * size_t(F) + size_t(j)];
      if (std::fabs(o - r) <= tol * (std::fabs(r) + scale)) continue;
      if (bad++ == 0) bad_row = rows[i], bad_col = j, bad_out = o, bad_ref = r;
    }
  INFO("output " << name << ": " << bad << " elements off; the first at row " << bad_row << ", column " << bad_col
                  << ": " << bad_out << " vs " << bad_ref << " (rms " << scale << ")");
  CHECK(bad == 0);
}

int64_t non_finite(const std::vector<double>& v) {
  int64_t n = 0;
  for (double x : v) n += std::isfinite(x) ? 0 : 1;
  return n;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.to(Device::cpu()), cb = b.to(Device::cpu());
  return ca.nbytes() == cb.nbytes() && std::memcmp(ca.data(), cb.data(), ca.nbytes()) == 0;
}

}  // namespace
#endif

TEST_CASE("cuda swiglu_linear fused gradient" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  using elementwise::swiglu_grad_product_cuda;
  {  // F % 128 != 0: not taken, nothing written
    const MlpInputs in = mlp_inputs({8, 64, 192}, DType::BF16, 1);
    Tensor dh = empty({8, 384}, DType::BF16, gpu());
    poison_(dh);
    CHECK_FALSE(swiglu_grad_product_cuda(in.dy, in.w, in.h, dh, Tensor()));
    CHECK(non_finite(dh.to_vector<double>()) == 8 * 384);
  }
  const MlpShape shapes[] = {{300, 128, 256}, {1, 64, 128}, {4096 + 37, 768, 2048}, {257, 192, 384}};
  for (DType dt : {DType::BF16, DType::F16})
    for (const MlpShape& sh : shapes) {
      INFO("dtype " << dtype_name(dt) << ", rows " << sh.rows << ", C " << sh.C << ", F " << sh.F);
      const MlpInputs in = mlp_inputs(sh, dt, 40);
      Tensor dh = empty({sh.rows, 2 * sh.F}, dt, gpu()), s = empty({sh.rows, sh.F}, dt, gpu());
      poison_(dh);
      poison_(s);
      if (!swiglu_grad_product_cuda(in.dy, in.w, in.h, dh, s)) {
        std::cout << "SKIPPED: the fused kernel needs an sm_90a build on a compute capability 9.0 device" << std::endl;
        return;
      }
      const std::vector<double> dhv = dh.to_vector<double>(), sv = s.to_vector<double>();
      CHECK(non_finite(dhv) == 0);
      CHECK(non_finite(sv) == 0);
      const std::vector<int64_t> rows = checked_rows(sh.rows);
      const MlpRef ref = mlp_reference(in, rows, dt);
      check_part("du", dhv, 2 * sh.F, 0, rows, ref.du, sh.F, dt);
      check_part("dg", dhv, 2 * sh.F, sh.F, rows, ref.dg, sh.F, dt);
      check_part("s", sv, sh.F, 0, rows, ref.s, sh.F, dt);
      // The same bits again, and without s the same dh.
      Tensor dh2 = empty({sh.rows, 2 * sh.F}, dt, gpu()), s2 = empty({sh.rows, sh.F}, dt, gpu());
      REQUIRE(swiglu_grad_product_cuda(in.dy, in.w, in.h, dh2, s2));
      CHECK(same_bits(dh, dh2));
      CHECK(same_bits(s, s2));
      REQUIRE(swiglu_grad_product_cuda(in.dy, in.w, in.h, dh2, Tensor()));
      CHECK(same_bits(dh, dh2));
    }
#endif
}

TEST_CASE("cuda swiglu_linear gradients through the tape with the fused kernel" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const MlpShape sh{257, 192, 384};
  for (DType dt : {DType::BF16, DType::F16}) {
    INFO("dtype " << dtype_name(dt));
    const MlpInputs in = mlp_inputs(sh, dt, 60);
    Tensor h = in.h.detach().clone().requires_grad_(), w = in.w.detach().clone().requires_grad_();
    backward(swiglu_linear(h, w), in.dy);
    const std::vector<int64_t> rows = checked_rows(sh.rows);
    const MlpRef ref = mlp_reference(in, rows, dt);
    const std::vector<double> dhv = h.grad().to_vector<double>();
    check_part("du", dhv, 2 * sh.F, 0, rows, ref.du, sh.F, dt);
    check_part("dg", dhv, 2 * sh.F, sh.F, rows, ref.dg, sh.F, dt);
    // dw = dy^T s with the reference's s (rounded to dt)
    const Tensor dy64 = in.dy.to(Device::cpu()).to(DType::F64);
    const Tensor s64 = from_vector(ref.s, {sh.rows, sh.F}, DType::F64);
    CHECK_CLOSE_TENSOR(w.grad().to(Device::cpu()).to(DType::F64), matmul(dy64, s64, true, false), dt);
    // With the kernel in use (LINTAPE_MLP_FUSED=1), the tape's dh is the kernel's, bit for bit.
    const char* env = std::getenv("LINTAPE_MLP_FUSED");
    Tensor dh = empty({sh.rows, 2 * sh.F}, dt, gpu());
    if (env && std::string(env) == "1" &&
        elementwise::swiglu_grad_product_cuda(in.dy, in.w, in.h, dh, Tensor()))
      CHECK(same_bits(h.grad(), dh));
  }
#endif
}
