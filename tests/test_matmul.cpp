#include <algorithm>
#include <cmath>
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#if LINTAPE_WITH_CUDA
#include "ops/matmul_cuda.h"
#endif

using namespace lintape;
using namespace lintape::test;

namespace {

// The stored shape of an operand whose op(x) is (rows, cols).
Shape stored(Shape batch, int64_t rows, int64_t cols, bool trans) {
  batch.push_back(trans ? cols : rows);
  batch.push_back(trans ? rows : cols);
  return batch;
}

// op(a) @ op(b) by plain loops in double; b may be 2-D and shared.
Tensor naive_matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  int64_t m = a.size(ta ? -1 : -2), k = a.size(ta ? -2 : -1), n = b.size(tb ? -2 : -1);
  Shape out(a.shape().begin(), a.shape().end() - 2);
  int64_t batch = shape_numel(out);
  out.push_back(m);
  out.push_back(n);
  std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>(), cv(size_t(batch * m * n));
  int64_t sb = b.dim() == 2 ? 0 : k * n;
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        double s = 0;
        for (int64_t j = 0; j < k; ++j) {
          double x = av[size_t(i * m * k + (ta ? j * m + r : r * k + j))];
          double y = bv[size_t(i * sb + (tb ? c * k + j : j * n + c))];
          s += x * y;
        }
        cv[size_t((i * m + r) * n + c)] = s;
      }
  return from_vector(cv, out, DType::F64);
}

struct Case {
  Shape batch_a, batch_b;
};
const Case kCases[] = {{{}, {}}, {{2, 3}, {2, 3}}, {{3}, {}}};  // 2-D, batched, shared b

}  // namespace

TEST_CASE("matmul cpu matches a naive product") {
  for (DType dt : {DType::F64, DType::F32, DType::BF16, DType::F16})
    for (const Case& cs : kCases)
      for (int t = 0; t < 4; ++t) {
        bool ta = t & 1, tb = t & 2;
        Tensor a = randn(stored(cs.batch_a, 5, 7, ta), dt, Device::cpu(), 1);
        Tensor b = randn(stored(cs.batch_b, 7, 6, tb), dt, Device::cpu(), 2);
        INFO(dtype_name(dt) << " a " << shape_str(a.shape()) << " b " << shape_str(b.shape()));
        CHECK_CLOSE_TENSOR(matmul(a, b, ta, tb), naive_matmul(a, b, ta, tb), dt);
      }
}

TEST_CASE("matmul cpu f32 rounds the exact product once") {
  // Same-signed terms over a long inner dim: an f32 accumulation drifts by several ulps.
  Tensor a = randn({16, 2048}, DType::F32, Device::cpu(), 5) + 2.0;
  Tensor b = randn({2048, 8}, DType::F32, Device::cpu(), 6) + 1.0;
  const std::vector<double> out = matmul(a, b).to_vector<double>();
  const std::vector<double> exact = naive_matmul(a, b, false, false).to_vector<double>();
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - exact[i]) / std::abs(exact[i]));
  CHECK(worst <= std::ldexp(1.0, -24));  // half an f32 ulp
}

TEST_CASE("matmul reads transposed views in place and copies other layouts") {
  Tensor x = randn({3, 6, 5}, DType::F64, Device::cpu(), 3);  // x^T (3, 5, 6) is a transposed view
  Tensor y = randn({3, 6, 9}, DType::F64, Device::cpu(), 4);
  Tensor y_slice = y.narrow(2, 1, 7);  // (3, 6, 7), neither contiguous nor a transpose
  Tensor xt = x.transpose(1, 2);
  Tensor ref = naive_matmul(xt.contiguous(), y_slice.contiguous(), false, false);
  CHECK_CLOSE_TENSOR(matmul(xt, y_slice), ref, DType::F64);
  CHECK_CLOSE_TENSOR(matmul(x, y_slice, true, false), ref, DType::F64);
  CHECK_CLOSE_TENSOR(matmul(xt.contiguous(), y_slice.transpose(1, 2), false, true), ref, DType::F64);
}

TEST_CASE("matmul with an empty inner dim gives zeros") {
  Tensor c = matmul(randn({3, 0}), randn({0, 4}));
  CHECK(c.shape() == Shape{3, 4});
  for (double v : c.to_vector<double>()) CHECK(v == 0.0);
}

