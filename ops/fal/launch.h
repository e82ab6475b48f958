// Internal to the FAL family: the launchers of the fused CUDA kernels (ops/fal/*.cu). ops/fal/fal.cpp checks the
// inputs and calls them; tests call them directly on poisoned outputs.
#pragma once
#include <cstdint>
#include "core/tensor.h"

namespace lintape {

// One call's description, already checked: the act codes, the LRPE rule and the decay. The step and the
// sequence kernels share it; for a sequence, position is the first token's (FalOptions::offset).
struct FalStepSpec {
  enum ActCode : int { kNone, kRelu, kSigmoid, kSilu, kSoftmaxFeature };
  enum LrpeCode : int { kNoLrpe, kCosine, kRotate };
  int act_q = kNone, act_k = kNone, act_v = kNone, act_g = kNone;
  int lrpe = kNoLrpe;
  Tensor theta;          // (H or 1, E_t) f32 contiguous on the inputs' device; undefined without LRPE
  int64_t position = 0;  // the token's position (FalOptions::offset)
  Tensor decay;          // (H) f32 on the inputs' device, or undefined (no decay)
  Tensor starts;         // sequences: (B, N) int32 documents' starts (ops/documents.h), or undefined (none)
};

#if LINTAPE_WITH_CUDA
namespace fal_cuda {

// The fields that the arguments of the chunk kernels and of the sweeps (chunk::Args, SweepArgs) both take from
// the inputs and the spec: the pointers, the dims, the LRPE, the decay and the acts.
template <class Args>
void fill_common_args(Args& a, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const FalStepSpec& spec) {
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.g = g.data();
  a.theta = spec.theta.defined() ? spec.theta.data_ptr<float>() : nullptr;
  a.theta_rows = spec.theta.defined() ? int(spec.theta.size(0)) : 0;
  a.theta_cols = spec.theta.defined() ? int(spec.theta.size(1)) : 0;
  a.decay = spec.decay.defined() ? spec.decay.data_ptr<float>() : nullptr;
  a.H = int(q.size(2));
  a.D = int(q.size(3));
  a.E = int(v.size(3));
  a.P = spec.lrpe == FalStepSpec::kCosine ? 2 * a.D : a.D;
  a.position = spec.position;
  a.act_q = spec.act_q;
  a.act_k = spec.act_k;
  a.act_v = spec.act_v;
  a.act_g = spec.act_g;
  a.lrpe = spec.lrpe;
}
// dO and the gradients' pointers, for the same two.
template <class Args>
void set_gradient_pointers(Args& a, const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                           const Tensor& dg) {
  a.dout = dout.data();
  a.dq = dq.data();
  a.dk = dk.data();
  a.dv = dv.data();
  a.dg = dg.data();
}

// q, k (B, 1, H, D), v, g (B, 1, H, E) contiguous f32/bf16/f16; state_in, state_out (B, H, D', E) f32
// contiguous (distinct); out (B, 1, H, E) in the inputs' dtype. Writes every element of state_out and out.
void step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
          const Tensor& state_in, const Tensor& state_out, const Tensor& out);

// The sequence kernels (ops/fal/noncausal.cu, ops/fal/causal.cu) keep a (D', E) f32 state of one (b, h) in
// shared memory: true when it fits, with D, E <= 256 (above that Auto runs Composed).
bool sequence_supported(int64_t D, int64_t P, int64_t E);

// Noncausal: true when the chunk kernels (ops/fal/noncausal.cuh) run the call (bf16/f16, LRPE none or cosine,
// D 64 or 128, E a multiple of 8 up to 128, softmax over the feature dim on q and k only); else the sweep.
bool noncausal_chunked(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec);

// Noncausal. q (B, N, H, D), k (B, M, H, D), v (B, M, H, E), g (B, N, H, E) f32/bf16/f16, views whose last two
// dims are contiguous rows (the chunk kernels read them in place, the sweep copies them); kv (B, H, D', E) f32
// receives kb^T vb (saved for backward); out (B, N, H, E) contiguous in the inputs' dtype.
void noncausal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                       const Tensor& kv, const Tensor& out);
// dout (B, N, H, E) contiguous in the inputs' dtype; kv as forward wrote it; writes dq, dk, dv, dg (the
// inputs' shapes and dtype; strided like the inputs when the chunk kernels run, else contiguous).
void noncausal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                        const Tensor& kv, const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dg);

// Causal, N == M: the number of segments the sweeps cut the sequence into for B x H = BH on a GPU of `sms`
// SMs (each keeps one (B, H, D', E) f32 state while the kernels run; 1: none), and the tokens of each but the
// last segment (cuda::sm_count gives a device's SMs).
int64_t causal_segments(int64_t BH, int64_t N, int sms);
int64_t causal_segment_tokens(int64_t N, int64_t G);

