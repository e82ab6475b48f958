// Element types and the named dispatch helpers that turn a runtime DType into a C++ type.
#pragma once
#include <cstdint>
#include <cstddef>
#include <string>
#include <cstring>
#include "error.h"

namespace lintape {

enum class DType : uint8_t { F32, BF16, F16, F64, I32, I64 };

// Host element types for the 16-bit floats, bit-compatible with CUDA's __nv_bfloat16 and __half.
// Conversions round to nearest even; arithmetic goes through float.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  bf16(float f) {  // NOLINT: implicit, like the built-in float types
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = uint16_t((u >> 16) | 0x40u); return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct f16 {
  uint16_t bits = 0;
  f16() = default;
  f16(float f);  // NOLINT
  operator float() const;
};

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
  }
  return "?";
}

DType dtype_from_name(const std::string& name);  // "f32", "bf16", ...; throws on an unknown name

inline bool is_floating(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F64; }
inline bool is_float16(DType t) { return t == DType::BF16 || t == DType::F16; }  // the 16-bit floats

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::F64; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::F16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::I64; };

}  // namespace lintape

// LT_DISPATCH_FLOAT(dtype, "op", T, body): runs body with T bound to the host type of a float dtype.
#define LT_DISPATCH_CASE(ENUM, TYPE, T, ...) \
  case ::lintape::DType::ENUM: {             \
    using T = TYPE;                          \
    __VA_ARGS__;                             \
    break;                                   \
  }
#define LT_DISPATCH_FLOAT(dtype, opname, T, ...)                                           \
  switch (dtype) {                                                                         \
    LT_DISPATCH_CASE(F32, float, T, __VA_ARGS__)                                           \
    LT_DISPATCH_CASE(F64, double, T, __VA_ARGS__)                                          \
    LT_DISPATCH_CASE(BF16, ::lintape::bf16, T, __VA_ARGS__)                                \
    LT_DISPATCH_CASE(F16, ::lintape::f16, T, __VA_ARGS__)                                  \
    default:                                                                               \
      ::lintape::fail(::lintape::str("[", opname, "] expected a float dtype (f32, f64, bf16, f16); got ", \
                                     ::lintape::dtype_name(dtype)));                       \
  }
#define LT_DISPATCH_ALL(dtype, opname, T, ...)                    \
  switch (dtype) {                                                \
    LT_DISPATCH_CASE(F32, float, T, __VA_ARGS__)                  \
    LT_DISPATCH_CASE(F64, double, T, __VA_ARGS__)                 \
    LT_DISPATCH_CASE(BF16, ::lintape::bf16, T, __VA_ARGS__)       \
    LT_DISPATCH_CASE(F16, ::lintape::f16, T, __VA_ARGS__)         \
    LT_DISPATCH_CASE(I32, int32_t, T, __VA_ARGS__)                \
    LT_DISPATCH_CASE(I64, int64_t, T, __VA_ARGS__)                \
  }
