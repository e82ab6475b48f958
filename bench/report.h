// Report formats of one measured table: the seeds' pandas-like text table, JSON rows and an SVG plot.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

namespace lintape::bench {

struct Table {
  std::string op;      // benchmark name, "lrpe-cosine"
  std::string title;   // "lrpe_cosine-speed-fwd-batch12-head12-dim128-act_none-bf16"
  std::string metric;  // "speed" or "memory"
  std::string mode;    // "fwd" or "bwd"
  std::string unit;    // "ms" or "MiB"
  std::string x_name;  // "n"
  std::vector<int64_t> ns;
  std::vector<std::string> providers;
  std::vector<std::vector<double>> values;  // [provider][n]; -1 where the provider failed
  std::vector<double> floor_ms;             // [n] speed tables of memory-bound ops; else empty
  std::vector<double> flops;                // [n] speed tables of compute-bound ops; else empty
};

// Percent of copy bandwidth (floor / time) and TFLOP/s of one value; NaN where it does not apply.
double pct_copy(const Table& t, size_t provider, size_t i);
double tflops(const Table& t, size_t provider, size_t i);

// "<title> (<unit>):" then the table: an index column, n as an integer, one column per provider, and for
// the first provider `floor` and `% copy` (memory-bound) or `TFLOP/s` (compute-bound; `GFLOP/s` when
// every value is under 1 TFLOP/s). Ends with a blank line.
std::string format_table(const Table& t);

// One screen over the speed tables of a run: per op and direction, the largest n, the first (fused)
// provider's ms, its % of copy and its speed-up over `composed`, each at a table's largest n; a range
// "lo..hi" when the op has several tables for the direction (its variants).
std::string format_summary(const std::vector<Table>& speed_tables);

// One object per (n, provider): op, title, metric, mode, n, provider, value, unit, floor_ms,
// pct_copy, tflops (null where they do not apply), device.
nlohmann::json json_rows(const Table& t, const std::string& device);

// Value against n (log2 x axis; log10 y axis when the values span more than a decade), one polyline
// per provider with a legend. Failed values (-1) are left out.
std::string svg_plot(const Table& t);

}  // namespace lintape::bench
