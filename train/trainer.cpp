#include "train/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "autograd/tape.h"
#include "core/allocator.h"
#include "layers/mixer.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "train/checkpoint.h"
#include "train/comm.h"
#include "train/run_log.h"

#if LINTAPE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lintape {

using nlohmann::json;

namespace {

// The signal (SIGINT or SIGTERM) that asks the run to stop; 0 while none has come.
std::atomic<int> g_signal{0};
extern "C" void on_stop_signal(int signal) { g_signal = signal; }

// Installs the SIGINT and SIGTERM handlers for the lifetime of run() and restores the previous ones.
struct StopSignalScope {
  StopSignalScope()
      : previous_int(std::signal(SIGINT, on_stop_signal)), previous_term(std::signal(SIGTERM, on_stop_signal)) {
    g_signal = 0;
  }
  ~StopSignalScope() {
    std::signal(SIGINT, previous_int);
    std::signal(SIGTERM, previous_term);
  }
  void (*previous_int)(int);
  void (*previous_term)(int);
};

// The held-out tail of a data file without --val-data (open_data's default).
constexpr double kValFraction = 0.05;

DocumentSplit document_split(const TrainConfig& c) { return DocumentSplit{c.documents, c.eot_token}; }

const char* signal_name(int signal) { return signal == SIGTERM ? "SIGTERM" : signal == SIGINT ? "SIGINT" : "a signal"; }

// This rank's rows of a global batch: rank r of R takes rows [r B / R, (r + 1) B / R).
Batch rank_slice(const Batch& global, Communicator& comm) {
  if (!comm.distributed()) return global;
  const int64_t rows = global.tokens.size(0) / comm.size(), first = rows * comm.rank();
  // Each rank's rows carry their own documents: nothing of them is reduced.
  const Documents docs = global.documents.defined()
                             ? Documents::from_starts(global.documents.starts().narrow(0, first, rows).contiguous())
                             : Documents();
  return {global.tokens.narrow(0, first, rows).contiguous(), global.targets.narrow(0, first, rows).contiguous(), docs};
}

// `value` of every rank, in rank order (one value each: a small sum over the ranks).
std::vector<double> every_rank(double value, Communicator& comm) {
  if (!comm.distributed()) return {value};
  std::vector<double> slots(size_t(comm.size()), 0.0);
  slots[size_t(comm.rank())] = value;
  Tensor t = from_vector(slots, {comm.size()}, DType::F64);
  comm.all_reduce_sum(t);
  return t.to_vector<double>();
}

}  // namespace

std::pair<double, std::string> peak_bf16_flops(Device device) {
#if LINTAPE_WITH_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, device.index) != cudaSuccess) return {0.0, ""};
    const std::string name = p.name;
    // H100 SXM and H200: 989 TFLOP/s dense bf16 (the datasheets' sparse figure halved).
    if (name.find("H100") != std::string::npos && name.find("PCIe") == std::string::npos)
      return {989e12, "989 TFLOP/s dense bf16 (" + name + ")"};
    if (name.find("H200") != std::string::npos) return {989e12, "989 TFLOP/s dense bf16 (" + name + ")"};
    if (name.find("H100") != std::string::npos) return {756e12, "756 TFLOP/s dense bf16 (" + name + ")"};
  }
#else
  (void)device;
#endif
  return {0.0, ""};
}

double train_flops_per_token(const ModelConfig& c, int64_t parameters, double context) {
  double flops = 6.0 * double(parameters);
  for (int64_t i = 0; i < c.layers; ++i) flops += mixer_kind(c.mixer(i)).train_flops_per_token(c, context);
  return flops;
}

