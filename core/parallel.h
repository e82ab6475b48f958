// Internal: runs fn(i) for i in [0, n) on the CPU's cores (std::thread, at most one thread per core).
// For loops whose iterations write disjoint outputs: the result does not depend on the thread count.
// LINTAPE_CPU_THREADS limits the threads (1: serial).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <thread>
#include <vector>

namespace lintape {

inline int cpu_threads() {
  static const int n = [] {
    const char* env = std::getenv("LINTAPE_CPU_THREADS");
    const int asked = env && *env ? std::atoi(env) : 0;
    const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
    return asked > 0 ? std::min(asked, cores) : cores;
  }();
  return n;
}

template <class Fn>
void parallel_for(int64_t n, Fn&& fn) {
  const int64_t threads = std::min<int64_t>(cpu_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      try {
        for (int64_t i = t; i < n; i += threads) fn(i);  // interleaved: neighbouring items on different threads
      } catch (...) {
        errors[size_t(t)] = std::current_exception();
      }
    });
  for (std::thread& th : pool) th.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace lintape
