// The shared activations: names, the act/dim rule, and the composed apply_act.
#include <cmath>
#include "helpers.h"
#include "ops/activation.h"

using namespace lintape;
using namespace lintape::test;

TEST_CASE("activation names round trip") {
  for (Act a : {Act::None, Act::Relu, Act::Sigmoid, Act::Silu, Act::Softmax}) CHECK(act_from_name(act_name(a)) == a);
  for (ActDim d : {ActDim::None, ActDim::Feature, ActDim::Sequence}) CHECK(act_dim_from_name(act_dim_name(d)) == d);
}

TEST_CASE("bad input activation") {
  check_throws_containing([] { act_from_name("gelu"); }, {"[act]", "unknown activation 'gelu'"});
  check_throws_containing([] { act_dim_from_name("batch"); }, {"[act]", "unknown activation dim 'batch'"});
  check_throws_containing([] { check_act(Act::Softmax, ActDim::None, "my_op"); },
                          {"[my_op]", "softmax needs a dim"});
  check_throws_containing([] { check_act(Act::Relu, ActDim::Sequence, "my_op"); },
                          {"[my_op]", "act relu is elementwise and takes no dim; got dim sequence"});
  check_throws_containing([] { apply_act(randn({2, 3, 4}), Act::Silu, ActDim::None); },
                          {"[apply_act]", "x must be (B, N, H, D); got (2, 3, 4)"});
}

TEST_CASE("apply_act follows the formulas") {
  // x (1, 2, 1, 2): softmax over the feature dim normalises each row of 2, over the sequence each column.
  Tensor x = from_vector({0.0, 1.0, 2.0, -1.0}, {1, 2, 1, 2}, DType::F64);
  std::vector<double> v = {0.0, 1.0, 2.0, -1.0};
  std::vector<double> silu = apply_act(x, Act::Silu, ActDim::None).to_vector<double>();
  for (size_t i = 0; i < v.size(); ++i) CHECK(silu[i] == doctest::Approx(v[i] / (1 + std::exp(-v[i]))));
  std::vector<double> feat = apply_act(x, Act::Softmax, ActDim::Feature).to_vector<double>();
  CHECK(feat[0] == doctest::Approx(1 / (1 + std::exp(1.0))));
  CHECK(feat[2] == doctest::Approx(1 / (1 + std::exp(-3.0))));
  std::vector<double> seq = apply_act(x, Act::Softmax, ActDim::Sequence).to_vector<double>();
  CHECK(seq[0] == doctest::Approx(1 / (1 + std::exp(2.0))));
  CHECK(seq[1] == doctest::Approx(1 / (1 + std::exp(-2.0))));
  CHECK(apply_act(x, Act::Relu, ActDim::None).to_vector<double>() == std::vector<double>{0, 1, 2, 0});
}

TEST_CASE("gradcheck apply_act") {
  for (ActDim d : {ActDim::Feature, ActDim::Sequence}) {
    CAPTURE(act_dim_name(d));
    auto f = [d](const std::vector<Tensor>& in) { return apply_act(in[0], Act::Softmax, d); };
    CHECK_GRADCHECK(f, (std::vector<Tensor>{leaf({2, 3, 2, 4}, 7)}));
  }
  auto f = [](const std::vector<Tensor>& in) { return apply_act(in[0], Act::Silu, ActDim::None); };
  CHECK_GRADCHECK(f, (std::vector<Tensor>{leaf({2, 3, 2, 4}, 8)}));
}
