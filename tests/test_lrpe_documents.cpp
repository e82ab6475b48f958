// LRPE family with documents (packed rows, ops/documents.h): a packed row gives each document what it gets
// on its own (values and gradients, every path), gradient checks across boundaries, and the errors.
#include <functional>
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/lrpe/launch.h"
#include "ops/lrpe/lrpe.h"

using namespace lintape;
using namespace lintape::test;

namespace {

// An LRPE op with its options but the documents, which each call brings.
using DocOp = std::function<Tensor(const Tensor& x, const Tensor& theta, const Documents& docs, Impl impl)>;

DocOp cosine(Act act = Act::None, ActDim dim = ActDim::None, int64_t offset = 0) {
  return [=](const Tensor& x, const Tensor& th, const Documents& docs, Impl impl) {
    LrpeOptions o{offset, act, dim, docs};
    return lrpe_cosine(x, th, o, impl);
  };
}
DocOp rotate(Act act = Act::None, ActDim dim = ActDim::None, int64_t offset = 0) {
  return [=](const Tensor& x, const Tensor& th, const Documents& docs, Impl impl) {
    LrpeOptions o{offset, act, dim, docs};
    return lrpe_rotate(x, th, o, impl);
  };
}

struct Result {
  Tensor out, dx;  // on the CPU
};
Result run(const DocOp& op, const Tensor& x_in, const Tensor& theta, const Documents& docs, Impl impl,
           const Tensor& dout) {
  Tensor x = x_in.detach();
  x.requires_grad_();
  Tensor out = op(x, theta, docs, impl);
  backward(out, dout.to(out.device()).to(out.dtype()));
  return {out.to(Device::cpu()), x.grad().to(Device::cpu())};
}

// op on the packed x (B, N, H, D) cut by cu_seqlens against op on each document alone (no documents):
// every document's slice of out and dx. A fused run's documents are compared at its dtype's tolerance, the
// f64 paths' at f64's.
void check_packed(const DocOp& op, const Tensor& x, const Tensor& theta, const std::vector<int64_t>& cu, Impl impl,
                  uint64_t seed) {
  const int64_t B = x.size(0), N = x.size(1);
  const Documents docs = Documents::from_cu_seqlens(cu, B, N, x.device());
  Tensor probe = op(x.detach(), theta, docs, impl);
  Tensor dout = randn(probe.shape(), x.dtype(), x.device(), seed);
  const Result packed = run(op, x, theta, docs, impl, dout);
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t b = cu[i] / N, s0 = cu[i] % N, len = cu[i + 1] - cu[i];
    CAPTURE(b);
    CAPTURE(s0);
    CAPTURE(len);
    auto part = [&](const Tensor& t) { return t.narrow(0, b, 1).narrow(1, s0, len).contiguous(); };
    const Result alone = run(op, part(x), theta, Documents(), impl, part(dout));
    CHECK_CLOSE_TENSOR(part(packed.out), alone.out, x.dtype());
    CHECK_CLOSE_TENSOR(part(packed.dx), alone.dx, x.dtype());
  }
}

// Rows of 9: [3 | 1 | 5] and one document; rows of 150 (for the fused kernels' tiles): [64 | 1 | 85] and
// [100 | 50].
const std::vector<int64_t> kShortCuts = {0, 3, 4, 9, 18};
const std::vector<int64_t> kLongCuts = {0, 64, 65, 150, 250, 300};

struct Named {
  const char* name;
  DocOp op;
  bool rotate;
};
// Softmax over the sequence normalises each document on its own.
std::vector<Named> ops_under_test() {
  return {{"cosine", cosine(), false},
          {"cosine silu offset 3", cosine(Act::Silu, ActDim::None, 3), false},
          {"cosine softmax feature", cosine(Act::Softmax, ActDim::Feature), false},
          {"cosine softmax sequence", cosine(Act::Softmax, ActDim::Sequence), false},
          {"rotate", rotate(), true},
          {"rotate sigmoid offset 5", rotate(Act::Sigmoid, ActDim::None, 5), true},
          {"rotate softmax feature", rotate(Act::Softmax, ActDim::Feature, 2), true},
          {"rotate softmax sequence offset 1", rotate(Act::Softmax, ActDim::Sequence, 1), true}};
}

}  // namespace

TEST_CASE("lrpe documents: packed equals each document alone, reference and composed") {
  uint64_t seed = 10;
  for (const Named& o : ops_under_test())
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      CAPTURE(o.name);
      CAPTURE(impl == Impl::Reference);
      const int64_t D = o.rotate ? 6 : 4;
      for (const Shape& ts : {Shape{2, o.rotate ? 3 : 4}, Shape{1, 2}, Shape{2, 1}}) {
        CAPTURE(shape_str(ts));
        check_packed(o.op, randn({2, 9, 2, D}, DType::F64, Device::cpu(), seed), rates(ts), kShortCuts, impl,
                     seed + 1);
        seed += 2;
      }
    }
}

