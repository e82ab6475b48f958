#include "ops/cross_entropy.h"
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include "autograd/tape.h"
#include "ops/cross_entropy_cuda.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif
#include "ops/elementwise.h"
#include "ops/matmul.h"

namespace lintape {
using autograd::Grads;

namespace {

// The saved log-sum-exp: f64 for f64 logits, else f32.
template <class T> using lse_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

[[noreturn]] void fail_bad_target(int64_t row, int64_t target, int64_t classes, int64_t ignore_index,
                                  const char* op = "cross_entropy") {
  fail(str("[", op, "] targets must be in [0, V = ", classes, ") or equal ignore_index = ", ignore_index, "; got ",
           target, " at row ", row));
}

// Returns the summed loss of the rows not ignored; writes lse per row and counts those rows.
template <class T>
double forward_cpu(const T* logits, const int64_t* targets, int64_t rows, int64_t classes, int64_t ignore_index,
                   lse_t<T>* lse, int64_t& count) {
  double total = 0;
  count = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const T* x = logits + i * classes;
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < classes; ++v) m = std::max(m, double(x[v]));
    for (int64_t v = 0; v < classes; ++v) s += std::exp(double(x[v]) - m);
    double l = m + std::log(s);
    lse[i] = lse_t<T>(l);
    int64_t t = targets[i];
    if (t == ignore_index) continue;
    if (t < 0 || t >= classes) fail_bad_target(i, t, classes, ignore_index);
    total += l - double(x[t]);
    ++count;
  }
  return total;
}

// dlogits = (softmax - onehot) * dloss / count; dlogits may be logits itself (each value is read before
// it is written).
template <class T>
void backward_cpu(double dloss, const T* logits, const int64_t* targets, int64_t rows, int64_t classes,
                  int64_t ignore_index, const lse_t<T>* lse, int64_t count, T* dlogits) {
  double scale = count > 0 ? dloss / double(count) : 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const T* x = logits + i * classes;
    T* d = dlogits + i * classes;
    bool ignored = targets[i] == ignore_index;
    for (int64_t v = 0; v < classes; ++v) {
      double p = std::exp(double(x[v]) - double(lse[i]));
      d[v] = T(ignored ? 0.0 : (p - (v == targets[i] ? 1.0 : 0.0)) * scale);
    }
  }
}

void check_targets(const char* op, const Tensor& targets, int64_t rows, const char* rows_of, const Tensor& like) {
  LT_CHECK(targets.dtype() == DType::I64 || targets.dtype() == DType::I32, "[", op,
           "] targets must be i64 or i32; got ", dtype_name(targets.dtype()));
  LT_CHECK(targets.dim() == 1 && targets.size(0) == rows, "[", op, "] targets must be (T) with T = ", rows,
           " (the rows of ", rows_of, " ", shape_str(like.shape()), "); got ", shape_str(targets.shape()));
  LT_CHECK(targets.device() == like.device(), "[", op, "] targets must be on the ", rows_of, "' device ",
           like.device().name(), "; got ", targets.device().name());
}

// Logits of this many bytes at most per chunk of rows. At the small model's head (32768 rows x 32768
// classes, bf16) 512 MiB (8192 rows) ran the op in 8.98 ms against 9.17 ms at 256 MiB, without raising the
// step's peak (the activations held for the backward are larger); 1 GiB gained 0.2 ms more for 0.5 GiB.
constexpr int64_t kChunkLogitBytes = int64_t(512) << 20;

#if LINTAPE_WITH_CUDA
// LINTAPE_CE_ONE_PASS=0 runs linear_cross_entropy's row losses and gradient as two kernels (to time the two).
bool one_pass_rows() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_CE_ONE_PASS");
    return !(v && std::string(v) == "0");
  }();
  return on;
}
#endif

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  LT_CHECK(logits.dim() == 2 && is_floating(logits.dtype()) && logits.size(1) > 0,
           "[cross_entropy] logits must be a float (T, V) tensor with V >= 1; got ", shape_str(logits.shape()), " ",
           dtype_name(logits.dtype()));
  check_targets("cross_entropy", targets, logits.size(0), "logits", logits);
  int64_t rows = logits.size(0), classes = logits.size(1);
  Tensor lg = logits.detach().contiguous(), tg = targets.detach().contiguous();
  DType ldt = logits.dtype() == DType::F64 ? DType::F64 : DType::F32;
  Tensor lse = empty({rows}, ldt, logits.device());
  Tensor loss;
  Tensor count_dev;        // CUDA: rows not ignored, on the device
  int64_t count = 0;       // CPU: the same
  std::vector<int64_t> host_targets;
