// Internal to the LRPE family: the description of one call that the CPU reference and the fused CUDA
// kernels share, and the kernels' launchers (defined in ops/lrpe/rows.cu). ops/lrpe/lrpe.cpp checks the inputs,
// records autograd and calls them; tests call the launchers directly on poisoned outputs.
#pragma once
#include <cstdint>
#include <vector>
#include "core/tensor.h"
#include "ops/activation.h"

namespace lintape {

// Everything about one LRPE call except x (B, N, H, D), already checked.
struct LrpeSpec {
  enum Kind { Cosine, Rotate, MdCosine } kind = Cosine;
  Tensor theta;               // (H or 1, E); for the kernels f32, contiguous, on x's device
  int64_t offset = 0;         // 1d: token s sits at position offset + s
  Tensor starts;              // 1d with documents: (B, N) int32 on x's device (ops/documents.h), token s of
                              // row b then sits at offset + s - starts[b, s]; undefined: no boundaries
  std::vector<int64_t> grid;  // md: the token grid (1 to 4 dims)
  int64_t extra_tokens = 0;   // md: L tokens in front with angle 0
  Act act = Act::None;
  ActDim dim = ActDim::None;
  Tensor table;               // md with cached angles: (2, P, H, D) f32, cos then sin; else undefined
  int64_t batch_rows = 0;     // kernels: batch rows per block of the row kernels; 0 lets the launcher
                              // choose (tests set it to reach every batch-tile path)
  int64_t stat_chunk = 0;     // kernels: tokens per chunk of the sequence statistics (per piece with
                              // documents); 0 lets the launcher choose (tests set it to reach long chunks)

  bool rotate() const { return kind == Rotate; }
  // A theta of one column in 1d gives each head one rate for all features.
  bool rate_per_head() const { return kind != MdCosine && theta.size(1) == 1; }
  bool seq_softmax() const { return act == Act::Softmax && dim == ActDim::Sequence; }
  const char* name() const {
    return kind == Cosine ? "lrpe_cosine" : kind == Rotate ? "lrpe_rotate" : "md_lrpe_cosine";
  }
  // x (B, N, H, D) -> out (B, N, H, 2D) for the cosine kinds, (B, N, H, D) for rotate.
  Shape out_shape(const Shape& x) const { return {x[0], x[1], x[2], rotate() ? x[3] : 2 * x[3]}; }
};

#if LINTAPE_WITH_CUDA
namespace lrpe_cuda {

// x (B, N, H, D) f32/bf16/f16 -> out (B, N, H, 2D) for the cosine kinds, (B, N, H, D) for rotate, same
// dtype, contiguous. x may be a view with packed features (stride 1) and any other strides. For softmax
// over the sequence it also writes stats (B, H, D) f32: the log-sum-exp of x over N per (b, h, d), which
// backward needs; otherwise pass an undefined stats. With documents stats is (B, N, H, D): each document's
// log-sum-exp in the row of its first token (the other rows are left as they were).
void forward(const Tensor& x, const LrpeSpec& spec, const Tensor& out, const Tensor& stats);

// dx (B, N, H, D) from dout (the shape of out, contiguous) and x (as for forward); stats as forward wrote
// them. dx may be a view with packed features and any other strides (a slice of a wider gradient).
void backward(const Tensor& x, const Tensor& dout, const LrpeSpec& spec, const Tensor& stats, const Tensor& dx);

// Whether forward and backward should read x where it lies: x is contiguous, or a view with packed
// features whose data pointer and strides are multiples of 16 bytes (so that it keeps the widest
// vectors; the kernels narrow them for a misaligned view). Otherwise the caller passes a contiguous copy.
bool reads_in_place(const Tensor& x);

// md cached mode: fills table (2, P, H, D) f32 with cos and sin of the grid tokens' angles.
void build_table(const LrpeSpec& spec, int64_t H, int64_t D, const Tensor& table);

}  // namespace lrpe_cuda
#endif

}  // namespace lintape
