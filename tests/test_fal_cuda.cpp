// FAL family on CUDA: the fused decoding step against the CPU reference (whole sequence in f64), its launcher
// on poisoned outputs, and the fused sequence kernels
// (noncausal and causal, called directly on poisoned outputs and through Impl::Fused) against the reference,
// the step.
#include <cmath>
#include <string>
#include <vector>
#include "fal_cuda_helpers.h"
#include "helpers.h"
#include "ops/fal/fal.h"
#include "core/allocator.h"
#include "ops/elementwise.h"
#include "ops/fal/launch.h"
#include "ops/fal/paths.h"
#include "core/cuda.h"
#include "ops/reduce.h"
#include "ops/shape.h"

using namespace lintape;
using namespace lintape::test;
using namespace lintape::test::fal_cuda_cases;

namespace {

const std::vector<StepConfig> kStepConfigs = {
    {"cosine D 128 E 128 silu decay", FalLrpe::Cosine, 128, 128, kSilu, kSilu, kNone, kSilu, true},
    {"cosine D 64 E 80 softmax q, relu v", FalLrpe::Cosine, 64, 80, kSoft, kSilu, kRelu, kSigmoid, true},
    {"rotate D 128 E 64 softmax k and g", FalLrpe::Rotate, 128, 64, kSilu, kSoft, kNone, kSoft, false},
    {"none D 64 E 64 no acts", FalLrpe::None, 64, 64, kNone, kNone, kNone, kNone, true},
    {"rotate D 64 E 37 (one column a thread)", FalLrpe::Rotate, 64, 37, kSilu, kSilu, kNone, kSilu, true},
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

namespace {



// Fused (launchers on poisoned outputs, then Impl::Auto through the tape) against the f64 reference: the
// output, the final state, the four input gradients and dS0, with the final state's gradient fed in.
// N and M default to odd lengths of a few 16-token chunks; long runs carry the state over many chunks.
// with_state false: causal without S0 and without a gradient of the final state. m > 0: M (noncausal).
// segments > 0: the causal launchers cut the sequence into that many segments (0: as the shapes want).
void check_fused_sequence(const StepConfig& c, bool causal, DType dt, uint64_t seed, int64_t n = 0, int64_t B = 2,
                          bool with_state = true, int64_t m = 0, int64_t segments = 0) {
#if LINTAPE_WITH_CUDA
  const int64_t H = 3, N = n > 0 ? n : causal ? 41 : 37, M = causal ? N : m > 0 ? m : n > 0 ? n + 8 : 45;
  const int64_t P = fal_state_rows(c.lrpe, c.D);
  std::vector<Tensor> in;  // q, k, v, g on the device, rounded to dt
  for (const Shape& s : {Shape{B, N, H, c.D}, Shape{B, M, H, c.D}, Shape{B, M, H, c.E}, Shape{B, N, H, c.E}})
    in.push_back(randn(s, dt, gpu(), seed++));
  const Tensor dout = randn({B, N, H, c.E}, dt, gpu(), seed++);
  const bool states = causal && with_state;
  const Tensor S0 = states ? randn({B, H, P, c.E}, DType::F32, gpu(), seed++) : Tensor();
  const Tensor dS = states ? randn({B, H, P, c.E}, DType::F32, gpu(), seed++) : Tensor();
  FalOptions o = step_options(c, H, gpu()), ref_o = step_options(c, H, Device::cpu());
  o.causal = ref_o.causal = causal;
  o.offset = ref_o.offset = 5;
  if (!causal) o.decay = ref_o.decay = Tensor();
  if (ref_o.decay.defined()) ref_o.decay = ref_o.decay.to(DType::F64);
  auto to_ref = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F64); };

  std::vector<Tensor> cpu;
  for (const Tensor& t : in) cpu.push_back(to_ref(t).requires_grad_());
  Tensor S0_ref = states ? to_ref(S0).requires_grad_() : Tensor();
  Tensor o_ref, S_ref;
  if (causal)
    std::tie(o_ref, S_ref) = fal_with_state(cpu[0], cpu[1], cpu[2], cpu[3], S0_ref, ref_o, Impl::Reference);
  else
    o_ref = fal(cpu[0], cpu[1], cpu[2], cpu[3], ref_o, Impl::Reference);
  Tensor loss = sum(o_ref * to_ref(dout));
  if (states) loss = loss + sum(S_ref * to_ref(dS));
  backward(loss);

  const FalStepSpec spec = kernel_spec(c, o);
  Tensor out = empty(o_ref.shape(), dt, gpu()), state = empty({B, H, P, c.E}, DType::F32, gpu());
  poison_(out);
  poison_(state);
  if (causal)
    fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out, state, segments);
  else
    fal_cuda::noncausal_forward(in[0], in[1], in[2], in[3], spec, state, out);
  CHECK_CLOSE_TENSOR(out.to(Device::cpu()), o_ref, dt);
  if (causal) CHECK_CLOSE_TENSOR(state.to(Device::cpu()), S_ref, dt);
  auto poisoned = [](const Shape& shape, DType type) {
    Tensor t = empty(shape, type, gpu());
    poison_(t);
    return t;
  };
  std::vector<Tensor> grads;
  for (const Tensor& t : in) grads.push_back(poisoned(t.shape(), dt));
  Tensor dS0 = states ? poisoned(S0.shape(), DType::F32) : Tensor();
  if (causal)
    fal_cuda::causal_backward(in[0], in[1], in[2], in[3], spec, S0, dout, dS, grads[0], grads[1], grads[2], grads[3],
                              dS0, segments);
  else
    fal_cuda::noncausal_backward(in[0], in[1], in[2], in[3], spec, state, dout, grads[0], grads[1], grads[2],
                                 grads[3]);
  for (size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK_CLOSE_TENSOR(grads[i].to(Device::cpu()), cpu[i].grad(), dt);
  }
  if (states) CHECK_CLOSE_TENSOR(dS0.to(Device::cpu()), S0_ref.grad(), dt);

