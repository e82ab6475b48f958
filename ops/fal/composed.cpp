// The FAL family's composed path: primitive ops, differentiated by the tape; causal in chunks of 128 tokens
// (the masked, decayed product inside each chunk plus the carried state and S0 terms). fal_step on the CPU and
// for f64 runs here too.
#include <algorithm>
#include <cmath>
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/fal/paths.h"
#include "ops/matmul.h"
#include "ops/shape.h"

namespace lintape::fal_paths {

namespace {

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

// 1 where the integer-valued x is >= 0, else 0 (the documents' masks, built on the device).
Tensor nonnegative(const Tensor& x) { return relu(x + 1.0) - relu(x); }

// The documents' masks of the chunked causal form (docs.h's rule), in the state dtype: starts padded to nC x C
// tokens with N (a padded query sees no key).
struct DocumentMasks {
  Tensor intra;        // (B, 1, nC, C, C): key j of the chunk is in query i's document
  Tensor uses_state;   // (B, 1, nC, C, 1): query i's document began before its chunk
  Tensor chunk_keys;   // (B, 1, nC, C, 1): key j is in the document of its chunk's last token
  Tensor chunk_links;  // (B, 1, nC, nC): chunk c' < c feeds the state entering chunk c (one document)
  Tensor s0_links;     // (B, 1, nC, 1): the state entering chunk c is in the row's first document
  Tensor final_keys;   // (B, 1, N, 1): key j is in the row's last document
  Tensor final_s0;     // (B, 1, 1, 1): the row is one document
};

DocumentMasks document_masks(const Documents& docs, int64_t N, int64_t C, int64_t nC, DType ct, Device dev) {
  NoGradGuard no_grad;
  const int64_t B = docs.batch(), Np = nC * C;
  Tensor st = docs.starts().to(ct);  // (B, N)
  if (Np != N) st = cat({st, full({B, Np - N}, double(N), ct, dev)}, 1);
  const Tensor pos = arange(0, Np, ct, dev);
  const Tensor chunk_start = arange(0, nC, ct, dev) * double(C);  // c0 of each chunk
  const Tensor stc = st.view({B, nC, C});
  DocumentMasks m;
  m.intra = nonnegative(pos.view({1, nC, 1, C}) - stc.view({B, nC, C, 1})).view({B, 1, nC, C, C});
  // Token s takes the state entering its chunk c0 when its document began before c0, or is the row's first
  // (the state entering chunk 0 is S0): starts[s] < max(c0, 1).
  std::vector<double> first_token(static_cast<size_t>(nC));
  for (int64_t c = 0; c < nC; ++c) first_token[size_t(c)] = double(std::max<int64_t>(c * C, 1));
  m.uses_state = nonnegative(from_vector(first_token, {1, nC, 1}, ct, dev) - 1.0 - stc).view({B, 1, nC, C, 1});
  const Tensor last = stc.narrow(2, C - 1, 1);  // (B, nC, 1): the start of each chunk's last token
  m.chunk_keys = nonnegative(pos.view({1, nC, C}) - last).view({B, 1, nC, C, 1});
  // The start of the token before chunk c (0 for c = 0, whose state is S0).
  const Tensor prev = nC > 1 ? cat({zeros({B, 1}, ct, dev), last.view({B, nC}).narrow(1, 0, nC - 1)}, 1)
                             : zeros({B, 1}, ct, dev);
  m.chunk_links = nonnegative(chunk_start.view({1, 1, nC}) + double(C - 1) - prev.view({B, nC, 1}))
                      .view({B, 1, nC, nC});
  m.s0_links = nonnegative(-prev).view({B, 1, nC, 1});
  const Tensor final_start = st.narrow(1, N - 1, 1);  // (B, 1)
  m.final_keys = nonnegative(pos.narrow(0, 0, N).view({1, N}) - final_start).view({B, 1, N, 1});
  m.final_s0 = nonnegative(-final_start).view({B, 1, 1, 1});
  return m;
}

}  // namespace

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
  // and the final state lambda^N S0 + sum_s lambda^(N - 1 - s) kb_s^T vb_s. With documents the same terms are
  // masked (DocumentMasks): the decay powers stay those of the token gaps, and a term crossing a document start
  // drops out (the state entering chunk c sums the keys of the document of token c C - 1 only).
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
  const bool docs = o.documents.defined();
  const DocumentMasks dm = docs ? document_masks(o.documents, N, C, nC, sdt, dev) : DocumentMasks();
  if (docs) W = W * dm.intra.to(dt);  // (B, R, nC, C, C)
  auto chunks = [&](const Tensor& x) {  // (B, H, N, w) -> (B, H, nC, C, w)
    const int64_t w = x.size(3);
    Tensor padded = Np == N ? x : cat({x, zeros({B, H, Np - N, w}, x.dtype(), dev)}, 2);
    return padded.reshape({B, H, nC, C, w});
  };
  Tensor qc = chunks(qb), kc = chunks(kb), vc = chunks(vb);
  Tensor y = matmul(matmul(qc, kc, false, true) * W, vc);  // (B, H, nC, C, E)
  if (nC > 1 || S0.defined()) {
    Tensor kd = kc.to(sdt) * decay_powers(lam_r, C, C - 1, -1, sdt, dev).view({R, 1, C, 1});
    if (docs) kd = kd * dm.chunk_keys;
    Tensor kv = matmul(kd, vc.to(sdt), true, false);  // (B, H, nC, P, E)
    std::vector<double> mask(size_t(R * nC * nC), 0.0), s0_pow(size_t(R * nC));
    for (int64_t h = 0; h < R; ++h)
      for (int64_t c = 0; c < nC; ++c) {
        s0_pow[size_t(h * nC + c)] = std::pow(lam_r[size_t(h)], double(C * c));
        for (int64_t c2 = 0; c2 < c; ++c2)
          mask[size_t((h * nC + c) * nC + c2)] = std::pow(lam_r[size_t(h)], double(C * (c - 1 - c2)));
      }
    // matmul takes equal batch dims: the per-head mask is broadcast to (B, H, nC, nC) first.
    Tensor chunk_mask = from_vector(mask, {R, nC, nC}, sdt, dev);
    if (docs) chunk_mask = chunk_mask * dm.chunk_links;
    chunk_mask = chunk_mask + zeros({B, H, nC, nC}, sdt, dev);
    Tensor entering = matmul(chunk_mask, kv.reshape({B, H, nC, P * E}));
    if (S0.defined()) {
      Tensor s0_coef = from_vector(s0_pow, {R, nC, 1}, sdt, dev);
      if (docs) s0_coef = s0_coef * dm.s0_links;
      entering = entering + S0.reshape({B, H, 1, P * E}) * s0_coef;
    }
    Tensor inter = matmul(qc.to(sdt), entering.reshape({B, H, nC, P, E})) *
                   decay_powers(lam_r, C, 1, 1, sdt, dev).view({R, 1, C, 1});
    if (docs) inter = inter * dm.uses_state;
    y = y + inter.to(dt);
  }
  y = y.reshape({B, H, Np, E});
  if (Np != N) y = y.narrow(2, 0, N);
  Tensor kd = kb.to(sdt) * decay_powers(lam_r, N, N - 1, -1, sdt, dev);
  if (docs) kd = kd * dm.final_keys;
  Tensor S = matmul(kd, vb.to(sdt), true, false);
  if (S0.defined()) {
    Tensor s0_coef = decay_powers(lam_r, 1, N, 0, sdt, dev);
    if (docs) s0_coef = s0_coef * dm.final_s0;
    S = S + S0 * s0_coef;
  }
  return {gb * y.permute(heads_first), S};
}

Tensor step_composed(Tensor& state, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& g_t,
                     const FalOptions& o) {
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

}  // namespace lintape::fal_paths
