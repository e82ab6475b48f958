// Caching allocator, one per device. Freed blocks go back to a per-size cache and are handed out
// again without a device allocation; all device work runs on one stream per device, so reuse in
// stream order is safe. Every tensor's storage comes from here, so current and peak bytes are exact.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include "device.h"
#include "dtype.h"

namespace lintape {

struct MemoryStats {
  size_t in_use = 0;          // bytes held by live storages (requested sizes rounded up to 512)
  size_t peak = 0;            // most bytes in use since the last reset_peak_memory()
  size_t reserved = 0;        // bytes obtained from the system/driver, in use or cached
  size_t device_allocs = 0;   // number of system/driver allocations made so far
};

MemoryStats memory_stats(Device d);
void reset_peak_memory(Device d);
void empty_cache(Device d);  // returns cached, unused blocks to the system/driver

// CUDA graphs (train/step_graph.h). Between graph_pool_begin and graph_pool_end, a device's allocations
// and the blocks freed belong to pool `pool` (> 0): their addresses are baked into the graph being
// captured, so a block of the pool, once freed, is kept for it (a later capture into the same pool may
// take it) and never handed to work outside the graph, whose replays would use it. graph_pool_release
// gives the pool's blocks back to the cache (the graph is gone); blocks still held return to it when freed.
// graph_pool_end returns how far the bytes in use rose above their level at graph_pool_begin during the
// capture: what a replay holds at its peak besides what was in use before it. count_replay(d, bytes) makes
// the peak at least the bytes in use now plus `bytes`, as allocations would have.
void graph_pool_begin(Device d, int pool);
size_t graph_pool_end(Device d);
void graph_pool_release(Device d, int pool);
void count_replay(Device d, size_t bytes);

// A block of raw memory on one device; returns itself to the cache when the last owner lets go.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;  // requested size
  Device device;
  uint64_t version = 0;  // bumped by in-place writes; caches keyed on a tensor's contents check it
  // A copy of these values in another dtype, element for element, kept by whoever writes both (AdamW keeps
  // the 16-bit compute copy of the flat parameters with each update); Tensor::to(copy_dtype) reads it instead
  // of converting while copy_version == version.
  std::shared_ptr<Storage> copy;
  DType copy_dtype = DType::F32;
  uint64_t copy_version = 0;
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

 private:
  size_t reserved_ = 0;  // the rounded block size taken from the cache
};

}  // namespace lintape
