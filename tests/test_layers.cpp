// Layers: gradient checks of every layer on small f64 CPU shapes, the composed mixer paths against the
// reference, MODEL.md's parameter names and shapes, the flat parameter and gradient buffers, state
// save/load, the config's input errors, and packed documents against each document run alone.
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>
#include "autograd/gradcheck.h"
#include "core/allocator.h"
#include "helpers.h"
#include "layers/fal_mixer.h"
#include "layers/language_model.h"
#include "layers/layers.h"
#include "layers/tpa_mixer.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"

using namespace lintape;
using namespace lintape::test;

namespace {

// A config small enough for a full gradcheck: V 16, C 8, two layers (fal then tpa), H 2, D 4.
ModelConfig micro_config() {
  ModelConfig c;
  c.vocab_size = 16;
  c.width = 8;
  c.layers = 2;
  c.mixers = {"fal", "tpa"};
  c.heads = 2;
  c.head_dim = 4;
  c.mlp_hidden = 12;
  c.tpa_ranks = {2, 1, 1};
  c.seq_len = 5;
  return c;
}

// Gradchecks module.forward(x) with respect to x and every parameter, in f64.
template <class M>
void gradcheck_module(M& module, const Shape& x_shape, uint64_t seed) {
  module.to(DType::F64);
  std::vector<Tensor> inputs = {leaf(x_shape, seed)};
  for (auto& [name, p] : module.named_parameters()) inputs.push_back(*p);
  auto fn = [&module](const std::vector<Tensor>& in) { return module.forward(in[0]); };
  CHECK_GRADCHECK(fn, inputs);
}

Tensor tokens_of(const std::vector<int64_t>& ids, int64_t B, int64_t N) { return from_vector_i64(ids, {B, N}); }

}  // namespace

TEST_CASE("gradcheck Linear") {
  Linear layer(5, 3, 0.5, 1);
  gradcheck_module(layer, {2, 2, 5}, 11);
}

TEST_CASE("gradcheck Embedding") {
  Embedding layer(7, 4, 0.5, 2);
  layer.to(DType::F64);
  const Tensor ids = tokens_of({0, 3, 6, 3}, 2, 2);
  auto fn = [&](const std::vector<Tensor>& in) { return mul(layer.forward(ids), in[0]); };
  CHECK_GRADCHECK(fn, (std::vector<Tensor>{leaf({2, 2, 4}, 3), layer.weight}));
}

TEST_CASE("gradcheck RMSNorm") {
  RMSNorm layer(6, 1e-6);
  layer.to(DType::F64);
  layer.weight.detach().copy_(randn({6}, DType::F64, Device::cpu(), 4));
  gradcheck_module(layer, {2, 3, 6}, 12);
}

TEST_CASE("gradcheck SwiGluMlp") {
  SwiGluMlp layer(4, 6, 0.5, 0.3, 5);
  gradcheck_module(layer, {1, 3, 4}, 13);
}

TEST_CASE("gradcheck FalMixer reference and composed") {
  for (Impl impl : {Impl::Reference, Impl::Composed}) {
    CAPTURE(int(impl));
    FalMixer layer(6, 2, 4, 1e-6, 0.4, 0.4, 6);
    layer.impl = impl;
    gradcheck_module(layer, {1, 4, 6}, 14);
  }
}

TEST_CASE("gradcheck TpaMixer reference and composed") {
  for (Impl impl : {Impl::Reference, Impl::Composed}) {
    CAPTURE(int(impl));
    TpaMixer layer(6, 2, 4, 2, 1, 2, 0.4, 0.4, 7);
    layer.impl = impl;
    gradcheck_module(layer, {1, 4, 6}, 15);
  }
}

TEST_CASE("gradcheck Block fal and tpa") {
  ModelConfig c = micro_config();
  for (int64_t layer_index : {0, 1}) {
    CAPTURE(layer_index);
    Block block(c, layer_index, 8);
    gradcheck_module(block, {1, 3, c.width}, 16);
  }
}

TEST_CASE("gradcheck LanguageModel loss") {
  const ModelConfig c = micro_config();
  LanguageModel model(c, 9);
  model.to(DType::F64);
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7}, 2, 4);
  const Tensor targets = tokens_of({5, 9, 15, -1, 0, 7, 7, 3}, 2, 4);
  std::vector<Tensor> inputs;
  for (auto& [name, p] : model.named_parameters()) inputs.push_back(*p);
  auto fn = [&](const std::vector<Tensor>&) { return model.loss(tokens, targets); };
  CHECK_GRADCHECK(fn, inputs);
}

