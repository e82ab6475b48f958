// The FAL family's entry points: the input checks, the Impl choice (the rule in ops/impl.h) and the dispatch to
// the paths of ops/fal/paths.h.
#include "ops/fal/fal.h"
#include "autograd/tape.h"
#include "ops/fal/paths.h"
#include "ops/lrpe/lrpe.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape {

FalLrpe fal_lrpe_from_name(const std::string& name) {
  if (name == "none") return FalLrpe::None;
  if (name == "cosine") return FalLrpe::Cosine;
  if (name == "rotate") return FalLrpe::Rotate;
  if (name == "md_cosine") return FalLrpe::MdCosine;
  fail(str("[fal] unknown lrpe kind '", name, "'; expected none, cosine, rotate or md_cosine"));
}

const char* fal_lrpe_name(FalLrpe kind) {
  switch (kind) {
    case FalLrpe::None: return "none";
    case FalLrpe::Cosine: return "cosine";
    case FalLrpe::Rotate: return "rotate";
    case FalLrpe::MdCosine: return "md_cosine";
  }
  return "?";
}

int64_t fal_state_rows(FalLrpe kind, int64_t D) {
  return kind == FalLrpe::Cosine || kind == FalLrpe::MdCosine ? 2 * D : D;
}

namespace fal_paths {

std::vector<double> decay_values(const FalOptions& o, int64_t H) {
  return o.decay.defined() ? o.decay.to_vector<double>() : std::vector<double>(size_t(H), 1.0);
}

Tensor act_lrpe(const Tensor& x, const ActSpec& a, const FalOptions& o, Impl impl) {
  const LrpeOptions lo{o.offset, a.act, a.dim, o.documents};
  switch (o.lrpe) {
    case FalLrpe::None: return impl == Impl::Reference ? reference_act(x.contiguous(), a) : apply_act(x, a.act, a.dim);
    case FalLrpe::Cosine: return lrpe_cosine(x, o.theta, lo, impl);
    case FalLrpe::Rotate: return lrpe_rotate(x, o.theta, lo, impl);
    case FalLrpe::MdCosine: {
      MdLrpeOptions mo;
      mo.shape = o.md_shape;
      mo.extra_tokens = o.md_extra_tokens;
      mo.act = a.act;
      mo.dim = a.dim;
      return md_lrpe_cosine(x, o.theta, mo, impl);
    }
  }
  return x;
}

}  // namespace fal_paths