TEST_CASE("gradcheck matmul 2-D, batched and shared b, each transpose") {
  for (const Case& cs : kCases)
    for (int t = 0; t < 4; ++t) {
      bool ta = t & 1, tb = t & 2;
      Tensor a = leaf(stored(cs.batch_a, 3, 4, ta), 10 + uint64_t(t));
      Tensor b = leaf(stored(cs.batch_b, 4, 2, tb), 20 + uint64_t(t));
      INFO("a " << shape_str(a.shape()) << " b " << shape_str(b.shape()) << " ta " << ta << " tb " << tb);
      CHECK_GRADCHECK([=](const std::vector<Tensor>& in) { return matmul(in[0], in[1], ta, tb); },
                      (std::vector<Tensor>{a, b}));
    }
}

TEST_CASE("gradcheck matmul through a transposed view") {
  Tensor a = leaf({2, 4, 3}, 31), b = leaf({4, 2}, 32);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return matmul(in[0].transpose(1, 2), in[1]); },
                  (std::vector<Tensor>{a, b}));
}

TEST_CASE("bad input matmul inner dims") {
  check_throws_containing([] { matmul(randn({2, 3}), randn({4, 5})); }, {"[matmul]", "inner", "(2, 3)", "(4, 5)"});
  check_throws_containing([] { matmul(randn({2, 3}), randn({2, 5}), false, true); }, {"[matmul]", "K = 3", "K = 5"});
}

TEST_CASE("bad input matmul rank") {
  check_throws_containing([] { matmul(randn({3}), randn({3, 4})); }, {"[matmul]", "at least 2 dims", "(3)", "(3, 4)"});
}

TEST_CASE("bad input matmul batch dims") {
  check_throws_containing([] { matmul(randn({2, 3, 4}), randn({3, 4, 5})); },
                          {"[matmul]", "batch", "(2, 3, 4)", "(3, 4, 5)"});
  check_throws_containing([] { matmul(randn({3, 4}), randn({2, 4, 5})); }, {"[matmul]", "batch", "(3, 4)", "(2, 4, 5)"});
}

TEST_CASE("bad input matmul dtype") {
  check_throws_containing([] { matmul(randn({2, 3}), randn({3, 4}, DType::BF16)); },
                          {"[matmul]", "same dtype", "f32", "bf16", "(2, 3)", "(3, 4)"});
  check_throws_containing([] { matmul(arange(0, 6, DType::I64).view({2, 3}), arange(0, 6, DType::I64).view({3, 2})); },
                          {"[matmul]", "float", "i64"});
}

TEST_CASE("matmul_out writes, accumulates, and keeps an f32 sum for bf16 inputs") {
  Tensor a = randn({5, 7}, DType::F64, Device::cpu(), 40), b = randn({6, 7}, DType::F64, Device::cpu(), 41);
  const Tensor ref = matmul(a, b, false, true);
  Tensor c = full({5, 6}, 3.0, DType::F64);
  matmul_out(a, b, c, false, true);
  CHECK_CLOSE_TENSOR(c, ref, DType::F64);
  matmul_out(a, b, c, false, true, /*accumulate=*/true);
  CHECK_CLOSE_TENSOR(c, mul(ref, 2.0), DType::F64);
  // bf16 inputs into an f32 sum: two accumulated products equal twice the product of the bf16 values.
  const Tensor a16 = a.to(DType::BF16), b16 = b.to(DType::BF16);
  const Tensor exact = matmul(a16.to(DType::F64), b16.to(DType::F64), false, true);
  Tensor c32 = zeros({5, 6}, DType::F32);
  matmul_out(a16, b16, c32, false, true, true);
  matmul_out(a16, b16, c32, false, true, true);
  CHECK_CLOSE_TENSOR(c32, mul(exact, 2.0), DType::F32);
}

