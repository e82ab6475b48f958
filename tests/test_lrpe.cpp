// LRPE family: gradient checks of the reference, fused CUDA vs reference, memory
// of the fused path, and the input errors.
#include <cmath>
#include <functional>
#include <string>
#include <vector>
#include "core/allocator.h"
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/lrpe/lrpe.h"
#include "ops/lrpe/launch.h"

using namespace lintape;
using namespace lintape::test;

namespace {

using OpFn = std::function<Tensor(const Tensor& x, const Tensor& theta, Impl impl)>;

OpFn cosine_op(LrpeOptions o) {
  return [o](const Tensor& x, const Tensor& th, Impl impl) { return lrpe_cosine(x, th, o, impl); };
}
OpFn rotate_op(LrpeOptions o) {
  return [o](const Tensor& x, const Tensor& th, Impl impl) { return lrpe_rotate(x, th, o, impl); };
}
OpFn md_op(MdLrpeOptions o) {
  return [o](const Tensor& x, const Tensor& th, Impl impl) { return md_lrpe_cosine(x, th, o, impl); };
}

LrpeOptions opts(Act act, ActDim dim = ActDim::None, int64_t offset = 0) { return {offset, act, dim}; }
MdLrpeOptions md_opts(std::vector<int64_t> grid, int64_t L, Act act = Act::None, ActDim dim = ActDim::None,
                      bool cache = false) {
  return {std::move(grid), L, act, dim, cache};
}

struct Act2 {
  const char* name;
  Act act;
  ActDim dim;
};
const std::vector<Act2> kActs = {{"none", Act::None, ActDim::None},
                                 {"relu", Act::Relu, ActDim::None},
                                 {"sigmoid", Act::Sigmoid, ActDim::None},
                                 {"silu", Act::Silu, ActDim::None},
                                 {"softmax feature", Act::Softmax, ActDim::Feature},
                                 {"softmax sequence", Act::Softmax, ActDim::Sequence}};

// One configuration on small CPU shapes.
struct Config {
  std::string name;
  OpFn op;
  Shape x, theta;
};

// Every option of each op on shapes like B=2, N=5, H=2, D=4 (D=6 for rotate, so that E < D/2 exists).
std::vector<Config> cosine_configs() {
  std::vector<Config> c;
  for (const Act2& a : kActs) c.push_back({str("act ", a.name), cosine_op(opts(a.act, a.dim)), {2, 5, 2, 4}, {2, 4}});
  c.push_back({"theta (1, E)", cosine_op(opts(Act::Silu)), {2, 5, 2, 4}, {1, 4}});
  c.push_back({"theta (H, 1)", cosine_op(opts(Act::None, ActDim::None, 2)), {2, 5, 2, 4}, {2, 1}});
  c.push_back({"E < D, offset 3", cosine_op(opts(Act::Sigmoid, ActDim::None, 3)), {2, 5, 2, 4}, {2, 2}});
  c.push_back({"softmax sequence, E < D, offset 7", cosine_op(opts(Act::Softmax, ActDim::Sequence, 7)),
               {2, 5, 2, 4}, {1, 3}});
  return c;
}

std::vector<Config> rotate_configs() {
  std::vector<Config> c;
  for (const Act2& a : kActs) c.push_back({str("act ", a.name), rotate_op(opts(a.act, a.dim)), {2, 5, 2, 6}, {2, 3}});
  c.push_back({"theta (1, E)", rotate_op(opts(Act::Silu)), {2, 5, 2, 6}, {1, 3}});
  c.push_back({"theta (H, 1)", rotate_op(opts(Act::None, ActDim::None, 2)), {2, 5, 2, 6}, {2, 1}});
  c.push_back({"E < D/2, offset 3", rotate_op(opts(Act::Softmax, ActDim::Feature, 3)), {2, 5, 2, 6}, {2, 2}});
  return c;
}

std::vector<Config> md_configs() {
  std::vector<Config> c;
  for (const Act2& a : kActs)
    c.push_back({str("2d L=1 act ", a.name), md_op(md_opts({2, 2}, 1, a.act, a.dim)), {2, 5, 2, 4}, {2, 2}});
  c.push_back({"1d L=0", md_op(md_opts({5}, 0)), {2, 5, 2, 4}, {2, 4}});
  c.push_back({"1d L=2 theta (1, E)", md_op(md_opts({3}, 2, Act::Silu)), {2, 5, 2, 4}, {1, 4}});
  c.push_back({"2d L=0", md_op(md_opts({2, 2}, 0, Act::Relu)), {2, 4, 2, 4}, {2, 2}});
  c.push_back({"3d L=0 theta (1, E)", md_op(md_opts({1, 2, 2}, 0)), {2, 4, 2, 4}, {1, 2}});
  c.push_back({"3d L=1 k*E > D", md_op(md_opts({2, 1, 2}, 1, Act::Softmax, ActDim::Sequence)), {2, 5, 2, 4}, {2, 2}});
  c.push_back({"4d L=1", md_op(md_opts({1, 2, 1, 2}, 1, Act::Sigmoid)), {2, 5, 2, 4}, {2, 1}});
  return c;
}

void gradcheck_configs(const std::vector<Config>& configs, Impl impl) {
  uint64_t seed = 1;
  for (const Config& c : configs) {
    CAPTURE(c.name);
    Tensor theta = rates(c.theta);
    auto f = [&](const std::vector<Tensor>& in) { return c.op(in[0], in[1], impl); };
    // Kept away from 0 so that relu's kink is never inside a finite difference.
    CHECK_GRADCHECK(f, (std::vector<Tensor>{leaf(c.x, seed++, 0.05), theta}));
  }
}

// out and dx (for a random dout) of one impl; x keeps its values, the result is on the CPU.
struct Result {
  Tensor out, dx;
};
Result run(const OpFn& op, const Tensor& x_in, const Tensor& theta, Impl impl, const Tensor& dout) {
  Tensor x = x_in.detach();
  x.requires_grad_();
  Tensor out = op(x, theta, impl);
  backward(out, dout.to(out.device()).to(out.dtype()));
  return {out.to(Device::cpu()), x.grad().to(Device::cpu())};
}

// impl on x (any dtype and device) against the reference in f64 on the CPU.
void check_against_reference(const OpFn& op, const Tensor& x, const Tensor& theta, Impl impl, uint64_t seed) {
  Tensor x64 = x.to(Device::cpu()).to(DType::F64), theta_cpu = theta.to(Device::cpu());
  Tensor ref_out = op(x64, theta_cpu, Impl::Reference);
  Tensor dout = randn(ref_out.shape(), x.dtype(), x.device(), seed);
  Result ref = run(op, x64, theta_cpu, Impl::Reference, dout.to(Device::cpu()).to(DType::F64));
  Result got = run(op, x, theta, impl, dout);
  CHECK_CLOSE_TENSOR(got.out, ref.out, x.dtype());
  CHECK_CLOSE_TENSOR(got.dx, ref.dx, x.dtype());
}

}  // namespace

