// A training run's record: JSONL rows (a row per step, one per validation), progress lines, and at the end
// the summary JSON and the loss SVG next to the JSONL (.summary.json, .svg). Only rank 0 keeps one: the
// others pass an empty path and no progress stream.
#pragma once
#include <cstdint>
#include <fstream>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lintape {

struct StepRow {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, step_ms = 0, peak_mem_mib = 0;
  std::optional<double> mfu;           // null in the row for an unknown peak
  std::vector<double> rank_peak_mibs;  // several ranks: each one's peak; empty on one
  int64_t total_steps = 0;
  double eta_s = 0;
};

class RunLog {
 public:
  // path: the JSONL (empty: none; its folder is made); append: continue an earlier run's log (resume).
  RunLog(const std::string& path, bool append, std::ostream* progress);
  // The step's JSONL row; with `progress_line`, its progress line too.
  void step(const StepRow& row, bool progress_line);
  // A validation's row and line (the trainer calls it only when there is validation data); accuracy < 0:
  // none (left out of the row and the line).
  void validation(int64_t step, double val_loss, double accuracy);
  void message(const std::string& text);  // a progress line
  // The summary (JSON text) and the loss SVG; nothing without a JSONL.
  void finish(const std::string& summary_json);

 private:
  std::string path_;
  std::ofstream jsonl_;
  std::ostream* progress_;
  std::vector<std::pair<int64_t, double>> train_curve_, val_curve_;
};

}  // namespace lintape
