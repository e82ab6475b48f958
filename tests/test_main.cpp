// The test runner. CUDA cases carry doctest::skip when no device is found at start (LT_CUDA_CASE), so a
// run reports them as skipped, not passed. Listing names them all the same: ctest's discovery
// (--list-test-cases) then makes a test of each, which it reports as skipped on a machine without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <string>

int main(int argc, char** argv) {
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--list-test-cases" || arg == "-ltc" || arg == "--dt-list-test-cases" || arg == "--dt-ltc")
      context.setOption("no-skip", true);
  }
  return context.run();
}