namespace {
using fal_paths::fused_unsupported;
using fal_paths::state_dtype;

void check_one_act(const ActSpec& a, const char* input, bool causal, const char* op) {
  LT_CHECK(a.act != Act::Softmax || a.dim != ActDim::None, "[", op, "] act of ", input,
           ": softmax needs a dim (feature or sequence); got dim none");
  LT_CHECK(a.act == Act::Softmax || a.dim == ActDim::None, "[", op, "] act of ", input, ": ", act_name(a.act),
           " is elementwise and takes no dim; got dim ", act_dim_name(a.dim));
  // Softmax over the sequence normalises over every token, future ones included.
  LT_CHECK(!(causal && a.act == Act::Softmax && a.dim == ActDim::Sequence), "[", op, "] act of ", input,
           ": causal mode needs softmax over the feature dim or an elementwise "
           "act (softmax over the sequence "
           "would look at future tokens); got softmax over the sequence");
}

bool decay_captured(const Tensor& decay) {
#if LINTAPE_WITH_CUDA
  return cuda::capturing(decay.device().index);
#else
  (void)decay;
  return false;
#endif
}

// Reading a CUDA decay's values synchronises the device: fal_step checks them only for a CPU decay.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalOptions& o,
                  const char* op, bool check_decay_values = true) {
  LT_CHECK(q.defined() && k.defined() && v.defined() && g.defined(), "[", op,
           "] q, k, v and g must be defined tensors");
  const std::pair<const char*, const Tensor*> all[] = {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}};
  for (const auto& [name, t] : all) {
    LT_CHECK(t->dim() == 4, "[", op, "] ", name, " must be a 4-D tensor (B, N or M, H, D or E); got ",
             shape_str(t->shape()));
    LT_CHECK(is_floating(t->dtype()), "[", op, "] ", name, " must be a float tensor (f32, f64, bf16, f16); got ",
             dtype_name(t->dtype()));
    LT_CHECK(t->dtype() == q.dtype(), "[", op, "] ", name, " must have q's dtype ", dtype_name(q.dtype()), "; got ",
             dtype_name(t->dtype()));
    LT_CHECK(t->device() == q.device(), "[", op, "] ", name, " must be on q's device ", q.device().name(), "; got ",
             t->device().name());
  }
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), D = q.size(3), M = k.size(1), E = v.size(3);
  LT_CHECK(k.size(0) == B && k.size(2) == H && k.size(3) == D, "[", op, "] k must be (B, M, H, D) with B = ", B,
           ", H = ", H, ", D = ", D, " from q; got ", shape_str(k.shape()));
  LT_CHECK(v.size(0) == B && v.size(1) == M && v.size(2) == H, "[", op, "] v must be (B, M, H, E) with B = ", B,
           ", M = ", M, ", H = ", H, " from q and k; got ", shape_str(v.shape()));
  LT_CHECK(g.size(0) == B && g.size(1) == N && g.size(2) == H && g.size(3) == E, "[", op,
           "] g must be (B, N, H, E) = ", shape_str(Shape{B, N, H, E}), " from q and v; got ", shape_str(g.shape()));
  LT_CHECK(!o.causal || N == M, "[", op, "] causal mode needs N == M; got N = ", N, " (q) and M = ", M, " (k)");
  check_one_act(o.q, "q", o.causal, op);
  check_one_act(o.k, "k", o.causal, op);
  check_one_act(o.v, "v", o.causal, op);
  check_one_act(o.g, "g", o.causal, op);
  LT_CHECK(o.offset >= 0, "[", op, "] offset must be >= 0; got ", o.offset);
  if (o.lrpe != FalLrpe::None)
    LT_CHECK(o.theta.defined(), "[", op, "] lrpe ", fal_lrpe_name(o.lrpe), " needs theta; got an undefined tensor");
  LT_CHECK(o.lrpe != FalLrpe::MdCosine || o.offset == 0, "[", op,
           "] md_cosine takes its positions from the grid; offset must be 0, got ", o.offset);
  if (o.documents.defined()) {
    LT_CHECK(o.causal, "[", op, "] documents are for causal mode only (noncausal FAL sums every key of a row); "
             "got documents in noncausal mode");
    LT_CHECK(o.lrpe != FalLrpe::MdCosine, "[", op, "] md_cosine takes its positions from one grid per row and "
             "does not take documents");
    o.documents.check(op, B, N, q.device());
  }
  if (o.decay.defined()) {
    LT_CHECK(o.causal, "[", op,
             "] decay is for causal mode only; got a decay tensor in noncausal "
             "mode");
    LT_CHECK(o.decay.dim() == 1 && o.decay.size(0) == H && is_floating(o.decay.dtype()), "[", op,
             "] decay must be a float tensor of shape (H) = (", H, "); got ", shape_str(o.decay.shape()), " ",
             dtype_name(o.decay.dtype()));
    // A step being captured into a CUDA graph cannot wait for the device: the values go unchecked there (the
    // mixers' decay is a fixed buffer made on the host and checked then).
    const bool readable = check_decay_values && !(o.decay.is_cuda() && decay_captured(o.decay));
    const std::vector<double> lam = readable ? o.decay.to_vector<double>() : std::vector<double>();
    for (int64_t h = 0; h < int64_t(lam.size()); ++h)
      LT_CHECK(lam[size_t(h)] > 0 && lam[size_t(h)] <= 1, "[", op, "] decay must be in (0, 1]; got ", lam[size_t(h)],
               " for head ", h);
  }
}

void check_state(const Tensor& S, const Tensor& q, const Tensor& v, const FalOptions& o, const char* op,
                 const char* name) {
  const Shape want{q.size(0), q.size(2), fal_state_rows(o.lrpe, q.size(3)), v.size(3)};
  const DType dt = state_dtype(q.dtype());
  LT_CHECK(S.shape() == want, "[", op, "] ", name, " must be (B, H, D', E) = ", shape_str(want), "; got ",
           shape_str(S.shape()));
  LT_CHECK(S.dtype() == dt, "[", op, "] ", name, " must be ", dtype_name(dt), " for ", dtype_name(q.dtype()),
           " inputs; got ", dtype_name(S.dtype()));
  LT_CHECK(S.device() == q.device(), "[", op, "] ", name, " must be on q's device ", q.device().name(), "; got ",
           S.device().name());
}