TEST_CASE("LanguageModel composed mixers match the reference") {
  LanguageModel model(micro_config(), 10);
  model.to(DType::F64);
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4}, 2, 5);
  const Tensor ref = model.forward(tokens);
  model.set_impl(Impl::Composed);
  const Tensor composed = model.forward(tokens);
  CHECK(rel_error(composed, ref) < 1e-10);
}

TEST_CASE("LanguageModel parameter names and shapes follow MODEL.md") {
  ModelConfig c = ModelConfig::preset("tiny");
  LanguageModel model(c, 0);
  std::map<std::string, Shape> shapes;
  for (auto& [name, p] : model.named_parameters()) shapes[name] = p->shape();
  const int64_t C = 128, HD = 128, F = 384;
  CHECK(shapes.at("wte") == Shape{256, C});
  CHECK(shapes.at("norm.weight") == Shape{C});
  CHECK(shapes.at("blocks.0.norm1.weight") == Shape{C});
  CHECK(shapes.at("blocks.0.norm2.weight") == Shape{C});
  CHECK(shapes.at("blocks.0.mlp.up.weight") == Shape{2 * F, C});
  CHECK(shapes.at("blocks.0.mlp.down.weight") == Shape{C, F});
  CHECK(shapes.at("blocks.0.fal.qkvg.weight") == Shape{4 * HD, C});
  CHECK(shapes.at("blocks.0.fal.norm.weight") == Shape{64});
  CHECK(shapes.at("blocks.0.fal.out.weight") == Shape{C, HD});
  CHECK(shapes.at("blocks.3.tpa.a.weight") == Shape{2 * 8, C});
  CHECK(shapes.at("blocks.3.tpa.b.weight") == Shape{8 * 64, C});
  CHECK(shapes.at("blocks.3.tpa.out.weight") == Shape{C, HD});
  CHECK(shapes.size() == 2 + 4 * 7);  // wte, norm, and 7 per block (3 fal, 1 tpa)
  CHECK(shapes.count("blocks.3.fal.qkvg.weight") == 0);
  // Buffers are named but never part of the parameters.
  CHECK(model.named_buffers().size() == 3 * 2 + 1);
  // Initialisation: norms 1, matrices N(0, 0.02), outputs N(0, 0.02 / sqrt(2 L)).
  CHECK(model.norm.weight.to_vector<float>() == std::vector<float>(size_t(C), 1.0f));
  auto stddev = [](const Tensor& t) {
    double s = 0;
    for (float v : t.to_vector<float>()) s += double(v) * v;
    return std::sqrt(s / double(t.numel()));
  };
  CHECK(stddev(model.wte) == doctest::Approx(0.02).epsilon(0.05));
  const auto& fal = dynamic_cast<const FalMixer&>(*model.blocks[0]->mixer);
  CHECK(stddev(fal.out.weight) == doctest::Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
  CHECK(stddev(model.blocks[1]->mlp.down.weight) == doctest::Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
}

TEST_CASE("flat parameters: views of one buffer, gradients accumulate into one buffer") {
  LanguageModel model(micro_config(), 11);
  model.flatten_parameters();
  const Tensor& flat = model.flat_parameters();
  const Tensor& grads = model.flat_gradients();
  CHECK(flat.numel() == model.parameter_count());
  CHECK(&model.wte.storage() == &flat.storage());
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7}, 2, 4);
  const Tensor targets = tokens_of({5, 9, 15, 3, 0, 7, 7, 3}, 2, 4);
  backward(model.loss(tokens, targets));
  CHECK(&model.wte.grad().storage() == &grads.storage());
  const std::vector<float> once = grads.to_vector<float>();
  double norm = 0;
  for (float g : once) norm += double(g) * g;
  CHECK(norm > 0);
  // A second backward adds the same gradient again: accumulation happens in the flat buffer.
  backward(model.loss(tokens, targets));
  const std::vector<float> twice = grads.to_vector<float>();
  for (size_t i = 0; i < once.size(); i += 97) CHECK(twice[i] == doctest::Approx(2 * once[i]));
  model.zero_grad();
  CHECK(sum(grads.detach().to(DType::F64) * grads.detach().to(DType::F64)).item() == 0.0);
  backward(model.loss(tokens, targets));
  const std::vector<float> again = grads.to_vector<float>();
  for (size_t i = 0; i < once.size(); i += 97) CHECK(again[i] == once[i]);
}

