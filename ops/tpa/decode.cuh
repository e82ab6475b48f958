// Internal to the TPA decode kernels: per-sequence cache lengths passed by value (no upload, no wait)
// up to kInlineLengths sequences, else read from a device array.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"

namespace lintape::tpa_cuda {

constexpr int kInlineLengths = 256;

struct DecodeLengths {
  const int64_t* device = nullptr;  // used when the batch is larger than kInlineLengths
  int inline_values[kInlineLengths];
#if defined(__CUDACC__)
  __device__ __forceinline__ int get(int b) const { return device ? int(device[b]) : inline_values[b]; }
#endif
};

// Fills `out`; for a large batch uploads the lengths into `storage`, which must outlive the launch.
inline DecodeLengths make_decode_lengths(const std::vector<int64_t>& lengths, Device device, Tensor& storage) {
  DecodeLengths out{};
  if (lengths.size() > size_t(kInlineLengths)) {
    storage = from_vector_i64(lengths, {int64_t(lengths.size())}, device);
    out.device = storage.data_ptr<int64_t>();
  } else {
    for (size_t i = 0; i < lengths.size(); ++i) out.inline_values[i] = int(lengths[i]);
  }
  return out;
}

}  // namespace lintape::tpa_cuda
