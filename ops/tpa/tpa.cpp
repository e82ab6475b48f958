// The TPA family: input checks, the CPU reference (the naive formula in double with a hand-written
// backward to all six factors), the composed path (materialise q, k, v with primitive ops, then attend
// through primitive ops; differentiated by the tape) and dispatch. The cache lives in ops/tpa/cache.cpp.
#include "ops/tpa/tpa.h"
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/tpa/launch.h"

namespace lintape {
using autograd::Grads;
using autograd::record;

namespace {

// The six factors with every rank axis present: aq (B, N, H, Rq), bq (B, N, Rq, D), ak (B, M, H, Rk),
// bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E).
struct Factors {
  Tensor aq, bq, ak, bk, av, bv;
  int64_t B = 0, N = 0, M = 0, H = 0, Rq = 0, Rk = 0, Rv = 0, D = 0, E = 0;
};

Tensor insert_axis(const Tensor& t, int64_t at) {
  Shape s = t.shape();
  s.insert(s.begin() + at, 1);
  return t.reshape(s);
}

// A 3-D mixing factor (B, L, H) or basis (B, L, D) has rank 1 without its rank axis.
Tensor mixing_4d(const Tensor& a, const char* op, const char* name) {
  LT_CHECK(a.dim() == 3 || a.dim() == 4, "[", op, "] ", name, " must be (B, L, H, R) or (B, L, H) for rank 1; got ",
           shape_str(a.shape()));
  return a.dim() == 3 ? insert_axis(a, 3) : a;
}
Tensor basis_4d(const Tensor& b, const char* op, const char* name) {
  LT_CHECK(b.dim() == 3 || b.dim() == 4, "[", op, "] ", name, " must be (B, L, R, D) or (B, L, D) for rank 1; got ",
           shape_str(b.shape()));
  return b.dim() == 3 ? insert_axis(b, 2) : b;
}

void check_rank_pair(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b) {
  LT_CHECK(a.size(3) == b.size(2), "[", op, "] rank mismatch: ", a_name, " ", shape_str(a.shape()), " has rank ",
           a.size(3), " but ", b_name, " ", shape_str(b.shape()), " has rank ", b.size(2));
  LT_CHECK(a.size(1) == b.size(1), "[", op, "] ", a_name, " and ", b_name, " must have the same token count; got ",
           shape_str(a.shape()), " and ", shape_str(b.shape()));
}

// Checks the factors and brings them to 4-D. In decode, aq and bq may lack the token axis (N = 1).
Factors check_factors(const char* op, const Tensor& aq_in, const Tensor& bq_in, const Tensor& ak_in,
                      const Tensor& bk_in, const Tensor& av_in, const Tensor& bv_in, bool decode) {
  const Tensor* all[] = {&aq_in, &bq_in, &ak_in, &bk_in, &av_in, &bv_in};
  const char* names[] = {"aq", "bq", "ak", "bk", "av", "bv"};
  for (int i = 0; i < 6; ++i) LT_CHECK(all[i]->defined(), "[", op, "] ", names[i], " must be a defined tensor");
  const DType dt = aq_in.dtype();
  LT_CHECK(is_floating(dt), "[", op, "] the factors must be float tensors (f32, f64, bf16, f16); got aq ",
           dtype_name(dt));
  for (int i = 1; i < 6; ++i) {
    LT_CHECK(all[i]->dtype() == dt, "[", op, "] every factor must have aq's dtype ", dtype_name(dt), "; got ",
             names[i], " ", dtype_name(all[i]->dtype()));
    LT_CHECK(all[i]->device() == aq_in.device(), "[", op, "] every factor must be on aq's device ",
             aq_in.device().name(), "; got ", names[i], " on ", all[i]->device().name());
  }
  Factors f;
  if (decode) {
    LT_CHECK(aq_in.dim() == 3 || (aq_in.dim() == 4 && aq_in.size(1) == 1), "[", op,
             "] aq must be (B, H, R_q) or (B, 1, H, R_q); got ", shape_str(aq_in.shape()));
    LT_CHECK(bq_in.dim() == 3 || (bq_in.dim() == 4 && bq_in.size(1) == 1), "[", op,
             "] bq must be (B, R_q, D) or (B, 1, R_q, D); got ", shape_str(bq_in.shape()));
    f.aq = aq_in.dim() == 3 ? insert_axis(aq_in, 1) : aq_in;
    f.bq = bq_in.dim() == 3 ? insert_axis(bq_in, 1) : bq_in;
  } else {
    f.aq = mixing_4d(aq_in, op, "aq");
    f.bq = basis_4d(bq_in, op, "bq");
  }
  f.ak = mixing_4d(ak_in, op, "ak");
  f.bk = basis_4d(bk_in, op, "bk");
  f.av = mixing_4d(av_in, op, "av");
  f.bv = basis_4d(bv_in, op, "bv");

  const Tensor* four[] = {&f.aq, &f.bq, &f.ak, &f.bk, &f.av, &f.bv};
  f.B = f.aq.size(0);
  for (int i = 1; i < 6; ++i)
    LT_CHECK(four[i]->size(0) == f.B, "[", op, "] batch mismatch: aq has B = ", f.B, " but ", names[i], " ",
             shape_str(four[i]->shape()), " has B = ", four[i]->size(0));
  check_rank_pair(op, "aq", f.aq, "bq", f.bq);
  check_rank_pair(op, "ak", f.ak, "bk", f.bk);
  check_rank_pair(op, "av", f.av, "bv", f.bv);
  LT_CHECK(f.ak.size(1) == f.av.size(1), "[", op, "] ak and av must have the same cache/key length M; got ",
           shape_str(f.ak.shape()), " and ", shape_str(f.av.shape()));
  f.N = f.aq.size(1);
  f.M = f.ak.size(1);
  f.H = f.aq.size(2);
  LT_CHECK(f.ak.size(2) == f.H && f.av.size(2) == f.H, "[", op, "] head count mismatch: aq has H = ", f.H,
           ", ak has ", f.ak.size(2), ", av has ", f.av.size(2));
  f.Rq = f.aq.size(3);
  f.Rk = f.ak.size(3);
  f.Rv = f.av.size(3);
  f.D = f.bq.size(3);
  f.E = f.bv.size(3);
  LT_CHECK(f.bk.size(3) == f.D, "[", op, "] head dim mismatch: bq has D = ", f.D, " but bk ", shape_str(f.bk.shape()),
           " has D = ", f.bk.size(3));
  const int64_t sizes[] = {f.B, f.N, f.M, f.H, f.Rq, f.Rk, f.Rv, f.D, f.E};
  for (int64_t s : sizes)
    LT_CHECK(s >= 1, "[", op, "] every size must be >= 1; got aq ", shape_str(f.aq.shape()), ", ak ",
             shape_str(f.ak.shape()), ", bv ", shape_str(f.bv.shape()));
  return f;
}

double resolve_scale(const TpaOptions& o, int64_t D) { return o.scale != 0 ? o.scale : 1.0 / std::sqrt(double(D)); }

// Keys each sequence may use: options.cache_lengths or M for all.
std::vector<int64_t> key_lengths(const char* op, const std::vector<int64_t>& lengths, int64_t B, int64_t M) {
  if (lengths.empty()) return std::vector<int64_t>(size_t(B), M);
  LT_CHECK(int64_t(lengths.size()) == B, "[", op, "] cache_lengths must have B = ", B, " entries; got ",
           lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b)
    LT_CHECK(lengths[b] >= 1 && lengths[b] <= M, "[", op, "] cache_lengths[", b, "] must be in 1..M = ", M,
             "; got ", lengths[b]);
  return lengths;
}

// ---------------------------------------------------------------------------------------------------
// Reference: the naive formula in double.

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

// What query (b, n) sees: keys m < limit.
struct Visibility {
  bool causal;
  std::vector<int64_t> lengths;
  int64_t limit(int64_t b, int64_t n) const { return causal ? std::min(lengths[size_t(b)], n + 1) : lengths[size_t(b)]; }
};

// o (B, N, H, E) and the log-sum-exp of the scaled scores (B, N, H).
void reference_forward(const Factors& f, const Qkv& t, double scale, const Visibility& vis, Vec& o, Vec& lse) {
  const int64_t N = f.N, M = f.M, H = f.H, D = f.D, E = f.E;
  o.assign(size_t(f.B * N * H * E), 0.0);
  lse.assign(size_t(f.B * N * H), 0.0);
  Vec s(static_cast<size_t>(M));
  for (int64_t b = 0; b < f.B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t lim = vis.limit(b, n);
        const double* q = t.q.data() + ((b * N + n) * H + h) * D;
        double mx = -INFINITY;
        for (int64_t m = 0; m < lim; ++m) {
          const double* k = t.k.data() + ((b * M + m) * H + h) * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          s[size_t(m)] = scale * dot;
          mx = std::max(mx, s[size_t(m)]);
        }
        double sum = 0;
        for (int64_t m = 0; m < lim; ++m) sum += std::exp(s[size_t(m)] - mx);
        double* out = o.data() + ((b * N + n) * H + h) * E;
        for (int64_t m = 0; m < lim; ++m) {
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
        const int64_t row = (b * N + n) * H + h, lim = vis.limit(b, n);
        const double* q = t.q.data() + row * D;
        const double* go = dout.data() + row * E;
        double delta = 0;  // sum_m p dp = do . o
        for (int64_t e = 0; e < E; ++e) delta += go[e] * o[size_t(row * E + e)];
        double* dq = g.q.data() + row * D;
        for (int64_t m = 0; m < lim; ++m) {
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

// ---------------------------------------------------------------------------------------------------
// Composed: primitive ops, recorded by the tape.

// (B, L, H, R) x (B, L, R, D) -> (B, H, L, D): one small matmul per token, then heads first.
Tensor expand_composed(const Tensor& a, const Tensor& b) {
  return (matmul(a, b) * (1.0 / double(a.size(3)))).permute({0, 2, 1, 3});
}

// An additive mask (B or 1, 1, N, M): 0 where a key is visible, a large negative number elsewhere (-inf
// once rounded to f16); undefined if every key is visible. Built on the factors' device from aranges:
// key m is hidden when m > n (causal) or m >= length[b], i.e. when relu(m - n) + relu(m - length + 1) >= 1.
Tensor visibility_mask(const Factors& f, const Visibility& vis) {
  bool all_visible = true;
  bool same_lengths = true;
  for (int64_t b = 0; b < f.B; ++b) {
    for (int64_t n = 0; n < f.N && all_visible; ++n) all_visible = vis.limit(b, n) == f.M;
    same_lengths = same_lengths && vis.lengths[size_t(b)] == vis.lengths[0];
  }
  if (all_visible) return Tensor();
  NoGradGuard no_grad;
  const Device dev = f.aq.device();
  const int64_t rows = same_lengths ? 1 : f.B;
  const Tensor key = arange(0, f.M, DType::F32, dev).view({1, 1, 1, f.M});
  Tensor hidden = zeros({rows, 1, f.N, f.M}, DType::F32, dev);
  if (vis.causal) hidden = hidden + relu(key - arange(0, f.N, DType::F32, dev).view({1, 1, f.N, 1}));
  std::vector<double> len(static_cast<size_t>(rows));
  for (int64_t b = 0; b < rows; ++b) len[size_t(b)] = double(vis.lengths[size_t(b)]);
  hidden = hidden + relu(key - (from_vector(len, {rows, 1, 1, 1}, DType::F32, dev) - 1.0));
  const Tensor visible = relu(hidden * -1.0 + 1.0);  // 1 where visible, 0 where hidden
  return ((visible - 1.0) * 1e30).to(f.aq.dtype());
}

Tensor run_composed(const Factors& f, double scale, const Visibility& vis) {
  Tensor q = expand_composed(f.aq, f.bq), k = expand_composed(f.ak, f.bk), v = expand_composed(f.av, f.bv);
  Tensor s = matmul(q, k, false, true) * scale;  // (B, H, N, M)
  Tensor mask = visibility_mask(f, vis);
  if (mask.defined()) s = s + mask;
  return matmul(softmax(s, 3), v).permute({0, 2, 1, 3}).contiguous();  // (B, N, H, E)
}

#if LINTAPE_WITH_CUDA
// Fused decode reads the k/v factors in place when each batch entry's rows are contiguous (a TpaCache's
// buffers narrowed to the used rows are).
Tensor rows_contiguous(const Tensor& t) {
  const Shape& st = t.strides();
  const bool ok = st[3] == 1 && st[2] == t.size(3) && st[1] == t.size(2) * t.size(3);
  return ok ? t : t.contiguous();
}
#endif

Tensor run_fused_decode(const Factors& f, double scale, const std::vector<int64_t>& lengths) {
  const char* op = "tpa_decode";
  LT_CHECK(f.aq.is_cuda(), "[", op, "] Impl::Fused needs the factors on a CUDA device; got ", f.aq.device().name());
  LT_CHECK(f.aq.dtype() != DType::F64, "[", op, "] Impl::Fused supports f32, bf16 and f16; got f64");
#if LINTAPE_WITH_CUDA
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
#else
  (void)scale;
  (void)lengths;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

// The fused attention's limits, "" when these factors are within them.
std::string fused_attention_unsupported(const Factors& f) {
#if LINTAPE_WITH_CUDA
  return tpa_cuda::attention_unsupported(f.aq.dtype(), f.D, f.E, f.Rq, f.Rk, f.Rv);
#else
  (void)f;
  return "a CUDA build";
#endif
}

#if LINTAPE_WITH_CUDA
// The fused attention reads a factor in place when its batch and token dims merge and each token's values
// sit as the kernels index them: a (B, L, H, R) with unit rank stride, b (B, L, R, D) with rows of D at
// stride D, 16-byte aligned. Views of a wider projection qualify (the TPA mixer's split of its two
// projections); anything else is copied.
Tensor factor_in_place(const Tensor& t, bool basis) {
  const Shape& st = t.strides();
  const int64_t bytes = int64_t(dtype_size(t.dtype()));
  bool ok = st[3] == 1 && (t.size(0) == 1 || st[0] == t.size(1) * st[1]);
  if (basis) ok = ok && st[2] == t.size(3) && st[1] * bytes % 16 == 0 && reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
  return ok ? t : t.contiguous();
}
#endif

// Fused attention: forward saves the detached factors, the output and the log-sum-exp; the backward
// kernels return the six factor gradients (dq, dk, dv are contracted on chip).
Tensor run_fused_attention(const Factors& f, double scale, bool causal) {
  const char* op = "tpa_attention";
  LT_CHECK(f.aq.is_cuda(), "[", op, "] Impl::Fused needs the factors on a CUDA device; got ", f.aq.device().name());
  const std::string why = fused_attention_unsupported(f);
  LT_CHECK(why.empty(), "[", op, "] Impl::Fused needs ", why, "; use Impl::Auto or Composed");
#if LINTAPE_WITH_CUDA
  tpa_cuda::AttentionArgs a;
  a.aq = factor_in_place(f.aq.detach(), false);
  a.bq = factor_in_place(f.bq.detach(), true);
  a.ak = factor_in_place(f.ak.detach(), false);
  a.bk = factor_in_place(f.bk.detach(), true);
  a.av = factor_in_place(f.av.detach(), false);
  a.bv = factor_in_place(f.bv.detach(), true);
  a.causal = causal;
  a.scale = scale;
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
#else
  (void)scale;
  (void)causal;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

// Auto: Reference on the CPU; on CUDA the fused decode (Composed for f64), and for attention the fused
// kernels wherever they apply (bf16/f16, D == E in {64, 128}, ranks up to 16), else the composed
// attention. The fused pair is faster than composed at every measured shape (docs/BENCHMARKS.md, TPA)
// and holds no q, k, v or scores, so nothing is gained by composing where both would run.
Impl resolve(Impl impl, const Factors& f, bool decode) {
  if (impl != Impl::Auto) return impl;
  if (!f.aq.is_cuda()) return Impl::Reference;
  if (decode) return f.aq.dtype() != DType::F64 ? Impl::Fused : Impl::Composed;
  return fused_attention_unsupported(f).empty() ? Impl::Fused : Impl::Composed;
}

}  // namespace

Tensor tpa_attention(const Tensor& aq, const Tensor& bq, const Tensor& ak, const Tensor& bk, const Tensor& av,
                     const Tensor& bv, const TpaOptions& options, Impl impl) {
  const char* op = "tpa_attention";
  const Factors f = check_factors(op, aq, bq, ak, bk, av, bv, false);
  LT_CHECK(!options.causal || f.N == f.M, "[", op, "] causal attention needs N == M; got N = ", f.N,
           " queries and M = ", f.M, " keys");
  LT_CHECK(options.cache_lengths.empty(), "[", op, "] cache_lengths is a decode option; got ",
           options.cache_lengths.size(), " entries");
  const double scale = resolve_scale(options, f.D);
  const Visibility vis{options.causal, std::vector<int64_t>(size_t(f.B), f.M)};
  switch (resolve(impl, f, false)) {
    case Impl::Composed: return run_composed(f, scale, vis);
    case Impl::Fused: return run_fused_attention(f, scale, options.causal);
    default: return run_reference_attention(f, scale, vis, op);
  }
}

Tensor tpa_decode(const Tensor& aq, const Tensor& bq, const Tensor& ak, const Tensor& bk, const Tensor& av,
                  const Tensor& bv, const TpaOptions& options, Impl impl) {
  const char* op = "tpa_decode";
  const Factors f = check_factors(op, aq, bq, ak, bk, av, bv, true);
  const double scale = resolve_scale(options, f.D);
  const Visibility vis{false, key_lengths(op, options.cache_lengths, f.B, f.M)};
  Tensor out;
  switch (resolve(impl, f, true)) {
    case Impl::Composed: out = run_composed(f, scale, vis); break;
    case Impl::Fused: out = run_fused_decode(f, scale, vis.lengths); break;
    default: {
      LT_CHECK(!f.aq.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got the factors on ",
               f.aq.device().name());
      Vec o, lse;
      reference_forward(f, reference_qkv(f), scale, vis, o, lse);
      out = from_vector(o, {f.B, 1, f.H, f.E}, f.aq.dtype());
    }
  }
  return aq.dim() == 3 ? out.reshape({f.B, f.H, f.E}) : out;
}

Tensor tpa_decode(const Tensor& aq, const Tensor& bq, const TpaCache& cache, const TpaOptions& options, Impl impl) {
  LT_CHECK(options.cache_lengths.empty(), "[tpa_decode] a TpaCache brings its own lengths; options.cache_lengths "
           "must be empty; got ", options.cache_lengths.size(), " entries");
  LT_CHECK(cache.max_length() >= 1, "[tpa_decode] the cache is empty: append a token before decoding");
  // Decode over the used rows only; the cache's lengths are checked like any cache_lengths.
  const int64_t M = cache.max_length();
  TpaOptions o = options;
  o.cache_lengths = cache.lengths();
  return tpa_decode(aq, bq, cache.ak().narrow(1, 0, M), cache.bk().narrow(1, 0, M), cache.av().narrow(1, 0, M),
                    cache.bv().narrow(1, 0, M), o, impl);
}

}  // namespace lintape
