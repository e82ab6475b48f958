#include <cmath>
#include "core/allocator.h"
#include "helpers.h"
#include "ops/cross_entropy.h"
#include "ops/cross_entropy_cuda.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "ops/rms_norm.h"
#if LINTAPE_WITH_CUDA
#include "ops/rms_norm_cuda.h"
#endif

using namespace lintape;
using namespace lintape::test;

namespace {

// Ids in [0, rows) that repeat, on the given device; i32 when asked.
Tensor make_ids(const Shape& shape, int64_t rows, DType dtype, Device device) {
  std::vector<int64_t> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t((i * 7919 + 13) % size_t(rows)) / (i % 3 == 0 ? 2 : 1);
  Tensor t = from_vector_i64(v, shape, device);
  return dtype == DType::I64 ? t : t.to(dtype);
}

// Targets in [0, classes) with every fifth row ignored (-100).
Tensor make_targets(int64_t rows, int64_t classes, DType dtype, Device device) {
  std::vector<int64_t> v(static_cast<size_t>(rows));
  for (size_t i = 0; i < v.size(); ++i) v[i] = i % 5 == 1 ? -100 : int64_t((i * 7919 + 5) % size_t(classes));
  Tensor t = from_vector_i64(v, {rows}, device);
  return dtype == DType::I64 ? t : t.to(dtype);
}

Tensor cpu64(const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::F64); }

}  // namespace

// ---- embedding ----

TEST_CASE("embedding gathers rows") {
  Tensor w = randn({5, 3}, DType::F32, Device::cpu(), 1);
  std::vector<double> wv = w.to_vector<double>();
  for (DType idt : {DType::I64, DType::I32}) {
    Tensor ids = from_vector_i64({4, 0, 4, 2}, {2, 2}).to(idt);
    Tensor out = embedding(w, ids);
    REQUIRE(out.shape() == Shape{2, 2, 3});
    std::vector<double> ov = out.to_vector<double>();
    int64_t rows[] = {4, 0, 4, 2};
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 3; ++c) CHECK(ov[size_t(i * 3 + c)] == wv[size_t(rows[i] * 3 + c)]);
  }
}

TEST_CASE("gradcheck embedding") {
  Tensor w = leaf({6, 3}, 2);
  Tensor ids = from_vector_i64({4, 1, 4, 0, 5, 4}, {2, 3});  // id 4 three times: the gradient adds up
  CHECK_GRADCHECK([ids](const std::vector<Tensor>& in) { return embedding(in[0], ids); }, (std::vector<Tensor>{w}));
}

TEST_CASE("bad input embedding id out of range") {
  Tensor w = randn({5, 3});
  check_throws_containing([&] { embedding(w, from_vector_i64({1, 7, 2}, {3})); },
                          {"[embedding]", "[0, 5)", "got 7", "position 1"});
  check_throws_containing([&] { embedding(w, from_vector_i64({-1}, {1})); }, {"[embedding]", "got -1"});
}

TEST_CASE("bad input embedding weight and ids") {
  check_throws_containing([] { embedding(randn({5}), from_vector_i64({1}, {1})); }, {"[embedding]", "weight", "(5)"});
  check_throws_containing([] { embedding(randn({5, 3}), randn({2})); }, {"[embedding]", "ids", "i64 or i32", "f32"});
}

TEST_CASE("cuda embedding matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t cols : {129, 128})  // scalar and 16-byte paths
      for (DType idt : {DType::I64, DType::I32}) {
        INFO(dtype_name(dt) << " C = " << cols << " ids " << dtype_name(idt));
        Tensor w = randn({1001, cols}, dt, gpu(), 3).requires_grad_();
        Tensor ids = make_ids({7, 13}, 1001, idt, gpu());
        Tensor w64 = cpu64(w).requires_grad_();
        Tensor out = embedding(w, ids), ref = embedding(w64, ids.to(Device::cpu()));
        CHECK_CLOSE_TENSOR(out, ref, dt);
        Tensor dout = randn(out.shape(), dt, gpu(), 4);
        backward(out, dout);
        backward(ref, cpu64(dout));
        CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), dt);
      }
}

TEST_CASE("bad input cuda embedding id out of range" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor w = randn({1001, 64}, DType::BF16, gpu(), 5);
  check_throws_containing([&] { embedding(w, from_vector_i64({3, 1001, 2}, {3}, gpu())); },
                          {"[embedding]", "[0, 1001)", "got 1001", "position 1"});
}

// ---- rms_norm ----

