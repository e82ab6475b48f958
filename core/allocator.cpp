#include "core/allocator.h"
#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>
#include "core/error.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape {
namespace {

std::string mib(size_t bytes) { return str(double(bytes) / (1024.0 * 1024.0), " MiB"); }

// One device's cache: free blocks by rounded size. A request takes the smallest cached block that is
// at least as large and at most twice as large; otherwise it allocates. Sizes are rounded up to 512
// bytes (2 MiB above 1 MiB requests) so that blocks of similar sizes are shared.
class CachingAllocator {
 public:
  explicit CachingAllocator(Device d) : device_(d) {}

  void* allocate(size_t bytes, size_t* rounded_out) {
    size_t rounded = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    void* p = nullptr;
    if (capture_pool_ > 0) p = take(pool_free_[capture_pool_], &rounded);
    if (!p) p = take(free_, &rounded);
    if (!p) {
      p = raw_alloc(rounded);
      if (!p) {  // give the cache back and try once more
        release_cached();
        p = raw_alloc(rounded);
      }
      if (!p)
        fail(str("[allocator] out of memory on ", device_.name(), ": asked for ", bytes, " bytes (", mib(bytes), "); in use ",
                 mib(stats_.in_use), ", peak ", mib(stats_.peak), ", reserved ", mib(stats_.reserved), " in ",
                 stats_.device_allocs, " allocations"));
      stats_.reserved += rounded;
      stats_.device_allocs += 1;
    }
    if (capture_pool_ > 0) owner_[p] = capture_pool_;
    if (capture_pool_ > 0) capture_high_ = std::max(capture_high_, stats_.in_use + counted_size(bytes));
    // In-use bytes count what was asked for (to 512 bytes), not the cached block that served it, so
    // the figures compare with other frameworks' "allocated" counters.
    stats_.in_use += counted_size(bytes);
    if (stats_.in_use > stats_.peak) stats_.peak = stats_.in_use;
    *rounded_out = rounded;
    return p;
  }

  void deallocate(void* p, size_t rounded, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.in_use -= counted_size(bytes);
    auto owner = owner_.find(p);
    // A block freed during a capture may be read by the graph before that point: it joins the pool too.
    if (owner == owner_.end() && capture_pool_ > 0) owner = owner_.emplace(p, capture_pool_).first;
    (owner == owner_.end() ? free_ : pool_free_[owner->second]).emplace(rounded, p);
  }

