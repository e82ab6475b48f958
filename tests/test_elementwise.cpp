#include <cmath>
#include "core/allocator.h"
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/reduce.h"

using namespace lintape;
using namespace lintape::test;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// An f64 CPU leaf with values in [0.5, 2.5): inside the domain of log, sqrt and rsqrt.
Tensor positive_leaf(const Shape& shape, uint64_t seed) {
  std::vector<double> v = rand(shape, DType::F64, Device::cpu(), seed).to_vector<double>();
  for (double& x : v) x = 0.5 + 2.0 * x;
  Tensor t = from_vector(v, shape, DType::F64);
  t.requires_grad_();
  return t;
}

struct UnaryCase {
  std::string name;
  Tensor (*op)(const Tensor&);
  double (*ref)(double);
  bool positive;  // needs inputs > 0
};

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

const std::vector<UnaryCase>& unary_cases() {
  static const std::vector<UnaryCase> cases = {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, false},
      {"exp", [](const Tensor& x) { return lintape::exp(x); }, [](double x) { return std::exp(x); }, false},
      {"log", [](const Tensor& x) { return lintape::log(x); }, [](double x) { return std::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return lintape::sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, true},
      {"tanh", [](const Tensor& x) { return lintape::tanh(x); }, [](double x) { return std::tanh(x); }, false},
      {"cos", [](const Tensor& x) { return lintape::cos(x); }, [](double x) { return std::cos(x); }, false},
      {"sin", [](const Tensor& x) { return lintape::sin(x); }, [](double x) { return std::sin(x); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0; }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1 / (1 + std::exp(-x)); }, false},
      {"silu", [](const Tensor& x) { return silu(x); }, [](double x) { return x / (1 + std::exp(-x)); }, false},
      {"gelu", [](const Tensor& x) { return gelu(x); }, gelu_ref, false},
  };
  return cases;
}

void gradcheck_unary(const std::string& name) {
  for (const UnaryCase& c : unary_cases()) {
    if (name != c.name) continue;
    // relu's kink at 0 is kept away from the finite differences by the shift.
    Tensor x = c.positive ? positive_leaf({2, 3, 4}, 11) : leaf({2, 3, 4}, 11, 0.05);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return c.op(in[0]); }, std::vector<Tensor>{x});
    // a non-contiguous input
    Tensor y = c.positive ? positive_leaf({4, 3}, 12) : leaf({4, 3}, 12, 0.05);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return c.op(in[0].transpose(0, 1)); },
                    std::vector<Tensor>{y});
    return;
  }
  FAIL("no unary case " << name);
}

Tensor binary_op(const std::string& name, const Tensor& a, const Tensor& b) {
  if (name == "add") return add(a, b);
  if (name == "sub") return sub(a, b);
  if (name == "mul") return mul(a, b);
  return div(a, b);
}

// Broadcasting pairs: equal shapes, a trailing row, a column against a row, a missing leading dim.
const std::vector<std::pair<Shape, Shape>> kBroadcastPairs = {
    {{2, 3}, {2, 3}}, {{2, 3, 4}, {4}}, {{3, 1}, {1, 4}}, {{2, 1, 4}, {3, 1}}, {{1}, {2, 3}}};

void gradcheck_binary(const std::string& name) {
  for (const auto& [sa, sb] : kBroadcastPairs) {
    CAPTURE(shape_str(sa));
    CAPTURE(shape_str(sb));
    Tensor a = leaf(sa, 21), b = name == "div" ? positive_leaf(sb, 22) : leaf(sb, 22);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return binary_op(name, in[0], in[1]); },
                    (std::vector<Tensor>{a, b}));
  }
}