TEST_CASE("rms_norm matches the formula") {
  for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
    Tensor x = randn({3, 7}, dt, Device::cpu(), 6), w = randn({7}, dt, Device::cpu(), 7);
    std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>(), ref(21);
    for (int i = 0; i < 3; ++i) {
      double ss = 0;
      for (int c = 0; c < 7; ++c) ss += xv[size_t(i * 7 + c)] * xv[size_t(i * 7 + c)];
      double r = 1 / std::sqrt(ss / 7 + 1e-5);
      for (int c = 0; c < 7; ++c) ref[size_t(i * 7 + c)] = xv[size_t(i * 7 + c)] * r * wv[size_t(c)];
    }
    CHECK_CLOSE_TENSOR(rms_norm(x, w, 1e-5), from_vector(ref, {3, 7}, DType::F64), dt);
  }
}

TEST_CASE("gradcheck rms_norm x and weight") {
  Tensor x = leaf({2, 3, 5}, 8), w = leaf({5}, 9, 0.5);
  auto f = [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1], 1e-5); };
  CHECK_GRADCHECK(f, (std::vector<Tensor>{x, w}));
  Tensor w_fixed = randn({5}, DType::F64, Device::cpu(), 10);  // only x needs a gradient
  CHECK_GRADCHECK(f, (std::vector<Tensor>{x, w_fixed}));
}

TEST_CASE("bad input rms_norm weight") {
  check_throws_containing([] { rms_norm(randn({2, 5}), randn({4})); }, {"[rms_norm]", "(C) with C = 5", "got (4)"});
  check_throws_containing([] { rms_norm(randn({2, 5}), randn({5}, DType::BF16)); }, {"[rms_norm]", "f32", "bf16"});
}

TEST_CASE("cuda rms_norm matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // C = 129: scalar loads; 8, 128 (many rows per warp, blocks looping over rows), 768 and 2056 (rows
  // over several warps): 16-byte packs; 1031 (scalar) and 8200 (bf16 packs): rows too long to be held
  // in registers, streamed twice.
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t cols : {8, 128, 129, 768, 1031, 2056, 8200}) {
      INFO(dtype_name(dt) << " C = " << cols);
      const int64_t mid = cols > 1000 ? 5 : cols <= 128 ? 1500 : 37;
      Tensor x = randn({3, mid, cols}, dt, gpu(), 11).requires_grad_();
      Tensor w = randn({cols}, dt, gpu(), 12).requires_grad_();
      Tensor x64 = cpu64(x).requires_grad_(), w64 = cpu64(w).requires_grad_();
      Tensor y = rms_norm(x, w), ref = rms_norm(x64, w64);
      CHECK_CLOSE_TENSOR(y, ref, dt);
      Tensor dy = randn(y.shape(), dt, gpu(), 13);
      backward(y, dy);
      backward(ref, cpu64(dy));
      CHECK_CLOSE_TENSOR(x.grad(), x64.grad(), dt);
      CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), dt);
    }
}

TEST_CASE("cuda rms_norm of a transposed view" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor x = randn({65, 37}, DType::F32, gpu(), 14).transpose(0, 1);  // (37, 65), not contiguous
  Tensor w = randn({65}, DType::F32, gpu(), 15);
  CHECK_CLOSE_TENSOR(rms_norm(x, w), rms_norm(cpu64(x), cpu64(w)), DType::F32);
}

// ---- add_rms_norm ----

TEST_CASE("add_rms_norm equals add then rms_norm, values and gradients") {
  for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    Tensor x = randn({4, 3, 24}, dt, Device::cpu(), 31).requires_grad_();
    Tensor r = randn({4, 3, 24}, dt, Device::cpu(), 32).requires_grad_();
    Tensor w = randn({24}, dt, Device::cpu(), 33).requires_grad_();
    Tensor x2 = x.detach().requires_grad_(), r2 = r.detach().requires_grad_(), w2 = w.detach().requires_grad_();
    const auto [sum, y] = add_rms_norm(x, r, w, 1e-5);
    const Tensor sum_ref = add(x2, r2), y_ref = rms_norm(sum_ref, w2, 1e-5);
    CHECK(rel_error(sum, sum_ref) == 0.0);  // the same rounding as add
    CHECK_CLOSE_TENSOR(y, y_ref, dt);
    // Both outputs carry a gradient, as in the model: the stream goes on and the normed rows feed a layer.
    Tensor dsum = randn(sum.shape(), dt, Device::cpu(), 34), dy = randn(y.shape(), dt, Device::cpu(), 35);
    backward(std::vector<Tensor>{sum, y}, std::vector<Tensor>{dsum, dy});
    backward(std::vector<Tensor>{sum_ref, y_ref}, std::vector<Tensor>{dsum, dy});
    CHECK_CLOSE_TENSOR(x.grad(), x2.grad(), dt);
    CHECK_CLOSE_TENSOR(r.grad(), r2.grad(), dt);
    CHECK_CLOSE_TENSOR(w.grad(), w2.grad(), dt);
  }
}

