// `lintape info` and `lintape --version`: the version, the build, the devices and their allocators.
#include <thread>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include "bench/harness.h"
#include "cli/commands.h"
#include "core/tensor.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape::cli {
namespace {

double mib(size_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

void print_memory(Device d) {
  MemoryStats s = memory_stats(d);
  fmt::print("    allocator: in use {:.1f} MiB, peak {:.1f} MiB, reserved {:.1f} MiB, {} device allocations\n",
             mib(s.in_use), mib(s.peak), mib(s.reserved), s.device_allocs);
}

void info() {
  fmt::print("{}\n", version_string());
#if LINTAPE_WITH_CUDA
  int runtime = 0, driver = 0;
  LT_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  if (cudaDriverGetVersion(&driver) != cudaSuccess) cudaGetLastError();
  // cudaDriverGetVersion gives 0 when no driver is loaded
  std::string driver_text = driver == 0 ? "no driver" : fmt::format("driver {}.{}", driver / 1000, driver % 1000 / 10);
  fmt::print("CUDA: on (runtime {}.{}, {}), {} device(s)\n", runtime / 1000, runtime % 1000 / 10, driver_text,
             cuda_device_count());
#else
  fmt::print("CUDA: off (built without CUDA)\n");
#endif
  for (int i = 0; i < cuda_device_count(); ++i) {
    bench::DeviceInfo d = bench::device_info(Device::cuda(i));
    fmt::print("  cuda:{}: {}, {} SMs, {:.1f} GiB, L2 {:.1f} MiB, compute capability {}.{}\n", i, d.name, d.sms,
               mib(d.memory_bytes) / 1024, mib(d.l2_bytes), d.cc_major, d.cc_minor);
    print_memory(Device::cuda(i));
  }
  bench::DeviceInfo cpu = bench::device_info(Device::cpu());
  fmt::print("  cpu: {}, {} threads, {:.1f} GiB\n", cpu.name, std::thread::hardware_concurrency(),
             mib(cpu.memory_bytes) / 1024);
  print_memory(Device::cpu());
}

}  // namespace

Device device_option(const std::string& name) {
  if (name.empty() || name == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d;
  try {
    d = parse_device(name);
  } catch (const Error& e) {
    throw UsageError(fmt::format("--device {}: {}", name, e.what()));
  }
  if (d.is_cuda() && d.index >= cuda_device_count())
    throw UsageError(fmt::format("--device {}: no such CUDA device; this machine has {}{}", name, cuda_device_count(),
                                 cuda_device_count() == 0 ? " (or lintape was built without CUDA)" : ""));
  return d;
}

std::string version_string() {
#if LINTAPE_WITH_CUDA
  const std::string cuda = fmt::format("CUDA on, architectures {}", LINTAPE_CLI_CUDA_ARCHITECTURES);
#else
  const std::string cuda = "CUDA off";
#endif
  return fmt::format("lintape {} ({}; {})", LINTAPE_CLI_VERSION, LINTAPE_CLI_BUILD_TYPE, cuda);
}

Command add_info_command(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("info", "Version, build, devices and allocator statistics");
  return {sub, [] { info(); }};
}

}  // namespace lintape::cli