  void begin_pool(int pool) {
    std::lock_guard<std::mutex> lock(mu_);
    capture_pool_ = pool;
    capture_base_ = capture_high_ = stats_.in_use;
  }
  size_t end_pool() {
    std::lock_guard<std::mutex> lock(mu_);
    capture_pool_ = 0;
    return capture_high_ - capture_base_;
  }
  void count_replay(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak = std::max(stats_.peak, stats_.in_use + bytes);
  }
  void release_pool(int pool) {
    std::lock_guard<std::mutex> lock(mu_);
    auto blocks = pool_free_.find(pool);
    if (blocks != pool_free_.end()) {
      free_.insert(blocks->second.begin(), blocks->second.end());
      pool_free_.erase(blocks);
    }
    for (auto it = owner_.begin(); it != owner_.end();) it = it->second == pool ? owner_.erase(it) : std::next(it);
  }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak = stats_.in_use;
  }
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached();
  }

 private:
  static size_t counted_size(size_t bytes) { return (std::max<size_t>(bytes, 1) + 511) / 512 * 512; }
  static size_t round_size(size_t bytes) {
    if (bytes == 0) bytes = 1;
    size_t unit = bytes > (1u << 20) ? (2u << 20) : 512;
    return (bytes + unit - 1) / unit * unit;
  }

  // The smallest block of `blocks` that is at least *rounded and at most twice as large (its size into
  // *rounded), or null.
  static void* take(std::multimap<size_t, void*>& blocks, size_t* rounded) {
    auto it = blocks.lower_bound(*rounded);
    if (it == blocks.end() || it->first > 2 * *rounded) return nullptr;
    *rounded = it->first;
    void* p = it->second;
    blocks.erase(it);
    return p;
  }

  void* raw_alloc(size_t bytes) {
    if (device_.is_cuda()) {
#if LINTAPE_WITH_CUDA
      // cudaMalloc counts as unsafe while this thread captures a CUDA graph (train/step_graph.h), though it
      // is no stream operation: the thread's capture mode is relaxed around it.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      LT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      int prev = cuda::current_device();
      LT_CUDA_CHECK(cudaSetDevice(device_.index));
      void* p = nullptr;
      cudaError_t err = cudaMalloc(&p, bytes);
      LT_CUDA_CHECK(cudaSetDevice(prev));
      LT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
      if (err == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return nullptr;
      }
      LT_CUDA_CHECK(err);
      return p;
#else
      fail("[allocator] lintape was built without CUDA");
#endif
    }
    // More than the machine's memory can never be served: refuse it at once rather than rely on the
    // system's overcommit policy (which may hand out the address space and kill the process later).
    static const size_t physical = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
    if (physical > 0 && bytes > physical) return nullptr;
    return std::aligned_alloc(64, bytes);  // rounded sizes are multiples of 64
  }

  void raw_free(void* p) {
    if (device_.is_cuda()) {
#if LINTAPE_WITH_CUDA
      // Blocks may still be in use by queued work on the stream: wait for it before freeing.
      LT_CUDA_CHECK(cudaStreamSynchronize(cuda::stream(device_.index)));
      LT_CUDA_CHECK(cudaFree(p));
#endif
    } else {
      std::free(p);
    }
  }

  void release_cached() {
    for (auto& [size, p] : free_) {
      raw_free(p);
      stats_.reserved -= size;
    }
    free_.clear();
  }

  Device device_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  int capture_pool_ = 0;                                   // 0: no capture
  size_t capture_base_ = 0, capture_high_ = 0;             // bytes in use at the capture's start, its most
  std::map<void*, int> owner_;                             // the blocks of graph pools, in use or not
  std::map<int, std::multimap<size_t, void*>> pool_free_;  // free blocks kept for their pool
  MemoryStats stats_;
};

// The allocators are never destroyed: storages may be freed during static destruction, and the cached
// blocks stay reachable (not leaks) until the process ends.
CachingAllocator& allocator_for(Device d) {
  static std::mutex& mu = *new std::mutex;
  static CachingAllocator& cpu = *new CachingAllocator(Device::cpu());
  static std::vector<CachingAllocator*>& gpus = *new std::vector<CachingAllocator*>;
  if (!d.is_cuda()) return cpu;
  LT_CHECK(d.index >= 0 && d.index < cuda_device_count(), "[device] ", d.name(), " does not exist: ",
           cuda_device_count() == 0 ? std::string("no CUDA device is available (or lintape was built without CUDA)")
                                    : str("expected cuda:0 to cuda:", cuda_device_count() - 1));
  std::lock_guard<std::mutex> lock(mu);
  if (gpus.empty()) gpus.resize(size_t(cuda_device_count()));
  CachingAllocator*& a = gpus[size_t(d.index)];
  if (!a) a = new CachingAllocator(d);
  return *a;
}

}  // namespace

Storage::Storage(size_t n, Device d) : bytes(n), device(d) {
  size_t rounded = 0;
  data = allocator_for(d).allocate(n, &rounded);
  reserved_ = rounded;
}

Storage::~Storage() {
  if (data) allocator_for(device).deallocate(data, reserved_, bytes);
}

void graph_pool_begin(Device d, int pool) {
  LT_CHECK(pool > 0, "[allocator] graph pools are numbered from 1; got ", pool);
  allocator_for(d).begin_pool(pool);
}
size_t graph_pool_end(Device d) { return allocator_for(d).end_pool(); }
void count_replay(Device d, size_t bytes) { allocator_for(d).count_replay(bytes); }
void graph_pool_release(Device d, int pool) { allocator_for(d).release_pool(pool); }

MemoryStats memory_stats(Device d) { return allocator_for(d).stats(); }
void reset_peak_memory(Device d) { allocator_for(d).reset_peak(); }
void empty_cache(Device d) { allocator_for(d).empty_cache(); }

}  // namespace lintape
