// Internal to the TPA family: the fused CUDA decode launcher (ops/tpa_decode.cu). ops/tpa.cpp checks
// the inputs and calls it; tests call it directly on poisoned outputs.
#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape::tpa_cuda {

// One decode call, already checked: aq (B, 1, H, Rq) and bq (B, 1, Rq, D) contiguous; ak (B, M, H, Rk),
// bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E) with each batch entry's rows contiguous and any
// batch stride (a TpaCache's buffers are read in place); lengths (B) i64 on the factors' device, each in
// 1..M; all factors of one float dtype other than f64.
struct DecodeArgs {
  Tensor aq, bq, ak, bk, av, bv, lengths;
  double scale = 0;
  int64_t split_rows = 0;  // cache rows per split; 0 lets the launcher choose from the shapes
};

// out (B, 1, H, E) contiguous, in the factors' dtype. One launch, or two with a split over the cache.
void decode(const DecodeArgs& args, Tensor& out);

}  // namespace lintape::tpa_cuda
