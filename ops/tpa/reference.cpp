// The TPA family's reference: the naive formula in double, with a hand-written backward to all six factors
// (q, k, v recomputed from the factors, never saved).
#include <cmath>
#include <memory>
#include "autograd/tape.h"
#include "ops/tpa/paths.h"

namespace lintape::tpa_paths {
using autograd::Grads;
using autograd::record;

namespace {

using Vec = std::vector<double>;

// out[(row, h, d)] = (1/R) sum_r a[(row, h, r)] b[(row, r, d)] for rows = B * L.
Vec expand(const Vec& a, const Vec& b, int64_t rows, int64_t H, int64_t R, int64_t D) {
  Vec out(size_t(rows * H * D), 0.0);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        const double ar = a[size_t((row * H + h) * R + r)] / double(R);
        const double* br = b.data() + (row * R + r) * D;
        double* o = out.data() + (row * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += ar * br[d];
      }
  return out;
}

// The gradients of expand: da (rows, H, R) and db (rows, R, D) from dout (rows, H, D).
void expand_backward(const Vec& a, const Vec& b, const Vec& dout, int64_t rows, int64_t H, int64_t R, int64_t D,
                     Vec& da, Vec& db) {
  da.assign(a.size(), 0.0);
  db.assign(b.size(), 0.0);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < R; ++r) {
        const double* br = b.data() + (row * R + r) * D;
        const double* g = dout.data() + (row * H + h) * D;
        double* dbr = db.data() + (row * R + r) * D;
        const double ar = a[size_t((row * H + h) * R + r)] / double(R);
        double acc = 0;
        for (int64_t d = 0; d < D; ++d) {
          acc += g[d] * br[d];
          dbr[d] += ar * g[d];
        }
        da[size_t((row * H + h) * R + r)] = acc / double(R);
      }
}

struct Qkv {
  Vec q, k, v;  // (B, N, H, D), (B, M, H, D), (B, M, H, E)
};

Qkv reference_qkv(const Factors& f) {
  return {expand(f.aq.to_vector<double>(), f.bq.to_vector<double>(), f.B * f.N, f.H, f.Rq, f.D),
          expand(f.ak.to_vector<double>(), f.bk.to_vector<double>(), f.B * f.M, f.H, f.Rk, f.D),
          expand(f.av.to_vector<double>(), f.bv.to_vector<double>(), f.B * f.M, f.H, f.Rv, f.E)};
}

// o (B, N, H, E) and the log-sum-exp of the scaled scores (B, N, H).
void reference_forward(const Factors& f, const Qkv& t, double scale, const Visibility& vis, Vec& o, Vec& lse) {
  const int64_t N = f.N, M = f.M, H = f.H, D = f.D, E = f.E;
  o.assign(size_t(f.B * N * H * E), 0.0);
  lse.assign(size_t(f.B * N * H), 0.0);
  Vec s(static_cast<size_t>(M));
  for (int64_t b = 0; b < f.B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t m0 = vis.first(b, n), lim = vis.limit(b, n);
        const double* q = t.q.data() + ((b * N + n) * H + h) * D;
        double mx = -INFINITY;
        for (int64_t m = m0; m < lim; ++m) {
          const double* k = t.k.data() + ((b * M + m) * H + h) * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          s[size_t(m)] = scale * dot;
          mx = std::max(mx, s[size_t(m)]);
        }
        double sum = 0;
        for (int64_t m = m0; m < lim; ++m) sum += std::exp(s[size_t(m)] - mx);
        double* out = o.data() + ((b * N + n) * H + h) * E;
        for (int64_t m = m0; m < lim; ++m) {
          const double p = std::exp(s[size_t(m)] - mx) / sum;
          const double* v = t.v.data() + ((b * M + m) * H + h) * E;
          for (int64_t e = 0; e < E; ++e) out[e] += p * v[e];
        }
        lse[size_t((b * N + n) * H + h)] = mx + std::log(sum);
      }
}

// Gradients of q, k, v from dout, with the probabilities recomputed from the saved log-sum-exp.
Qkv reference_backward_qkv(const Factors& f, const Qkv& t, const Vec& o, const Vec& lse, const Vec& dout,
                           double scale, const Visibility& vis) {
  const int64_t N = f.N, M = f.M, H = f.H, D = f.D, E = f.E;
  Qkv g{Vec(t.q.size(), 0.0), Vec(t.k.size(), 0.0), Vec(t.v.size(), 0.0)};
  for (int64_t b = 0; b < f.B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = (b * N + n) * H + h, m0 = vis.first(b, n), lim = vis.limit(b, n);
        const double* q = t.q.data() + row * D;
        const double* go = dout.data() + row * E;
        double delta = 0;  // sum_m p dp = do . o
        for (int64_t e = 0; e < E; ++e) delta += go[e] * o[size_t(row * E + e)];
        double* dq = g.q.data() + row * D;
        for (int64_t m = m0; m < lim; ++m) {
          const int64_t krow = (b * M + m) * H + h;
          const double* k = t.k.data() + krow * D;
          const double* v = t.v.data() + krow * E;
          double dot = 0, dp = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          for (int64_t e = 0; e < E; ++e) dp += go[e] * v[e];
          const double p = std::exp(scale * dot - lse[size_t(row)]);
          const double ds = p * (dp - delta) * scale;
          double* dk = g.k.data() + krow * D;
          double* dv = g.v.data() + krow * E;
          for (int64_t e = 0; e < E; ++e) dv[e] += p * go[e];
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
          }
        }
      }
  return g;
}

}  // namespace

