// Messages a user of the tool meets first: the tensor factories name themselves when a size is wrong.
// The command line itself (exit statuses, option errors, --json outputs) is tested by tests/cli/run_cli.cmake.
#include <doctest/doctest.h>
#include "core/tensor.h"
#include "helpers.h"

using namespace lintape;
using lintape::test::check_throws_containing;

TEST_CASE("bad input factory of a negative size names the factory called") {
  const Device cpu = Device::cpu();
  check_throws_containing([&] { randn({2, -3}, DType::F32, cpu, 1); }, {"[randn]", "sizes must be >= 0", "(2, -3)"});
  check_throws_containing([&] { rand({-1}, DType::F32, cpu, 1); }, {"[rand]", "sizes must be >= 0", "(-1)"});
  check_throws_containing([&] { zeros({-4, 2}, DType::F32, cpu); }, {"[zeros]", "sizes must be >= 0", "(-4, 2)"});
  check_throws_containing([&] { ones({-1}, DType::F32, cpu); }, {"[ones]", "sizes must be >= 0"});
  check_throws_containing([&] { full({-1}, 2.0, DType::F32, cpu); }, {"[full]", "sizes must be >= 0"});
  check_throws_containing([&] { empty({-1}, DType::F32, cpu); }, {"[empty]", "sizes must be >= 0"});
}
