// `lintape train` and `lintape eval`: train the language model of MODEL.md (train/trainer.h) and measure
// a checkpoint's loss on a file.
#include <cmath>
#include <fstream>
#include <memory>
#include <random>
#include <algorithm>
#include <iostream>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include "autograd/tape.h"
#include "cli/commands.h"
#include "train/checkpoint.h"
#include "train/comm.h"
#include "train/config.h"
#include "train/data.h"
#include "train/trainer.h"

namespace lintape::cli {

namespace {

// The corpus scripts/setup.sh installs (Debian's fortunes package).
constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

struct TrainArgs {
  std::string preset = "auto", config_file, data, val_data, device = "auto", dtype = "auto", mixers, log,
              checkpoint_dir;
  int64_t steps = 0, batch = 0, seq = 0, checkpoint_every = -1, seed = -1, zero = 0;
  double lr = 0, bucket_mib = 25;
  bool resume = false;
};

// "auto": bf16 on CUDA, f32 on the CPU (the master weights are f32 either way).
DType parse_compute_dtype(const std::string& text, Device device) {
  if (text == "auto") return default_compute_dtype(device);
  if (text == "bf16") return DType::BF16;
  if (text == "f32") return DType::F32;
  throw UsageError(fmt::format("--dtype must be auto, bf16 or f32; got '{}'", text));
}

void train(const TrainArgs& a) {
  const Device device = device_option(a.device);
  const DType dtype = parse_compute_dtype(a.dtype, device);
  // "auto": small on a GPU, tiny on the CPU.
  const std::string preset = a.preset != "auto" ? a.preset : (device.is_cuda() ? "small" : "tiny");
  TrainConfig c;
  try {
    c = a.config_file.empty() ? TrainConfig::preset(preset) : load_train_config(a.config_file);
  } catch (const Error& e) {
    if (a.config_file.empty()) throw UsageError(e.what());
    throw;
  }
  c.data = !a.data.empty() ? a.data : (a.config_file.empty() ? kDefaultCorpus : c.data);
  if (!a.val_data.empty()) c.val_data = a.val_data;
  if (a.steps != 0) c.steps = a.steps;
  if (a.batch != 0) c.batch = a.batch;
  if (a.seq != 0) c.model.seq_len = a.seq;
  if (a.lr != 0) c.lr = a.lr;
  if (!a.mixers.empty()) c.model.mixers = ModelConfig::mixers_from_list(a.mixers);
  if (a.checkpoint_every >= 0) c.checkpoint_every = a.checkpoint_every;
  if (a.seed >= 0) c.seed = uint64_t(a.seed);
  try {
    c.validate();
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  TrainerOptions o;
  o.device = device;
  o.compute_dtype = dtype;
  o.log_path = a.log;
  o.checkpoint_dir = a.checkpoint_dir;
  o.resume = a.resume;
  o.progress = &std::cout;
  o.zero = int(a.zero);
  o.bucket_mib = a.bucket_mib;
  if (a.resume && a.checkpoint_dir.empty()) throw UsageError("--resume needs --checkpoint-dir");
  Trainer trainer(c, o);
  const Communicator& comm = Communicator::world();
  const bool leader = comm.rank() == 0;  // rank 0 prints for the job
  if (leader)
    fmt::print("training {} parameters ({}) on {} ({}, {} activations), {} steps of {} x {} tokens{}\n",
               trainer.model().parameter_count(), a.config_file.empty() ? preset : a.config_file, c.data,
               comm.distributed() ? fmt::format("{} ranks, {} each", comm.size(), o.device.is_cuda() ? "a GPU" : "the CPU")
                                  : o.device.name(),
               dtype_name(dtype), c.steps, c.batch, c.model.seq_len,
               comm.distributed() ? fmt::format(" (global batch; {} sequences a rank)", c.batch / comm.size()) : "");
  if (leader && trainer.reducer())
    fmt::print("gradients averaged over the ranks in {} bucket{} started during backward\n",
               trainer.reducer()->buckets().size(), trainer.reducer()->buckets().size() == 1 ? "" : "s");
  std::cout << std::flush;
  const TrainResult r = trainer.run();
  if (r.stopped_nonfinite) fail(r.message);
  if (!leader) return;
  if (!r.message.empty()) fmt::print("{}\n", r.message);
  if (!r.losses.empty())
    fmt::print("loss {:.4f} -> {:.4f} over steps {}..{}, {:.0f} tok/s, {:.1f} ms/step, peak {:.0f} MiB\n",
               r.losses.front(), r.losses.back(), r.first_step + 1, r.last_step, r.tokens_per_s, r.step_ms,
               r.peak_mem_mib);
}

struct EvalArgs {
  std::string checkpoint, data, json_path, device = "auto", dtype = "auto";
  int64_t batches = 16;
};

void eval(const EvalArgs& a) {
  if (a.batches <= 0) throw UsageError(fmt::format("--batches must be positive; got {}", a.batches));
  const Device device = device_option(a.device);
  const DType dtype = parse_compute_dtype(a.dtype, device);
  const Checkpoint ckpt = load_checkpoint(a.checkpoint);
  LanguageModel model(ckpt.config.model, ckpt.config.seed);
  model.load_state_dict(ckpt.model, ckpt.path + "/model.safetensors");
  model.to(device);
  model.set_compute_dtype(dtype);
  std::vector<int32_t> tokens = load_tokens(a.data);
  TokenData data(tokens, tokens, 1, ckpt.config.model.seq_len, a.batches, a.data);
  NoGradGuard no_grad;
  double sum = 0;
  for (int64_t i = 0; i < data.validation_batches(); ++i) {
    const Batch b = data.validation(i);
    sum += model.loss(b.tokens.to(device), b.targets.to(device)).item();
  }
  const double loss = sum / double(data.validation_batches());
  fmt::print("{}: mean loss {:.4f}, perplexity {:.2f} over {} sequences of {} tokens\n", a.data, loss, std::exp(loss),
             data.validation_batches(), ckpt.config.model.seq_len);
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << nlohmann::json{{"checkpoint", ckpt.path}, {"data", a.data}, {"loss", loss}, {"perplexity", std::exp(loss)},
                          {"sequences", data.validation_batches()}}
               .dump(2)
        << "\n";
    LT_CHECK(out.good(), "[eval] cannot write '", a.json_path, "'");
  }
}

struct GenerateArgs {
  std::string checkpoint, prompt, device = "auto", dtype = "auto";
  int64_t tokens = 200, top_k = 0;
  double temperature = 0.8;
  uint64_t seed = 0;
};

// Samples from logits (V) with temperature (0: greedy) among the top_k most likely (0: all).
int64_t sample(const std::vector<double>& logits, double temperature, int64_t top_k, std::mt19937_64& rng) {
  std::vector<int64_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
  if (temperature <= 0) return order[0];
  const size_t keep = top_k > 0 ? std::min(order.size(), size_t(top_k)) : order.size();
  std::vector<double> weights(keep);
  for (size_t i = 0; i < keep; ++i)
    weights[i] = std::exp((logits[size_t(order[i])] - logits[size_t(order[0])]) / temperature);
  std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
  return order[pick(rng)];
}

void generate(const GenerateArgs& a) {
  if (a.tokens <= 0) throw UsageError(fmt::format("--tokens must be positive; got {}", a.tokens));
  if (a.prompt.empty()) throw UsageError("--prompt must not be empty");
  const Device device = device_option(a.device);
  const DType dtype = parse_compute_dtype(a.dtype, device);
  const Checkpoint ckpt = load_checkpoint(a.checkpoint);
  LanguageModel model(ckpt.config.model, ckpt.config.seed);
  model.load_state_dict(ckpt.model, ckpt.path + "/model.safetensors");
  model.to(device);
  model.set_compute_dtype(dtype);
  const bool bytes = ckpt.config.model.vocab_size == 256;
  std::mt19937_64 rng(a.seed);
  DecodeState state = model.start_decoding(1);
  // The prompt goes through the whole-sequence ops at once, filling the states and caches; then one
  // token at a time.
  std::vector<int64_t> prompt;
  for (unsigned char c : a.prompt) prompt.push_back(int64_t(c));
  const int64_t n = int64_t(prompt.size());
  Tensor logits = model.prefill(from_vector_i64(prompt, {1, n}).to(device), state).narrow(1, n - 1, 1);
  std::cout << a.prompt << std::flush;
  for (int64_t i = 0; i < a.tokens; ++i) {
    const int64_t next = sample(logits.to(DType::F64).to_vector<double>(), a.temperature, a.top_k, rng);
    if (bytes)
      std::cout << char(next) << std::flush;
    else
      std::cout << ' ' << next << std::flush;
    logits = model.decode_step(from_vector_i64({next}, {1, 1}).to(device), state);
  }
  std::cout << std::endl;
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "Train the language model (MODEL.md) on mqar, a text or .bin file");
  sub->add_option("--preset", args->preset, "tiny (CPU, about a minute), small (one GPU), or auto: small on a GPU, tiny on the CPU");
  sub->add_option("--config", args->config_file, "a TrainConfig JSON file (instead of a preset)");
  sub->add_option("--data", args->data, std::string("mqar, a text file, a directory of text, or an llm.c .bin; default ") +
                                            kDefaultCorpus);
  sub->add_option("--val-data", args->val_data, "validation file (default: the held-out tail of --data)");
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)");
  sub->add_option("--dtype", args->dtype, "activations and matrix products: bf16, f32 or auto (bf16 on CUDA, f32 on the CPU); weights stay f32");
  sub->add_option("--steps", args->steps, "optimizer steps");
  sub->add_option("--batch", args->batch, "sequences per step");
  sub->add_option("--seq", args->seq, "tokens per sequence");
  sub->add_option("--lr", args->lr, "peak learning rate");
  sub->add_option("--mixers", args->mixers, "comma-separated mixers per layer: fal, tpa (a shorter list repeats)");
  sub->add_option("--log", args->log, "JSONL log; the summary JSON and loss SVG go next to it");
  sub->add_option("--checkpoint-dir", args->checkpoint_dir, "checkpoint directory");
  sub->add_option("--checkpoint-every", args->checkpoint_every, "steps between checkpoints (0: at the end)");
  sub->add_flag("--resume", args->resume, "continue from the checkpoint directory's latest checkpoint");
  sub->add_option("--seed", args->seed, "seed of the initialisation and the data");
  sub->add_option("--zero", args->zero, "under mpirun: 1 shards the AdamW moments over the ranks (ZeRO-1)")
      ->check(CLI::IsMember({0, 1}));
  sub->add_option("--bucket-mib", args->bucket_mib,
                  "under mpirun, without --zero 1: gradient all-reduce buckets (MiB) started during backward; 0: one")
      ->check(CLI::NonNegativeNumber);
  return {sub, [args] { train(*args); }};
}

