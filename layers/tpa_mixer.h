// MODEL.md's TPA mixer: TPA factors, rotary on bq and bk, causal softmax attention, (B, N, C) -> (B, N, C).
// `impl` picks the op's implementation (Auto: the reference on the CPU, the fused kernels on CUDA);
// tests set Composed to check the two paths against each other.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include "../core/tensor.h"
#include "../ops/tpa/tpa.h"
#include "layers.h"
#include "mixer.h"

namespace lintape {

// The decoding state: the factor cache of the tokens so far.
struct TpaState : MixerState {
  explicit TpaState(TpaCache cache) : cache(std::move(cache)) {}
  TpaCache cache;
};

class TpaMixer : public Mixer {
 public:
  TpaMixer(int64_t width, int64_t heads, int64_t head_dim, int64_t rank_q, int64_t rank_k, int64_t rank_v,
           double init_std, double out_std, uint64_t seed);
  Tensor forward(const Tensor& x, const Documents& docs = {}) const override;
  // Decoding over the state's factor cache (TpaState, made by make_cache). prefill: x (B, N, C), the first
  // tokens (the cache must be empty), through tpa_attention, appending their k, v factors to the cache;
  // step: one token x_t (B, 1, C) at position cache.max_length(), appended and attended over the cache
  // with tpa_decode. Both take the position from the cache.
  std::unique_ptr<MixerState> start_decoding(int64_t batch, DType dtype) const override;
  Tensor prefill(const Tensor& x, MixerState& state, int64_t position) const override;
  Tensor step(const Tensor& x_t, MixerState& state, int64_t position) const override;
  Tensor prefill(const Tensor& x, TpaCache& cache) const;
  Tensor step(const Tensor& x_t, TpaCache& cache) const;
  // A cache of factors in `dtype` (the activations' dtype) on the weights' device.
  TpaCache make_cache(int64_t batch, DType dtype) const;
  Linear a;      // (H (Rq + Rk + Rv), C)
  Linear b;      // ((Rq + Rk + Rv) D, C)
  Linear out;    // (C, H D)
  Tensor theta;  // buffer (1, D/2): rotary 10000^(-2 j / D)
  int64_t heads, head_dim, rank_q, rank_k, rank_v;

 private:
  // Both projections of x (B, N, C) in one product: each token's row in tpa_factors' layout (ops/tpa/tpa.h).
  Tensor projection(const Tensor& x) const;
  // The factors of the projection y: aq, bq and bk rotated from `position` (restarting at each document's
  // start), ak, av, bv.
  std::array<Tensor, 6> factors(const Tensor& y, int64_t position, const Documents& docs = {}) const;
  // bk as projected, before the rotation (a TpaCache rotates the rows it appends).
  Tensor unrotated_bk(const Tensor& y) const;
  // Causal over these tokens (within each document), then out.
  Tensor attend(const std::array<Tensor, 6>& factors, const Documents& docs = {}) const;
};

std::unique_ptr<Mixer> make_tpa_mixer(const ModelConfig& config, double init_std, double out_std, uint64_t seed);
// 12 H D context: causal attention over each token's document (6 H D N for rows of one document).
double tpa_train_flops_per_token(const ModelConfig& config, double context);

}  // namespace lintape
