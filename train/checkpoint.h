// Checkpoints of docs/MODEL.md: DIR/step_<8 digits>/{model.safetensors, optim.safetensors, state.json} and
// DIR/latest. A step directory is written under a temporary name (removed when a write fails) and renamed
// when complete, and `latest` is replaced by rename, so a run killed while writing leaves the previous
// checkpoint as the newest complete one. Loading checks state.json's own checksum (state_sha256, absent in
// checkpoints of lintape 0.1, which still load) and its config's sizes before anything else, then every
// file's sha256 and every shape, and names the file that differs.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include "../core/tensor.h"
#include "../layers/module.h"
#include "config.h"
#include "optimizer.h"

namespace lintape {

struct TrainState {
  int64_t step = 0;           // optimizer steps done
  int64_t data_position = 0;  // where the training data resumes
};

// Writes the checkpoint of `step`, points `latest` at it and removes all but the newest `keep` step
// directories. Returns the step directory's path.
// `optimizer_state` is AdamW::state_dict() (the moments m.<param>, v.<param>).
std::string save_checkpoint(const std::string& dir, Module& model,
                            const std::map<std::string, Tensor>& optimizer_state, const TrainConfig& config,
                            const TrainState& state, int64_t keep);

// Creates DIR if needed, writes and removes a small file in it: a run calls it before its first step, so an
// unwritable or full directory is found before any training is lost. Throws naming DIR and the reason.
void check_checkpoint_dir_writable(const std::string& dir);

struct Checkpoint {
  std::string path;  // the step directory
  TrainConfig config;
  TrainState state;
  std::map<std::string, Tensor> model, optim;
};

// The checkpoint named by DIR/latest (or DIR itself when it is a step directory), verified.
// The config is read and validated (sizes against overflow and memory, errors naming state.json) before
// any tensor file is hashed or loaded; weights that are not all finite are refused, naming the tensor.
Checkpoint load_checkpoint(const std::string& dir);
// The same without the tensors and their hashes: the config, the step and the data position.
Checkpoint load_checkpoint_state(const std::string& dir);

}  // namespace lintape
