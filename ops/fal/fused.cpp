// The FAL family's fused path: the kernels of launch.h (the step kernel, ops/fal/step.cu; the sequence kernels,
// ops/fal/noncausal.cu and ops/fal/causal.cu, and the chunk kernels they dispatch to), forward now and the
// backward recorded on the tape. Rotate reaches the chunk kernels through the LRPE family's kernels
// (ops/lrpe/launch.h), which put q and k through their acts and the rotation first.
#if LINTAPE_WITH_CUDA
#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include "autograd/tape.h"
#include "ops/fal/launch.h"
#include "ops/fal/paths.h"
#include "ops/lrpe/launch.h"

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

// The chunk kernels' codes for q' = rotate(act_q(q)), k' = rotate(act_k(k)): no act on them, no LRPE.
FalStepSpec after_rotation(FalStepSpec spec) {
  spec.act_q = spec.act_k = FalStepSpec::kNone;
  spec.lrpe = FalStepSpec::kNoLrpe;
  spec.theta = Tensor();
  return spec;
}

bool chunk_kernels_take(const Tensor& q, const Tensor& v, bool causal, const FalStepSpec& codes) {
  return causal ? fal_cuda::causal_chunked(q.dtype(), q.size(3), v.size(3), codes)
                : fal_cuda::noncausal_chunked(q.dtype(), q.size(3), v.size(3), codes);
}

// The LRPE family's rotate call that turns x (q or k, with its act) into x' for the chunk kernels: the same
// theta, positions (offset, restarting at the documents' starts) and act as the FAL sweep's.
LrpeSpec rotation(const FalStepSpec& spec, const ActSpec& act) {
  LrpeSpec r;
  r.kind = LrpeSpec::Rotate;
  r.theta = spec.theta;
  r.offset = spec.position;
  r.starts = spec.starts;
  r.act = act.act;
  r.dim = act.dim;
  return r;
}

// x as the LRPE kernels read it: in place where they can, else a contiguous copy.
Tensor rotation_input(const Tensor& x) { return lrpe_cuda::reads_in_place(x) ? x : x.contiguous(); }

// x' = rotate(act(x)) (B, N, H, D), contiguous in x's dtype.
Tensor rotated(const Tensor& x, const LrpeSpec& r) {
  Tensor out = empty(x.shape(), x.dtype(), x.device());
  lrpe_cuda::forward(rotation_input(x), r, out, Tensor());
  return out;
}

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

SavedStates saved_states_override = SavedStates::Auto;

// Which chunk states a causal forward on the chunk kernels that records its backward saves (so that the backward
// skips its forward state pass): set_saved_states, else LINTAPE_FAL_SAVE_STATES: 0 none (the forward's memory
// stays the output and the final state; the backward computes them), all every chunk's, anything else or unset
// the even chunks' (the backward advances each odd chunk's from the one before: half the memory of all, at the
// same training speed).
SavedStates saved_states() {
  static const SavedStates env = [] {
    const char* v = std::getenv("LINTAPE_FAL_SAVE_STATES");
    const std::string s = v ? v : "";
    return s == "0" ? SavedStates::None : s == "all" ? SavedStates::All : SavedStates::Half;
  }();
  return saved_states_override == SavedStates::Auto ? env : saved_states_override;
}

}  // namespace

void set_saved_states(SavedStates s) { saved_states_override = s; }

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

bool rotates_first(const Tensor& q, const Tensor& v, const FalOptions& o) {
  if (!q.is_cuda() || o.lrpe != FalLrpe::Rotate || is_seq_softmax(o.q) || is_seq_softmax(o.k)) return false;
  return chunk_kernels_take(q, v, o.causal, after_rotation(kernel_codes(o)));
}

bool chunked(const Tensor& q, const Tensor& v, const FalOptions& o) {
  if (!q.is_cuda()) return false;
  return rotates_first(q, v, o) || chunk_kernels_take(q, v, o.causal, kernel_codes(o));
}

// Forward now, backward recorded on the tape (it saves q, k, v, g and kv or S0, and the chunk states). With rotate
// on the chunk kernels (rotates_first), q' and k' are temporaries of the forward, computed again by the backward.
std::pair<Tensor, Tensor> run_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& S0, const FalOptions& o, const char* op) {
  const Device dev = q.device();
  const FalStepSpec full = kernel_spec(q, o, op);
  const bool rotate_first = rotates_first(q, v, o);
  const FalStepSpec spec = rotate_first ? after_rotation(full) : full;
  const LrpeSpec rot_q = rotate_first ? rotation(full, o.q) : LrpeSpec(),
                 rot_k = rotate_first ? rotation(full, o.k) : LrpeSpec();
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
  // The chunk states (B, H, ceil(N / 64), D', E), or the even chunks' (B, H, ceil(N / 128), D', E), saved for the
  // backward when it is recorded.
  const SavedStates saving = saved_states();
  const int64_t saved_chunks = saving == SavedStates::Half ? (q.size(1) + 127) / 128 : (q.size(1) + 63) / 64;
  const Tensor chunk_states =
      causal && chunk_kernels && q.size(1) > 0 && saving != SavedStates::None && autograd::needs_grad(grad_inputs)
          ? empty({q.size(0), q.size(2), saved_chunks, state_shape[2], v.size(3)}, q.dtype(), dev)
          : Tensor();
  {
    const Tensor qk[2] = {rotate_first ? rotated(qc, rot_q) : qc, rotate_first ? rotated(kc, rot_k) : kc};
    if (causal)
      fal_cuda::causal_forward(qk[0], qk[1], vc, gc, spec, s0, out, state, 0, chunk_states);
    else
      fal_cuda::noncausal_forward(qk[0], qk[1], vc, gc, spec, state, out);
  }
  std::vector<Input> inputs(grad_inputs.begin(), grad_inputs.end());
  std::vector<Tensor> outputs{out};
  if (causal) outputs.push_back(state);
  const Tensor kv = causal ? Tensor() : state;
  record(op, inputs, outputs, [qc, kc, vc, gc, s0, kv, spec, rotate_first, rot_q, rot_k, causal, state_shape,
                               chunk_kernels, chunk_states](const Grads& gin) -> Grads {
    const Device d = qc.device();
    const Tensor dout = gin[0].defined() ? gin[0].contiguous() : zeros(gc.shape(), gc.dtype(), d);
    const Tensor dS = causal && gin.size() > 1 && gin[1].defined() ? gin[1].contiguous() : Tensor();
    // Rotate first: q' and k' again; the chunk kernels' gradients of q' and k' (dense, as are dv and dg) go
    // through the rotation's backward into dq and dk, which take q''s and k''s buffers.
    const Tensor q1 = rotate_first ? rotated(qc, rot_q) : qc, k1 = rotate_first ? rotated(kc, rot_k) : kc;
    auto [dq, dk, dv, dg] = gradient_buffers({q1, k1, vc, gc}, chunk_kernels && !rotate_first);
    Tensor dS0 = s0.defined() ? empty(state_shape, DType::F32, d) : Tensor();
    if (causal)
      fal_cuda::causal_backward(q1, k1, vc, gc, spec, s0, dout, dS, dq, dk, dv, dg, dS0, 0, chunk_states);
    else
      fal_cuda::noncausal_backward(q1, k1, vc, gc, spec, kv, dout, dq, dk, dv, dg);
    if (rotate_first) {
      lrpe_cuda::backward(rotation_input(qc), dq, rot_q, Tensor(), q1);
      lrpe_cuda::backward(rotation_input(kc), dk, rot_k, Tensor(), k1);
      dq = q1, dk = k1;
    }
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
