#include <cmath>
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"

using namespace lintape;
using namespace lintape::test;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
using Dims = std::vector<int64_t>;

// 0, 1, 2, ... as f64 in the given shape.
Tensor iota(const Shape& shape) { return arange(0, shape_numel(shape), DType::F64).reshape(shape); }

// The CUDA op on a `dtype` input against the CPU op on the f64 copy of the same (rounded) values, for
// the output and the input's gradient.
void compare_cuda(const Fn& f, const Shape& shape, DType dtype) {
  Tensor x = randn(shape, dtype, gpu(), 31);
  x.requires_grad_();
  Tensor xr = x.detach().to(Device::cpu()).to(DType::F64);
  xr.requires_grad_();
  Tensor out = f({x}), out_ref = f({xr});
  REQUIRE(out.is_cuda());
  REQUIRE(out.shape() == out_ref.shape());
  CHECK_CLOSE_TENSOR(out, out_ref, dtype);
  Tensor dy = randn(out.shape(), dtype, gpu(), 32);
  backward(out, dy);
  backward(out_ref, dy.to(Device::cpu()).to(DType::F64));
  CHECK_CLOSE_TENSOR(x.grad(), xr.grad(), dtype);
}

const std::vector<std::pair<Dims, bool>> kSumDims = {
    {{}, false}, {{1}, false}, {{0, 2}, true}, {{-1}, true}, {{2, 0}, false}, {{0, 1}, false}};

}  // namespace

TEST_CASE("sum and mean values") {
  Tensor x = iota({2, 3, 4});
  CHECK(sum(x).item() == 276);
  CHECK(sum(x).shape() == Shape{});
  CHECK(sum(x, {}, true).shape() == Shape{1, 1, 1});
  CHECK(sum(x, {2}).to_vector<double>() == std::vector<double>{6, 22, 38, 54, 70, 86});
  CHECK(sum(x, {1}, true).shape() == Shape{2, 1, 4});
  CHECK(sum(x, {1}).to_vector<double>() == std::vector<double>{12, 15, 18, 21, 48, 51, 54, 57});
  CHECK(sum(x, {0, 2}).to_vector<double>() == std::vector<double>{60, 92, 124});  // not adjacent
  CHECK(sum(x, {-1, -3}).to_vector<double>() == std::vector<double>{60, 92, 124});
  CHECK(mean(x, {1, 2}).to_vector<double>() == std::vector<double>{5.5, 17.5});
  CHECK(mean(x, {0}, true).shape() == Shape{1, 3, 4});
  Tensor strided_sum = sum(x.transpose(0, 2), {0});  // (3, 2): the transpose of sum(x, {2})
  CHECK(strided_sum.to_vector<double>() == sum(x, {2}).transpose(0, 1).contiguous().to_vector<double>());
  // f32 and bf16 accumulate in a wider type
  CHECK(sum(ones({1000}, DType::BF16)).item() == 1000);
}

TEST_CASE("max values and indices") {
  Tensor x = from_vector({1, 3, 3, 2, 5, 0, 5, -1}, {2, 4}, DType::F32);
  MaxResult r = max(x, 1);
  CHECK(r.values.to_vector<double>() == std::vector<double>{3, 5});
  CHECK(r.indices.to_vector<int64_t>() == std::vector<int64_t>{1, 0});  // the first of equal maxima
  CHECK(r.indices.dtype() == DType::I64);
  MaxResult c = max(x, 0, true);
  CHECK(c.values.shape() == Shape{1, 4});
  CHECK(c.values.to_vector<double>() == std::vector<double>{5, 3, 5, 2});
  CHECK(c.indices.to_vector<int64_t>() == std::vector<int64_t>{1, 0, 1, 0});
  Tensor n = from_vector({1, NAN, 2, NAN}, {4}, DType::F64);
  CHECK(max(n, 0).indices.item() == 1);  // NaN wins
}

