// TPA attention in the tests: the output and the six factor gradients of one call, shared by the CPU and
// CUDA cases.
#pragma once
#include <cmath>
#include <vector>
#include "autograd/tape.h"
#include "helpers.h"
#include "ops/tpa/launch.h"
#include "ops/tpa/tpa.h"

namespace lintape::test {

// The names of attention_and_grads' outputs, in order.
inline const char* const kAttentionNames[] = {"out", "aq", "bq", "ak", "bk", "av", "bv"};

// The output and the six factor gradients for the upstream gradient w (the same values on every side), all
// on the CPU.
inline std::vector<Tensor> attention_and_grads(const std::vector<Tensor>& factors, const TpaOptions& o, Impl impl,
                                               const Tensor& w) {
  std::vector<Tensor> leaves;
  for (const Tensor& t : factors) leaves.push_back(t.detach().requires_grad_());
  Tensor out = tpa_attention(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], o, impl);
  backward(out, w.to(out.device()).to(out.dtype()));
  std::vector<Tensor> r{out.detach().to(Device::cpu())};
  for (const Tensor& t : leaves) r.push_back(t.grad().to(Device::cpu()));
  return r;
}

// A decode call's sizes: batch, cache length, heads, the ranks of q, k and v, and the head dims of q/k and v.
struct DecodeShape {
  int64_t B, M, H, Rq, Rk, Rv, D, E;
};

// Six TPA factors in the tested dtype on a device, and the same values in f64 on the CPU.
struct FactorInputs {
  std::vector<Tensor> cpu;  // f64, rounded through the tested dtype
  std::vector<Tensor> gpu;  // the tested dtype
};

// A decode call's six factors (q's of one token, k's and v's of the M cache rows) on `device`.
inline FactorInputs decode_inputs(const DecodeShape& s, DType dt, uint64_t seed, Device device) {
  const Shape shapes[] = {{s.B, 1, s.H, s.Rq},  {s.B, 1, s.Rq, s.D}, {s.B, s.M, s.H, s.Rk},
                          {s.B, s.M, s.Rk, s.D}, {s.B, s.M, s.H, s.Rv}, {s.B, s.M, s.Rv, s.E}};
  FactorInputs in;
  for (int i = 0; i < 6; ++i) {
    Tensor g = randn(shapes[i], dt, device, seed * 8 + uint64_t(i));
    in.gpu.push_back(g);
    in.cpu.push_back(g.to(Device::cpu()).to(DType::F64));
  }
  return in;
}

// The f64 reference decode of those factors over the given cache lengths.
inline Tensor cpu_decode(const FactorInputs& in, const std::vector<int64_t>& lengths) {
  TpaOptions o;
  o.cache_lengths = lengths;
  const std::vector<Tensor>& c = in.cpu;
  return tpa_decode(c[0], c[1], c[2], c[3], c[4], c[5], o, Impl::Reference);
}

#if LINTAPE_WITH_CUDA
// The attention launchers on poisoned outputs, against ref (attention_and_grads' output and six gradients for
// the upstream gradient w): every forward kernel the device runs (tpa_cuda::forward_kernels; a call with
// documents always runs the mma.sync kernel), each writing every element and a finite lse, then each backward
// kernel (tpa_cuda::backward_kernels; calls it does not take run the mma.sync kernel) reading that forward's
// output and lse (so a wrong lse fails the gradients) on six poisoned gradients. The persistent kernels run on
// five blocks at most, so that a block walks several work items.
inline void check_attention_launchers(tpa_cuda::AttentionArgs a, DType dt, const Tensor& w,
                                      const std::vector<Tensor>& ref) {
  a.persistent_blocks = 5;
  const int64_t B = a.aq.size(0), N = a.aq.size(1), H = a.aq.size(2), E = a.bv.size(-1);
  Tensor out = empty({B, N, H, E}, dt, a.aq.device()), lse = empty({B, N, H}, DType::F32, a.aq.device());
  const std::vector<Tensor> f = {a.aq, a.bq, a.ak, a.bk, a.av, a.bv};
  tpa_cuda::FactorGrads fg{empty(f[0].shape(), dt, f[0].device()), empty(f[1].shape(), dt, f[0].device()),
                           empty(f[2].shape(), dt, f[0].device()), empty(f[3].shape(), dt, f[0].device()),
                           empty(f[4].shape(), dt, f[0].device()), empty(f[5].shape(), dt, f[0].device())};
  Tensor* grads[] = {&fg.aq, &fg.bq, &fg.ak, &fg.bk, &fg.av, &fg.bv};
  for (tpa_cuda::ForwardKernel k : tpa_cuda::forward_kernels(a.aq.device().index)) {
    CAPTURE(int(k));
    a.forward_kernel = k;
    poison_(out);
    poison_(lse);
    tpa_cuda::attention_forward(a, out, lse);
    bool lse_finite = true;
    for (double v : lse.to(Device::cpu()).to_vector<double>()) lse_finite = lse_finite && std::isfinite(v);
    CHECK(lse_finite);
    CHECK_CLOSE_TENSOR(out.to(Device::cpu()), ref[0], dt);
    for (tpa_cuda::BackwardKernel bk : tpa_cuda::backward_kernels(a.aq.device().index)) {
      CAPTURE(int(bk));
      a.backward_kernel = bk;
      for (Tensor* t : grads) poison_(*t);
      tpa_cuda::attention_backward(a, out, lse, w.to(dt).to(a.aq.device()), fg);
      for (size_t i = 0; i < 6; ++i) {
        CAPTURE(kAttentionNames[i + 1]);
        CHECK_CLOSE_TENSOR(grads[i]->to(Device::cpu()), ref[i + 1], dt);
      }
    }
  }
}
#endif

}  // namespace lintape::test
