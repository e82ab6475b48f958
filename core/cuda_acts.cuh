// For CUDA kernels: the sigmoid in the precisions the kernels pick and the gradients of the sigmoid and silu
// acts. The first two share the exponential and differ in the reciprocal, the last goes through tanh; a kernel
// keeps the one it was measured and tested with.
#pragma once

namespace lintape::cuda_device {

// 2^x and 1 / x, one instruction each: subnormal results flush to zero (the library's versions add a fix-up
// for them, three instructions more); ex2 of a large x is +inf and its reciprocal 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / (1 + e^-x) with the fast division (the LRPE kernels) or the correctly rounded reciprocal (the FAL sweep
// kernels).
__device__ __forceinline__ float sigmoid_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_rn(float x) { return __frcp_rn(1.0f + __expf(-x)); }
// (1 + tanh(x / 2)) / 2 through one special-function instruction instead of two (tanh.approx: absolute error
// about 2^-11, so within a few units of 2^-12 of the sigmoid): for kernels whose results round to bf16 or f16
// (the chunked FAL kernels and the FAL step, which shares their acts).
__device__ __forceinline__ float sigmoid_tanh(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * x));
  return fmaf(0.5f, t, 0.5f);
}

// dx = act'(x) dy from s = sigmoid(x): for the sigmoid (s is then also its output) and for silu (x s).
__device__ __forceinline__ float sigmoid_grad(float s, float dy) { return dy * s * (1.0f - s); }
__device__ __forceinline__ float silu_grad(float x, float s, float dy) { return dy * s * (1.0f + x * (1.0f - s)); }

}  // namespace lintape::cuda_device