Trainer::Trainer(TrainConfig config, TrainerOptions options) : config_(std::move(config)), options_(options) {
  Communicator& comm = Communicator::world();
  // Several ranks: each drives the GPU of its local rank on the node.
  if (comm.distributed() && options_.device.is_cuda()) options_.device = Device::cuda(comm.local_rank());
  if (options_.resume) {
    LT_CHECK(!options_.checkpoint_dir.empty(), "[train] --resume needs a checkpoint directory");
    Checkpoint c = load_checkpoint(options_.checkpoint_dir);
    // The caller's config is the checkpoint's, with --steps at or above its total (cli/ refuses a smaller one).
    LT_CHECK(config_.steps >= c.config.steps, "[train] ", config_.steps, " steps is below the checkpoint's total of ",
             c.config.steps, " (", c.path, "); a resumed run can extend its total, not shorten it");
    const int64_t steps = config_.steps;
    config_ = c.config;
    config_.steps = steps;
    session_ = TrainSession::build(config_.model, config_.seed, session_options(comm.size()), &c.model,
                                   c.path + "/model.safetensors");
    session_.optimizer->load_state_dict(c.optim, c.state.step, c.path + "/optim.safetensors");
    data_ = open_data(config_.data, config_.val_data, config_.batch, config_.model.seq_len, config_.seed,
                      config_.val_batches, config_.model.vocab_size, kValFraction, document_split(config_));
    data_->seek(c.state.data_position);
    step_ = c.state.step;
  } else {
    config_.validate();
    data_ = open_data(config_.data, config_.val_data, config_.batch, config_.model.seq_len, config_.seed,
                      config_.val_batches, config_.model.vocab_size, kValFraction, document_split(config_));
    LT_CHECK(data_->vocab_size() <= config_.model.vocab_size, "[train] the data has tokens up to ",
             data_->vocab_size() - 1, "; the model's vocab_size is ", config_.model.vocab_size);
    session_ = TrainSession::build(config_.model, config_.seed, session_options(comm.size()));
  }
  std::tie(peak_flops_, peak_name_) = peak_bf16_flops(options_.device);
  if (comm.distributed()) {
    LT_CHECK(config_.batch % comm.size() == 0, "[train] the batch (", config_.batch,
             " sequences) must be a multiple of the number of ranks (", comm.size(), ")");
    comm.check_same("the training config", to_json(config_));
    comm.check_same("the step to start from", std::to_string(step_));
    comm.check_same("--zero", std::to_string(options_.zero));
    // Every rank starts from rank 0's weights (the same seed gives the same ones; this makes it so).
    Tensor params = session_.model->flat_parameters();
    comm.broadcast(params, 0);
  }
  LT_CHECK(options_.zero == 0 || options_.zero == 1, "[train] --zero must be 0 or 1; got ", options_.zero);
  // Unsharded, the weights' bf16 copy comes with each update.
  if (options_.zero == 1) session_.optimizer->shard(comm);
  else
    session_.optimizer->keep_compute_copy(session_.model->compute_dtype());
  LT_CHECK(options_.bucket_mib >= 0, "[train] --bucket-mib must be >= 0; got ", options_.bucket_mib);
  // ZeRO-1 keeps its one reduce-scatter after backward; one rank has nothing to reduce.
  if (comm.distributed() && options_.zero == 0)
    session_.reducer = std::make_unique<GradReducer>(*session_.model, comm, options_.bucket_mib);
  // The queued step (and its CUDA graph) holds the gradients' all-reduce, in buckets or one after backward;
  // not ZeRO-1's reduce-scatter, whose steps stay eager.
  if (session_.optimizer->can_queue() && (!comm.distributed() || queued_reduce()))
    graph_ = std::make_unique<StepGraph>(options_.device, options_.cuda_graph);
}

SessionOptions Trainer::session_options(int64_t shards) const {
  SessionOptions o;
  o.device = options_.device;
  o.compute_dtype = options_.compute_dtype;
  o.shards = shards;
  o.adamw = AdamWOptions{0.9, 0.95, 1e-8, config_.weight_decay};
  return o;
}

std::pair<double, double> Trainer::validate() {
  NoGradGuard no_grad;
  double loss_sum = 0, correct = 0, answers = 0;
  const int64_t n = data_->validation_batches();
  for (int64_t i = 0; i < n; ++i) {
    const Batch b = data_->validation(i);
    const Documents docs = b.documents.to(options_.device);
    loss_sum += session_.model->loss(b.tokens.to(options_.device), b.targets.to(options_.device), docs).item();
    if (data_->reports_accuracy()) {
      const int64_t rows = b.tokens.numel(), V = config_.model.vocab_size;
      const Tensor flat_logits = session_.model->forward(b.tokens.to(options_.device), docs).reshape({rows, V});
      const std::vector<int64_t> predicted = max(flat_logits, 1).indices.to_vector<int64_t>();
      const std::vector<int64_t> targets = b.targets.to_vector<int64_t>();
      for (size_t r = 0; r < targets.size(); ++r)
        if (targets[r] >= 0) {
          answers += 1;
          correct += predicted[r] == targets[r] ? 1 : 0;
        }
    }
  }
  return {n > 0 ? loss_sum / double(n) : -1.0, answers > 0 ? correct / answers : -1.0};
}

