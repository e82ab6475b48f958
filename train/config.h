// TrainConfig: the model (MODEL.md's config) and the run's settings, with the presets tiny and small,
// JSON load and save, and validation with errors that name the key.
#pragma once
#include <cstdint>
#include <string>
#include "../layers/language_model.h"

namespace lintape {

struct TrainConfig {
  ModelConfig model;
  std::string data = "mqar";  // "mqar" or a file (text as bytes, or an llm.c .bin)
  std::string val_data;       // empty: the held-out tail of the data file
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

std::string to_json(const ModelConfig& config);
std::string to_json(const TrainConfig& config);
// Keys missing from the JSON keep their default (or `base`'s); unknown keys are an error naming `source`.
ModelConfig model_config_from_json(const std::string& json, const std::string& source);
TrainConfig train_config_from_json(const std::string& json, const std::string& source,
                                   const TrainConfig& base = TrainConfig());
TrainConfig load_train_config(const std::string& path);  // file errors name the file

}  // namespace lintape
