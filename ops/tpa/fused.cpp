// The TPA family's fused path: the decode and attention kernels of launch.h (ops/tpa/decode.cu with its
// tensor-core kernel in ops/tpa/decode_tc.cu; ops/tpa/attention.cu), the attention's backward recorded on the
// tape.
#if LINTAPE_WITH_CUDA
#include <cstdint>
#include "autograd/tape.h"
#include "ops/tpa/launch.h"
#include "ops/tpa/paths.h"

namespace lintape::tpa_paths {
using autograd::Grads;
using autograd::record;

namespace {

// Fused decode reads the k/v factors in place when each batch entry's rows are contiguous (a TpaCache's
// buffers narrowed to the used rows are).
Tensor rows_contiguous(const Tensor& t) {
  const Shape& st = t.strides();
  const bool ok = st[3] == 1 && st[2] == t.size(3) && st[1] == t.size(2) * t.size(3);
  return ok ? t : t.contiguous();
}

// The fused attention reads a factor in place when its batch and token dims merge and each token's values
// sit as the kernels index them: a (B, L, H, R) with unit rank stride, b (B, L, R, D) with rows of D at
// stride D, 16-byte aligned. Views of a wider projection qualify (the TPA mixer's split of its two
// projections); anything else is copied.
Tensor factor_in_place(const Tensor& t, bool basis) {
  const Shape& st = t.strides();
  const int64_t bytes = int64_t(dtype_size(t.dtype()));
  bool ok = st[3] == 1 && (t.size(0) == 1 || st[0] == t.size(1) * st[1]);
  if (basis)
    ok = ok && st[2] == t.size(3) && st[1] * bytes % 16 == 0 && reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
  return ok ? t : t.contiguous();
}

}  // namespace

std::string fused_attention_unsupported(const Factors& f) {
  return tpa_cuda::attention_unsupported(f.aq.dtype(), f.D, f.E, f.Rq, f.Rk, f.Rv);
}

Tensor run_fused_decode(const Factors& f, double scale, const std::vector<int64_t>& lengths) {
  tpa_cuda::DecodeArgs a;
  a.aq = f.aq.detach().contiguous();
  a.bq = f.bq.detach().contiguous();
  a.ak = rows_contiguous(f.ak.detach());
  a.bk = rows_contiguous(f.bk.detach());
  a.av = rows_contiguous(f.av.detach());
  a.bv = rows_contiguous(f.bv.detach());
  a.lengths = lengths;
  a.scale = scale;
  Tensor out = empty({f.B, 1, f.H, f.E}, f.aq.dtype(), f.aq.device());
  tpa_cuda::decode(a, out);
  return out;
}

// Fused attention: forward saves the detached factors (and the documents' starts), the output and the
// log-sum-exp; the backward kernels return the six factor gradients (dq, dk, dv are contracted on chip).
Tensor run_fused_attention(const Factors& f, double scale, bool causal, const Tensor& starts) {
  const char* op = "tpa_attention";
  LT_CHECK(!starts.defined(), "[", op, "] the fused kernels take no documents yet; use Impl::Composed");
  tpa_cuda::AttentionArgs a;
  a.aq = factor_in_place(f.aq.detach(), false);
  a.bq = factor_in_place(f.bq.detach(), true);
  a.ak = factor_in_place(f.ak.detach(), false);
  a.bk = factor_in_place(f.bk.detach(), true);
  a.av = factor_in_place(f.av.detach(), false);
  a.bv = factor_in_place(f.bv.detach(), true);
  a.causal = causal;
  a.scale = scale;
  a.starts = starts.defined() ? starts.contiguous() : Tensor();
  const Device dev = f.aq.device();
  Tensor out = empty({f.B, f.N, f.H, f.E}, f.aq.dtype(), dev);
  Tensor lse = empty({f.B, f.N, f.H}, DType::F32, dev);
  tpa_cuda::attention_forward(a, out, lse);
  const Tensor saved_out = out.detach();  // the graph node must not own its own output's history
  record(op, {f.aq, f.bq, f.ak, f.bk, f.av, f.bv}, {out}, [a, saved_out, lse](const Grads& g) -> Grads {
    NoGradGuard no_grad;
    const Tensor dout = g[0].contiguous();
    const Device d = a.aq.device();
    const DType dt = a.aq.dtype();
    tpa_cuda::FactorGrads fg;
    fg.aq = empty(a.aq.shape(), dt, d);
    fg.bq = empty(a.bq.shape(), dt, d);
    fg.ak = empty(a.ak.shape(), dt, d);
    fg.bk = empty(a.bk.shape(), dt, d);
    fg.av = empty(a.av.shape(), dt, d);
    fg.bv = empty(a.bv.shape(), dt, d);
    tpa_cuda::attention_backward(a, saved_out, lse, dout, fg);
    Grads out{fg.aq, fg.bq, fg.ak, fg.bk, fg.av, fg.bv};
    return out;
  });
  return out;
}

}  // namespace lintape::tpa_paths
#endif