// The CUDA op on `dtype` inputs against the CPU op on the f64 copies of the same (rounded) values, for
// the output and for every input's gradient.
void compare_cuda(const Fn& f, const std::vector<Shape>& shapes, DType dtype, bool positive = false) {
  std::vector<Tensor> dev, ref;
  for (size_t k = 0; k < shapes.size(); ++k) {
    Tensor base = positive ? positive_leaf(shapes[k], 100 + k) : randn(shapes[k], DType::F64, Device::cpu(), 100 + k);
    Tensor d = base.detach().to(dtype).to(gpu());
    d.requires_grad_();
    Tensor r = d.detach().to(Device::cpu()).to(DType::F64);
    r.requires_grad_();
    dev.push_back(d);
    ref.push_back(r);
  }
  Tensor out = f(dev), out_ref = f(ref);
  REQUIRE(out.is_cuda());
  REQUIRE(out.dtype() == dtype);
  CHECK_CLOSE_TENSOR(out, out_ref, dtype);
  Tensor dy = randn(out.shape(), dtype, gpu(), 7);
  backward(out, dy);
  backward(out_ref, dy.to(Device::cpu()).to(DType::F64));
  for (size_t k = 0; k < shapes.size(); ++k) {
    CAPTURE(k);
    REQUIRE(dev[k].grad().defined());
    CHECK_CLOSE_TENSOR(dev[k].grad(), ref[k].grad(), dtype);
  }
}

const std::vector<DType> kCudaDtypes = {DType::F32, DType::BF16, DType::F16};

}  // namespace

TEST_CASE("add sub mul div broadcast values") {
  Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::F64);
  Tensor b = from_vector({10, 20, 30}, {3}, DType::F64);
  Tensor c = from_vector({2, 4}, {2, 1}, DType::F64);
  CHECK(add(a, b).to_vector<double>() == std::vector<double>{11, 22, 33, 14, 25, 36});
  CHECK(sub(a, b).to_vector<double>() == std::vector<double>{-9, -18, -27, -6, -15, -24});
  CHECK(mul(a, c).to_vector<double>() == std::vector<double>{2, 4, 6, 16, 20, 24});
  CHECK(div(a, c).to_vector<double>() == std::vector<double>{0.5, 1, 1.5, 1, 1.25, 1.5});
  Tensor outer = mul(c, b);  // (2, 1) * (3) -> (2, 3)
  CHECK(outer.shape() == Shape{2, 3});
  CHECK(outer.to_vector<double>() == std::vector<double>{20, 40, 60, 40, 80, 120});
  CHECK((a + 1.0).to_vector<double>() == std::vector<double>{2, 3, 4, 5, 6, 7});
  CHECK((2.0 * a - 1.0).to_vector<double>() == std::vector<double>{1, 3, 5, 7, 9, 11});
  CHECK((a / 2.0).to_vector<double>() == std::vector<double>{0.5, 1, 1.5, 2, 2.5, 3});
  CHECK((-a).to_vector<double>() == std::vector<double>{-1, -2, -3, -4, -5, -6});
  // a strided operand: the transpose of a (3, 2) tensor
  Tensor t = from_vector({1, 4, 2, 5, 3, 6}, {3, 2}, DType::F64).transpose(0, 1);
  CHECK(sub(a, t).to_vector<double>() == std::vector<double>(6, 0.0));
}

TEST_CASE("unary ops values") {
  for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
    Tensor x = randn({5, 7}, DType::F64, Device::cpu(), 3);
    Tensor xp = positive_leaf({5, 7}, 4).detach();
    for (const UnaryCase& c : unary_cases()) {
      CAPTURE(c.name);
      INFO("dtype " << dtype_name(dt));
      Tensor in = (c.positive ? xp : x).to(dt);
      Tensor out = c.op(in);
      CHECK(out.dtype() == dt);
      std::vector<double> v = in.to_vector<double>(), expect(v.size());
      for (size_t i = 0; i < v.size(); ++i) expect[i] = c.ref(v[i]);
      CHECK_CLOSE_TENSOR(out, from_vector(expect, in.shape(), DType::F64), dt);
    }
  }
}

TEST_CASE("sum_to_shape") {
  Tensor g = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, DType::F64);
  CHECK(sum_to_shape(g, {2, 3}).to_vector<double>() == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK(sum_to_shape(g, {3}).to_vector<double>() == std::vector<double>{5, 7, 9});
  CHECK(sum_to_shape(g, {2, 1}).to_vector<double>() == std::vector<double>{6, 15});
  CHECK(sum_to_shape(g, {1, 3}).shape() == Shape{1, 3});
  CHECK(sum_to_shape(g, {}).item() == 21);
}

