// FAL family on the CPU: gradient checks of the reference (noncausal and causal, every LRPE kind, the acts,
// decay, S0 and the final state), chunked and prefilled causal vs fal_step, and the
// input errors.
#include <cmath>
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/fal/fal.h"
#include "ops/reduce.h"
#include "ops/shape.h"

using namespace lintape;
using namespace lintape::test;

namespace {

const ActSpec kNone{}, kSilu{Act::Silu, ActDim::None}, kSigmoid{Act::Sigmoid, ActDim::None},
    kRelu{Act::Relu, ActDim::None}, kSoftFeature{Act::Softmax, ActDim::Feature},
    kSoftSequence{Act::Softmax, ActDim::Sequence};

struct Config {
  std::string name;
  FalOptions o;
  int64_t B = 2, N = 5, M = 5, H = 2, D = 4, E = 3;
  bool with_s0 = false;
};

FalOptions options(FalLrpe lrpe, ActSpec q, ActSpec k, ActSpec v, ActSpec g, bool causal) {
  FalOptions o;
  o.q = q;
  o.k = k;
  o.v = v;
  o.g = g;
  o.lrpe = lrpe;
  o.causal = causal;
  if (lrpe == FalLrpe::Cosine) o.theta = rates({2, 4});
  if (lrpe == FalLrpe::Rotate) o.theta = rates({2, 2});
  if (lrpe == FalLrpe::MdCosine) {
    o.theta = rates({2, 2});
    o.md_shape = {2, 2};
    o.md_extra_tokens = 1;
  }
  return o;
}

Tensor decay(std::vector<double> lam) { return from_vector(lam, {int64_t(lam.size())}, DType::F64); }

std::vector<Config> noncausal_configs() {
  std::vector<Config> c;
  c.push_back({"none, no acts, N != M", options(FalLrpe::None, kNone, kNone, kNone, kNone, false), 2, 4, 6});
  c.push_back({"cosine silu", options(FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, false), 2, 4, 6});
  c.push_back({"cosine softmax feature q, offset 3",
               options(FalLrpe::Cosine, kSoftFeature, kSilu, kSigmoid, kSilu, false), 1, 3, 5});
  c.back().o.offset = 3;
  c.push_back({"rotate softmax sequence q and k",
               options(FalLrpe::Rotate, kSoftSequence, kSoftSequence, kNone, kSigmoid, false), 2, 4, 6});
  c.push_back(
      {"md_cosine 2x2 + 1, relu v", options(FalLrpe::MdCosine, kSilu, kSoftFeature, kRelu, kSilu, false), 2, 5, 5});
  return c;
}

std::vector<Config> causal_configs() {
  std::vector<Config> c;
  c.push_back({"none, no acts", options(FalLrpe::None, kNone, kNone, kNone, kNone, true)});
  c.push_back({"cosine silu, decay", options(FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, true)});
  c.back().o.decay = decay({0.9, 0.5});
  c.push_back({"cosine silu, decay, S0", options(FalLrpe::Cosine, kSilu, kSilu, kSilu, kSigmoid, true)});
  c.back().o.decay = decay({0.8, 1.0});
  c.back().with_s0 = true;
  c.push_back({"rotate softmax feature, S0, offset 2",
               options(FalLrpe::Rotate, kSoftFeature, kSoftFeature, kNone, kSilu, true)});
  c.back().o.offset = 2;
  c.back().with_s0 = true;
  c.push_back({"md_cosine, decay", options(FalLrpe::MdCosine, kSilu, kSigmoid, kNone, kSilu, true)});
  c.back().o.decay = decay({0.7, 0.95});
  return c;
}

struct Inputs {
  std::vector<Tensor> t;  // q, k, v, g, and S0 when used
};

Inputs make_inputs(const Config& c, uint64_t seed, bool requires_grad = true) {
  const int64_t P = fal_state_rows(c.o.lrpe, c.D);
  auto make = [&](const Shape& s) {
    Tensor x = leaf(s, seed++, 0.05);
    if (!requires_grad) x = x.detach();
    return x;
  };
  Inputs in;
  in.t = {make({c.B, c.N, c.H, c.D}), make({c.B, c.M, c.H, c.D}), make({c.B, c.M, c.H, c.E}),
          make({c.B, c.N, c.H, c.E})};
  if (c.with_s0) in.t.push_back(make({c.B, c.H, P, c.E}));
  return in;
}

// o and (causal) the final state, flattened into one tensor so that both get checked.
Tensor run_config(const Config& c, const std::vector<Tensor>& in, Impl impl) {
  if (!c.o.causal) return fal(in[0], in[1], in[2], in[3], c.o, impl);
  auto [o, S] = fal_with_state(in[0], in[1], in[2], in[3], c.with_s0 ? in[4] : Tensor(), c.o, impl);
  return cat({o.reshape({-1}), S.reshape({-1}).to(o.dtype())}, 0);
}

void gradcheck_configs(const std::vector<Config>& configs, Impl impl) {
  uint64_t seed = 1;
  for (const Config& c : configs) {
    CAPTURE(c.name);
    auto f = [&](const std::vector<Tensor>& in) { return run_config(c, in, impl); };
    CHECK_GRADCHECK(f, make_inputs(c, seed).t);
    seed += 10;
  }
}

}  // namespace

