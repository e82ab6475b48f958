// The FAL family: input checks, dispatch, the CPU reference (loops in double with a hand-written backward) and
// the composed path (primitive ops and the tape; causal in chunks: the masked, decayed product inside each
// chunk plus the carried state and S0 terms) and the fused CUDA path (ops/fal/noncausal.cu, ops/fal/causal.cu
// and the chunk kernels it dispatches to; its backward recorded on the tape). fal_step runs through primitive
// ops on the CPU (and for f64) and through its fused kernel (ops/fal/step.cu) on CUDA.
#include "ops/fal/fal.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include "autograd/tape.h"
#include "core/parallel.h"
#include "ops/elementwise.h"
#include "ops/fal/launch.h"
#include "ops/lrpe/lrpe.h"
#include "ops/matmul.h"
#include "ops/shape.h"

namespace lintape {
using autograd::Grads;
using autograd::Input;
using autograd::nondiff;
using autograd::record;

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

namespace {

// The state dtype: f32 always, f64 for f64 inputs (gradient checks).
DType state_dtype(DType input) { return input == DType::F64 ? DType::F64 : DType::F32; }

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
  if (o.decay.defined()) {
    LT_CHECK(o.causal, "[", op,
             "] decay is for causal mode only; got a decay tensor in noncausal "
             "mode");
    LT_CHECK(o.decay.dim() == 1 && o.decay.size(0) == H && is_floating(o.decay.dtype()), "[", op,
             "] decay must be a float tensor of shape (H) = (", H, "); got ", shape_str(o.decay.shape()), " ",
             dtype_name(o.decay.dtype()));
    const std::vector<double> lam = check_decay_values ? o.decay.to_vector<double>() : std::vector<double>();
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

std::vector<double> decay_values(const FalOptions& o, int64_t H) {
  return o.decay.defined() ? o.decay.to_vector<double>() : std::vector<double>(size_t(H), 1.0);
}

// qb or kb through the LRPE family (which applies the act), or the act alone; impl picks the path.
Tensor act_lrpe(const Tensor& x, const ActSpec& a, const FalOptions& o, Impl impl);

// ---------------------------------------------------------------------------------------------------
// Reference: plain loops in double.

double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// act(x) of x (B, N, H, D) in row-major order.
std::vector<double> act_values(const std::vector<double>& x, const Shape& s, const ActSpec& a) {
  const int64_t B = s[0], N = s[1], HD = s[2] * s[3], D = s[3];
  std::vector<double> y(x.size());
  switch (a.act) {
    case Act::None: return x;
    case Act::Relu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = std::max(x[i], 0.0);
      return y;
    case Act::Sigmoid:
      for (size_t i = 0; i < x.size(); ++i) y[i] = sigmoid_d(x[i]);
      return y;
    case Act::Silu:
      for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sigmoid_d(x[i]);
      return y;
    case Act::Softmax: break;
  }
  // Softmax groups: feature = D contiguous values; sequence = N values at stride H*D.
  const bool feature = a.dim == ActDim::Feature;
  const int64_t groups = feature ? B * N * s[2] : B * HD, len = feature ? D : N, stride = feature ? 1 : HD;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t base = feature ? gi * D : (gi / HD) * N * HD + gi % HD;
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, x[size_t(base + j * stride)]);
    for (int64_t j = 0; j < len; ++j)
      sum += (y[size_t(base + j * stride)] = std::exp(x[size_t(base + j * stride)] - m));
    for (int64_t j = 0; j < len; ++j) y[size_t(base + j * stride)] /= sum;
  }
  return y;
}

// dx from dy for y = act(x).
std::vector<double> act_backward(const std::vector<double>& x, const std::vector<double>& dy, const Shape& s,
                                 const ActSpec& a) {
  std::vector<double> dx(x.size());
  switch (a.act) {
    case Act::None: return dy;
    case Act::Relu:
      for (size_t i = 0; i < x.size(); ++i) dx[i] = x[i] > 0 ? dy[i] : 0.0;
      return dx;
    case Act::Sigmoid:
      for (size_t i = 0; i < x.size(); ++i) {
        const double y = sigmoid_d(x[i]);
        dx[i] = dy[i] * y * (1 - y);
      }
      return dx;
    case Act::Silu:
      for (size_t i = 0; i < x.size(); ++i) {
        const double sg = sigmoid_d(x[i]);
        dx[i] = dy[i] * sg * (1 + x[i] * (1 - sg));
      }
      return dx;
    case Act::Softmax: break;
  }
  const std::vector<double> y = act_values(x, s, a);
  const int64_t B = s[0], N = s[1], HD = s[2] * s[3], D = s[3];
  const bool feature = a.dim == ActDim::Feature;
  const int64_t groups = feature ? B * N * s[2] : B * HD, len = feature ? D : N, stride = feature ? 1 : HD;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const int64_t base = feature ? gi * D : (gi / HD) * N * HD + gi % HD;
    double dot = 0;
    for (int64_t j = 0; j < len; ++j) dot += y[size_t(base + j * stride)] * dy[size_t(base + j * stride)];
    for (int64_t j = 0; j < len; ++j) {
      const size_t i = size_t(base + j * stride);
      dx[i] = y[i] * (dy[i] - dot);
    }
  }
  return dx;
}

