#pragma once
#include "../core/tensor.h"

namespace lintape {

// weight (V, C), ids (...) of i64 or i32 -> (..., C). Backward scatter-adds into the weight's gradient
// (on CUDA through f32 atomics, so the summation order is not fixed); ids are not differentiable.
// An id outside [0, V) is an error on either device; on CUDA the gather records it in a device flag
// that is read back after the launch, which waits for the stream once per call.
Tensor embedding(const Tensor& weight, const Tensor& ids);

}  // namespace lintape