  // The chunked backward at this cut (from `saved` chunk states when defined) on poisoned gradients, each checked
  // against the reference; its gradients, then dS0, for the bit-for-bit comparisons below.
  auto chunked_backward = [&](const Tensor& saved) {
    std::vector<Tensor> g;
    for (const Tensor& t : in) g.push_back(poisoned(t.shape(), dt));
    g.push_back(states ? poisoned(S0.shape(), DType::F32) : Tensor());
    fal_cuda::causal_backward(in[0], in[1], in[2], in[3], spec, S0, dout, dS, g[0], g[1], g[2], g[3], g[4], segments,
                              saved);
    for (size_t i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK_CLOSE_TENSOR(g[i].to(Device::cpu()), cpu[i].grad(), dt);
    }
    if (states) CHECK_CLOSE_TENSOR(g[4].to(Device::cpu()), S0_ref.grad(), dt);
    return g;
  };
  if (causal && fal_cuda::causal_chunked(dt, c.D, c.E, spec)) {
    // Each kernel of the state passes in turn (the wgmma walks where the device runs them, then the mma.sync
    // slices): the backward with both state passes, then the forward saving every chunk's entering state
    // (poisoned first) and the backward reading them instead of running its forward state pass, at the same
    // cut: the tape's way when it records the backward.
    struct Restore {
      ~Restore() { fal_cuda::set_state_pass_kernel(fal_cuda::StatePassKernel::Auto); }
    } restore;
    for (const auto kernel : {fal_cuda::StatePassKernel::Walk, fal_cuda::StatePassKernel::Slices}) {
      CAPTURE(kernel == fal_cuda::StatePassKernel::Walk ? "walk" : "slices");
      fal_cuda::set_state_pass_kernel(kernel);
      chunked_backward(Tensor());
      const Tensor saved = poisoned({B, H, (N + 63) / 64, P, c.E}, dt);
      const Tensor out2 = poisoned(o_ref.shape(), dt), state2 = poisoned({B, H, P, c.E}, DType::F32);
      fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out2, state2, segments, saved);
      CHECK(rel_error(out2.to(Device::cpu()), out.to(Device::cpu())) == 0.0);
      CHECK(rel_error(state2.to(Device::cpu()), state.to(Device::cpu())) == 0.0);
      const std::vector<Tensor> grads2 = chunked_backward(saved);
      // The forward saving the even chunks' states only (the same values, bit for bit), and the backward
      // advancing each odd chunk's from the one before.
      const int64_t nC = (N + 63) / 64, half_chunks = (nC + 1) / 2;
      const Tensor half = poisoned({B, H, half_chunks, P, c.E}, dt);
      const Tensor out3 = poisoned(o_ref.shape(), dt), state3 = poisoned({B, H, P, c.E}, DType::F32);
      fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out3, state3, segments, half);
      CHECK(rel_error(out3.to(Device::cpu()), out.to(Device::cpu())) == 0.0);
      CHECK(rel_error(state3.to(Device::cpu()), state.to(Device::cpu())) == 0.0);
      const Tensor half_cpu = half.to(Device::cpu()), saved_cpu = saved.to(Device::cpu());
      for (int64_t j = 0; j < half_chunks; ++j) {
        CAPTURE(j);
        CHECK(rel_error(half_cpu.narrow(2, j, 1).contiguous(), saved_cpu.narrow(2, 2 * j, 1).contiguous()) == 0.0);
      }
      const std::vector<Tensor> grads3 = chunked_backward(half);
      // dk, dv and dS0 read no S_c: the same bits as from every chunk's state.
      for (size_t i : {size_t(1), size_t(2)}) {
        CAPTURE(i);
        CHECK(rel_error(grads3[i].to(Device::cpu()), grads2[i].to(Device::cpu())) == 0.0);
      }
      if (states) CHECK(rel_error(grads3[4].to(Device::cpu()), grads2[4].to(Device::cpu())) == 0.0);
    }
    // The mma.sync forward too (the wgmma forward is the default where it runs).
    struct RestoreForward {
      ~RestoreForward() { fal_cuda::set_forward_kernel(fal_cuda::ForwardKernel::Auto); }
    } restore_forward;
    fal_cuda::set_forward_kernel(fal_cuda::ForwardKernel::Chunks);
    const Tensor out4 = poisoned(o_ref.shape(), dt), state4 = poisoned({B, H, P, c.E}, DType::F32);
    fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out4, state4, segments);
    CHECK_CLOSE_TENSOR(out4.to(Device::cpu()), o_ref, dt);
    CHECK_CLOSE_TENSOR(state4.to(Device::cpu()), S_ref, dt);
    // The mma.sync gradient kernel too (the wgmma kernel is the default where it runs): from the state passes,
    // then from the even chunks' saved states.
    struct RestoreGradient {
      ~RestoreGradient() { fal_cuda::set_gradient_kernel(fal_cuda::GradientKernel::Auto); }
    } restore_gradient;
    fal_cuda::set_gradient_kernel(fal_cuda::GradientKernel::Chunks);
    chunked_backward(Tensor());
    const Tensor half = poisoned({B, H, ((N + 63) / 64 + 1) / 2, P, c.E}, dt);
    fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out4, state4, segments, half);
    chunked_backward(half);
  }

  // The same through Impl::Fused, which records the kernels' backward on the tape (saving the chunk states: every
  // chunk's, then on the chunk kernels the even chunks' only). The blocks of the sizes of its outputs, gradients and
  // temporaries are poisoned first: the caching allocator hands freed blocks of a size on to the next tensors of
  // that size.
  struct RestoreSaving {
    ~RestoreSaving() { fal_paths::set_saved_states(fal_paths::SavedStates::Auto); }
  } restore_saving;
  const bool chunks = causal && fal_paths::chunked(in[0], in[2], o);  // rotate too (rotated first)
  for (const auto saving : {fal_paths::SavedStates::All, fal_paths::SavedStates::Half}) {
    if (saving == fal_paths::SavedStates::Half && !chunks) break;
    CAPTURE(saving == fal_paths::SavedStates::Half ? "half states" : "all states");
    fal_paths::set_saved_states(saving);
    {
      std::vector<Tensor> blocks;
      for (int i = 0; i < 3; ++i)
        for (const Tensor& t : in) blocks.push_back(poisoned(t.shape(), dt));
      if (causal) blocks.push_back(poisoned({B, H, P, c.E}, DType::F32));
    }
    std::vector<Tensor> leaves;
    for (const Tensor& t : in) leaves.push_back(t.detach().requires_grad_());
    Tensor S0_leaf = states ? S0.detach().requires_grad_() : Tensor();
    Tensor got, S_got;
    if (causal)
      std::tie(got, S_got) = fal_with_state(leaves[0], leaves[1], leaves[2], leaves[3], S0_leaf, o, Impl::Fused);
    else
      got = fal(leaves[0], leaves[1], leaves[2], leaves[3], o, Impl::Fused);
    Tensor loss_got = sum(got.to(DType::F32) * dout.to(DType::F32));
    if (states) loss_got = loss_got + sum(S_got * dS);
    backward(loss_got);
    CHECK_CLOSE_TENSOR(got.to(Device::cpu()), o_ref, dt);
    for (size_t i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK_CLOSE_TENSOR(leaves[i].grad().to(Device::cpu()), cpu[i].grad(), dt);
    }
    if (states) CHECK_CLOSE_TENSOR(S0_leaf.grad().to(Device::cpu()), S0_ref.grad(), dt);
  }
