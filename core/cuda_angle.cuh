// For CUDA kernels: cos and sin of the LRPE angles pos * rate. A prefill and the steps after it must agree on
// the angles: every FAL kernel (chunked, sweep, step) uses angle_cs; the LRPE kernels, which take positions in
// double (md), use angle_sincos.
#pragma once
#include <cstdint>

namespace lintape::cuda_device {

// The angle rate * pos reduced modulo 2 pi in f32 (FP64 and its conversions are slow in the chunked kernels):
// pos * rate = hi + lo exactly (pos < 2^24 is exact in f32), then hi - k 2 pi with 2 pi in three parts
// (Cody-Waite; the first has 8 significant bits); within 4e-7 of the exact reduction (checked against double
// for positions up to 2^22). Larger positions reduce in double.
constexpr int64_t kF32Positions = int64_t(1) << 24;
__device__ __forceinline__ float reduce_f32(float rate, float p) {
  const float hi = __fmul_rn(p, rate), lo = fmaf(p, rate, -hi);
  const float k = rintf(hi * 0.15915494309189535f);
  float r = fmaf(-k, 6.28125f, hi);
  r = fmaf(-k, 1.9353071795864769e-3f, r);
  return fmaf(-k, 1.025313168e-11f, r) + lo;
}
__device__ __forceinline__ float reduce_f64(float rate, int64_t pos) {
  const double ang = double(pos) * double(rate);
  return float(ang - 6.283185307179586 * rint(ang * 0.15915494309189535));
}

// cos and sin of rate * pos, reduced in f32 below kF32Positions, else in double; on [-pi, pi] the fast sincos
// is within 2^-21 of the exact values.
__device__ __forceinline__ void angle_cs(float rate, int64_t pos, float& c, float& s) {
  __sincosf(pos < kF32Positions ? reduce_f32(rate, float(pos)) : reduce_f64(rate, pos), &s, &c);
}

// cos and sin of pos * rate. The product is exact in double (pos an integer below 2^29); reduced there
// to a fraction of a half turn, it keeps f32 accuracy at angles of tens of thousands of radians, and
// sincospif needs no slow path (sincosf's large-argument reduction lives in local memory). Whole turns
// are rounded off by adding and subtracting 1.5 * 2^52 (two adds on the double pipe, cheaper than rint).
__device__ __forceinline__ void angle_sincos(double pos, float rate, float& c, float& s) {
  constexpr double kRound = 0x1.8p52;
  double turns = pos * double(rate) * 0.31830988618379067;  // angle / pi
  turns -= 2.0 * ((0.5 * turns + kRound) - kRound);
  sincospif(float(turns), &s, &c);
}

}  // namespace lintape::cuda_device
