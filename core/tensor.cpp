#include "core/tensor.h"
#include <cmath>
#include <cstring>
#include <functional>
#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>
#include "core/kernels.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t v : s) n *= v;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  LT_CHECK(d >= -n && d < n, "[size] dim ", d, " is out of range for a tensor of shape ", shape_str(shape()));
  return shape()[size_t(d < 0 ? d + n : d)];
}

bool Tensor::is_contiguous() const {
  const Shape& sh = shape();
  const Shape& st = strides();
  int64_t expect = 1;
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] != 1 && st[i] != expect) return false;
    expect *= sh[i];
  }
  return true;
}

void* Tensor::data() const {
  return static_cast<char*>(storage().data) + offset() * int64_t(dtype_size(dtype()));
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = checked().storage;
  impl->shape = shape();
  impl->strides = strides();
  impl->offset = offset();
  impl->dtype = dtype();
  return Tensor(impl);
}

Tensor& Tensor::requires_grad_(bool on) {
  LT_CHECK(!on || is_floating(dtype()), "[requires_grad_] only float tensors can require grad; got a tensor of ",
           dtype_name(dtype()));
  LT_CHECK(is_leaf() || on, "[requires_grad_] requires_grad_(false) on a non-leaf tensor; use detach()");
  checked().requires_grad = on;
  return *this;
}

#if LINTAPE_WITH_CUDA
namespace {
// A contiguous tensor with the same values on the same device; no autograd.
Tensor contiguous_raw(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.shape(), t.dtype(), t.device());
  out.copy_(t);
  return out;
}
}  // namespace
#endif