#else
  (void)c, (void)causal, (void)dt, (void)seed, (void)n, (void)B, (void)with_state, (void)m, (void)segments;
#endif
}

}  // namespace

TEST_CASE("cuda fal fused noncausal matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 200;
  for (const StepConfig& c : kSequenceConfigs)
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(c.name);
      CAPTURE(dtype_name(dt));
      check_fused_sequence(c, false, dt, seed += 10);
    }
}

TEST_CASE("cuda fal fused causal matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 300;
  for (const StepConfig& c : kSequenceConfigs)
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(c.name);
      CAPTURE(dtype_name(dt));
      check_fused_sequence(c, true, dt, seed += 10);
    }
}

// Hundreds of tokens: the carried state (and its gradient, carried backward) crosses many chunks; decay and
// softmax keep the sums of the long cases in range.
TEST_CASE("cuda fal fused long sequences match the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 600;
  for (bool causal : {true, false})
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(causal);
      CAPTURE(dtype_name(dt));
      check_fused_sequence(kSequenceConfigs[2], causal, dt, seed += 10, 333, 1);
    }
}

namespace {

// The chunk-parallel kernels (bf16 and f16; ops/fal/chunk.cuh) on lengths around their 64-token chunks (one
// partial chunk, exactly one, several with a partial last), D 64 and 128, decay on and off, with and without
// S0 and the final state's gradient. Three chunks run as the shapes want (B x H = 6: a segment a chunk), in
// one segment, and in two (two chunks, then the partial one).
const std::vector<StepConfig> kChunkConfigs = {
    {"cosine D 128 E 128 silu decay", FalLrpe::Cosine, 128, 128, kSilu, kSilu, kNone, kSilu, true},
    {"cosine D 64 E 64 sigmoid k, relu v", FalLrpe::Cosine, 64, 64, kSilu, kSigmoid, kRelu, kSilu, false},
    {"none D 64 E 80 no acts decay", FalLrpe::None, 64, 80, kNone, kNone, kNone, kNone, true},
    {"cosine D 128 E 32 relu q, sigmoid g", FalLrpe::Cosine, 128, 32, kRelu, kSilu, kNone, kSigmoid, true},
};

}  // namespace

TEST_CASE("cuda fal chunked causal matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  uint64_t seed = 700;
  for (const StepConfig& c : kChunkConfigs)
    for (DType dt : {DType::BF16, DType::F16})
      for (const auto& [N, segments] : {std::pair<int64_t, int64_t>{23, 0}, {64, 0}, {161, 0}, {161, 1}, {161, 2}})
        for (bool with_state : {true, false}) {
          CAPTURE(c.name);
          CAPTURE(dtype_name(dt));
          CAPTURE(N);
          CAPTURE(segments);
          CAPTURE(with_state);
          FalOptions o = step_options(c, 3, gpu());
          REQUIRE(fal_cuda::causal_chunked(dt, c.D, c.E, kernel_spec(c, o)));
          check_fused_sequence(c, true, dt, seed += 10, N, 2, with_state, 0, segments);
        }
#endif
}

