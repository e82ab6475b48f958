// Internal to the TPA decode kernels: per-sequence cache lengths passed by value (no upload, no wait)
// up to kInlineLengths sequences, else read from a device array.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"
#include "ops/tpa/launch.h"

namespace lintape::tpa_cuda {

constexpr int kInlineLengths = 256;

struct DecodeLengths {
  const int64_t* device = nullptr;  // used when the batch is larger than kInlineLengths
  int inline_values[kInlineLengths];
#if defined(__CUDACC__)
  __device__ __forceinline__ int get(int b) const { return device ? int(device[b]) : inline_values[b]; }
#endif
};

// The dims and batch strides that both decode kernels' geometries (G) take from the arguments.
template <class G>
void fill_decode_dims(G& g, const DecodeArgs& a) {
  g.H = int(a.aq.size(2));
  g.Rq = int(a.aq.size(3));
  g.Rk = int(a.ak.size(3));
  g.Rv = int(a.av.size(3));
  g.D = int(a.bq.size(3));
  g.E = int(a.bv.size(3));
  g.ak_b = a.ak.strides()[0];
  g.bk_b = a.bk.strides()[0];
  g.av_b = a.av.strides()[0];
  g.bv_b = a.bv.strides()[0];
}

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