Tensor reference_act(const Tensor& x, const ActSpec& a) {
  if (a.act == Act::None) return x;
  const Tensor xs = x.detach().contiguous();
  Tensor y = from_vector(act_values(xs.to_vector<double>(), xs.shape(), a), xs.shape(), xs.dtype());
  record("fal_act", {x}, {y}, [xs, a](const Grads& gr) -> Grads {
    return {from_vector(act_backward(xs.to_vector<double>(), gr[0].to_vector<double>(), xs.shape(), a), xs.shape(),
                        xs.dtype())};
  });
  return y;
}

// The linear attention on activated, encoded inputs: qb (B, N, H, P), kb (B, M, H, P), vb (B, M, H, E), gb (B,
// N, H, E), all contiguous, values in double.
struct CoreInputs {
  int64_t B, N, M, H, P, E;
  std::vector<double> q, k, v, g;
  size_t qi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * N + t) * H + h) * P); }
  size_t ki(int64_t b, int64_t t, int64_t h) const { return size_t(((b * M + t) * H + h) * P); }
  size_t vi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * M + t) * H + h) * E); }
  size_t gi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * N + t) * H + h) * E); }
};

CoreInputs core_inputs(const Tensor& qb, const Tensor& kb, const Tensor& vb, const Tensor& gb) {
  return {qb.size(0),
          qb.size(1),
          kb.size(1),
          qb.size(2),
          qb.size(3),
          vb.size(3),
          qb.to_vector<double>(),
          kb.to_vector<double>(),
          vb.to_vector<double>(),
          gb.to_vector<double>()};
}