TEST_CASE("softmax and log_softmax values") {
  Tensor x = from_vector({1, 2, 3, -1000, 0, 1000}, {2, 3}, DType::F64);
  double e = std::exp(1.0), z = 1 + e + e * e;
  CHECK_CLOSE_TENSOR(softmax(x, 1), from_vector({1 / z, e / z, e * e / z, 0, 0, 1}, {2, 3}, DType::F64), DType::F64);
  // stable for large inputs: row 2 is exactly (-2000, -1000, 0)
  double lz = std::log(z);
  CHECK_CLOSE_TENSOR(log_softmax(x, -1), from_vector({-lz, 1 - lz, 2 - lz, -2000, -1000, 0}, {2, 3}, DType::F64),
                     DType::F64);
  // over dim 0 of a (2, 3) tensor: every column sums to 1
  CHECK_CLOSE_TENSOR(sum(softmax(x, 0), {0}), ones({3}, DType::F64), DType::F64);
  Tensor b = randn({4, 5, 6}, DType::BF16, Device::cpu(), 2);
  CHECK_CLOSE_TENSOR(sum(softmax(b, 1), {1}), ones({4, 6}, DType::F64), DType::BF16);
}

TEST_CASE("gradcheck sum") {
  for (const auto& [dims, keepdim] : kSumDims) {
    CAPTURE(shape_str(dims));
    CAPTURE(keepdim);
    Tensor x = leaf({2, 3, 4}, 41);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return sum(in[0], dims, keepdim); }, std::vector<Tensor>{x});
  }
  Tensor t = leaf({4, 3}, 42);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return sum(in[0].transpose(0, 1), {1}); },
                  std::vector<Tensor>{t});
}

TEST_CASE("gradcheck mean") {
  for (const auto& [dims, keepdim] : kSumDims) {
    CAPTURE(shape_str(dims));
    CAPTURE(keepdim);
    Tensor x = leaf({2, 3, 4}, 43);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return mean(in[0], dims, keepdim); }, std::vector<Tensor>{x});
  }
}

TEST_CASE("gradcheck max") {
  for (int64_t dim : {0, 1, -1})
    for (bool keepdim : {false, true}) {
      CAPTURE(dim);
      CAPTURE(keepdim);
      Tensor x = leaf({2, 3, 4}, 44);  // distinct values: the argmax is stable under finite differences
      CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return max(in[0], dim, keepdim).values; },
                      std::vector<Tensor>{x});
    }
}

TEST_CASE("gradcheck softmax") {
  for (int64_t dim : {0, 1, -1}) {
    CAPTURE(dim);
    Tensor x = leaf({2, 3, 4}, 45);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return softmax(in[0], dim); }, std::vector<Tensor>{x});
  }
}

TEST_CASE("gradcheck log_softmax") {
  for (int64_t dim : {0, 1, -1}) {
    CAPTURE(dim);
    Tensor x = leaf({2, 3, 4}, 46);
    CHECK_GRADCHECK([&](const std::vector<Tensor>& in) { return log_softmax(in[0], dim); }, std::vector<Tensor>{x});
  }
}

TEST_CASE("bad input: unknown dim") {
  Tensor x = zeros({2, 3, 4});
  check_throws_containing([&] { sum(x, {3}); }, {"[sum]", "dim 3", "3 dims"});
  check_throws_containing([&] { mean(x, {0, -4}); }, {"[mean]", "dim -4", "3 dims"});
  check_throws_containing([&] { max(x, 5); }, {"[max]", "dim 5"});
  check_throws_containing([&] { softmax(x, -4); }, {"[softmax]", "dim -4"});
  check_throws_containing([&] { log_softmax(x, 3); }, {"[log_softmax]", "dim 3"});
}

TEST_CASE("bad input: repeated dim") {
  Tensor x = zeros({2, 3, 4});
  check_throws_containing([&] { sum(x, {1, -2}); }, {"[sum]", "expected distinct dims", "(1, -2)"});
  check_throws_containing([&] { mean(x, {0, 0}); }, {"[mean]", "expected distinct dims", "(0, 0)"});
}

