#include <cmath>
#include "helpers.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/rms_norm.h"

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

TEST_CASE("cuda embedding matches cpu") {
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

TEST_CASE("bad input cuda embedding id out of range") {
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

namespace {

// Forward and backward of rms_norm on the GPU against the f64 CPU reference; `grad_x` / `grad_w` say which
// inputs require grad (the kernels skip dx or dweight when it is not wanted).
void check_rms_norm_cuda(const Shape& shape, DType dt, uint64_t seed, bool grad_x = true, bool grad_w = true) {
  const int64_t cols = shape.back();
  Tensor x = randn(shape, dt, gpu(), seed).requires_grad_(grad_x);
  Tensor w = randn({cols}, dt, gpu(), seed + 1).requires_grad_(grad_w);
  Tensor x64 = cpu64(x).requires_grad_(grad_x), w64 = cpu64(w).requires_grad_(grad_w);
  Tensor y = rms_norm(x, w), ref = rms_norm(x64, w64);
  CHECK_CLOSE_TENSOR(y, ref, dt);
  Tensor dy = randn(y.shape(), dt, gpu(), seed + 2);
  backward(y, dy);
  backward(ref, cpu64(dy));
  if (grad_x) CHECK_CLOSE_TENSOR(x.grad(), x64.grad(), dt);
  if (grad_w) CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), dt);
}

}  // namespace

TEST_CASE("cuda rms_norm matches cpu") {
  LT_REQUIRE_CUDA();
  // Rows of 111 and 15 (not multiples of the 8 rows a block serves). With 16-byte packs of 8 (bf16,
  // f16), 4 (f32) or 2 (f64) elements, these C cover 1 ... 4 packs per lane held by groups of 1, 2, 4
  // and 8 warps, and rows too long to hold (streamed, read twice). Scalar loads: C = 100 (bf16, f16;
  // 4 per lane), 129 (2 warps) and 1031 (streamed).
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64})
    for (int64_t cols : {100, 129, 200, 384, 768, 1000, 1031, 3000, 5000, 8200}) {
      INFO(dtype_name(dt) << " C = " << cols);
      check_rms_norm_cuda({3, cols > 1031 ? 5 : 37, cols}, dt, 11);
    }
}

TEST_CASE("cuda rms_norm backward with several rows per group") {
  LT_REQUIRE_CUDA();
  // More rows than the blocks that fit on the device take at once: each group sums dweight over several
  // rows, and the blocks' slices differ by a row. C = 768: 8 groups of a warp per block; 3000 (bf16): 2
  // groups of 4 warps; 1031 (scalar): one group, streamed.
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    check_rms_norm_cuda({2051, 768}, dt, 21);
    check_rms_norm_cuda({801, 3000}, dt, 24);
    check_rms_norm_cuda({1001, 1031}, dt, 27);
  }
}

TEST_CASE("cuda rms_norm with only x or only weight requiring grad") {
  LT_REQUIRE_CUDA();
  for (int64_t cols : {768, 8200}) {
    INFO("C = " << cols);
    check_rms_norm_cuda({45, cols}, DType::BF16, 31, true, false);
    check_rms_norm_cuda({45, cols}, DType::BF16, 34, false, true);
  }
}

TEST_CASE("cuda rms_norm of a misaligned view") {
  LT_REQUIRE_CUDA();
  // C = 768 would take 16-byte packs, but x starts one element into its storage: scalar loads.
  const int64_t rows = 37, cols = 768;
  Tensor base = randn({rows * cols + 1}, DType::BF16, gpu(), 40).requires_grad_();
  Tensor w = randn({cols}, DType::BF16, gpu(), 41).requires_grad_();
  Tensor base64 = cpu64(base).requires_grad_(), w64 = cpu64(w).requires_grad_();
  Tensor y = rms_norm(base.narrow(0, 1, rows * cols).view({rows, cols}), w);
  Tensor ref = rms_norm(base64.narrow(0, 1, rows * cols).view({rows, cols}), w64);
  CHECK_CLOSE_TENSOR(y, ref, DType::BF16);
  Tensor dy = randn(y.shape(), DType::BF16, gpu(), 42);
  backward(y, dy);
  backward(ref, cpu64(dy));
  CHECK_CLOSE_TENSOR(base.grad(), base64.grad(), DType::BF16);
  CHECK_CLOSE_TENSOR(w.grad(), w64.grad(), DType::BF16);
}

TEST_CASE("cuda rms_norm of a transposed view") {
  LT_REQUIRE_CUDA();
  Tensor x = randn({65, 37}, DType::F32, gpu(), 14).transpose(0, 1);  // (37, 65), not contiguous
  Tensor w = randn({65}, DType::F32, gpu(), 15);
  CHECK_CLOSE_TENSOR(rms_norm(x, w), rms_norm(cpu64(x), cpu64(w)), DType::F32);
}

TEST_CASE("bad input cuda rms_norm backward wider than shared memory") {
  LT_REQUIRE_CUDA();
  // The forward streams any C; the backward sums dweight over a block's rows in shared memory.
  Tensor x = randn({2, 65536}, DType::F32, gpu(), 50).requires_grad_();
  Tensor w = randn({65536}, DType::F32, gpu(), 51).requires_grad_();
  Tensor y = rms_norm(x, w);
  check_throws_containing([&] { backward(y, ones(y.shape(), DType::F32, gpu())); },
                          {"[rms_norm]", "supports C <= ", "f32", "got C = 65536"});
}

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

TEST_CASE("cuda cross_entropy matches cpu") {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (int64_t classes : {1001, 1024})  // scalar and 16-byte paths
      for (DType idt : {DType::I64, DType::I32}) {
        INFO(dtype_name(dt) << " V = " << classes << " targets " << dtype_name(idt));
        Tensor logits = randn({37, classes}, dt, gpu(), 19).requires_grad_();
        Tensor targets = make_targets(37, classes, idt, gpu());
        Tensor l64 = cpu64(logits).requires_grad_();
        Tensor loss = cross_entropy(logits, targets), ref = cross_entropy(l64, targets.to(Device::cpu()));
        CHECK(loss.dtype() == dt);
        CHECK_CLOSE_TENSOR(loss, ref, dt);
        backward(loss, full({}, 0.7, dt, gpu()));
        backward(ref, full({}, 0.7, DType::F64));
        CHECK_CLOSE_TENSOR(logits.grad(), l64.grad(), dt);
      }
}

TEST_CASE("cuda cross_entropy of a view whose rows start off 16-byte boundaries") {
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

TEST_CASE("cuda cross_entropy with every token ignored is 0 with a zero gradient") {
  LT_REQUIRE_CUDA();
  Tensor logits = randn({5, 33}, DType::BF16, gpu(), 20).requires_grad_();
  Tensor loss = cross_entropy(logits, from_vector_i64({-100, -100, -100, -100, -100}, {5}, gpu()));
  CHECK(loss.item() == 0.0);
  backward(loss);
  for (double g : logits.grad().to_vector<double>()) CHECK(g == 0.0);
}

TEST_CASE("bad input cuda cross_entropy target out of range") {
  LT_REQUIRE_CUDA();
  Tensor logits = randn({4, 1001}, DType::F32, gpu(), 21);
  check_throws_containing([&] { cross_entropy(logits, from_vector_i64({1, 2, -3, 0}, {4}, gpu())); },
                          {"[cross_entropy]", "[0, V = 1001)", "got -3", "row 2"});
}
