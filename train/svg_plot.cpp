#include "train/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <fmt/format.h>

namespace lintape {
namespace {

constexpr const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                   "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

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

// Whole numbers as integers (an x axis of sizes reads 1048576, not 1.04858e+06); others in %g.
std::string label(double v) {
  if (v == std::round(v) && std::abs(v) < 1e15) return fmt::format("{}", int64_t(v));
  return fmt::format("{:g}", v);
}

bool drawable(double v, AxisScale scale) { return std::isfinite(v) && (scale == AxisScale::Linear || v > 0); }

// One axis: its range in axis units (the value, or its log2 on x and log10 on y) and its ticks as values.
struct Axis {
  AxisScale scale = AxisScale::Linear;
  bool is_x = true;
  double lo = 0, hi = 1;
  std::vector<double> ticks;

  double unit(double v) const {
    if (scale == AxisScale::Linear) return v;
    return is_x ? std::log2(v) : std::log10(v);
  }
  double fraction(double v) const { return (unit(v) - lo) / (hi - lo); }
};

// `values`: the drawable coordinates of this axis over all series (and the x ticks asked for).
Axis make_axis(AxisScale scale, bool is_x, const std::vector<double>& values, const std::vector<double>& ticks) {
  Axis a;
  a.scale = scale;
  a.is_x = is_x;
  const bool any = !values.empty();
  const double vmin = any ? *std::min_element(values.begin(), values.end()) : 0;
  const double vmax = any ? *std::max_element(values.begin(), values.end()) : 0;
  if (scale == AxisScale::Linear) {
    const double low = std::min(vmin, 0.0), high = std::max(vmax, 0.0);
    double step = 0.2;  // an axis of zeros only, or of nothing: 0 to 1
    if (high > low) {
      step = nice_step((high - low) / 5);
      a.lo = low < 0 ? -std::ceil(-low / step * (1 - 1e-9)) * step : 0;
      a.hi = high > 0 ? std::ceil(high / step * (1 - 1e-9)) * step : 0;
    }
    const int64_t count = int64_t(std::llround((a.hi - a.lo) / step));
    for (int64_t i = 0; i <= count; ++i) a.ticks.push_back(a.lo + double(i) * step);
  } else if (is_x) {
    const double nmin = any ? vmin : 1, nmax = any ? vmax : 2;
    a.lo = std::log2(nmin) - 0.3, a.hi = std::log2(nmax) + 0.3;  // keep the end points off the frame
    const double first = std::ceil(a.lo), last = std::floor(a.hi);
    const double every = std::max(1.0, std::ceil((last - first + 1) / 10));  // at most 10 powers of two
    for (double e = first; e <= last; e += every) a.ticks.push_back(std::exp2(e));
  } else {
    a.lo = any ? std::floor(std::log10(vmin)) : 0;
    a.hi = any ? std::ceil(std::log10(vmax)) : 1;
    if (a.hi <= a.lo) a.hi = a.lo + 1;  // every value the same power of ten
    // decades, with 2 and 5 when the axis spans at most two
    for (double d = a.lo; d <= a.hi + 1e-9; d += 1)
      for (double m : {1.0, 2.0, 5.0})
        if (m == 1.0 || a.hi - a.lo <= 2) {
          double v = m * std::pow(10.0, d);
          if (std::log10(v) <= a.hi + 1e-9) a.ticks.push_back(v);
        }
  }
  if (!ticks.empty()) {
    a.ticks.clear();
    for (double t : ticks)
      if (drawable(t, scale)) a.ticks.push_back(t);
  }
  return a;
}

}  // namespace

std::string svg_line_plot(const std::vector<PlotSeries>& series, const PlotOptions& o) {
  const double width = 760, height = 460, left = 80, right = 190, top = 48, bottom = 60;
  const double pw = width - left - right, ph = height - top - bottom;

  auto drawn = [&](const std::pair<double, double>& p) {
    return drawable(p.first, o.x_scale) && drawable(p.second, o.y_scale);
  };
  std::vector<double> xs, ys;
  for (const PlotSeries& s : series)
    for (const auto& p : s.points)
      if (drawn(p)) xs.push_back(p.first), ys.push_back(p.second);
  for (double x : o.x_ticks)
    if (drawable(x, o.x_scale)) xs.push_back(x);
  const Axis ax = make_axis(o.x_scale, true, xs, o.x_ticks);
  const Axis ay = make_axis(o.y_scale, false, ys, {});
  auto X = [&](double x) { return left + ax.fraction(x) * pw; };
  auto Y = [&](double y) { return top + ph - ay.fraction(y) * ph; };

  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" text-anchor=\"middle\" font-size=\"13\">{3}</text>\n",
      width, height, left + pw / 2, xml_escape(o.title));
  for (double v : ay.ticks) {
    double y = Y(v);
    s += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{3}\" y=\"{4:.1f}\" text-anchor=\"end\">{5}</text>\n",
        left, y, left + pw, left - 6, y + 4, label(v));
  }
  for (double v : ax.ticks) {
    double x = X(v);
    s += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        x, top, top + ph, top + ph + 16, label(v));
  }
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"black\"/>\n", left,
                   top, pw, ph);
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}{}</text>\n", left + pw / 2, height - 16,
                   xml_escape(o.x_title), o.x_scale == AxisScale::Log ? " (log2 scale)" : "");
  s += fmt::format(
      "<text x=\"18\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 18 {0})\">{1}{2}</text>\n",
      top + ph / 2, xml_escape(o.y_title), o.y_scale == AxisScale::Log ? " (log scale)" : "");

  for (size_t i = 0; i < series.size(); ++i) {
    const char* color = kColors[i % std::size(kColors)];
    std::string points;
    auto flush = [&] {
      if (!points.empty())
        s += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", points,
                         color);
      points.clear();
    };
    for (const auto& p : series[i].points) {
      if (!drawn(p)) {
        flush();
        continue;
      }
      double x = X(p.first), y = Y(p.second);
      points += fmt::format("{}{:.1f},{:.1f}", points.empty() ? "" : " ", x, y);
      if (series[i].markers)
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", x, y, color);
    }
    flush();
    double ly = top + 12 + 20 * double(i), lx = left + pw + 16;
    s += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>\n"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n",
        lx, ly, lx + 24, color, lx + 30, ly + 4, xml_escape(series[i].name));
  }
  return s + "</svg>\n";
}

}  // namespace lintape