bool Trainer::checkpoint(TrainResult& result) {
  if (options_.checkpoint_dir.empty()) return true;
  Communicator& comm = Communicator::world();
  // A finite step can still leave weights that give NaN (a huge learning rate): they are checked on the
  // last batch before they are saved, so that the latest checkpoint is always one to resume or evaluate.
  double check_loss = 0;
  {
    NoGradGuard no_grad;
    check_loss = session_.model
                     ->loss(last_batch_.tokens.to(options_.device), last_batch_.targets.to(options_.device),
                            last_batch_.documents.to(options_.device))
                     .item();
  }
  bool sound = std::isfinite(check_loss);
  if (comm.distributed()) sound = comm.all_reduce_max(sound ? 0.0 : 1.0) == 0;
  if (!sound) {
    result.stopped_nonfinite = true;
    const bool earlier = std::filesystem::exists(std::filesystem::path(options_.checkpoint_dir) / "latest");
    result.message = str("[train] the weights after step ", step_, " give a loss of ", check_loss,
                         " on its batch; no checkpoint written from them, ",
                         earlier ? str("the latest in '", options_.checkpoint_dir, "' is the last good one")
                                 : std::string("and none was written before"));
    return false;
  }
  // The state is the same on every rank: rank 0 writes it, the others wait, so that a checkpoint is
  // complete before any rank goes on (and a later run with any number of ranks can resume from it).
  // Sharded: gathered, by every rank.
  const std::map<std::string, Tensor> moments = session_.optimizer->state_dict();
  const int64_t position = next_batches_ ? position_before_next_ : data_->position();  // before a step drawn ahead
  if (comm.rank() == 0)
    save_checkpoint(options_.checkpoint_dir, *session_.model, moments, config_, {step_, position},
                    config_.keep_checkpoints);
  comm.barrier();
  return true;
}

TrainResult Trainer::run() {
  StopSignalScope signals;
  const bool leader = Communicator::world().rank() == 0;  // logs, prints and writes checkpoints
  RunLog log(leader ? options_.log_path : "", options_.resume, leader ? options_.progress : nullptr);
  TrainResult result;
  result.first_step = step_;
  const Clock::time_point run_start = Clock::now();
  Clock::time_point last_line = run_start;
  reset_peak_memory(options_.device);
  if (data_->validation_batches() == 0)
    log.message("no validation data (the held-out part is shorter than a batch of sequences): the run is not "
                "validated");
  if (!data_->documents().empty())
    log.message("rows packed from documents cut at " + data_->documents() + " (each token sees only its own)");
  while (step_ < config_.steps) {
    const Clock::time_point step_start = Clock::now();
    double loss = 0;
    std::optional<StepNumbers> numbers;
    if (graph_) {
      std::tie(loss, numbers) = queued_step();
    } else {
      loss = forward_backward();
      numbers = update(loss);
    }
    if (graph_ && !graph_said_ && (graph_->replaying() || graph_->why() != "on")) {
      log.message(graph_->replaying() ? std::string("the step runs as a CUDA graph (--no-cuda-graph runs it eagerly)")
                                      : "the step runs eagerly: CUDA graph " + graph_->why());
      graph_said_ = true;
    }
    if (!numbers) {
      stop_nonfinite(loss, result);
      break;
    }
    // The first step's line, then every log_every steps, and at least every kLineSeconds on a slow run.
    const bool line = step_ == result.first_step + 1 || step_ % config_.log_every == 0 || step_ == config_.steps ||
                      Clock::now() - last_line >= std::chrono::seconds(kLineSeconds);
    if (line) last_line = Clock::now();
    log_step(*numbers, step_start, run_start, line, result, log);
    if (step_ % config_.val_every == 0 || step_ == config_.steps) log_validation(result, log);
    const bool stop = stop_requested(result);
    if ((config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) || step_ == config_.steps || stop) {
      if (!checkpoint(result)) break;  // result.message says why; the caller reports it
    }
    if (stop) break;
  }
  result.last_step = step_;
  result.cuda_graph = graph_ ? graph_->why()
                     : !options_.device.is_cuda()          ? "off (not a CUDA device)"
                     : Communicator::world().distributed() ? "off (several ranks with ZeRO-1 or --bucket-mib > 0)"
                                                           : "off";
  log.finish(summary_json(result));
  return result;
}

std::vector<std::pair<Batch, double>> Trainer::draw_step_batches() {
  Communicator& comm = Communicator::world();
  std::vector<std::pair<Batch, double>> micro;
  double targets = 0;  // this rank's, then every rank's
  for (int64_t m = 0; m < config_.grad_accum; ++m) {
    Batch b = rank_slice(data_->next_train(), comm);
    const std::vector<int64_t> t = b.targets.to_vector<int64_t>();
    const double count = double(std::count_if(t.begin(), t.end(), [](int64_t v) { return v >= 0; }));
    targets += count;
    micro.emplace_back(std::move(b), count);
  }
  if (comm.distributed()) targets = comm.all_reduce_sum(targets);
  // Each loss is its micro-batch's mean: weighed by its share of the targets (times the ranks, over which
  // the gradients' reduction takes the mean), the step's loss is the mean over all of them, exactly.
  for (auto& [b, w] : micro)
    w = targets > 0 ? w * double(comm.size()) / targets : 1.0 / double(config_.grad_accum);
  return micro;
}