TEST_CASE("gradcheck add_rms_norm x, residual and weight") {
  Tensor x = leaf({2, 3, 5}, 36), r = leaf({2, 3, 5}, 37), w = leaf({5}, 38, 0.5);
  Tensor mix = randn({2, 3, 5}, DType::F64, Device::cpu(), 39);
  // Both outputs in the checked scalar: sum * mix + y.
  auto f = [mix](const std::vector<Tensor>& in) {
    const auto [sum, y] = add_rms_norm(in[0], in[1], in[2], 1e-5);
    return add(mul(sum, mix), y);
  };
  CHECK_GRADCHECK(f, (std::vector<Tensor>{x, r, w}));
  auto normed_only = [](const std::vector<Tensor>& in) { return add_rms_norm(in[0], in[1], in[2], 1e-5).second; };
  CHECK_GRADCHECK(normed_only, (std::vector<Tensor>{x, r, w}));
  auto sum_only = [](const std::vector<Tensor>& in) { return add_rms_norm(in[0], in[1], in[2], 1e-5).first; };
  CHECK_GRADCHECK(sum_only, (std::vector<Tensor>{x, r, w}));
}

TEST_CASE("bad input add_rms_norm") {
  check_throws_containing([] { add_rms_norm(randn({2, 5}), randn({2, 4}), randn({5})); },
                          {"[add_rms_norm]", "residual", "(2, 5)", "got (2, 4)"});
  check_throws_containing([] { add_rms_norm(randn({2, 5}), randn({2, 5}, DType::BF16), randn({5})); },
                          {"[add_rms_norm]", "residual", "f32", "bf16"});
  check_throws_containing([] { add_rms_norm(randn({2, 5}), randn({2, 5}), randn({4})); },
                          {"[add_rms_norm]", "(C) with C = 5", "got (4)"});
}

#if LINTAPE_WITH_CUDA
TEST_CASE("cuda add_rms_norm matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // As the rms_norm case: rows held by 4 to 256 lanes, scalar loads (129, 1031) and streamed rows (8200).
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t cols : {8, 128, 129, 768, 1031, 8200}) {
      INFO(dtype_name(dt) << " C = " << cols);
      const int64_t mid = cols > 1000 ? 5 : cols <= 128 ? 1500 : 37;
      Tensor x = randn({3, mid, cols}, dt, gpu(), 41).requires_grad_();
      Tensor r = randn({3, mid, cols}, dt, gpu(), 42).requires_grad_();
      Tensor w = randn({cols}, dt, gpu(), 43).requires_grad_();
      Tensor x64 = cpu64(x).requires_grad_(), r64 = cpu64(r).requires_grad_(), w64 = cpu64(w).requires_grad_();
      // Outputs written over poison: whatever a kernel leaves unwritten shows as NaN.
      Tensor sum_p = empty(x.shape(), dt, gpu()), y_p = empty(x.shape(), dt, gpu());
      Tensor rstd = empty({3 * mid}, DType::F32, gpu());
      poison_(sum_p);
      poison_(y_p);
      ops_cuda::rms_norm_forward_cuda(x.detach(), r.detach(), sum_p, w.detach(), 1e-6, y_p, rstd);
      const auto [sum, y] = add_rms_norm(x, r, w);
      const auto [sum64, y64] = add_rms_norm(x64, r64, w64);
      CHECK_CLOSE_TENSOR(sum_p, sum64, dt);
      CHECK_CLOSE_TENSOR(y_p, y64, dt);
      CHECK(rel_error(sum, add(x.detach(), r.detach())) == 0.0);
      CHECK_CLOSE_TENSOR(y, y64, dt);
      Tensor dsum = randn(sum.shape(), dt, gpu(), 44), dy = randn(y.shape(), dt, gpu(), 45);
      backward(std::vector<Tensor>{sum, y}, std::vector<Tensor>{dsum, dy});
      backward(std::vector<Tensor>{sum64, y64}, std::vector<Tensor>{cpu64(dsum), cpu64(dy)});
      CHECK_CLOSE_TENSOR(x.grad(), x64.grad(), dt);
      CHECK_CLOSE_TENSOR(r.grad(), r64.grad(), dt);
      CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), dt);
      // The backward kernel alone, dx over poison.
      Tensor dx_p = empty(x.shape(), dt, gpu());
      poison_(dx_p);
      ops_cuda::rms_norm_backward_cuda(dy, dsum, sum.detach(), w.detach(), rstd, dx_p, Tensor());
      CHECK_CLOSE_TENSOR(dx_p, x64.grad(), dt);
    }
}
#endif

