#include "bench/harness.h"
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <fmt/format.h>
#include "autograd/tape.h"
#include "bench/report.h"
#include "train/step_graph.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape::bench {

const char* mode_name(Mode m) { return m == Mode::Fwd ? "fwd" : "bwd"; }
const char* metric_name(Metric m) { return m == Metric::Speed ? "speed" : "memory"; }

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::vector<Benchmark>& mutable_registry() {
  static std::vector<Benchmark> r;
  return r;
}

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since).count();
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

int64_t in_use(Device d) { return int64_t(memory_stats(d).in_use); }

// Speed: one input set, then as many more (up to 4) as it takes for all of them together to exceed twice
// the cache, so that rotating among them keeps the cache from flattering the time.
double time_case(const Config& cfg, Case c, size_t cache_bytes, int min_reps, double min_ms, bool cuda_graph) {
  int64_t before = in_use(c.device);
  std::vector<Call> sets{cfg.make(c)};
  synchronize(c.device);
  int64_t set_bytes = std::max<int64_t>(in_use(c.device) - before, 1);
  int64_t want = std::clamp<int64_t>((2 * int64_t(cache_bytes) + set_bytes - 1) / set_bytes, 1, 4);
  for (int64_t s = 1; s < want; ++s) {
    c.seed = uint64_t(s);
    sets.push_back(cfg.make(c));
  }
  if (!cuda_graph || !c.device.is_cuda()) return median_ms(sets, c.device, min_reps, min_ms);
  // One graph per input set: its first run is eager (lazy state), the second captures it; timing replays.
  std::vector<std::unique_ptr<StepGraph>> graphs;
  std::vector<Call> replays;
  for (const Call& call : sets) {
    graphs.push_back(std::make_unique<StepGraph>(c.device, true));
    StepGraph* g = graphs.back().get();
    replays.push_back([g, call] { g->run(call); });
    for (int i = 0; i < 2; ++i) replays.back()();
  }
  synchronize(c.device);
  for (const auto& g : graphs) LT_CHECK(g->replaying(), "not captured as a CUDA graph: ", g->why());
  return median_ms(replays, c.device, min_reps, min_ms);
}

// Memory: the peak bytes in use while one call runs, counted from before its inputs were built (so
// inputs, saved graph and dout are included, and whatever earlier cases left cached is not).
double memory_case(const Config& cfg, const Case& c) {
  synchronize(c.device);
  int64_t before = in_use(c.device);
  Call call = cfg.make(c);
  synchronize(c.device);
  reset_peak_memory(c.device);
  call();
  synchronize(c.device);
  return double(int64_t(memory_stats(c.device).peak) - before) / kMiB;
}

#if LINTAPE_WITH_CUDA
struct Events {
  std::vector<cudaEvent_t> ev;
  explicit Events(size_t n) : ev(n, nullptr) {}
  ~Events() {
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
  }
};
#endif

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos)
      return line.substr(line.find(':') + 2);
  return "cpu";
}

// Makes sure the results can be written before anything is measured: FILE opens for writing (it is
// rewritten after each table) and FILE.plots/ exists. A failure says the OS's reason.
void prepare_outputs(const std::string& json_path) {
  std::ofstream probe(json_path);
  LT_CHECK(probe.is_open(), "[bench] cannot write --json ", json_path, ": ", std::strerror(errno));
  std::error_code ec;
  std::filesystem::create_directories(plots_folder(json_path), ec);
  LT_CHECK(!ec, "[bench] cannot create the plots folder ", plots_folder(json_path), ": ", ec.message());
}

}  // namespace

Registration::Registration(Benchmark b) { mutable_registry().push_back(std::move(b)); }
const std::vector<Benchmark>& registry() { return mutable_registry(); }

const Benchmark* find_benchmark(const std::string& name) {
  for (const Benchmark& b : registry())
    if (b.name == name) return &b;
  return nullptr;
}

Documents bench_documents(int64_t batch, int64_t n, int64_t length, Device device) {
  if (length <= 0 || n == 0) return Documents();
  std::vector<int64_t> cu{0};
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = length; t < n; t += length) cu.push_back(b * n + t);
    cu.push_back(b * n + n);
  }
  return Documents::from_cu_seqlens(cu, batch, n, device);
}

std::string documents_tag(int64_t length) { return length > 0 ? "-docs" + std::to_string(length) : ""; }

void unsupported(const std::string& why) { fail("unsupported: " + why); }

void synchronize(Device d) {
#if LINTAPE_WITH_CUDA
  if (d.is_cuda()) cuda::synchronize(d.index);
#else
  (void)d;
#endif
}