Command add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* sub = app.add_subcommand("eval", "Mean loss and perplexity of a checkpoint over a file");
  sub->add_option("--checkpoint", args->checkpoint, "checkpoint directory")->required();
  sub->add_option("--data", args->data, "text file, directory of text or llm.c .bin")->required();
  sub->add_option("--batches", args->batches, "sequences to evaluate");
  sub->add_option("--json", args->json_path, "write the result as JSON");
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)");
  sub->add_option("--dtype", args->dtype, "bf16, f32 or auto (bf16 on CUDA, f32 on the CPU)");
  return {sub, [args] { eval(*args); }};
}

Command add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Sample text from a checkpoint, token by token");
  sub->add_option("--checkpoint", args->checkpoint, "checkpoint directory")->required();
  sub->add_option("--prompt", args->prompt, "the text to continue (bytes)")->required();
  sub->add_option("--tokens", args->tokens, "tokens to generate");
  sub->add_option("--temperature", args->temperature, "sampling temperature (0: greedy)");
  sub->add_option("--top-k", args->top_k, "sample among the k most likely (0: all)");
  sub->add_option("--seed", args->seed, "sampling seed");
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)");
  sub->add_option("--dtype", args->dtype, "bf16, f32 or auto (bf16 on CUDA, f32 on the CPU)");
  return {sub, [args] { generate(*args); }};
}

}  // namespace lintape::cli