#if LINTAPE_WITH_CUDA
  if (lg.is_cuda()) {
    loss = empty({}, ldt, logits.device());
    count_dev = empty({1}, DType::I64, logits.device());
    Tensor bad = zeros({2}, DType::I64, logits.device());
    ops_cuda::cross_entropy_forward_cuda(lg, tg, ignore_index, loss, lse, count_dev, bad);
    if (!cuda::capturing(lg.device().index)) {  // a captured step's caller checks its targets (step_graph.h)
      std::vector<int64_t> flag = bad.to_vector<int64_t>();  // waits for the forward
      if (flag[0] != 0) fail_bad_target(flag[0] - 1, flag[1], classes, ignore_index);
    }
  } else
#endif
  {
    host_targets = tg.to_vector<int64_t>();
    double total = 0;
    LT_DISPATCH_FLOAT(lg.dtype(), "cross_entropy", T, {
      total = forward_cpu(lg.data_ptr<T>(), host_targets.data(), rows, classes, ignore_index, lse.data_ptr<lse_t<T>>(),
                          count);
    });
    loss = from_vector({count > 0 ? total / double(count) : 0.0}, {}, ldt);
  }

  if (!autograd::needs_grad({logits})) return loss;
  autograd::record(
      "cross_entropy", {logits, autograd::nondiff(targets, "targets")}, {loss},
      [lg, tg, lse, count_dev, count, host_targets = std::move(host_targets), ignore_index](const Grads& g) -> Grads {
        Tensor dlogits = empty(lg.shape(), lg.dtype(), lg.device());
#if LINTAPE_WITH_CUDA
        if (lg.is_cuda()) {
          Tensor dloss = g[0].to(lse.dtype()).to(lg.device());
          ops_cuda::cross_entropy_backward_cuda(dloss, lg, tg, ignore_index, lse, count_dev, dlogits);
          return {dlogits, Tensor()};
        }
#endif
        LT_DISPATCH_FLOAT(lg.dtype(), "cross_entropy", T, {
          backward_cpu(g[0].item(), lg.data_ptr<T>(), host_targets.data(), lg.size(0), lg.size(1), ignore_index,
                       lse.data_ptr<lse_t<T>>(), count, dlogits.data_ptr<T>());
        });
        return {dlogits, Tensor()};
      });
  return loss;
}

Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t ignore_index,
                            int64_t chunk_rows) {
  const char* op = "linear_cross_entropy";
  LT_CHECK(x.dim() == 2 && is_floating(x.dtype()), "[", op, "] x must be a float (T, C) tensor; got ",
           shape_str(x.shape()), " ", dtype_name(x.dtype()));
  LT_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.size(0) > 0, "[", op,
           "] weight must be (V, C) with V >= 1 and C = ", x.size(1), " (x's last dim); got ",
           shape_str(weight.shape()));
  LT_CHECK(weight.dtype() == x.dtype() && weight.device() == x.device(), "[", op,
           "] weight must have x's dtype and device (", dtype_name(x.dtype()), " on ", x.device().name(), "); got ",
           dtype_name(weight.dtype()), " on ", weight.device().name());
  check_targets(op, targets, x.size(0), "x", x);
  LT_CHECK(chunk_rows >= 0, "[", op, "] chunk_rows must be >= 0 (0 picks it); got ", chunk_rows);
  const int64_t rows = x.size(0), classes = weight.size(0), width = x.size(1);
  const Device dev = x.device();
  const DType dt = x.dtype(), acc = dt == DType::F64 ? DType::F64 : DType::F32;
  const bool need_x = autograd::needs_grad({x}), need_w = autograd::needs_grad({weight});
  const int64_t chunk = std::max<int64_t>(
      1, std::min(rows, chunk_rows > 0 ? chunk_rows : kChunkLogitBytes / (classes * int64_t(dtype_size(dt)))));
  Tensor xs = x.detach().contiguous(), ws = weight.detach().contiguous(), tg = targets.detach().contiguous();
  Tensor logits = empty({chunk, classes}, dt, dev), lse = empty({rows}, acc, dev);
  // The gradients for dloss = 1, summed while the chunk's logits exist: dx in x's dtype, dW in f32 (f64).
  Tensor dx = need_x ? empty({rows, width}, dt, dev) : Tensor();
  // dW: the first chunk's product writes it, the others add (no zeros to write first, but with no rows).
  Tensor dw = need_w ? (rows == 0 ? zeros({classes, width}, acc, dev) : empty({classes, width}, acc, dev)) : Tensor();
  // For each chunk: its logits, their lse and row losses, then (softmax - onehot) / count in place and
  // the chunk's terms of dx and dW.
  auto for_chunks = [&](auto&& losses, auto&& gradient) {
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows - r0);
      Tensor lg = logits.narrow(0, 0, n), xc = xs.narrow(0, r0, n);
      matmul_out(xc, ws, lg, false, true);
      losses(lg, r0, n);
      if (!need_x && !need_w) continue;
      gradient(lg, r0, n);
      if (need_x) matmul_out(lg, ws, dx.narrow(0, r0, n), false, false);
      if (need_w) matmul_out(lg, xc, dw, true, false, /*accumulate=*/r0 > 0);
    }
  };
  Tensor loss;
  int64_t count = 0;
