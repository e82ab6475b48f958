// FAL family on CUDA: the fused decoding step against the CPU reference (whole sequence in f64), its launcher
// on poisoned outputs, and the composed path on the device against the reference.
#include <cmath>
#include <string>
#include <vector>
#include "helpers.h"
#include "ops/fal.h"
#include "ops/fal_cuda.h"
#include "ops/shape.h"

using namespace lintape;
using namespace lintape::test;

namespace {

Tensor rates(const Shape& shape, Device dev) {
  std::vector<double> v;
  for (int64_t h = 0; h < shape[0]; ++h)
    for (int64_t k = 0; k < shape[1]; ++k)
      v.push_back(std::pow(10000.0, -double(k) / double(shape[1])) * (1 + double(h) / 4));
  return from_vector(v, shape, DType::F32, dev);
}

struct StepConfig {
  std::string name;
  FalLrpe lrpe;
  int64_t D, E;
  ActSpec q, k, v, g;
  bool decay;
};

FalOptions step_options(const StepConfig& c, int64_t H, Device dev) {
  FalOptions o;
  o.q = c.q;
  o.k = c.k;
  o.v = c.v;
  o.g = c.g;
  o.lrpe = c.lrpe;
  o.causal = true;
  if (c.lrpe == FalLrpe::Cosine) o.theta = rates({H, c.D}, dev);
  if (c.lrpe == FalLrpe::Rotate) o.theta = rates({1, c.D / 2}, dev);
  if (c.decay) o.decay = from_vector({0.9, 0.99, 0.5}, {H}, DType::F32, dev);
  return o;
}

const ActSpec kNone{}, kSilu{Act::Silu, ActDim::None}, kSoft{Act::Softmax, ActDim::Feature},
    kSigmoid{Act::Sigmoid, ActDim::None}, kRelu{Act::Relu, ActDim::None};

const std::vector<StepConfig> kStepConfigs = {
    {"cosine D 128 E 128 silu decay", FalLrpe::Cosine, 128, 128, kSilu, kSilu, kNone, kSilu, true},
    {"cosine D 64 E 80 softmax q, relu v", FalLrpe::Cosine, 64, 80, kSoft, kSilu, kRelu, kSigmoid, true},
    {"rotate D 128 E 64 softmax k and g", FalLrpe::Rotate, 128, 64, kSilu, kSoft, kNone, kSoft, false},
    {"none D 64 E 64 no acts", FalLrpe::None, 64, 64, kNone, kNone, kNone, kNone, true},
};

}  // namespace

TEST_CASE("cuda fal step matches the reference on the whole sequence" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const int64_t B = 2, N = 7, H = 3, offset = 1000;
  uint64_t seed = 1;
  for (const StepConfig& c : kStepConfigs)
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(c.name);
      CAPTURE(dtype_name(dt));
      const int64_t P = fal_state_rows(c.lrpe, c.D);
      std::vector<Tensor> in;  // q, k, v, g on the device, rounded to dt
      for (const Shape& s : {Shape{B, N, H, c.D}, Shape{B, N, H, c.D}, Shape{B, N, H, c.E}, Shape{B, N, H, c.E}})
        in.push_back(randn(s, dt, gpu(), seed++));
      Tensor S0 = randn({B, H, P, c.E}, DType::F32, gpu(), seed++);
      FalOptions o = step_options(c, H, gpu());
      o.offset = offset;
      FalOptions ref_o = step_options(c, H, Device::cpu());
      ref_o.offset = offset;
      ref_o.decay = ref_o.decay.defined() ? ref_o.decay.to(DType::F64) : Tensor();
      std::vector<Tensor> cpu;
      for (const Tensor& t : in) cpu.push_back(t.to(Device::cpu()).to(DType::F64));
      auto [o_ref, S_ref] =
          fal_with_state(cpu[0], cpu[1], cpu[2], cpu[3], S0.to(Device::cpu()).to(DType::F64), ref_o, Impl::Reference);
      Tensor state = S0;
      std::vector<Tensor> outs;
      for (int64_t t = 0; t < N; ++t) {
        FalOptions step = o;
        step.offset = offset + t;
        outs.push_back(fal_step(state, in[0].narrow(1, t, 1), in[1].narrow(1, t, 1), in[2].narrow(1, t, 1),
                                in[3].narrow(1, t, 1), step));
      }
      CHECK(state.dtype() == DType::F32);
      CHECK_CLOSE_TENSOR(cat(outs, 1).to(Device::cpu()), o_ref, dt);
      CHECK_CLOSE_TENSOR(state.to(Device::cpu()), S_ref, DType::F32);
    }
}

