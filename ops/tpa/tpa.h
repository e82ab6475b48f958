// The TPA family (tensor product attention): tpa_attention for training and prefill, tpa_decode for one
// query token per sequence over a cache of factor rows, and TpaCache, the growing factor cache.
//
// Factors (ranks R_q, R_k, R_v; head dim D, value dim E):
//   aq (B, N, H, R_q)  bq (B, N, R_q, D)  ak (B, M, H, R_k)  bk (B, M, R_k, D)  av (B, M, H, R_v)  bv (B, M, R_v, E)
//   q[b,n,h] = (1/R_q) sum_r aq[b,n,h,r] bq[b,n,r],  k and v alike,
//   o[b,n,h] = sum_m softmax_m(scale q.k + mask) v[b,m,h],  scale = D^-1/2 by default.
// R_k = R_v = 1 may be passed without the rank axis (ak (B, M, H), bk (B, M, D), av (B, M, H), bv (B, M, E)).
//
// Rotary position is not applied by tpa_attention or tpa_decode: callers rotate bq and bk first with
// lrpe_rotate (bq viewed as (B, N, R_q, D) with a one-row theta (1, D/2)). TpaCache applies it to bk
// at append when given a theta, at each token's position.
#pragma once
#include <array>
#include <cstdint>
#include <vector>
#include "../../core/tensor.h"
#include "../documents.h"
#include "../impl.h"

namespace lintape {

struct TpaOptions {
  bool causal = true;  // tpa_attention: query n sees keys m <= n (needs N == M); ignored by decode
  double scale = 0;    // 0 means D^-1/2
  // tpa_decode over whole factors: rows of the cache each sequence uses (B entries, each 1..M);
  // empty means all M rows for every sequence.
  std::vector<int64_t> cache_lengths;
  // tpa_attention: packed rows (ops/documents.h) for the factors' (B, N) on their device, N == M; no query
  // attends a key of another document: causal, key m is visible to query n iff starts[n] <= m <= n; not
  // causal, iff starts[m] == starts[n]. Every path takes them; undefined costs nothing.
  Documents documents;
};

// Training and prefill; out (B, N, H, E) in the factors' dtype. Recorded by autograd: gradients flow to
// all six factors. Impl::Fused (CUDA, bf16/f16, D == E in {64, 128}, ranks up to 16) runs flash-style
// tensor-core kernels: q, k, v tiles built from the factors on chip, only the output and the
// log-sum-exp saved (the backward contracts dq, dk, dv to the factors on chip). Impl::Auto (the rule in
// ops/impl.h) runs Fused wherever it applies: faster than Composed both ways at every measured shape.
Tensor tpa_attention(const Tensor& aq, const Tensor& bq, const Tensor& ak, const Tensor& bk, const Tensor& av,
                     const Tensor& bv, const TpaOptions& options = {}, Impl impl = Impl::Auto);

// The TPA mixer's factors out of its one projection y (B, N, W): each token's row is [bq (R_q D) | bk (R_k D) |
// bv (R_v E) | for each head [aq (R_q) ak (R_k) av (R_v)] | padding]. Returns {aq, bq, ak, bk, av, bv} for
// tpa_attention with the rotary embedding (lrpe_rotate with theta (1, D/2), token s at offset + s, positions
// restarting at each document) applied to bq and bk; aq, ak, av and bv are views of y. Recorded by autograd.
// On CUDA (Impl::Auto or Fused, f32/bf16/f16) bq and bk are rotated in one launch into one new buffer and the
// backward writes y's gradient in one pass of copies (the inverse rotation straight into its columns); on the
// CPU and with Impl::Composed: split, views and lrpe_rotate. Both give the same bits.
std::array<Tensor, 6> tpa_factors(const Tensor& y, int64_t heads, int64_t rank_q, int64_t rank_k, int64_t rank_v,
                                  int64_t head_dim, int64_t value_dim, const Tensor& theta, int64_t offset = 0,
                                  const Documents& documents = {}, Impl impl = Impl::Auto);

// A factor cache for decoding: B sequences, each with its own length, stored as (B, capacity, H, R_k),
// (B, capacity, R_k, D), (B, capacity, H, R_v), (B, capacity, R_v, E) buffers. Capacity grows by whole
// blocks of rows, geometrically, so a step copies nothing and growth copies the cache O(log M) times.
class TpaCache {
 public:
  // theta: rotary rates (1, D/2) applied to bk at append, or undefined for none.
  TpaCache(int64_t batch, int64_t heads, int64_t rank_k, int64_t rank_v, int64_t head_dim, int64_t value_dim,
           DType dtype, Device device, Tensor theta = Tensor(), int64_t block_rows = 256);

  // Appends one token to each sequence b with active[b] (all when active is empty): ak (B, H, R_k),
  // bk (B, R_k, D), av (B, H, R_v), bv (B, R_v, E); a leading token axis of size 1 after B is allowed,
  // and the rank axis may be left out when that rank is 1. The token of sequence b sits at position
  // lengths()[b]; no gradient flows through the cache.
  void append(const Tensor& ak, const Tensor& bk, const Tensor& av, const Tensor& bv,
              const std::vector<bool>& active = {});

  const std::vector<int64_t>& lengths() const { return lengths_; }
  int64_t max_length() const;
  int64_t capacity() const { return capacity_; }
  int64_t bytes() const;  // bytes held by the four buffers
  void clear();           // lengths back to 0; keeps the buffers

  // The whole buffers; rows at or past a sequence's length hold no data.
  const Tensor& ak() const { return ak_; }
  const Tensor& bk() const { return bk_; }
  const Tensor& av() const { return av_; }
  const Tensor& bv() const { return bv_; }

 private:
  void grow(int64_t rows);

  int64_t batch_, heads_, rank_k_, rank_v_, head_dim_, value_dim_, block_rows_;
  DType dtype_;
  Device device_;
  Tensor theta_;
  int64_t capacity_ = 0;
  std::vector<int64_t> lengths_;
  Tensor ak_, bk_, av_, bv_;
};

// One query token per sequence: aq (B, H, R_q) or (B, 1, H, R_q), bq (B, R_q, D) or (B, 1, R_q, D);
// out (B, H, E) or (B, 1, H, E), following aq. Sequence b attends its first cache_lengths[b] rows.
// Inference only: no gradient is recorded (except through Impl::Composed's primitive ops).
// Impl::Auto (the rule in ops/impl.h) runs the fused decode kernel for every f32/bf16/f16 CUDA call: it
// never builds k or v, reads a TpaCache's buffers in place and splits long caches over the GPU.
Tensor tpa_decode(const Tensor& aq, const Tensor& bq, const Tensor& ak, const Tensor& bk, const Tensor& av,
                  const Tensor& bv, const TpaOptions& options = {}, Impl impl = Impl::Auto);

// The same over a TpaCache, with its lengths (options.cache_lengths must be empty).
Tensor tpa_decode(const Tensor& aq, const Tensor& bq, const TpaCache& cache, const TpaOptions& options = {},
                  Impl impl = Impl::Auto);

}  // namespace lintape