TEST_CASE("state_dict round trip and load errors") {
  LanguageModel a(micro_config(), 12), b(micro_config(), 13);
  b.flatten_parameters();
  b.load_state_dict(a.state_dict(), "a.safetensors");
  const Tensor tokens = tokens_of({1, 2, 3, 4}, 1, 4);
  CHECK(rel_error(b.forward(tokens), a.forward(tokens)) == 0.0);
  std::map<std::string, Tensor> state = a.state_dict();
  state.erase("norm.weight");
  check_throws_containing([&] { b.load_state_dict(state, "x.safetensors"); },
                          {"x.safetensors", "norm.weight"});
  state = a.state_dict();
  state["wte"] = zeros({3, 8});
  check_throws_containing([&] { b.load_state_dict(state, "y.safetensors"); }, {"y.safetensors", "wte", "(3, 8)"});
  state = a.state_dict();
  state["extra"] = zeros({1});
  check_throws_containing([&] { b.load_state_dict(state, "z.safetensors"); }, {"extra"});
}

TEST_CASE("mixer registry: the config's names, each kind's module and FLOPs") {
  CHECK(mixer_names() == "fal or tpa");
  CHECK(is_mixer_name("fal"));
  CHECK(is_mixer_name("tpa"));
  CHECK_FALSE(is_mixer_name("mamba"));
  check_throws_containing([] { mixer_kind("mamba"); }, {"[config]", "mamba", "fal or tpa"});
  const ModelConfig c = micro_config();
  CHECK(dynamic_cast<FalMixer*>(mixer_kind("fal").make(c, 0.02, 0.01, 3).get()) != nullptr);
  CHECK(dynamic_cast<TpaMixer*>(mixer_kind("tpa").make(c, 0.02, 0.01, 3).get()) != nullptr);
  const double H = double(c.heads), D = double(c.head_dim), N = double(c.seq_len);
  CHECK(mixer_kind("fal").train_flops_per_token(c, N / 2) == 24.0 * H * D * D);
  CHECK(mixer_kind("fal").train_flops_per_token(c, 3.5) == 24.0 * H * D * D);
  CHECK(mixer_kind("tpa").train_flops_per_token(c, N / 2) == 6.0 * H * D * N);
  CHECK(mixer_kind("tpa").train_flops_per_token(c, 3.5) == 12.0 * H * D * 3.5);
}

TEST_CASE("bad input: model config") {
  check_throws_containing([] { ModelConfig::preset("huge"); }, {"[config]", "huge", "tiny"});
  ModelConfig c = micro_config();
  c.mixers = {"fal", "mamba"};
  check_throws_containing([&] { LanguageModel m(c); }, {"[config]", "mixers", "mamba"});
  c = micro_config();
  c.width = 0;
  check_throws_containing([&] { c.validate(); }, {"[config]", "width", "0"});
  c = micro_config();
  c.heads = -2;
  check_throws_containing([&] { c.validate(); }, {"heads", "-2"});
  c = micro_config();
  c.tpa_ranks = {1, 1};
  check_throws_containing([&] { c.validate(); }, {"tpa_ranks"});
}

TEST_CASE("decoding token by token gives the full forward's logits") {
  for (DType dtype : {DType::F64, DType::F32}) {
    CAPTURE(dtype_name(dtype));
    LanguageModel model(micro_config(), 14);
    model.to(dtype);
    const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4}, 2, 5);
    const Tensor full = model.forward(tokens);
    DecodeState state = model.start_decoding(2);
    for (int64_t t = 0; t < 5; ++t) {
      CAPTURE(t);
      const Tensor step = model.decode_step(tokens.narrow(1, t, 1).contiguous(), state);
      CHECK(rel_error(step, full.narrow(1, t, 1)) < (dtype == DType::F64 ? 1e-10 : 1e-5));
    }
  }
}