// ---- rms_norm_linear, add_rms_norm_linear ----

namespace {

// Bits equal: the fused ops' values and gradients against rms_norm (or add_rms_norm) then matmul, on `device`
// in dtype dt; x (rows, K), the norm over groups of C. Both outputs carry a gradient with a residual.
void check_norm_linear_bits(Device device, DType dt, int64_t B, int64_t N, int64_t K, int64_t C, int64_t M,
                            bool residual) {
  INFO(device.name() << " " << dtype_name(dt) << " K = " << K << " C = " << C << " M = " << M
                     << (residual ? " with residual" : ""));
  Tensor x = randn({B, N, K}, dt, device, 51).requires_grad_();
  Tensor r = randn({B, N, K}, dt, device, 52).requires_grad_();
  Tensor nw = add(mul(randn({C}, dt, device, 53), 0.25), 1.0).requires_grad_();
  Tensor w = mul(randn({M, K}, dt, device, 54), 0.05).requires_grad_();
  auto copy = [](const Tensor& t) { return t.detach().clone().requires_grad_(); };
  Tensor x2 = copy(x), r2 = copy(r), nw2 = copy(nw), w2 = copy(w);
  Tensor dout = randn({B, N, M}, dt, device, 55), dsum = randn({B, N, K}, dt, device, 56);
  if (residual) {
    const auto [sum, out] = add_rms_norm_linear(x, r, nw, w, 1e-5);
    const auto [sum_ref, normed] = add_rms_norm(x2, r2, nw2, 1e-5);
    const Tensor out_ref = matmul(normed, w2, false, true);
    CHECK(rel_error(sum, sum_ref) == 0.0);
    CHECK(rel_error(out, out_ref) == 0.0);
    backward(std::vector<Tensor>{sum, out}, std::vector<Tensor>{dsum, dout});
    backward(std::vector<Tensor>{sum_ref, out_ref}, std::vector<Tensor>{dsum, dout});
    CHECK(rel_error(r.grad(), r2.grad()) == 0.0);
  } else {
    const Tensor out = rms_norm_linear(x, nw, w, 1e-5);
    const Tensor normed = rms_norm(x2.view({B, N, K / C, C}), nw2, 1e-5).view({B, N, K});
    const Tensor out_ref = matmul(normed, w2, false, true);
    CHECK(rel_error(out, out_ref) == 0.0);
    backward(std::vector<Tensor>{out}, std::vector<Tensor>{dout});
    backward(std::vector<Tensor>{out_ref}, std::vector<Tensor>{dout});
  }
  CHECK(rel_error(x.grad(), x2.grad()) == 0.0);
  CHECK(rel_error(nw.grad(), nw2.grad()) == 0.0);
  CHECK(rel_error(w.grad(), w2.grad()) == 0.0);
  CHECK(rel_error(x.grad(), zeros(x.shape(), dt, device)) > 0.0);  // a gradient arrived at all
}

}  // namespace

TEST_CASE("rms_norm_linear and add_rms_norm_linear give the bits of the norm then matmul") {
  for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
    check_norm_linear_bits(Device::cpu(), dt, 2, 5, 24, 24, 7, true);
    check_norm_linear_bits(Device::cpu(), dt, 2, 5, 24, 24, 7, false);
    check_norm_linear_bits(Device::cpu(), dt, 3, 4, 24, 8, 5, false);  // three groups a row: per-head norms
  }
}

TEST_CASE("gradcheck rms_norm_linear and add_rms_norm_linear") {
  Tensor x = leaf({2, 3, 6}, 57), r = leaf({2, 3, 6}, 58), nw = leaf({3}, 59, 1.0), w = leaf({4, 6}, 60);
  Tensor mix = randn({2, 3, 6}, DType::F64, Device::cpu(), 61);
  auto grouped = [](const std::vector<Tensor>& in) { return rms_norm_linear(in[0], in[1], in[2], 1e-5); };
  CHECK_GRADCHECK(grouped, (std::vector<Tensor>{x, nw, w}));
  // A fixed weight: no weight gradient wanted, so the backward does not make the normed rows again.
  const Tensor fixed = w.detach();
  auto fixed_weight = [fixed](const std::vector<Tensor>& in) { return rms_norm_linear(in[0], in[1], fixed, 1e-5); };
  CHECK_GRADCHECK(fixed_weight, (std::vector<Tensor>{x, nw}));
  Tensor nw6 = leaf({6}, 62, 1.0);
  auto with_sum = [mix](const std::vector<Tensor>& in) {
    const auto [total, out] = add_rms_norm_linear(in[0], in[1], in[2], in[3], 1e-5);
    return add(sum(mul(total, mix)), sum(out));
  };
  CHECK_GRADCHECK(with_sum, (std::vector<Tensor>{x, r, nw6, w}));
  auto product_only = [](const std::vector<Tensor>& in) {
    return add_rms_norm_linear(in[0], in[1], in[2], in[3], 1e-5).second;
  };
  CHECK_GRADCHECK(product_only, (std::vector<Tensor>{x, r, nw6, w}));
}

