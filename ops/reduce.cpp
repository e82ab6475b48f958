// Reductions: input checks, the CPU loops (accumulating in double), CUDA dispatch and backward rules.
// Every op sees its input as a contiguous (outer, len, inner) block (reduce::Dims3): a single dim or a
// run of adjacent dims is reduced in place; other sets of dims are first permuted to the end.
#include "ops/reduce.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/reduce_cuda.h"
#include "ops/shape.h"

namespace lintape {
using autograd::Grads;
using autograd::record;
using reduce::Dims3;

namespace {

void check_float(const Tensor& x, const char* op) {
  LT_CHECK(is_floating(x.dtype()), "[", op, "] expected a float dtype (f32, f64, bf16, f16); got ",
           dtype_name(x.dtype()));
}

// dims normalised and sorted; an empty list means every dim.
std::vector<int64_t> reduce_dims(const std::vector<int64_t>& dims, int64_t rank, const char* op) {
  std::vector<int64_t> out;
  for (int64_t d = 0; dims.empty() && d < rank; ++d) out.push_back(d);
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, rank, op);
    LT_CHECK(std::find(out.begin(), out.end(), w) == out.end(), "[", op, "] expected distinct dims; dim ", d,
             " appears twice in ", shape_str(dims));
    out.push_back(w);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (int64_t d = 0; d < int64_t(s.size()); ++d) {
    bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) out.push_back(s[size_t(d)]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

struct Layout {
  Tensor x;  // contiguous, detached
  Dims3 d;
};

Layout layout_for(const Tensor& x, const std::vector<int64_t>& dims) {
  Tensor t = x.detach();
  int64_t first = dims.empty() ? 0 : dims.front(), count = int64_t(dims.size());
  if (count > 0 && dims.back() - first + 1 != count) {  // not adjacent: kept dims first, reduced last
    std::vector<int64_t> order;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) order.push_back(d);
    order.insert(order.end(), dims.begin(), dims.end());
    t = t.permute(order);
    first = x.dim() - count;
  }
  Layout l{t.contiguous(), {}};
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t n = t.shape()[size_t(d)];
    (d < first ? l.d.outer : d < first + count ? l.d.len : l.d.inner) *= n;
  }
  return l;
}

// t with stride 0 along the dims where it has size 1 and shape more (same rank); no copy, no record.
Tensor broadcast_view(const Tensor& t, const Shape& shape) {
  Tensor v = t.detach();
  for (size_t d = 0; d < shape.size(); ++d)
    if (v.shape()[d] != shape[d]) v.impl()->strides[d] = 0;
  v.impl()->shape = shape;
  return v;
}

template <class T>
void sum_cpu(const Tensor& out, const Tensor& x, Dims3 d, double scale) {
  const T* px = static_cast<const T*>(x.data());
  T* po = static_cast<T*>(out.data());
  std::vector<double> acc(size_t(d.inner));
  for (int64_t o = 0; o < d.outer; ++o) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < d.len; ++j) {
      const T* row = px + (o * d.len + j) * d.inner;
      for (int64_t i = 0; i < d.inner; ++i) acc[size_t(i)] += double(row[i]);
    }
    for (int64_t i = 0; i < d.inner; ++i) po[o * d.inner + i] = T(acc[size_t(i)] * scale);
  }
}

// The first maximum wins; NaN beats every number (and the first NaN every later one).
bool beats(double v, double best) { return v > best || (std::isnan(v) && !std::isnan(best)); }

template <class T>
void max_cpu(const Tensor& values, const Tensor& indices, const Tensor& x, Dims3 d) {
  const T* px = static_cast<const T*>(x.data());
  T* pv = static_cast<T*>(values.data());
  int64_t* pi = static_cast<int64_t*>(indices.data());
  for (int64_t o = 0; o < d.outer; ++o)
    for (int64_t i = 0; i < d.inner; ++i) {
      const T* col = px + o * d.len * d.inner + i;
      double best = double(col[0]);
      int64_t at = 0;
      for (int64_t j = 1; j < d.len; ++j)
        if (beats(double(col[j * d.inner]), best)) best = double(col[j * d.inner]), at = j;
      pv[o * d.inner + i] = T(best);
      pi[o * d.inner + i] = at;
    }
}

template <class T>
void max_backward_cpu(const Tensor& dx, const Tensor& dy, const Tensor& indices, Dims3 d) {
  T* pdx = static_cast<T*>(dx.data());
  const T* pdy = static_cast<const T*>(dy.data());
  const int64_t* pi = static_cast<const int64_t*>(indices.data());
  for (int64_t o = 0; o < d.outer; ++o)
    for (int64_t j = 0; j < d.len; ++j)
      for (int64_t i = 0; i < d.inner; ++i) {
        int64_t k = o * d.inner + i;
        pdx[(o * d.len + j) * d.inner + i] = pi[k] == j ? pdy[k] : T(0.0f);
      }
}

template <class T>
void softmax_cpu(const Tensor& y, const Tensor& x, Dims3 d, bool log) {
  const T* px = static_cast<const T*>(x.data());
  T* py = static_cast<T*>(y.data());
  for (int64_t o = 0; o < d.outer; ++o)
    for (int64_t i = 0; i < d.inner; ++i) {
      int64_t base = o * d.len * d.inner + i;
      double m = -INFINITY, s = 0;
      for (int64_t j = 0; j < d.len; ++j) m = std::max(m, double(px[base + j * d.inner]));
      for (int64_t j = 0; j < d.len; ++j) s += std::exp(double(px[base + j * d.inner]) - m);
      double log_s = std::log(s);
      for (int64_t j = 0; j < d.len; ++j) {
        double v = double(px[base + j * d.inner]) - m;
        py[base + j * d.inner] = T(log ? v - log_s : std::exp(v) / s);
      }
    }
}

