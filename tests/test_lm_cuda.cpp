// The layers, the language model and the training loop on CUDA against the CPU, in float32: every layer's
// forward and gradients, the fused AdamW and gradient clip, one training run, checkpoints across devices,
// decoding (prefill and step by step) against the full forward; then the bf16 mixed-precision path and
// an out-of-memory report. Two f32 summation orders differ by about 1e-6 relative; a bug shows as O(1),
// so the f32 bounds below sit well between.
#include <cmath>
#include <functional>
#include <string>
#include <vector>
#include "core/allocator.h"
#include "helpers.h"
#include "layers/fal_mixer.h"
#include "layers/language_model.h"
#include "layers/layers.h"
#include "layers/tpa_mixer.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/trainer.h"
#include "train_helpers.h"

using namespace lintape;
using namespace lintape::test;

namespace {

constexpr double kF32Gap = 1e-4;  // CPU f32 against CUDA f32

ModelConfig micro_model() {
  ModelConfig c;
  c.vocab_size = 32;
  c.width = 16;
  c.layers = 2;
  c.mixers = {"fal", "tpa"};
  c.heads = 2;
  c.head_dim = 8;
  c.mlp_hidden = 24;
  c.tpa_ranks = {2, 1, 1};
  c.seq_len = 12;
  return c;
}

Tensor random_tokens(int64_t B, int64_t N, int64_t V, uint64_t seed) {
  std::vector<double> u = rand({B * N}, DType::F64, Device::cpu(), seed).to_vector<double>();
  std::vector<int64_t> ids;
  for (double x : u) ids.push_back(std::min<int64_t>(V - 1, int64_t(x * double(V))));
  return from_vector_i64(ids, {B, N});
}

// Runs make() twice (the same seeds), one copy on each device, and compares forward(x) and the gradients
// of sum(forward(x) * r) with respect to x and every parameter.
template <class M>
void check_module_on_cuda(const std::function<std::unique_ptr<M>()>& make, const Shape& x_shape, uint64_t seed) {
  std::unique_ptr<M> cpu = make(), gpu_module = make();
  gpu_module->to(gpu());
  Tensor x_cpu = randn(x_shape, DType::F32, Device::cpu(), seed);
  Tensor x_gpu = x_cpu.to(gpu());
  x_cpu.requires_grad_();
  x_gpu.requires_grad_();
  const Tensor y_cpu = cpu->forward(x_cpu), y_gpu = gpu_module->forward(x_gpu);
  CHECK(y_gpu.is_cuda());
  INFO("forward relative error " << rel_error(y_gpu, y_cpu));
  CHECK(rel_error(y_gpu, y_cpu) < kF32Gap);
  const Tensor r = randn(y_cpu.shape(), DType::F32, Device::cpu(), seed + 1);
  backward(sum(mul(y_cpu, r)));
  backward(sum(mul(y_gpu, r.to(gpu()))));
  CHECK(rel_error(x_gpu.grad(), x_cpu.grad()) < kF32Gap);
  auto p_cpu = cpu->named_parameters(), p_gpu = gpu_module->named_parameters();
  REQUIRE(p_cpu.size() == p_gpu.size());
  for (size_t i = 0; i < p_cpu.size(); ++i) {
    CAPTURE(p_cpu[i].first);
    REQUIRE(p_gpu[i].second->grad().defined());
    const double err = rel_error(p_gpu[i].second->grad(), p_cpu[i].second->grad());
    INFO("gradient relative error " << err);
    CHECK(err < kF32Gap);
  }
}

}  // namespace