DeviceInfo device_info(Device d) {
  DeviceInfo info;
  if (d.is_cuda()) {
#if LINTAPE_WITH_CUDA
    cudaDeviceProp p{};
    LT_CUDA_CHECK(cudaGetDeviceProperties(&p, d.index));
    info.name = p.name;
    info.sms = p.multiProcessorCount;
    info.memory_bytes = p.totalGlobalMem;
    info.l2_bytes = size_t(p.l2CacheSize);
    info.cc_major = p.major;
    info.cc_minor = p.minor;
    return info;
#else
    fail("lintape was built without CUDA; there is no " + d.name());
#endif
  }
  info.name = cpu_name();
  info.memory_bytes = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGE_SIZE));
  return info;
}

Call op_call(Mode mode, const std::vector<Tensor>& inputs, const Forward& f, uint64_t seed) {
  if (mode == Mode::Fwd) return [inputs, f] { f(inputs); };
  Tensor out = f(inputs);
  LT_CHECK(out.requires_grad(), "[bench] a backward needs an input that requires grad");
  Tensor dout = randn(out.shape(), out.dtype(), out.device(), seed + 1000003);
  return [inputs, out, dout] {
    for (Tensor t : inputs)
      if (t.requires_grad()) t.set_grad(Tensor());  // each call writes fresh gradients, none accumulate
    autograd::backward(out, dout, /*retain_graph=*/true);
  };
}

double median_ms(const std::vector<Call>& calls, Device device, int min_reps, double min_ms) {
  LT_CHECK(!calls.empty(), "[bench] median_ms needs at least one call");
  auto call = [&](size_t i) { calls[i % calls.size()](); };
  // Warm-up: one call for lazy setup, then (CUDA) a pass over the sets; it estimates the time per call.
  call(0);
  synchronize(device);
  size_t warm = device.is_cuda() ? std::max<size_t>(3, calls.size()) : 1;
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 1; i <= warm; ++i) call(i);
  synchronize(device);
  double estimate = std::max(elapsed_ms(t0) / double(warm), 1e-4);
  size_t reps = size_t(std::max(double(min_reps), std::min(2000.0, std::ceil(min_ms / estimate))));

  std::vector<double> times(reps);
  if (device.is_cuda()) {
#if LINTAPE_WITH_CUDA
    Events events(2 * reps);
    for (cudaEvent_t& e : events.ev) LT_CUDA_CHECK(cudaEventCreate(&e));
    cudaStream_t stream = cuda::stream(device.index);
    for (size_t r = 0; r < reps; ++r) {
      LT_CUDA_CHECK(cudaEventRecord(events.ev[2 * r], stream));
      call(r);
      LT_CUDA_CHECK(cudaEventRecord(events.ev[2 * r + 1], stream));
    }
    LT_CUDA_CHECK(cudaEventSynchronize(events.ev.back()));
    for (size_t r = 0; r < reps; ++r) {
      float ms = 0;
      LT_CUDA_CHECK(cudaEventElapsedTime(&ms, events.ev[2 * r], events.ev[2 * r + 1]));
      times[r] = ms;
    }
#endif
  } else {
    for (size_t r = 0; r < reps; ++r) {
      auto t = std::chrono::steady_clock::now();
      call(r);
      times[r] = elapsed_ms(t);
    }
  }
  std::sort(times.begin(), times.end());
  return reps % 2 ? times[reps / 2] : 0.5 * (times[reps / 2 - 1] + times[reps / 2]);
}

std::vector<int64_t> pick_sizes(const RunOptions& o, const std::vector<int64_t>& cuda,
                                const std::vector<int64_t>& quick, const std::vector<int64_t>& cpu) {
  if (o.device.is_cuda()) return o.quick ? quick : cuda;
  if (o.quick && cpu.size() > 2) return {cpu[0], cpu[1]};
  return cpu;
}

std::vector<int64_t> powers_of_two(int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (int64_t n = lo; n <= hi; n *= 2) out.push_back(n);
  return out;
}

int64_t copy_reference_mib(Device d) { return d.is_cuda() ? 1024 : 64; }

std::string plots_folder(const std::string& json_path) { return json_path + ".plots"; }