TEST_CASE("gradcheck lrpe_cosine reference") { gradcheck_configs(cosine_configs(), Impl::Reference); }
TEST_CASE("gradcheck lrpe_rotate reference") { gradcheck_configs(rotate_configs(), Impl::Reference); }
TEST_CASE("gradcheck md_lrpe_cosine reference") { gradcheck_configs(md_configs(), Impl::Reference); }

TEST_CASE("gradcheck lrpe composed") {
  gradcheck_configs({{"cosine silu offset 2", cosine_op(opts(Act::Silu, ActDim::None, 2)), {2, 5, 2, 4}, {2, 2}},
                     {"rotate softmax feature", rotate_op(opts(Act::Softmax, ActDim::Feature)), {2, 5, 2, 6}, {1, 3}},
                     {"md 2d L=1 softmax sequence", md_op(md_opts({2, 2}, 1, Act::Softmax, ActDim::Sequence)),
                      {2, 5, 2, 4}, {2, 2}}},
                    Impl::Composed);
}

TEST_CASE("lrpe reference follows the formulas") {
  // One token at position 3, one head, D = 2, theta (1, 1) = 0.5: angles 1.5 for both features.
  Tensor x = from_vector({1.0, -2.0}, {1, 1, 1, 2}, DType::F64);
  Tensor th = from_vector({0.5}, {1, 1}, DType::F32);
  const double c = std::cos(1.5), s = std::sin(1.5);
  std::vector<double> cosine = lrpe_cosine(x, th, opts(Act::None, ActDim::None, 3)).to_vector<double>();
  std::vector<double> want = {c, -2 * c, s, -2 * s};
  for (size_t i = 0; i < want.size(); ++i) CHECK(cosine[i] == doctest::Approx(want[i]));
  std::vector<double> rot = lrpe_rotate(x, th, opts(Act::None, ActDim::None, 3)).to_vector<double>();
  CHECK(rot[0] == doctest::Approx(c + 2 * s));
  CHECK(rot[1] == doctest::Approx(s - 2 * c));
  // md 1d: the extra token in front keeps [x, 0]; grid tokens sit at coordinates 0 and 1.
  Tensor thm = from_vector({0.5, 0.25}, {1, 2}, DType::F32);
  std::vector<double> md = md_lrpe_cosine(ones({1, 3, 1, 2}, DType::F64), thm, md_opts({2}, 1)).to_vector<double>();
  want = {1, 1, 0, 0, 1, 1, 0, 0, std::cos(0.5), std::cos(0.25), std::sin(0.5), std::sin(0.25)};
  for (size_t i = 0; i < want.size(); ++i) CHECK(md[i] == doctest::Approx(want[i]));
  // md 2d, grid (2, 3), theta (1, 1): the last token has coordinates (1, 2), feature k uses axis k.
  md = md_lrpe_cosine(ones({1, 6, 1, 2}, DType::F64), th, md_opts({2, 3}, 0)).to_vector<double>();
  want = {std::cos(0.5), std::cos(1.0), std::sin(0.5), std::sin(1.0)};
  for (size_t i = 0; i < want.size(); ++i) CHECK(md[20 + i] == doctest::Approx(want[i]));
}