Tensor& Tensor::copy_(const Tensor& src) {
  LT_CHECK(shape() == src.shape(), "[copy_] expected a source of the destination's shape ", shape_str(shape()), "; got ",
           shape_str(src.shape()));
  storage().version++;
  if (numel() == 0) return *this;
  if (device() == src.device()) {
#if LINTAPE_WITH_CUDA
    if (is_cuda()) {
      core_kernels::copy_cuda(*this, src);
      return *this;
    }
#endif
    core_kernels::copy_cpu(*this, src);
    return *this;
  }
#if LINTAPE_WITH_CUDA
  // Across devices: bring a contiguous copy of src over in its own dtype, then convert in place.
  Tensor s = contiguous_raw(src);
  Tensor staged = (dtype() == s.dtype() && is_contiguous()) ? *this : empty(shape(), s.dtype(), device());
  cudaMemcpyKind kind = s.is_cuda() ? (is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                    : cudaMemcpyHostToDevice;
  // The copy runs on the destination's stream (the source's for a copy to the host), after the source's
  // queued work, and is waited for: the temporaries above may be reused as soon as this returns.
  if (s.is_cuda()) cuda::synchronize(s.device().index);
  int dev = is_cuda() ? device().index : s.device().index;
  if (s.is_cuda() && is_cuda())
    LT_CUDA_CHECK(cudaMemcpyPeerAsync(staged.data(), device().index, s.data(), s.device().index, s.nbytes(),
                                      cuda::stream(dev)));
  else
    LT_CUDA_CHECK(cudaMemcpyAsync(staged.data(), s.data(), s.nbytes(), kind, cuda::stream(dev)));
  cuda::synchronize(dev);
  if (staged.impl() != impl()) copy_(staged);
  return *this;
#else
  fail(str("[copy_] lintape was built without CUDA; cannot copy from ", src.device().name(), " to ",
           device().name()));
#endif
}

Tensor& Tensor::fill_(double value) {
  storage().version++;
#if LINTAPE_WITH_CUDA
  if (is_cuda()) {
    core_kernels::fill_cuda(*this, value);
    return *this;
  }
#endif
  core_kernels::fill_cpu(*this, value);
  return *this;
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = empty(shape(), dtype_of<T>::value, Device::cpu());
  host.copy_(*this);
  const T* p = host.data_ptr<T>();
  return std::vector<T>(p, p + host.numel());
}
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;

double Tensor::item() const {
  LT_CHECK(numel() == 1, "[item] expected a tensor with one element; got shape ", shape_str(shape()));
  return to_vector<double>()[0];
}

std::string Tensor::to_string(int64_t max_per_dim) const {
  std::ostringstream os;
  os << "tensor" << shape_str(shape()) << " " << dtype_name(dtype()) << " " << device().name();
  if (requires_grad()) os << " requires_grad";
  std::vector<double> v = to_vector<double>();
  const Shape& sh = shape();
  // Prints nested brackets, eliding the middle of any dim longer than max_per_dim.
  std::function<void(size_t, int64_t)> rec = [&](size_t d, int64_t base) {
    if (d == sh.size()) {
      os << std::setprecision(5) << v[size_t(base)];
      return;
    }
    int64_t n = sh[d];
    int64_t inner = 1;
    for (size_t k = d + 1; k < sh.size(); ++k) inner *= sh[k];
    os << "[";
    for (int64_t i = 0; i < n; ++i) {
      if (n > max_per_dim && i == max_per_dim / 2) {
        os << "..., ";
        i = n - max_per_dim / 2 - 1;
        continue;
      }
      rec(d + 1, base + i * inner);
      if (i + 1 < n) os << ", ";
    }
    os << "]";
  };
  os << "\n";
  rec(0, 0);
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

namespace {
// Every factory allocates through this, under the name the caller used, so that a bad shape given to
// randn or zeros is reported as [randn] or [zeros] rather than as the internal [empty].
Tensor allocate(const char* factory, const Shape& shape, DType dtype, Device device) {
  LT_CHECK(shape.size() <= size_t(kMaxDims), "[", factory, "] tensors have at most ", kMaxDims, " dims; got shape ",
           shape_str(shape));
  int64_t numel = 1;
  for (int64_t s : shape) {
    LT_CHECK(s >= 0, "[", factory, "] sizes must be >= 0; got shape ", shape_str(shape));
    LT_CHECK(!__builtin_mul_overflow(numel, s, &numel) && numel <= INT64_MAX / 8, "[", factory, "] shape ",
             shape_str(shape), " has too many elements");
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(size_t(numel) * dtype_size(dtype), device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor filled(const char* factory, const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = allocate(factory, shape, dtype, device);
  t.fill_(value);
  return t;
}
}  // namespace

Tensor empty(const Shape& shape, DType dtype, Device device) { return allocate("empty", shape, dtype, device); }

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  return filled("full", shape, value, dtype, device);
}
Tensor zeros(const Shape& shape, DType dtype, Device device) { return filled("zeros", shape, 0.0, dtype, device); }
Tensor ones(const Shape& shape, DType dtype, Device device) { return filled("ones", shape, 1.0, dtype, device); }
Tensor empty_like(const Tensor& like) { return empty(like.shape(), like.dtype(), like.device()); }
Tensor zeros_like(const Tensor& like) { return zeros(like.shape(), like.dtype(), like.device()); }

Tensor arange(int64_t start, int64_t end, DType dtype, Device device) {
  LT_CHECK(end >= start, "[arange] expected end >= start; got start ", start, ", end ", end);
  Tensor t = empty({end - start}, dtype, device);
#if LINTAPE_WITH_CUDA
  if (device.is_cuda()) {
    core_kernels::arange_cuda(t, start);
    return t;
  }
#endif
  core_kernels::arange_cpu(t, start);
  return t;
}

namespace {
Tensor random_tensor(const Shape& shape, DType dtype, Device device, uint64_t seed, bool normal) {
  LT_CHECK(is_floating(dtype), "[", normal ? "randn" : "rand", "] expected a float dtype; got ", dtype_name(dtype));
  Tensor t = allocate(normal ? "randn" : "rand", shape, dtype, device);
#if LINTAPE_WITH_CUDA
  if (device.is_cuda()) {
    core_kernels::random_cuda(t, seed, normal);
    return t;
  }
#endif
  core_kernels::random_cpu(t, seed, normal);
  return t;
}
}  // namespace

Tensor randn(const Shape& shape, DType dtype, Device device, uint64_t seed) {
  return random_tensor(shape, dtype, device, seed, true);
}
Tensor rand(const Shape& shape, DType dtype, Device device, uint64_t seed) {
  return random_tensor(shape, dtype, device, seed, false);
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype, Device device) {
  LT_CHECK(int64_t(values.size()) == shape_numel(shape), "[from_vector] expected ", shape_numel(shape), " values for shape ",
           shape_str(shape), "; got ", values.size());
  Tensor host = empty(shape, DType::F64, Device::cpu());
  if (!values.empty()) std::memcpy(host.data(), values.data(), values.size() * sizeof(double));  // no null to memcpy
  if (dtype == DType::F64 && !device.is_cuda()) return host;
  Tensor out = empty(shape, dtype, device);
  out.copy_(host);
  return out;
}

Tensor from_vector_i64(const std::vector<int64_t>& values, const Shape& shape, Device device) {
  LT_CHECK(int64_t(values.size()) == shape_numel(shape), "[from_vector_i64] expected ", shape_numel(shape),
           " values for shape ", shape_str(shape), "; got ", values.size());
  Tensor host = empty(shape, DType::I64, Device::cpu());
  if (!values.empty()) std::memcpy(host.data(), values.data(), values.size() * sizeof(int64_t));
  if (!device.is_cuda()) return host;
  Tensor out = empty(shape, DType::I64, device);
  out.copy_(host);
  return out;
}

void poison_(Tensor& t) {
  if (is_floating(t.dtype()))
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  else
    t.fill_(t.dtype() == DType::I32 ? double(std::numeric_limits<int32_t>::min()) : -9.0e18);
}

}  // namespace lintape
