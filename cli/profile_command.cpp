// `lintape profile`: where a training step's time and memory go, per layer kind (bench/train_steps.h),
// and `lintape bench train`'s run (called from cli/bench_command.cpp).
#include <fstream>
#include <map>
#include <memory>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include "bench/harness.h"
#include "bench/train_steps.h"
#include "cli/commands.h"

namespace lintape::cli {

namespace {

struct ProfileArgs {
  bench::TrainBenchOptions train;
  std::string device, json, dtype;
  bool per_layer = false;
};

std::string describe(const bench::TrainSetup& s) {
  const ModelConfig& c = s.model->config();
  std::string mixers;
  for (const std::string& m : c.mixers) mixers += (mixers.empty() ? "" : ",") + m;
  const bench::DeviceInfo info = bench::device_info(s.options.device);
  const std::string docs = s.options.document_length > 0
                               ? fmt::format(", documents of {} tokens", s.options.document_length)
                               : std::string();
  return fmt::format("{} ({:.1f} M parameters, mixers {}), batch {} x {}{}, vocab {}, {} on {} ({})", s.options.preset,
                     double(s.params) / 1e6, mixers, s.options.batch, c.seq_len, docs, c.vocab_size,
                     dtype_name(s.model->compute_dtype()), s.options.device.name(), info.name);
}

void write_json(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  out << doc.dump(1) << "\n";
  LT_CHECK(out.good(), "[profile] cannot write '", path, "'");
}

void profile(ProfileArgs a) {
  a.train.device = device_option(a.device);
  if (!a.dtype.empty()) a.train.compute_dtype = dtype_from_name(a.dtype);
  if (!a.json.empty()) {  // checked before the measurement
    std::ofstream probe(a.json);
    LT_CHECK(probe.is_open(), "[profile] cannot write --json ", a.json, ": ", std::strerror(errno));
  }
  bench::TrainSetup s = bench::make_train_setup(a.train);
  fmt::print("profile of a training step: {}; medians of {} steps after {} warm-up\n", describe(s), a.train.steps,
             a.train.warmup);
  const bench::ProfileResult r = bench::profile_train_step(s);

  struct Sum {
    int count = 0;
    double fwd = 0, bwd = 0, act = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Sum> kinds;
  for (const bench::ProfileRow& row : r.rows) {
    if (!kinds.count(row.kind)) order.push_back(row.kind);
    Sum& k = kinds[row.kind];
    ++k.count;
    k.fwd += row.fwd_ms;
    k.bwd += row.bwd_ms;
    k.act += row.activation_mib;
  }
  fmt::print("{:<26} {:>6} {:>10} {:>10} {:>7} {:>17}\n", "part", "count", "fwd ms", "bwd ms", "share",
             "activations MiB");
  auto line = [&](const std::string& name, int count, double fwd, double bwd, double act) {
    fmt::print("{:<26} {:>6} {:>10.3f} {:>10.3f} {:>6.1f}% {:>17.1f}\n", name, count, fwd, bwd,
               100.0 * (fwd + bwd) / r.parts_ms, act);
  };
  for (const std::string& k : order) line(k, kinds[k].count, kinds[k].fwd, kinds[k].bwd, kinds[k].act);
  if (a.per_layer) {
    fmt::print("\nper layer:\n");
    for (const bench::ProfileRow& row : r.rows) line(row.part, 1, row.fwd_ms, row.bwd_ms, row.activation_mib);
  }
  fmt::print("sum of the parts {:.2f} ms; a whole step timed alone {:.2f} ms (parts / step {:.1f}%); peak {:.0f} MiB\n",
             r.parts_ms, r.step_ms, 100.0 * r.parts_ms / r.step_ms, r.peak_mib);
  // Where each kind's time goes, by op: the largest first, those over 1% of the parts' sum.
  fmt::print("\nby op (ms per step; ops of over 1% of the step):\n{:<26} {:<22} {:>6} {:>10} {:>10} {:>7}\n", "part",
             "op", "calls", "fwd ms", "bwd ms", "share");
  for (const bench::ProfileOpRow& op : r.ops)
    if (op.fwd_ms + op.bwd_ms >= 0.01 * r.parts_ms)
      fmt::print("{:<26} {:<22} {:>6} {:>10.3f} {:>10.3f} {:>6.1f}%\n", op.kind, op.op, op.calls, op.fwd_ms, op.bwd_ms,
                 100.0 * (op.fwd_ms + op.bwd_ms) / r.parts_ms);
  if (a.json.empty()) return;
  nlohmann::json ops = nlohmann::json::array();
  for (const bench::ProfileOpRow& op : r.ops)
    ops.push_back({{"kind", op.kind}, {"op", op.op}, {"calls", op.calls}, {"fwd_ms", op.fwd_ms}, {"bwd_ms", op.bwd_ms}});
  nlohmann::json rows = nlohmann::json::array(), by_kind = nlohmann::json::array();
  for (const bench::ProfileRow& row : r.rows)
    rows.push_back({{"part", row.part}, {"kind", row.kind}, {"fwd_ms", row.fwd_ms}, {"bwd_ms", row.bwd_ms},
                    {"activation_mib", row.activation_mib}});
  for (const std::string& k : order)
    by_kind.push_back({{"kind", k}, {"count", kinds[k].count}, {"fwd_ms", kinds[k].fwd}, {"bwd_ms", kinds[k].bwd},
                       {"share", (kinds[k].fwd + kinds[k].bwd) / r.parts_ms}, {"activation_mib", kinds[k].act}});
  write_json(a.json, {{"model", describe(s)}, {"steps", a.train.steps}, {"parts_ms", r.parts_ms},
                      {"step_ms", r.step_ms}, {"peak_mib", r.peak_mib}, {"kinds", by_kind}, {"layers", rows},
                      {"ops", ops}});
}

void add_model_options(CLI::App* sub, bench::TrainBenchOptions& o, std::string& device) {
  sub->add_option("--preset", o.preset, "tiny or small (default small)")->check(CLI::IsMember({"tiny", "small"}));
  sub->add_option("--mixers", o.mixers, "comma-separated mixers per layer: fal, tpa (default: the preset's)");
  sub->add_option("--batch", o.batch, "sequences per step (default 16)")->check(CLI::PositiveNumber);
  sub->add_option("--seq", o.seq, "tokens per sequence (default: the preset's)")->check(CLI::PositiveNumber);
  sub->add_option("--vocab", o.vocab, "vocabulary size (default 32768, docs/MODEL.md's benchmark)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--steps", o.steps, "timed steps (default 10)")->check(positive_number());
  sub->add_option("--warmup", o.warmup, "untimed steps first (default 3)")->check(CLI::NonNegativeNumber);
  sub->add_option("--device", device, "cuda, cuda:N or cpu (default: cuda when available)");
}

}  // namespace

void bench_train(bench::TrainBenchOptions o, const std::string& device, const std::string& json) {
  o.device = device_option(device);
  if (!json.empty()) {
    std::ofstream probe(json);
    LT_CHECK(probe.is_open(), "[bench train] cannot write --json ", json, ": ", std::strerror(errno));
  }
  bench::TrainSetup s = bench::make_train_setup(o);
  fmt::print("bench train: {}; medians of {} steps after {} warm-up\n", describe(s), o.steps, o.warmup);
  const bench::TrainBenchResult r = bench::bench_train(s);
  const std::string mfu = r.mfu >= 0 ? fmt::format("{:.1f}%", 100.0 * r.mfu) : std::string("n/a");
  fmt::print("{:>12} {:>10} {:>7} {:>10} {:>10}\n", "tokens/s", "ms/step", "MFU", "peak MiB", "loss");
  fmt::print("{:>12.0f} {:>10.2f} {:>7} {:>10.0f} {:>10.4f}\n", r.tokens_per_s, r.step_ms, mfu, r.peak_mib, r.last_loss);
  fmt::print("MFU: 6 x parameters x tokens + the mixers' token mixing, over {}\n",
             r.peak_source.empty() ? std::string("no known peak (CPU)") : r.peak_source);
  if (!r.cuda_graph.empty()) fmt::print("CUDA graph: {}\n", r.cuda_graph);
  if (!json.empty())
    write_json(json, {{"model", describe(s)}, {"params", r.params}, {"tokens_per_step", r.tokens_per_step},
                      {"tokens_per_s", r.tokens_per_s}, {"step_ms", r.step_ms},
                      {"mfu", r.mfu >= 0 ? nlohmann::json(r.mfu) : nlohmann::json()}, {"peak_mib", r.peak_mib},
                      {"peak_source", r.peak_source}, {"loss", r.last_loss},
                      {"cuda_graph", r.cuda_graph.empty() ? nlohmann::json() : nlohmann::json(r.cuda_graph)}});
}

Command add_profile_command(CLI::App& app) {
  auto a = std::make_shared<ProfileArgs>();
  CLI::App* sub = app.add_subcommand("profile", "Where a training step's time and memory go, per layer kind");
  add_model_options(sub, a->train, a->device);
  sub->add_option("--json", a->json, "write the tables as JSON");
  sub->add_flag("--per-layer", a->per_layer, "also print every layer's row");
  sub->add_option("--documents", a->train.document_length,
                  "cut every row into documents of this many tokens, passed to every mixer (default 0: none)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--dtype", a->dtype, "the compute dtype: bf16 or f32 (default bf16 on CUDA, f32 on the CPU)")
      ->check(CLI::IsMember({"bf16", "f32"}));
  return {sub, [a] { profile(*a); }};
}

}  // namespace lintape::cli