// Forward: y = qb S (before the gate), o = gb * y; S per (b, h) is kv (noncausal) or S_t (causal). Returns o
// and, causal, the final state. s0 empty means zeros.
std::pair<std::vector<double>, std::vector<double>> core_forward(const CoreInputs& c, bool causal,
                                                                 const std::vector<double>& lam,
                                                                 const std::vector<double>& s0) {
  const int64_t P = c.P, E = c.E;
  std::vector<double> o(size_t(c.B * c.N * c.H * E)), S_final(size_t(c.B * c.H * P * E));
  // Each (b, h) writes its own rows: the pairs run on the CPU's cores.
  parallel_for(c.B * c.H, [&](int64_t bh) {
      const int64_t b = bh / c.H, h = bh % c.H;
      std::vector<double> S(size_t(P * E));
      if (s0.empty())
        std::fill(S.begin(), S.end(), 0.0);
      else
        std::copy_n(s0.begin() + (b * c.H + h) * P * E, P * E, S.begin());
      auto add_token = [&](int64_t t) {
        const double* kr = &c.k[c.ki(b, t, h)];
        const double* vr = &c.v[c.vi(b, t, h)];
        for (int64_t p = 0; p < P; ++p)
          for (int64_t e = 0; e < E; ++e) S[size_t(p * E + e)] += kr[p] * vr[e];
      };
      auto emit = [&](int64_t t) {
        const double* qr = &c.q[c.qi(b, t, h)];
        for (int64_t e = 0; e < E; ++e) {
          double y = 0;
          for (int64_t p = 0; p < P; ++p) y += qr[p] * S[size_t(p * E + e)];
          o[c.gi(b, t, h) + size_t(e)] = c.g[c.gi(b, t, h) + size_t(e)] * y;
        }
      };
      if (causal) {
        for (int64_t t = 0; t < c.N; ++t) {
          for (double& s : S) s *= lam[size_t(h)];
          add_token(t);
          emit(t);
        }
        std::copy(S.begin(), S.end(), S_final.begin() + (b * c.H + h) * P * E);
      } else {
        for (int64_t t = 0; t < c.M; ++t) add_token(t);
        for (int64_t t = 0; t < c.N; ++t) emit(t);
      }
  });
  return {o, S_final};
}

struct CoreGrads {
  std::vector<double> q, k, v, g, s0;
};

// Backward of core_forward from do (empty: zero) and, causal, dS_final (empty: zero). Causal: G_t = dL/dS_t =
// qb_t^T dy_t + lambda G_{t+1} (+ dS_final at t = N-1); dkb_t = G_t vb_t, dvb_t = kb_t G_t, dS0 = lambda G_0;
// dqb_t = dy_t S_t^T and dgb_t = do_t * y_t need the forward states.
CoreGrads core_backward(const CoreInputs& c, bool causal, const std::vector<double>& lam, const std::vector<double>& s0,
                        const std::vector<double>& dout, const std::vector<double>& dS_final) {
  const int64_t P = c.P, E = c.E;
  CoreGrads gr{std::vector<double>(c.q.size()), std::vector<double>(c.k.size()), std::vector<double>(c.v.size()),
               std::vector<double>(c.g.size()), std::vector<double>(s0.size())};
  auto d_out = [&](size_t i) { return dout.empty() ? 0.0 : dout[i]; };
  // Each (b, h) writes its own rows: the pairs run on the CPU's cores.
  parallel_for(c.B * c.H, [&](int64_t bh) {
      const int64_t b = bh / c.H, h = bh % c.H;
      std::vector<double> S(size_t(P * E)), G(size_t(P * E)), dy(static_cast<size_t>(E));
      const double l = lam.empty() ? 1.0 : lam[size_t(h)];
      // Pass 1: states forward; dqb and dgb at each query.
      if (s0.empty())
        std::fill(S.begin(), S.end(), 0.0);
      else
        std::copy_n(s0.begin() + (b * c.H + h) * P * E, P * E, S.begin());
      auto add_token = [&](int64_t t) {
        const double* kr = &c.k[c.ki(b, t, h)];
        const double* vr = &c.v[c.vi(b, t, h)];
        for (int64_t p = 0; p < P; ++p)
          for (int64_t e = 0; e < E; ++e) S[size_t(p * E + e)] += kr[p] * vr[e];
      };
      auto query_grads = [&](int64_t t) {
        const double* qr = &c.q[c.qi(b, t, h)];
        const size_t gi = c.gi(b, t, h);
        for (int64_t e = 0; e < E; ++e) {
          double y = 0;
          for (int64_t p = 0; p < P; ++p) y += qr[p] * S[size_t(p * E + e)];
          gr.g[gi + size_t(e)] = d_out(gi + size_t(e)) * y;
          dy[size_t(e)] = d_out(gi + size_t(e)) * c.g[gi + size_t(e)];
        }
        for (int64_t p = 0; p < P; ++p) {
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += dy[size_t(e)] * S[size_t(p * E + e)];
          gr.q[c.qi(b, t, h) + size_t(p)] = s;
        }
      };
      if (causal) {
        for (int64_t t = 0; t < c.N; ++t) {
          for (double& s : S) s *= l;
          add_token(t);
          query_grads(t);
        }
      } else {
        for (int64_t t = 0; t < c.M; ++t) add_token(t);
        for (int64_t t = 0; t < c.N; ++t) query_grads(t);
      }
      // Pass 2: G, the gradient of the state (noncausal: dkv = qb^T dy, one for all keys).
      if (causal && !dS_final.empty())
        std::copy_n(dS_final.begin() + (b * c.H + h) * P * E, P * E, G.begin());
      else
        std::fill(G.begin(), G.end(), 0.0);
      auto add_query = [&](int64_t t) {
        const double* qr = &c.q[c.qi(b, t, h)];
        const size_t gi = c.gi(b, t, h);
        for (int64_t p = 0; p < P; ++p)
          for (int64_t e = 0; e < E; ++e) G[size_t(p * E + e)] += qr[p] * d_out(gi + size_t(e)) * c.g[gi + size_t(e)];
      };
      auto key_grads = [&](int64_t t) {
        const double* kr = &c.k[c.ki(b, t, h)];
        const double* vr = &c.v[c.vi(b, t, h)];
        for (int64_t p = 0; p < P; ++p) {
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += G[size_t(p * E + e)] * vr[e];
          gr.k[c.ki(b, t, h) + size_t(p)] = s;
        }
        for (int64_t e = 0; e < E; ++e) {
          double s = 0;
          for (int64_t p = 0; p < P; ++p) s += kr[p] * G[size_t(p * E + e)];
          gr.v[c.vi(b, t, h) + size_t(e)] = s;
        }
      };
      if (causal) {
        for (int64_t t = c.N - 1; t >= 0; --t) {
          add_query(t);
          key_grads(t);
          for (double& s : G) s *= l;
        }
        if (!s0.empty()) std::copy(G.begin(), G.end(), gr.s0.begin() + (b * c.H + h) * P * E);
      } else {
        for (int64_t t = 0; t < c.N; ++t) add_query(t);
        for (int64_t t = 0; t < c.M; ++t) key_grads(t);
      }
  });
  return gr;
}

