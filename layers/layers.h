// The basic layers: Linear (x @ W^T), Embedding, RMSNorm and the SwiGLU MLP of MODEL.md.
// Weights are created float32 on the CPU with MODEL.md's seeded initialisation; move them with to().
// Mixed precision: a layer computes in its input's dtype. Weights of another float dtype (the float32
// master copy under bf16 activations) are cast to it first by a recorded cast, so their gradients come
// back to the master weights in its dtype.
#pragma once
#include <cstdint>
#include <utility>
#include "../core/tensor.h"
#include "module.h"

namespace lintape {

// N(0, std) float32 values of `shape`, from (seed, element index) only.
Tensor normal_init(const Shape& shape, double std, uint64_t seed);

// `weight` in x's dtype (itself when it already is): a recorded cast.
Tensor weight_as(const Tensor& weight, const Tensor& x);

// Whether a norm that feeds a product (the MLP's up projection, the FAL mixer's out projection) keeps its rows
// for the backward instead of making them again there (rms_norm_linear, the default): one activation of the
// residual's size less a use for one more pass of the norm. Both give the same bits. The default comes from
// LINTAPE_KEEP_NORMED (1: keep); set_keep_normed_rows overrides it for the process.
bool keep_normed_rows();
void set_keep_normed_rows(bool keep);

class Linear : public Module {
 public:
  // weight (out_features, in_features), N(0, init_std). No bias (MODEL.md has none).
  Linear(int64_t in_features, int64_t out_features, double init_std, uint64_t seed);
  Tensor forward(const Tensor& x) const;  // (..., in) -> (..., out)
  Tensor weight;
};

class Embedding : public Module {
 public:
  Embedding(int64_t vocab, int64_t width, double init_std, uint64_t seed);
  Tensor forward(const Tensor& ids) const;  // (...) integer ids -> (..., width)
  Tensor weight;
};

class RMSNorm : public Module {
 public:
  RMSNorm(int64_t width, double eps);
  Tensor forward(const Tensor& x) const;  // over the last dim
  // {x + residual, forward(x + residual)} in one pass (add_rms_norm).
  std::pair<Tensor, Tensor> forward_sum(const Tensor& x, const Tensor& residual) const;
  Tensor weight;
  double eps;
};

// out = (silu(gate) * u) @ down^T with [u, gate] = split(x @ up^T): up (2F, C), down (C, F).
class SwiGluMlp : public Module {
 public:
  SwiGluMlp(int64_t width, int64_t hidden, double init_std, double out_std, uint64_t seed);
  Tensor forward(const Tensor& x) const;
  // {x + residual, forward(norm(x + residual))}, the norm's rows not held for the backward but made again
  // there (add_rms_norm_linear): what a block runs after its mixer.
  std::pair<Tensor, Tensor> forward_after(const RMSNorm& norm, const Tensor& x, const Tensor& residual) const;
  Linear up, down;
  int64_t hidden;
};

}  // namespace lintape
