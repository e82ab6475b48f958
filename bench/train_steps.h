// Training steps of the language model, timed and taken apart: what `lintape bench train` and
// `lintape profile` measure. A step is MODEL.md's: forward, loss, backward, global-norm clip at 1.0,
// AdamW. Batches are random tokens drawn before timing (speed does not depend on the text).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "core/device.h"
#include "layers/language_model.h"
#include "ops/documents.h"
#include "train/session.h"
#include "train/step_graph.h"

namespace lintape::bench {

struct TrainBenchOptions {
  std::string preset = "small";
  std::string mixers;        // comma-separated; empty: the preset's
  int64_t batch = 16;
  int64_t seq = 0;           // 0: the preset's seq_len
  int64_t vocab = 32768;     // MODEL.md's benchmark vocabulary
  int64_t steps = 10;        // timed steps
  int64_t warmup = 3;
  Device device = Device::cpu();
  std::optional<DType> compute_dtype;  // unset: default_compute_dtype(device), bf16 on CUDA
  bool cuda_graph = true;              // CUDA: the step replayed as a CUDA graph (train/step_graph.h)
  // Rows packed from documents of this many tokens (bench_documents; targets masked at each document's
  // end), their starts copied into the step's buffer every step as the trainer does; 0: none. bench train
  // and profile.
  int64_t document_length = 0;
};

// A model, its optimizer and pre-drawn batches, ready to step.
struct TrainSetup {
  TrainSession session;
  LanguageModel* model = nullptr;  // session's
  std::vector<std::pair<Tensor, Tensor>> batches;  // (tokens, targets) on the device
  Documents documents;  // of every batch (document_length), on the device; undefined without
  TrainBenchOptions options;
  int64_t params = 0;
  // CUDA: the queued step's graph and its input buffers (each batch is copied into them), made by the first step.
  std::unique_ptr<StepGraph> graph;
  std::vector<StepInputs> inputs{1};
  int64_t tokens_per_step() const;
};
TrainSetup make_train_setup(const TrainBenchOptions& o);

// One training step on batch `i` (mod the number drawn); returns the loss (a device sync). On CUDA the
// step is queued whole (AdamW::queue_step) and, with options.cuda_graph, replayed as a CUDA graph.
double train_step(TrainSetup& s, size_t i);

struct TrainBenchResult {
  int64_t params = 0, tokens_per_step = 0;
  double step_ms = 0, tokens_per_s = 0, mfu = -1, peak_mib = 0, last_loss = 0;
  std::string peak_source;
  std::string cuda_graph;  // StepGraph::why(), empty off CUDA
};
TrainBenchResult bench_train(TrainSetup& s);

// One row of a profile: a part of the model (a layer's norm, mixer, MLP, ...) with its forward and
// backward time and the activation memory it holds between them (its output and saved tensors).
struct ProfileRow {
  std::string part;  // "blocks.3.fal", "embedding", "optimizer", ...
  std::string kind;  // what rows are summed by: "embedding", "norm", "fal", "tpa", "mlp", ...
  double fwd_ms = 0, bwd_ms = 0, activation_mib = 0;
};
// One op inside one layer kind, per step (the mean over the profiled steps): its forward (from the previous
// op's record to its own, so untaped work such as a view's counts towards the next op) and its backward.
struct ProfileOpRow {
  std::string kind, op;
  double fwd_ms = 0, bwd_ms = 0;
  int64_t calls = 0;
};
struct ProfileResult {
  std::vector<ProfileRow> rows;  // per layer, in execution order
  std::vector<ProfileOpRow> ops;  // the rows split by op, the largest forward + backward first
  double parts_ms = 0;           // sum of the rows
  double step_ms = 0;            // a whole step, timed on its own
  double peak_mib = 0;
};
// Runs each part on a detached copy of its input so that its forward and backward can be timed apart
// (CUDA events on the device's stream), `steps` times after the warm-up; rows hold the medians.
ProfileResult profile_train_step(TrainSetup& s);

}  // namespace lintape::bench