// Many chunks: the states carried both ways cross a dozen chunk boundaries, in one segment, in four (three of
// four chunks and a partial one) and as the shapes want (B x H = 3: many segments).
TEST_CASE("cuda fal chunked causal long sequence matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (int64_t segments : {0, 1, 4}) {
    CAPTURE(segments);
    check_fused_sequence(kChunkConfigs[0], true, DType::BF16, 800, 777, 1, true, 0, segments);
    check_fused_sequence(kChunkConfigs[2], true, DType::F16, 810, 700, 1, false, 0, segments);
  }
}

#if LINTAPE_WITH_CUDA
// The Hopper forward's balanced cut over a given number of blocks for a scope (then as the shapes want).
struct ForwardBlocks {
  explicit ForwardBlocks(int64_t blocks) { fal_cuda::set_forward_blocks(blocks); }
  ~ForwardBlocks() { fal_cuda::set_forward_blocks(0); }
};
#endif

// The Hopper forward's balanced cut (runs of the list of every (b, h)'s chunks, one a block): blocks whose runs
// cross (b, h)s and start inside one (B 2, H 3, 13 chunks: 5 and 7 blocks), chains of cuts along a (b, h) (40
// blocks of two chunks), every chunk a block (78), with and without S0, D' 256, 128 and 64 (no LRPE), with and
// without decay, a partial last chunk; the pieces' sums and their scan through the outputs and the final state.
TEST_CASE("cuda fal chunked causal forward's balanced cut matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  uint64_t seed = 4100;
  for (int64_t blocks : {5, 7, 40, 78}) {
    CAPTURE(blocks);
    ForwardBlocks cut(blocks);
    check_fused_sequence(kChunkConfigs[0], true, DType::BF16, seed += 10, 777, 2, blocks % 2 == 1);
    check_fused_sequence(kChunkConfigs[1], true, DType::BF16, seed += 10, 777, 2, true);
    check_fused_sequence(kChunkConfigs[2], true, DType::F16, seed += 10, 800, 2, blocks % 2 == 0);
  }
#endif
}

// The balanced cut against the uniform one at the language model's shape (B 16, H 6, N 2048, D = E = 128, q, k, v,
// g slices of one projection, the even chunks' states saved): pieces of several chunks summed in runs of several,
// every cut (132 and 100 blocks) inside a (b, h). The two cuts differ only in rounding.
TEST_CASE("cuda fal chunked causal forward's balanced cut agrees with the uniform cut at the model's shape" *
          LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const StepConfig& c = kChunkConfigs[0];
  const int64_t B = 16, H = 6, N = 2048, nC = N / 64, P = fal_state_rows(c.lrpe, c.D);
  const Tensor proj = randn({B, N, 4 * H, c.D}, DType::BF16, gpu(), 4400);
  const FalStepSpec spec = kernel_spec(c, step_options(c, H, gpu()));
  for (bool save : {true, false}) {
    std::vector<std::vector<Tensor>> runs;  // out, S_final, saved states per cut
    for (int64_t blocks : {-1, 132, 100}) {
      ForwardBlocks cut(blocks);
      std::vector<Tensor> r = {empty({B, N, H, c.E}, DType::BF16, gpu()), empty({B, H, P, c.E}, DType::F32, gpu()),
                               empty({B, H, (nC + 1) / 2, P, c.E}, DType::BF16, gpu())};
      for (Tensor& t : r) poison_(t);
      fal_cuda::causal_forward(proj.narrow(2, 0, H), proj.narrow(2, H, H), proj.narrow(2, 2 * H, H),
                               proj.narrow(2, 3 * H, H), spec, Tensor(), r[0], r[1], 0, save ? r[2] : Tensor());
      for (Tensor& t : r) t = t.to(Device::cpu());
      runs.push_back(r);
    }
    for (size_t i = 1; i < runs.size(); ++i)
      for (size_t j = 0; j < (save ? 3u : 2u); ++j) {
        CAPTURE(save);
        CAPTURE(i);
        CAPTURE(j);
        const double err = rel_error(runs[i][j], runs[0][j]);  // about 5e-5 on an H200
        CHECK(err <= 2e-3);
      }
  }
#endif
}

// The forward saving every chunk's state for the backward (the tape's way) over more walks than the GPU has SMs
// (B x H x G = 8 x 3 x 7: one 64-token chunk a segment, the last one of 17 tokens).
TEST_CASE("cuda fal chunked causal saves the chunk states over many walks" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  check_fused_sequence(kChunkConfigs[0], true, DType::BF16, 1700, 401, 8, true, 0, 7);
  check_fused_sequence(kChunkConfigs[2], true, DType::F16, 1710, 401, 8, false, 0, 7);
}

// The state passes (check_fused_sequence runs each kernel) at the chunks' edges: one token, a chunk less one and
// more one, two whole chunks, walks that start and end at a cut mid-sequence (5 chunks and a token in segments of
// two), and D 128 without LRPE (D' = 128) beside D' = 256.
TEST_CASE("cuda fal chunked causal state passes at the chunk edges" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const StepConfig none128{"none D 128 E 64 sigmoid v decay", FalLrpe::None, 128, 64, kSilu, kNone, kSigmoid, kNone,
                           true};
  uint64_t seed = 1900;
  for (const auto& [N, segments] : {std::pair<int64_t, int64_t>{1, 0}, {63, 0}, {65, 1}, {128, 2}, {321, 3}})
    for (const StepConfig* c : {&kChunkConfigs[0], &none128}) {
      CAPTURE(c->name);
      CAPTURE(N);
      CAPTURE(segments);
      check_fused_sequence(*c, true, N % 2 == 1 ? DType::BF16 : DType::F16, seed += 10, N, 2, N != 63, 0, segments);
    }
}

