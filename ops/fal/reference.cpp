// The FAL family's reference: the linear attention in double with a hand-written backward, on qb, kb, vb and
// gb from the LRPE family's reference (the act alone through ops/activation.h's act_reference).
#include <algorithm>
#include <memory>
#include "autograd/tape.h"
#include "core/parallel.h"
#include "ops/fal/paths.h"

namespace lintape::fal_paths {
using autograd::Grads;
using autograd::Input;
using autograd::record;

Tensor reference_act(const Tensor& x, const ActSpec& a) {
  if (a.act == Act::None) return x;
  const Tensor xs = x.detach().contiguous();
  Tensor y = from_vector(act_reference(xs.to_vector<double>(), xs.shape(), a.act, a.dim), xs.shape(), xs.dtype());
  record("fal_act", {x}, {y}, [xs, a](const Grads& gr) -> Grads {
    const std::vector<double> dx =
        act_reference_backward(xs.to_vector<double>(), gr[0].to_vector<double>(), xs.shape(), a.act, a.dim);
    return {from_vector(dx, xs.shape(), xs.dtype())};
  });
  return y;
}

namespace {

// The linear attention on activated, encoded inputs: qb (B, N, H, P), kb (B, M, H, P), vb (B, M, H, E), gb (B,
// N, H, E), all contiguous, values in double; starts (B x N) the documents' starts (causal; empty: none).
struct CoreInputs {
  int64_t B, N, M, H, P, E;
  std::vector<double> q, k, v, g;
  std::vector<int32_t> starts;
  // Token t > 0 of row b begins a document: the state is reset before it.
  bool resets(int64_t b, int64_t t) const { return !starts.empty() && t > 0 && starts[size_t(b * N + t)] == t; }
  size_t qi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * N + t) * H + h) * P); }
  size_t ki(int64_t b, int64_t t, int64_t h) const { return size_t(((b * M + t) * H + h) * P); }
  size_t vi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * M + t) * H + h) * E); }
  size_t gi(int64_t b, int64_t t, int64_t h) const { return size_t(((b * N + t) * H + h) * E); }
};

CoreInputs core_inputs(const Tensor& qb, const Tensor& kb, const Tensor& vb, const Tensor& gb, const Documents& docs) {
  return {qb.size(0),
          qb.size(1),
          kb.size(1),
          qb.size(2),
          qb.size(3),
          vb.size(3),
          qb.to_vector<double>(),
          kb.to_vector<double>(),
          vb.to_vector<double>(),
          gb.to_vector<double>(),
          docs.host_starts()};
}

// The states of (b, h) walked forward from S0's block (zeros when s0 is empty). Causal: S_t = lambda S_{t-1} +
// kb_t^T vb_t (S_{t-1} taken as 0 where t begins a document other than the row's first), then at_query(t) at
// each token; noncausal: every key first (S = kv), then at_query(t) for each
// query. S holds the last state on return.
template <class AtQuery>
void walk_states(const CoreInputs& c, bool causal, double lambda, const std::vector<double>& s0, int64_t b,
                 int64_t h, std::vector<double>& S, AtQuery at_query) {
  const int64_t P = c.P, E = c.E;
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
  if (causal) {
    for (int64_t t = 0; t < c.N; ++t) {
      const double carry = c.resets(b, t) ? 0.0 : lambda;
      for (double& x : S) x *= carry;
      add_token(t);
      at_query(t);
    }
  } else {
    for (int64_t t = 0; t < c.M; ++t) add_token(t);
    for (int64_t t = 0; t < c.N; ++t) at_query(t);
  }
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
      auto emit = [&](int64_t t) {
        const double* qr = &c.q[c.qi(b, t, h)];
        for (int64_t e = 0; e < E; ++e) {
          double y = 0;
          for (int64_t p = 0; p < P; ++p) y += qr[p] * S[size_t(p * E + e)];
          o[c.gi(b, t, h) + size_t(e)] = c.g[c.gi(b, t, h) + size_t(e)] * y;
        }
      };
      walk_states(c, causal, lam.empty() ? 1.0 : lam[size_t(h)], s0, b, h, S, emit);
      if (causal) std::copy(S.begin(), S.end(), S_final.begin() + (b * c.H + h) * P * E);
  });
  return {o, S_final};
}

struct CoreGrads {
  std::vector<double> q, k, v, g, s0;
};

// Backward of core_forward from do (empty: zero) and, causal, dS_final (empty: zero). Causal: G_t = dL/dS_t =
// qb_t^T dy_t + lambda G_{t+1} (+ dS_final at t = N-1; no lambda G_{t+1} where t + 1 begins a document);
// dkb_t = G_t vb_t, dvb_t = kb_t G_t, dS0 = lambda G_0; dqb_t = dy_t S_t^T and dgb_t = do_t * y_t need the
// forward states.
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
      walk_states(c, causal, l, s0, b, h, S, query_grads);
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
          const double carry = c.resets(b, t) ? 0.0 : l;
          for (double& s : G) s *= carry;
        }
        if (!s0.empty()) std::copy(G.begin(), G.end(), gr.s0.begin() + (b * c.H + h) * P * E);
      } else {
        for (int64_t t = 0; t < c.N; ++t) add_query(t);
        for (int64_t t = 0; t < c.M; ++t) key_grads(t);
      }
  });
  return gr;
}

}  // namespace

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
  auto ctx = std::make_shared<CoreInputs>(core_inputs(qb.detach(), kb.detach(), vb.detach(), gb.detach(), o.documents));
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

}  // namespace lintape::fal_paths