// Impl::Fused: the fused path's own checks, then the kernels.
std::pair<Tensor, Tensor> fused_path(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& S0, const FalOptions& o, const char* op) {
  const char* why = fused_unsupported(q, v, o);
  LT_CHECK(why == nullptr, "[", op, "] Impl::Fused cannot run this call: ", why);
  // No tokens: the state passes through, an identity the tape records (nothing for the kernels to do).
  if (o.causal && q.size(1) == 0) return fal_paths::run_composed(q, k, v, g, S0, o);
#if LINTAPE_WITH_CUDA
  return fal_paths::run_fused(q, k, v, g, S0, o, op);
#else
  (void)k, (void)g, (void)S0;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

std::pair<Tensor, Tensor> run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& S0,
                              const FalOptions& o, Impl impl, const char* op) {
  // On CUDA (docs/BENCHMARKS.md) every fused causal forward is faster than the composed one and takes a
  // fraction of its memory; the chunk kernels' backwards (bf16/f16, causal and noncausal: chunked) and the
  // noncausal chunk forward are faster than the composed ones too, but the sweep's backwards (other causal and
  // noncausal calls) are slower, and the noncausal sweep's forward no faster. Under the rule of ops/impl.h,
  // Auto thus runs Fused for the calls that the chunk kernels take and for causal calls that record no
  // gradient (prefill, evaluation), and Composed otherwise.
  if (impl == Impl::Auto) {
    const bool records = autograd::grad_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                      g.requires_grad() || (S0.defined() && S0.requires_grad()));
    const bool fused = fused_unsupported(q, v, o) == nullptr && (fal_paths::chunked(q, v, o) || (o.causal && !records));
    impl = !q.is_cuda() ? Impl::Reference : fused ? Impl::Fused : Impl::Composed;
  }
  switch (impl) {
    case Impl::Reference: return fal_paths::run_reference(q, k, v, g, S0, o, op);
    case Impl::Composed: return fal_paths::run_composed(q, k, v, g, S0, o);
    case Impl::Fused: return fused_path(q, k, v, g, S0, o, op);
    case Impl::Auto: break;
  }
  fail(str("[", op, "] unknown impl"));
}

}  // namespace

Tensor fal(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalOptions& options, Impl impl) {
  check_inputs(q, k, v, g, options, "fal");
  return run(q, k, v, g, Tensor(), options, impl, "fal").first;
}

std::pair<Tensor, Tensor> fal_with_state(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                         const Tensor& S0, const FalOptions& options, Impl impl) {
  const char* op = "fal_with_state";
  LT_CHECK(options.causal, "[", op, "] needs causal mode (options.causal = true); got noncausal");
  check_inputs(q, k, v, g, options, op);
  if (S0.defined()) check_state(S0, q, v, options, op, "S0");
  return run(q, k, v, g, S0, options, impl, op);
}

Tensor fal_step(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                const FalOptions& options) {
  const char* op = "fal_step";
  FalOptions o = options;
  o.causal = true;
  o.documents = Documents();  // decoding continues the last document
  check_inputs(q_t, k_t, v_t, g_t, o, op, !o.decay.defined() || !o.decay.is_cuda());
  LT_CHECK(q_t.size(1) == 1, "[", op,
           "] q_t, k_t, v_t and g_t must hold one token, (B, 1, H, D or E); "
           "got q_t ",
           shape_str(q_t.shape()));
  LT_CHECK(o.lrpe != FalLrpe::MdCosine, "[", op, "] md_cosine has no 1-D position to step; got lrpe md_cosine");
  LT_CHECK(state.defined(), "[", op, "] state must be a defined (B, H, D', E) tensor (zeros to start)");
  check_state(state, q_t, v_t, o, op, "state");
  NoGradGuard no_grad;
#if LINTAPE_WITH_CUDA
  if (state.is_cuda() && q_t.dtype() != DType::F64) return fal_paths::step_fused(state, q_t, k_t, v_t, g_t, o);
#endif
  return fal_paths::step_composed(state, q_t, k_t, v_t, g_t, o);
}

}  // namespace lintape