TEST_CASE("bad input lrpe") {
  Tensor x = randn({2, 5, 2, 4}, DType::F32, Device::cpu(), 1);
  Tensor th = rates({2, 4});
  check_throws_containing([&] { lrpe_rotate(randn({2, 5, 2, 5}), rates({2, 2})); },
                          {"[lrpe_rotate]", "D must be even", "got D = 5"});
  check_throws_containing([&] { lrpe_cosine(x, rates({2, 5})); },
                          {"[lrpe_cosine]", "theta must be (H, E), (1, E) or (H, 1)", "E <= D = 4", "got (2, 5)"});
  check_throws_containing([&] { lrpe_rotate(x, rates({2, 3})); },
                          {"[lrpe_rotate]", "E <= D/2 = 2", "got (2, 3)"});
  check_throws_containing([&] { lrpe_cosine(x, rates({3, 4})); }, {"[lrpe_cosine]", "H = 2", "got (3, 4)"});
  check_throws_containing([&] { md_lrpe_cosine(x, rates({3, 4}), md_opts({5}, 0)); },
                          {"[md_lrpe_cosine]", "theta must be (H, E) or (1, E)", "got (3, 4)"});
  check_throws_containing([&] { md_lrpe_cosine(x, th, md_opts({2, 2}, 0)); },
                          {"[md_lrpe_cosine]", "shape (2, 2) has 4 tokens", "N - L = 5 - 0 = 5"});
  check_throws_containing([&] { md_lrpe_cosine(x, th, md_opts({2}, 2)); },
                          {"[md_lrpe_cosine]", "has 2 tokens", "N - L = 5 - 2 = 3"});
  check_throws_containing([&] { md_lrpe_cosine(x, th, md_opts({}, 0)); },
                          {"[md_lrpe_cosine]", "shape must have 1 to 4 dims; got 0"});
  check_throws_containing([&] { md_lrpe_cosine(x, th, md_opts({5, 1, 1, 1, 1}, 0)); },
                          {"[md_lrpe_cosine]", "shape must have 1 to 4 dims; got 5"});
  check_throws_containing([&] { md_lrpe_cosine(x, rates({2, 1}), md_opts({5, 1}, 0)); },
                          {"[md_lrpe_cosine]", "k * E >= D = 4", "k = 2", "got (2, 1)"});
  check_throws_containing([&] { lrpe_cosine(x, th, opts(Act::Softmax)); },
                          {"[lrpe_cosine]", "softmax needs a dim"});
  check_throws_containing([&] { lrpe_rotate(x, rates({2, 2}), opts(Act::Silu, ActDim::Feature)); },
                          {"[lrpe_rotate]", "act silu is elementwise and takes no dim; got dim feature"});
  check_throws_containing([&] { md_lrpe_cosine(x, th, md_opts({5}, 0, Act::Relu, ActDim::Sequence)); },
                          {"[md_lrpe_cosine]", "act relu", "got dim sequence"});
  check_throws_containing([&] { lrpe_cosine(randn({2, 5, 4}), th); },
                          {"[lrpe_cosine]", "x must be (B, N, H, D); got (2, 5, 4)"});
  check_throws_containing([&] { lrpe_cosine(from_vector_i64(std::vector<int64_t>(80, 1), {2, 5, 2, 4}), th); },
                          {"[lrpe_cosine]", "x must be a float tensor", "got i64"});
  check_throws_containing([&] { lrpe_cosine(x, th, {}, Impl::Fused); },
                          {"[lrpe_cosine]", "Impl::Fused needs x on a CUDA device; got x on cpu"});
  check_throws_containing([&] { lrpe_cosine(x, th, opts(Act::None, ActDim::None, -1)); },
                          {"[lrpe_cosine]", "offset must be >= 0; got -1"});
  // theta is not differentiable: backward to a theta that requires grad names the op and the input.
  Tensor thl = rates({2, 4}).to(DType::F64);
  thl.requires_grad_();
  check_throws_containing([&] { backward(lrpe_cosine(leaf({2, 5, 2, 4}, 3), thl), randn({2, 5, 2, 8}, DType::F64)); },
                          {"[lrpe_cosine]", "'theta'"});
}

TEST_CASE("bad input lrpe x and theta on different devices" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor x = randn({2, 5, 2, 4}, DType::F32, gpu(), 1);
  check_throws_containing([&] { lrpe_cosine(x, rates({2, 4})); },
                          {"[lrpe_cosine]", "x and theta must be on the same device", "x on cuda:0", "theta on cpu"});
  check_throws_containing([&] { lrpe_cosine(x, rates({2, 4}, gpu()), {}, Impl::Reference); },
                          {"[lrpe_cosine]", "Impl::Reference runs on the CPU"});
}