TEST_CASE("gradcheck add") { gradcheck_binary("add"); }
TEST_CASE("gradcheck sub") { gradcheck_binary("sub"); }
TEST_CASE("gradcheck mul") { gradcheck_binary("mul"); }
TEST_CASE("gradcheck div") { gradcheck_binary("div"); }
TEST_CASE("gradcheck mul and add with scalars") {
  Tensor x = leaf({2, 3}, 5);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return 3.0 * in[0] + 1.5; }, std::vector<Tensor>{x});
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0] / 4.0 - 2.0; }, std::vector<Tensor>{x});
}
TEST_CASE("gradcheck mul with the same tensor twice") {
  Tensor x = leaf({3, 4}, 6);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return mul(in[0], in[0]) + in[0]; }, std::vector<Tensor>{x});
}
TEST_CASE("gradcheck sum_to_shape") {
  Tensor x = leaf({2, 3, 4}, 8);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return sum_to_shape(in[0], {3, 1}); }, std::vector<Tensor>{x});
}

TEST_CASE("gradcheck neg") { gradcheck_unary("neg"); }
TEST_CASE("gradcheck exp") { gradcheck_unary("exp"); }
TEST_CASE("gradcheck log") { gradcheck_unary("log"); }
TEST_CASE("gradcheck sqrt") { gradcheck_unary("sqrt"); }
TEST_CASE("gradcheck rsqrt") { gradcheck_unary("rsqrt"); }
TEST_CASE("gradcheck tanh") { gradcheck_unary("tanh"); }
TEST_CASE("gradcheck cos") { gradcheck_unary("cos"); }
TEST_CASE("gradcheck sin") { gradcheck_unary("sin"); }
TEST_CASE("gradcheck relu") { gradcheck_unary("relu"); }
TEST_CASE("gradcheck sigmoid") { gradcheck_unary("sigmoid"); }
TEST_CASE("gradcheck silu") { gradcheck_unary("silu"); }
TEST_CASE("gradcheck gelu") { gradcheck_unary("gelu"); }

TEST_CASE("bad input: binary shapes that do not broadcast") {
  Tensor a = zeros({3, 4}), b = zeros({5});
  check_throws_containing([&] { add(a, b); }, {"[add]", "(3, 4)", "(5)", "broadcast", "equal sizes or 1"});
  check_throws_containing([&] { mul(zeros({2, 3}), zeros({3, 2})); }, {"[mul]", "(2, 3)", "(3, 2)"});
}

TEST_CASE("bad input: binary dtype mismatch") {
  check_throws_containing([] { sub(zeros({2}), zeros({2}, DType::F64)); }, {"[sub]", "one dtype", "f32", "f64"});
}

TEST_CASE("bad input: binary device mismatch" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  check_throws_containing([] { div(zeros({2}), zeros({2}, DType::F32, gpu())); },
                          {"[div]", "one device", "cpu", "cuda:0"});
}

TEST_CASE("bad input: log of an int tensor") {
  Tensor ids = from_vector_i64({1, 2, 3}, {3});
  check_throws_containing([&] { lintape::log(ids); }, {"[log]", "expected a float dtype", "i64"});
  check_throws_containing([&] { add(ids, ids); }, {"[add]", "expected a float dtype", "i64"});
}

TEST_CASE("bad input: sum_to_shape to a shape that does not broadcast") {
  check_throws_containing([] { sum_to_shape(zeros({2, 3}), {4}); }, {"[sum_to_shape]", "(2, 3)", "(4)"});
  check_throws_containing([] { sum_to_shape(zeros({3}), {2, 3}); }, {"[sum_to_shape]", "(3)", "(2, 3)"});
}

