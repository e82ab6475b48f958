// The token mixers of MODEL.md: FalMixer (FAL, causal with per-head decay and LRPE cosine) and
// TpaMixer (TPA factors, rotary on bq and bk, causal softmax attention). Both map (B, N, C) -> (B, N, C).
// `impl` picks the op's implementation (Auto: the reference on the CPU, the fused kernels on CUDA);
// tests set Composed to check the two paths against each other.
#pragma once
#include <array>
#include <cstdint>
#include "../core/tensor.h"
#include "../ops/impl.h"
#include "../ops/tpa/tpa.h"
#include "layers.h"
#include "module.h"

namespace lintape {

class FalMixer : public Module {
 public:
  FalMixer(int64_t width, int64_t heads, int64_t head_dim, double eps, double init_std, double out_std,
           uint64_t seed);
  Tensor forward(const Tensor& x) const;
  // Decoding. `state` (B, H, 2D, D), f32 (f64 for f64 weights), zeros before the first token, is
  // replaced by the state after the tokens given. prefill: x (B, N, C) at positions position..
  // position + N - 1 through the chunked causal op with state (fal_with_state); step: one token x_t
  // (B, 1, C) at `position` through fal_step.
  Tensor prefill(const Tensor& x, Tensor& state, int64_t position) const;
  Tensor step(const Tensor& x_t, Tensor& state, int64_t position) const;
  Linear qkvg;   // (4 H D, C): q, k, v, g blocks of H D rows
  RMSNorm norm;  // over D, per head
  Linear out;    // (C, H D)
  Tensor theta;  // buffer (H, D): 10000^(-j / D)
  Tensor decay;  // buffer (H): 1 - 2^(-5 - h)
  int64_t heads, head_dim;
  Impl impl = Impl::Auto;

 private:
  std::array<Tensor, 4> project(const Tensor& x) const;  // q, k, v, g (B, N, H, D)
  Tensor finish(const Tensor& mixed) const;              // per-head norm, then out
};

class TpaMixer : public Module {
 public:
  TpaMixer(int64_t width, int64_t heads, int64_t head_dim, int64_t rank_q, int64_t rank_k, int64_t rank_v,
           double init_std, double out_std, uint64_t seed);
  Tensor forward(const Tensor& x) const;
  // Decoding over `cache` (made by make_cache). prefill: x (B, N, C), the first tokens (the cache must
  // be empty), through tpa_attention, appending their k, v factors to the cache; step: one token x_t
  // (B, 1, C) at position cache.max_length(), appended and attended over the cache with tpa_decode.
  Tensor prefill(const Tensor& x, TpaCache& cache) const;
  Tensor step(const Tensor& x_t, TpaCache& cache) const;
  // A cache of factors in `dtype` (the activations' dtype) on the weights' device.
  TpaCache make_cache(int64_t batch, DType dtype) const;
  Linear a;      // (H (Rq + Rk + Rv), C)
  Linear b;      // ((Rq + Rk + Rv) D, C)
  Linear out;    // (C, H D)
  Tensor theta;  // buffer (1, D/2): rotary 10000^(-2 j / D)
  int64_t heads, head_dim, rank_q, rank_k, rank_v;
  Impl impl = Impl::Auto;

 private:
  // The factors of x (B, N, C): aq, bq (rotated from `position`), ak, bk (not rotated), av, bv.
  std::array<Tensor, 6> factors(const Tensor& x, int64_t position) const;
  Tensor attend(const std::array<Tensor, 6>& factors) const;  // causal over these tokens, then out
};

}  // namespace lintape