// ---------------------------------------------------------------------------------------------------
// CUDA: the fused kernels against the f64 CPU reference.

namespace {

// Every act and theta shape on odd N and D in {64, 96, 128}, B = 2, H = 3, f32 and bf16.
void fused_matches_reference(const std::function<OpFn(Act, ActDim, int64_t offset)>& make, bool half_width) {
  uint64_t seed = 500;
  const int64_t H = 3;
  for (DType dt : {DType::F32, DType::BF16}) {
    int k = 0;
    for (const Act2& a : kActs) {
      const int64_t N = k % 2 ? 129 : 37, D = std::vector<int64_t>{64, 96, 128}[size_t(k % 3)];
      ++k;
      CAPTURE(a.name);
      CAPTURE(dtype_name(dt));
      CAPTURE(N);
      CAPTURE(D);
      check_against_reference(make(a.act, a.dim, 5), randn({2, N, H, D}, dt, gpu(), seed),
                              rates({H, half_width ? D / 2 : D}, gpu()),
                              Impl::Fused, seed + 1);
      seed += 2;
    }
  }
}

void fused_theta_shapes(const std::function<OpFn(Act, ActDim, int64_t offset)>& make, bool half_width) {
  const int64_t H = 3, D = 96, A = half_width ? D / 2 : D;
  uint64_t seed = 700;
  for (Shape ts : {Shape{1, A}, Shape{H, 1}, Shape{H, A - 17}, Shape{1, 5}}) {
    CAPTURE(shape_str(ts));
    check_against_reference(make(Act::Silu, ActDim::None, 11), randn({2, 37, H, D}, DType::BF16, gpu(), seed),
                            rates(ts, gpu()), Impl::Fused, seed + 1);
    seed += 2;
  }
  // f16, and widths that take the narrower vector paths (D = 38 with rotate: odd halves, scalar).
  for (int64_t d : {int64_t(100), int64_t(52), int64_t(38)}) {
    CAPTURE(d);
    check_against_reference(make(Act::Softmax, ActDim::Feature, 0), randn({2, 37, H, d}, DType::F16, gpu(), seed),
                            rates({H, half_width ? d / 2 : d}, gpu()), Impl::Fused, seed + 1);
    seed += 2;
  }
  // Wide rows: more than 32 vectors per row, so each lane handles several (softmax reduces over them).
  const int64_t wide = half_width ? 640 : 320;
  check_against_reference(make(Act::Softmax, ActDim::Feature, 0), randn({2, 37, H, wide}, DType::BF16, gpu(), seed),
                          rates({H, half_width ? wide / 2 : wide}, gpu()), Impl::Fused, seed + 1);
  check_against_reference(make(Act::Softmax, ActDim::Sequence, 0), randn({2, 37, H, wide}, DType::F32, gpu(), seed),
                          rates({H, 7}, gpu()), Impl::Fused, seed + 1);
  if (!half_width)  // odd D: the scalar path
    check_against_reference(make(Act::Sigmoid, ActDim::None, 0), randn({2, 37, H, 33}, DType::F32, gpu(), seed),
                            rates({H, 33}, gpu()), Impl::Fused, seed + 1);
}

// Peak device memory of one fused forward: the output, plus small statistics.
void check_fused_peak(const OpFn& op, const Tensor& x, const Tensor& theta, size_t extra_allowed) {
  empty_cache(gpu());  // fresh blocks, so that a reused larger block does not count
  const size_t before = memory_stats(gpu()).in_use;
  reset_peak_memory(gpu());
  Tensor out = op(x, theta, Impl::Fused);
  const size_t peak = memory_stats(gpu()).peak - before;
  INFO("peak " << peak << " bytes for an output of " << out.nbytes());
  CHECK(peak >= out.nbytes());
  CHECK(peak <= out.nbytes() + extra_allowed + 64 * 1024);
}

#if LINTAPE_WITH_CUDA
// The launchers straight on poisoned outputs: every element must be written.
void check_launchers(LrpeSpec spec, const Tensor& x, const Tensor& theta, const OpFn& op) {
  spec.theta = theta;
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  Tensor out = empty({B, N, H, spec.rotate() ? D : 2 * D}, x.dtype(), gpu());
  Tensor stats = spec.seq_softmax() ? empty({B, H, D}, DType::F32, gpu()) : Tensor();
  poison_(out);
  if (stats.defined()) poison_(stats);
  lrpe_cuda::forward(x, spec, out, stats);
  Tensor dout = randn(out.shape(), x.dtype(), gpu(), 9);
  Tensor dx = empty_like(x);
  poison_(dx);
  lrpe_cuda::backward(x, dout, spec, stats, dx);

  Tensor x64 = x.to(Device::cpu()).to(DType::F64);
  Result ref = run(op, x64, theta.to(Device::cpu()), Impl::Reference, dout.to(Device::cpu()).to(DType::F64));
  CHECK_CLOSE_TENSOR(out.to(Device::cpu()), ref.out, x.dtype());
  CHECK_CLOSE_TENSOR(dx.to(Device::cpu()), ref.dx, x.dtype());
}
#endif

}  // namespace

