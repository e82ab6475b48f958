// `lintape bench`: parses the benchmark options, checks them all before anything is measured, and hands
// the run to the harness (bench/harness.h).
#include <memory>
#include <sstream>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include "bench/harness.h"
#include "bench/train_steps.h"
#include "cli/commands.h"
#include "core/tensor.h"

namespace lintape::cli {
namespace {

struct BenchArgs {
  std::string op, device, mode = "all", metric = "all", n, dtype = "bf16", json;
  bool list = false, quick = false, cuda_graph = false;
  int reps = 0;
  int64_t documents = 0;
  bench::TrainBenchOptions train;  // `bench train` only
  std::vector<std::string> train_flags_given;
  bool dtype_given = false;  // bench train: else the training default (bf16 on CUDA, f32 on the CPU)
};

std::vector<int64_t> parse_sizes(const std::string& list) {
  std::vector<int64_t> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || v <= 0)
      throw UsageError(fmt::format("--n takes positive integers separated by commas, like 256,1024; got '{}'", list));
    out.push_back(v);
  }
  if (out.empty()) throw UsageError("--n takes positive integers separated by commas, like 256,1024; got ''");
  return out;
}

void list_benchmarks() {
  for (const bench::Benchmark& b : bench::registry()) {
    std::string providers;
    for (const std::string& p : b.providers) providers += (providers.empty() ? "" : ", ") + p;
    fmt::print("{:<16} {} [{}]\n", b.name, b.about, providers);
  }
  fmt::print("{:<16} {}\n", "train",
             "a training step of the language model: tokens/s, ms/step, MFU, peak MiB (not part of all)");
}

std::vector<const bench::Benchmark*> pick_benchmarks(const std::string& op) {
  std::vector<const bench::Benchmark*> which;
  if (op.empty()) throw UsageError("bench expects a benchmark name, all, or --list");
  if (op == "all") {
    for (const bench::Benchmark& b : bench::registry()) which.push_back(&b);
    return which;
  }
  if (const bench::Benchmark* b = bench::find_benchmark(op)) return {b};
  std::string names;
  for (const bench::Benchmark& r : bench::registry()) names += r.name + ", ";
  throw UsageError(fmt::format("unknown benchmark '{}'; expected one of {}or all (see bench --list)", op, names));
}

void bench_command(const BenchArgs& a) {
  if (a.list) return list_benchmarks();
  if (a.op == "train") {
    if (a.cuda_graph)
      throw UsageError("--cuda-graph is for the ops' tables: bench train replays its step as a CUDA graph already "
                       "(--no-cuda-graph turns that off)");
    bench::TrainBenchOptions train = a.train;
    if (a.dtype_given) train.compute_dtype = dtype_from_name(a.dtype);
    train.document_length = a.documents;
    return bench_train(train, a.device, a.json);
  }
  if (!a.train_flags_given.empty())
    throw UsageError(fmt::format("{} applies to bench train only", a.train_flags_given.front()));
  // Every argument is checked here, before the harness measures anything (it checks --json's paths first).
  bench::RunOptions o;
  std::vector<const bench::Benchmark*> which = pick_benchmarks(a.op);
  o.device = device_option(a.device);
  o.dtype = dtype_from_name(a.dtype);
  o.quick = a.quick;
  o.reps = a.reps;
  o.json_path = a.json;
  o.document_length = a.documents;
  o.cuda_graph = a.cuda_graph;
  if (o.cuda_graph && !o.device.is_cuda())
    throw UsageError(fmt::format("--cuda-graph needs a CUDA device; got {}", o.device.name()));
  if (!a.n.empty()) o.ns = parse_sizes(a.n);
  if (a.mode != "all") o.modes = {a.mode == "fwd" ? bench::Mode::Fwd : bench::Mode::Bwd};
  if (a.metric != "all") o.metrics = {a.metric == "speed" ? bench::Metric::Speed : bench::Metric::Memory};
  bench::run(which, o);
}

// An integer option that must be at least 1. CLI's own range check would print the type's full range.
CLI::Validator at_least_one() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        long long v = 0;
        size_t used = 0;
        try {
          v = std::stoll(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != value.size() || value.empty()) return "must be an integer >= 1; got '" + value + "'";
        return v >= 1 ? std::string() : "must be >= 1; got " + value;
      },
      "INT >= 1", "AT_LEAST_ONE");
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Speed and memory tables of the ops (JSON and SVG with --json)");
  auto a = std::make_shared<BenchArgs>();
  bench->add_option("op", a->op, "A benchmark (see --list) or all");
  bench->add_flag("--list", a->list, "List the benchmarks and their providers");
  bench->add_option("--device", a->device, "cuda, cuda:N or cpu (default: cuda when available)");
  bench->add_option("--mode", a->mode, "fwd, bwd or all")->check(CLI::IsMember({"fwd", "bwd", "all"}));
  bench->add_option("--metric", a->metric, "speed, memory or all")->check(CLI::IsMember({"speed", "memory", "all"}));
  bench->add_option("--n", a->n, "Comma-separated sizes replacing every table's n (or sides), e.g. 256,1024");
  bench->add_option("--dtype", a->dtype, "bf16 or f32 (train: the compute dtype; default bf16 on CUDA, f32 on the CPU)")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->each([a](const std::string&) { a->dtype_given = true; });
  bench->add_option("--json", a->json, "Write JSON rows to FILE and an SVG plot per table into FILE.plots/");
  bench->add_flag("--quick", a->quick, "Fewer sizes and repetitions");
  bench->add_flag("--cuda-graph", a->cuda_graph,
                  "CUDA: time each call replayed from a CUDA graph (the kernels without the host's launch work)");
  bench->add_option("--reps", a->reps, "Least number of timed calls per measurement (default 20; quick: 10, CPU 5)")
      ->check(at_least_one());
  bench->add_option("--documents", a->documents,
                    "Ops that take documents, and train: cut every row into documents of this many tokens "
                    "(default 0: none)")
      ->check(CLI::NonNegativeNumber);
  // `bench train`: the model's options (bench/train_steps.h).
  for (auto [flag, what] : {std::pair{"--preset", "train: tiny or small (default small)"},
                            {"--mixers", "train: comma-separated mixers per layer, fal or tpa"}}) {
    std::string& slot = std::string(flag) == "--preset" ? a->train.preset : a->train.mixers;
    bench->add_option(flag, slot, what)->each([a, flag = std::string(flag)](const std::string&) {
      a->train_flags_given.push_back(flag);
    });
  }
  for (auto [flag, slot, what] :
       {std::tuple{"--batch", &a->train.batch, "train: sequences per step (default 16)"},
        {"--seq", &a->train.seq, "train: tokens per sequence (default: the preset's)"},
        {"--vocab", &a->train.vocab, "train: vocabulary size (default 32768)"},
        {"--steps", &a->train.steps, "train: timed steps (default 10)"},
        {"--warmup", &a->train.warmup, "train: untimed steps first (default 3; 0 allowed)"}})
    bench->add_option(flag, *slot, what)
        ->check(std::string(flag) == "--warmup" ? CLI::Validator(CLI::NonNegativeNumber) : at_least_one())
        ->each([a, flag = std::string(flag)](const std::string&) { a->train_flags_given.push_back(flag); });
  bench->add_flag_callback(
      "--no-cuda-graph",
      [a] {
        a->train.cuda_graph = false;
        a->train_flags_given.push_back("--no-cuda-graph");
      },
      "train: run each step eagerly instead of replaying it as a CUDA graph (CUDA)");
  return {bench, [a] { bench_command(*a); }};
}

}  // namespace lintape::cli