namespace {

// q, k, v, g as slices of one (B, N, 4 H, D) projection (token stride 4 H D): Impl::Auto reads them in place with
// the same results as Impl::Fused on contiguous copies, and records the fused backward; through split (the
// mixer's way) the kernels write the four gradients side by side, handed on uncopied. Returns Auto's output
// and the four inputs as contiguous copies.
std::pair<Tensor, std::vector<Tensor>> check_strided_slices(const FalOptions& o, int64_t N, uint64_t seed) {
  const int64_t B = 2, H = 3, D = 64;
  const Tensor proj = randn({B, N, 4 * H, D}, DType::BF16, gpu(), seed).requires_grad_();
  std::vector<Tensor> parts, copies;
  for (int64_t i = 0; i < 4; ++i) {
    parts.push_back(proj.narrow(2, i * H, H));
    copies.push_back(parts.back().detach().contiguous().requires_grad_());
  }
  CHECK(!parts[0].is_contiguous());
  const Tensor dout = randn({B, N, H, D}, DType::BF16, gpu(), seed + 1);
  Tensor got = fal(parts[0], parts[1], parts[2], parts[3], o, Impl::Auto);
  Tensor want = fal(copies[0], copies[1], copies[2], copies[3], o, Impl::Fused);
  CHECK(rel_error(got.to(Device::cpu()), want.to(Device::cpu())) == 0.0);
  backward(sum(got.to(DType::F32) * dout.to(DType::F32)));
  backward(sum(want.to(DType::F32) * dout.to(DType::F32)));
  const Tensor grads = proj.grad().to(Device::cpu());
  for (int64_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(rel_error(grads.narrow(2, i * H, H).contiguous(), copies[size_t(i)].grad().to(Device::cpu())) == 0.0);
  }
  const Tensor proj2 = proj.detach().clone().requires_grad_();
  const std::vector<Tensor> pieces = split(proj2, {H, H, H, H}, 2);
  backward(sum(fal(pieces[0], pieces[1], pieces[2], pieces[3], o, Impl::Auto).to(DType::F32) * dout.to(DType::F32)));
  CHECK(rel_error(proj2.grad().to(Device::cpu()), grads) == 0.0);
  for (Tensor& t : copies) t = t.detach();
  return {got, copies};
}

// check_strided_slices, and the composed path on the contiguous copies agrees with the strided call.
void check_strided_slices_and_composed(const FalOptions& o, int64_t N, uint64_t seed) {
  const auto [got, in] = check_strided_slices(o, N, seed);
  const Tensor composed = fal(in[0], in[1], in[2], in[3], o, Impl::Composed);
  CHECK(rel_error(got.to(Device::cpu()).to(DType::F64), composed.to(Device::cpu()).to(DType::F64)) <=
        tolerance(DType::BF16));
}

}  // namespace

TEST_CASE("cuda fal chunked causal reads strided slices of one projection" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  FalOptions o = step_options(kChunkConfigs[1], 3, gpu());
  o.decay = from_vector({0.9, 0.99, 0.5}, {3}, DType::F32, gpu());
  check_strided_slices(o, 100, 900);
}

namespace {

// The noncausal chunk kernels (bf16 and f16; ops/fal/noncausal.cuh): D 64 and 128, E from 32 to 128, LRPE none
// and cosine, softmax over the feature dim on q and k, elementwise acts on v and g.
const std::vector<StepConfig> kNoncausalChunkConfigs = {
    {"cosine D 128 E 128 silu", FalLrpe::Cosine, 128, 128, kSilu, kSilu, kNone, kSilu, false},
    {"cosine D 64 E 80 softmax q, relu v, sigmoid g", FalLrpe::Cosine, 64, 80, kSoft, kSilu, kRelu, kSigmoid, false},
    {"none D 128 E 32 softmax q and k", FalLrpe::None, 128, 32, kSoft, kSoft, kNone, kSilu, false},
    {"none D 64 E 64 no acts", FalLrpe::None, 64, 64, kNone, kNone, kNone, kNone, false},
    {"cosine D 128 E 64 softmax q, relu g", FalLrpe::Cosine, 128, 64, kSoft, kSilu, kNone, kRelu, false},
};

}  // namespace

// Queries and keys around the 64-token chunks, M above, equal to and below N.
TEST_CASE("cuda fal chunked noncausal matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  uint64_t seed = 1000;
  const std::pair<int64_t, int64_t> lengths[] = {{23, 31}, {64, 64}, {161, 100}, {37, 200}};
  for (const StepConfig& c : kNoncausalChunkConfigs)
    for (DType dt : {DType::BF16, DType::F16})
      for (const auto& [N, M] : lengths) {
        CAPTURE(c.name);
        CAPTURE(dtype_name(dt));
        CAPTURE(N);
        CAPTURE(M);
        FalOptions o = step_options(c, 3, gpu());
        REQUIRE(fal_cuda::noncausal_chunked(dt, c.D, c.E, kernel_spec(c, o)));
        check_fused_sequence(c, false, dt, seed += 10, N, 2, true, M);
      }
#endif
}

