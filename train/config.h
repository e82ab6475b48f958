// TrainConfig: the model (docs/MODEL.md's config) and the run's settings, with the presets tiny and small,
// JSON load and save, and validation with errors that name the key.
#pragma once
#include <cstdint>
#include <string>
#include "../layers/language_model.h"
#include "documents.h"

namespace lintape {

struct TrainConfig {
  ModelConfig model;
  std::string data = "mqar";  // "mqar" or a file (text as bytes, or an llm.c .bin)
  std::string val_data;       // empty: the held-out tail of the data file
  // --documents (train/documents.h): "" none, "auto", or a separator; .bin data is cut at eot_token.
  std::string documents;
  int64_t eot_token = kGpt2EndOfText;
  int64_t steps = 60;          // tiny: about 1.2 s a step on a 2-core CPU
  int64_t batch = 8;
  int64_t grad_accum = 1;     // micro-batches per step
  double lr = 3e-3;           // peak
  int64_t warmup = 5;
  double min_lr_ratio = 0.1;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  uint64_t seed = 0;
  int64_t log_every = 10;
  int64_t val_every = 50;
  int64_t val_batches = 4;
  int64_t checkpoint_every = 0;  // 0: only at the end
  int64_t keep_checkpoints = 3;

  static TrainConfig preset(const std::string& name);  // "tiny" or "small"
  void validate() const;                                // throws naming the key and the value
};

// Sizes of a run, each product computed with overflow checks (a failure names the product): the f32
// weights, gradients and AdamW moments, and a lower bound of the activations a step keeps.
struct SizeEstimate {
  int64_t tokens = 0, parameter_bytes = 0, activation_bytes = 0;
};
SizeEstimate estimate_sizes(const ModelConfig& model, int64_t batch);
int64_t memory_limit_bytes();  // the machine's physical memory
// Throws naming `source` and the bytes needed when the estimate exceeds memory_limit_bytes().
void check_memory(const ModelConfig& model, int64_t batch, const std::string& source);
// validate(), then every size against overflow and memory: what a command line, a config file and a
// checkpoint's state.json go through before anything is built (train_config_from_json calls it).
void validate_with_sizes(const TrainConfig& config);

std::string to_json(const ModelConfig& config);
std::string to_json(const TrainConfig& config);
// Keys missing from the JSON keep their default (or `base`'s); unknown keys are an error naming `source`.
ModelConfig model_config_from_json(const std::string& json, const std::string& source);
TrainConfig train_config_from_json(const std::string& json, const std::string& source,
                                   const TrainConfig& base = TrainConfig());
TrainConfig load_train_config(const std::string& path);  // file errors name the file

}  // namespace lintape
