#include "train/run_log.h"

#include <filesystem>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <ostream>
#include "core/error.h"
#include "train/progress.h"
#include "train/svg_plot.h"

namespace lintape {

using nlohmann::json;

namespace {

std::string sibling(const std::string& log_path, const std::string& suffix) {
  const size_t dot = log_path.rfind(".jsonl");
  return (dot == std::string::npos ? log_path : log_path.substr(0, dot)) + suffix;
}

// Loss against step, linear axes: the train loss as a line, the validation losses with a dot each.
void write_svg(const std::string& path, const std::vector<std::pair<int64_t, double>>& train,
               const std::vector<std::pair<int64_t, double>>& val) {
  std::vector<PlotSeries> series;
  auto add = [&](const char* name, const std::vector<std::pair<int64_t, double>>& curve, bool markers) {
    series.push_back({name, {}, markers});
    for (const auto& [step, loss] : curve) series.back().points.emplace_back(double(step), loss);
  };
  add("train", train, false);
  if (!val.empty()) add("validation", val, true);
  PlotOptions o;
  o.title = "loss against step";
  o.x_title = "step";
  o.y_title = "loss";
  std::ofstream out(path);
  out << svg_line_plot(series, o);
}

}  // namespace

RunLog::RunLog(const std::string& path, bool append, std::ostream* progress) : path_(path), progress_(progress) {
  if (path_.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) {
    std::error_code ignored;  // an unwritable place shows as the open failure below
    std::filesystem::create_directories(parent, ignored);
  }
  jsonl_.open(path_, append ? std::ios::app : std::ios::trunc);
  LT_CHECK(jsonl_.good(), "[train] cannot write the log '", path_, "'");
}

void RunLog::step(const StepRow& r, bool progress_line) {
  train_curve_.emplace_back(r.step, r.loss);
  if (jsonl_.is_open()) {
    json row{{"step", r.step},           {"loss", r.loss},
             {"lr", r.lr},               {"grad_norm", r.grad_norm},
             {"tokens_per_s", r.tokens_per_s}, {"step_ms", r.step_ms},
             {"peak_mem_mib", r.peak_mem_mib}, {"mfu", r.mfu ? json(*r.mfu) : json(nullptr)}};
    if (!r.rank_peak_mibs.empty()) row["peak_mem_mib_per_rank"] = r.rank_peak_mibs;
    jsonl_ << row.dump() << std::endl;  // a row per line as it happens: the log can be followed
  }
  if (progress_ && progress_line) {
    *progress_ << "step " << r.step << "/" << r.total_steps << "  loss " << std::fixed << std::setprecision(4)
               << r.loss << "  " << std::setprecision(0) << r.tokens_per_s << " tok/s  " << std::setprecision(1)
               << r.step_ms << " ms/step  peak " << r.peak_mem_mib << " MiB  ETA " << format_duration(r.eta_s)
               << std::defaultfloat << std::endl;
  }
}

void RunLog::validation(int64_t step, double val_loss, double accuracy) {
  val_curve_.emplace_back(step, val_loss);
  json row{{"step", step}, {"val_loss", val_loss}};
  if (accuracy >= 0) row["accuracy"] = accuracy;
  if (jsonl_.is_open()) jsonl_ << row.dump() << "\n";
  if (progress_)
    *progress_ << "step " << step << "  val_loss " << std::setprecision(4) << val_loss
               << (accuracy >= 0 ? str("  accuracy ", accuracy) : std::string()) << std::endl;
}

void RunLog::message(const std::string& text) {
  if (progress_) *progress_ << text << "\n";
}

void RunLog::finish(const std::string& summary_json) {
  if (!jsonl_.is_open()) return;
  std::ofstream summary(sibling(path_, ".summary.json"));
  summary << summary_json << "\n";
  write_svg(sibling(path_, ".svg"), train_curve_, val_curve_);
}

}  // namespace lintape
