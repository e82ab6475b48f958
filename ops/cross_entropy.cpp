#include "ops/cross_entropy.h"
#include <algorithm>
#include <cmath>
#include <type_traits>
#include "autograd/tape.h"
#include "ops/cross_entropy_cuda.h"

namespace lintape {
using autograd::Grads;

namespace {

// The saved log-sum-exp: f64 for f64 logits, else f32.
template <class T> using lse_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

[[noreturn]] void fail_bad_target(int64_t row, int64_t target, int64_t classes, int64_t ignore_index) {
  fail(str("[cross_entropy] targets must be in [0, V = ", classes, ") or equal ignore_index = ", ignore_index, "; got ",
           target, " at row ", row));
}

// Returns the summed loss of the rows not ignored; writes lse per row and counts those rows.
template <class T>
double forward_cpu(const T* logits, const std::vector<int64_t>& targets, int64_t classes, int64_t ignore_index,
                   lse_t<T>* lse, int64_t& count) {
  double total = 0;
  count = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    const T* x = logits + int64_t(i) * classes;
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < classes; ++v) m = std::max(m, double(x[v]));
    for (int64_t v = 0; v < classes; ++v) s += std::exp(double(x[v]) - m);
    double l = m + std::log(s);
    lse[i] = lse_t<T>(l);
    int64_t t = targets[i];
    if (t == ignore_index) continue;
    if (t < 0 || t >= classes) fail_bad_target(int64_t(i), t, classes, ignore_index);
    total += l - double(x[t]);
    ++count;
  }
  return total;
}

template <class T>
void backward_cpu(double dloss, const T* logits, const std::vector<int64_t>& targets, int64_t classes,
                  int64_t ignore_index, const lse_t<T>* lse, int64_t count, T* dlogits) {
  double scale = count > 0 ? dloss / double(count) : 0.0;
  for (size_t i = 0; i < targets.size(); ++i) {
    const T* x = logits + int64_t(i) * classes;
    T* d = dlogits + int64_t(i) * classes;
    bool ignored = targets[i] == ignore_index;
    for (int64_t v = 0; v < classes; ++v) {
      double p = std::exp(double(x[v]) - double(lse[i]));
      d[v] = T(ignored ? 0.0 : (p - (v == targets[i] ? 1.0 : 0.0)) * scale);
    }
  }
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index) {
  LT_CHECK(logits.dim() == 2 && is_floating(logits.dtype()) && logits.size(1) > 0,
           "[cross_entropy] logits must be a float (T, V) tensor with V >= 1; got ", shape_str(logits.shape()), " ",
           dtype_name(logits.dtype()));
  LT_CHECK(targets.dtype() == DType::I64 || targets.dtype() == DType::I32,
           "[cross_entropy] targets must be i64 or i32; got ", dtype_name(targets.dtype()));
  LT_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "[cross_entropy] targets must be (T) with T = ",
           logits.size(0), " (the rows of logits ", shape_str(logits.shape()), "); got ", shape_str(targets.shape()));
  LT_CHECK(targets.device() == logits.device(), "[cross_entropy] targets must be on the logits' device ",
           logits.device().name(), "; got ", targets.device().name());
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
    cuda_ops::cross_entropy_forward_cuda(lg, tg, ignore_index, loss, lse, count_dev, bad);
    std::vector<int64_t> flag = bad.to_vector<int64_t>();  // waits for the forward
    if (flag[0] != 0) fail_bad_target(flag[0] - 1, flag[1], classes, ignore_index);
  } else
#endif
  {
    host_targets = tg.to_vector<int64_t>();
    double total = 0;
    LT_DISPATCH_FLOAT(lg.dtype(), "cross_entropy", T, {
      total = forward_cpu(lg.data_ptr<T>(), host_targets, classes, ignore_index, lse.data_ptr<lse_t<T>>(), count);
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
          cuda_ops::cross_entropy_backward_cuda(dloss, lg, tg, ignore_index, lse, count_dev, dlogits);
          return {dlogits, Tensor()};
        }
#endif
        LT_DISPATCH_FLOAT(lg.dtype(), "cross_entropy", T, {
          backward_cpu(g[0].item(), lg.data_ptr<T>(), host_targets, lg.size(1), ignore_index, lse.data_ptr<lse_t<T>>(),
                       count, dlogits.data_ptr<T>());
        });
        return {dlogits, Tensor()};
      });
  return loss;
}

}  // namespace lintape
