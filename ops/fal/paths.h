// Internal to the FAL family: what its files share. fal.cpp checks the inputs, picks the path (the rule in
// ops/impl.h) and calls one of reference.cpp (loops in double with a hand-written backward), composed.cpp
// (primitive ops and the tape; causal in chunks: the masked, decayed product inside each chunk plus the carried
// state and S0 terms) or fused.cpp (the kernels of launch.h, ops/fal/noncausal.cu and ops/fal/causal.cu and the
// chunk kernels they dispatch to; the backward recorded on the tape). fal_step runs through primitive ops on the
// CPU (and for f64) and through its fused kernel (ops/fal/step.cu) on CUDA.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>
#include "core/tensor.h"
#include "ops/fal/fal.h"

namespace lintape::fal_paths {

// The state dtype: f32 always, f64 for f64 inputs (gradient checks).
inline DType state_dtype(DType input) { return input == DType::F64 ? DType::F64 : DType::F32; }

// fal.cpp: the decay per head (1 without one), and qb or kb through the LRPE family (which applies the act) or
// the act alone, impl picking the path.
std::vector<double> decay_values(const FalOptions& o, int64_t H);
Tensor act_lrpe(const Tensor& x, const ActSpec& a, const FalOptions& o, Impl impl);

// reference.cpp: act(x) of x (B, N, H, D) with its hand-written backward.
Tensor reference_act(const Tensor& x, const ActSpec& a);

// The paths of fal and fal_with_state: checked inputs (S0 undefined, or causal's initial state); they record
// their backward and return o and, causal, the final state. run_reference runs on the CPU.
std::pair<Tensor, Tensor> run_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& S0, const FalOptions& o, const char* op);
std::pair<Tensor, Tensor> run_composed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                       const Tensor& S0, const FalOptions& o);

// The paths of fal_step: checked inputs, causal and one token each; no gradient recorded.
Tensor step_composed(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                     const FalOptions& o);

#if LINTAPE_WITH_CUDA
// fused.cpp. fused_unsupported: why the fused sequence kernels cannot run this call, or nullptr when they can.
// chunked: true when the call runs the chunk kernels (causal: chunk-parallel; noncausal: ops/fal/noncausal.cuh),
// whose forward and backward are faster than the composed ones. rotates_first: true for the rotate calls among
// them: the LRPE family's rotate kernels put q and k through their acts and the rotation, and the chunk kernels
// take q' and k' with no act and no LRPE (the same call with LRPE none; f32 and the others run the sweep).
// run_fused: a call that fused_unsupported accepts, with tokens. step_fused: CUDA inputs other than f64.
const char* fused_unsupported(const Tensor& q, const Tensor& v, const FalOptions& o);
bool chunked(const Tensor& q, const Tensor& v, const FalOptions& o);
bool rotates_first(const Tensor& q, const Tensor& v, const FalOptions& o);
std::pair<Tensor, Tensor> run_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& S0, const FalOptions& o, const char* op);
Tensor step_fused(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                  const FalOptions& o);
// Which chunk states run_fused's causal forward on the chunk kernels saves for its recorded backward: every
// chunk's (All), the even chunks' (Half: half the memory; the backward advances each odd chunk's from the one
// before) or none (the backward computes them). Auto: LINTAPE_FAL_SAVE_STATES (0: None, all: All, else Half).
// For tests; process-wide, not thread-safe.
enum class SavedStates { Auto, All, Half, None };
void set_saved_states(SavedStates s);
#else
// Without CUDA the fused kernels take no call.
inline const char* fused_unsupported(const Tensor&, const Tensor&, const FalOptions&) {
  return "lintape was built without CUDA";
}
inline bool chunked(const Tensor&, const Tensor&, const FalOptions&) { return false; }
inline bool rotates_first(const Tensor&, const Tensor&, const FalOptions&) { return false; }
#endif

}  // namespace lintape::fal_paths