std::pair<Tensor, Tensor> run_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& S0, const FalOptions& o, const char* op) {
  LT_CHECK(!q.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got q on ", q.device().name());
  const Tensor qb = act_lrpe(q, o.q, o, Impl::Reference).contiguous();
  const Tensor kb = act_lrpe(k, o.k, o, Impl::Reference).contiguous();
  const Tensor vb = reference_act(v.contiguous(), o.v).contiguous();
  const Tensor gb = reference_act(g.contiguous(), o.g).contiguous();
  const bool causal = o.causal;
  const std::vector<double> lam = decay_values(o, q.size(2));
  const DType sdt = state_dtype(q.dtype());
  auto ctx = std::make_shared<CoreInputs>(core_inputs(qb.detach(), kb.detach(), vb.detach(), gb.detach()));
  const std::vector<double> s0 = S0.defined() ? S0.to_vector<double>() : std::vector<double>();
  auto [ov, sv] = core_forward(*ctx, causal, lam, s0);
  Tensor out = from_vector(ov, g.shape(), q.dtype());
  Tensor S_final = causal ? from_vector(sv, {ctx->B, ctx->H, ctx->P, ctx->E}, sdt) : Tensor();
  std::vector<Input> inputs{qb, kb, vb, gb};
  if (S0.defined()) inputs.push_back(S0);
  std::vector<Tensor> outputs{out};
  if (causal) outputs.push_back(S_final);
  const Shape qs = qb.shape(), ks = kb.shape(), vs = vb.shape(), gs = gb.shape();
  const DType dt = q.dtype();
  const Shape s0s = S0.defined() ? S0.shape() : Shape{};
  record(op, inputs, outputs, [ctx, causal, lam, s0, qs, ks, vs, gs, s0s, dt, sdt](const Grads& gin) -> Grads {
    const std::vector<double> dout = gin[0].defined() ? gin[0].to_vector<double>() : std::vector<double>();
    const std::vector<double> dS =
        causal && gin.size() > 1 && gin[1].defined() ? gin[1].to_vector<double>() : std::vector<double>();
    CoreGrads gr = core_backward(*ctx, causal, lam, s0, dout, dS);
    Grads res{from_vector(gr.q, qs, dt), from_vector(gr.k, ks, dt), from_vector(gr.v, vs, dt),
              from_vector(gr.g, gs, dt)};
    if (!s0.empty()) res.push_back(from_vector(gr.s0, s0s, sdt));
    return res;
  });
  return {out, S_final};
}

// ---------------------------------------------------------------------------------------------------
// Composed: primitive ops, differentiated by the tape.

Tensor act_lrpe(const Tensor& x, const ActSpec& a, const FalOptions& o, Impl impl) {
  const LrpeOptions lo{o.offset, a.act, a.dim};
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

// lambda^(exponent) per head as an (H or 1, rows, 1) tensor, exponent = base + sign * row.
Tensor decay_powers(const std::vector<double>& lam, int64_t rows, int64_t base, int64_t sign, DType dt, Device dev) {
  const int64_t H = int64_t(lam.size());
  std::vector<double> w(size_t(H * rows));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < rows; ++r) w[size_t(h * rows + r)] = std::pow(lam[size_t(h)], double(base + sign * r));
  return from_vector(w, {H, rows, 1}, dt, dev);
}

// Tokens per chunk of the composed causal form: its scores take B * H * N * kComposedChunk elements.
constexpr int64_t kComposedChunk = 128;

std::pair<Tensor, Tensor> run_composed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                       const Tensor& S0, const FalOptions& o) {
  const DType dt = q.dtype(), sdt = state_dtype(dt);
  const Device dev = q.device();
  const int64_t N = q.size(1), H = q.size(2);
  const std::vector<int64_t> heads_first{0, 2, 1, 3};
  Tensor qb = act_lrpe(q, o.q, o, Impl::Composed).permute(heads_first);  // (B, H, N, P)
  Tensor kb = act_lrpe(k, o.k, o, Impl::Composed).permute(heads_first);  // (B, H, M, P)
  Tensor vb = apply_act(v, o.v.act, o.v.dim).permute(heads_first);       // (B, H, M, E)
  Tensor gb = apply_act(g, o.g.act, o.g.dim);                            // (B, N, H, E)
  if (!o.causal) {
    Tensor y = matmul(qb, matmul(kb, vb, true, false));  // (B, H, N, E)
    return {gb * y.permute(heads_first), Tensor()};
  }
  // Causal, in chunks of C tokens, all chunks at once (the sequence zero-padded to nC * C tokens):
  //   inside chunk c:  y_i = sum_{j <= i} lambda^(i - j) (qb_i . kb_j) vb_j + lambda^(i + 1) qb_i S_c
  //   kv_c = sum_j lambda^(C - 1 - j) kb_j^T vb_j   (the chunk's contribution, decayed to its end)
  //   S_c = lambda^(C c) S0 + sum_{c' < c} lambda^(C (c - 1 - c')) kv_c'   (the state before chunk c:
  //         a product with an nC x nC decay mask rather than a loop, so that the tape records a few ops)
  // and the final state lambda^N S0 + sum_s lambda^(N - 1 - s) kb_s^T vb_s.
  if (N == 0) {  // no tokens: an empty output, and the state passes through
    const Tensor S = S0.defined() ? S0.to(sdt) : zeros({q.size(0), H, qb.size(3), vb.size(3)}, sdt, dev);
    return {zeros(g.shape(), dt, dev), S};
  }
  const std::vector<double> lam = decay_values(o, H);
  const int64_t R = o.decay.defined() ? H : 1, C = std::min(N, kComposedChunk), nC = (N + C - 1) / C;
  const int64_t B = q.size(0), P = qb.size(3), E = vb.size(3), Np = nC * C;
  const std::vector<double> lam_r(lam.begin(), lam.begin() + R);
  Tensor W;
  {
    // Built on the device from the integer gaps d = i - j: the mask relu(d + 1) - relu(d) is 1 for d >= 0 and 0
    // below; the decay exp(d log lambda) uses relu(d) so that no power overflows.
    NoGradGuard no_grad;
    const DType ct = state_dtype(dt);
    Tensor pos = arange(0, C, ct, dev);
    Tensor gap = pos.view({C, 1}) - pos.view({1, C});
    W = relu(gap + 1.0) - relu(gap);
    if (o.decay.defined()) {
      std::vector<double> log_lam(static_cast<size_t>(R));
      for (int64_t h = 0; h < R; ++h) log_lam[size_t(h)] = std::log(lam[size_t(h)]);
      W = W * exp(relu(gap).view({1, C, C}) * from_vector(log_lam, {R, 1, 1}, ct, dev));
    }
    W = W.to(dt).view({R, 1, C, C});
  }
  auto chunks = [&](const Tensor& x) {  // (B, H, N, w) -> (B, H, nC, C, w)
    const int64_t w = x.size(3);
    Tensor padded = Np == N ? x : cat({x, zeros({B, H, Np - N, w}, x.dtype(), dev)}, 2);
    return padded.reshape({B, H, nC, C, w});
  };
  Tensor qc = chunks(qb), kc = chunks(kb), vc = chunks(vb);
  Tensor y = matmul(matmul(qc, kc, false, true) * W, vc);  // (B, H, nC, C, E)
  if (nC > 1 || S0.defined()) {
    Tensor kv = matmul(kc.to(sdt) * decay_powers(lam_r, C, C - 1, -1, sdt, dev).view({R, 1, C, 1}), vc.to(sdt), true,
                       false);  // (B, H, nC, P, E)
    std::vector<double> mask(size_t(R * nC * nC), 0.0), s0_pow(size_t(R * nC));
    for (int64_t h = 0; h < R; ++h)
      for (int64_t c = 0; c < nC; ++c) {
        s0_pow[size_t(h * nC + c)] = std::pow(lam_r[size_t(h)], double(C * c));
        for (int64_t c2 = 0; c2 < c; ++c2)
          mask[size_t((h * nC + c) * nC + c2)] = std::pow(lam_r[size_t(h)], double(C * (c - 1 - c2)));
      }
    // matmul takes equal batch dims: the per-head mask is broadcast to (B, H, nC, nC) first.
    Tensor chunk_mask = from_vector(mask, {R, nC, nC}, sdt, dev) + zeros({B, H, nC, nC}, sdt, dev);
    Tensor starts = matmul(chunk_mask, kv.reshape({B, H, nC, P * E}));
    if (S0.defined()) starts = starts + S0.reshape({B, H, 1, P * E}) * from_vector(s0_pow, {R, nC, 1}, sdt, dev);
    Tensor inter = matmul(qc.to(sdt), starts.reshape({B, H, nC, P, E})) *
                   decay_powers(lam_r, C, 1, 1, sdt, dev).view({R, 1, C, 1});
    y = y + inter.to(dt);
  }
  y = y.reshape({B, H, Np, E});
  if (Np != N) y = y.narrow(2, 0, N);
  Tensor S = matmul(kb.to(sdt) * decay_powers(lam_r, N, N - 1, -1, sdt, dev), vb.to(sdt), true, false);
  if (S0.defined()) S = S + S0 * decay_powers(lam_r, 1, N, 0, sdt, dev);
  return {gb * y.permute(heads_first), S};
}

