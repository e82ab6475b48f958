// The FAL family: fused activation + LRPE + linear attention with an output gate.
//
//   qb = lrpe(act_q(q))  (B, N, H, D'),  kb = lrpe(act_k(k))  (B, M, H, D'),  D' = 2D for the cosine kinds
//   vb = act_v(v)        (B, M, H, E),   gb = act_g(g)        (B, N, H, E)
//   noncausal:  o = gb * (qb (kb^T vb))                      per (b, h); M may differ from N
//   causal:     S_t = lambda_h S_{t-1} + kb_t^T vb_t,  S_{-1} = S0,  o_t = gb_t * (qb_t S_t);  N == M
//
// q, k, v, g are (B, N or M, H, D or E) in one float dtype and on one device. theta is a fixed buffer and decay
// a fixed per-head constant: no gradient flows to either. The state S is always float32 (float64 when the
// inputs are f64, for gradient checks) and is (B, H, D', E).
//
// Softmax over the sequence normalises over every token, so in causal mode it would let token t see tokens
// after t: causal mode rejects it (for any of q, k, v, g) with an error.
//
// Documents (options.documents, ops/documents.h; causal only): each row is cut into documents that do not see
// each other. The state is reset at each document start (S_{start - 1} taken as 0), except the row's first
// document, which starts from S0; fal_with_state returns as S_final the state after each row's last document;
// the 1-D LRPE puts token s at position offset + s - starts[b, s]; the decay powers are those of the token gaps
// inside a document. Noncausal mode and md_cosine refuse documents with an error (noncausal sums every key of
// a row; md_cosine has one grid per row); fal_step ignores them (decoding continues the last document).
// Documents for another (B, N) or on another device are an error. Fused runs documents on every causal call it
// takes.
//
// Impl::Fused runs the fused CUDA kernels of fal and fal_with_state for f32/bf16/f16 inputs with LRPE none,
// cosine or rotate, acts other than softmax over the sequence and D, E <= 256 (D' x E up to 256 x 128); for
// md_cosine, softmax over the sequence or a larger state it throws, saying why (Composed runs those). Causal
// bf16/f16 calls with LRPE none, cosine or rotate, D 64 or 128, E <= 128 and elementwise acts (rotate: also
// softmax over the feature dim on q and k) run the chunked tensor-core kernels (bf16/f16 products, f32
// accumulation and carried states; the state enters the products in the inputs' dtype, and the backward
// stores its per-chunk states in it: with f16 inputs a state entry past 65504 overflows, which long sequences
// without decay can reach; bf16 has f32's range). Noncausal bf16/f16 calls with LRPE none, cosine or rotate,
// D 64 or 128, E <= 128 and elementwise acts or softmax over the feature dim on q and k run the noncausal
// chunk kernels (the same products; kv and dkv summed in f32, read by the row passes in the inputs' dtype,
// with the same f16 caveat). Rotate reaches them behind the LRPE family's rotate kernels, which write
// rotate(act(q)) and rotate(act(k)) to temporaries of the forward, made again by the backward. The others run a
// chunk sweep (tf32; f32 inputs in split tf32 at f32 accuracy). Impl::Auto (the rule in ops/impl.h) runs Fused
// for the calls that the chunk kernels take (faster than Composed both ways, and without its intermediates) and
// for causal calls that record no gradient (every fused causal forward is faster); the sweeps' backwards are
// slower than the composed ones, and the noncausal sweep's forward no faster.
// fal_step runs its fused kernel for f32/bf16/f16 CUDA inputs.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#include "../../core/tensor.h"
#include "../activation.h"
#include "../documents.h"
#include "../impl.h"

namespace lintape {

struct ActSpec {
  Act act = Act::None;
  ActDim dim = ActDim::None;  // softmax only: Feature or Sequence
};

enum class FalLrpe { None, Cosine, Rotate, MdCosine };

struct FalOptions {
  ActSpec q, k, v, g;
  FalLrpe lrpe = FalLrpe::None;
  Tensor theta;                   // as the LRPE family: (H, E_t), (1, E_t) or (H, 1) in 1-D; md (H or 1, E_t)
  int64_t offset = 0;             // 1-D LRPE: token s sits at position offset + s (prefill and fal_step);
                                  // must be 0 for md_cosine (the grid gives the positions)
  std::vector<int64_t> md_shape;  // md_cosine: the token grid
  int64_t md_extra_tokens = 0;    // md_cosine: L unencoded tokens in front
  bool causal = false;
  Tensor decay;                   // causal only, optional: (H) per-head lambda in (0, 1]; undefined = 1
  Documents documents;            // causal only: packed rows (ops/documents.h); the state and the 1-D LRPE
                                  // positions restart at each document start
};

FalLrpe fal_lrpe_from_name(const std::string& name);  // "none", "cosine", "rotate", "md_cosine"
const char* fal_lrpe_name(FalLrpe kind);

// o (B, N, H, E) in q's dtype.
Tensor fal(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalOptions& options,
           Impl impl = Impl::Auto);

// Causal only. S0 (B, H, D', E) float32 (f64 for f64 inputs) or undefined (zeros). Returns o and the final
// state S_{N-1}; gradients flow to S0 when it requires grad and from the final state when it is used.
std::pair<Tensor, Tensor> fal_with_state(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                         const Tensor& S0, const FalOptions& options, Impl impl = Impl::Auto);

// One decoding step, causal: q_t, k_t, v_t, g_t are (B, 1, H, D or E); the token sits at position
// options.offset (options.causal is implied). state (B, H, D', E) float32 is replaced by lambda state + kb_t^T
// vb_t (a new tensor); returns o_t (B, 1, H, E). Records no gradient (decoding). Softmax over the sequence is
// rejected as in causal mode; md_cosine has no 1-D position and is rejected.
Tensor fal_step(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                const FalOptions& options);

// D' for head dim D under this LRPE kind (2D for the cosine kinds).
int64_t fal_state_rows(FalLrpe kind, int64_t D);

}  // namespace lintape
