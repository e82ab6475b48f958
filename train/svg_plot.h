// A line plot as SVG text, for the benchmarks' plots and the training run's loss curve: named series of
// (x, y) points, axis titles, ticks with a grid, and a legend. Internal: not installed.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace lintape {

enum class AxisScale { Linear, Log };  // Log: base 2 on the x axis, base 10 on the y axis

struct PlotSeries {
  std::string name;                             // its legend entry
  std::vector<std::pair<double, double>> points;  // (x, y) in drawing order
  bool markers = true;                          // a dot at each point
};

struct PlotOptions {
  std::string title, x_title, y_title;  // the axis titles get " (log2 scale)" / " (log scale)" on a log axis
  AxisScale x_scale = AxisScale::Linear;
  AxisScale y_scale = AxisScale::Linear;
  std::vector<double> x_ticks;  // labelled x positions, within the axis; empty: chosen from its range
};

// A point with a coordinate that is not finite, or not positive on a log axis, is left out and breaks its
// series' line. A linear axis always reaches zero, so that the heights compare; a log axis spans whole
// decades (y) or the points' range with a margin (x). Every series has a legend entry, even an empty one.
std::string svg_line_plot(const std::vector<PlotSeries>& series, const PlotOptions& options);

}  // namespace lintape