#if LINTAPE_WITH_CUDA
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
  return spec;
}

bool is_seq_softmax(const ActSpec& a) { return a.act == Act::Softmax && a.dim == ActDim::Sequence; }
#endif

// Why the fused sequence kernels cannot run this call, or nullptr when they can.
const char* fused_unsupported(const Tensor& q, const Tensor& v, const FalOptions& o) {
#if LINTAPE_WITH_CUDA
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
#else
  (void)q, (void)v, (void)o;
  return "lintape was built without CUDA";
#endif
}

// True when the call runs the chunk kernels (causal: chunk-parallel; noncausal: ops/fal/noncausal.cuh), whose
// forward and backward are faster than the composed ones.
bool chunked(const Tensor& q, const Tensor& v, const FalOptions& o) {
#if LINTAPE_WITH_CUDA
  if (!q.is_cuda()) return false;
  const FalStepSpec codes = kernel_codes(o);
  return o.causal ? fal_cuda::causal_chunked(q.dtype(), q.size(3), v.size(3), codes)
                  : fal_cuda::noncausal_chunked(q.dtype(), q.size(3), v.size(3), codes);
#else
  (void)q, (void)v, (void)o;
  return false;
#endif
}

#if LINTAPE_WITH_CUDA
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
#endif

// The fused kernels: forward now, backward recorded on the tape (it saves q, k, v, g and kv or S0).
std::pair<Tensor, Tensor> run_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& S0, const FalOptions& o, const char* op) {
  const char* why = fused_unsupported(q, v, o);
  LT_CHECK(why == nullptr, "[", op, "] Impl::Fused cannot run this call: ", why);
  // No tokens: the state passes through, an identity the tape records (nothing for the kernels to do).
  if (o.causal && q.size(1) == 0) return run_composed(q, k, v, g, S0, o);
#if LINTAPE_WITH_CUDA
  const Device dev = q.device();
  const FalStepSpec spec = kernel_spec(q, o, op);
  const bool causal = o.causal;
  // The launchers take strided views (the chunk kernels read them in place, the sweeps copy them).
  const Tensor qc = q.detach(), kc = k.detach(), vc = v.detach(), gc = g.detach();
  const Tensor s0 = S0.defined() ? S0.detach().contiguous() : Tensor();
  const Shape state_shape{q.size(0), q.size(2), fal_state_rows(o.lrpe, q.size(3)), v.size(3)};
  Tensor out = empty(g.shape(), g.dtype(), dev);
  Tensor state = empty(state_shape, DType::F32, dev);  // kv (noncausal, saved) or the final state
  if (causal)
    fal_cuda::causal_forward(qc, kc, vc, gc, spec, s0, out, state);
  else
    fal_cuda::noncausal_forward(qc, kc, vc, gc, spec, state, out);
  std::vector<Input> inputs{q, k, v, g};
  if (S0.defined()) inputs.push_back(S0);
  std::vector<Tensor> outputs{out};
  if (causal) outputs.push_back(state);
  const Tensor kv = causal ? Tensor() : state;
  const bool chunk_kernels = chunked(q, v, o);
  record(op, inputs, outputs, [qc, kc, vc, gc, s0, kv, spec, causal, state_shape, chunk_kernels](const Grads& gin)
                                   -> Grads {
    const Device d = qc.device();
    const Tensor dout = gin[0].defined() ? gin[0].contiguous() : zeros(gc.shape(), gc.dtype(), d);
    const Tensor dS = causal && gin.size() > 1 && gin[1].defined() ? gin[1].contiguous() : Tensor();
    auto [dq, dk, dv, dg] = gradient_buffers({qc, kc, vc, gc}, chunk_kernels);
    Tensor dS0 = s0.defined() ? empty(state_shape, DType::F32, d) : Tensor();
    if (causal)
      fal_cuda::causal_backward(qc, kc, vc, gc, spec, s0, dout, dS, dq, dk, dv, dg, dS0);
    else
      fal_cuda::noncausal_backward(qc, kc, vc, gc, spec, kv, dout, dq, dk, dv, dg);
    Grads res{dq, dk, dv, dg};
    if (s0.defined()) res.push_back(dS0);
    return res;
  });
  return {out, causal ? state : Tensor()};
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
  // noncausal calls) are slower, and the noncausal sweep's forward no faster. Auto runs Fused for the calls
  // that the chunk kernels take and for causal calls that record no gradient (prefill, evaluation), and
  // Composed otherwise.
  if (impl == Impl::Auto) {
    const bool records = autograd::grad_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                                      g.requires_grad() || (S0.defined() && S0.requires_grad()));
    const bool fused = fused_unsupported(q, v, o) == nullptr && (chunked(q, v, o) || (o.causal && !records));
    impl = !q.is_cuda() ? Impl::Reference : fused ? Impl::Fused : Impl::Composed;
  }
  switch (impl) {
    case Impl::Reference: return run_reference(q, k, v, g, S0, o, op);
    case Impl::Composed: return run_composed(q, k, v, g, S0, o);
    case Impl::Fused: return run_fused(q, k, v, g, S0, o, op);
    case Impl::Auto: break;
  }
  fail(str("[", op, "] unknown impl"));
}

