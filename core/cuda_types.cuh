// For CUDA kernels: the device element type of each DType, float conversions, and the dispatch
// helpers (LT_DISPATCH_FLOAT_CUDA binds T to float, double, __nv_bfloat16 or __half).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "core/cuda.h"
#include "core/dtype.h"
#include "core/strided.h"

namespace lintape::cuda {

// Compute type: float for the 16- and 32-bit floats, double for double.
template <class T> struct acc_type { using type = float; };
template <> struct acc_type<double> { using type = double; };
template <class T> using acc_t = typename acc_type<T>::type;

template <class T> __device__ __forceinline__ acc_t<T> to_acc(T v) { return acc_t<T>(v); }
template <> __device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T from_acc(acc_t<T> v) { return T(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_acc(float v) { return __float2half(v); }

// Whether a pointer allows 16-byte vector accesses (Pack of 16 bytes).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// V elements in one aligned word (16 bytes for V = 16 / sizeof(T)): vector loads and stores.
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Plain conversions through double for copies between any two types.
template <class T> __device__ __forceinline__ double to_double(T v) { return double(v); }
template <> __device__ __forceinline__ double to_double(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
template <> __device__ __forceinline__ double to_double(__half v) { return double(__half2float(v)); }
template <class T> __device__ __forceinline__ T from_double(double v) { return T(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_double(double v) { return __float2bfloat16(float(v)); }
template <> __device__ __forceinline__ __half from_double(double v) { return __float2half(float(v)); }

}  // namespace lintape::cuda

#define LT_DISPATCH_FLOAT_CUDA(dtype, opname, T, ...)                                                      \
  switch (dtype) {                                                                                         \
    LT_DISPATCH_CASE(F32, float, T, __VA_ARGS__)                                                           \
    LT_DISPATCH_CASE(F64, double, T, __VA_ARGS__)                                                          \
    LT_DISPATCH_CASE(BF16, __nv_bfloat16, T, __VA_ARGS__)                                                  \
    LT_DISPATCH_CASE(F16, __half, T, __VA_ARGS__)                                                          \
    default:                                                                                               \
      ::lintape::fail(::lintape::str("[", opname, "] expected a float dtype (f32, f64, bf16, f16); got ",  \
                                     ::lintape::dtype_name(dtype)));                                       \
  }
#define LT_DISPATCH_ALL_CUDA(dtype, opname, T, ...)            \
  switch (dtype) {                                             \
    LT_DISPATCH_CASE(F32, float, T, __VA_ARGS__)               \
    LT_DISPATCH_CASE(F64, double, T, __VA_ARGS__)              \
    LT_DISPATCH_CASE(BF16, __nv_bfloat16, T, __VA_ARGS__)      \
    LT_DISPATCH_CASE(F16, __half, T, __VA_ARGS__)              \
    LT_DISPATCH_CASE(I32, int32_t, T, __VA_ARGS__)             \
    LT_DISPATCH_CASE(I64, int64_t, T, __VA_ARGS__)             \
  }
