// The lintape command-line tool: `lintape info` and `lintape bench`. Library code throws lintape::Error;
// this is the one place that turns it into "error: <message>" and exit status 1.
#include <cstdio>
#include <sstream>
#include <thread>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include "bench/harness.h"
#include "core/tensor.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif


namespace lintape {
namespace {

double mib(size_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

void print_memory(Device d) {
  MemoryStats s = memory_stats(d);
  fmt::print("    allocator: in use {:.1f} MiB, peak {:.1f} MiB, reserved {:.1f} MiB, {} device allocations\n",
             mib(s.in_use), mib(s.peak), mib(s.reserved), s.device_allocs);
}

void info() {
  fmt::print("lintape {}\n", LINTAPE_VERSION);
  fmt::print("build: {}\n", LINTAPE_BUILD_TYPE);
#if LINTAPE_WITH_CUDA
  int runtime = 0, driver = 0;
  LT_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  if (cudaDriverGetVersion(&driver) != cudaSuccess) cudaGetLastError();
  fmt::print("CUDA: on (runtime {}.{}, driver {}.{}), {} device(s)\n", runtime / 1000, runtime % 1000 / 10,
             driver / 1000, driver % 1000 / 10, cuda_device_count());
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

std::vector<int64_t> parse_sizes(const std::string& list) {
  std::vector<int64_t> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    LT_CHECK(used == item.size() && v > 0, "[bench] --n takes positive integers separated by commas, like ",
             "256,1024; got '", list, "'");
    out.push_back(v);
  }
  return out;
}

struct BenchArgs {
  std::string op, device, mode = "all", metric = "all", n, dtype = "bf16", json;
  bool list = false, quick = false;
  int reps = 0;
};

void list_benchmarks() {
  for (const bench::Benchmark& b : bench::registry()) {
    std::string providers;
    for (const std::string& p : b.providers) providers += (providers.empty() ? "" : ", ") + p;
    fmt::print("{:<16} {} [{}]\n", b.name, b.about, providers);
  }
}

void bench_command(const BenchArgs& a) {
  if (a.list) return list_benchmarks();
  std::vector<const bench::Benchmark*> which;
  if (a.op == "all") {
    for (const bench::Benchmark& b : bench::registry()) which.push_back(&b);
  } else {
    const bench::Benchmark* b = bench::find_benchmark(a.op);
    if (!b) {
      std::string names;
      for (const bench::Benchmark& r : bench::registry()) names += r.name + ", ";
      fail(str("[bench] unknown benchmark '", a.op, "'; expected one of ", names, "or all (see --list)"));
    }
    which.push_back(b);
  }

  bench::RunOptions o;
  o.device = a.device.empty() ? (cuda_available() ? Device::cuda(0) : Device::cpu()) : parse_device(a.device);
  LT_CHECK(!o.device.is_cuda() || o.device.index < cuda_device_count(), "[bench] --device ", a.device,
           ": no such CUDA device; this machine has ", cuda_device_count(),
           cuda_device_count() == 0 ? " (or lintape was built without CUDA)" : "");
  o.dtype = dtype_from_name(a.dtype);
  o.quick = a.quick;
  o.reps = a.reps;
  o.json_path = a.json;
  if (!a.n.empty()) o.ns = parse_sizes(a.n);
  if (a.mode != "all") o.modes = {a.mode == "fwd" ? bench::Mode::Fwd : bench::Mode::Bwd};
  if (a.metric != "all") o.metrics = {a.metric == "speed" ? bench::Metric::Speed : bench::Metric::Memory};
  bench::run(which, o);
}

}  // namespace
}  // namespace lintape

int main(int argc, char** argv) {
  CLI::App app{"lintape: a tensor library with tape autograd and fused linear-attention ops"};
  app.require_subcommand(1);
  CLI::App* info = app.add_subcommand("info", "Version, build, devices and allocator statistics");
  CLI::App* bench = app.add_subcommand("bench", "Speed and memory tables of the ops (JSON and SVG with --json)");

  lintape::BenchArgs a;
  bench->add_option("op", a.op, "A benchmark (see --list) or all");
  bench->add_flag("--list", a.list, "List the benchmarks and their providers");
  bench->add_option("--device", a.device, "cuda, cuda:N or cpu (default: cuda when available)");
  bench->add_option("--mode", a.mode, "fwd, bwd or all")->check(CLI::IsMember({"fwd", "bwd", "all"}));
  bench->add_option("--metric", a.metric, "speed, memory or all")->check(CLI::IsMember({"speed", "memory", "all"}));
  bench->add_option("--n", a.n, "Comma-separated sizes replacing every table's n (or sides), e.g. 256,1024");
  bench->add_option("--dtype", a.dtype, "bf16 or f32")->check(CLI::IsMember({"bf16", "f32"}));
  bench->add_option("--json", a.json, "Write JSON rows to FILE and an SVG plot per table next to it");
  bench->add_flag("--quick", a.quick, "Fewer sizes and repetitions");
  bench->add_option("--reps", a.reps, "Least number of timed calls per measurement (default 20; quick: 10, CPU 5)")
      ->check(CLI::PositiveNumber);

  CLI11_PARSE(app, argc, argv);
  try {
    if (info->parsed()) lintape::info();
    if (bench->parsed()) {
      if (a.op.empty() && !a.list) lintape::fail("[bench] expected a benchmark name, all, or --list");
      lintape::bench_command(a);
    }
  } catch (const std::exception& e) {  // lintape::Error, and the standard library's (bad_alloc, ...)
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