template <class T>
void softmax_backward_cpu(const Tensor& dx, const Tensor& y, const Tensor& dy, Dims3 d, bool log) {
  const T* py = static_cast<const T*>(y.data());
  const T* pdy = static_cast<const T*>(dy.data());
  T* pdx = static_cast<T*>(dx.data());
  for (int64_t o = 0; o < d.outer; ++o)
    for (int64_t i = 0; i < d.inner; ++i) {
      int64_t base = o * d.len * d.inner + i;
      double dot = 0;  // sum(y * dy), or sum(dy) for log_softmax
      for (int64_t j = 0; j < d.len; ++j) {
        int64_t k = base + j * d.inner;
        dot += log ? double(pdy[k]) : double(py[k]) * double(pdy[k]);
      }
      for (int64_t j = 0; j < d.len; ++j) {
        int64_t k = base + j * d.inner;
        double yv = double(py[k]), g = double(pdy[k]);
        pdx[k] = T(log ? g - std::exp(yv) * dot : yv * (g - dot));
      }
    }
}

void run_sum(const Tensor& out, const Tensor& x, Dims3 d, double scale, const char* op) {
#if LINTAPE_WITH_CUDA
  if (x.is_cuda()) return reduce::sum_cuda(out, x, d, scale);
#endif
  LT_DISPATCH_FLOAT(x.dtype(), op, T, { sum_cpu<T>(out, x, d, scale); });
}

// sum or mean (scale = 1 / number of reduced elements).
Tensor sum_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, bool mean, const char* op) {
  check_float(x, op);
  std::vector<int64_t> rd = reduce_dims(dims, x.dim(), op);
  Layout l = layout_for(x, rd);
  double scale = mean ? 1.0 / double(l.d.len) : 1.0;
  Tensor out = empty(reduced_shape(x.shape(), rd, keepdim), x.dtype(), x.device());
  if (out.numel() > 0 && l.d.len == 0) out.fill_(mean ? std::numeric_limits<double>::quiet_NaN() : 0.0);
  else if (out.numel() > 0) run_sum(out, l.x, l.d, scale, op);
  Shape in_shape = x.shape(), keep_shape = reduced_shape(x.shape(), rd, true);
  record(op, {x}, {out}, [in_shape, keep_shape, scale](const Grads& g) -> Grads {
    Tensor spread = broadcast_view(g[0].reshape(keep_shape), in_shape);
    return {scale == 1.0 ? spread.contiguous() : mul(spread, scale)};
  });
  return out;
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log, const char* op) {
  check_float(x, op);
  Layout l = layout_for(x, {wrap_dim(dim, x.dim(), op)});
  Tensor y = empty(x.shape(), x.dtype(), x.device());
  if (y.numel() > 0) {
#if LINTAPE_WITH_CUDA
    if (x.is_cuda()) reduce::softmax_cuda(y, l.x, l.d, log);
    else
#endif
      LT_DISPATCH_FLOAT(x.dtype(), op, T, { softmax_cpu<T>(y, l.x, l.d, log); });
  }
  Tensor saved = y.detach();
  Dims3 d = l.d;
  record(op, {x}, {y}, [saved, d, log, op](const Grads& g) -> Grads {
    Tensor dy = g[0].contiguous(), dx = empty_like(saved);
    if (dx.numel() == 0) return {dx};
#if LINTAPE_WITH_CUDA
    if (dx.is_cuda()) {
      reduce::softmax_backward_cuda(dx, saved, dy, d, log);
      return {dx};
    }
#endif
    LT_DISPATCH_FLOAT(dx.dtype(), op, T, { softmax_backward_cpu<T>(dx, saved, dy, d, log); });
    return {dx};
  });
  return y;
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return sum_impl(x, dims, keepdim, false, "sum");
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return sum_impl(x, dims, keepdim, true, "mean");
}

MaxResult max(const Tensor& x, int64_t dim, bool keepdim) {
  check_float(x, "max");
  int64_t d = wrap_dim(dim, x.dim(), "max");
  LT_CHECK(x.shape()[size_t(d)] > 0, "[max] expected a non-empty dim to reduce; dim ", dim, " of ",
           shape_str(x.shape()), " has size 0");
  Layout l = layout_for(x, {d});
  Shape shape = reduced_shape(x.shape(), {d}, keepdim);
  MaxResult r{empty(shape, x.dtype(), x.device()), empty(shape, DType::I64, x.device())};
  if (r.values.numel() > 0) {
#if LINTAPE_WITH_CUDA
    if (x.is_cuda()) reduce::max_cuda(r.values, r.indices, l.x, l.d);
    else
#endif
      LT_DISPATCH_FLOAT(x.dtype(), "max", T, { max_cpu<T>(r.values, r.indices, l.x, l.d); });
  }
  Tensor indices = r.indices.detach();
  Shape in_shape = x.shape();
  Dims3 dd = l.d;
  record("max", {x}, {r.values}, [indices, in_shape, dd](const Grads& g) -> Grads {
    Tensor dy = g[0].contiguous(), dx = empty(in_shape, dy.dtype(), dy.device());
    if (dx.numel() == 0) return {dx};
#if LINTAPE_WITH_CUDA
    if (dx.is_cuda()) {
      reduce::max_backward_cuda(dx, dy, indices, dd);
      return {dx};
    }
#endif
    LT_DISPATCH_FLOAT(dx.dtype(), "max", T, { max_backward_cpu<T>(dx, dy, indices, dd); });
    return {dx};
  });
  return r;
}

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false, "softmax"); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true, "log_softmax"); }

}  // namespace lintape