TEST_CASE("rms_norm_linear holds the input, not the normed rows") {
  // What the graph holds after the forward, against the norm then matmul: one (rows, K) tensor less.
  const Device cpu = Device::cpu();
  Tensor x = randn({4, 64, 96}, DType::F32, cpu, 63).requires_grad_();
  Tensor nw = ones({32}).requires_grad_(), w = randn({48, 96}, DType::F32, cpu, 64).requires_grad_();
  const size_t base = memory_stats(cpu).in_use;
  size_t fused = 0, composed = 0;
  {
    const Tensor out = rms_norm_linear(x, nw, w);
    fused = memory_stats(cpu).in_use - base;
  }
  {
    const Tensor out = matmul(rms_norm(x.view({4, 64, 3, 32}), nw).view({4, 64, 96}), w, false, true);
    composed = memory_stats(cpu).in_use - base;
  }
  CHECK(composed - fused == size_t(4 * 64 * 96) * sizeof(float));
}

TEST_CASE("bad input rms_norm_linear") {
  check_throws_containing([] { rms_norm_linear(randn({2, 6}), randn({4}), randn({3, 6})); },
                          {"[rms_norm_linear]", "C dividing", "K = 6", "got (4)"});
  check_throws_containing([] { rms_norm_linear(randn({2, 6}), randn({6}), randn({3, 5})); },
                          {"[rms_norm_linear]", "(M, K) with K = 6", "got (3, 5)"});
  check_throws_containing([] { rms_norm_linear(randn({2, 6}), randn({6}), randn({3, 6}, DType::BF16)); },
                          {"[rms_norm_linear]", "weight", "f32", "bf16"});
  check_throws_containing([] { add_rms_norm_linear(randn({2, 6}), randn({3, 6}), randn({6}), randn({3, 6})); },
                          {"[add_rms_norm_linear]", "residual", "(2, 6)", "got (3, 6)"});
}

#if LINTAPE_WITH_CUDA
TEST_CASE("cuda rms_norm_linear and add_rms_norm_linear give the bits of the norm then matmul" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16}) {
    check_norm_linear_bits(gpu(), dt, 2, 300, 768, 768, 1024, true);   // the MLP's up projection, narrowed
    check_norm_linear_bits(gpu(), dt, 2, 300, 768, 128, 768, false);   // the FAL mixer's per-head norm and out
    check_norm_linear_bits(gpu(), dt, 1, 37, 129, 129, 40, true);      // scalar loads, odd sizes
  }
  // Against the f64 reference on the CPU.
  Tensor x = randn({2, 50, 256}, DType::BF16, gpu(), 65).requires_grad_();
  Tensor nw = randn({128}, DType::BF16, gpu(), 66).requires_grad_();
  Tensor w = mul(randn({96, 256}, DType::BF16, gpu(), 67), 0.05).requires_grad_();
  Tensor x64 = cpu64(x).requires_grad_(), nw64 = cpu64(nw).requires_grad_(), w64 = cpu64(w).requires_grad_();
  const Tensor out = rms_norm_linear(x, nw, w), out64 = rms_norm_linear(x64, nw64, w64);
  CHECK_CLOSE_TENSOR(out, out64, DType::BF16);
  Tensor dout = randn(out.shape(), DType::BF16, gpu(), 68);
  backward(std::vector<Tensor>{out}, std::vector<Tensor>{dout});
  backward(std::vector<Tensor>{out64}, std::vector<Tensor>{cpu64(dout)});
  CHECK_CLOSE_TENSOR(x.grad(), x64.grad(), DType::BF16);
  CHECK_CLOSE_TENSOR(nw.grad(), nw64.grad(), DType::BF16);
  CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), DType::BF16);
}
#endif

// ---- cross_entropy ----

TEST_CASE("cross_entropy matches log-softmax by hand") {
  Tensor logits = randn({4, 6}, DType::F64, Device::cpu(), 16);
  Tensor targets = from_vector_i64({2, -100, 5, 0}, {4});
  std::vector<double> x = logits.to_vector<double>();
  double total = 0;
  int64_t t[] = {2, -1, 5, 0};
  for (int i = 0; i < 4; ++i) {
    if (t[i] < 0) continue;
    double s = 0;
    for (int v = 0; v < 6; ++v) s += std::exp(x[size_t(i * 6 + v)]);
    total += std::log(s) - x[size_t(i * 6 + t[i])];
  }
  Tensor loss = cross_entropy(logits, targets);
  CHECK(loss.shape() == Shape{});
  CHECK(loss.item() == doctest::Approx(total / 3).epsilon(1e-12));
}

