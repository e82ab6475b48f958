#include "core/dtype.h"
#include <cmath>

namespace lintape {

DType dtype_from_name(const std::string& name) {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64})
    if (name == dtype_name(t)) return t;
  fail(str("[dtype] unknown dtype '", name, "'; expected one of f32, bf16, f16, f64, i32, i64"));
}

f16::f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) { bits = uint16_t(sign | 0x7e00u); return; }  // NaN
  if (mag >= 0x477ff000u) { bits = uint16_t(sign | 0x7c00u); return; }  // rounds to >= 65520: inf
  if (mag < 0x38800000u) {  // below the smallest normal half: subnormal or zero, rounded to nearest even
    float a = std::fabs(f) * 16777216.0f;  // in units of 2^-24
    float r = std::nearbyint(a);
    bits = uint16_t(sign | uint32_t(r));
    return;
  }
  uint32_t e = (mag >> 23) - 112;  // rebias 127 -> 15
  uint32_t m = mag & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
  bits = uint16_t(sign | h);
}

f16::operator float() const {
  uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  uint32_t e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu;
  float f;
  if (e == 0) {
    f = std::ldexp(float(m), -24);
    return sign ? -f : f;
  }
  uint32_t u = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112) << 23) | (m << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace lintape
