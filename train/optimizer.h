// AdamW over a module's flat parameter and gradient buffers, the warm-up + cosine schedule and the
// global gradient-norm clip of docs/MODEL.md. The module must be flattened (Module::flatten_parameters).
// CPU: float32 loops in a fixed order, so a run is bit-reproducible. CUDA (parameters on a GPU): one fused
// kernel for the update and a deterministic device reduction for the norm; only the norm comes back.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include "../core/tensor.h"
#include "../layers/module.h"

namespace lintape {

class Communicator;

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // on matrices and embeddings (dim >= 2) only, never on norm weights
};

class AdamW {
 public:
  AdamW(Module& module, const AdamWOptions& options = {});
  // One update with learning rate lr from the module's flat gradients.
  void step(double lr);
  int64_t steps_taken() const { return steps_; }
  // Moments named m.<param> and v.<param> (CPU float32 copies), and back; errors name `source`.
  // Sharded, state_dict gathers the moments from every rank: every rank must call it.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& state, int64_t steps_taken,
                       const std::string& source = "optimizer state");

  // ZeRO-1 over the ranks of `comm`: this rank keeps the moments of its 1 / ranks of the flat buffers
  // only (their length must split evenly: Module::flatten_parameters(ranks)). Then
  // reduce_and_clip_gradients() replaces the all-reduce and clip_grad_norm: it reduce-scatters the
  // gradients' mean into this rank's slice and clips it by the global norm (returned); step() updates
  // this rank's slice of the parameters and all-gathers them.
  void shard(Communicator& comm);
  bool sharded() const { return comm_ != nullptr; }

  // Keeps the parameters also in `dtype` (bf16 or f16; anything else drops the copy), rewritten with each
  // update: Tensor::to(dtype) on a parameter then returns a view of it instead of converting, so the model's
  // weights reach their compute dtype without a pass of their own. numel x 2 bytes. Not kept when sharded
  // (shard() drops it).
  void keep_compute_copy(DType dtype);
  double reduce_and_clip_gradients(double max_norm);

  // The queued step (CUDA, unsharded): the clip and the update with no host wait, so that a CUDA graph can
  // capture them (train/step_graph.h). Its learning rate and step number are read from device memory, and
  // a loss or gradient norm that is not finite skips the update on the device. In order:
  // set_learning_rate(lr) before the step's work (outside a graph), queue_step(loss, clip) after backward
  // (loss: the step's float32 scalar on the device), read_step() for (loss, gradient norm) once the work
  // is queued (waits for it), then commit_step() if both are finite (counts the update).
  bool can_queue() const;
  void set_learning_rate(double lr);
  void queue_step(const Tensor& loss, double max_norm);
  std::pair<double, double> read_step() const;
  void commit_step();

 private:
  Tensor slice(const Tensor& flat) const;  // this rank's slice of a flat buffer (all of it unsharded)
  void attach_compute_copy();
  Module& module_;
  AdamWOptions options_;
  // Flat like the parameters (this rank's slice when sharded); decay_mask_ is 1 where weight decay applies.
  Tensor m_, v_, decay_mask_;
  Tensor compute_copy_;  // see keep_compute_copy; undefined when none
  Tensor device_step_;   // the queued step's scalars (train_cuda::DeviceStep), made by its first use
  int64_t steps_ = 0;
  Communicator* comm_ = nullptr;
};

// Linear warm-up to peak over `warmup` steps, then cosine down to min_ratio * peak at total_steps.
double learning_rate(int64_t step, int64_t total_steps, int64_t warmup, double peak, double min_ratio = 0.1);

// Scales the module's flat gradients so that their global L2 norm is at most max_norm; returns the norm
// before clipping (computed in double).
double clip_grad_norm(Module& module, double max_norm);

}  // namespace lintape