TEST_CASE("cuda lrpe_cosine fused matches reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  auto make = [](Act a, ActDim d, int64_t off) { return cosine_op(opts(a, d, off)); };
  fused_matches_reference(make, false);
  fused_theta_shapes(make, false);
}

TEST_CASE("cuda lrpe_rotate fused matches reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  auto make = [](Act a, ActDim d, int64_t off) { return rotate_op(opts(a, d, off)); };
  fused_matches_reference(make, true);
  fused_theta_shapes(make, true);
}

TEST_CASE("cuda md_lrpe_cosine fused matches reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  struct Grid {
    std::vector<int64_t> shape;
    int64_t L, E;
  };
  // D = 96 or 64; E so that k * E >= D, with and without truncation, theta (H, E) and (1, E).
  const std::vector<Grid> grids = {{{37}, 0, 96}, {{34}, 3, 96}, {{5, 7}, 0, 48}, {{6, 6}, 3, 50},
                                   {{3, 4, 3}, 0, 32}, {{2, 3, 5}, 3, 40}, {{2, 2, 3, 3}, 3, 24}};
  uint64_t seed = 900;
  int k = 0;
  for (const Grid& gr : grids)
    for (const Act2& a : kActs) {
      const int64_t N = gr.L + shape_numel(gr.shape);
      const DType dt = k % 3 == 2 ? DType::F32 : DType::BF16;
      const int64_t D = k % 2 ? 64 : 96, rows = k % 4 == 3 ? 1 : 3;
      ++k;
      CAPTURE(a.name);
      CAPTURE(shape_str(gr.shape));
      CAPTURE(gr.L);
      CAPTURE(D);
      CAPTURE(dtype_name(dt));
      OpFn op = md_op(md_opts(gr.shape, gr.L, a.act, a.dim, k % 5 == 0));
      check_against_reference(op, randn({2, N, 3, D}, dt, gpu(), seed), rates({rows, gr.E}, gpu()), Impl::Fused,
                              seed + 1);
      seed += 2;
    }
}

TEST_CASE("cuda md_lrpe_cosine cached angles" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const int64_t H = 3, D = 128;
  Tensor theta = rates({H, 64}, gpu());
  OpFn cached = md_op(md_opts({8, 8}, 3, Act::Silu, ActDim::None, true));
  Tensor x = randn({2, 67, H, D}, DType::BF16, gpu(), 31);
  check_against_reference(cached, x, theta, Impl::Fused, 32);
  // The table is reused: a second forward allocates the output only.
  check_fused_peak(cached, x, theta, 0);
  // Writing theta bumps its version: the next call must not use the old table.
  theta.copy_(rates({H, 64}, gpu()) * 0.5);
  check_against_reference(cached, x, theta, Impl::Fused, 33);
  // A new theta at a reused address with the same version must not hit the old entry either.
  theta = Tensor();
  Tensor theta2 = rates({H, 64}, gpu()) * 0.25;
  check_against_reference(cached, x, theta2, Impl::Fused, 34);
}

TEST_CASE("cuda lrpe fused long positions stay accurate in f32" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Angles reach ~40000 radians: the f32 angle's rounding error is folded back into cos/sin.
  check_against_reference(cosine_op(opts(Act::None, ActDim::None, 40000)), randn({2, 37, 3, 64}, DType::F32, gpu(), 41),
                          rates({3, 64}, gpu()), Impl::Fused, 42);
  check_against_reference(rotate_op(opts(Act::Silu, ActDim::None, 30000)), randn({2, 37, 3, 64}, DType::F32, gpu(), 43),
                          rates({3, 32}, gpu()), Impl::Fused, 44);
}

TEST_CASE("cuda lrpe fused launchers write every element" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const int64_t H = 3;
  LrpeSpec spec;
  spec.kind = LrpeSpec::Cosine;
  spec.offset = 4;
  spec.act = Act::Silu;
  check_launchers(spec, randn({2, 129, H, 128}, DType::BF16, gpu(), 51), rates({H, 128}, gpu()),
                  cosine_op(opts(Act::Silu, ActDim::None, 4)));
  spec.act = Act::Softmax;
  spec.dim = ActDim::Sequence;
  check_launchers(spec, randn({2, 37, H, 96}, DType::F32, gpu(), 52), rates({H, 96}, gpu()),
                  cosine_op(opts(Act::Softmax, ActDim::Sequence, 4)));
  spec.kind = LrpeSpec::Rotate;
  spec.dim = ActDim::Feature;
  check_launchers(spec, randn({2, 129, H, 64}, DType::F16, gpu(), 53), rates({H, 32}, gpu()),
                  rotate_op(opts(Act::Softmax, ActDim::Feature, 4)));
  LrpeSpec md;
  md.kind = LrpeSpec::MdCosine;
  md.grid = {4, 8};
  md.extra_tokens = 5;
  md.act = Act::Relu;
  check_launchers(md, randn({2, 37, H, 96}, DType::BF16, gpu(), 54), rates({H, 48}, gpu()),
                  md_op(md_opts({4, 8}, 5, Act::Relu)));
  Tensor theta = rates({H, 48}, gpu()), table = empty({2, 32, H, 96}, DType::F32, gpu());
  md.theta = theta;
  poison_(table);
  lrpe_cuda::build_table(md, H, 96, table);
  md.table = table;
  check_launchers(md, randn({2, 37, H, 96}, DType::BF16, gpu(), 55), theta, md_op(md_opts({4, 8}, 5, Act::Relu)));
#endif
}

