// One table of op cases, every implementation against the f64 CPU reference: each row names an op and its
// options, makes fresh random inputs from a seed and runs the op with a given Impl. The runner takes every
// row x implementation x dtype x device (CPU: Reference in f32, Composed in f64 and f32; CUDA: the row's
// Fused and Composed dtypes), computes the outputs and every input gradient (backward of a random-weighted
// sum of the outputs) and compares them with tests/helpers.h's dtype-aware tolerances. Each combination
// is its own doctest subcase: "row / impl / dtype / device". Only the public op headers are used.
#include <cmath>
#include <functional>
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/fal/fal.h"
#include "ops/lrpe/lrpe.h"
#include "ops/tpa/tpa.h"

using namespace lintape;
using namespace lintape::test;

namespace {

// One differentiable input: its f64 CPU values and whether it is a state (FAL's S0), which is held in f32
// whatever the inputs' dtype (f64 with f64 inputs).
struct Arg {
  Tensor value;
  bool state = false;
};

struct Row {
  std::string name;
  std::function<std::vector<Arg>(uint64_t seed)> inputs;
  // The op's outputs for inputs on one device in one dtype. Fixed buffers (theta, decay) are made here, on
  // the inputs' device: no gradient flows to them, so every input of `inputs` gets its gradient compared.
  std::function<std::vector<Tensor>(const std::vector<Tensor>& in, Impl impl)> run;
  std::vector<DType> fused, composed;  // CUDA dtypes of Impl::Fused and Impl::Composed (none: not run)
};

const std::vector<DType> kFloats = {DType::F32, DType::BF16, DType::F16};
const std::vector<DType> kF32 = {DType::F32};

// Random values kept away from 0, so that relu's kink sits between the same neighbours in every dtype.
Tensor values(const Shape& shape, uint64_t seed) { return leaf(shape, seed, 0.05).detach(); }

std::function<std::vector<Arg>(uint64_t)> shapes_of(std::vector<Shape> shapes) {
  return [shapes](uint64_t seed) {
    std::vector<Arg> a;
    for (const Shape& s : shapes) a.push_back({values(s, seed++)});
    return a;
  };
}

// ---------------------------------------------------------------------------------------------------
// The table.

struct ActCase {
  const char* name;
  Act act;
  ActDim dim;
};
const std::vector<ActCase> kActs = {{"none", Act::None, ActDim::None},
                                    {"relu", Act::Relu, ActDim::None},
                                    {"sigmoid", Act::Sigmoid, ActDim::None},
                                    {"silu", Act::Silu, ActDim::None},
                                    {"softmax feature", Act::Softmax, ActDim::Feature},
                                    {"softmax sequence", Act::Softmax, ActDim::Sequence}};

enum class LrpeKind { Cosine, Rotate };

Row lrpe_row(std::string name, LrpeKind kind, LrpeOptions o, Shape x, Shape theta) {
  auto run = [kind, o, theta](const std::vector<Tensor>& in, Impl impl) -> std::vector<Tensor> {
    const Tensor th = rates(theta, in[0].device());
    return {kind == LrpeKind::Cosine ? lrpe_cosine(in[0], th, o, impl) : lrpe_rotate(in[0], th, o, impl)};
  };
  const char* op = kind == LrpeKind::Cosine ? "lrpe_cosine " : "lrpe_rotate ";
  return {op + name, shapes_of({x}), run, kFloats, kF32};
}

Row md_row(std::string name, MdLrpeOptions o, Shape x, Shape theta) {
  auto run = [o, theta](const std::vector<Tensor>& in, Impl impl) -> std::vector<Tensor> {
    return {md_lrpe_cosine(in[0], rates(theta, in[0].device()), o, impl)};
  };
  return {"md_lrpe_cosine " + name, shapes_of({x}), run, kFloats, kF32};
}

// Every act and theta shape of each op on B=2, N=5, H=2, D=4 (D=6 for rotate, so that E < D/2 exists),
// then D=64 over N=37 tokens.
std::vector<Row> lrpe_rows() {
  std::vector<Row> r;
  auto o = [](Act act, ActDim dim = ActDim::None, int64_t offset = 0) { return LrpeOptions{offset, act, dim, {}}; };
  for (const ActCase& a : kActs) r.push_back(lrpe_row(str("act ", a.name), LrpeKind::Cosine, o(a.act, a.dim),
                                                      {2, 5, 2, 4}, {2, 4}));
  r.push_back(lrpe_row("theta (1, E)", LrpeKind::Cosine, o(Act::Silu), {2, 5, 2, 4}, {1, 4}));
  r.push_back(lrpe_row("theta (H, 1)", LrpeKind::Cosine, o(Act::None, ActDim::None, 2), {2, 5, 2, 4}, {2, 1}));
  r.push_back(lrpe_row("E < D, offset 3", LrpeKind::Cosine, o(Act::Sigmoid, ActDim::None, 3), {2, 5, 2, 4}, {2, 2}));
  r.push_back(lrpe_row("softmax sequence, E < D, offset 7", LrpeKind::Cosine, o(Act::Softmax, ActDim::Sequence, 7),
                       {2, 5, 2, 4}, {1, 3}));
  r.push_back(lrpe_row("silu offset 3, N 37 D 64", LrpeKind::Cosine, o(Act::Silu, ActDim::None, 3), {2, 37, 3, 64},
                       {3, 40}));

  for (const ActCase& a : kActs) r.push_back(lrpe_row(str("act ", a.name), LrpeKind::Rotate, o(a.act, a.dim),
                                                      {2, 5, 2, 6}, {2, 3}));
  r.push_back(lrpe_row("theta (1, E)", LrpeKind::Rotate, o(Act::Silu), {2, 5, 2, 6}, {1, 3}));
  r.push_back(lrpe_row("theta (H, 1)", LrpeKind::Rotate, o(Act::None, ActDim::None, 2), {2, 5, 2, 6}, {2, 1}));
  r.push_back(lrpe_row("E < D/2, offset 3", LrpeKind::Rotate, o(Act::Softmax, ActDim::Feature, 3), {2, 5, 2, 6},
                       {2, 2}));
  r.push_back(lrpe_row("softmax feature, N 37 D 64", LrpeKind::Rotate, o(Act::Softmax, ActDim::Feature),
                       {2, 37, 3, 64}, {1, 32}));

  auto md = [](std::vector<int64_t> grid, int64_t L, Act act = Act::None, ActDim dim = ActDim::None) {
    return MdLrpeOptions{std::move(grid), L, act, dim, false};
  };
  for (const ActCase& a : kActs)
    r.push_back(md_row(str("2d L=1 act ", a.name), md({2, 2}, 1, a.act, a.dim), {2, 5, 2, 4}, {2, 2}));
  r.push_back(md_row("1d L=0", md({5}, 0), {2, 5, 2, 4}, {2, 4}));
  r.push_back(md_row("1d L=2 theta (1, E)", md({3}, 2, Act::Silu), {2, 5, 2, 4}, {1, 4}));
  r.push_back(md_row("2d L=0", md({2, 2}, 0, Act::Relu), {2, 4, 2, 4}, {2, 2}));
  r.push_back(md_row("3d L=0 theta (1, E)", md({1, 2, 2}, 0), {2, 4, 2, 4}, {1, 2}));
  r.push_back(md_row("3d L=1 k*E > D", md({2, 1, 2}, 1, Act::Softmax, ActDim::Sequence), {2, 5, 2, 4}, {2, 2}));
  r.push_back(md_row("3d L=3 act silu", md({2, 3, 2}, 3, Act::Silu), {2, 15, 2, 6}, {2, 2}));
  r.push_back(md_row("4d L=1", md({1, 2, 1, 2}, 1, Act::Sigmoid), {2, 5, 2, 4}, {2, 1}));
  r.push_back(md_row("2d L=5 softmax sequence, N 37 D 64", md({4, 8}, 5, Act::Softmax, ActDim::Sequence),
                     {2, 37, 3, 64}, {3, 32}));
  return r;
}

const ActSpec kNone{}, kSilu{Act::Silu, ActDim::None}, kSigmoid{Act::Sigmoid, ActDim::None},
    kRelu{Act::Relu, ActDim::None}, kSoftFeature{Act::Softmax, ActDim::Feature},
    kSoftSequence{Act::Softmax, ActDim::Sequence};

struct FalCase {
  std::string name;
  FalLrpe lrpe;
  ActSpec q, k, v, g;
  bool causal = false;
  int64_t B = 2, N = 5, M = 5, H = 2, D = 4, E = 3;
  Shape theta = {};                // default: (H, D) for cosine, (H, 2) for rotate and md_cosine
  std::vector<double> decay = {};  // causal: per-head lambda (empty: none)
  bool with_s0 = false;
  int64_t offset = 0;
};

// Noncausal: {o}. Causal through fal_with_state: {o, final state}, with S0 as the last input when used.
Row fal_row(FalCase c) {
  if (c.theta.empty())
    c.theta = c.lrpe == FalLrpe::Cosine ? Shape{c.H, c.D} : Shape{c.H, 2};
  auto inputs = [c](uint64_t seed) {
    std::vector<Arg> a = shapes_of({{c.B, c.N, c.H, c.D}, {c.B, c.M, c.H, c.D}, {c.B, c.M, c.H, c.E},
                                    {c.B, c.N, c.H, c.E}})(seed);
    if (c.with_s0) a.push_back({values({c.B, c.H, fal_state_rows(c.lrpe, c.D), c.E}, seed + 4), true});
    return a;
  };
  auto run = [c](const std::vector<Tensor>& in, Impl impl) -> std::vector<Tensor> {
    const Device dev = in[0].device();
    FalOptions o;
    o.q = c.q;
    o.k = c.k;
    o.v = c.v;
    o.g = c.g;
    o.lrpe = c.lrpe;
    o.causal = c.causal;
    o.offset = c.offset;
    if (c.lrpe != FalLrpe::None) o.theta = rates(c.theta, dev);
    if (c.lrpe == FalLrpe::MdCosine) {
      o.md_shape = {2, 2};
      o.md_extra_tokens = 1;
    }
    if (!c.decay.empty()) o.decay = from_vector(c.decay, {c.H}, DType::F64, dev);
    if (!c.causal) return {fal(in[0], in[1], in[2], in[3], o, impl)};
    auto [out, S] = fal_with_state(in[0], in[1], in[2], in[3], c.with_s0 ? in[4] : Tensor(), o, impl);
    return {out, S};
  };
  // The fused kernels take no md_cosine and no softmax over the sequence.
  const bool fusable = c.lrpe != FalLrpe::MdCosine && c.q.dim != ActDim::Sequence && c.k.dim != ActDim::Sequence;
  return {str("fal ", c.causal ? "causal " : "noncausal ", c.name), inputs, run,
          fusable ? kFloats : std::vector<DType>{}, kF32};
}

std::vector<Row> fal_rows() {
  std::vector<FalCase> c;
  c.push_back({"none, no acts, N != M", FalLrpe::None, kNone, kNone, kNone, kNone, false, 2, 4, 6});
  c.push_back({"cosine silu", FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, false, 2, 4, 6});
  c.push_back({"cosine softmax feature q, offset 3", FalLrpe::Cosine, kSoftFeature, kSilu, kSigmoid, kSilu, false, 1,
               3, 5});
  c.back().offset = 3;
  c.push_back({"rotate softmax sequence q and k", FalLrpe::Rotate, kSoftSequence, kSoftSequence, kNone, kSigmoid,
               false, 2, 4, 6});
  c.push_back({"md_cosine 2x2 + 1, relu v", FalLrpe::MdCosine, kSilu, kSoftFeature, kRelu, kSilu, false});
  // Odd N != M, D 64 (the head size of the device kernels).
  c.push_back({"cosine softmax feature q, N 37 M 45 D 64", FalLrpe::Cosine, kSoftFeature, kSilu, kNone, kSilu, false,
               2, 37, 45, 3, 64, 32});

  c.push_back({"none, no acts", FalLrpe::None, kNone, kNone, kNone, kNone, true});
  c.push_back({"cosine silu, decay", FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, true});
  c.back().decay = {0.9, 0.5};
  c.push_back({"cosine silu, decay, S0", FalLrpe::Cosine, kSilu, kSilu, kSilu, kSigmoid, true});
  c.back().decay = {0.8, 1.0};
  c.back().with_s0 = true;
  c.push_back({"rotate softmax feature, S0, offset 2", FalLrpe::Rotate, kSoftFeature, kSoftFeature, kNone, kSilu,
               true});
  c.back().offset = 2;
  c.back().with_s0 = true;
  c.push_back({"md_cosine, decay", FalLrpe::MdCosine, kSilu, kSigmoid, kNone, kSilu, true});
  c.back().decay = {0.7, 0.95};
  // Longer than one chunk of the composed causal form (128 tokens): the state carried between chunks.
  c.push_back({"cosine silu, decay, S0, N 133", FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, true, 1, 133, 133});
  c.back().decay = {0.97, 0.9};
  c.back().with_s0 = true;
  // Odd N, D 64, softmax over the features, S0 and decay.
  c.push_back({"cosine softmax feature q, decay, S0, N 37 D 64", FalLrpe::Cosine, kSoftFeature, kSilu, kNone, kSilu,
               true, 2, 37, 37, 3, 64, 32});
  c.back().decay = {0.9, 0.99, 0.5};
  c.back().with_s0 = true;
  // Rotate at D 64 (bf16/f16 on CUDA: the chunk kernels behind the LRPE family's rotate kernels), causal and
  // noncausal.
  c.push_back({"rotate silu, decay, S0, offset 2, N 37 D 64", FalLrpe::Rotate, kSilu, kSigmoid, kNone, kSilu, true,
               2, 37, 37, 3, 64, 32, {3, 32}});
  c.back().decay = {0.9, 0.99, 0.5};
  c.back().with_s0 = true;
  c.back().offset = 2;
  c.push_back({"rotate softmax feature k, N 37 M 45 D 64", FalLrpe::Rotate, kSilu, kSoftFeature, kRelu, kSilu, false,
               2, 37, 45, 3, 64, 32, {1, 32}});
  // The small preset's FAL mixer: six heads of D = E = 128 (D' = 256), cosine, silu, per-head decay.
  c.push_back({"small preset head, N 70", FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, true, 1, 70, 70, 6, 128, 128});
  c.back().theta = {6, 128};
  c.back().decay = {0.999, 0.99, 0.97, 0.9, 0.8, 0.5};
  std::vector<Row> r;
  for (const FalCase& f : c) r.push_back(fal_row(f));
  return r;
}

struct TpaCase {
  std::string name;
  int64_t B, N, M, H, Rq, Rk, Rv, D, E;
  bool causal;
  bool rankless = false;  // R_k = R_v = 1 passed without the rank axis
};

Row tpa_row(const TpaCase& c) {
  auto inputs = [c](uint64_t seed) {
    const bool k1 = c.rankless && c.Rk == 1, v1 = c.rankless && c.Rv == 1;
    return shapes_of({{c.B, c.N, c.H, c.Rq}, {c.B, c.N, c.Rq, c.D},
                      k1 ? Shape{c.B, c.M, c.H} : Shape{c.B, c.M, c.H, c.Rk},
                      k1 ? Shape{c.B, c.M, c.D} : Shape{c.B, c.M, c.Rk, c.D},
                      v1 ? Shape{c.B, c.M, c.H} : Shape{c.B, c.M, c.H, c.Rv},
                      v1 ? Shape{c.B, c.M, c.E} : Shape{c.B, c.M, c.Rv, c.E}})(seed);
  };
  auto run = [c](const std::vector<Tensor>& in, Impl impl) -> std::vector<Tensor> {
    TpaOptions o;
    o.causal = c.causal;
    return {tpa_attention(in[0], in[1], in[2], in[3], in[4], in[5], o, impl)};
  };
  // The fused kernels: bf16/f16, D == E in {64, 128}, ranks up to 16.
  const bool fusable = c.D == c.E && (c.D == 64 || c.D == 128) && !c.rankless;
  return {str("tpa_attention ", c.causal ? "causal " : "noncausal ", c.name), inputs, run,
          fusable ? std::vector<DType>{DType::BF16, DType::F16} : std::vector<DType>{},
          {DType::F32, DType::BF16}};
}

std::vector<Row> tpa_rows() {
  return {tpa_row({"ranks (6, 2, 2) N 13 D 8", 2, 13, 13, 3, 6, 2, 2, 8, 8, true}),
          tpa_row({"ranks (6, 2, 2) N 13 D 8", 2, 13, 13, 3, 6, 2, 2, 8, 8, false}),
          tpa_row({"ranks (1, 1, 1) without rank axes, N 7 M 9", 1, 7, 9, 2, 1, 1, 1, 4, 3, false, true}),
          tpa_row({"ranks (6, 2, 2) N 33 D 64", 2, 33, 33, 4, 6, 2, 2, 64, 64, true}),
          tpa_row({"ranks (3, 2, 4) N 21 M 30 D 64", 1, 21, 30, 2, 3, 2, 4, 64, 64, false})};
}

// ---------------------------------------------------------------------------------------------------
// The runner.

struct Outcome {
  std::vector<Tensor> outs, grads;  // on the CPU, in the dtype the op returned
};

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::Reference: return "reference";
    case Impl::Composed: return "composed";
    case Impl::Fused: return "fused";
    default: return "auto";
  }
}

