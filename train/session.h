// What a training step works on, built in one place for `lintape train` (Trainer), `bench train` and
// `profile`: the model on its device (parameters flattened for the optimizer), its AdamW, and on several
// ranks without ZeRO-1 the bucketed gradient all-reduce.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "../core/device.h"
#include "../layers/language_model.h"
#include "grad_reducer.h"
#include "optimizer.h"

namespace lintape {

struct SessionOptions {
  Device device = Device::cpu();
  std::optional<DType> compute_dtype;  // unset: default_compute_dtype(device)
  int64_t shards = 1;                  // the ranks: the flat parameters split into this many equal shards
  AdamWOptions adamw;
};

// A queued step's inputs for one micro-batch: fixed device buffers that every step's batch is copied into
// (write), so that a replayed CUDA graph reads the new tokens, targets and document boundaries.
struct StepInputs {
  Tensor tokens, targets;
  Documents documents;  // defined when the batches have documents
  Tensor weight;        // float32 scalar: the loss's weight in the step (the trainer's share of the targets)
  // Allocates the buffers on `device` at the first call; later batches must have the first one's shapes.
  void write(const Tensor& tokens, const Tensor& targets, const Documents& documents, double weight,
             Device device);
};

struct TrainSession {
  std::unique_ptr<LanguageModel> model;
  std::unique_ptr<AdamW> optimizer;
  std::unique_ptr<GradReducer> reducer;  // set by the caller: several ranks without ZeRO-1 only

  // The model of `config` from `seed` (then `weights`, a checkpoint's, when given; `source` names them in
  // errors), moved to the device and flattened, its compute dtype set, and a fresh AdamW over it.
  static TrainSession build(const ModelConfig& config, uint64_t seed, const SessionOptions& options,
                            const std::map<std::string, Tensor>* weights = nullptr, const std::string& source = "");
  // After backward: the global-norm clip at `clip` (sharded: with the moments' reduce-scatter) and the
  // AdamW update at `lr`; returns the gradient norm before the clip. A non-finite norm leaves the weights
  // as they are (no update).
  double update(double lr, double clip);
  // The whole step queued on the device without a wait (AdamW::queue_step): zero the gradients, each
  // micro-batch's loss (times its weight) and backward, with a reducer the gradients' mean over the ranks
  // (in buckets started during the last backward, or one sum after it) and the loss's, then the clip at
  // `clip` and the update.
  // What a CUDA graph captures; the caller sets the learning rate before and reads the step after.
  void queue_step(const std::vector<StepInputs>& micro, double clip);
};

// bfloat16 on CUDA (docs/MODEL.md's mixed precision), float32 on the CPU.
DType default_compute_dtype(Device device);

}  // namespace lintape