TEST_CASE("prefill then step by step gives the full forward's logits") {
  for (DType dtype : {DType::F64, DType::F32}) {
    CAPTURE(dtype_name(dtype));
    const double tol = dtype == DType::F64 ? 1e-10 : 1e-5;
    LanguageModel model(micro_config(), 15);
    model.to(dtype);
    const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4, 11, 12, 13, 14}, 2, 7);
    const Tensor full = model.forward(tokens);
    DecodeState state = model.start_decoding(2);
    const Tensor prompt = model.prefill(tokens.narrow(1, 0, 4).contiguous(), state);
    CHECK(state.position == 4);
    // The tpa layer's cache holds the prompt.
    CHECK(dynamic_cast<const TpaState&>(*state.layers[1]).cache.max_length() == 4);
    CHECK(rel_error(prompt, full.narrow(1, 0, 4)) < tol);
    for (int64_t t = 4; t < 7; ++t) {
      CAPTURE(t);
      const Tensor step = model.decode_step(tokens.narrow(1, t, 1).contiguous(), state);
      CHECK(rel_error(step, full.narrow(1, t, 1)) < tol);
    }
    check_throws_containing([&] { model.prefill(tokens, state); }, {"[LanguageModel] prefill", "7 tokens"});
  }
}

TEST_CASE("mixed precision: bf16 activations over f32 master weights") {
  LanguageModel model(micro_config(), 16);
  model.flatten_parameters();
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4}, 2, 5);
  const Tensor targets = tokens_of({5, 9, 15, 2, -1, 7, 7, 3, 4, 1}, 2, 5);
  const Tensor l32 = model.loss(tokens, targets);
  backward(l32);
  const Tensor g32 = model.flat_gradients().clone();
  model.zero_grad();
  model.set_compute_dtype(DType::BF16);
  CHECK(model.compute_dtype() == DType::BF16);
  CHECK(model.forward(tokens).dtype() == DType::BF16);
  const Tensor l16 = model.loss(tokens, targets);
  CHECK(l16.dtype() == DType::F32);  // the loss and its statistics stay f32
  CHECK(l16.item() == doctest::Approx(l32.item()).epsilon(2e-2));
  backward(l16);
  // The gradients reach the f32 master weights (through the recorded casts), close to the f32 ones.
  CHECK(model.flat_gradients().dtype() == DType::F32);
  CHECK(model.wte.dtype() == DType::F32);
  CHECK(rel_error(model.flat_gradients(), g32) < 5e-2);
  check_throws_containing([&] { model.set_compute_dtype(DType::I32); }, {"compute dtype", "i32"});
}

TEST_CASE("normed rows made again in the backward give the bits of the rows kept, and hold less") {
  // The MLP's norm and up projection, the FAL mixer's norm and out projection: rms_norm_linear against the norm
  // then the product (set_keep_normed_rows), loss and every gradient, f32 and bf16 over f32 master weights.
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4}, 2, 5);
  const Tensor targets = tokens_of({5, 9, 15, 2, -1, 7, 7, 3, 4, 1}, 2, 5);
  const bool before = keep_normed_rows();
  for (DType dt : {DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    LanguageModel model(micro_config(), 17);
    model.flatten_parameters();
    model.set_compute_dtype(dt);
    Tensor loss[2], grads[2];
    size_t held[2];
    for (int keep = 0; keep < 2; ++keep) {
      set_keep_normed_rows(keep == 1);
      model.zero_grad();
      const size_t base = memory_stats(Device::cpu()).in_use;
      loss[keep] = model.loss(tokens, targets);
      held[keep] = memory_stats(Device::cpu()).in_use - base;
      backward(loss[keep]);
      grads[keep] = model.flat_gradients().clone();
    }
    CHECK(loss[0].item() == loss[1].item());
    CHECK(rel_error(grads[0], grads[1]) == 0.0);
    // Two layers' MLP rows (10 x C) and the FAL layer's mixer rows (10 x H D), in the compute dtype.
    const ModelConfig c = micro_config();
    CHECK(held[1] - held[0] >= size_t(10 * (2 * c.width + c.heads * c.head_dim)) * dtype_size(dt));
  }
  set_keep_normed_rows(before);
}