void run(const std::vector<const Benchmark*>& benchmarks, const RunOptions& o) {
  if (!o.json_path.empty()) prepare_outputs(o.json_path);
  const Device dev = o.device;
#if LINTAPE_WITH_CUDA
  if (dev.is_cuda()) cuda::set_device(dev.index);
#endif
  const DeviceInfo info = device_info(dev);
  const int min_reps = o.reps > 0 ? o.reps : !o.quick ? 20 : dev.is_cuda() ? 10 : 5;
  const double min_ms = o.quick ? 10 : 50;
  const size_t cache_bytes = dev.is_cuda() ? info.l2_bytes : 0;  // the CPU does not rotate: it is a smoke test

  std::string where = dev.is_cuda() ? fmt::format("{} ({} SMs, {:.1f} GiB, L2 {:.0f} MiB, sm_{}{})", info.name,
                                                  info.sms, double(info.memory_bytes) / (kMiB * 1024),
                                                  double(info.l2_bytes) / kMiB, info.cc_major, info.cc_minor)
                                    : info.name;
  LT_CHECK(!o.cuda_graph || dev.is_cuda(), "[bench] --cuda-graph needs a CUDA device; got ", dev.name());
  fmt::print("lintape bench on {}: {}; dtype {}{}{}\n", dev.name(), where, dtype_name(o.dtype),
             o.quick ? "; quick" : "", o.cuda_graph ? "; times of CUDA graph replays" : "");

  // The copy bandwidth every floor is measured against: bytes read + written over the median time.
  const int64_t copy_bytes = copy_reference_mib(dev) << 20;
  double copy_bytes_per_ms = 0;
  {
    Tensor src = empty({copy_bytes / int64_t(dtype_size(o.dtype))}, o.dtype, dev);
    src.fill_(1.0);
    Tensor dst = empty_like(src);
    double ms = median_ms({[&] { dst.copy_(src); }}, dev, min_reps, min_ms);
    copy_bytes_per_ms = 2.0 * double(copy_bytes) / ms;
  }
  empty_cache(dev);
  fmt::print("copy bandwidth: {:.1f} GB/s (Tensor::copy_ of {} MiB, bytes read + written; the floors below use it)\n\n",
             copy_bytes_per_ms / 1e6, copy_bytes >> 20);
  std::fflush(stdout);

  nlohmann::json doc = {{"device", info.name},
                        {"device_id", dev.name()},
                        {"dtype", dtype_name(o.dtype)},
                        {"quick", o.quick},
                        {"cuda_graph", o.cuda_graph},
                        {"copy_GBps", copy_bytes_per_ms / 1e6},
                        {"rows", nlohmann::json::array()}};
  std::set<std::string> noted;
  std::vector<Table> speed_tables;  // for the summary

  for (const Benchmark* b : benchmarks) {
    for (const Config& cfg : b->configs(o)) {
      const std::vector<int64_t> ns = o.ns.empty() ? cfg.ns : o.ns;
      for (Mode mode : cfg.modes) {
        if (std::find(o.modes.begin(), o.modes.end(), mode) == o.modes.end()) continue;
        for (Metric metric : o.metrics) {
          Table t;
          t.op = b->name;
          t.metric = metric_name(metric);
          t.mode = mode_name(mode);
          t.title = replace_all(replace_all(cfg.stem, "{metric}", t.metric), "{mode}", t.mode);
          t.unit = metric == Metric::Speed ? "ms" : "MiB";
          t.x_name = cfg.x_name;
          t.ns = ns;
          t.providers = b->providers;
          t.values.assign(b->providers.size(), std::vector<double>(ns.size(), -1.0));
          for (size_t i = 0; i < ns.size(); ++i) {
            for (size_t p = 0; p < b->providers.size(); ++p) {
              Case c{ns[i], b->providers[p], mode, dev, o.dtype, 0};
              try {
                t.values[p][i] = metric == Metric::Speed
                                     ? time_case(cfg, c, cache_bytes, min_reps, min_ms, o.cuda_graph)
                                     : memory_case(cfg, c);
              } catch (const Error& e) {  // the table shows -1; each distinct reason is said once
                if (noted.insert(e.what()).second) {
                  std::fflush(stdout);
                  fmt::print(stderr, "note: {} {} ({} = {}) gives -1: {}\n", b->name, c.provider, cfg.x_name, c.n,
                             e.what());
                }
              }
              empty_cache(dev);
            }
            if (metric == Metric::Speed && cfg.measures_copy_bandwidth && ns[i] == copy_reference_mib(dev) &&
                t.values[0][i] > 0) {
              copy_bytes_per_ms = std::max(copy_bytes_per_ms, cfg.floor_bytes(ns[i], mode) / t.values[0][i]);
              doc["copy_GBps"] = copy_bytes_per_ms / 1e6;
            }
            if (metric == Metric::Speed && cfg.floor_bytes)
              t.floor_ms.push_back(cfg.floor_bytes(ns[i], mode) / copy_bytes_per_ms);
            if (metric == Metric::Speed && cfg.flops) t.flops.push_back(cfg.flops(ns[i], mode));
          }
          fmt::print("{}", format_table(t));
          std::fflush(stdout);
          if (metric == Metric::Speed) speed_tables.push_back(t);

          if (o.json_path.empty()) continue;
          for (const auto& row : json_rows(t, info.name)) doc["rows"].push_back(row);
          std::ofstream json(o.json_path);
          json << doc.dump(1) << "\n";
          LT_CHECK(json.good(), "[bench] cannot write --json ", o.json_path);
          std::filesystem::path svg = std::filesystem::path(plots_folder(o.json_path)) / (t.title + ".svg");
          std::ofstream plot(svg);
          plot << svg_plot(t);
          LT_CHECK(plot.good(), "[bench] cannot write the plot ", svg.string());
        }
      }
    }
  }
  if (speed_tables.size() > 1) fmt::print("{}", format_summary(speed_tables));
}

}  // namespace lintape::bench