// The fused step kernel (ops/fal/step.cu); the inputs are checked, causal and one token each.
Tensor step_fused(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                  const FalOptions& o) {
#if LINTAPE_WITH_CUDA
  const Device dev = q_t.device();
  const FalStepSpec spec = kernel_spec(q_t, o, "fal_step");
  Tensor state_out = empty(state.shape(), DType::F32, dev);
  Tensor out = empty(g_t.shape(), g_t.dtype(), dev);
  fal_cuda::step(q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), g_t.contiguous(), spec, state.contiguous(),
                 state_out, out);
  state = state_out;
  return out;
#else
  (void)state, (void)q_t, (void)k_t, (void)v_t, (void)g_t, (void)o;
  fail("[fal_step] lintape was built without CUDA");
#endif
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
  check_inputs(q_t, k_t, v_t, g_t, o, op, !o.decay.defined() || !o.decay.is_cuda());
  LT_CHECK(q_t.size(1) == 1, "[", op,
           "] q_t, k_t, v_t and g_t must hold one token, (B, 1, H, D or E); "
           "got q_t ",
           shape_str(q_t.shape()));
  LT_CHECK(o.lrpe != FalLrpe::MdCosine, "[", op, "] md_cosine has no 1-D position to step; got lrpe md_cosine");
  LT_CHECK(state.defined(), "[", op, "] state must be a defined (B, H, D', E) tensor (zeros to start)");
  check_state(state, q_t, v_t, o, op, "state");
  NoGradGuard no_grad;
  if (state.is_cuda() && q_t.dtype() != DType::F64) return step_fused(state, q_t, k_t, v_t, g_t, o);
  const DType dt = q_t.dtype(), sdt = state.dtype();
  const std::vector<int64_t> heads_first{0, 2, 1, 3};
  Tensor qb = act_lrpe(q_t, o.q, o, Impl::Composed).permute(heads_first).to(sdt);  // (B, H, 1, P)
  Tensor kb = act_lrpe(k_t, o.k, o, Impl::Composed).permute(heads_first).to(sdt);
  Tensor vb = apply_act(v_t, o.v.act, o.v.dim).permute(heads_first).to(sdt);  // (B, H, 1, E)
  Tensor gb = apply_act(g_t, o.g.act, o.g.dim);                               // (B, 1, H, E)
  Tensor kv = matmul(kb, vb, true, false);                                    // (B, H, P, E)
  if (o.decay.defined()) {
    const int64_t H = q_t.size(2);
    state = state * decay_powers(decay_values(o, H), 1, 1, 0, sdt, state.device()) + kv;
  } else {
    state = state + kv;
  }
  return gb * matmul(qb, state).permute(heads_first).to(dt);
}

}  // namespace lintape
