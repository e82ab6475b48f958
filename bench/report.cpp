#include "bench/report.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <fmt/format.h>
#include "train/svg_plot.h"

namespace lintape::bench {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// pandas' float format: six decimals, then the trailing zeros that every value of the column has are
// trimmed (one decimal always stays). NaN prints as NaN.
std::vector<std::string> format_column(const std::vector<double>& values) {
  std::vector<std::string> out;
  size_t trim = 5;
  for (double v : values) {
    if (std::isnan(v)) {
      out.push_back("NaN");
      continue;
    }
    std::string s = fmt::format("{:.6f}", v);
    size_t zeros = 0;
    while (zeros < 5 && s[s.size() - 1 - zeros] == '0') ++zeros;
    trim = std::min(trim, zeros);
    out.push_back(s);
  }
  for (std::string& s : out)
    if (s != "NaN") s.resize(s.size() - trim);
  return out;
}

}  // namespace

double pct_copy(const Table& t, size_t provider, size_t i) {
  double v = t.values[provider][i];
  if (t.floor_ms.empty() || v <= 0) return kNaN;
  return 100.0 * t.floor_ms[i] / v;
}

double tflops(const Table& t, size_t provider, size_t i) {
  double v = t.values[provider][i];
  if (t.flops.empty() || v <= 0) return kNaN;
  return t.flops[i] / (v * 1e9);
}

std::string format_table(const Table& t) {
  std::vector<std::pair<std::string, std::vector<std::string>>> cols;
  std::vector<std::string> xs;
  for (int64_t n : t.ns) xs.push_back(std::to_string(n));
  cols.emplace_back(t.x_name, xs);
  for (size_t p = 0; p < t.providers.size(); ++p) cols.emplace_back(t.providers[p], format_column(t.values[p]));
  auto extra = [&](const char* name, double (*f)(const Table&, size_t, size_t), double scale) {  // one decimal
    std::vector<double> v;
    for (size_t i = 0; i < t.ns.size(); ++i) v.push_back(std::round(f(t, 0, i) * scale * 10) / 10);
    cols.emplace_back(name, format_column(v));
  };
  if (!t.floor_ms.empty()) {
    cols.emplace_back("floor", format_column(t.floor_ms));
    extra("% copy", pct_copy, 1);
  }
  if (!t.flops.empty()) {
    double most = 0;  // NaN (a failed call) compares false and is skipped
    for (size_t i = 0; i < t.ns.size(); ++i) most = std::max(most, tflops(t, 0, i));
    if (most >= 1) extra("TFLOP/s", tflops, 1);
    else extra("GFLOP/s", tflops, 1000);  // TFLOP/s would print 0.0
  }

  size_t index_width = std::to_string(t.ns.empty() ? 0 : t.ns.size() - 1).size();
  std::vector<size_t> widths;
  for (const auto& [name, vals] : cols) {
    size_t w = name.size();
    for (const std::string& v : vals) w = std::max(w, v.size());
    widths.push_back(w);
  }
  std::string out = t.title + " (" + t.unit + "):\n" + std::string(index_width, ' ');
  for (size_t c = 0; c < cols.size(); ++c) out += fmt::format("  {:>{}}", cols[c].first, widths[c]);
  out += "\n";
  for (size_t i = 0; i < t.ns.size(); ++i) {
    out += fmt::format("{:<{}}", i, index_width);
    for (size_t c = 0; c < cols.size(); ++c) out += fmt::format("  {:>{}}", cols[c].second[i], widths[c]);
    out += "\n";
  }
  return out + "\n";
}