std::vector<std::pair<Batch, double>> Trainer::take_step_batches() {
  std::vector<std::pair<Batch, double>> micro;
  if (next_batches_) {
    micro = std::move(*next_batches_);
    next_batches_.reset();
  } else {
    micro = draw_step_batches();
  }
  for (const auto& batch : micro) {
    context_sum_ += mean_causal_context(batch.first.documents, config_.model.seq_len);
    ++context_batches_;
  }
  last_batch_ = micro.back().first;
  return micro;
}

double Trainer::forward_backward() {
  Communicator& comm = Communicator::world();
  session_.model->zero_grad();
  double loss = 0;
  const std::vector<std::pair<Batch, double>> batches = take_step_batches();
  for (size_t micro = 0; micro < batches.size(); ++micro) {
    const auto& [b, weight] = batches[micro];
    Tensor l = session_.model->loss(b.tokens.to(options_.device), b.targets.to(options_.device),
                                    b.documents.to(options_.device));
    if (weight != 1.0) l = mul(l, weight);
    // The last micro-batch's backward completes the gradients: it starts the buckets' all-reduces.
    if (session_.reducer && micro + 1 == batches.size())
      backward(l, {}, false, session_.reducer->on_leaf_ready());
    else
      backward(l);
    loss += l.item();  // after backward: on CUDA the forward and backward are queued without a wait
  }
  // Before any other collective: every rank issues them in the same order.
  if (session_.reducer) session_.reducer->finish();
  // The weights make the ranks' mean the global batch's mean over its targets.
  if (comm.distributed()) loss = comm.all_reduce_sum(loss) / double(comm.size());
  return loss;
}

std::pair<double, std::optional<Trainer::StepNumbers>> Trainer::queued_step() {
  // The data's tokens are below the model's vocabulary (checked when it opens), so the embedding's and the
  // loss's checks, which a captured step skips, would not fire.
  const std::vector<std::pair<Batch, double>> batches = take_step_batches();
  inputs_.resize(batches.size());
  for (size_t m = 0; m < batches.size(); ++m) {
    const auto& [b, weight] = batches[m];
    inputs_[m].write(b.tokens, b.targets, b.documents, weight, options_.device);
  }
  const double lr = learning_rate(step_, config_.steps, config_.warmup, config_.lr, config_.min_lr_ratio);
  AdamW& optimizer = *session_.optimizer;
  optimizer.set_learning_rate(lr);
  graph_->run([this] { session_.queue_step(inputs_, config_.grad_clip); });
  // While the device runs the step, the host draws the next one's batches (each rank makes the global batch
  // and keeps its rows, and the ranks sum their targets), off the step's path: on four GPUs that took the
  // step from 92.6% to 94.7% of four times one GPU. A checkpoint saves the data's position before them.
  if (step_ + 1 < config_.steps) {
    position_before_next_ = data_->position();
    next_batches_ = draw_step_batches();
  }
  // Several ranks: the wait for the step (the queued all-reduces) under the timeout, so that a rank that
  // fails or stops ends the job instead of hanging it.
  Communicator::world().wait_device(options_.device);
  const auto [loss, grad_norm] = optimizer.read_step();
  last_grad_norm_ = grad_norm;
  if (!std::isfinite(loss) || !std::isfinite(grad_norm)) return {loss, std::nullopt};
  optimizer.commit_step();
  ++step_;
  return {loss, StepNumbers{loss, grad_norm, lr}};
}

std::optional<Trainer::StepNumbers> Trainer::update(double loss) {
  // Every rank has the same loss and gradient norm (reduced): they stop together.
  if (!std::isfinite(loss)) return std::nullopt;
  const double lr = learning_rate(step_, config_.steps, config_.warmup, config_.lr, config_.min_lr_ratio);
  // A non-finite gradient norm stops the run: the session applied no update, the weights are untouched.
  const double grad_norm = session_.update(lr, config_.grad_clip);
  last_grad_norm_ = grad_norm;
  if (!std::isfinite(grad_norm)) return std::nullopt;
  ++step_;
  return StepNumbers{loss, grad_norm, lr};
}

