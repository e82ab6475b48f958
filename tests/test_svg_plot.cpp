// The SVG line plot of the benchmarks and the training run: polylines, legend, finite coordinates inside
// the picture on either scale, and the run log's loss SVG built on it.
#include <doctest/doctest.h>
#include <cctype>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <regex>
#include <sstream>
#include "train/run_log.h"
#include "train/svg_plot.h"
#include "train_helpers.h"

using namespace lintape;
using lintape::test::TempDir;

namespace {

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The (x, y) pairs of every polyline, each checked finite and inside the picture's width and height.
std::vector<std::vector<std::pair<double, double>>> polylines(const std::string& svg) {
  const std::smatch size = [&] {
    std::smatch m;
    REQUIRE(std::regex_search(svg, m, std::regex("<svg [^>]*width=\"([0-9.]+)\" height=\"([0-9.]+)\"")));
    return m;
  }();
  const double width = std::stod(size[1]), height = std::stod(size[2]);
  std::vector<std::vector<std::pair<double, double>>> lines;
  const std::regex polyline("<polyline points=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), polyline); it != std::sregex_iterator(); ++it) {
    lines.emplace_back();
    std::istringstream points((*it)[1].str());
    std::string pair;
    while (points >> pair) {
      const size_t comma = pair.find(',');
      REQUIRE(comma != std::string::npos);
      const double x = std::stod(pair.substr(0, comma)), y = std::stod(pair.substr(comma + 1));
      CHECK(std::isfinite(x));
      CHECK(std::isfinite(y));
      CHECK((x >= 0 && x <= width && y >= 0 && y <= height));
      lines.back().emplace_back(x, y);
    }
  }
  return lines;
}

void check_no_nan(const std::string& svg) {
  std::string lower;
  for (char c : svg) lower += char(std::tolower(static_cast<unsigned char>(c)));
  CHECK(lower.find("nan") == std::string::npos);
  CHECK(lower.find("inf") == std::string::npos);
}

}  // namespace

TEST_CASE("svg_line_plot: two series give two polylines, a legend and finite coordinates on either scale") {
  const std::vector<PlotSeries> series = {{"fused", {{64, 0.5}, {256, 2.0}, {1024, 9.0}}},
                                          {"composed", {{64, 1.5}, {256, 30.0}, {1024, 120.0}}, false}};
  for (AxisScale scale : {AxisScale::Linear, AxisScale::Log}) {
    PlotOptions o;
    o.title = "speed <fwd>";
    o.x_title = "n";
    o.y_title = "ms";
    o.x_scale = scale;
    o.y_scale = scale;
    const std::string svg = svg_line_plot(series, o);
    CAPTURE(svg);
    CHECK(svg.rfind("<svg ", 0) == 0);
    CHECK(svg.find("</svg>") != std::string::npos);
    const auto lines = polylines(svg);
    REQUIRE(lines.size() == 2);
    CHECK(lines[0].size() == 3);
    CHECK(lines[1].size() == 3);
    CHECK(lines[0][1].first > lines[0][0].first);   // x grows to the right
    CHECK(lines[1][2].second < lines[1][0].second);  // a larger y is higher up
    CHECK(svg.find(">fused</text>") != std::string::npos);
    CHECK(svg.find(">composed</text>") != std::string::npos);
    CHECK(svg.find("speed &lt;fwd&gt;") != std::string::npos);
    CHECK(count(svg, "<circle") == 3);  // markers for the first series only
    CHECK((svg.find("(log scale)") != std::string::npos) == (scale == AxisScale::Log));
    check_no_nan(svg);
  }
}

TEST_CASE("svg_line_plot: empty, one-point, constant and broken series draw without NaN") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (AxisScale scale : {AxisScale::Linear, AxisScale::Log}) {
    PlotOptions o;
    o.x_scale = scale;
    o.y_scale = scale;
    CAPTURE(int(scale));
    check_no_nan(svg_line_plot({}, o));
    const std::string empty = svg_line_plot({{"nothing", {}}}, o);
    CHECK(polylines(empty).empty());
    CHECK(empty.find(">nothing</text>") != std::string::npos);
    check_no_nan(empty);
    for (double y : {0.0, 1.0, 100.0, 3.5}) {  // one point; on a log axis 0 is left out
      const std::string one = svg_line_plot({{"one", {{8, y}}}}, o);
      CHECK(polylines(one).size() == (scale == AxisScale::Log && y == 0 ? 0u : 1u));
      check_no_nan(one);
    }
    const std::string flat = svg_line_plot({{"flat", {{1, 10}, {2, 10}, {4, 10}}}}, o);
    REQUIRE(polylines(flat).size() == 1);
    check_no_nan(flat);
    // a value that cannot be drawn (NaN, infinite, or -1 on a log axis) splits the line in two
    for (double bad : {nan, std::numeric_limits<double>::infinity(), -1.0}) {
      const std::string broken = svg_line_plot({{"broken", {{1, 1}, {2, 2}, {4, bad}, {8, 3}, {16, 4}}}}, o);
      const auto lines = polylines(broken);
      if (scale == AxisScale::Linear && bad == -1.0) {
        CHECK(lines.size() == 1);  // a negative value is drawn on a linear axis
      } else {
        REQUIRE(lines.size() == 2);
        CHECK(lines[0].size() == 2);
        CHECK(lines[1].size() == 2);
      }
      check_no_nan(broken);
    }
  }
}

TEST_CASE("the run log's loss SVG plots the train and validation losses against the step") {
  TempDir dir("svg_plot");
  RunLog log(dir.file("log.jsonl"), false, nullptr);
  for (int64_t step = 1; step <= 5; ++step) {
    StepRow row;
    row.step = step;
    row.loss = 4.0 - 0.5 * double(step);
    log.step(row, false);
    if (step % 2 == 0) log.validation(step, 3.8 - 0.5 * double(step), -1);
  }
  log.finish("{}");
  std::ifstream in(dir.file("log.svg"));
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CAPTURE(svg);
  const auto lines = polylines(svg);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].size() == 5);
  CHECK(lines[1].size() == 2);
  CHECK(lines[0][4].second > lines[0][0].second);  // the loss falls: its line goes down the picture
  CHECK(svg.find(">train</text>") != std::string::npos);
  CHECK(svg.find(">validation</text>") != std::string::npos);
  CHECK(svg.find(">step</text>") != std::string::npos);
  CHECK(svg.find(">loss</text>") != std::string::npos);
  check_no_nan(svg);
}