TEST_CASE("lrpe documents: one document a row is the op without documents") {
  Tensor x = randn({2, 9, 2, 4}, DType::F64, Device::cpu(), 3), theta = rates({2, 4});
  const Documents whole = Documents::from_cu_seqlens({0, 9, 18}, 2, 9);
  Tensor dout = randn({2, 9, 2, 8}, DType::F64, Device::cpu(), 4);
  const Result with = run(cosine(Act::Silu, ActDim::None, 4), x, theta, whole, Impl::Reference, dout);
  const Result without = run(cosine(Act::Silu, ActDim::None, 4), x, theta, Documents(), Impl::Reference, dout);
  CHECK(rel_error(with.out, without.out) == 0);
  CHECK(rel_error(with.dx, without.dx) == 0);
}

TEST_CASE("gradcheck lrpe with documents") {
  const Documents docs = Documents::from_cu_seqlens(kShortCuts, 2, 9);
  uint64_t seed = 30;
  for (const Named& o : ops_under_test())
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      CAPTURE(o.name);
      CAPTURE(impl == Impl::Reference);
      Tensor theta = rates({2, o.rotate ? 3 : 4});
      auto f = [&](const std::vector<Tensor>& in) { return o.op(in[0], in[1], docs, impl); };
      CHECK_GRADCHECK(f, (std::vector<Tensor>{leaf({2, 9, 2, o.rotate ? 6 : 4}, seed++, 0.05), theta}));
    }
}

TEST_CASE("bad input lrpe documents") {
  Tensor x = randn({2, 9, 2, 4}, DType::F32, Device::cpu(), 1), theta = rates({2, 4});
  const Documents other = Documents::from_cu_seqlens({0, 4, 8}, 2, 4);
  check_throws_containing([&] { cosine()(x, theta, other, Impl::Auto); },
                          {"[lrpe_cosine]", "documents are for (2, 4) tokens", "(2, 9)"});
}

TEST_CASE("bad input lrpe documents on another device" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor x = randn({2, 9, 2, 4}, DType::F32, gpu(), 1);
  const Documents docs = Documents::from_cu_seqlens(kShortCuts, 2, 9);  // on the CPU
  check_throws_containing([&] { cosine()(x, rates({2, 4}, gpu()), docs, Impl::Fused); },
                          {"[lrpe_cosine]", "documents are on cpu", "cuda:0"});
}

TEST_CASE("cuda lrpe documents: softmax over the sequence runs fused, each document on its own" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const Documents docs = Documents::from_cu_seqlens(kLongCuts, 2, 150, gpu());
  const DocOp op = rotate(Act::Softmax, ActDim::Sequence, 1);
  Tensor x = randn({2, 150, 3, 64}, DType::F32, gpu(), 40), theta = rates({3, 32}, gpu());
  Tensor dout = randn({2, 150, 3, 64}, DType::F32, gpu(), 42);
  const Result got = run(op, x, theta, docs, Impl::Auto, dout);
  // Auto takes the fused kernels: the same bits as Impl::Fused.
  const Result fused = run(op, x, theta, docs, Impl::Fused, dout);
  CHECK(rel_error(got.out, fused.out) == 0);
  CHECK(rel_error(got.dx, fused.dx) == 0);
  const Result ref = run(op, x.to(Device::cpu()).to(DType::F64), theta.to(Device::cpu()), docs.to(Device::cpu()),
                         Impl::Reference, dout.to(Device::cpu()).to(DType::F64));
  CHECK_CLOSE_TENSOR(got.out, ref.out, DType::F32);
  CHECK_CLOSE_TENSOR(got.dx, ref.dx, DType::F32);
  // Composed agrees.
  const Result composed = run(op, x, theta, docs, Impl::Composed, dout);
  CHECK_CLOSE_TENSOR(composed.out, ref.out, DType::F32);
  CHECK_CLOSE_TENSOR(composed.dx, ref.dx, DType::F32);
}

// ---------------------------------------------------------------------------------------------------
// CUDA: the fused kernels with documents.