TEST_CASE("gradcheck fal noncausal reference") { gradcheck_configs(noncausal_configs(), Impl::Reference); }
TEST_CASE("gradcheck fal causal reference") { gradcheck_configs(causal_configs(), Impl::Reference); }

TEST_CASE("gradcheck fal composed") {
  gradcheck_configs({noncausal_configs()[1], causal_configs()[2]}, Impl::Composed);
}

TEST_CASE("fal reference follows the formula") {
  // B = H = 1, D = E = 1, no acts, no LRPE: noncausal o_t = g_t q_t sum_s k_s v_s; causal with decay o_t = g_t
  // q_t sum_{s <= t} lambda^(t - s) k_s v_s.
  Tensor q = from_vector({1, 2, 3}, {1, 3, 1, 1}, DType::F64), k = from_vector({1, -1, 2}, {1, 3, 1, 1}, DType::F64);
  Tensor v = from_vector({2, 1, 1}, {1, 3, 1, 1}, DType::F64), g = from_vector({1, 1, 2}, {1, 3, 1, 1}, DType::F64);
  FalOptions o;
  std::vector<double> nc = fal(q, k, v, g, o).to_vector<double>();
  CHECK(nc == std::vector<double>{3, 6, 18});
  o.causal = true;
  o.decay = decay({0.5});
  std::vector<double> c = fal(q, k, v, g, o).to_vector<double>();
  CHECK(c[0] == doctest::Approx(2));
  CHECK(c[1] == doctest::Approx(2 * (0.5 * 2 - 1)));
  CHECK(c[2] == doctest::Approx(2 * 3 * (0.25 * 2 - 0.5 + 2)));
}

// No tokens: an empty output, the final state is S0 and S0's gradient is the final state's.
TEST_CASE("fal causal over an empty sequence passes the state through") {
  const int64_t B = 2, H = 3, D = 4, E = 5;
  FalOptions o;
  o.causal = true;
  o.lrpe = FalLrpe::Cosine;
  o.theta = from_vector({0.5, 0.25, 0.125, 0.0625}, {1, D}, DType::F64);
  o.decay = decay({0.9, 0.5, 0.99});
  for (Impl impl : {Impl::Reference, Impl::Composed}) {
    CAPTURE(int(impl));
    Tensor q = randn({B, 0, H, D}, DType::F64, Device::cpu(), 1), k = randn({B, 0, H, D}, DType::F64, Device::cpu(), 2);
    Tensor v = randn({B, 0, H, E}, DType::F64, Device::cpu(), 3), g = randn({B, 0, H, E}, DType::F64, Device::cpu(), 4);
    Tensor S0 = randn({B, H, 2 * D, E}, DType::F64, Device::cpu(), 5).requires_grad_();
    Tensor dS = randn({B, H, 2 * D, E}, DType::F64, Device::cpu(), 6);
    auto [out, S] = fal_with_state(q, k, v, g, S0, o, impl);
    CHECK(out.shape() == Shape{B, 0, H, E});
    CHECK(S.to_vector<double>() == S0.to_vector<double>());
    backward(sum(S * dS));
    CHECK(S0.grad().to_vector<double>() == dS.to_vector<double>());
  }
}