TEST_CASE("bad input: reduction of an int tensor") {
  Tensor ids = from_vector_i64({1, 2, 3}, {3});
  check_throws_containing([&] { sum(ids); }, {"[sum]", "expected a float dtype", "i64"});
  check_throws_containing([&] { softmax(ids, 0); }, {"[softmax]", "expected a float dtype", "i64"});
}

TEST_CASE("bad input: max over an empty dim") {
  check_throws_containing([] { max(zeros({2, 0}), 1); }, {"[max]", "non-empty", "(2, 0)"});
}

TEST_CASE("cuda sum matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const auto& [dims, keepdim] : kSumDims) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(dims));
      CAPTURE(keepdim);
      compare_cuda([&](const std::vector<Tensor>& in) { return sum(in[0], dims, keepdim); }, {3, 37, 129}, dt);
    }
}

TEST_CASE("cuda sum of long rows and long columns matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // few long rows or columns: the sum is split into partial sums and a second pass
  const std::vector<std::pair<Shape, Dims>> cases = {
      {{2, 50001}, {1}}, {{3, 65536}, {-1}}, {{40001, 3}, {0}}, {{5000, 129}, {0}}, {{7, 300001}, {}}};
  for (DType dt : {DType::F32, DType::BF16})
    for (const auto& [shape, dims] : cases) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(shape));
      compare_cuda([&](const std::vector<Tensor>& in) { return sum(in[0], dims); }, shape, dt);
    }
}

TEST_CASE("cuda mean matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dt : {DType::F32, DType::BF16})
    for (const auto& [dims, keepdim] : kSumDims) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(dims));
      compare_cuda([&](const std::vector<Tensor>& in) { return mean(in[0], dims, keepdim); }, {3, 37, 129}, dt);
    }
}

TEST_CASE("cuda max matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const std::vector<std::pair<Shape, int64_t>> cases = {{{3, 37, 129}, 0}, {{3, 37, 129}, 1}, {{3, 37, 129}, 2},
                                                         {{5, 1024}, -1},  {{7, 4099}, 1}, {{4, 300, 3}, 1}};
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const auto& [shape, dim] : cases) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(shape));
      CAPTURE(dim);
      compare_cuda([&](const std::vector<Tensor>& in) { return max(in[0], dim).values; }, shape, dt);
      Tensor x = randn(shape, dt, gpu(), 31);
      MaxResult r = max(x, dim, true), ref = max(x.to(Device::cpu()).to(DType::F64), dim, true);
      CHECK(r.indices.to_vector<int64_t>() == ref.indices.to_vector<int64_t>());
    }
}

TEST_CASE("cuda softmax matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const std::vector<std::pair<Shape, int64_t>> cases = {{{3, 37, 129}, 0}, {{3, 37, 129}, 1}, {{3, 37, 129}, -1},
                                                         {{64, 1024}, 1},  {{7, 4099}, 1}, {{4, 300, 3}, 1}};
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (const auto& [shape, dim] : cases) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(shape));
      CAPTURE(dim);
      compare_cuda([&](const std::vector<Tensor>& in) { return softmax(in[0], dim); }, shape, dt);
    }
  compare_cuda([](const std::vector<Tensor>& in) { return softmax(in[0].transpose(0, 1), 1); }, {129, 37}, DType::F32);
}

TEST_CASE("cuda log_softmax matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const std::vector<std::pair<Shape, int64_t>> cases = {{{3, 37, 129}, 0}, {{3, 37, 129}, 1}, {{3, 37, 129}, -1},
                                                         {{64, 1024}, 1},  {{7, 4099}, 1}, {{4, 300, 3}, 1}};
  for (DType dt : {DType::F32, DType::BF16})
    for (const auto& [shape, dim] : cases) {
      INFO("dtype " << dtype_name(dt));
      CAPTURE(shape_str(shape));
      CAPTURE(dim);
      compare_cuda([&](const std::vector<Tensor>& in) { return log_softmax(in[0], dim); }, shape, dt);
    }
}
