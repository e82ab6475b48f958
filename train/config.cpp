#include "train/config.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace lintape {

using nlohmann::json;

namespace {

json model_json(const ModelConfig& c) {
  return json{{"vocab_size", c.vocab_size}, {"width", c.width},           {"layers", c.layers},
              {"mixers", c.mixers},         {"heads", c.heads},           {"head_dim", c.head_dim},
              {"mlp_hidden", c.mlp_hidden}, {"tpa_ranks", c.tpa_ranks},   {"seq_len", c.seq_len},
              {"norm_eps", c.norm_eps}};
}

template <class T>
void read_key(const json& j, const char* key, T& value, const std::string& source) {
  if (!j.contains(key)) return;
  try {
    value = j.at(key).get<T>();
  } catch (const json::exception& e) {
    fail(str("[config] ", source, ": key '", key, "' has the wrong type: ", e.what()));
  }
}

ModelConfig model_from(const json& j, const std::string& source, ModelConfig c) {
  LT_CHECK(j.is_object(), "[config] ", source, ": the model config must be a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it)
    LT_CHECK(model_json(c).contains(it.key()), "[config] ", source, ": unknown model key '", it.key(), "'");
  read_key(j, "vocab_size", c.vocab_size, source);
  read_key(j, "width", c.width, source);
  read_key(j, "layers", c.layers, source);
  read_key(j, "mixers", c.mixers, source);
  read_key(j, "heads", c.heads, source);
  read_key(j, "head_dim", c.head_dim, source);
  read_key(j, "mlp_hidden", c.mlp_hidden, source);
  read_key(j, "tpa_ranks", c.tpa_ranks, source);
  read_key(j, "seq_len", c.seq_len, source);
  read_key(j, "norm_eps", c.norm_eps, source);
  return c;
}

json parse(const std::string& text, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(str("[config] ", source, " is not valid JSON: ", e.what()));
  }
}

// a * b, or a failure naming `what` when it does not fit in int64.
int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  LT_CHECK(!__builtin_mul_overflow(a, b, &r), "[config] ", what, " overflows: ", a, " x ", b,
           " is beyond 2^63, far more than any memory holds");
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  LT_CHECK(!__builtin_add_overflow(a, b, &r), "[config] ", what, " overflows: ", a, " + ", b);
  return r;
}

}  // namespace

int64_t memory_limit_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return int64_t(1) << 40;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(int64_t(pages), int64_t(page), &bytes)) return std::numeric_limits<int64_t>::max();
  return bytes;
}

SizeEstimate estimate_sizes(const ModelConfig& m, int64_t batch) {
  m.validate();
  LT_CHECK(batch > 0, "[config] batch must be positive; got ", batch);
  const int64_t C = m.width, HD = checked_mul(m.heads, m.head_dim, "heads x head_dim");
  // Per layer: two norms, the MLP (three C x hidden), the mixer's projections (at most four C x H*D plus
  // the TPA factors, bounded by C x H*D x (sum of the ranks)).
  int64_t ranks = 0;
  for (int64_t r : m.tpa_ranks) ranks = checked_add(ranks, r, "tpa_ranks' sum");
  int64_t layer = checked_mul(3, checked_mul(C, m.mlp_hidden, "width x mlp_hidden"), "the MLP's parameters");
  layer = checked_add(layer, checked_mul(4, checked_mul(C, HD, "width x heads x head_dim"), "a mixer's projections"),
                      "a layer's parameters");
  layer = checked_add(layer, checked_mul(checked_mul(C, HD, "width x heads x head_dim"), ranks, "tpa's factors"),
                      "a layer's parameters");
  layer = checked_add(layer, checked_mul(4, C, "the norms"), "a layer's parameters");
  int64_t params = checked_mul(layer, m.layers, "layers x a layer's parameters");
  params = checked_add(params, checked_mul(m.vocab_size, C, "vocab_size x width"), "the parameter count");
  SizeEstimate e;
  e.tokens = checked_mul(batch, m.seq_len, "batch x seq_len");
  // f32 weights, gradients and two AdamW moments.
  e.parameter_bytes = checked_mul(params, 16, "the parameters' bytes");
  // A lower bound of the activations the tape keeps: per token and layer four f32 vectors of the widest of
  // C, hidden, H*D (a real step keeps several times more), so only what surely cannot fit is refused.
  const int64_t widest = std::max({C, m.mlp_hidden, HD});
  const int64_t per_token = checked_mul(checked_mul(4 * 4, widest, "the activations"), m.layers, "the activations");
  e.activation_bytes = checked_mul(e.tokens, per_token, "the activations' bytes (batch x seq_len x ...)");
  return e;
}

void check_memory(const ModelConfig& m, int64_t batch, const std::string& source) {
  const SizeEstimate e = estimate_sizes(m, batch);
  const int64_t limit = memory_limit_bytes();
  LT_CHECK(e.parameter_bytes <= limit, "[config] ", source, ": the model would need ", e.parameter_bytes,
           " bytes for its weights, gradients and optimizer state; this machine has ", limit);
  LT_CHECK(e.activation_bytes <= limit, "[config] ", source, ": batch ", batch, " x seq_len ", m.seq_len,
           " would need at least ", e.activation_bytes, " bytes of activations; this machine has ", limit);
}

