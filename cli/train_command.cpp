// `lintape train` and `lintape eval`: train the language model of docs/MODEL.md (train/trainer.h) and measure
// a checkpoint's loss on a file.
#include <cmath>
#include <cstdlib>
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
#include "train/documents.h"
#include "train/trainer.h"

namespace lintape::cli {

namespace {

// The corpus scripts/setup.sh installs (Debian's fortunes package).
constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

struct TrainArgs {
  std::string preset = "auto", config_file, data, val_data, device = "auto", dtype = "auto", mixers, log,
              checkpoint_dir, documents;
  int64_t steps = 0, batch = 0, seq = 0, checkpoint_every = -1, seed = -1, zero = 0, eot_token = kGpt2EndOfText;
  double lr = 0, bucket_mib = 25;
  bool resume = false, no_cuda_graph = false;
  const CLI::App* app = nullptr;  // which options were given
  bool given(const char* name) const { return app->count(name) > 0; }
};

// A --documents value as the config keeps it: "off" is none ("").
std::string documents_setting(const std::string& option) { return option == "off" ? "" : option; }
std::string documents_name(const std::string& setting) { return setting.empty() ? "off" : setting; }

// --documents and --eot-token against the data they would cut: refused where they do not apply.
void check_documents(const std::string& data, const std::string& documents, bool eot_given) {
  if (documents.empty()) {
    if (eot_given) throw UsageError("--eot-token needs --documents (it cuts an llm.c .bin file into documents)");
    return;
  }
  if (data == "mqar")
    throw UsageError("--documents does not apply to mqar: its rows are generated, each one sequence");
  if (is_llmc_bin(data) && documents != "auto")
    throw UsageError(fmt::format("--documents={}: '{}' is an llm.c token file, cut at its end-of-text tokens "
                                 "(--eot-token); give --documents alone",
                                 documents, data));
  if (!is_llmc_bin(data) && eot_given)
    throw UsageError(fmt::format("--eot-token applies to llm.c .bin data; '{}' is text, cut at a separator "
                                 "(--documents=SEP)",
                                 data));
}

// On --resume the checkpoint's config is the run's: --steps extends the run (the cosine decay is stretched to
// the new total from the current step on; a total below the checkpoint's is refused); options that would
// change the data, the model or the schedule's peak are refused when they differ from the checkpoint's,
// naming its value.
TrainConfig resumed_config(const TrainArgs& a) {
  const Checkpoint ckpt = load_checkpoint_state(a.checkpoint_dir);
  TrainConfig c = ckpt.config;
  auto refuse = [&](const char* option, const std::string& given, const std::string& saved) {
    if (given != saved)
      throw UsageError(fmt::format("{} {} differs from the checkpoint's {} ({}); a resumed run keeps the "
                                   "checkpoint's value: leave {} out or start a new run",
                                   option, given, saved, ckpt.path, option));
  };
  if (a.given("--data")) refuse("--data", a.data, c.data);
  if (a.given("--val-data")) refuse("--val-data", a.val_data, c.val_data);
  if (a.given("--batch")) refuse("--batch", std::to_string(a.batch), std::to_string(c.batch));
  if (a.given("--seq")) refuse("--seq", std::to_string(a.seq), std::to_string(c.model.seq_len));
  if (a.given("--lr")) refuse("--lr", fmt::format("{:g}", a.lr), fmt::format("{:g}", c.lr));
  if (a.given("--seed")) refuse("--seed", std::to_string(a.seed), std::to_string(c.seed));
  if (a.given("--mixers"))
    refuse("--mixers", a.mixers, fmt::format("{}", fmt::join(c.model.mixers, ",")));
  if (a.given("--config") || a.given("--preset"))
    throw UsageError("--config and --preset do not apply with --resume: the checkpoint holds the config");
  if (a.given("--documents"))
    refuse("--documents", documents_name(documents_setting(a.documents)), documents_name(c.documents));
  if (a.given("--eot-token")) refuse("--eot-token", std::to_string(a.eot_token), std::to_string(c.eot_token));
  if (a.given("--checkpoint-every"))
    refuse("--checkpoint-every", std::to_string(a.checkpoint_every), std::to_string(c.checkpoint_every));
  if (a.given("--steps")) {
    if (a.steps < c.steps)
      throw UsageError(fmt::format("--steps {} is below the checkpoint's total of {} steps ({}, at step {}); a "
                                   "resumed run can extend its total, not shorten it",
                                   a.steps, c.steps, ckpt.path, ckpt.state.step));
    c.steps = a.steps;
  }
  return c;
}

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
  if (a.resume && a.checkpoint_dir.empty()) throw UsageError("--resume needs --checkpoint-dir");
  TrainConfig c;
  if (a.resume) {
    c = resumed_config(a);
  } else {
    try {
      c = a.config_file.empty() ? TrainConfig::preset(preset) : load_train_config(a.config_file);
    } catch (const Error& e) {
      if (a.config_file.empty()) throw UsageError(e.what());
      throw;
    }
    c.data = a.given("--data") ? a.data : (a.config_file.empty() ? kDefaultCorpus : c.data);
    if (a.given("--val-data")) c.val_data = a.val_data;
    if (a.given("--steps")) c.steps = a.steps;
    if (a.given("--batch")) c.batch = a.batch;
    if (a.given("--seq")) c.model.seq_len = a.seq;
    if (a.given("--lr")) c.lr = a.lr;
    if (a.given("--mixers")) c.model.mixers = ModelConfig::mixers_from_list(a.mixers);
    if (a.given("--checkpoint-every")) c.checkpoint_every = a.checkpoint_every;
    if (a.given("--seed")) c.seed = uint64_t(a.seed);
    if (a.given("--documents")) c.documents = documents_setting(a.documents);
    if (a.given("--eot-token")) c.eot_token = a.eot_token;
    check_documents(c.data, c.documents, a.given("--eot-token"));
  }
  try {
    validate_with_sizes(c);  // every size against overflow and memory, before anything is built
  } catch (const Error& e) {
    const std::string model = a.resume ? "checkpoint's model" : a.config_file.empty() ? preset + " preset" : "config";
    throw UsageError(
        fmt::format("{} (from --batch {}, --seq {} and the {})", e.what(), c.batch, c.model.seq_len, model));
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
  o.cuda_graph = !a.no_cuda_graph;
  const Communicator& comm = Communicator::world();
  const bool leader = comm.rank() == 0;  // rank 0 prints for the job
  // An unwritable or full checkpoint directory is found now, not after the training it would have saved.
  if (leader && !a.checkpoint_dir.empty()) check_checkpoint_dir_writable(a.checkpoint_dir);
  Trainer trainer(c, o);
  if (leader)
    fmt::print("training {} parameters ({}) on {} ({}, {} activations), {} steps of {} x {} tokens{}\n",
               trainer.model().parameter_count(),
               a.resume ? a.checkpoint_dir : a.config_file.empty() ? preset : a.config_file, c.data,
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
  if (leader) {
    if (!r.message.empty()) fmt::print("{}\n", r.message);
    if (!r.losses.empty())
      fmt::print("loss {:.4f} -> {:.4f} over steps {}..{}, {:.0f} tok/s, {:.1f} ms/step, peak {:.0f} MiB{}\n",
                 r.losses.front(), r.losses.back(), r.first_step + 1, r.last_step, r.tokens_per_s, r.step_ms,
                 r.peak_mem_mib, o.device.is_cuda() ? ", CUDA graph " + r.cuda_graph : std::string());
  }
  // The shell's convention for a process ended by a signal, so that a script tells it from a finished run.
  if (r.signal != 0) throw ExitStatus{128 + r.signal};
}

struct EvalArgs {
  std::string checkpoint, data, json_path, device = "auto", dtype = "auto", documents;
  int64_t batches = 16, eot_token = kGpt2EndOfText;
  const CLI::App* app = nullptr;  // which options were given
  bool given(const char* name) const { return app->count(name) > 0; }
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
  // The checkpoint's documents setting unless --documents (or --eot-token) says otherwise.
  const DocumentSplit split{a.given("--documents") ? documents_setting(a.documents) : ckpt.config.documents,
                            a.given("--eot-token") ? a.eot_token : ckpt.config.eot_token};
  check_documents(a.data, split.separator, a.given("--eot-token"));
  std::string how;
  TokenText text = split.on() ? load_documents(a.data, split, ckpt.config.model.vocab_size, &how)
                              : TokenText{load_tokens(a.data, ckpt.config.model.vocab_size), {}};
  TokenData data(text, text, 1, ckpt.config.model.seq_len, a.batches, a.data, 0, how);
  NoGradGuard no_grad;
  double sum = 0;
  for (int64_t i = 0; i < data.validation_batches(); ++i) {
    const Batch b = data.validation(i);
    sum += model.loss(b.tokens.to(device), b.targets.to(device), b.documents.to(device)).item();
  }
  const double loss = sum / double(data.validation_batches());
  if (!std::isfinite(loss))
    fail(fmt::format("[eval] the mean loss of '{}' on {} is {}: the checkpoint's weights overflow on this data",
                     ckpt.path, a.data, loss));
  fmt::print("{}: mean loss {:.4f}, perplexity {:.2f} over {} sequences of {} tokens{}\n", a.data, loss,
             std::exp(loss), data.validation_batches(), ckpt.config.model.seq_len,
             split.on() ? ", documents cut at " + how : std::string());
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << nlohmann::json{{"checkpoint", ckpt.path}, {"data", a.data}, {"loss", loss}, {"perplexity", std::exp(loss)},
                          {"sequences", data.validation_batches()},
                          {"documents", split.on() ? nlohmann::json(how) : nlohmann::json(nullptr)}}
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
  // token at a time. It starts a fresh document: position 0, empty states, as each document of a packed
  // training row does.
  std::vector<int64_t> prompt;
  for (unsigned char c : a.prompt) prompt.push_back(int64_t(c));
  const int64_t n = int64_t(prompt.size());
  // The CPU's prefill runs at a few hundred bytes a second on the default model: say so for a long prompt.
  constexpr int64_t kLongCpuPrompt = 2000;
  if (!device.is_cuda() && n >= kLongCpuPrompt)
    fmt::print(stderr, "a {}-byte prompt on the CPU takes a while (about {} s on 2 cores) before the first token\n",
               n, n / 300 + 1);
  Tensor logits = model.prefill(from_vector_i64(prompt, {1, n}).to(device), state).narrow(1, n - 1, 1);
  std::cout << a.prompt << std::flush;
  for (int64_t i = 0; i < a.tokens; ++i) {
    const std::vector<double> values = logits.to(DType::F64).to_vector<double>();
    const auto bad = std::find_if(values.begin(), values.end(), [](double v) { return !std::isfinite(v); });
    if (bad != values.end()) {
      std::cout << std::endl;
      fail(fmt::format("[generate] the logits of token {} hold {}: the checkpoint '{}' overflows on this text",
                       i + 1, *bad, ckpt.path));
    }
    const int64_t next = sample(values, a.temperature, a.top_k, rng);
    if (bytes)
      std::cout << char(next) << std::flush;
    else
      std::cout << ' ' << next << std::flush;
    logits = model.decode_step(from_vector_i64({next}, {1, 1}).to(device), state);
  }
  std::cout << std::endl;
}

}  // namespace

namespace {
CLI::Validator number_at_least(double min, bool strict, const std::string& words) {
  return CLI::Validator(
      [=](std::string& value) {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        if (end == value.c_str() || *end != '\0') return std::string();  // not a number: the conversion says so
        return (strict ? v > min : v >= min) ? std::string() : words + "; got " + value;
      },
      strict ? "POSITIVE" : "NONNEGATIVE");
}
}  // namespace

namespace {
// --documents takes an optional value: alone it means "auto".
void add_documents_option(CLI::App* sub, std::string& slot, const std::string& help) {
  sub->add_option("--documents", slot, help)->expected(0, 1)->default_str("auto")->option_text("[=SEP|off]");
}
}  // namespace

CLI::Validator positive_number() { return number_at_least(0, true, "must be positive"); }
CLI::Validator non_negative_number() { return number_at_least(0, false, "must not be negative"); }

Command add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub = app.add_subcommand("train", "Train the language model (docs/MODEL.md) on mqar, a text or .bin file");
  sub->add_option("--preset", args->preset,
                  "tiny (CPU, about a minute), small (one GPU), or auto: small on a GPU, tiny on the CPU")
      ->capture_default_str();
  sub->add_option("--config", args->config_file, "a TrainConfig JSON file (instead of a preset)");
  sub->add_option("--data", args->data, std::string("mqar, a text file, a directory of text, or an llm.c .bin; default ") +
                                            kDefaultCorpus);
  sub->add_option("--val-data", args->val_data, "validation file (default: the held-out tail of --data)");
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)")->capture_default_str();
  sub->add_option("--dtype", args->dtype,
                  "activations and matrix products: bf16, f32 or auto (bf16 on CUDA, f32 on the CPU); weights stay f32")
      ->capture_default_str();
  args->app = sub;
  sub->add_option("--steps", args->steps,
                  "optimizer steps in all (default: the preset's, tiny 60, small 1000); with --resume, a larger "
                  "total extends the run and stretches the cosine decay to it")
      ->check(positive_number());
  sub->add_option("--batch", args->batch, "sequences per step (default: the preset's, 8)")
      ->check(positive_number());
  sub->add_option("--seq", args->seq, "tokens per sequence (default: the preset's, 256)")
      ->check(positive_number());
  sub->add_option("--lr", args->lr, "peak learning rate (default: the preset's, tiny 3e-3, small 1e-3)")
      ->check(positive_number());
  sub->add_option("--mixers", args->mixers, "comma-separated mixers per layer: fal, tpa (a shorter list repeats)");
  sub->add_option("--log", args->log, "JSONL log; the summary JSON and loss SVG go next to it");
  sub->add_option("--checkpoint-dir", args->checkpoint_dir, "checkpoint directory");
  sub->add_option("--checkpoint-every", args->checkpoint_every, "steps between checkpoints (default 0: at the end)")
      ->check(non_negative_number());
  sub->add_flag("--resume", args->resume, "continue from the checkpoint directory's latest checkpoint");
  sub->add_option("--seed", args->seed, "seed of the initialisation and the data (default 0)")
      ->check(non_negative_number());
  sub->add_option("--zero", args->zero, "under mpirun: 1 shards the AdamW moments over the ranks (ZeRO-1)")
      ->capture_default_str()
      ->check(CLI::IsMember({0, 1}));
  sub->add_option("--bucket-mib", args->bucket_mib,
                  "under mpirun, without --zero 1: gradient all-reduce buckets (MiB) started during backward; "
                  "0: one, after backward")
      ->capture_default_str()
      ->check(non_negative_number());
  add_documents_option(sub, args->documents,
                       "cut the data into documents and pack the rows with their boundaries (no token sees another "
                       "document, no target crosses one): alone, the fortunes' % lines when the text has them, "
                       "else blank lines, and an llm.c .bin's end-of-text tokens; --documents=SEP cuts text at "
                       "each SEP (\\n for a newline); off: none (default)");
  sub->add_option("--eot-token", args->eot_token,
                  "with --documents on llm.c .bin data: the end-of-text token that starts each document")
      ->capture_default_str()
      ->check(non_negative_number());
  sub->add_flag("--no-cuda-graph", args->no_cuda_graph,
                "on CUDA with one process: run each step eagerly instead of replaying it as a CUDA graph");
  return {sub, [args] { train(*args); }};
}

