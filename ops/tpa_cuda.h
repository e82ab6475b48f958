// Internal to the TPA family: the fused CUDA decode launcher (ops/tpa_decode.cu, with its tensor-core
// kernel in ops/tpa_decode_tc.cu). ops/tpa.cpp checks the inputs and calls it; tests call it directly
// on poisoned outputs.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"

namespace lintape::tpa_cuda {

// One decode call, already checked: aq (B, 1, H, Rq) and bq (B, 1, Rq, D) contiguous; ak (B, M, H, Rk),
// bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E) with each batch entry's rows contiguous and any
// batch stride (a TpaCache's buffers are read in place); lengths: B entries, each in 1..M (passed to the
// kernel by value up to 256 sequences); all factors of one float dtype other than f64.
struct DecodeArgs {
  Tensor aq, bq, ak, bk, av, bv;
  std::vector<int64_t> lengths;
  double scale = 0;
  int64_t split_rows = 0;          // cache rows per split; 0 lets the launcher choose from the shapes
  bool allow_tensor_cores = true;  // false forces the general kernel (tests)
};

// out (B, 1, H, E) contiguous, in the factors' dtype. The tensor-core kernel is one launch (with a split
// over the cache, the last block of each sequence to finish combines the splits); the general kernel
// adds a combine launch when it splits.
void decode(const DecodeArgs& args, Tensor& out);

// Whether decode runs the tensor-core kernel for these arguments: bf16/f16, R_q <= 16, R_k, R_v <= 4,
// H <= 64, D a multiple of 16 up to 256, E 64 or 128, 16-byte aligned rows.
bool decode_uses_tensor_cores(const DecodeArgs& args);

// The tensor-core kernel's launcher (ops/tpa_decode_tc.cu), for arguments it accepts.
void decode_tensor_cores(const DecodeArgs& args, Tensor& out);

}  // namespace lintape::tpa_cuda
