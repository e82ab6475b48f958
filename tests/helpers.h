// Shared test helpers: the CUDA skip rule, dtype-aware comparisons, error-message checks, gradcheck.
#pragma once
#include <doctest/doctest.h>
#include <cmath>
#include <functional>
#include <iostream>
#include <string>
#include <vector>
#include "autograd/gradcheck.h"
#include "autograd/tape.h"
#include "core/tensor.h"

namespace lintape::test {

// CUDA test cases are declared `TEST_CASE("cuda ..." * LT_CUDA_CASE)` and start with LT_REQUIRE_CUDA().
// Without a GPU doctest skips them (the decorator), and ctest reports each as skipped, never as passed
// (tests/CMakeLists.txt). Run with --no-skip, the body prints the reason and ends.
#define LT_REQUIRE_CUDA()                                                       \
  do {                                                                          \
    if (!::lintape::cuda_available()) {                                         \
      std::cout << "SKIPPED: no CUDA device (or built without CUDA)" << std::endl; \
      return;                                                                   \
    }                                                                           \
  } while (0)

// Decided once, when the cases are registered: skipped when no device is found at start.
#define LT_CUDA_CASE ::doctest::skip(!::lintape::cuda_available())

inline Device gpu() { return Device::cuda(0); }

// ||out - ref|| / ||ref|| in double on the CPU; infinity if any element of out is NaN or inf.
inline double rel_error(const Tensor& out, const Tensor& ref) {
  REQUIRE(out.shape() == ref.shape());
  std::vector<double> o = out.to_vector<double>(), r = ref.to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    if (!std::isfinite(o[i])) return INFINITY;
    num += (o[i] - r[i]) * (o[i] - r[i]);
    den += r[i] * r[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Relative error a kernel of this dtype may show against an f64 reference.
inline double tolerance(DType t) {
  switch (t) {
    case DType::F64: return 1e-10;
    case DType::F32: return 1e-5;
    case DType::F16: return 5e-3;
    case DType::BF16: return 1.6e-2;
    default: return 0;
  }
}

#define CHECK_CLOSE_TENSOR(out, ref, dtype)                                     \
  do {                                                                          \
    double lt_err_ = ::lintape::test::rel_error(out, ref);                      \
    INFO("relative error " << lt_err_ << " (tolerance " << ::lintape::test::tolerance(dtype) << ")"); \
    CHECK(lt_err_ <= ::lintape::test::tolerance(dtype));                        \
  } while (0)

// Checks that fn throws a lintape::Error whose message contains every one of `parts`.
inline void check_throws_containing(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts) {
      INFO("message: " << msg);
      CHECK_MESSAGE(msg.find(p) != std::string::npos, "expected the error to mention '" << p << "'");
    }
    return;
  }
  FAIL("expected a lintape::Error mentioning '" << (parts.empty() ? std::string() : parts[0]) << "'");
}

// LRPE-like rates for theta (H, E): theta[h, k] = 10000^(-k / E) * (1 + h / 4), f32.
inline Tensor rates(const Shape& shape, Device dev = Device::cpu()) {
  std::vector<double> v;
  for (int64_t h = 0; h < shape[0]; ++h)
    for (int64_t k = 0; k < shape[1]; ++k)
      v.push_back(std::pow(10000.0, -double(k) / double(shape[1])) * (1 + double(h) / 4));
  return from_vector(v, shape, DType::F32, dev);
}

// An f64 CPU leaf requiring grad, with random values (shifted away from 0 with `shift` if asked).
inline Tensor leaf(const Shape& shape, uint64_t seed, double shift = 0.0) {
  Tensor t = randn(shape, DType::F64, Device::cpu(), seed);
  if (shift != 0.0) {
    std::vector<double> v = t.to_vector<double>();
    for (double& x : v) x += (x >= 0 ? shift : -shift);
    t = from_vector(v, shape, DType::F64);
  }
  t.requires_grad_();
  return t;
}

#define CHECK_GRADCHECK(fn, inputs)                              \
  do {                                                           \
    ::lintape::GradcheckResult lt_gc_ = ::lintape::gradcheck(fn, inputs); \
    INFO(lt_gc_.message);                                        \
    CHECK(lt_gc_.ok);                                            \
  } while (0)

}  // namespace lintape::test
