// Internal to the FAL family: a probe of where a chunk kernel's time goes (LINTAPE_FAL_PHASES=1). The kernels
// stamp through stamp<Probe>: their Probe copy, compiled for the model's shape in bf16 only, runs when the
// process asks for it; every other copy has no stamp at all. Thread 0 of every block adds clock64() at each stamp
// to its block's row of the stamps' buffer; after the launch the host prints, per stamp, the mean SM cycles since
// the stamp before it, over `items` (a walk's chunks or a block's chunk). Stamps between barriers time the block's
// slowest warp. With `walk`, stamps 0 and slots - 1 are a block's (before and after its loop), the others each
// chunk's.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>
#include "ops/fal/chunk.cuh"

namespace lintape::fal_cuda::chunk {

constexpr int kStampSlots = 16;

namespace {
// The stamps' buffer (blocks, kStampSlots) of this translation unit's launch.
__constant__ unsigned long long* phase_clocks;
}  // namespace

template <bool Probe>
__device__ __forceinline__ void stamp(int slot) {
  if constexpr (Probe)
    if (threadIdx.x == 0)
      atomicAdd(phase_clocks + (size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kStampSlots + slot,
                static_cast<unsigned long long>(clock64()));
}

// The shape and type the Probe copies are compiled for: the model's mixer (D = E = 128, cosine: D' = 256), bf16.
template <class T, int DP, int PP, int EP>
constexpr bool kProbeShape = std::is_same_v<T, __nv_bfloat16> && DP == 128 && PP == 256 && EP == 128;

inline bool phase_probe_wanted() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_FAL_PHASES");
    return v && v[0] == '1';
  }();
  return on;
}

class PhaseProbe {
 public:
  // The buffer in place for a Probe launch of `blocks` with stamps 0 ... slots - 1.
  PhaseProbe(int64_t blocks, int slots, int64_t items, bool walk, const char* name)
      : blocks_(blocks), slots_(slots), items_(items), walk_(walk), name_(name) {
    if (blocks <= 0 || items <= 0) return;
    LT_CUDA_CHECK(cudaMalloc(&clocks_, size_t(blocks) * kStampSlots * sizeof(unsigned long long)));
    LT_CUDA_CHECK(cudaMemset(clocks_, 0, size_t(blocks) * kStampSlots * sizeof(unsigned long long)));
    LT_CUDA_CHECK(cudaMemcpyToSymbol(phase_clocks, &clocks_, sizeof(clocks_)));
  }
  ~PhaseProbe() {
    if (!clocks_) return;
    std::vector<unsigned long long> h(size_t(blocks_) * kStampSlots);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), clocks_, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost);
    cudaFree(clocks_);
    if (parity_x_ > 0) {  // the even and the odd blockIdx.x apart
      report(h, 0, " even x");
      report(h, 1, " odd x");
    } else {
      report(h, -1, "");
    }
  }
  // With parity_x > 0 (the grid's x extent), report() can take the blocks of one parity of blockIdx.x.
  void split_parity(int64_t grid_x) { parity_x_ = grid_x; }
  PhaseProbe(const PhaseProbe&) = delete;
  PhaseProbe& operator=(const PhaseProbe&) = delete;

 private:
  // The mean cycles between stamps over the blocks (those whose blockIdx.x has parity `parity`, if >= 0).
  void report(const std::vector<unsigned long long>& h, int parity, const char* which) const {
    int dev = 0, khz = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
    std::vector<long double> sum(slots_, 0.0L);
    int64_t n = 0;
    for (int64_t b = 0; b < blocks_; ++b) {
      if (parity >= 0 && (b % parity_x_) % 2 != parity) continue;
      ++n;
      for (int s = 0; s < slots_; ++s) sum[s] += (long double)h[size_t(b) * kStampSlots + s];
    }
    const int64_t items = parity >= 0 ? n : items_;
    if (items <= 0) return;
    std::fprintf(stderr, "fal phases %s%s (%lld blocks, %lld items; cycles an item, us at %d MHz):", name_, which,
                 (long long)blocks_, (long long)items, khz / 1000);
    const double total = double((sum[slots_ - 1] - sum[0]) / (long double)items);
    double parts = 0.0;
    for (int s = walk_ ? 2 : 1; s < (walk_ ? slots_ - 1 : slots_); ++s) {
      const double cyc = double((sum[s] - sum[s - 1]) / (long double)items);
      parts += cyc;
      std::fprintf(stderr, " %d:%.0f", s, cyc);
    }
    std::fprintf(stderr, " | rest %.0f | all %.0f = %.2f us\n", total - parts, total, total / (khz / 1000.0));
  }

  unsigned long long* clocks_ = nullptr;
  int64_t parity_x_ = 0;
  int64_t blocks_;
  int slots_;
  int64_t items_;
  bool walk_;
  const char* name_;
};

}  // namespace lintape::fal_cuda::chunk