DType arg_dtype(const Arg& a, DType dt) { return a.state ? (dt == DType::F64 ? DType::F64 : DType::F32) : dt; }

// The public ops allocate their own outputs: poisoned blocks of the outputs' and gradients' sizes are put
// in the device's cache just before the op runs, so that the caching allocator hands them out and an
// element a kernel never writes shows as NaN (an intermediate of the same size may take a block first:
// several copies of each are left).
void poison_cached_blocks(const std::vector<Shape>& shapes, DType dt, Device dev) {
  std::vector<Tensor> blocks;
  for (const Shape& s : shapes)
    for (DType t : {dt, DType::F32})
      for (int copy = 0; copy < 4; ++copy) {
        blocks.push_back(empty(s, t, dev));
        poison_(blocks.back());
      }
}

// Outputs and input gradients of one implementation: the gradients are the backward of sum_i <w_i, out_i>
// with random weights w_i from `seed`, rounded through round_dt (the same values on every side). On CUDA,
// blocks of the `poison` shapes are poisoned once the inputs are in place.
Outcome evaluate(const Row& row, const std::vector<Arg>& args, Impl impl, DType dt, Device dev, uint64_t seed,
                 DType round_dt, const std::vector<Shape>& poison = {}) {
  std::vector<Tensor> in;
  for (const Arg& a : args) in.push_back(a.value.to(arg_dtype(a, dt)).to(dev).requires_grad_());
  if (dev.is_cuda()) poison_cached_blocks(poison, dt, dev);
  std::vector<Tensor> outs = row.run(in, impl), weights;
  for (size_t i = 0; i < outs.size(); ++i) {
    const Tensor w = randn(outs[i].shape(), DType::F64, Device::cpu(), seed + 50 + i).to(round_dt);
    weights.push_back(w.to(outs[i].dtype()).to(outs[i].device()));
  }
  backward(outs, weights);
  Outcome r;
  for (const Tensor& o : outs) {
    CHECK(o.device() == dev);
    r.outs.push_back(o.detach().to(Device::cpu()));
  }
  for (const Tensor& x : in) {
    CHECK_MESSAGE(x.grad().defined(), "no gradient reached an input");
    r.grads.push_back(x.grad().defined() ? x.grad().to(Device::cpu()) : zeros_like(x).to(Device::cpu()));
  }
  return r;
}