TEST_CASE("cuda layers: forward and gradients equal the CPU in f32" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const ModelConfig c = micro_model();
  SUBCASE("Linear") { check_module_on_cuda<Linear>([] { return std::make_unique<Linear>(16, 24, 0.3, 1); }, {2, 5, 16}, 10); }
  SUBCASE("RMSNorm") {
    check_module_on_cuda<RMSNorm>(
        [] {
          auto m = std::make_unique<RMSNorm>(16, 1e-6);
          m->weight.detach().copy_(randn({16}, DType::F32, Device::cpu(), 2));
          return m;
        },
        {2, 5, 16}, 11);
  }
  SUBCASE("SwiGluMlp") {
    check_module_on_cuda<SwiGluMlp>([] { return std::make_unique<SwiGluMlp>(16, 24, 0.3, 0.2, 3); }, {2, 5, 16}, 12);
  }
  SUBCASE("FalMixer") {
    check_module_on_cuda<FalMixer>([] { return std::make_unique<FalMixer>(16, 2, 8, 1e-6, 0.3, 0.2, 4); },
                                   {2, 9, 16}, 13);
  }
  SUBCASE("TpaMixer") {
    check_module_on_cuda<TpaMixer>([] { return std::make_unique<TpaMixer>(16, 2, 8, 2, 1, 2, 0.3, 0.2, 5); },
                                   {2, 9, 16}, 14);
  }
  SUBCASE("Block fal") { check_module_on_cuda<Block>([&] { return std::make_unique<Block>(c, 0, 6); }, {2, 9, 16}, 15); }
  SUBCASE("Block tpa") { check_module_on_cuda<Block>([&] { return std::make_unique<Block>(c, 1, 7); }, {2, 9, 16}, 16); }
}

TEST_CASE("cuda LanguageModel: loss and flat gradients equal the CPU in f32" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const ModelConfig c = micro_model();
  LanguageModel cpu(c, 20), gpu_model(c, 20);
  cpu.flatten_parameters();
  gpu_model.to(gpu());
  gpu_model.flatten_parameters();
  CHECK(gpu_model.flat_gradients().is_cuda());
  const Tensor tokens = random_tokens(2, 12, c.vocab_size, 21), targets = random_tokens(2, 12, c.vocab_size, 22);
  const Tensor l_cpu = cpu.loss(tokens, targets), l_gpu = gpu_model.loss(tokens.to(gpu()), targets.to(gpu()));
  CHECK(l_gpu.item() == doctest::Approx(l_cpu.item()).epsilon(kF32Gap));
  backward(l_cpu);
  backward(l_gpu);
  CHECK(rel_error(gpu_model.flat_gradients(), cpu.flat_gradients()) < kF32Gap);
}

TEST_CASE("cuda normed rows made again in the backward: the bits of the rows kept, less held" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Widths the 16-byte kernels take (C 256, D 64), bf16 over f32 master weights, both mixers.
  ModelConfig c = micro_model();
  c.vocab_size = 512;
  c.width = 256;
  c.heads = 4;
  c.head_dim = 64;
  c.mlp_hidden = 512;
  c.seq_len = 128;
  LanguageModel model(c, 23);
  model.to(gpu());
  model.flatten_parameters();
  model.set_compute_dtype(DType::BF16);
  const Tensor tokens = random_tokens(2, 128, c.vocab_size, 24).to(gpu());
  const Tensor targets = random_tokens(2, 128, c.vocab_size, 25).to(gpu());
  const bool before = keep_normed_rows();
  backward(model.loss(tokens, targets));  // the products' workspaces, allocated once, before the counts
  Tensor loss[2], grads[2];
  size_t held[2];
  for (int keep = 0; keep < 2; ++keep) {
    set_keep_normed_rows(keep == 1);
    model.zero_grad();
    const size_t base = memory_stats(gpu()).in_use;
    loss[keep] = model.loss(tokens, targets);
    held[keep] = memory_stats(gpu()).in_use - base;
    backward(loss[keep]);
    grads[keep] = model.flat_gradients().clone();
  }
  set_keep_normed_rows(before);
  CHECK(loss[0].item() == loss[1].item());
  CHECK(rel_error(grads[0], grads[1]) == 0.0);
  CHECK(rel_error(grads[0], zeros(grads[0].shape(), grads[0].dtype(), gpu())) > 0.0);
  // Both layers' MLP rows (256 x C) and the FAL layer's mixer rows (256 x H D), bf16.
  CHECK(held[1] - held[0] == size_t(256 * (2 * c.width + c.heads * c.head_dim)) * 2);
}