// Causal, N == M: true when the chunked tensor-core kernels (ops/fal/chunk.cuh) run the call (bf16/f16, LRPE none
// or cosine, D 64 or 128, E a multiple of 8 up to 128, elementwise acts); else the chunk sweep runs it.
bool causal_chunked(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec);

// Causal chunk kernels: the segments that each (b, h)'s nC 64-token chunks are cut into, for the fused forward
// (fused) or the backward's state passes, on a GPU of `sms` SMs (1: none). Each segment but the last keeps one
// (D', E) f32 boundary state per (b, h) while the kernels run.
struct ChunkShape {
  int64_t BH, nC, D, P, E;  // P = D' (2 D with cosine LRPE)
};
int64_t chunk_segments(const ChunkShape& shape, int sms, bool fused);
// The Hopper forward's balanced cut: the blocks (one an SM) that walk equal runs of the list of every (b, h)'s
// chunks, across (b, h)s, or 0 where the uniform cut (chunk_segments) is about as fast.
int64_t balanced_blocks(const ChunkShape& shape, int sms);
// The balanced cut's blocks for the Hopper forward: 0 as the shapes want (balanced_blocks; the environment's
// LINTAPE_FAL_FORWARD_BLOCKS where set), n > 0 that many, -1 none (the uniform cut). Calls that ask for a
// number of segments keep the uniform cut. For tests; process-wide, not thread-safe.
void set_forward_blocks(int64_t blocks);

// Which kernel runs the causal chunk kernels' state passes (the backward's; the forward's when it did not save
// the chunk states; the local passes of a cut): Walk, one wgmma block per (b, h) and segment holding the whole
// state (ops/fal/chunk_state.cu; sm_90a builds on a device of compute capability 9.0, calls without documents),
// or Slices, mma.sync blocks per 64 x 64 state tile (ops/fal/chunk_fwd.cu; every call). Auto: Walk where it
// runs unless LINTAPE_FAL_STATE_PASS=slices, else Slices (bench/notes/fal-hopper.md, session 8). For tests,
// which run each; process-wide, not thread-safe.
enum class StatePassKernel { Auto, Slices, Walk };
void set_state_pass_kernel(StatePassKernel kernel);

// Which kernel runs the causal chunk kernels' forward: Auto, the wgmma kernel (ops/fal/chunk_fwd_hopper.cu) where
// it runs (sm_90a builds on a device of compute capability 9.0; not the local passes of a cut or calls with
// documents) unless LINTAPE_FAL_FORWARD=chunks, else the mma.sync kernel (ops/fal/chunk_fwd.cu), which Chunks
// picks for every call. For tests, which run each; process-wide, not thread-safe.
enum class ForwardKernel { Auto, Chunks };
void set_forward_kernel(ForwardKernel kernel);

// Which kernel runs the causal chunk kernels' gradients (dq, dk, dv, dg from the chunk states): Auto, the wgmma
// kernel (ops/fal/chunk_bwd_hopper.cu) where it runs (sm_90a builds on a device of compute capability 9.0; not
// calls with documents) unless LINTAPE_FAL_GRADIENT=chunks, else the mma.sync kernel (ops/fal/chunk_bwd.cu),
// which Chunks picks for every call. For tests, which run each; process-wide, not thread-safe.
enum class GradientKernel { Auto, Chunks };
void set_gradient_kernel(GradientKernel kernel);

// Causal, N == M. q, k, v, g may be views whose last two dims are contiguous rows (e.g. slices of one
// projection): the chunk kernels read them in place, the sweep copies them. S0 (B, H, D', E) f32 or undefined
// (zeros); writes out and S_final (B, H, D', E) f32. segments: 0 cuts the sequence as the shapes want (see
// causal_segments and chunk_segments); tests pass a count to run a given cut. states (chunk kernels only, see
// causal_chunked; else undefined): (B, H, nC, D', E) in the inputs' dtype, nC = ceil(N / 64), receives the state
// entering every 64-token chunk for causal_backward; (B, H, ceil(nC / 2), D', E) those entering the even chunks
// (the backward then advances each odd chunk's from the one before: half the memory, a little more time).
void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                    const Tensor& S0, const Tensor& out, const Tensor& S_final, int64_t segments = 0,
                    const Tensor& states = Tensor());
// dout as in noncausal_backward; dS_final f32 or undefined (zeros); dS0 is written when defined. fwd_states: the
// states causal_forward saved for the same inputs and S0, or undefined (the backward computes them).
void causal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                     const Tensor& S0, const Tensor& dout, const Tensor& dS_final, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dS0, int64_t segments = 0,
                     const Tensor& fwd_states = Tensor());

}  // namespace fal_cuda
#endif

}  // namespace lintape