TEST_CASE("cuda lrpe documents: fused packed equals each document alone and the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 100;
  const int64_t H = 3;
  int k = 0;
  for (const Named& o : ops_under_test())
    for (DType dt : {DType::F32, DType::BF16}) {
      const int64_t D = std::vector<int64_t>{64, 128, 96}[size_t(k++ % 3)];
      CAPTURE(o.name);
      CAPTURE(dtype_name(dt));
      CAPTURE(D);
      Tensor x = randn({2, 150, H, D}, dt, gpu(), seed), theta = rates({H, o.rotate ? D / 2 : D}, gpu());
      check_packed(o.op, x, theta, kLongCuts, Impl::Fused, seed + 1);
      // Against the f64 reference with the same documents.
      const Documents docs = Documents::from_cu_seqlens(kLongCuts, 2, 150, gpu());
      Tensor dout = randn(o.op(x, theta, docs, Impl::Fused).shape(), dt, gpu(), seed + 2);
      const Result got = run(o.op, x, theta, docs, Impl::Fused, dout);
      const Result ref = run(o.op, x.to(Device::cpu()).to(DType::F64), theta.to(Device::cpu()), docs.to(Device::cpu()),
                             Impl::Reference, dout.to(Device::cpu()).to(DType::F64));
      CHECK_CLOSE_TENSOR(got.out, ref.out, dt);
      CHECK_CLOSE_TENSOR(got.dx, ref.dx, dt);
      seed += 3;
    }
}

TEST_CASE("cuda lrpe documents: launchers write every element, rows cut differently" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // 7 rows of 37, each cut differently (a row of one-token documents, a whole row), in batch groups of 1, 3
  // and the launcher's choice: the lanes recompute their angles where a row's positions differ. Softmax over
  // the sequence with statistics pieces of 1, 5 and the launcher's choice of tokens (documents across
  // pieces), its statistics poisoned too: only each document's first row may be read.
  const int64_t B = 7, N = 37, H = 3;
  std::vector<int64_t> cu{0};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t step = b == 0 ? 1 : b == 1 ? N : 3 + 5 * b;
    for (int64_t s = step; s < N; s += step) cu.push_back(b * N + s);
    cu.push_back((b + 1) * N);
  }
  const Documents docs = Documents::from_cu_seqlens(cu, B, N, gpu());
  struct Case {
    LrpeSpec::Kind kind;
    Act act;
    ActDim dim;
    DType dtype;
    int64_t D;
  };
  const std::vector<Case> cases = {{LrpeSpec::Cosine, Act::None, ActDim::None, DType::BF16, 128},
                                   {LrpeSpec::Cosine, Act::Silu, ActDim::None, DType::F32, 64},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Feature, DType::F16, 64},
                                   {LrpeSpec::Rotate, Act::Relu, ActDim::None, DType::BF16, 640},
                                   {LrpeSpec::Cosine, Act::Sigmoid, ActDim::None, DType::F32, 33},
                                   {LrpeSpec::Cosine, Act::Softmax, ActDim::Sequence, DType::BF16, 128},
                                   {LrpeSpec::Cosine, Act::Softmax, ActDim::Sequence, DType::F32, 33},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Sequence, DType::F32, 64},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Sequence, DType::BF16, 128},
                                   {LrpeSpec::Rotate, Act::Softmax, ActDim::Sequence, DType::F16, 640}};
  uint64_t seed = 200;
  for (const Case& c : cases)
    for (int64_t rows : {int64_t(1), int64_t(3), int64_t(0)}) {
      CAPTURE(int(c.kind));
      CAPTURE(c.D);
      CAPTURE(rows);
      LrpeSpec spec;
      spec.kind = c.kind;
      spec.act = c.act;
      spec.dim = c.dim;
      spec.offset = 6;
      spec.batch_rows = rows;
      spec.stat_chunk = rows == 1 ? 1 : rows == 3 ? 5 : 0;
      spec.starts = docs.starts();
      Tensor x = randn({B, N, H, c.D}, c.dtype, gpu(), seed++);
      spec.theta = rates({H, c.kind == LrpeSpec::Rotate ? c.D / 2 : c.D}, gpu());
      Tensor out = empty(spec.out_shape(x.shape()), c.dtype, gpu()), dx = empty_like(x), stats;
      poison_(out);
      poison_(dx);
      if (spec.seq_softmax()) {
        stats = empty({B, N, H, c.D}, DType::F32, gpu());
        poison_(stats);
      }
      lrpe_cuda::forward(x, spec, out, stats);
      Tensor dout = randn(out.shape(), c.dtype, gpu(), seed++);
      lrpe_cuda::backward(x, dout, spec, stats, dx);
      const DocOp op = c.kind == LrpeSpec::Rotate ? rotate(c.act, c.dim, 6) : cosine(c.act, c.dim, 6);
      const Result ref = run(op, x.to(Device::cpu()).to(DType::F64), spec.theta.to(Device::cpu()),
                             docs.to(Device::cpu()), Impl::Reference, dout.to(Device::cpu()).to(DType::F64));
      CHECK_CLOSE_TENSOR(out.to(Device::cpu()), ref.out, c.dtype);
      CHECK_CLOSE_TENSOR(dx.to(Device::cpu()), ref.dx, c.dtype);
    }
#endif
}
