// Internal: the CUDA side of train/optimizer.h, over a module's flat float32 buffers (contiguous, one
// device). Both run on the device's lintape stream; only the gradient norm comes back to the host.
#pragma once
#if LINTAPE_WITH_CUDA
#include "core/tensor.h"

namespace lintape::train_cuda {

// The scalars of one AdamW update, as the CPU loop uses them (float32).
struct AdamWScalars {
  float lr, shrink, beta1, beta2, eps, bias1, bias2;  // shrink = lr * weight_decay; bias_i = 1 - beta_i^t
};

// One fused pass: p, m, v updated in place from g; decay_mask is 1 where weight decay applies. copy, when
// defined (a bf16/f16 buffer like params), receives the updated parameters rounded to its dtype.
void adamw_step_cuda(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                     const Tensor& decay_mask, const AdamWScalars& s, const Tensor& copy = Tensor());

// The global L2 norm of grads, reduced on the device in float64 in a fixed order (deterministic); when it
// is finite and above max_norm, grads are scaled by max_norm / (norm + 1e-6) on the device, reading the
// norm from device memory. Returns the norm before clipping (the one value copied back).
double clip_grad_norm_cuda(const Tensor& grads, double max_norm);

}  // namespace lintape::train_cuda
#endif