TEST_CASE("cuda AdamW and gradient clip: steps equal the CPU optimizer" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const ModelConfig c = micro_model();
  LanguageModel cpu(c, 30), gpu_model(c, 30);
  cpu.flatten_parameters();
  gpu_model.to(gpu());
  gpu_model.flatten_parameters();
  const AdamWOptions options{0.9, 0.95, 1e-8, 0.1};
  AdamW opt_cpu(cpu, options), opt_gpu(gpu_model, options);
  const int64_t n = cpu.flat_gradients().numel();
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    // The same gradients on both; every other step large enough to be clipped.
    const double scale = step % 2 == 0 ? 10.0 : 1e-3;
    const Tensor g = mul(randn({n}, DType::F32, Device::cpu(), 40 + uint64_t(step)), scale);
    cpu.flat_gradients().detach().copy_(g);
    gpu_model.flat_gradients().detach().copy_(g);
    const double norm_cpu = clip_grad_norm(cpu, 1.0), norm_gpu = clip_grad_norm(gpu_model, 1.0);
    CHECK(norm_gpu == doctest::Approx(norm_cpu).epsilon(1e-12));  // both reduce in double
    CHECK(rel_error(gpu_model.flat_gradients(), cpu.flat_gradients()) < 1e-6);
    const double lr = learning_rate(step, 6, 2, 1e-2);
    opt_cpu.step(lr);
    opt_gpu.step(lr);
    CHECK(rel_error(gpu_model.flat_parameters(), cpu.flat_parameters()) < 1e-6);
  }
  const auto m_cpu = opt_cpu.state_dict(), m_gpu = opt_gpu.state_dict();
  for (const auto& [name, t] : m_cpu) {
    CAPTURE(name);
    CHECK(rel_error(m_gpu.at(name), t) < 1e-5);
  }
  // The norm is one deterministic reduction: the same gradients give the same bits.
  const Tensor g = randn({n}, DType::F32, Device::cpu(), 99);
  gpu_model.flat_gradients().detach().copy_(g);
  const double first = clip_grad_norm(gpu_model, 1e9);
  gpu_model.flat_gradients().detach().copy_(g);
  CHECK(clip_grad_norm(gpu_model, 1e9) == first);
}

TEST_CASE("cuda AdamW writes the bf16 compute copy with the update" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  LanguageModel model(micro_model(), 31);
  model.to(gpu());
  model.flatten_parameters();
  AdamW optimizer(model);
  optimizer.keep_compute_copy(DType::BF16);
  const int64_t n = model.flat_gradients().numel();
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    model.flat_gradients().detach().copy_(randn({n}, DType::F32, Device::cpu(), 50 + uint64_t(step)));
    optimizer.step(1e-2);
    Storage& s = model.flat_parameters().storage();
    REQUIRE(s.copy != nullptr);
    CHECK(s.copy_version == s.version);
    const Tensor through = model.flat_parameters().to(DType::BF16);
    CHECK(through.impl()->storage == s.copy);
    CHECK(through.to_vector<double>() == model.flat_parameters().clone().to(DType::BF16).to_vector<double>());
  }
}