TEST_CASE("fal chunked causal and prefill plus steps match the whole sequence") {
  for (FalLrpe lrpe : {FalLrpe::None, FalLrpe::Cosine, FalLrpe::Rotate}) {
    CAPTURE(fal_lrpe_name(lrpe));
    Config c{"", options(lrpe, kSilu, kSoftFeature, kNone, kSigmoid, true), 2, 7, 7, 2, 4, 3, true};
    c.o.decay = decay({0.9, 0.6});
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      const Inputs in = make_inputs(c, 77, false);
      auto [o_all, S_all] = fal_with_state(in.t[0], in.t[1], in.t[2], in.t[3], in.t[4], c.o, impl);
      // Two chunks of 3 and 4 tokens, the state carried between them.
      FalOptions first = c.o, second = c.o;
      auto part = [&](int64_t i, int64_t start, int64_t len) { return in.t[size_t(i)].narrow(1, start, len); };
      auto [o1, S1] = fal_with_state(part(0, 0, 3), part(1, 0, 3), part(2, 0, 3), part(3, 0, 3), in.t[4], first, impl);
      second.offset = 3;
      auto [o2, S2] = fal_with_state(part(0, 3, 4), part(1, 3, 4), part(2, 3, 4), part(3, 3, 4), S1, second, impl);
      CHECK_CLOSE_TENSOR(cat({o1, o2}, 1), o_all, DType::F64);
      CHECK_CLOSE_TENSOR(S2, S_all, DType::F64);
      // Prefill 3 tokens, then step through the other 4; and stepping from the start.
      for (int64_t prefill : {int64_t(0), int64_t(3)}) {
        CAPTURE(prefill);
        Tensor state = in.t[4];
        std::vector<Tensor> outs;
        if (prefill > 0) {
          outs.push_back(o1);
          state = S1;
        }
        for (int64_t t = prefill; t < c.N; ++t) {
          FalOptions step = c.o;
          step.offset = t;
          outs.push_back(fal_step(state, part(0, t, 1), part(1, t, 1), part(2, t, 1), part(3, t, 1), step));
        }
        CHECK_CLOSE_TENSOR(cat(outs, 1), o_all, DType::F64);
        CHECK_CLOSE_TENSOR(state, S_all, DType::F64);
      }
    }
  }
}

TEST_CASE("fal step keeps an f32 state for f32 inputs") {
  Config c{"", options(FalLrpe::Cosine, kSilu, kSilu, kNone, kSilu, true), 1, 4, 4, 2, 4, 3, false};
  const Inputs in = make_inputs(c, 5, false);
  std::vector<Tensor> f32;
  for (const Tensor& x : in.t) f32.push_back(x.to(DType::F32));
  Tensor state = zeros({1, 2, 8, 3}, DType::F32);
  Tensor o = fal_step(state, f32[0].narrow(1, 0, 1), f32[1].narrow(1, 0, 1), f32[2].narrow(1, 0, 1),
                      f32[3].narrow(1, 0, 1), c.o);
  CHECK(state.dtype() == DType::F32);
  CHECK(o.dtype() == DType::F32);
  CHECK(o.shape() == Shape{1, 1, 2, 3});
}

