// For CUDA kernels: sums and maxima across the lanes of a warp (butterfly shuffles).
#pragma once

namespace lintape::cuda_device {

// The sum (max) of v over aligned groups of Lanes lanes (a power of two, 32: the whole warp); every lane of the
// warp takes part and gets its group's result.
template <int Lanes = 32, class A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = Lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int Lanes = 32>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = Lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace lintape::cuda_device
