// The LRPE family's fused path: the CUDA kernels of ops/lrpe/rows.cu through launch.h's launchers. They read
// x in place where they can (a contiguous x, or a view such as a narrow over heads:
// lrpe_cuda::reads_in_place), else a contiguous copy.
#if LINTAPE_WITH_CUDA
#include <memory>
#include <mutex>
#include "autograd/tape.h"
#include "ops/lrpe/paths.h"

namespace lintape::lrpe_paths {
using autograd::Grads;
using autograd::nondiff;
using autograd::record;

namespace {

// md cached mode: the (2, P, H, D) cos/sin table, kept per (grid, L, H, D, theta's storage, offset and
// version, device). An entry whose theta storage died is stale even if a new one reuses its address.
Tensor cached_table(const LrpeSpec& spec, const Tensor& theta, int64_t H, int64_t D) {
  struct Entry {
    std::vector<int64_t> grid;
    int64_t L, H, D, offset;
    std::weak_ptr<Storage> storage;
    uint64_t version;
    Shape theta_shape;
    DType theta_dtype;
    Tensor table;
  };
  static std::mutex mu;
  static auto* entries = new std::vector<Entry>();  // never destroyed: its tensors outlive exit order
  const std::shared_ptr<Storage>& st = theta.impl()->storage;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : *entries)
    if (e.grid == spec.grid && e.L == spec.extra_tokens && e.H == H && e.D == D && e.offset == theta.offset() &&
        e.storage.lock() == st && e.version == st->version && e.theta_shape == theta.shape() &&
        e.theta_dtype == theta.dtype())
      return e.table;
  Tensor table = empty({2, grid_tokens(spec.grid), H, D}, DType::F32, theta.device());
  lrpe_cuda::build_table(spec, H, D, table);
  constexpr size_t kMaxEntries = 8;
  if (entries->size() >= kMaxEntries) entries->erase(entries->begin());
  entries->push_back({spec.grid, spec.extra_tokens, H, D, theta.offset(), st, st->version, theta.shape(),
                      theta.dtype(), table});
  return table;
}

}  // namespace

Tensor run_fused(const Tensor& x_in, LrpeSpec spec, const Tensor& theta, bool cache_angles) {
  const char* op = spec.name();
  const Tensor x = lrpe_cuda::reads_in_place(x_in) ? x_in : x_in.contiguous();
  spec.theta = theta.detach().to(DType::F32).contiguous();
  if (cache_angles) spec.table = cached_table(spec, theta, x.size(2), x.size(3));
  Tensor out = empty(spec.out_shape(x.shape()), x.dtype(), x.device());
  // Softmax over the sequence: its statistics per row, or per document in the row of its first token.
  const Shape stats_shape = spec.starts.defined() ? x.shape() : Shape{x.size(0), x.size(2), x.size(3)};
  Tensor stats = spec.seq_softmax() ? empty(stats_shape, DType::F32, x.device()) : Tensor();
  lrpe_cuda::forward(x, spec, out, stats);
  Tensor xs = x.detach();  // a view stays one: backward reads it in place too
  record(op, {x, nondiff(theta, "theta")}, {out}, [xs, spec, stats](const Grads& g) -> Grads {
    Tensor dout = g[0].to(xs.dtype()).contiguous();
    Tensor dx = empty_like(xs);
    lrpe_cuda::backward(xs, dout, spec, stats, dx);
    return {dx, Tensor()};
  });
  return out;
}

}  // namespace lintape::lrpe_paths
#endif
