// The benchmark harness: a registry of benchmarks, the timing and memory rules, and the run loop that
// prints each table as soon as it is measured and writes JSON rows and SVG plots.
//
// A benchmark is a name, its providers, and the configurations of a run (one table each per mode and
// metric). A configuration builds one input set for (n, provider, mode) and returns the call to time.
// Adding a benchmark is one registration in one bench_*.cpp file:
//
//   static const Registration reg({"my-op", "what it measures", {"fused", "composed"},
//                                  [](const RunOptions& o) { return std::vector<Config>{...}; }});
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "core/tensor.h"
#include "ops/documents.h"

namespace lintape::bench {

enum class Mode { Fwd, Bwd };
enum class Metric { Speed, Memory };
const char* mode_name(Mode m);      // "fwd", "bwd"
const char* metric_name(Metric m);  // "speed", "memory"

struct RunOptions {
  Device device = Device::cpu();
  DType dtype = DType::BF16;
  bool quick = false;
  std::vector<Mode> modes = {Mode::Fwd, Mode::Bwd};
  std::vector<Metric> metrics = {Metric::Speed, Metric::Memory};
  std::vector<int64_t> ns;  // replaces every table's x values when not empty
  int reps = 0;             // least number of timed calls; 0: 20 (quick: 10 on CUDA, 5 on the CPU)
  std::string json_path;    // rows go here, one plot per table into <json_path>.plots/<title>.svg; empty: neither
  int64_t document_length = 0;  // ops that take documents: cut every row into documents of this many tokens
  // CUDA: time each call replayed from a CUDA graph captured once per input set (the kernels' time without the
  // host's launch work, as a graphed decode or training step runs them); a call that cannot be captured runs
  // eagerly and is said so.
  bool cuda_graph = false;
};

// What one input set is built for. Each set of a case gets its own seed.
struct Case {
  int64_t n = 0;
  std::string provider;
  Mode mode = Mode::Fwd;
  Device device;
  DType dtype = DType::BF16;
  uint64_t seed = 0;
};

using Call = std::function<void()>;
using Forward = std::function<Tensor(const std::vector<Tensor>&)>;

struct Config {
  std::string stem;  // the title with "{metric}" and "{mode}" left open: "lrpe_cosine-{metric}-{mode}-...-bf16"
  std::vector<int64_t> ns;
  // Builds one input set with fresh random values (from case.seed) and returns the call to time. All
  // setup, including the forward graph a backward needs, happens here, outside the timed region.
  std::function<Call(const Case&)> make;
  // Memory-bound ops: the fewest bytes one call must move (floor and % copy columns).
  std::function<double(int64_t n, Mode mode)> floor_bytes;
  // Compute-bound ops: floating-point operations of one call (TFLOP/s column).
  std::function<double(int64_t n, Mode mode)> flops;
  std::vector<Mode> modes = {Mode::Fwd, Mode::Bwd};
  std::string x_name = "n";
  // The copy benchmark: where it measures at copy_reference_mib, a faster time than the run's first copy
  // raises the bandwidth the floors use, so that no table shows more than 100% of copy by chance.
  bool measures_copy_bandwidth = false;
};

struct Benchmark {
  std::string name;  // what `lintape bench <name>` takes
  std::string about;
  std::vector<std::string> providers;  // the first is the fused one: floor columns refer to it
  std::function<std::vector<Config>(const RunOptions&)> configs;
};

struct Registration {
  explicit Registration(Benchmark b);
};
const std::vector<Benchmark>& registry();  // in registration order
const Benchmark* find_benchmark(const std::string& name);

// The size of the copy every floor is measured against: 1 GiB on CUDA, 64 MiB on the CPU.
int64_t copy_reference_mib(Device d);

// The folder of a run's SVG plots: "<json_path>.plots".
std::string plots_folder(const std::string& json_path);

// Runs the benchmarks and reports them: a table per config, mode and metric as soon as it is measured,
// then, when there was more than one speed table, a summary. Checks the --json paths before measuring
// anything; throws on a setup error outside a provider's call.
void run(const std::vector<const Benchmark*>& benchmarks, const RunOptions& options);

// ---- Helpers for writing benchmarks ----

// The call for a differentiable op: fwd runs f(inputs); bwd runs f once now and returns a call that
// clears the inputs' gradients and runs the backward of that saved graph against a random dout.
Call op_call(Mode mode, const std::vector<Tensor>& inputs, const Forward& f, uint64_t seed);

// Median milliseconds of calls[i % calls.size()] over at least min_reps timed calls and at least
// min_ms in all, after a warm-up. CUDA: one pair of events per call on the device's lintape stream.
double median_ms(const std::vector<Call>& calls, Device device, int min_reps, double min_ms);

// The x values of a run: on CUDA `cuda` (with --quick, `quick`); on the CPU `cpu` (with --quick, its
// first two).
std::vector<int64_t> pick_sizes(const RunOptions& o, const std::vector<int64_t>& cuda,
                                const std::vector<int64_t>& quick, const std::vector<int64_t>& cpu);
std::vector<int64_t> powers_of_two(int64_t lo, int64_t hi);  // lo, 2 lo, ..., hi

// Every row of B x N tokens cut into documents of `length` tokens (the last one of a row shorter); undefined
// Documents (no boundaries) for length 0. Titles of such tables say "docs<length>" (documents_tag).
Documents bench_documents(int64_t batch, int64_t n, int64_t length, Device device);
std::string documents_tag(int64_t length);  // "" for 0, else "-docs<length>"

// Throws the error a provider raises for a case it does not support; the table shows -1.
[[noreturn]] void unsupported(const std::string& why);

// The device facts `lintape info` prints and the harness uses (L2 size for input rotation).
struct DeviceInfo {
  std::string name;
  int sms = 0;               // CUDA only
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;       // CUDA only
  int cc_major = 0, cc_minor = 0;
};
DeviceInfo device_info(Device d);
void synchronize(Device d);  // waits for the device's queued work (no-op on the CPU)

}  // namespace lintape::bench
