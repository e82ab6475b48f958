// Which implementation of a fused op to run. Tests and benchmarks pick one; users leave Auto.
#pragma once

namespace lintape {

// Impl::Auto is one rule for every fused family (LRPE, FAL, TPA): Reference on the CPU; on CUDA, Fused for the
// calls that the family's fused kernels take and run faster than Composed (the forward alone when the call
// records no gradient, else forward and backward), Composed for the others (f64 among them: the kernels take
// f32, bf16 and f16). Each family's header names its calls.
enum class Impl {
  Auto,       // the rule above
  Fused,      // the fused CUDA kernels (forward and backward)
  Composed,   // the same math through primitive ops, differentiated by the tape
  Reference,  // plain CPU loops with a hand-written backward; any float dtype (f64 for gradcheck)
};

}  // namespace lintape