TEST_CASE("gradcheck cross_entropy with an ignored token") {
  Tensor logits = leaf({4, 5}, 17);
  Tensor targets = from_vector_i64({1, -100, 4, 0}, {4});
  CHECK_GRADCHECK([targets](const std::vector<Tensor>& in) { return cross_entropy(in[0], targets); },
                  (std::vector<Tensor>{logits}));
}

TEST_CASE("cross_entropy with every token ignored is 0 with a zero gradient") {
  Tensor logits = randn({3, 4}, DType::F64, Device::cpu(), 18).requires_grad_();
  Tensor loss = cross_entropy(logits, from_vector_i64({7, 7, 7}, {3}), 7);
  CHECK(loss.item() == 0.0);
  backward(loss);
  for (double g : logits.grad().to_vector<double>()) CHECK(g == 0.0);
}

TEST_CASE("bad input cross_entropy target out of range") {
  check_throws_containing([] { cross_entropy(randn({3, 5}), from_vector_i64({1, 5, 2}, {3})); },
                          {"[cross_entropy]", "[0, V = 5)", "got 5", "row 1", "ignore_index = -100"});
}

TEST_CASE("bad input cross_entropy shapes") {
  check_throws_containing([] { cross_entropy(randn({4, 5}), from_vector_i64({1, 2, 3}, {3})); },
                          {"[cross_entropy]", "(T) with T = 4", "(3)"});
  check_throws_containing([] { cross_entropy(randn({5}), from_vector_i64({1}, {1})); },
                          {"[cross_entropy]", "(T, V)", "(5)"});
  check_throws_containing([] { cross_entropy(randn({2, 5}), randn({2})); }, {"[cross_entropy]", "i64 or i32", "f32"});
}

TEST_CASE("cuda cross_entropy matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t classes : {1001, 1024})  // scalar and 16-byte paths
      for (DType idt : {DType::I64, DType::I32}) {
        INFO(dtype_name(dt) << " V = " << classes << " targets " << dtype_name(idt));
        Tensor logits = randn({37, classes}, dt, gpu(), 19).requires_grad_();
        Tensor targets = make_targets(37, classes, idt, gpu());
        Tensor l64 = cpu64(logits).requires_grad_();
        Tensor loss = cross_entropy(logits, targets), ref = cross_entropy(l64, targets.to(Device::cpu()));
        CHECK(loss.dtype() == DType::F32);  // f32 from bf16 logits too
        CHECK_CLOSE_TENSOR(loss, ref, dt);
        backward(loss, full({}, 0.7, DType::F32, gpu()));
        backward(ref, full({}, 0.7, DType::F64));
        CHECK_CLOSE_TENSOR(logits.grad(), l64.grad(), dt);
      }
}

TEST_CASE("cuda cross_entropy of a view whose rows start off 16-byte boundaries" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Rows 1..37 of a (38, 1001) bf16 tensor: contiguous, 2002 bytes past the allocation's start.
  Tensor logits = randn({38, 1001}, DType::BF16, gpu(), 22).narrow(0, 1, 37).detach().requires_grad_();
  Tensor targets = make_targets(37, 1001, DType::I64, gpu());
  Tensor l64 = cpu64(logits).requires_grad_();
  Tensor loss = cross_entropy(logits, targets), ref = cross_entropy(l64, targets.to(Device::cpu()));
  CHECK_CLOSE_TENSOR(loss, ref, DType::BF16);
  backward(loss);
  backward(ref);
  CHECK_CLOSE_TENSOR(logits.grad(), l64.grad(), DType::BF16);
}

TEST_CASE("cuda cross_entropy with every token ignored is 0 with a zero gradient" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor logits = randn({5, 33}, DType::BF16, gpu(), 20).requires_grad_();
  Tensor loss = cross_entropy(logits, from_vector_i64({-100, -100, -100, -100, -100}, {5}, gpu()));
  CHECK(loss.item() == 0.0);
  backward(loss);
  for (double g : logits.grad().to_vector<double>()) CHECK(g == 0.0);
}