TEST_CASE("cuda lrpe fused batch tiles" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // An odd batch in groups of several rows, so that the row kernels run full and partial batch tiles
  // with prefetch, and the backward statistics kernel partial batch tiles; one group (0) and the
  // launcher's own choice included.
  const int64_t B = 11, N = 37, H = 3;
  struct Case {
    LrpeSpec::Kind kind;
    Act act;
    ActDim dim;
    DType dtype;
    int64_t D;
  };
  const std::vector<Case> cases = {{LrpeSpec::Cosine, Act::Silu, ActDim::None, DType::BF16, 128},
                                   {LrpeSpec::Cosine, Act::None, ActDim::None, DType::F32, 64},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Feature, DType::F32, 64},
                                   {LrpeSpec::Rotate, Act::Sigmoid, ActDim::None, DType::BF16, 128},
                                   {LrpeSpec::Cosine, Act::Softmax, ActDim::Sequence, DType::F32, 96},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Sequence, DType::BF16, 128},
                                   {LrpeSpec::Cosine, Act::Softmax, ActDim::Feature, DType::BF16, 320}};
  uint64_t seed = 1100;
  for (const Case& c : cases)
    for (int64_t rows : {int64_t(0), int64_t(1), int64_t(5), B}) {
      CAPTURE(int(c.kind));
      CAPTURE(int(c.act));
      CAPTURE(dtype_name(c.dtype));
      CAPTURE(c.D);
      CAPTURE(rows);
      LrpeSpec spec;
      spec.kind = c.kind;
      spec.offset = 3;
      spec.act = c.act;
      spec.dim = c.dim;
      spec.batch_rows = rows;
      const LrpeOptions o = opts(c.act, c.dim, 3);
      const bool rot = c.kind == LrpeSpec::Rotate;
      check_launchers(spec, randn({B, N, H, c.D}, c.dtype, gpu(), seed), rates({H, rot ? c.D / 2 : c.D}, gpu()),
                      rot ? rotate_op(o) : cosine_op(o));
      ++seed;
    }
  LrpeSpec md;
  md.kind = LrpeSpec::MdCosine;
  md.grid = {4, 8};
  md.extra_tokens = 5;
  md.act = Act::Relu;
  md.batch_rows = 4;
  check_launchers(md, randn({B, 37, H, 96}, DType::BF16, gpu(), 1150), rates({H, 48}, gpu()),
                  md_op(md_opts({4, 8}, 5, Act::Relu)));
#endif
}

TEST_CASE("cuda lrpe fused sequence statistics over long chunks" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // Softmax over the sequence in f32 at large positions, with chunks long enough that each token lane
  // of the backward statistics kernel steps its angles through several exact re-seeds.
  const int64_t B = 3, N = 200, H = 2, D = 64, offset = 30000;
  uint64_t seed = 1200;
  for (LrpeSpec::Kind kind : {LrpeSpec::Cosine, LrpeSpec::Rotate})
    for (int64_t chunk : {int64_t(0), int64_t(67), N}) {
      CAPTURE(int(kind));
      CAPTURE(chunk);
      LrpeSpec spec;
      spec.kind = kind;
      spec.offset = offset;
      spec.act = Act::Softmax;
      spec.dim = ActDim::Sequence;
      spec.stat_chunk = chunk;
      const LrpeOptions o = opts(Act::Softmax, ActDim::Sequence, offset);
      const bool rot = kind == LrpeSpec::Rotate;
      check_launchers(spec, randn({B, N, H, D}, DType::F32, gpu(), seed), rates({H, rot ? D / 2 : D}, gpu()),
                      rot ? rotate_op(o) : cosine_op(o));
      ++seed;
    }
#endif
}