TrainConfig TrainConfig::preset(const std::string& name) {
  TrainConfig c;
  c.model = ModelConfig::preset(name);  // throws for an unknown name
  if (name == "small") {
    c.steps = 1000;
    c.batch = 8;
    c.lr = 1e-3;
    c.warmup = 50;
    c.val_every = 200;
  }
  return c;
}

void TrainConfig::validate() const {
  model.validate();
  auto positive = [](const char* key, int64_t v) {
    LT_CHECK(v > 0, "[config] ", key, " must be positive; got ", v);
  };
  positive("steps", steps);
  positive("batch", batch);
  positive("grad_accum", grad_accum);
  positive("log_every", log_every);
  positive("val_every", val_every);
  positive("keep_checkpoints", keep_checkpoints);
  LT_CHECK(val_batches >= 0, "[config] val_batches must not be negative; got ", val_batches);
  LT_CHECK(checkpoint_every >= 0, "[config] checkpoint_every must not be negative; got ", checkpoint_every);
  LT_CHECK(warmup >= 0, "[config] warmup must not be negative; got ", warmup);
  LT_CHECK(lr > 0, "[config] lr must be positive; got ", lr);
  LT_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "[config] min_lr_ratio must be in [0, 1]; got ", min_lr_ratio);
  LT_CHECK(grad_clip > 0, "[config] grad_clip must be positive; got ", grad_clip);
  LT_CHECK(!data.empty(), "[config] data must be mqar or a file; got an empty string");
  LT_CHECK(documents.empty() || data != "mqar",
           "[config] documents do not apply to mqar (its rows are generated, each one sequence); got documents \"",
           documents, "\"");
  LT_CHECK(eot_token >= 0, "[config] eot_token must not be negative; got ", eot_token);
}

void validate_with_sizes(const TrainConfig& c) {
  c.validate();
  check_memory(c.model, c.batch, "batch and the model");
}

std::string to_json(const ModelConfig& config) { return model_json(config).dump(2); }

std::string to_json(const TrainConfig& c) {
  const json j{{"model", model_json(c.model)},
               {"data", c.data},
               {"val_data", c.val_data},
               {"documents", c.documents},
               {"eot_token", c.eot_token},
               {"steps", c.steps},
               {"batch", c.batch},
               {"grad_accum", c.grad_accum},
               {"lr", c.lr},
               {"warmup", c.warmup},
               {"min_lr_ratio", c.min_lr_ratio},
               {"weight_decay", c.weight_decay},
               {"grad_clip", c.grad_clip},
               {"seed", c.seed},
               {"log_every", c.log_every},
               {"val_every", c.val_every},
               {"val_batches", c.val_batches},
               {"checkpoint_every", c.checkpoint_every},
               {"keep_checkpoints", c.keep_checkpoints}};
  return j.dump(2);
}

ModelConfig model_config_from_json(const std::string& text, const std::string& source) {
  ModelConfig c = model_from(parse(text, source), source, ModelConfig());
  try {
    c.validate();
    check_memory(c, 1, "the model");
  } catch (const Error& e) {
    fail(str(source, ": ", e.what()));
  }
  return c;
}

TrainConfig train_config_from_json(const std::string& text, const std::string& source, const TrainConfig& base) {
  const json j = parse(text, source);
  LT_CHECK(j.is_object(), "[config] ", source, ": expected a JSON object");
  const json known = json::parse(to_json(base));
  for (auto it = j.begin(); it != j.end(); ++it)
    LT_CHECK(known.contains(it.key()), "[config] ", source, ": unknown key '", it.key(), "'");
  TrainConfig c = base;
  if (j.contains("model")) c.model = model_from(j.at("model"), source, base.model);
  read_key(j, "data", c.data, source);
  read_key(j, "val_data", c.val_data, source);
  read_key(j, "documents", c.documents, source);
  read_key(j, "eot_token", c.eot_token, source);
  read_key(j, "steps", c.steps, source);
  read_key(j, "batch", c.batch, source);
  read_key(j, "grad_accum", c.grad_accum, source);
  read_key(j, "lr", c.lr, source);
  read_key(j, "warmup", c.warmup, source);
  read_key(j, "min_lr_ratio", c.min_lr_ratio, source);
  read_key(j, "weight_decay", c.weight_decay, source);
  read_key(j, "grad_clip", c.grad_clip, source);
  read_key(j, "seed", c.seed, source);
  read_key(j, "log_every", c.log_every, source);
  read_key(j, "val_every", c.val_every, source);
  read_key(j, "val_batches", c.val_batches, source);
  read_key(j, "checkpoint_every", c.checkpoint_every, source);
  read_key(j, "keep_checkpoints", c.keep_checkpoints, source);
  try {
    validate_with_sizes(c);
  } catch (const Error& e) {  // the sizes are checked before anything is built: the message names the file
    fail(str(source, ": ", e.what()));
  }
  return c;
}

TrainConfig load_train_config(const std::string& path) {
  std::ifstream in(path);
  LT_CHECK(in.good(), "[config] cannot read the config file '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  return train_config_from_json(text.str(), path);
}

}  // namespace lintape
