// Internal: the CUDA side of train/optimizer.h, over a module's flat float32 buffers (contiguous, one
// device). Both run on the device's lintape stream; only the gradient norm comes back to the host.
#pragma once
#if LINTAPE_WITH_CUDA
#include <utility>
#include "core/tensor.h"

namespace lintape::train_cuda {

// The scalars of one AdamW update, as the CPU loop uses them (float32).
struct AdamWScalars {
  float lr, shrink, beta1, beta2, eps, bias1, bias2;  // shrink = lr * weight_decay; bias_i = 1 - beta_i^t
};

// A queued step's scalars in device memory (a float64 tensor of kDeviceStepDoubles): the host writes lr
// and step (set_step_inputs_cuda) before the step's work, the step writes the rest (queue_step_cuda), and
// the host reads the loss and the gradient norm after it (read_step_cuda).
struct DeviceStep {
  double lr, step;          // in: the learning rate and the step's number t (1 for the first update)
  double loss, grad_norm;   // out: the step's loss and its gradient norm before the clip
  AdamWScalars scalars;     // the update's, from lr, t and the options
  int skip;                 // 1: the loss or the norm is not finite, no update
  float grad_scale;         // the clip's factor (1 when the norm is under the limit), applied as g is read
};
constexpr int64_t kDeviceStepDoubles = 9;
static_assert(sizeof(DeviceStep) <= kDeviceStepDoubles * sizeof(double), "DeviceStep outgrew its buffer");

// One fused pass: p, m, v updated in place from g; decay_mask is 1 where weight decay applies. copy, when
// defined (a bf16/f16 buffer like params), receives the updated parameters rounded to its dtype.
void adamw_step_cuda(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                     const Tensor& decay_mask, const AdamWScalars& s, const Tensor& copy = Tensor());

void set_step_inputs_cuda(const Tensor& state, double lr, int64_t step);
// The clip and the update with no host wait (a CUDA graph can capture it): the norm of grads as
// clip_grad_norm_cuda takes it, then `state`'s scalars from its lr and step, beta1, beta2, eps and
// weight_decay (skip when `loss`, a float32 scalar on the device, or the norm is not finite), the clip,
// and the update as adamw_step_cuda does it unless skipped. Bias corrections in float64, rounded to float32.
// The clip is folded into the update (each g read is scaled as clip_grad_norm_cuda would have scaled it,
// the same float32 product), so grads are left unclipped: one pass over them fewer.
void queue_step_cuda(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                     const Tensor& decay_mask, const Tensor& copy, const Tensor& loss, const Tensor& state,
                     double max_norm, double beta1, double beta2, double eps, double weight_decay);
// (loss, grad_norm) of the queued step: waits for it.
std::pair<double, double> read_step_cuda(const Tensor& state);

// The global L2 norm of grads, reduced on the device in float64 in a fixed order (deterministic); when it
// is finite and above max_norm, grads are scaled by max_norm / (norm + 1e-6) on the device, reading the
// norm from device memory. Returns the norm before clipping (the one value copied back).
double clip_grad_norm_cuda(const Tensor& grads, double max_norm);

}  // namespace lintape::train_cuda
#endif