Tensor run_reference_attention(const Factors& f, double scale, const Visibility& vis, const char* op) {
  LT_CHECK(!f.aq.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got the factors on ", f.aq.device().name());
  const Qkv t = reference_qkv(f);
  auto saved = std::make_shared<std::pair<Vec, Vec>>();  // o and lse
  reference_forward(f, t, scale, vis, saved->first, saved->second);
  const DType dt = f.aq.dtype();
  Tensor out = from_vector(saved->first, {f.B, f.N, f.H, f.E}, dt);
  Factors fs = f;  // detached: the backward never extends the graph
  for (Tensor* x : {&fs.aq, &fs.bq, &fs.ak, &fs.bk, &fs.av, &fs.bv}) *x = x->detach();
  record(op, {f.aq, f.bq, f.ak, f.bk, f.av, f.bv}, {out}, [fs, saved, scale, vis](const Grads& g) -> Grads {
    const Qkv t = reference_qkv(fs);  // recomputed from the factors: q, k, v are never saved
    const Qkv dt = reference_backward_qkv(fs, t, saved->first, saved->second, g[0].to_vector<double>(), scale, vis);
    Grads out(6);
    const std::pair<const Tensor*, const Tensor*> pairs[] = {{&fs.aq, &fs.bq}, {&fs.ak, &fs.bk}, {&fs.av, &fs.bv}};
    const Vec* dx[] = {&dt.q, &dt.k, &dt.v};
    for (int i = 0; i < 3; ++i) {
      const Tensor& a = *pairs[i].first;
      const Tensor& b = *pairs[i].second;
      Vec da, db;
      expand_backward(a.to_vector<double>(), b.to_vector<double>(), *dx[i], a.size(0) * a.size(1), a.size(2),
                      a.size(3), b.size(3), da, db);
      out[size_t(2 * i)] = from_vector(da, a.shape(), a.dtype());
      out[size_t(2 * i + 1)] = from_vector(db, b.shape(), b.dtype());
    }
    return out;
  });
  return out;
}

Tensor run_reference_decode(const Factors& f, double scale, const Visibility& vis, const char* op) {
  LT_CHECK(!f.aq.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got the factors on ", f.aq.device().name());
  Vec o, lse;
  reference_forward(f, reference_qkv(f), scale, vis, o, lse);
  return from_vector(o, {f.B, 1, f.H, f.E}, f.aq.dtype());
}

}  // namespace lintape::tpa_paths