TEST_CASE("cuda lrpe fused forward memory is the output" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const int64_t B = 2, N = 129, H = 3, D = 128;
  Tensor x = randn({B, N, H, D}, DType::BF16, gpu(), 61);
  x.requires_grad_();
  const size_t stats = size_t(B * H * D) * 4;
  check_fused_peak(cosine_op(opts(Act::Silu)), x, rates({H, D}, gpu()), 0);
  check_fused_peak(rotate_op(opts(Act::Softmax, ActDim::Feature)), x, rates({H, D / 2}, gpu()), 0);
  // Softmax over the sequence keeps the (B, H, D) log-sum-exp; its chunk partials are freed at once.
  check_fused_peak(cosine_op(opts(Act::Softmax, ActDim::Sequence)), x, rates({H, D}, gpu()), stats);
  check_fused_peak(md_op(md_opts({8, 16}, 1, Act::None)), x, rates({H, D / 2}, gpu()), 0);
  // The backward allocates dx (and the small statistics) only.
  Tensor out = lrpe_cosine(x, rates({H, D}, gpu()), opts(Act::Silu), Impl::Fused);
  Tensor dout = randn(out.shape(), DType::BF16, gpu(), 62);
  empty_cache(gpu());
  const size_t before = memory_stats(gpu()).in_use;
  reset_peak_memory(gpu());
  backward(out, dout);
  CHECK(memory_stats(gpu()).peak - before <= x.nbytes() + 64 * 1024);
}

namespace {

// Elements where a and b differ, compared as f32 on the CPU (NaN counts as a difference).
int64_t mismatches(const Tensor& a, const Tensor& b) {
  const std::vector<float> va = a.to(Device::cpu()).to_vector<float>(), vb = b.to(Device::cpu()).to_vector<float>();
  REQUIRE(va.size() == vb.size());
  int64_t n = 0;
  for (size_t i = 0; i < va.size(); ++i) n += !(va[i] == vb[i]);
  return n;
}

struct ViewCase {
  const char* name;
  LrpeSpec spec;  // for the launchers (theta set per call)
  OpFn op;        // the same call through the op
};

std::vector<ViewCase> view_cases() {
  auto spec = [](LrpeSpec::Kind kind, Act act, ActDim dim, int64_t offset) {
    LrpeSpec s;
    s.kind = kind;
    s.act = act;
    s.dim = dim;
    s.offset = offset;
    return s;
  };
  LrpeSpec md = spec(LrpeSpec::MdCosine, Act::Relu, ActDim::None, 0);
  md.grid = {4, 9};
  md.extra_tokens = 1;
  return {{"rotate none", spec(LrpeSpec::Rotate, Act::None, ActDim::None, 3),
           rotate_op(opts(Act::None, ActDim::None, 3))},
          {"rotate silu", spec(LrpeSpec::Rotate, Act::Silu, ActDim::None, 3),
           rotate_op(opts(Act::Silu, ActDim::None, 3))},
          {"rotate softmax sequence", spec(LrpeSpec::Rotate, Act::Softmax, ActDim::Sequence, 3),
           rotate_op(opts(Act::Softmax, ActDim::Sequence, 3))},
          {"cosine softmax feature", spec(LrpeSpec::Cosine, Act::Softmax, ActDim::Feature, 3),
           cosine_op(opts(Act::Softmax, ActDim::Feature, 3))},
          {"cosine softmax sequence", spec(LrpeSpec::Cosine, Act::Softmax, ActDim::Sequence, 3),
           cosine_op(opts(Act::Softmax, ActDim::Sequence, 3))},
          {"md relu", md, md_op(md_opts({4, 9}, 1, Act::Relu))}};
}

// theta for x (B, N, H, D): (H, D/2) for rotate and md (k = 2 grid axes), (H, D) for cosine.
Tensor view_theta(const LrpeSpec& spec, int64_t H, int64_t D) {
  return rates({H, spec.kind == LrpeSpec::Cosine ? D : D / 2}, gpu());
}

#if LINTAPE_WITH_CUDA
// out and dx of the launchers on poisoned outputs.
Result launch(LrpeSpec spec, const Tensor& x, const Tensor& theta, const Tensor& dout) {
  spec.theta = theta;
  Tensor out = empty(spec.out_shape(x.shape()), x.dtype(), gpu());
  Tensor stats = spec.seq_softmax() ? empty({x.size(0), x.size(2), x.size(3)}, DType::F32, gpu()) : Tensor();
  Tensor dx = empty(x.shape(), x.dtype(), gpu());
  poison_(out);
  poison_(dx);
  if (stats.defined()) poison_(stats);
  lrpe_cuda::forward(x, spec, out, stats);
  lrpe_cuda::backward(x, dout, spec, stats, dx);
  return {out, dx};
}
#endif

}  // namespace