void Trainer::stop_nonfinite(double loss, TrainResult& result) const {
  result.stopped_nonfinite = true;
  const std::string what =
      std::isfinite(loss) ? str("the gradient norm is ", last_grad_norm_) : str("the loss is ", loss);
  result.message = str("[train] ", what, " at step ", step_ + 1,
                       "; stopped before the update, the last checkpoint is the last good one");
}

void Trainer::log_step(const StepNumbers& n, Clock::time_point step_start, Clock::time_point run_start, bool line,
                       TrainResult& result, RunLog& log) const {
  Communicator& comm = Communicator::world();
  const int64_t steps_this_run = step_ - result.first_step;
  const int64_t tokens_per_step = config_.batch * config_.model.seq_len * config_.grad_accum;
  const double step_ms = std::chrono::duration<double, std::milli>(Clock::now() - step_start).count();
  const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
  const int64_t parameters = session_.model->parameter_count();
  StepRow row;
  row.step = step_;
  row.loss = n.loss;
  row.lr = n.lr;
  row.grad_norm = n.grad_norm;
  row.tokens_per_s = double(tokens_per_step) * double(steps_this_run) / std::max(elapsed, 1e-9);
  row.step_ms = step_ms;
  row.peak_mem_mib = double(memory_stats(options_.device).peak) / (1024.0 * 1024.0);
  const std::vector<double> rank_peaks = every_rank(row.peak_mem_mib, comm);  // a collective: every rank
  if (comm.distributed()) row.rank_peak_mibs = rank_peaks;
  if (peak_flops_ > 0)
    row.mfu = row.tokens_per_s *
              train_flops_per_token(config_.model, parameters,
                                    context_batches_ > 0 ? context_sum_ / double(context_batches_)
                                                         : 0.5 * double(config_.model.seq_len)) /
              peak_flops_;
  row.total_steps = config_.steps;
  row.eta_s = elapsed / double(steps_this_run) * double(config_.steps - step_);
  result.losses.push_back(n.loss);
  result.tokens_per_s = row.tokens_per_s;
  result.step_ms = step_ms;
  result.peak_mem_mib = row.peak_mem_mib;
  log.step(row, line);
}

void Trainer::log_validation(TrainResult& result, RunLog& log) {
  if (data_->validation_batches() == 0) return;  // said once, at the start
  std::tie(result.val_loss, result.accuracy) = validate();
  log.validation(step_, result.val_loss, result.accuracy);
}

bool Trainer::stop_requested(TrainResult& result) const {
  Communicator& comm = Communicator::world();
  const bool counted_out = options_.stop_after >= 0 && step_ - result.first_step >= options_.stop_after;
  int signal = g_signal;
  // A signal reaches the ranks at slightly different times (or only one): they stop together, at the same
  // step, all with the same signal (SIGTERM before SIGINT).
  if (comm.distributed()) signal = int(comm.all_reduce_max(double(signal)));
  if (signal == 0 && !counted_out) return false;
  result.interrupted = signal != 0;
  result.signal = signal;
  const std::string saved = options_.checkpoint_dir.empty()
                                ? std::string("no checkpoint directory, nothing saved")
                                : str("checkpoint written to '", options_.checkpoint_dir, "' (continue with --resume)");
  result.message = signal == 0 ? "" : str("[train] ", signal_name(signal), " at step ", step_, "; ", saved);
  return true;
}

std::string Trainer::summary_json(const TrainResult& result) const {
  return json{{"config", json::parse(to_json(config_))},
              {"steps", step_},
              {"first_loss", result.losses.empty() ? 0.0 : result.losses.front()},
              {"last_loss", result.losses.empty() ? 0.0 : result.losses.back()},
              {"val_loss", result.val_loss >= 0 ? json(result.val_loss) : json(nullptr)},
              {"accuracy", result.accuracy >= 0 ? json(result.accuracy) : json(nullptr)},
              {"tokens_per_s", result.tokens_per_s},
              {"peak_mem_mib", double(memory_stats(options_.device).peak) / (1024.0 * 1024.0)},
              {"device", options_.device.name()},
              {"ranks", Communicator::world().size()},
              {"zero", options_.zero},
              {"compute_dtype", dtype_name(session_.model->compute_dtype())},
              {"cuda_graph", result.cuda_graph},
              {"documents", data_->documents().empty() ? json(nullptr) : json(data_->documents())},
              {"mfu_peak", peak_name_.empty() ? json(nullptr) : json(peak_name_)},
              {"stopped", result.message}}
      .dump(2);
}

}  // namespace lintape
