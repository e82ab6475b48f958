// The TPA family's entry points: the factor checks, the Impl choice (the rule in ops/impl.h) and the dispatch
// to the paths of ops/tpa/paths.h.
#include "ops/tpa/tpa.h"
#include <cmath>
#include <string>
#include "ops/tpa/paths.h"

namespace lintape {

namespace {
using tpa_paths::Factors;
using tpa_paths::Visibility;

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

// The documents' starts and ends (host vectors) into vis.
void document_bounds(const Documents& docs, Visibility& vis) {
  vis.starts = docs.host_starts();
  vis.row = docs.seq_len();
  vis.ends.resize(vis.starts.size());
  for (int64_t b = 0; b < docs.batch(); ++b) {
    int32_t end = int32_t(vis.row);
    for (int64_t n = vis.row - 1; n >= 0; --n) {
      const size_t i = size_t(b * vis.row + n);
      vis.ends[i] = end;
      if (vis.starts[i] == n) end = int32_t(n);
    }
  }
}

// Impl::Fused: each fused path's own checks, then the kernels.
Tensor fused_decode_path(const Factors& f, double scale, const std::vector<int64_t>& lengths) {
  const char* op = "tpa_decode";
  LT_CHECK(f.aq.is_cuda(), "[", op, "] Impl::Fused needs the factors on a CUDA device; got ", f.aq.device().name());
  LT_CHECK(f.aq.dtype() != DType::F64, "[", op, "] Impl::Fused supports f32, bf16 and f16; got f64");
#if LINTAPE_WITH_CUDA
  return tpa_paths::run_fused_decode(f, scale, lengths);
#else
  (void)scale;
  (void)lengths;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

Tensor fused_attention_path(const Factors& f, double scale, bool causal, const Tensor& starts) {
  const char* op = "tpa_attention";
  LT_CHECK(f.aq.is_cuda(), "[", op, "] Impl::Fused needs the factors on a CUDA device; got ", f.aq.device().name());
  const std::string why = tpa_paths::fused_attention_unsupported(f);
  LT_CHECK(why.empty(), "[", op, "] Impl::Fused needs ", why, "; use Impl::Auto or Composed");
#if LINTAPE_WITH_CUDA
  return tpa_paths::run_fused_attention(f, scale, causal, starts);
#else
  (void)scale;
  (void)causal;
  (void)starts;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

// Auto, under the rule of ops/impl.h: on CUDA the fused decode (Composed for f64), and for attention the
// fused kernels wherever they apply (bf16/f16, D == E in {64, 128}, ranks up to 16), else the composed
// attention. The fused pair is faster than composed at every measured shape (docs/BENCHMARKS.md, TPA)
// and holds no q, k, v or scores, so nothing is gained by composing where both would run.
Impl resolve(Impl impl, const Factors& f, bool decode) {
  if (impl != Impl::Auto) return impl;
  if (!f.aq.is_cuda()) return Impl::Reference;
  if (decode) return f.aq.dtype() != DType::F64 ? Impl::Fused : Impl::Composed;
  return tpa_paths::fused_attention_unsupported(f).empty() ? Impl::Fused : Impl::Composed;
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
  const Documents& docs = options.documents;
  LT_CHECK(!docs.defined() || f.N == f.M, "[", op, "] documents need N == M; got N = ", f.N, " queries and M = ",
           f.M, " keys");
  docs.check(op, f.B, f.N, f.aq.device());
  const double scale = resolve_scale(options, f.D);
  impl = resolve(impl, f, false);
  if (impl == Impl::Fused) return fused_attention_path(f, scale, options.causal, docs.starts());
  Visibility vis{options.causal, std::vector<int64_t>(size_t(f.B), f.M)};
  if (docs.defined()) document_bounds(docs, vis);
  return impl == Impl::Composed ? tpa_paths::run_composed(f, scale, vis)
                                : tpa_paths::run_reference_attention(f, scale, vis, op);
}

Tensor tpa_decode(const Tensor& aq, const Tensor& bq, const Tensor& ak, const Tensor& bk, const Tensor& av,
                  const Tensor& bv, const TpaOptions& options, Impl impl) {
  const char* op = "tpa_decode";
  const Factors f = check_factors(op, aq, bq, ak, bk, av, bv, true);
  const double scale = resolve_scale(options, f.D);
  const Visibility vis{false, key_lengths(op, options.cache_lengths, f.B, f.M)};
  Tensor out;
  switch (resolve(impl, f, true)) {
    case Impl::Composed: out = tpa_paths::run_composed(f, scale, vis); break;
    case Impl::Fused: out = fused_decode_path(f, scale, vis.lengths); break;
    default: out = tpa_paths::run_reference_decode(f, scale, vis, op);
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