// Many chunks over several (b, h): the runs of chunks cross (b, h) boundaries in every pass.
TEST_CASE("cuda fal chunked noncausal long sequence matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  check_fused_sequence(kNoncausalChunkConfigs[0], false, DType::BF16, 1500, 777, 2, true, 901);
  check_fused_sequence(kNoncausalChunkConfigs[1], false, DType::F16, 1510, 1100, 1, true, 650);
  // Past 32 chunks of one (b, h): the LRPE angles, turned from chunk to chunk, are computed afresh there.
  check_fused_sequence(kNoncausalChunkConfigs[0], false, DType::BF16, 1520, 2200, 1, true, 2300);
  // More chunks than the SMs take three at a time: every block of the row passes runs several chunks on each of
  // its warpgroups, across (b, h) boundaries, with a partial last chunk in every (b, h).
  check_fused_sequence(kNoncausalChunkConfigs[0], false, DType::BF16, 1530, 4500, 4, true, 4601);
  check_fused_sequence(kNoncausalChunkConfigs[3], false, DType::F16, 1540, 4500, 4, true, 4601);
}

// The same noncausal, and the composed path agrees (the reference of the strided call).
TEST_CASE("cuda fal chunked noncausal reads strided slices of one projection" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  FalOptions o = step_options(kNoncausalChunkConfigs[1], 3, gpu());
  o.causal = false;
  o.decay = Tensor();
  check_strided_slices_and_composed(o, 150, 1600);
}

// No tokens: an empty output, S0 passes through as the final state and dS_final back as dS0, through the op
// (bf16: the chunk kernels, f32: the sweep) and through the chunk launchers with the sequence cut or not.
TEST_CASE("cuda fal causal over an empty sequence passes the state through" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const StepConfig& c = kChunkConfigs[0];
  const int64_t B = 2, H = 3, P = fal_state_rows(c.lrpe, c.D);
  const FalOptions o = step_options(c, H, gpu());
  const Tensor S0 = randn({B, H, P, c.E}, DType::F32, gpu(), 1), dS = randn({B, H, P, c.E}, DType::F32, gpu(), 2);
  const std::vector<double> s0 = S0.to_vector<double>(), ds = dS.to_vector<double>();
  for (DType dt : {DType::BF16, DType::F32})
    for (Impl impl : {Impl::Fused, Impl::Composed}) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(int(impl));
      std::vector<Tensor> in;
      for (int64_t w : {c.D, c.D, c.E, c.E}) in.push_back(randn({B, 0, H, w}, dt, gpu(), 3).requires_grad_());
      Tensor S0_leaf = S0.detach().requires_grad_();
      auto [out, S] = fal_with_state(in[0], in[1], in[2], in[3], S0_leaf, o, impl);
      CHECK(out.shape() == Shape{B, 0, H, c.E});
      CHECK(S.to_vector<double>() == s0);
      backward(sum(S * dS));
      CHECK(S0_leaf.grad().to_vector<double>() == ds);
    }
  const FalStepSpec spec = kernel_spec(c, o);
  std::vector<Tensor> in, grads;
  for (int64_t w : {c.D, c.D, c.E, c.E}) {
    in.push_back(randn({B, 0, H, w}, DType::BF16, gpu(), 4));
    grads.push_back(empty({B, 0, H, w}, DType::BF16, gpu()));
  }
  const Tensor out = empty({B, 0, H, c.E}, DType::BF16, gpu()), dout = empty({B, 0, H, c.E}, DType::BF16, gpu());
  for (int64_t segments : {0, 1, 4}) {
    CAPTURE(segments);
    Tensor state = empty(S0.shape(), DType::F32, gpu()), dS0 = empty(S0.shape(), DType::F32, gpu());
    poison_(state);
    poison_(dS0);
    fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out, state, segments);
    CHECK(state.to_vector<double>() == s0);
    fal_cuda::causal_backward(in[0], in[1], in[2], in[3], spec, S0, dout, dS, grads[0], grads[1], grads[2], grads[3],
                              dS0, segments);
    CHECK(dS0.to_vector<double>() == ds);
  }
#endif
}

TEST_CASE("cuda fal fused causal equals the recurrent step" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // f32 runs the sweep, bf16 the chunk kernels (two chunks, the last partial).
  for (DType dt : {DType::F32, DType::BF16}) {
  CAPTURE(dtype_name(dt));
  const int64_t B = 2, N = dt == DType::F32 ? 40 : 100, H = 3;
  const StepConfig& c = kSequenceConfigs[0];
  std::vector<Tensor> in;
  uint64_t seed = 400;
  for (const Shape& s : {Shape{B, N, H, c.D}, Shape{B, N, H, c.D}, Shape{B, N, H, c.E}, Shape{B, N, H, c.E}})
    in.push_back(randn(s, dt, gpu(), seed++));
  const Tensor S0 = randn({B, H, fal_state_rows(c.lrpe, c.D), c.E}, DType::F32, gpu(), seed++);
  FalOptions o = step_options(c, H, gpu());
  o.offset = 3;
  auto [whole, S_whole] = fal_with_state(in[0], in[1], in[2], in[3], S0, o, Impl::Fused);
  Tensor state = S0;
  std::vector<Tensor> outs;
  for (int64_t t = 0; t < N; ++t) {
    FalOptions step = o;
    step.offset = o.offset + t;
    outs.push_back(fal_step(state, in[0].narrow(1, t, 1), in[1].narrow(1, t, 1), in[2].narrow(1, t, 1),
                            in[3].narrow(1, t, 1), step));
  }
  CHECK_CLOSE_TENSOR(cat(outs, 1).to(Device::cpu()), whole.to(Device::cpu()).to(DType::F64), dt);
  CHECK_CLOSE_TENSOR(state.to(Device::cpu()), S_whole.to(Device::cpu()).to(DType::F64), dt);
  }
}

