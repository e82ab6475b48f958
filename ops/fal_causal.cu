// Fused FAL, causal with decay and state: one block per (b, h) walks the sequence in chunks, the f32 state in
// shared memory (ops/fal_sweep.cuh): inside a chunk the masked, decayed product, across chunks the carried
// state. Backward runs two sweeps: forward again for dq and dg (the states recomputed, never stored), and
// backward from the final state's gradient for dk, dv and dS0.
#include "ops/fal_sweep.cuh"

namespace lintape::fal_cuda {

void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                    const Tensor& S0, const Tensor& out, const Tensor& S_final) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0 || v.size(3) == 0) return;
  SweepArgs a = sweep_args(q, k, v, g, spec);
  a.pass = kForward;
  a.causal = true;
  a.state_in = S0.defined() ? S0.data_ptr<float>() : nullptr;
  a.state_out = S_final.data_ptr<float>();
  a.out = out.data();
  launch_sweep(a, q.dtype(), dim3(unsigned(BH), 1), cuda::stream(q.device().index), "fal");
}

void causal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                     const Tensor& S0, const Tensor& dout, const Tensor& dS_final, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dS0) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0) return;
  cudaStream_t st = cuda::stream(q.device().index);
  SweepArgs a = sweep_args(q, k, v, g, spec);
  a.causal = true;
  a.dout = dout.data();
  a.dq = dq.data();
  a.dk = dk.data();
  a.dv = dv.data();
  a.dg = dg.data();
  a.pass = kQueryGrad;
  a.state_in = S0.defined() ? S0.data_ptr<float>() : nullptr;
  launch_sweep(a, q.dtype(), dim3(unsigned(BH), 1), st, "fal");
  a.pass = kKeyGrad;
  a.state_in = dS_final.defined() ? dS_final.data_ptr<float>() : nullptr;
  a.state_out = dS0.defined() ? dS0.data_ptr<float>() : nullptr;
  launch_sweep(a, q.dtype(), dim3(unsigned(BH), 1), st, "fal");
}

}  // namespace lintape::fal_cuda
