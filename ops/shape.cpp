#include "ops/shape.h"
#include <numeric>
#include "autograd/tape.h"

namespace lintape {
using autograd::Grads;
using autograd::record;

int64_t wrap_dim(int64_t dim, int64_t rank, const char* op) {
  LT_CHECK(dim >= -rank && dim < rank, "[", op, "] dim ", dim, " is out of range for a tensor with ", rank,
           " dims");
  return dim < 0 ? dim + rank : dim;
}

namespace {
// A tensor over `storage` read as `dtype` with the given layout.
Tensor alias(const std::shared_ptr<Storage>& storage, DType dtype, const Shape& shape, const Shape& strides,
             int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage;
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(impl);
}
Tensor alias(const Tensor& t, const Shape& shape, const Shape& strides, int64_t offset) {
  return alias(t.impl()->storage, t.dtype(), shape, strides, offset);
}

Shape infer_shape(const Shape& shape, int64_t numel, const char* op) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      LT_CHECK(infer < 0, "[", op, "] only one dim may be -1; got ", shape_str(shape));
      infer = int64_t(i);
    } else {
      LT_CHECK(out[i] >= 0, "[", op, "] invalid size in ", shape_str(shape));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    LT_CHECK(known > 0 && numel % known == 0, "[", op, "] cannot infer -1 in ", shape_str(shape), " for ", numel,
             " elements");
    out[size_t(infer)] = numel / known;
  }
  LT_CHECK(shape_numel(out) == numel, "[", op, "] shape ", shape_str(shape), " has ", shape_numel(out),
           " elements; the tensor has ", numel);
  return out;
}

// Strides that show t's elements, in order, with `shape`, when t's layout allows it without a copy: t's dims
// fall into runs that are contiguous among themselves (a split of one projection's last dim is), and each
// run must map onto whole new dims, which take their strides from the run's innermost stride.
bool view_strides(const Tensor& t, const Shape& shape, Shape& strides) {
  if (t.is_contiguous()) {
    strides = contiguous_strides(shape);
    return true;
  }
  const Shape& old = t.shape();
  const Shape& old_st = t.strides();
  if (old.empty() || t.numel() == 0) return false;
  strides.assign(shape.size(), 0);
  int64_t new_d = int64_t(shape.size()) - 1, base = old_st.back(), run = 1, mapped = 1;
  for (int64_t d = int64_t(old.size()) - 1; d >= 0; --d) {
    run *= old[size_t(d)];
    const bool run_ends = d == 0 || (old[size_t(d - 1)] != 1 && old_st[size_t(d - 1)] != run * base);
    if (!run_ends) continue;
    while (new_d >= 0 && (mapped < run || shape[size_t(new_d)] == 1)) {
      strides[size_t(new_d)] = mapped * base;
      mapped *= shape[size_t(new_d)];
      --new_d;
    }
    if (mapped != run) return false;
    if (d > 0) {
      base = old_st[size_t(d - 1)];
      run = mapped = 1;
    }
  }
  return new_d == -1;
}

Tensor copy_to(const Tensor& t, DType dtype, Device device) {
  Tensor out = empty(t.shape(), dtype, device);
  out.copy_(t);
  return out;
}
}  // namespace

Tensor Tensor::view(const Shape& shape_in) const {
  Shape shape = infer_shape(shape_in, numel(), "view");
  Shape st;
  LT_CHECK(view_strides(*this, shape, st), "[view] a tensor of shape ", shape_str(this->shape()),
           " with strides ", shape_str(strides()), " cannot be viewed as ", shape_str(shape),
           " without a copy; call reshape() (which copies when it must) or contiguous() first");
  Tensor out = alias(*this, shape, st, offset());
  Shape in_shape = this->shape();
  record("view", {*this}, {out}, [in_shape](const Grads& g) -> Grads { return {g[0].reshape(in_shape)}; });
  return out;
}

