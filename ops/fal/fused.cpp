// The FAL family's fused path: the kernels of launch.h (the step kernel, ops/fal/step.cu; the sequence kernels,
// ops/fal/noncausal.cu and ops/fal/causal.cu, and the chunk kernels they dispatch to), forward now and the
// backward recorded on the tape.
#if LINTAPE_WITH_CUDA
#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include "autograd/tape.h"
#include "ops/fal/launch.h"
#include "ops/fal/paths.h"

namespace lintape::fal_paths {
using autograd::Grads;
using autograd::Input;
using autograd::record;

namespace {

FalStepSpec::ActCode step_act(const ActSpec& a) {
  switch (a.act) {
    case Act::None: return FalStepSpec::kNone;
    case Act::Relu: return FalStepSpec::kRelu;
    case Act::Sigmoid: return FalStepSpec::kSigmoid;
    case Act::Silu: return FalStepSpec::kSilu;
    case Act::Softmax: break;
  }
  return FalStepSpec::kSoftmaxFeature;  // softmax over the sequence was rejected by the checks
}

// The act and LRPE codes of a call (no tensors).
FalStepSpec kernel_codes(const FalOptions& o) {
  FalStepSpec spec;
  spec.act_q = step_act(o.q);
  spec.act_k = step_act(o.k);
  spec.act_v = step_act(o.v);
  spec.act_g = step_act(o.g);
  spec.lrpe = o.lrpe == FalLrpe::Cosine   ? FalStepSpec::kCosine
              : o.lrpe == FalLrpe::Rotate ? FalStepSpec::kRotate
                                          : FalStepSpec::kNoLrpe;
  return spec;
}

// The kernels' description of a checked call on CUDA inputs.
FalStepSpec kernel_spec(const Tensor& q, const FalOptions& o, const char* op) {
  const Device dev = q.device();
  FalStepSpec spec = kernel_codes(o);
  if (o.lrpe != FalLrpe::None) {
    spec.theta = o.theta.detach().to(dev).to(DType::F32).contiguous();
    const int64_t H = q.size(2), D = q.size(3), A = o.lrpe == FalLrpe::Rotate ? D / 2 : D;
    const Tensor& th = spec.theta;
    LT_CHECK(o.lrpe != FalLrpe::Rotate || D % 2 == 0, "[", op, "] rotate needs an even D; got D = ", D);
    LT_CHECK(th.dim() == 2 && (th.size(0) == H || th.size(0) == 1) && th.size(1) >= 1 && th.size(1) <= A, "[", op,
             "] theta must be (H, E_t), (1, E_t) or (H, 1) with H = ", H, " and E_t <= ", A, "; got ",
             shape_str(o.theta.shape()));
  }
  spec.position = o.offset;
  if (o.decay.defined()) spec.decay = o.decay.detach().to(dev).to(DType::F32).contiguous();
  if (o.documents.defined()) spec.starts = o.documents.starts().contiguous();
  return spec;
}

bool is_seq_softmax(const ActSpec& a) { return a.act == Act::Softmax && a.dim == ActDim::Sequence; }

// Gradients for q, k, v, g (B, N, H, D or E). When the four are consecutive column ranges of one (B, N, W)
// tensor (one projection split four ways) and the chunk kernels write them, they go to the same columns of
// one fresh (B, N, W) buffer, so that split's backward hands that buffer on uncopied; else dense tensors.
std::array<Tensor, 4> gradient_buffers(const std::array<Tensor, 4>& x, bool chunk_kernels) {
  const Tensor& q = x[0];
  const int64_t B = q.size(0), N = q.size(1), W = q.strides()[1];
  bool side_by_side = chunk_kernels && q.strides()[0] == N * W;
  int64_t base = q.offset(), end = q.offset();
  for (const Tensor& t : x) {
    side_by_side = side_by_side && t.size(1) == N && t.impl()->storage == q.impl()->storage &&
                   t.strides()[0] == q.strides()[0] &&
                   t.strides()[1] == W && t.strides()[3] == 1 && t.strides()[2] == t.size(3);
    base = std::min(base, t.offset());
    end = std::max(end, t.offset() + t.size(2) * t.size(3));
  }
  side_by_side = side_by_side && end - base <= W && W % 8 == 0;  // rows of 16 bytes for the kernels' stores
  for (const Tensor& t : x) side_by_side = side_by_side && (t.offset() - base) % 8 == 0;
  std::array<Tensor, 4> g;
  const Tensor buffer = side_by_side ? empty({B, N, W}, q.dtype(), q.device()) : Tensor();
  for (size_t i = 0; i < 4; ++i)
    g[i] = side_by_side ? buffer.narrow(2, x[i].offset() - base, x[i].size(2) * x[i].size(3)).reshape(x[i].shape())
                        : empty(x[i].shape(), x[i].dtype(), x[i].device());
  return g;
}

// Whether a causal forward on the chunk kernels that records its backward saves every chunk's entering state
// (so that the backward skips its forward state pass): yes unless LINTAPE_FAL_SAVE_STATES=0, which keeps the
// forward's memory at the output and the final state (the backward then computes them).
bool save_chunk_states() {
  static const bool on = [] {
    const char* v = std::getenv("LINTAPE_FAL_SAVE_STATES");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

}  // namespace

const char* fused_unsupported(const Tensor& q, const Tensor& v, const FalOptions& o) {
  if (!q.is_cuda()) return "the fused kernels run on CUDA";
  if (q.dtype() != DType::F32 && q.dtype() != DType::BF16 && q.dtype() != DType::F16)
    return "the fused kernels take f32, bf16 or f16 inputs";
  if (o.lrpe == FalLrpe::MdCosine) return "md_cosine runs composed";
  if (is_seq_softmax(o.q) || is_seq_softmax(o.k) || is_seq_softmax(o.v) || is_seq_softmax(o.g))
    return "softmax over the sequence runs composed";
  if (o.lrpe == FalLrpe::Rotate && q.size(3) % 2 != 0) return "rotate needs an even D";
  if (!fal_cuda::sequence_supported(q.size(3), fal_state_rows(o.lrpe, q.size(3)), v.size(3)))
    return "the state does not fit the kernels' shared memory (D, E <= 256, D' x E up to 256 x 128)";
  return nullptr;
}

bool chunked(const Tensor& q, const Tensor& v, const FalOptions& o) {
  if (!q.is_cuda()) return false;
  const FalStepSpec codes = kernel_codes(o);
  return o.causal ? fal_cuda::causal_chunked(q.dtype(), q.size(3), v.size(3), codes)
                  : fal_cuda::noncausal_chunked(q.dtype(), q.size(3), v.size(3), codes);
}

// Forward now, backward recorded on the tape (it saves q, k, v, g and kv or S0).
std::pair<Tensor, Tensor> run_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& S0, const FalOptions& o, const char* op) {
  const Device dev = q.device();
  const FalStepSpec spec = kernel_spec(q, o, op);
  const bool causal = o.causal;
  // The launchers take strided views (the chunk kernels read them in place, the sweeps copy them).
  const Tensor qc = q.detach(), kc = k.detach(), vc = v.detach(), gc = g.detach();
  const Tensor s0 = S0.defined() ? S0.detach().contiguous() : Tensor();
  const Shape state_shape{q.size(0), q.size(2), fal_state_rows(o.lrpe, q.size(3)), v.size(3)};
  Tensor out = empty(g.shape(), g.dtype(), dev);
  Tensor state = empty(state_shape, DType::F32, dev);  // kv (noncausal, saved) or the final state
  std::vector<Tensor> grad_inputs{q, k, v, g};
  if (S0.defined()) grad_inputs.push_back(S0);
  const bool chunk_kernels = chunked(q, v, o);
  // The chunk states (B, H, ceil(N / 64), D', E), saved for the backward when it is recorded.
  const Tensor chunk_states = causal && chunk_kernels && q.size(1) > 0 && save_chunk_states() &&
                                      autograd::needs_grad(grad_inputs)
                                  ? empty({q.size(0), q.size(2), (q.size(1) + 63) / 64, state_shape[2], v.size(3)},
                                          q.dtype(), dev)
                                  : Tensor();
  if (causal)
    fal_cuda::causal_forward(qc, kc, vc, gc, spec, s0, out, state, 0, chunk_states);
  else
    fal_cuda::noncausal_forward(qc, kc, vc, gc, spec, state, out);
  std::vector<Input> inputs(grad_inputs.begin(), grad_inputs.end());
  std::vector<Tensor> outputs{out};
  if (causal) outputs.push_back(state);
  const Tensor kv = causal ? Tensor() : state;
  record(op, inputs, outputs, [qc, kc, vc, gc, s0, kv, spec, causal, state_shape, chunk_kernels,
                               chunk_states](const Grads& gin) -> Grads {
    const Device d = qc.device();
    const Tensor dout = gin[0].defined() ? gin[0].contiguous() : zeros(gc.shape(), gc.dtype(), d);
    const Tensor dS = causal && gin.size() > 1 && gin[1].defined() ? gin[1].contiguous() : Tensor();
    auto [dq, dk, dv, dg] = gradient_buffers({qc, kc, vc, gc}, chunk_kernels);
    Tensor dS0 = s0.defined() ? empty(state_shape, DType::F32, d) : Tensor();
    if (causal)
      fal_cuda::causal_backward(qc, kc, vc, gc, spec, s0, dout, dS, dq, dk, dv, dg, dS0, 0, chunk_states);
    else
      fal_cuda::noncausal_backward(qc, kc, vc, gc, spec, kv, dout, dq, dk, dv, dg);
    Grads res{dq, dk, dv, dg};
    if (s0.defined()) res.push_back(dS0);
    return res;
  });
  return {out, causal ? state : Tensor()};
}

Tensor step_fused(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                  const FalOptions& o) {
  const Device dev = q_t.device();
  const FalStepSpec spec = kernel_spec(q_t, o, "fal_step");
  Tensor state_out = empty(state.shape(), DType::F32, dev);
  Tensor out = empty(g_t.shape(), g_t.dtype(), dev);
  fal_cuda::step(q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), g_t.contiguous(), spec, state.contiguous(),
                 state_out, out);
  state = state_out;
  return out;
}

}  // namespace lintape::fal_paths
#endif