Command add_eval_command(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* sub = app.add_subcommand("eval", "Mean loss and perplexity of a checkpoint over a file");
  sub->add_option("--checkpoint", args->checkpoint, "checkpoint directory")->required();
  sub->add_option("--data", args->data, "text file, directory of text or llm.c .bin")->required();
  sub->add_option("--batches", args->batches, "sequences to evaluate")->capture_default_str()
      ->check(positive_number());
  sub->add_option("--json", args->json_path, "write the result as JSON");
  add_documents_option(sub, args->documents,
                       "cut the data into documents as train's --documents does (default: as the checkpoint was "
                       "trained); off: none");
  sub->add_option("--eot-token", args->eot_token,
                  "with --documents on llm.c .bin data: the end-of-text token (default: the checkpoint's)")
      ->check(non_negative_number());
  args->app = sub;
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)")->capture_default_str();
  sub->add_option("--dtype", args->dtype, "bf16, f32 or auto (bf16 on CUDA, f32 on the CPU)")->capture_default_str();
  return {sub, [args] { eval(*args); }};
}

Command add_generate_command(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Sample text from a checkpoint, token by token");
  sub->add_option("--checkpoint", args->checkpoint, "checkpoint directory")->required();
  sub->add_option("--prompt", args->prompt, "the text to continue (bytes)")->required();
  sub->add_option("--tokens", args->tokens, "tokens to generate")
      ->capture_default_str()
      ->check(positive_number());
  sub->add_option("--temperature", args->temperature, "sampling temperature (0: greedy)")
      ->capture_default_str()
      ->check(non_negative_number());
  sub->add_option("--top-k", args->top_k, "sample among the k most likely (0: all)")
      ->capture_default_str()
      ->check(non_negative_number());
  sub->add_option("--seed", args->seed, "sampling seed")->capture_default_str();
  sub->add_option("--device", args->device, "cpu, cuda[:N] or auto (the GPU when there is one)")->capture_default_str();
  sub->add_option("--dtype", args->dtype, "bf16, f32 or auto (bf16 on CUDA, f32 on the CPU)")->capture_default_str();
  return {sub, [args] { generate(*args); }};
}

}  // namespace lintape::cli