namespace {

// Rows of 12 tokens holding documents of these lengths: row 0 [5, 1, 6] (a one-token document), row 1 [7, 5].
const std::vector<std::vector<int64_t>> kRowDocuments = {{5, 1, 6}, {7, 5}};
constexpr int64_t kRowTokens = 12;

// The packed loss with documents against each document alone in a row of its own (targets within it, its last
// token's -1): the same loss (the mean over all the targets) and the same gradient of every parameter.
void check_packed_equals_unpacked(const std::vector<std::string>& mixers, Impl impl, DType dtype, double tol) {
  ModelConfig c = micro_config();
  c.mixers = mixers;
  LanguageModel model(c, 21);
  model.to(dtype);
  model.set_impl(impl);
  const int64_t B = int64_t(kRowDocuments.size()), N = kRowTokens;
  std::vector<int64_t> ids(size_t(B * N)), targets(size_t(B * N)), cu{0};
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((i * 7 + 3) % 16);
  int64_t total = 0;  // targets that count
  for (int64_t b = 0; b < B; ++b) {
    int64_t at = b * N;
    for (int64_t length : kRowDocuments[size_t(b)]) {
      for (int64_t j = 0; j < length; ++j) targets[size_t(at + j)] = j + 1 < length ? ids[size_t(at + j + 1)] : -1;
      total += length - 1;
      cu.push_back(at += length);
    }
  }
  const Documents docs = Documents::from_cu_seqlens(cu, B, N);
  const Tensor tokens = tokens_of(ids, B, N), target = tokens_of(targets, B, N);
  const Tensor packed = model.loss(tokens, target, docs);
  backward(packed);
  std::map<std::string, Tensor> packed_grads;
  for (auto& [name, p] : model.named_parameters()) packed_grads[name] = p->grad().clone();
  model.zero_grad();

  Tensor unpacked;
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t at = cu[d], length = cu[d + 1] - at;
    if (length == 1) continue;  // nothing to predict in it
    const std::vector<int64_t> doc_ids(ids.begin() + at, ids.begin() + at + length),
        doc_targets(targets.begin() + at, targets.begin() + at + length);
    const Tensor l = mul(model.loss(tokens_of(doc_ids, 1, length), tokens_of(doc_targets, 1, length)),
                         double(length - 1) / double(total));
    unpacked = unpacked.defined() ? add(unpacked, l) : l;
  }
  CHECK(packed.item() == doctest::Approx(unpacked.item()).epsilon(tol));
  backward(unpacked);
  for (auto& [name, p] : model.named_parameters()) {
    CAPTURE(name);
    CHECK(rel_error(packed_grads.at(name), p->grad()) < tol);
  }
  // The boundaries matter: the same rows without them give another loss, far beyond the tolerance (at
  // initialisation the mixers move the loss little; f32 cannot tell).
  if (dtype == DType::F64) CHECK(std::abs(model.loss(tokens, target).item() - packed.item()) > 1e4 * tol);
}

}  // namespace

TEST_CASE("packed documents: the loss and gradients of each document run alone") {
  using Mixers = std::vector<std::string>;
  for (const Mixers& mixers : {Mixers{"fal"}, Mixers{"tpa"}, Mixers{"fal", "tpa"}}) {
    CAPTURE(mixers.front());
    CAPTURE(mixers.size());
    check_packed_equals_unpacked(mixers, Impl::Auto, DType::F64, 1e-10);
    check_packed_equals_unpacked(mixers, Impl::Composed, DType::F64, 1e-10);
    check_packed_equals_unpacked(mixers, Impl::Auto, DType::F32, 1e-4);
  }
}

TEST_CASE("packed documents: undefined documents leave the model's bits as they were") {
  LanguageModel model(micro_config(), 22);
  const Tensor tokens = tokens_of({1, 5, 9, 15, 2, 0, 7, 7, 3, 4}, 2, 5);
  const std::vector<float> plain = model.forward(tokens).to_vector<float>();
  CHECK(model.forward(tokens, Documents()).to_vector<float>() == plain);
  // One document a row is no boundary at all.
  const Documents whole = Documents::from_cu_seqlens({0, 5, 10}, 2, 5);
  CHECK(rel_error(model.forward(tokens, whole), model.forward(tokens)) < 1e-6);
  check_throws_containing([&] { model.forward(tokens, Documents::from_cu_seqlens({0, 4, 8}, 2, 4)); },
                          {"[LanguageModel]", "documents"});
}