TEST_CASE("cuda lrpe fused reads a token-strided view in place" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // x: heads 0..5 or 6..7 of (B, N, 10, D), as the TPA mixer's basis views; the same kernels run on it
  // and on its contiguous copy, so out and dx match bit for bit.
  const int64_t B = 2, N = 37, D = 64;
  uint64_t seed = 1300;
  for (DType dt : {DType::BF16, DType::F32})
    for (const ViewCase& c : view_cases())
      for (const auto& [h0, H] : {std::pair<int64_t, int64_t>{0, 6}, {6, 2}}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(c.name);
        CAPTURE(h0);
        Tensor wide = randn({B, N, 10, D}, dt, gpu(), seed++);
        wide.requires_grad_();
        const Tensor x = wide.narrow(2, h0, H), theta = view_theta(c.spec, H, D);
        REQUIRE(!x.is_contiguous());
        const Tensor dout = randn(c.spec.out_shape(x.shape()), dt, gpu(), seed++);
        Tensor out = c.op(x, theta, Impl::Fused);
        backward(out, dout);
        const Result ref = run(c.op, x.detach().contiguous(), theta, Impl::Fused, dout);
        CHECK(mismatches(out, ref.out) == 0);
        CHECK(mismatches(wide.grad().narrow(2, h0, H), ref.dx) == 0);
#if LINTAPE_WITH_CUDA
        const Result got = launch(c.spec, x.detach(), theta, dout);
        CHECK(mismatches(got.out, ref.out) == 0);
        CHECK(mismatches(got.dx, ref.dx) == 0);
        // dx written where it lies: the same heads of a wider, poisoned gradient; the other heads keep the poison.
        if (!c.spec.seq_softmax()) {
          LrpeSpec spec = c.spec;
          spec.theta = theta;
          Tensor dwide = empty(wide.shape(), dt, gpu());
          poison_(dwide);
          lrpe_cuda::backward(x.detach(), dout, spec, Tensor(), dwide.narrow(2, h0, H));
          CHECK(mismatches(dwide.narrow(2, h0, H), ref.dx) == 0);
          int64_t written_outside = 0;
          for (int64_t h = 0; h < 10; ++h)
            if (h < h0 || h >= h0 + H)
              for (float v : dwide.narrow(2, h, 1).to(Device::cpu()).to_vector<float>()) written_outside += !std::isnan(v);
          CHECK(written_outside == 0);
        }
#endif
      }
  // A view off the 16-byte grid: the op copies it; the launchers read it with narrower vectors.
  for (const ViewCase& c : view_cases()) {
    CAPTURE(c.name);
    const Tensor x = randn({B, N, 3, D + 8}, DType::BF16, gpu(), seed++).narrow(3, 1, D);
    const Tensor theta = view_theta(c.spec, 3, D);
    const Tensor dout = randn(c.spec.out_shape(x.shape()), DType::BF16, gpu(), seed++);
    const Result ref = run(c.op, x.contiguous(), theta, Impl::Fused, dout);
    const Result got = run(c.op, x, theta, Impl::Fused, dout);
    CHECK(mismatches(got.out, ref.out) == 0);
    CHECK(mismatches(got.dx, ref.dx) == 0);
#if LINTAPE_WITH_CUDA
    const Result narrow = launch(c.spec, x, theta, dout);
    CHECK_CLOSE_TENSOR(narrow.out.to(Device::cpu()), ref.out, DType::BF16);
    CHECK_CLOSE_TENSOR(narrow.dx.to(Device::cpu()), ref.dx, DType::BF16);
#endif
  }
  // Read in place: the forward allocates its output (and the small statistics) only, not a copy of x.
  Tensor wide = randn({B, 129, 10, 128}, DType::BF16, gpu(), seed++);
  wide.requires_grad_();
  check_fused_peak(rotate_op(opts(Act::None)), wide.narrow(2, 0, 6), rates({6, 64}, gpu()), 0);
  check_fused_peak(cosine_op(opts(Act::Softmax, ActDim::Sequence)), wide.narrow(2, 6, 2), rates({2, 128}, gpu()),
                   size_t(B * 2 * 128) * 4);
}

TEST_CASE("lrpe_theta is the usual rates") {
  Tensor theta = lrpe_theta(3, 4, 100.0);
  CHECK(theta.shape() == Shape{3, 4});
  CHECK(theta.dtype() == DType::F32);
  CHECK(theta.device() == Device::cpu());
  std::vector<double> v = theta.to_vector<double>();
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t k = 0; k < 4; ++k) CHECK(v[h * 4 + k] == doctest::Approx(std::pow(100.0, -k / 4.0)).epsilon(1e-7));
  // The default base: theta[h, 1] = 10000^(-1/2) = 0.01.
  CHECK(lrpe_theta(1, 2).to_vector<double>()[1] == doctest::Approx(0.01).epsilon(1e-7));
}

TEST_CASE("cuda lrpe_theta on the device matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor theta = lrpe_theta(2, 64, 10000.0, gpu());
  CHECK(theta.device() == gpu());
  CHECK(theta.to(Device::cpu()).to_vector<float>() == lrpe_theta(2, 64).to_vector<float>());
}

TEST_CASE("bad input lrpe_theta sizes and base") {
  check_throws_containing([] { lrpe_theta(0, 4); }, {"[lrpe_theta]", "H and E must be >= 1", "H = 0"});
  check_throws_containing([] { lrpe_theta(2, -1); }, {"[lrpe_theta]", "E = -1"});
  check_throws_containing([] { lrpe_theta(2, 4, 1.0); }, {"[lrpe_theta]", "base must be > 1", "got 1"});
}