TEST_CASE("cuda fal causal segments follow the shape" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  CHECK(fal_cuda::causal_segments(144, 8192, 132) == 1);  // B x H fills the SMs: one sweep per (b, h)
  CHECK(fal_cuda::causal_segments(12, 8192, 132) > 1);    // few heads: the sequence is cut
  CHECK(fal_cuda::causal_segments(12, 100, 132) == 1);    // too short to cut
  for (int64_t N : {333, 1000, 4099}) {
    const int64_t G = fal_cuda::causal_segments(3, N, 132), per = fal_cuda::causal_segment_tokens(N, G);
    CAPTURE(N);
    CHECK(per % 16 == 0);
    CHECK((G - 1) * per < N);  // no empty segment
    CHECK(G * per >= N);
  }
  // The chunk kernels (64-token chunks; D = E = 128, cosine: D' = 256). The fused forward, one block per SM:
  // B = H = 12 (two waves on 132 SMs) and few heads are cut, the language model's 16 x 6 is not.
  CHECK(fal_cuda::chunk_segments({144, 128, 128, 256, 128}, 132, true) > 1);
  CHECK(fal_cuda::chunk_segments({96, 32, 128, 256, 128}, 132, true) == 1);
  CHECK(fal_cuda::chunk_segments({3, 128, 128, 256, 128}, 132, true) > 8);
  CHECK(fal_cuda::chunk_segments({3, 1, 128, 256, 128}, 132, true) == 1);  // one chunk: nothing to cut
  // The state passes (three blocks per SM): 144 x 4 blocks nearly fill 132 SMs, 3 x 4 do not.
  CHECK(fal_cuda::chunk_segments({144, 128, 128, 256, 128}, 132, false) == 1);
  CHECK(fal_cuda::chunk_segments({3, 128, 128, 256, 128}, 132, false) > 8);
  for (int64_t nC : {2, 13, 128, 1000}) {
    CAPTURE(nC);
    for (bool fused : {true, false}) {
      const int64_t G = fal_cuda::chunk_segments({2, nC, 128, 256, 64}, 132, fused);
      CHECK(G >= 1);
      CHECK(G <= nC);
      CHECK(G <= 64);  // each segment keeps a state per (b, h)
    }
  }
#endif
}

namespace {

// Rotate on the chunk kernels (bf16/f16): the LRPE family's rotate kernels put q and k through their acts and the
// rotation, the chunk kernels take the rest. check_fused_sequence runs the launchers (the chunk sweep, which takes
// rotate itself) and Impl::Fused (this path). theta (1, D/2), (H, E_t < D/2) and (H, 1); softmax over the
// features on q or k, which the chunk kernels take behind the rotation only.
const std::vector<StepConfig> kRotateChunkConfigs = {
    {"rotate D 128 E 128 silu decay", FalLrpe::Rotate, 128, 128, kSilu, kSilu, kNone, kSilu, true},
    {"rotate D 64 E 64 softmax q, sigmoid k, relu v, theta (H, 20)", FalLrpe::Rotate, 64, 64, kSoft, kSigmoid, kRelu,
     kSilu, true, 20},
    {"rotate D 128 E 32 softmax k, relu g, theta (H, 1)", FalLrpe::Rotate, 128, 32, kSilu, kSoft, kNone, kRelu, false,
     1},
};

// The path that fal takes for c: the chunk kernels behind the rotation for dt, the sweep for f32.
void require_rotates_first(const StepConfig& c, bool causal, DType dt) {
#if LINTAPE_WITH_CUDA
  FalOptions o = step_options(c, 3, gpu());
  o.causal = causal;
  const Tensor q = empty({1, 1, 3, c.D}, dt, gpu()), v = empty({1, 1, 3, c.E}, dt, gpu());
  REQUIRE(fal_paths::rotates_first(q, v, o));
  REQUIRE(fal_paths::chunked(q, v, o));
  const Tensor q32 = empty(q.shape(), DType::F32, gpu()), v32 = empty(v.shape(), DType::F32, gpu());
  REQUIRE_FALSE(fal_paths::rotates_first(q32, v32, o));
#else
  (void)c, (void)causal, (void)dt;
#endif
}

}  // namespace

// Odd lengths inside one chunk and across three, with and without S0 and the final state's gradient.
TEST_CASE("cuda fal rotate causal on the chunk kernels matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 2000;
  for (const StepConfig& c : kRotateChunkConfigs)
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t N : {23, 161})
        for (bool with_state : {true, false}) {
          CAPTURE(c.name);
          CAPTURE(dtype_name(dt));
          CAPTURE(N);
          CAPTURE(with_state);
          require_rotates_first(c, true, dt);
          check_fused_sequence(c, true, dt, seed += 10, N, 2, with_state);
        }
  check_fused_sequence(kRotateChunkConfigs[0], true, DType::BF16, 2500, 777, 1);  // many chunks and segments
}