std::string format_summary(const std::vector<Table>& speed_tables) {
  struct Group {
    std::string op, mode;
    int64_t n = 0;
    std::vector<double> ms, pct, speedup;
  };
  std::vector<Group> groups;  // in the order the tables ran
  for (const Table& t : speed_tables) {
    if (t.ns.empty() || t.values.empty()) continue;
    auto same = [&](const Group& g) { return g.op == t.op && g.mode == t.mode; };
    auto g = std::find_if(groups.begin(), groups.end(), same);
    if (g == groups.end()) g = groups.insert(groups.end(), Group{t.op, t.mode});
    size_t i = size_t(std::max_element(t.ns.begin(), t.ns.end()) - t.ns.begin());
    g->n = std::max(g->n, t.ns[i]);
    double fused = t.values[0][i];
    if (fused <= 0) continue;  // failed: nothing to say about this table
    g->ms.push_back(fused);
    g->pct.push_back(pct_copy(t, 0, i));
    auto composed = std::find(t.providers.begin(), t.providers.end(), "composed");
    double base = composed == t.providers.end() ? -1 : t.values[size_t(composed - t.providers.begin())][i];
    g->speedup.push_back(base > 0 ? base / fused : kNaN);
  }
  // "lo..hi" over the values that apply, one value when they agree to the printed digits, "-" for none.
  auto range = [](const std::vector<double>& v, int decimals) -> std::string {
    double lo = INFINITY, hi = -INFINITY;
    for (double x : v)
      if (!std::isnan(x)) lo = std::min(lo, x), hi = std::max(hi, x);
    if (lo > hi) return "-";
    std::string a = fmt::format("{:.{}f}", lo, decimals), b = fmt::format("{:.{}f}", hi, decimals);
    return a == b ? a : a + ".." + b;
  };
  std::vector<std::vector<std::string>> rows = {{"op", "dir", "largest n", "fused ms", "% copy", "x composed"}};
  for (const Group& g : groups)
    rows.push_back({g.op, g.mode, std::to_string(g.n), range(g.ms, 3), range(g.pct, 1),
                    range(g.speedup, 2)});
  std::vector<size_t> widths(rows[0].size(), 0);
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); ++c) widths[c] = std::max(widths[c], r[c].size());
  std::string out =
      "summary (ms): each op's speed tables at their largest n; a range over the op's variants; x composed = "
      "composed ms / fused ms\n";
  for (const auto& r : rows) {
    out += fmt::format("{:<{}}", r[0], widths[0]);
    for (size_t c = 1; c < r.size(); ++c) out += fmt::format("  {:>{}}", r[c], widths[c]);
    out += "\n";
  }
  return out;
}

nlohmann::json json_rows(const Table& t, const std::string& device) {
  auto number = [](double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); };
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < t.ns.size(); ++i)
    for (size_t p = 0; p < t.providers.size(); ++p)
      rows.push_back({{"op", t.op},
                      {"title", t.title},
                      {"metric", t.metric},
                      {"mode", t.mode},
                      {"n", t.ns[i]},
                      {"provider", t.providers[p]},
                      {"value", t.values[p][i]},
                      {"unit", t.unit},
                      {"floor_ms", number(t.floor_ms.empty() ? kNaN : t.floor_ms[i])},
                      {"pct_copy", number(pct_copy(t, p, i))},
                      {"tflops", number(tflops(t, p, i))},
                      {"device", device}});
  return rows;
}

std::string svg_plot(const Table& t) {
  double vmin = INFINITY, vmax = 0;
  for (const auto& values : t.values)
    for (double v : values)
      if (v > 0) vmin = std::min(vmin, v), vmax = std::max(vmax, v);
  PlotOptions o;
  o.title = t.title;
  o.x_title = t.x_name;
  o.y_title = t.unit;
  o.x_scale = AxisScale::Log;
  o.y_scale = vmax > 0 && vmax / vmin > 10 ? AxisScale::Log : AxisScale::Linear;
  for (int64_t n : t.ns) o.x_ticks.push_back(double(n));
  std::vector<PlotSeries> series;
  for (size_t p = 0; p < t.providers.size(); ++p) {
    series.push_back({t.providers[p], {}});
    for (size_t i = 0; i < t.ns.size(); ++i)  // NaN for a failed value (-1): it breaks the line
      series.back().points.emplace_back(double(t.ns[i]), t.values[p][i] < 0 ? kNaN : t.values[p][i]);
  }
  return svg_line_plot(series, o);
}

}  // namespace lintape::bench