Tensor Tensor::reshape(const Shape& shape_in) const {
  Shape shape = infer_shape(shape_in, numel(), "reshape");
  Shape st;
  if (view_strides(*this, shape, st)) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  int64_t n = dim();
  LT_CHECK(int64_t(dims.size()) == n, "[permute] expected ", n, " dims; got ", dims.size());
  std::vector<bool> seen(size_t(n), false);
  Shape shape(static_cast<size_t>(n)), st(static_cast<size_t>(n));
  std::vector<int64_t> inverse(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    int64_t d = wrap_dim(dims[size_t(i)], n, "permute");
    LT_CHECK(!seen[size_t(d)], "[permute] dim ", d, " appears twice");
    seen[size_t(d)] = true;
    shape[size_t(i)] = this->shape()[size_t(d)];
    st[size_t(i)] = strides()[size_t(d)];
    inverse[size_t(d)] = i;
  }
  Tensor out = alias(*this, shape, st, offset());
  record("permute", {*this}, {out}, [inverse](const Grads& g) -> Grads { return {g[0].permute(inverse)}; });
  return out;
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  std::vector<int64_t> dims(static_cast<size_t>(dim()));
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[size_t(wrap_dim(a, dim(), "transpose"))], dims[size_t(wrap_dim(b, dim(), "transpose"))]);
  return permute(dims);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim(), "narrow");
  int64_t n = shape()[size_t(d)];
  LT_CHECK(start >= 0 && length >= 0 && start + length <= n, "[narrow] range [", start, ", ", start + length,
           ") is outside dim ", d, " of size ", n);
  Shape shape = this->shape();
  shape[size_t(d)] = length;
  Tensor out = alias(*this, shape, strides(), offset() + start * strides()[size_t(d)]);
  Tensor like = detach();
  record("narrow", {*this}, {out}, [like, d, start, length](const Grads& g) -> Grads {
    Tensor full = zeros(like.shape(), g[0].dtype(), g[0].device());
    full.detach().narrow(d, start, length).copy_(g[0]);
    return {full};
  });
  return out;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = copy_to(*this, dtype(), device());
  record("contiguous", {*this}, {out}, [](const Grads& g) -> Grads { return {g[0]}; });
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out = copy_to(*this, dtype(), d);
  Device from = device();
  record("to_device", {*this}, {out}, [from](const Grads& g) -> Grads { return {g[0].to(from)}; });
  return out;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype()) return *this;
  const Storage& s = storage();
  const bool kept = s.copy && s.copy_dtype == t && s.copy_version == s.version;  // a view of the kept copy
  Tensor out = kept ? alias(s.copy, t, shape(), strides(), offset()) : copy_to(*this, t, device());
  const DType from = dtype();
  // A float32 leaf (a parameter) takes a 16-bit gradient as it is: the leaf's accumulation converts it in the
  // same pass.
  const bool leaf_accumulates = impl()->grad_fn == nullptr && from == DType::F32 && is_float16(t);
  record("to_dtype", {*this}, {out}, [from, leaf_accumulates](const Grads& g) -> Grads {
    return {leaf_accumulates ? g[0] : g[0].to(from)};
  });
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = copy_to(*this, dtype(), device());
  record("clone", {*this}, {out}, [](const Grads& g) -> Grads { return {g[0]}; });
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  LT_CHECK(!tensors.empty(), "[cat] expected at least one tensor");
  const Tensor& first = tensors[0];
  int64_t d = wrap_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    LT_CHECK(t.dim() == first.dim() && t.dtype() == first.dtype() && t.device() == first.device(),
             "[cat] tensor ", i, " is ", shape_str(t.shape()), " ", dtype_name(t.dtype()), " on ", t.device().name(),
             "; expected rank ", first.dim(), " ", dtype_name(first.dtype()), " on ", first.device().name());
    for (int64_t k = 0; k < first.dim(); ++k)
      LT_CHECK(k == d || t.shape()[size_t(k)] == shape[size_t(k)], "[cat] tensor ", i, " has shape ",
               shape_str(t.shape()), "; all dims but ", d, " must match ", shape_str(shape));
    total += t.shape()[size_t(d)];
  }
  shape[size_t(d)] = total;
  Tensor out = empty(shape, first.dtype(), first.device());
  std::vector<int64_t> sizes;
  int64_t at = 0;
  for (const Tensor& t : tensors) {
    int64_t len = t.shape()[size_t(d)];
    out.detach().narrow(d, at, len).copy_(t);
    sizes.push_back(len);
    at += len;
  }
  std::vector<autograd::Input> inputs(tensors.begin(), tensors.end());
  record("cat", inputs, {out}, [d, sizes](const Grads& g) -> Grads {
    Grads out;
    int64_t at = 0;
    for (int64_t len : sizes) {
      out.push_back(g[0].narrow(d, at, len));
      at += len;
    }
    return out;
  });
  return out;
}

namespace {
// When the pieces' gradients already lie side by side in one buffer laid out like x (a fused backward or
// cat's backward wrote them there), that buffer as x's gradient; else undefined.
Tensor side_by_side(const Grads& g, const Tensor& like, int64_t d, const std::vector<int64_t>& starts) {
  for (const Tensor& gi : g)
    if (!gi.defined() || gi.impl()->storage != g[0].impl()->storage || gi.dtype() != like.dtype() ||
        gi.strides() != like.strides())
      return Tensor();
  const int64_t base = g[0].offset() - starts[0] * like.strides()[size_t(d)];
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i].offset() != base + starts[i] * like.strides()[size_t(d)]) return Tensor();
  if (base < 0) return Tensor();
  return alias(g[0], like.shape(), like.strides(), base);
}
}  // namespace

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t len : sizes) {
    LT_CHECK(len >= 0, "[split] sizes must be >= 0; got ", len);
    total += len;
  }
  LT_CHECK(total == x.size(d), "[split] sizes must add up to dim ", d, " of ", shape_str(x.shape()), " (", x.size(d),
           "); they add up to ", total);
  std::vector<Tensor> pieces;
  std::vector<int64_t> starts;
  {
    NoGradGuard no_grad;  // the pieces are recorded below, together
    int64_t at = 0;
    for (int64_t len : sizes) {
      pieces.push_back(x.narrow(d, at, len));
      starts.push_back(at);
      at += len;
    }
  }
  const Tensor like = x.detach();
  record("split", {x}, pieces, [like, d, sizes, starts](const Grads& g) -> Grads {
    if (Tensor joined = side_by_side(g, like, d, starts); joined.defined()) return {joined};
    const Tensor* any = nullptr;
    for (const Tensor& gi : g)
      if (gi.defined() && !any) any = &gi;
    // Each slice written once: a piece's gradient, or zeros for a piece without one.
    Tensor full = empty(like.shape(), any->dtype(), any->device());
    for (size_t i = 0; i < g.size(); ++i) {
      Tensor slice = full.detach().narrow(d, starts[i], sizes[i]);
      if (g[i].defined())
        slice.copy_(g[i]);
      else
        slice.zero_();
    }
    return {full};
  });
  return pieces;
}

}  // namespace lintape