TEST_CASE("cuda fal rotate noncausal on the chunk kernels matches the reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 2100;
  for (const StepConfig& c : kRotateChunkConfigs)
    for (DType dt : {DType::BF16, DType::F16})
      for (const auto& [N, M] : {std::pair<int64_t, int64_t>{23, 31}, {161, 100}}) {
        CAPTURE(c.name);
        CAPTURE(dtype_name(dt));
        CAPTURE(N);
        CAPTURE(M);
        require_rotates_first(c, false, dt);
        check_fused_sequence(c, false, dt, seed += 10, N, 2, true, M);
      }
}

// Slices of one projection: read in place by the rotation (q, k) and the chunk kernels (v, g), against contiguous
// copies and the composed path.
TEST_CASE("cuda fal rotate on the chunk kernels reads strided slices of one projection" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    const StepConfig& c = kRotateChunkConfigs[1];
    require_rotates_first(c, causal, DType::BF16);
    FalOptions o = step_options(c, 3, gpu());
    o.causal = causal;
    if (!causal) o.decay = Tensor();
    check_strided_slices_and_composed(o, 100, 2200);
  }
}

// What the tape keeps of a rotate call on the chunk kernels: the output, the final state and the chunk states (every
// chunk's, then the even chunks' only: 3 of 5), not q' nor k' (temporaries of the forward, beside the cut's boundary
// states at its peak).
TEST_CASE("cuda fal rotate on the chunk kernels keeps no rotated q or k" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  struct Restore {
    ~Restore() { fal_paths::set_saved_states(fal_paths::SavedStates::Auto); }
  } restore;
  const StepConfig& c = kRotateChunkConfigs[0];
  const int64_t B = 2, N = 300, H = 3, nC = (N + 63) / 64, slack = 8 * 512;
  std::vector<Tensor> in;
  uint64_t seed = 2300;
  for (int64_t w : {c.D, c.D, c.E, c.E})
    in.push_back(randn({B, N, H, w}, DType::BF16, gpu(), seed++).requires_grad_());
  const FalOptions o = step_options(c, H, gpu());
  const int64_t state_bytes = B * H * c.D * c.E * 4, x_bytes = B * N * H * c.D * 2;
  const int64_t cut = fal_cuda::chunk_segments({B * H, nC, c.D, c.D, c.E}, cuda::sm_count(gpu().index), true);
  for (const auto saving : {fal_paths::SavedStates::All, fal_paths::SavedStates::Half}) {
    const int64_t saved = saving == fal_paths::SavedStates::Half ? (nC + 1) / 2 : nC;
    CAPTURE(saved);
    fal_paths::set_saved_states(saving);
    const int64_t kept = B * N * H * c.E * 2 + state_bytes + B * H * saved * c.D * c.E * 2;  // o, S_final, states
    const int64_t base = int64_t(memory_stats(gpu()).in_use);
    reset_peak_memory(gpu());
    const auto res = fal_with_state(in[0], in[1], in[2], in[3], Tensor(), o, Impl::Fused);
    CHECK(int64_t(memory_stats(gpu()).in_use) - base <= kept + slack);
    CHECK(int64_t(memory_stats(gpu()).peak) - base <= kept + 2 * x_bytes + (cut - 1) * state_bytes + slack);
    CHECK(res.first.requires_grad());
  }
#endif
}

// The FAL kernels of this file's cases but the mma.sync noncausal row passes, once each at small shapes, for
// compute-sanitizer (racecheck over one of the cases above runs past six minutes): the chunked causal forward,
// state walks and gradient kernels (wgmma and mma.sync; every, half and no saved states) on a partial chunk and
// across a cut, D' 256 and 64, bf16 and f16, the forward's balanced cut (runs across (b, h)s, the pieces' sums);
// the chunked noncausal reductions and wgmma row passes (silu acts; the softmax-q configurations of the noncausal
// cases run the mma.sync row passes); the f32 sweeps; the rotate path. (The documents' kernels have their own cases
// in test_documents_cuda.cpp.)
TEST_CASE("cuda fal the kernels at small shapes, for the sanitizers" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  for (const auto& [c, dt, N, segments] :
       {std::tuple<const StepConfig*, DType, int64_t, int64_t>{&kChunkConfigs[0], DType::BF16, 161, 2},
        {&kChunkConfigs[2], DType::F16, 65, 0}}) {
    CAPTURE(c->name);
    REQUIRE(fal_cuda::causal_chunked(dt, c->D, c->E, kernel_spec(*c, step_options(*c, 3, gpu()))));
    check_fused_sequence(*c, true, dt, 3100 + N, N, 2, true, 0, segments);
  }
  {
    ForwardBlocks cut(5);
    check_fused_sequence(kChunkConfigs[0], true, DType::BF16, 3150, 161, 2, true);
  }
  REQUIRE(fal_cuda::noncausal_chunked(DType::BF16, 128, 128,
                                      kernel_spec(kNoncausalChunkConfigs[0], step_options(kNoncausalChunkConfigs[0], 3,
                                                                                         gpu()))));
  check_fused_sequence(kNoncausalChunkConfigs[0], false, DType::BF16, 3200, 161, 2, true, 100);
  check_fused_sequence(kSequenceConfigs[0], true, DType::F32, 3300);
  check_fused_sequence(kSequenceConfigs[0], false, DType::F32, 3310);
  require_rotates_first(kRotateChunkConfigs[0], true, DType::BF16);
  check_fused_sequence(kRotateChunkConfigs[0], true, DType::BF16, 3400, 100, 1);
#endif
}