// linear_cross_entropy's one-pass row kernel against the row kernel then the backward kernel on rows laid out
// alike: the same lse, row losses and gradient bits (rows off the 16-byte grid, ignored rows, a target out of
// range, the longest rows it takes); rows longer than that are left to the two kernels.
TEST_CASE("cuda cross_entropy one-pass rows give the bits of the row and backward kernels" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const int64_t R = 37;
  for (DType dt : {DType::BF16, DType::F32})
    for (int64_t classes : {1001, 1024, 16384, 32768, 32769}) {
      INFO(dtype_name(dt) << " V = " << classes);
      const bool fits = classes <= (dt == DType::BF16 ? 32768 : 16384);
      // Rows of 1001 classes start off the 16-byte grid; the two sides read rows of the same alignment (a row's
      // sum order follows its first 16-byte boundary).
      const Tensor logits = randn({R, classes}, dt, gpu(), uint64_t(classes));
      std::vector<int64_t> tv = make_targets(R, classes, DType::I64, Device::cpu()).to_vector<int64_t>();
      tv[7] = classes + 3;  // out of range: recorded in bad
      const Tensor targets = from_vector_i64(tv, {R}, gpu());
      Tensor count = empty({1}, DType::I64, gpu()), one = full({1}, 1.0, DType::F32, gpu());
      ops_cuda::cross_entropy_reduce_cuda(Tensor(), targets, -100, Tensor(), count, DType::F32);
      Tensor lse[2], loss[2], bad[2], grad[2];
      for (int k = 0; k < 2; ++k) {
        lse[k] = empty({R}, DType::F32, gpu());
        loss[k] = empty({R}, DType::F32, gpu());
        bad[k] = zeros({2}, DType::I64, gpu());
        poison_(lse[k]);
        poison_(loss[k]);
      }
      ops_cuda::cross_entropy_rows_cuda(logits, targets, -100, lse[0], loss[0], bad[0], 5);
      grad[0] = empty({R, classes}, dt, gpu());
      ops_cuda::cross_entropy_backward_cuda(one, logits, targets, -100, lse[0], count, grad[0]);
      grad[1] = logits.clone();  // in place
      CHECK(ops_cuda::cross_entropy_rows_gradient_cuda(grad[1], targets, -100, lse[1], loss[1], bad[1], 5, one, count) ==
            fits);
      if (!fits) continue;
      CHECK(lse[1].to_vector<double>() == lse[0].to_vector<double>());
      CHECK(loss[1].to_vector<double>() == loss[0].to_vector<double>());
      CHECK(grad[1].to_vector<double>() == grad[0].to_vector<double>());
      CHECK(bad[1].to_vector<int64_t>() == std::vector<int64_t>{5 + 7 + 1, classes + 3});
    }
#endif
}

TEST_CASE("bad input cuda cross_entropy target out of range" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor logits = randn({4, 1001}, DType::F32, gpu(), 21);
  check_throws_containing([&] { cross_entropy(logits, from_vector_i64({1, 2, -3, 0}, {4}, gpu())); },
                          {"[cross_entropy]", "[0, V = 1001)", "got -3", "row 2"});
}

// ---- linear_cross_entropy ----

namespace {
// cross_entropy of the whole (T, V) logits: what linear_cross_entropy must equal.
Tensor full_logits_loss(const Tensor& x, const Tensor& w, const Tensor& targets) {
  return cross_entropy(matmul(x, w, false, true), targets);
}
}  // namespace

TEST_CASE("linear_cross_entropy equals cross_entropy of the full logits, in chunks and with ignored rows") {
  for (int64_t chunk : {0, 1, 3, 10, 64}) {
    INFO("chunk_rows " << chunk);
    Tensor x = leaf({10, 6}, 23), w = leaf({7, 6}, 24);
    Tensor x2 = x.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
    Tensor targets = make_targets(10, 7, DType::I32, Device::cpu());
    Tensor loss = linear_cross_entropy(x, w, targets, -100, chunk), ref = full_logits_loss(x2, w2, targets);
    CHECK(loss.item() == doctest::Approx(ref.item()).epsilon(1e-12));
    backward(loss, full({}, 0.7, DType::F64));
    backward(ref, full({}, 0.7, DType::F64));
    CHECK_CLOSE_TENSOR(x.grad(), x2.grad(), DType::F64);
    CHECK_CLOSE_TENSOR(w.grad(), w2.grad(), DType::F64);
  }
}

TEST_CASE("gradcheck linear_cross_entropy in chunks with an ignored token") {
  Tensor targets = from_vector_i64({1, -100, 4, 0, 2}, {5});
  CHECK_GRADCHECK(
      [targets](const std::vector<Tensor>& in) { return linear_cross_entropy(in[0], in[1], targets, -100, 2); },
      (std::vector<Tensor>{leaf({5, 3}, 25), leaf({6, 3}, 26)}));
}

