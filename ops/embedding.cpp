#include "ops/embedding.h"
#include <cstring>
#include "autograd/tape.h"
#include "ops/embedding_cuda.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape {
using autograd::Grads;

namespace {

[[noreturn]] void fail_bad_id(int64_t position, int64_t id, int64_t rows) {
  fail(str("[embedding] ids must be in [0, ", rows, ") (the rows of weight); got ", id, " at position ", position));
}

// Rows are copied as bytes: the gather needs no dtype dispatch.
void gather_cpu(const Tensor& w, const std::vector<int64_t>& ids, const Tensor& out) {
  int64_t rows = w.size(0);
  size_t row_bytes = size_t(w.size(1)) * dtype_size(w.dtype());
  const char* src = static_cast<const char*>(w.data());
  char* dst = static_cast<char*>(out.data());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= rows) fail_bad_id(int64_t(i), ids[i], rows);
    std::memcpy(dst + i * row_bytes, src + size_t(ids[i]) * row_bytes, row_bytes);
  }
}

// dweight = scatter-add of dout's rows, accumulated in double.
Tensor scatter_add_cpu(const Tensor& dout, const std::vector<int64_t>& ids, int64_t rows, int64_t cols) {
  std::vector<double> g = dout.to_vector<double>(), acc(size_t(rows * cols), 0.0);
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t c = 0; c < cols; ++c) acc[size_t(ids[i] * cols + c)] += g[i * size_t(cols) + size_t(c)];
  return from_vector(acc, {rows, cols}, dout.dtype());
}

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  LT_CHECK(weight.dim() == 2 && is_floating(weight.dtype()), "[embedding] weight must be a float (V, C) tensor; got ",
           shape_str(weight.shape()), " ", dtype_name(weight.dtype()));
  LT_CHECK(ids.dtype() == DType::I64 || ids.dtype() == DType::I32, "[embedding] ids must be i64 or i32; got ",
           dtype_name(ids.dtype()), " ", shape_str(ids.shape()));
  LT_CHECK(ids.dim() < kMaxDims, "[embedding] ids may have at most ", kMaxDims - 1, " dims; got ",
           shape_str(ids.shape()));
  LT_CHECK(weight.device() == ids.device(), "[embedding] weight and ids must be on the same device; got weight on ",
           weight.device().name(), " and ids on ", ids.device().name());
  int64_t rows = weight.size(0), cols = weight.size(1);
  Tensor w = weight.detach().contiguous(), id = ids.detach().contiguous();
  Shape out_shape = ids.shape();
  out_shape.push_back(cols);
  Tensor out = empty(out_shape, weight.dtype(), weight.device());
  std::vector<int64_t> host_ids;  // CPU only
#if LINTAPE_WITH_CUDA
  if (w.is_cuda()) {
    Tensor bad = zeros({2}, DType::I64, w.device());
    ops_cuda::embedding_forward_cuda(w, id, out, bad);
    if (!cuda::capturing(w.device().index)) {  // a captured step's caller checks its ids (step_graph.h)
      std::vector<int64_t> flag = bad.to_vector<int64_t>();  // waits for the gather
      if (flag[0] != 0) fail_bad_id(flag[0] - 1, flag[1], rows);
    }
  } else
#endif
  {
    host_ids = id.to_vector<int64_t>();
    gather_cpu(w, host_ids, out);
  }

  if (!autograd::needs_grad({weight})) return out;
  autograd::record("embedding", {weight, autograd::nondiff(ids, "ids")}, {out},
                   [id, host_ids = std::move(host_ids), rows, cols](const Grads& g) -> Grads {
                     Tensor dout = g[0].detach().contiguous();
#if LINTAPE_WITH_CUDA
                     if (dout.is_cuda()) {
                       // 16-bit gradients are summed in an f32 buffer, then converted.
                       bool wide = dout.dtype() == DType::F32 || dout.dtype() == DType::F64;
                       Tensor acc = zeros({rows, cols}, wide ? dout.dtype() : DType::F32, dout.device());
                       ops_cuda::embedding_backward_cuda(dout, id, acc);
                       return {wide ? acc : acc.to(dout.dtype()), Tensor()};
                     }
#endif
                     return {scatter_add_cpu(dout, host_ids, rows, cols), Tensor()};
                   });
  return out;
}

}  // namespace lintape