// One (row, impl, dtype, device) against the f64 CPU reference on the same inputs rounded through dt.
void check_case(const Row& row, uint64_t seed, Impl impl, DType dt, Device dev) {
  const std::vector<Arg> args = row.inputs(seed);
  std::vector<Arg> ref_args = args;
  for (Arg& a : ref_args) a.value = a.value.to(arg_dtype(a, dt)).to(DType::F64);
  const Outcome ref = evaluate(row, ref_args, Impl::Reference, DType::F64, Device::cpu(), seed, dt);
  std::vector<Shape> shapes;
  for (const Tensor& t : ref.outs) shapes.push_back(t.shape());
  for (const Arg& a : args) shapes.push_back(a.value.shape());
  const Outcome got = evaluate(row, args, impl, dt, dev, seed, dt, shapes);
  for (size_t i = 0; i < ref.outs.size(); ++i) {
    INFO("output " << i);
    CHECK_CLOSE_TENSOR(got.outs[i], ref.outs[i], dt);
  }
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    INFO("gradient of input " << i);
    CHECK_CLOSE_TENSOR(got.grads[i], ref.grads[i], dt);
  }
}

struct Combo {
  Impl impl;
  DType dt;
};

// Every row x implementation x dtype on one device, each its own subcase.
void run_table(const std::vector<Row>& rows, Device dev) {
  uint64_t seed = 1000;
  for (const Row& row : rows) {
    seed += 100;
    std::vector<Combo> combos;
    if (dev.is_cuda()) {
      for (DType dt : row.fused) combos.push_back({Impl::Fused, dt});
      for (DType dt : row.composed) combos.push_back({Impl::Composed, dt});
    } else {
      combos.push_back({Impl::Reference, DType::F32});
      combos.push_back({Impl::Composed, DType::F64});
      combos.push_back({Impl::Composed, DType::F32});
    }
    for (const Combo& c : combos) {
      const std::string name = str(row.name, " / ", impl_name(c.impl), " / ", dtype_name(c.dt), " / ",
                                   dev.is_cuda() ? "cuda" : "cpu");
      SUBCASE(name.c_str()) { check_case(row, seed, c.impl, c.dt, dev); }
    }
  }
}

}  // namespace

TEST_CASE("consistency lrpe") { run_table(lrpe_rows(), Device::cpu()); }
TEST_CASE("consistency fal") { run_table(fal_rows(), Device::cpu()); }
TEST_CASE("consistency tpa_attention") { run_table(tpa_rows(), Device::cpu()); }

TEST_CASE("cuda consistency lrpe" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  run_table(lrpe_rows(), gpu());
}

TEST_CASE("cuda consistency fal" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  run_table(fal_rows(), gpu());
}

TEST_CASE("cuda consistency tpa_attention" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  run_table(tpa_rows(), gpu());
}
