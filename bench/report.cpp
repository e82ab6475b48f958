#include "bench/report.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <fmt/format.h>

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

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

// The smallest of 1, 2, 5 times a power of ten that is >= x.
double nice_step(double x) {
  double p = std::pow(10.0, std::floor(std::log10(x)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= x * (1 - 1e-9)) return m * p;
  return 10 * p;
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
  const double width = 760, height = 460, left = 80, right = 190, top = 48, bottom = 60;
  const double pw = width - left - right, ph = height - top - bottom;
  static const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                 "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

  double nmin = t.ns.empty() ? 1 : double(*std::min_element(t.ns.begin(), t.ns.end()));
  double nmax = t.ns.empty() ? 2 : double(*std::max_element(t.ns.begin(), t.ns.end()));
  double x0 = std::log2(std::max(nmin, 1.0)), x1 = std::log2(std::max(nmax, 1.0));
  x0 -= 0.3, x1 += 0.3;  // keep the end points off the frame

  double vmin = INFINITY, vmax = 0;
  for (const auto& series : t.values)
    for (double v : series)
      if (v > 0) vmin = std::min(vmin, v), vmax = std::max(vmax, v);
  bool any = vmax > 0;
  bool log_y = any && vmax / vmin > 10;
  auto valid = [&](double v) { return log_y ? v > 0 : v >= 0; };
  double y0 = 0, y1 = 1, step = 0.2;  // linear axis by default
  if (log_y) {
    y0 = std::floor(std::log10(vmin));
    y1 = std::ceil(std::log10(vmax));
  } else if (any) {
    step = nice_step(vmax / 5);
    y1 = std::ceil(vmax / step * (1 - 1e-9)) * step;
  }
  auto X = [&](double n) { return left + (std::log2(n) - x0) / (x1 - x0) * pw; };
  auto Y = [&](double v) {
    double f = log_y ? (std::log10(v) - y0) / (y1 - y0) : (v - y0) / (y1 - y0);
    return top + ph - f * ph;
  };

  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" text-anchor=\"middle\" font-size=\"13\">{3}</text>\n",
      width, height, left + pw / 2, xml_escape(t.title));

  // y ticks and grid: decades (with 2 and 5 when the axis spans at most two) or a linear step
  std::vector<double> yticks;
  if (log_y) {
    for (double d = y0; d <= y1 + 1e-9; d += 1)
      for (double m : {1.0, 2.0, 5.0})
        if (m == 1.0 || y1 - y0 <= 2) {
          double v = m * std::pow(10.0, d);
          if (std::log10(v) <= y1 + 1e-9) yticks.push_back(v);
        }
  } else {
    for (double v = y0; v <= y1 + step * 1e-6; v += step) yticks.push_back(v);
  }
  for (double v : yticks) {
    double y = Y(v);
    s += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5:g}</text>\n",
        left, y, left + pw, left - 6, y + 4, v);
  }
  for (int64_t n : t.ns) {
    double x = X(double(n));
    s += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        x, top, top + ph, top + ph + 16, n);
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"black\"/>\n", left,
                   top, pw, ph);
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{} (log2 scale)</text>\n", left + pw / 2,
                   height - 16, xml_escape(t.x_name));
  s += fmt::format(
      "<text x=\"18\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 18 {0})\">{1}{2}</text>\n",
      top + ph / 2, xml_escape(t.unit), log_y ? " (log scale)" : "");

  for (size_t p = 0; p < t.providers.size(); ++p) {
    const char* color = colors[p % 8];
    std::string points;
    auto flush = [&] {
      if (!points.empty())
        s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", points,
                         color);
      points.clear();
    };
    for (size_t i = 0; i < t.ns.size(); ++i) {
      double v = t.values[p][i];
      if (!valid(v)) {
        flush();  // a failed value breaks the line
        continue;
      }
      double x = X(double(t.ns[i])), y = Y(v);
      points += fmt::format("{}{:.1f},{:.1f}", points.empty() ? "" : " ", x, y);
      s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", x, y, color);
    }
    flush();
    double ly = top + 12 + 20 * double(p), lx = left + pw + 16;
    s += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>\n"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n",
        lx, ly, lx + 24, color, lx + 30, ly + 4, xml_escape(t.providers[p]));
  }
  return s + "</svg>\n";
}

}  // namespace lintape::bench
