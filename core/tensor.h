// Tensor: a shape, strides and offset over shared storage, with a dtype, a device and autograd state.
// Copying a Tensor is cheap (it shares the implementation). Views share storage.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>
#include "allocator.h"
#include "device.h"
#include "dtype.h"
#include "error.h"

namespace lintape {

namespace autograd { struct Node; }

using Shape = std::vector<int64_t>;
constexpr int kMaxDims = 8;

std::string shape_str(const Shape& s);  // "(12, 256, 12, 128)"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

class Tensor;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape, strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::F32;
  // autograd state
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<autograd::Node> grad_fn;  // set on outputs of recorded ops; empty for leaves
  int output_index = 0;                     // which output of grad_fn this tensor is
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  const Shape& shape() const { return checked().shape; }
  const Shape& strides() const { return checked().strides; }
  int64_t offset() const { return checked().offset; }
  int64_t dim() const { return int64_t(shape().size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape()); }
  DType dtype() const { return checked().dtype; }
  Device device() const { return checked().storage->device; }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_contiguous() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype()); }
  Storage& storage() const { return *checked().storage; }

  void* data() const;  // address of the first element
  template <class T> T* data_ptr() const {
    LT_CHECK(dtype_of<T>::value == dtype(), "[data_ptr] the tensor is ", dtype_name(dtype()), "; asked for ",
             dtype_name(dtype_of<T>::value));
    return static_cast<T*>(data());
  }

  // Shape and conversion ops. All are recorded by autograd (ops/shape.cpp).
  Tensor view(const Shape& shape) const;     // needs a compatible layout; one dim may be -1
  Tensor reshape(const Shape& shape) const;  // a view when possible, else a copy
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor transpose(int64_t a, int64_t b) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;  // a view: a slice of one dim
  Tensor contiguous() const;
  Tensor to(Device d) const;
  // A converted copy; or, while the storage keeps a current copy in t (Storage::copy, e.g. AdamW's bf16 copy
  // of the parameters), a view of that copy, which must then not be written.
  Tensor to(DType t) const;
  Tensor clone() const;
  Tensor detach() const;  // shares storage, no autograd history

  // Host access
  double item() const;                                // one element, as double
  template <class T> std::vector<T> to_vector() const;  // all elements in row-major order
  std::string to_string(int64_t max_per_dim = 6) const;

  // In-place writes; not recorded by autograd.
  Tensor& copy_(const Tensor& src);  // any dtype/device/layout; shapes must match
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // autograd
  bool requires_grad() const { return checked().requires_grad; }
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const { return !checked().grad_fn; }
  Tensor grad() const { return Tensor(checked().grad); }  // undefined until backward reaches it
  void set_grad(const Tensor& g) { checked().grad = g.impl_; }
  const std::shared_ptr<autograd::Node>& grad_fn() const { return checked().grad_fn; }

 private:
  TensorImpl& checked() const {
    LT_CHECK(impl_ != nullptr, "[tensor] use of an undefined tensor");
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// Factories. Values from randn/rand depend only on (seed, element index): the same on CPU and CUDA.
Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::F32, Device device = Device::cpu());
Tensor arange(int64_t start, int64_t end, DType dtype = DType::F32, Device device = Device::cpu());
Tensor randn(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(), uint64_t seed = 0);
Tensor rand(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(), uint64_t seed = 0);
// A tensor holding a copy of host values (converted to dtype).
Tensor from_vector(const std::vector<double>& values, const Shape& shape, DType dtype = DType::F32,
                   Device device = Device::cpu());
Tensor from_vector_i64(const std::vector<int64_t>& values, const Shape& shape, Device device = Device::cpu());

// Same-shape contiguous tensors like `like`, with an optional other dtype.
Tensor empty_like(const Tensor& like);
Tensor zeros_like(const Tensor& like);

// Fills with a value no correct kernel produces (NaN for floats, a sentinel for ints): tests poison
// outputs with it before a kernel runs, so that unwritten elements show.
void poison_(Tensor& t);

}  // namespace lintape