namespace {

// Binary ops on odd sizes, broadcasting every way, in f32, bf16 and f16.
void cuda_binary(const std::string& name) {
  const std::vector<std::pair<Shape, Shape>> pairs = {
      {{3, 37, 129}, {3, 37, 129}}, {{37, 1}, {1, 129}}, {{3, 37, 129}, {129}}, {{2, 1, 5}, {3, 1}},
      {{1}, {129}}, {{5, 1}, {5, 200003}},
      // inner dims of 64: the 16-byte path, with a broadcast operand read as repeated elements or packs
      {{7, 64}, {64}}, {{4, 3, 64}, {3, 1}}, {{1}, {4, 64}}};
  for (DType dt : kCudaDtypes)
    for (const auto& [sa, sb] : pairs) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(sa));
      CAPTURE(shape_str(sb));
      // div: positive operands, so that no quotient explodes
      compare_cuda([&](const std::vector<Tensor>& in) { return binary_op(name, in[0], in[1]); }, {sa, sb}, dt,
                   name == "div");
    }
  // a transposed operand, and slices at odd offsets (no 16-byte alignment)
  compare_cuda([&](const std::vector<Tensor>& in) { return binary_op(name, in[0].transpose(0, 1), in[1]); },
               {{129, 37}, {37, 129}}, DType::BF16, name == "div");
  compare_cuda(
      [&](const std::vector<Tensor>& in) { return binary_op(name, in[0].narrow(1, 1, 128), in[1].narrow(1, 0, 128)); },
      {{37, 129}, {37, 129}}, DType::F32, name == "div");
}

// A unary op in f32, bf16, f16 and f64, on a contiguous and a transposed (strided) input.
void cuda_unary(const std::string& name) {
  for (const UnaryCase& c : unary_cases()) {
    if (name != c.name) continue;
    for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
      INFO("dtype " << dtype_name(dt));
      compare_cuda([&](const std::vector<Tensor>& in) { return c.op(in[0]); }, {{3, 37, 129}}, dt, c.positive);
      compare_cuda([&](const std::vector<Tensor>& in) { return c.op(in[0].transpose(0, 2)); }, {{129, 37, 3}}, dt,
                   c.positive);
    }
    return;
  }
  FAIL("no unary case " << name);
}

}  // namespace

