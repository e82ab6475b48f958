// Internal to the FAL family: a probe of where a chunk kernel's time goes (LINTAPE_FAL_PHASES=1; off otherwise,
// then one untaken branch a stamp). Thread 0 of every block adds clock64() at each stamp to its block's row of
// the stamps' buffer; after the launch the host prints, per stamp, the mean SM cycles since the stamp before it, over
// `items` (a walk's chunks or a block's chunk). Stamps between barriers time the block's slowest warp. With
// `walk`, stamps 0 and slots - 1 are a block's (before and after its loop), the others each chunk's.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "ops/fal/chunk.cuh"

namespace lintape::fal_cuda::chunk {

constexpr int kStampSlots = 16;

namespace {
// The stamps' buffer (blocks, kStampSlots) of this translation unit's launch, or null.
__constant__ unsigned long long* phase_clocks;
}  // namespace

__device__ __forceinline__ void stamp(const Args&, int slot) {
  if (phase_clocks != nullptr && threadIdx.x == 0)
    atomicAdd(phase_clocks + (size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kStampSlots + slot,
              static_cast<unsigned long long>(clock64()));
}

class PhaseProbe {
 public:
  // The buffer in place when the process asked for the probe (null otherwise); `slots` stamps 0 ... slots - 1.
  PhaseProbe(int64_t blocks, int slots, int64_t items, bool walk, const char* name)
      : blocks_(blocks), slots_(slots), items_(items), walk_(walk), name_(name) {
    static const bool on = [] {
      const char* v = std::getenv("LINTAPE_FAL_PHASES");
      return v && v[0] == '1';
    }();
    if (on && blocks > 0 && items > 0) {
      LT_CUDA_CHECK(cudaMalloc(&clocks_, size_t(blocks) * kStampSlots * sizeof(unsigned long long)));
      LT_CUDA_CHECK(cudaMemset(clocks_, 0, size_t(blocks) * kStampSlots * sizeof(unsigned long long)));
    }
    if (on) LT_CUDA_CHECK(cudaMemcpyToSymbol(phase_clocks, &clocks_, sizeof(clocks_)));
  }
  ~PhaseProbe() {
    if (!clocks_) return;
    std::vector<unsigned long long> h(size_t(blocks_) * kStampSlots);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), clocks_, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost);
    cudaFree(clocks_);
    int dev = 0, khz = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
    std::vector<long double> sum(slots_, 0.0L);
    for (int64_t b = 0; b < blocks_; ++b)
      for (int s = 0; s < slots_; ++s) sum[s] += (long double)h[size_t(b) * kStampSlots + s];
    std::fprintf(stderr, "fal phases %s (%lld blocks, %lld items; cycles an item, us at %d MHz):", name_,
                 (long long)blocks_, (long long)items_, khz / 1000);
    const double total = double((sum[slots_ - 1] - sum[0]) / (long double)items_);
    double parts = 0.0;
    for (int s = walk_ ? 2 : 1; s < (walk_ ? slots_ - 1 : slots_); ++s) {
      const double cyc = double((sum[s] - sum[s - 1]) / (long double)items_);
      parts += cyc;
      std::fprintf(stderr, " %d:%.0f", s, cyc);
    }
    std::fprintf(stderr, " | rest %.0f | all %.0f = %.2f us\n", total - parts, total, total / (khz / 1000.0));
  }
  PhaseProbe(const PhaseProbe&) = delete;
  PhaseProbe& operator=(const PhaseProbe&) = delete;

 private:
  unsigned long long* clocks_ = nullptr;
  int64_t blocks_;
  int slots_;
  int64_t items_;
  bool walk_;
  const char* name_;
};

}  // namespace lintape::fal_cuda::chunk
