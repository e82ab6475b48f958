// Which implementation of a fused op to run. Tests and benchmarks pick one; users leave Auto.
#pragma once

namespace lintape {

enum class Impl {
  Auto,       // Fused on CUDA, Reference on the CPU
  Fused,      // the fused CUDA kernels (forward and backward)
  Composed,   // the same math through primitive ops, differentiated by the tape
  Reference,  // plain CPU loops with a hand-written backward; any float dtype (f64 for gradcheck)
};

}  // namespace lintape