TEST_CASE("cuda add matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_binary("add"); }
TEST_CASE("cuda sub matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_binary("sub"); }
TEST_CASE("cuda mul matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_binary("mul"); }
TEST_CASE("cuda div matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_binary("div"); }
TEST_CASE("cuda add and mul with scalars match cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : kCudaDtypes) {
    INFO("dtype " << dtype_name(dt));
    compare_cuda([](const std::vector<Tensor>& in) { return 3.0 * in[0] + 0.25; }, {{3, 37, 129}}, dt);
  }
}
TEST_CASE("cuda neg matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("neg"); }
TEST_CASE("cuda exp matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("exp"); }
TEST_CASE("cuda log matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("log"); }
TEST_CASE("cuda sqrt matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("sqrt"); }
TEST_CASE("cuda rsqrt matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("rsqrt"); }
TEST_CASE("cuda tanh matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("tanh"); }
TEST_CASE("cuda cos matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("cos"); }
TEST_CASE("cuda sin matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("sin"); }
TEST_CASE("cuda relu matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("relu"); }
TEST_CASE("cuda sigmoid matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("sigmoid"); }
TEST_CASE("cuda silu matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("silu"); }
TEST_CASE("cuda gelu matches cpu" * LT_CUDA_CASE) { LT_REQUIRE_CUDA(); cuda_unary("gelu"); }

// SwiGLU: one fused op over h = [u, gate], equal to the composed silu(gate) * u in values and gradients.
Tensor swiglu_composed(const Tensor& h) {
  const int64_t F = h.size(-1) / 2;
  return mul(silu(h.narrow(-1, F, F)), h.narrow(-1, 0, F));
}

TEST_CASE("gradcheck swiglu") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, std::vector<Tensor>{leaf({2, 3, 8}, 21)});
  // a non-contiguous input
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return swiglu(in[0].transpose(0, 1)); },
                  std::vector<Tensor>{leaf({6, 3}, 22)});
}

TEST_CASE("swiglu equals silu(gate) * u, values and gradients") {
  Tensor a = leaf({3, 5, 14}, 23), b = leaf({3, 5, 14}, 23);
  Tensor out = swiglu(a), ref = swiglu_composed(b);
  REQUIRE(out.shape() == Shape{3, 5, 7});
  CHECK_CLOSE_TENSOR(out, ref, DType::F64);
  Tensor dy = randn({3, 5, 7}, DType::F64, Device::cpu(), 24);
  backward(out, dy);
  backward(ref, dy);
  CHECK_CLOSE_TENSOR(a.grad(), b.grad(), DType::F64);
}

TEST_CASE("bad input: swiglu of an odd last dim") {
  check_throws_containing([] { swiglu(zeros({4, 7})); }, {"[swiglu]", "even last dim", "(4, 7)"});
}

// swiglu_linear: swiglu then a product with w^T, the SwiGLU output made again in the backward.
Tensor swiglu_linear_composed(const Tensor& h, const Tensor& w) { return matmul(swiglu(h), w, false, true); }

TEST_CASE("gradcheck swiglu_linear") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return swiglu_linear(in[0], in[1]); },
                  (std::vector<Tensor>{leaf({2, 3, 8}, 25), leaf({5, 4}, 26)}));
}

TEST_CASE("swiglu_linear equals swiglu then matmul, values and gradients, and holds no SwiGLU output") {
  Tensor h = leaf({4, 16, 64}, 27), w = leaf({3, 32}, 28);
  Tensor h2 = h.detach().clone().requires_grad_(), w2 = w.detach().clone().requires_grad_();
  const size_t before = memory_stats(Device::cpu()).in_use;
  Tensor out = swiglu_linear(h, w);
  // Only the output (1.5 KiB) stays: not the SwiGLU output (16 KiB), nor a copy of h.
  CHECK(memory_stats(Device::cpu()).in_use - before < 4096);
  Tensor ref = swiglu_linear_composed(h2, w2);
  REQUIRE(out.shape() == Shape{4, 16, 3});
  CHECK_CLOSE_TENSOR(out, ref, DType::F64);
  Tensor dy = randn({4, 16, 3}, DType::F64, Device::cpu(), 29);
  backward(out, dy);
  backward(ref, dy);
  CHECK_CLOSE_TENSOR(h.grad(), h2.grad(), DType::F64);
  CHECK_CLOSE_TENSOR(w.grad(), w2.grad(), DType::F64);
}

TEST_CASE("bad input: swiglu_linear") {
  check_throws_containing([] { swiglu_linear(zeros({4, 8}), zeros({3, 5})); },
                          {"[swiglu_linear]", "(C, F) with F = 4", "(3, 5)"});
  check_throws_containing([] { swiglu_linear(zeros({4, 8}), zeros({3, 4}, DType::F64)); },
                          {"[swiglu_linear]", "dtype", "f32", "f64"});
  check_throws_containing([] { swiglu_linear(zeros({4, 7}), zeros({3, 4})); }, {"[swiglu_linear]", "even last dim"});
}

TEST_CASE("cuda swiglu_linear matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO("dtype " << dtype_name(dt));
    // 16-byte packs (F = 64) and one element at a time (F = 37), a strided h
    compare_cuda([](const std::vector<Tensor>& in) { return swiglu_linear(in[0], in[1]); }, {{3, 37, 128}, {48, 64}},
                 dt);
    compare_cuda([](const std::vector<Tensor>& in) { return swiglu_linear(in[0].transpose(0, 1), in[1]); },
                 {{74, 5}, {9, 37}}, dt);
  }
}

TEST_CASE("cuda swiglu matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    INFO("dtype " << dtype_name(dt));
    // 16-byte packs (F = 64), one element at a time (F = 37), and a strided input
    compare_cuda([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, {{3, 37, 128}}, dt);
    compare_cuda([](const std::vector<Tensor>& in) { return swiglu(in[0]); }, {{5, 74}}, dt);
    compare_cuda([](const std::vector<Tensor>& in) { return swiglu(in[0].transpose(0, 1)); }, {{64, 9}}, dt);
  }
}