TEST_CASE("linear_cross_entropy gives a gradient only to the inputs that want one") {
  Tensor x = leaf({4, 3}, 27), w = randn({5, 3}, DType::F64, Device::cpu(), 28);
  Tensor loss = linear_cross_entropy(x, w, from_vector_i64({0, 1, 2, 3}, {4}));
  backward(loss);
  CHECK(x.grad().defined());
  CHECK_FALSE(w.grad().defined());
  NoGradGuard no_grad;
  Tensor plain = linear_cross_entropy(x, w, from_vector_i64({0, 1, 2, 3}, {4}));
  CHECK_FALSE(plain.requires_grad());
  CHECK(plain.item() == doctest::Approx(loss.item()).epsilon(1e-12));
}

TEST_CASE("linear_cross_entropy with every token ignored is 0 with zero gradients") {
  Tensor x = leaf({3, 4}, 29), w = leaf({5, 4}, 30);
  Tensor loss = linear_cross_entropy(x, w, from_vector_i64({-1, -1, -1}, {3}), -1, 2);
  CHECK(loss.item() == 0.0);
  backward(loss);
  for (double g : x.grad().to_vector<double>()) CHECK(g == 0.0);
  for (double g : w.grad().to_vector<double>()) CHECK(g == 0.0);
}

TEST_CASE("bad input linear_cross_entropy") {
  // The row is counted over the whole input, not within its chunk.
  check_throws_containing(
      [] { linear_cross_entropy(randn({5, 3}), randn({4, 3}), from_vector_i64({1, 2, 0, 3, 9}, {5}), -100, 2); },
      {"[linear_cross_entropy]", "[0, V = 4)", "got 9", "row 4"});
  check_throws_containing([] { linear_cross_entropy(randn({5, 3}), randn({4, 2}), from_vector_i64({1}, {1})); },
                          {"[linear_cross_entropy]", "weight", "C = 3", "(4, 2)"});
  check_throws_containing(
      [] { linear_cross_entropy(randn({5, 3}), randn({4, 3}, DType::F64), from_vector_i64({0, 0, 0, 0, 0}, {5})); },
      {"[linear_cross_entropy]", "dtype", "f32", "f64"});
  check_throws_containing([] { linear_cross_entropy(randn({5, 3}), randn({4, 3}), from_vector_i64({0, 0}, {2})); },
                          {"[linear_cross_entropy]", "(T) with T = 5", "(2)"});
  check_throws_containing(
      [] { linear_cross_entropy(randn({2, 3}), randn({4, 3}), from_vector_i64({0, 0}, {2}), -100, -1); },
      {"[linear_cross_entropy]", "chunk_rows", "-1"});
}

TEST_CASE("cuda linear_cross_entropy matches the f64 reference and holds no logits" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t chunk : {0, 100}) {
      INFO(dtype_name(dt) << " chunk_rows " << chunk);
      const int64_t T = 333, C = 64, V = 4001;
      Tensor x = randn({T, C}, dt, gpu(), 31).requires_grad_(), w = randn({V, C}, dt, gpu(), 32).requires_grad_();
      Tensor targets = make_targets(T, V, DType::I64, gpu());
      Tensor x64 = cpu64(x).requires_grad_(), w64 = cpu64(w).requires_grad_();
      Tensor ref = full_logits_loss(x64, w64, targets.to(Device::cpu()));
      // A freed block of NaN the op's buffers may reuse: no result may come from memory it did not write.
      empty({T, V}, dt, gpu()).fill_(std::nan(""));
      reset_peak_memory(gpu());
      const size_t before = memory_stats(gpu()).in_use;
      Tensor loss = linear_cross_entropy(x, w, targets, -100, chunk);
      backward(loss, full({}, 0.7, DType::F32, gpu()));
      const size_t extra = memory_stats(gpu()).peak - before;
      backward(ref, full({}, 0.7, DType::F64));
      CHECK(loss.dtype() == DType::F32);
      CHECK_CLOSE_TENSOR(loss, ref, dt);
      CHECK_CLOSE_TENSOR(x.grad(), x64.grad(), dt);
      CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), dt);
      // A chunk of 100 rows of logits, dx, dW in f32, the gradients and small things; less than the full
      // logits (T x V).
      if (chunk == 100) CHECK(extra < size_t(T * V) * dtype_size(dt));
    }
}

TEST_CASE("bad input cuda linear_cross_entropy target out of range, in a later chunk" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor x = randn({6, 8}, DType::BF16, gpu(), 33), w = randn({101, 8}, DType::BF16, gpu(), 34);
  check_throws_containing(
      [&] { linear_cross_entropy(x, w, from_vector_i64({1, 2, 3, 0, 101, 5}, {6}, gpu()), -100, 2); },
      {"[linear_cross_entropy]", "[0, V = 101)", "got 101", "row 4"});
}