#if LINTAPE_WITH_CUDA
  if (xs.is_cuda()) {
    Tensor count_dev = empty({1}, DType::I64, dev), bad = zeros({2}, DType::I64, dev);
    Tensor row_loss = empty({rows}, acc, dev), one = full({1}, 1.0, acc, dev);
    ops_cuda::cross_entropy_reduce_cuda(Tensor(), tg, ignore_index, Tensor(), count_dev, acc);
    // With a gradient to make, the row losses and the gradient in one pass over each row where it fits.
    bool one_pass = false;
    for_chunks(
        [&](const Tensor& lg, int64_t r0, int64_t n) {
          one_pass = (need_x || need_w) && one_pass_rows() &&
                     ops_cuda::cross_entropy_rows_gradient_cuda(lg, tg.narrow(0, r0, n), ignore_index,
                                                                lse.narrow(0, r0, n), row_loss.narrow(0, r0, n), bad,
                                                                r0, one, count_dev);
          if (!one_pass)
            ops_cuda::cross_entropy_rows_cuda(lg, tg.narrow(0, r0, n), ignore_index, lse.narrow(0, r0, n),
                                              row_loss.narrow(0, r0, n), bad, r0);
        },
        [&](const Tensor& lg, int64_t r0, int64_t n) {
          if (!one_pass)
            ops_cuda::cross_entropy_backward_cuda(one, lg, tg.narrow(0, r0, n), ignore_index, lse.narrow(0, r0, n),
                                                  count_dev, lg);
        });
    loss = empty({}, acc, dev);
    ops_cuda::cross_entropy_reduce_cuda(row_loss, tg, ignore_index, loss, count_dev, acc);
    if (!cuda::capturing(dev.index)) {  // a captured step's caller checks its targets (step_graph.h)
      std::vector<int64_t> flag = bad.to_vector<int64_t>();  // waits for the chunks
      if (flag[0] != 0) fail_bad_target(flag[0] - 1, flag[1], classes, ignore_index, op);
    }
  } else
#endif
  {
    std::vector<int64_t> host = tg.to_vector<int64_t>();
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = host[size_t(i)];
      if (t == ignore_index) continue;
      if (t < 0 || t >= classes) fail_bad_target(i, t, classes, ignore_index, op);
      ++count;
    }
    double total = 0;
    LT_DISPATCH_FLOAT(dt, op, T, {
      for_chunks(
          [&](const Tensor& lg, int64_t r0, int64_t n) {
            int64_t counted = 0;  // the targets were checked and counted above
            total += forward_cpu(lg.data_ptr<T>(), host.data() + r0, n, classes, ignore_index,
                                 lse.data_ptr<lse_t<T>>() + r0, counted);
          },
          [&](const Tensor& lg, int64_t r0, int64_t n) {
            backward_cpu(1.0, lg.data_ptr<T>(), host.data() + r0, n, classes, ignore_index,
                         lse.data_ptr<lse_t<T>>() + r0, count, lg.data_ptr<T>());
          });
    });
    loss = from_vector({count > 0 ? total / double(count) : 0.0}, {}, acc);
  }
  if (!need_x && !need_w) return loss;
  autograd::record(op, {x, weight, autograd::nondiff(targets, "targets")}, {loss}, [dx, dw, dt](const Grads& g) {
    // The saved gradients are for dloss = 1; the incoming one (usually exactly 1) scales them.
    Tensor dloss = g[0].to(dx.defined() ? dx.device() : dw.device());
    Tensor gx = dx.defined() ? mul(dx, dloss.to(dt)) : Tensor();
    Tensor gw = dw.defined() ? mul(dw, dloss.to(dw.dtype())).to(dt) : Tensor();
    return Grads{gx, gw, Tensor()};
  });
  return loss;
}

}  // namespace lintape