TEST_CASE("cuda training: steps in f32 equal the CPU's" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_steps");
  TrainConfig c = micro_train_config(write_text_corpus(dir));
  c.steps = 3;
  Trainer on_cpu(c, {});
  TrainerOptions o;
  o.device = gpu();
  o.compute_dtype = DType::F32;
  Trainer on_gpu(c, o);
  CHECK(on_gpu.model().flat_parameters().is_cuda());
  const TrainResult a = on_cpu.run(), b = on_gpu.run();
  REQUIRE(a.losses.size() == 3);
  REQUIRE(b.losses.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(b.losses[i] == doctest::Approx(a.losses[i]).epsilon(kF32Gap));
  // Adam's first steps are about lr * sign(g): an element whose gradient is at the rounding level may
  // move the other way, so the weights compare more loosely than the losses.
  CHECK(rel_error(on_gpu.model().flat_parameters(), on_cpu.model().flat_parameters()) < 1e-3);
  CHECK(on_gpu.validate().first == doctest::Approx(on_cpu.validate().first).epsilon(1e-3));
}

TEST_CASE("cuda checkpoints: saved on the CPU load on CUDA, and the reverse, with the same loss" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_ckpt");
  TrainConfig c = micro_train_config(write_text_corpus(dir));
  c.steps = 2;
  TrainerOptions gpu_f32;
  gpu_f32.device = gpu();
  gpu_f32.compute_dtype = DType::F32;

  Trainer cpu_run(c, {Device::cpu(), "", dir.file("from_cpu")});
  cpu_run.run();
  TrainerOptions resume_on_gpu = gpu_f32;
  resume_on_gpu.checkpoint_dir = dir.file("from_cpu");
  resume_on_gpu.resume = true;
  Trainer loaded_on_gpu(c, resume_on_gpu);
  CHECK(loaded_on_gpu.step() == 2);
  CHECK(loaded_on_gpu.model().wte.is_cuda());
  CHECK(loaded_on_gpu.validate().first == doctest::Approx(cpu_run.validate().first).epsilon(kF32Gap));

  TrainerOptions save_on_gpu = gpu_f32;
  save_on_gpu.checkpoint_dir = dir.file("from_gpu");
  Trainer gpu_run(c, save_on_gpu);
  gpu_run.run();
  Trainer loaded_on_cpu(c, {Device::cpu(), "", dir.file("from_gpu"), true});
  CHECK(!loaded_on_cpu.model().wte.is_cuda());
  CHECK(loaded_on_cpu.validate().first == doctest::Approx(gpu_run.validate().first).epsilon(kF32Gap));
  // And it trains on from there.
  c.steps = 4;
  Trainer more(c, {Device::cpu(), "", dir.file("from_gpu"), true});
  const TrainResult r = more.run();
  CHECK(r.first_step == 2);
  CHECK(r.losses.size() == 2);
}

TEST_CASE("cuda decoding: prefill and step-by-step logits equal the full forward" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType dtype : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dtype));
    // The bf16 paths round differently (whole-sequence kernels against one-token ones).
    const double tol = dtype == DType::F32 ? kF32Gap : 5e-2;
    LanguageModel model(micro_model(), 50);
    model.to(gpu());
    model.set_compute_dtype(dtype);
    const int64_t B = 2, N = 10, prompt = 4;
    const Tensor tokens = random_tokens(B, N, 32, 51).to(gpu());
    const Tensor full = model.forward(tokens).to(DType::F32);
    DecodeState state = model.start_decoding(B);
    const Tensor pre = model.prefill(tokens.narrow(1, 0, prompt).contiguous(), state);
    CHECK(rel_error(pre.to(DType::F32), full.narrow(1, 0, prompt)) < tol);
    for (int64_t t = prompt; t < N; ++t) {
      CAPTURE(t);
      const Tensor step = model.decode_step(tokens.narrow(1, t, 1).contiguous(), state);
      CHECK(rel_error(step.to(DType::F32), full.narrow(1, t, 1)) < tol);
    }
    // And the CUDA f32 logits are the CPU's.
    if (dtype == DType::F32) {
      LanguageModel cpu(micro_model(), 50);
      CHECK(rel_error(full, cpu.forward(tokens.to(Device::cpu()))) < kF32Gap);
    }
  }
}

TEST_CASE("cuda mixed precision: bf16 activations, f32 master weights, the loss falls" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  TempDir dir("cuda_bf16");
  TrainConfig c = micro_train_config(write_text_corpus(dir));
  c.steps = 60;
  c.warmup = 5;
  c.lr = 1e-2;
  TrainerOptions o;
  o.device = gpu();
  Trainer t(c, o);  // bf16 by default on CUDA
  CHECK(t.model().compute_dtype() == DType::BF16);
  CHECK(t.model().flat_parameters().dtype() == DType::F32);
  const Tensor tokens = random_tokens(2, 16, 256, 60).to(gpu());
  CHECK(t.model().forward(tokens).dtype() == DType::BF16);
  CHECK(t.model().loss(tokens, tokens).dtype() == DType::F32);
  const TrainResult r = t.run();
  REQUIRE(r.losses.size() == 60);
  INFO("first " << r.losses.front() << " last " << r.losses.back());
  double early = 0, late = 0;
  for (size_t i = 0; i < 5; ++i) early += r.losses[i] / 5;
  for (size_t i = 50; i < 60; ++i) late += r.losses[i] / 10;
  CHECK(late < 0.6 * early);  // as the CPU's f32 run on the same corpus
  // The first loss (the same initial weights) agrees with the f32 one to bf16 precision.
  TrainerOptions f32 = o;
  f32.compute_dtype = DType::F32;
  c.steps = 1;
  const TrainResult r32 = Trainer(c, f32).run();
  CHECK(r.losses.front() == doctest::Approx(r32.losses.front()).epsilon(2e-2));
}

TEST_CASE("cuda out of memory reports the request and the allocator's statistics" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const Tensor keep = zeros({1024}, DType::F32, gpu());
  check_throws_containing([] { empty({int64_t(1) << 42}, DType::F32, gpu()); },
                          {"[allocator] out of memory on cuda:0", "asked for 17592186044416 bytes", "in use", "peak",
                           "reserved"});
  CHECK(zeros({1024}, DType::F32, gpu()).is_cuda());  // and the device still works
}