TEST_CASE("bad input matmul_out output") {
  Tensor a = randn({4, 5}), b = randn({5, 6});
  check_throws_containing([&] { matmul_out(a, b, zeros({4, 7}), false, false); }, {"[matmul]", "(4, 6)", "(4, 7)"});
  check_throws_containing([&] { matmul_out(a, b, zeros({4, 6}, DType::F64), false, false); },
                          {"[matmul]", "of f32", "f64"});
  check_throws_containing([&] { matmul_out(a, b, zeros({6, 4}).transpose(0, 1), false, false); },
                          {"[matmul]", "not contiguous"});
  // f32 output is for 16-bit inputs; the message offers it only there.
  check_throws_containing([&] { matmul_out(a.to(DType::BF16), b.to(DType::BF16), zeros({4, 6}, DType::F64), false,
                                           false); },
                          {"[matmul]", "of bf16 (or f32)", "f64"});
}

TEST_CASE("cuda matmul matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const Case& cs : kCases)
      for (int t = 0; t < 4; ++t) {
        bool ta = t & 1, tb = t & 2;
        Tensor a = randn(stored(cs.batch_a, 37, 65, ta), dt, gpu(), 41);
        Tensor b = randn(stored(cs.batch_b, 65, 129, tb), dt, gpu(), 42);
        INFO(dtype_name(dt) << " a " << shape_str(a.shape()) << " b " << shape_str(b.shape()));
        Tensor ref = matmul(a.to(Device::cpu()).to(DType::F64), b.to(Device::cpu()).to(DType::F64), ta, tb);
        CHECK_CLOSE_TENSOR(matmul(a, b, ta, tb), ref, dt);
#if LINTAPE_WITH_CUDA
        int count = matmul_heuristic_count(a, b, ta, tb);
        CHECK(count >= 1);
        for (int rank = 0; rank < count; ++rank) {
          INFO("heuristic rank " << rank << " of " << count);
          Tensor c = empty(ref.shape(), dt, gpu());
          poison_(c);
          matmul_into(a, b, c, ta, tb, rank);
          CHECK_CLOSE_TENSOR(c, ref, dt);
        }
#endif
      }
}

TEST_CASE("cuda matmul reads transposed views and f64" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor x = randn({3, 65, 37}, dt, gpu(), 43), y = randn({3, 65, 131}, dt, gpu(), 44);
    Tensor xt = x.transpose(1, 2), ys = y.narrow(2, 1, 129);
    Tensor ref = matmul(xt.to(Device::cpu()).to(DType::F64), ys.to(Device::cpu()).to(DType::F64));
    CHECK_CLOSE_TENSOR(matmul(xt, ys), ref, dt);
  }
}

TEST_CASE("cuda matmul backward matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (const Case& cs : kCases)
      for (int t = 0; t < 4; ++t) {
        bool ta = t & 1, tb = t & 2;
        Tensor a = randn(stored(cs.batch_a, 37, 65, ta), dt, gpu(), 45).requires_grad_();
        Tensor b = randn(stored(cs.batch_b, 65, 129, tb), dt, gpu(), 46).requires_grad_();
        Tensor a64 = a.detach().to(Device::cpu()).to(DType::F64).requires_grad_();
        Tensor b64 = b.detach().to(Device::cpu()).to(DType::F64).requires_grad_();
        Shape out = matmul(a64.detach(), b64.detach(), ta, tb).shape();
        Tensor dc = randn(out, dt, gpu(), 47);
        backward(matmul(a, b, ta, tb), dc);
        backward(matmul(a64, b64, ta, tb), dc.to(Device::cpu()).to(DType::F64));
        INFO(dtype_name(dt) << " a " << shape_str(a.shape()) << " b " << shape_str(b.shape()));
        CHECK_CLOSE_TENSOR(a.grad(), a64.grad(), dt);
        CHECK_CLOSE_TENSOR(b.grad(), b64.grad(), dt);
      }
}

#if LINTAPE_WITH_CUDA
TEST_CASE("bad input matmul_into output" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor a = randn({4, 5}, DType::F32, gpu(), 1), b = randn({5, 6}, DType::F32, gpu(), 2);
  Tensor c = empty({4, 7}, DType::F32, gpu());
  check_throws_containing([&] { matmul_into(a, b, c, false, false, 0); }, {"[matmul]", "(4, 6)", "(4, 7)"});
  Tensor ok = empty({4, 6}, DType::F32, gpu());
  int count = matmul_heuristic_count(a, b, false, false);
  check_throws_containing([&] { matmul_into(a, b, ok, false, false, count); }, {"[matmul]", "heuristic_rank"});
}
#endif
