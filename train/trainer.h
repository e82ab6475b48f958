// The training loop: builds the model and data of a TrainConfig, steps AdamW with the schedule, clipping
// and gradient accumulation, prints progress lines (step/total, loss, tok/s, ms/step, peak MiB, ETA),
// validates every val_every steps, writes JSONL rows, the summary JSON and the loss SVG, and checkpoints.
// A NaN or Inf loss or gradient norm stops the run before the update, and weights that give a non-finite
// loss on their last batch are never saved: the latest checkpoint stays the last good one. SIGINT or SIGTERM
// finishes the current step, writes a checkpoint and returns with the signal in the result (cli/ makes it the
// exit status 128 + signal). On CUDA the parameters, their
// gradients and the AdamW moments are float32 on the device and the forward runs in the compute dtype.
// Data cut into documents (TrainConfig::documents) hands each batch's boundaries to the model with its tokens.
#pragma once
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>
#include "../core/device.h"
#include "../layers/language_model.h"
#include "config.h"
#include "data.h"
#include "grad_reducer.h"
#include "optimizer.h"
#include "session.h"
#include "step_graph.h"

namespace lintape {

struct TrainerOptions {
  Device device = Device::cpu();
  std::string log_path;        // JSONL; the summary and SVG go next to it (.summary.json, .svg)
  std::string checkpoint_dir;  // empty: no checkpoints
  bool resume = false;         // continue from checkpoint_dir's latest checkpoint
  std::ostream* progress = nullptr;
  int64_t stop_after = -1;     // stop (with a checkpoint) after this many steps of this run; tests
  // The activations' and matrix products' dtype; the master weights and AdamW moments stay float32.
  // Unset: default_compute_dtype(device).
  std::optional<DType> compute_dtype;
  // Several ranks: 1 shards the AdamW moments over them (ZeRO-1); 0 keeps them whole on every rank.
  int zero = 0;
  // Several ranks without ZeRO-1: the gradient all-reduce's buckets (MiB), started during backward
  // (train/grad_reducer.h) inside the step's CUDA graph; 0: one bucket, the whole buffer, once backward is
  // done. 25 by default: on four H100s (small, 16 x 2048 a GPU) 2-4% faster than one bucket, except TPA on
  // four (0.4% slower).
  double bucket_mib = 25.0;
  // On CUDA with one process: the step (forward, backward, clip, AdamW) is captured once as a CUDA graph
  // and replayed (train/step_graph.h); false runs it eagerly. Either way it is queued without a host wait.
  bool cuda_graph = true;
};

// Training FLOPs per token of a config: 6 x parameters plus the mixers' attention (FAL: the state
// update and read, 24 H D^2 per layer; TPA: causal scores and values, 12 H D context per layer, 6 H D N
// without documents). context: the tokens' mean causal context (mean_causal_context, ops/documents.h).
double train_flops_per_token(const ModelConfig& config, int64_t parameters, double context);
// The card's dense bf16 tensor-core peak in FLOP/s for MFU, and how it was chosen ("989 TFLOP/s dense
// bf16 (NVIDIA H100 80GB HBM3)"); 0 and "" for a device not known (the CPU).
std::pair<double, std::string> peak_bf16_flops(Device device);

struct TrainResult {
  std::vector<double> losses;  // per step of this run
  int64_t first_step = 0, last_step = 0;
  double val_loss = -1, accuracy = -1;  // of the last validation (accuracy: mqar only)
  double tokens_per_s = 0;       // over this run so far
  double step_ms = 0, peak_mem_mib = 0;  // of the last step
  bool stopped_nonfinite = false, interrupted = false;
  int signal = 0;       // the signal that interrupted the run (SIGINT, SIGTERM), 0 if none
  std::string message;  // why the run stopped early, if it did
  std::string cuda_graph;  // "on", "off (--no-cuda-graph)", "off (several ranks)", ... (StepGraph::why)
};

class RunLog;

class Trainer {
 public:
  Trainer(TrainConfig config, TrainerOptions options);
  TrainResult run();
  // Mean validation loss and (mqar) accuracy over the data's validation batches.
  std::pair<double, double> validate();
  LanguageModel& model() { return *session_.model; }
  DataSource& data() { return *data_; }
  int64_t step() const { return step_; }
  // The gradient all-reduce in buckets: several ranks without ZeRO-1 only, null otherwise.
  const GradReducer* reducer() const { return session_.reducer.get(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct StepNumbers {
    double loss, grad_norm, lr;
  };
  // A slow run prints a progress line at least this often (seconds), besides every log_every steps.
  static constexpr int kLineSeconds = 10;
  // One step: the mean loss over the global batch (zero_grad, the micro-batches' forward and backward,
  // the gradient all-reduce), then the clipping and the AdamW update; none when the loss or the gradient
  // norm is NaN or Inf (the weights are left as they were).
  double forward_backward();
  std::optional<StepNumbers> update(double loss);
  // The same step queued whole (CUDA, one process): the batches copied into fixed input buffers, then
  // the step's work run or replayed by graph_, then one wait for its loss and gradient norm. Returns the
  // loss, and the numbers unless the loss or the norm is NaN or Inf (then no update was applied).
  std::pair<double, std::optional<StepNumbers>> queued_step();
  // Several ranks reduce inside the queued step without ZeRO-1 (whose reduce-scatter stays eager).
  bool queued_reduce() const { return options_.zero == 0; }
  // The step's row (and with `line`, its progress line), the validation's, the stop on a NaN or Inf.
  void log_step(const StepNumbers& numbers, Clock::time_point step_start, Clock::time_point run_start, bool line,
                TrainResult& result, RunLog& log) const;
  void log_validation(TrainResult& result, RunLog& log);
  void stop_nonfinite(double loss, TrainResult& result) const;
  // SIGINT or SIGTERM on any rank or stop_after reached: sets the result's reason; the same answer on every rank.
  bool stop_requested(TrainResult& result) const;
  std::string summary_json(const TrainResult& result) const;
  SessionOptions session_options(int64_t shards) const;
  // Writes a checkpoint (with a checkpoint directory) unless the weights give a non-finite loss on the last
  // batch: then false, and the result says why the run stops.
  bool checkpoint(TrainResult& result);
  TrainConfig config_;
  TrainerOptions options_;
  TrainSession session_;  // its reducer: several ranks without ZeRO-1 only
  std::unique_ptr<DataSource> data_;
  int64_t step_ = 0;
  Batch last_batch_;             // this rank's last micro-batch: the weights' check before a checkpoint
  double last_grad_norm_ = 0;    // of the last update (tried)
  // The training batches' mean causal context (ops/documents.h) summed over this run's micro-batches: the
  // MFU's count of the mixers' attention.
  double context_sum_ = 0;
  int64_t context_batches_ = 0;
  // The step's micro-batches (this rank's rows), each with its loss's weight: its count of targets over
  // the global batch's, times the ranks.
  std::vector<std::pair<Batch, double>> draw_step_batches();
  // The batches of the step about to run (drawn ahead by the last queued step, or now), counted into the
  // context's mean; the last into last_batch_.
  std::vector<std::pair<Batch, double>> take_step_batches();
  std::optional<std::vector<std::pair<Batch, double>>> next_batches_;  // queued steps: drawn during the last one
  int64_t position_before_next_ = 0;  // the data's position before next_batches_ (what a checkpoint saves)
  std::unique_ptr<StepGraph> graph_;               // queued steps only
  bool graph_said_ = false;                        // the log told whether the step is a CUDA graph
  std::vector<StepInputs> inputs_;  // queued steps: each micro-batch's buffers
  double peak_flops_ = 0;  // the card's dense bf16 peak (0: unknown, no MFU)
  std::string peak_name_;
};

}  // namespace lintape