TEST_CASE("cuda fal step launcher writes every element" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const int64_t B = 3, H = 3, D = 64, E = 80, P = 2 * D;
  Tensor q = randn({B, 1, H, D}, DType::BF16, gpu(), 1), k = randn({B, 1, H, D}, DType::BF16, gpu(), 2);
  Tensor v = randn({B, 1, H, E}, DType::BF16, gpu(), 3), g = randn({B, 1, H, E}, DType::BF16, gpu(), 4);
  Tensor S = randn({B, H, P, E}, DType::F32, gpu(), 5);
  FalStepSpec spec;
  spec.act_q = spec.act_k = FalStepSpec::kSilu;
  spec.lrpe = FalStepSpec::kCosine;
  spec.theta = rates({H, D}, gpu());
  spec.position = 12;
  Tensor S_out = empty(S.shape(), DType::F32, gpu()), out = empty(g.shape(), DType::BF16, gpu());
  poison_(S_out);
  poison_(out);
  fal_cuda::step(q, k, v, g, spec, S, S_out, out);
  for (double x : S_out.to_vector<double>()) REQUIRE(std::isfinite(x));
  for (double x : out.to_vector<double>()) REQUIRE(std::isfinite(x));
#endif
}

TEST_CASE("cuda fal composed matches reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const int64_t B = 2, H = 3, D = 64, E = 32;
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    const int64_t N = 37, M = causal ? N : 45;
    std::vector<Tensor> in;
    uint64_t seed = 40;
    for (const Shape& s : {Shape{B, N, H, D}, Shape{B, M, H, D}, Shape{B, M, H, E}, Shape{B, N, H, E}})
      in.push_back(randn(s, DType::F32, gpu(), seed++));
    StepConfig c{"", FalLrpe::Cosine, D, E, kSoft, kSilu, kNone, kSilu, causal};
    FalOptions o = step_options(c, H, gpu()), ref_o = step_options(c, H, Device::cpu());
    o.causal = ref_o.causal = causal;
    Tensor S0;
    if (causal) S0 = randn({B, H, 2 * D, E}, DType::F32, gpu(), seed++);
    std::vector<Tensor> cpu;
    for (const Tensor& t : in) cpu.push_back(t.to(Device::cpu()).to(DType::F64));
    for (Tensor& t : in) t.requires_grad_();
    for (Tensor& t : cpu) t.requires_grad_();
    auto run = [&](const std::vector<Tensor>& x, const FalOptions& opts, const Tensor& s0, Impl impl) {
      if (!causal) return fal(x[0], x[1], x[2], x[3], opts, impl);
      return fal_with_state(x[0], x[1], x[2], x[3], s0, opts, impl).first;
    };
    Tensor ref = run(cpu, ref_o, causal ? S0.to(Device::cpu()).to(DType::F64) : Tensor(), Impl::Reference);
    Tensor got = run(in, o, S0, Impl::Composed);
    Tensor dout = randn(ref.shape(), DType::F32, gpu(), 99);
    backward(ref, dout.to(Device::cpu()).to(DType::F64));
    backward(got, dout);
    CHECK_CLOSE_TENSOR(got.to(Device::cpu()), ref, DType::F32);
    for (size_t i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK_CLOSE_TENSOR(in[i].grad().to(Device::cpu()), cpu[i].grad(), DType::F32);
    }
  }
}