TEST_CASE("bad input fal") {
  auto t = [](const Shape& s, DType dt = DType::F32) { return randn(s, dt, Device::cpu(), 1); };
  Tensor q = t({2, 5, 3, 4}), k = t({2, 6, 3, 4}), v = t({2, 6, 3, 8}), g = t({2, 5, 3, 8});
  FalOptions nc;
  FalOptions causal;
  causal.causal = true;
  Tensor k5 = t({2, 5, 3, 4}), v5 = t({2, 5, 3, 8});

  check_throws_containing([&] { fal(q, k, v, g, causal); }, {"[fal]", "N == M", "N = 5", "M = 6"});
  FalOptions bad_decay = causal;
  bad_decay.decay = from_vector({0.5, 1.5, 0.9}, {3});
  check_throws_containing([&] { fal(q, k5, v5, g, bad_decay); }, {"[fal]", "decay", "(0, 1]", "1.5", "head 1"});
  bad_decay.decay = from_vector({0.5, 0.0, 0.9}, {3});
  check_throws_containing([&] { fal(q, k5, v5, g, bad_decay); }, {"[fal]", "decay", "(0, 1]", "got 0"});
  bad_decay.decay = from_vector({0.5, 0.5}, {2});
  check_throws_containing([&] { fal(q, k5, v5, g, bad_decay); }, {"[fal]", "decay", "(H) = (3)", "(2)"});
  FalOptions nc_decay = nc;
  nc_decay.decay = from_vector({0.5, 0.5, 0.5}, {3});
  check_throws_containing([&] { fal(q, k, v, g, nc_decay); }, {"[fal]", "decay", "causal mode only", "noncausal"});

  check_throws_containing([&] { fal(q, t({1, 6, 3, 4}), v, g, nc); }, {"[fal]", "k must be", "B = 2", "(1, 6, 3, 4)"});
  check_throws_containing([&] { fal(q, t({2, 6, 2, 4}), v, g, nc); }, {"[fal]", "k must be", "H = 3", "(2, 6, 2, 4)"});
  check_throws_containing([&] { fal(q, t({2, 6, 3, 5}), v, g, nc); }, {"[fal]", "k must be", "D = 4", "(2, 6, 3, 5)"});
  check_throws_containing([&] { fal(q, k, t({2, 7, 3, 8}), g, nc); }, {"[fal]", "v must be", "M = 6", "(2, 7, 3, 8)"});
  check_throws_containing(
      [&] {
        fal(q, k, v, t({2, 5, 3, 7}), nc);
      },
      {"[fal]", "g must be", "(2, 5, 3, 8)", "(2, 5, 3, 7)"});
  check_throws_containing(
      [&] {
        fal(q, k, t({2, 6, 3, 8}, DType::F64), g, nc);
      },
      {"[fal]", "v must have q's dtype f32", "got f64"});
  check_throws_containing([&] { fal(q, k, v, t({2, 5, 8}), nc); }, {"[fal]", "g must be a 4-D tensor", "(2, 5, 8)"});

  FalOptions soft = nc;
  soft.q = {Act::Softmax, ActDim::None};
  check_throws_containing([&] { fal(q, k, v, g, soft); }, {"[fal]", "act of q", "softmax needs a dim", "got dim none"});
  FalOptions relu_dim = nc;
  relu_dim.g = {Act::Relu, ActDim::Feature};
  check_throws_containing([&] { fal(q, k, v, g, relu_dim); }, {"[fal]", "act of g", "takes no dim", "feature"});
  FalOptions seq = causal;
  seq.k = {Act::Softmax, ActDim::Sequence};
  check_throws_containing([&] { fal(q, k5, v5, g, seq); },
                          {"[fal]", "act of k", "future tokens", "got softmax over the sequence"});

  FalOptions neg = nc;
  neg.offset = -1;
  check_throws_containing([&] { fal(q, k, v, g, neg); }, {"[fal]", "offset must be >= 0", "got -1"});
  FalOptions no_theta = nc;
  no_theta.lrpe = FalLrpe::Cosine;
  check_throws_containing([&] { fal(q, k, v, g, no_theta); }, {"[fal]", "cosine needs theta", "undefined"});

  FalOptions cos = causal;
  cos.lrpe = FalLrpe::Cosine;
  cos.theta = rates({3, 4});
  check_throws_containing(
      [&] {
        fal_with_state(q, k5, v5, g, zeros({2, 3, 4, 8}), cos);
      },
      {"[fal_with_state]", "S0 must be (B, H, D', E) = (2, 3, 8, 8)", "got (2, 3, 4, 8)"});
  check_throws_containing(
      [&] {
        fal_with_state(q, k5, v5, g, zeros({2, 3, 8, 8}, DType::BF16), cos);
      },
      {"[fal_with_state]", "S0 must be f32", "got bf16"});
  check_throws_containing([&] { fal_with_state(q, k, v, g, Tensor(), nc); },
                          {"[fal_with_state]", "causal mode", "got noncausal"});

  Tensor state = zeros({2, 3, 4, 8});
  auto one = [&](const Tensor& x) { return x.narrow(1, 0, 1); };
  check_throws_containing([&] { fal_step(state, q, k5, v5, g, causal); }, {"[fal_step]", "one token", "(2, 5, 3, 4)"});
  Tensor bad_state = zeros({2, 3, 4, 4});
  check_throws_containing([&] { fal_step(bad_state, one(q), one(k), one(v), one(g), causal); },
                          {"[fal_step]", "state must be (B, H, D', E) = (2, 3, 4, 8)", "(2, 3, 4, 4)"});
  FalOptions step_seq = causal;
  step_seq.q = {Act::Softmax, ActDim::Sequence};
  check_throws_containing([&] { fal_step(state, one(q), one(k), one(v), one(g), step_seq); },
                          {"[fal_step]", "act of q", "future tokens"});
}
