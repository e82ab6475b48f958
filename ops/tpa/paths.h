// Internal to the TPA family: what its files share. tpa.cpp checks the factors, picks the path (the rule in
// ops/impl.h) and calls one of reference.cpp (the naive formula in double with a hand-written backward to all
// six factors), composed.cpp (q, k, v materialised with primitive ops, then attention through primitive ops;
// differentiated by the tape) or fused.cpp (the kernels of launch.h). The cache lives in cache.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>
#include "core/tensor.h"

namespace lintape::tpa_paths {

// The six factors with every rank axis present: aq (B, N, H, Rq), bq (B, N, Rq, D), ak (B, M, H, Rk),
// bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E).
struct Factors {
  Tensor aq, bq, ak, bk, av, bv;
  int64_t B = 0, N = 0, M = 0, H = 0, Rq = 0, Rk = 0, Rv = 0, D = 0, E = 0;
};

// What query (b, n) sees: keys first <= m < limit.
struct Visibility {
  bool causal;
  std::vector<int64_t> lengths;
  // Attention with documents (N == M, rows of `row` tokens): starts[b row + n] as in ops/documents.h and
  // ends[b row + n], the end of n's document; both empty without documents.
  std::vector<int32_t> starts, ends;
  int64_t row = 0;
  int64_t first(int64_t b, int64_t n) const { return starts.empty() ? 0 : starts[size_t(b * row + n)]; }
  int64_t limit(int64_t b, int64_t n) const {
    int64_t end = lengths[size_t(b)];
    if (!ends.empty()) end = std::min<int64_t>(end, ends[size_t(b * row + n)]);
    return causal ? std::min(end, n + 1) : end;
  }
};

// The paths take checked factors and the resolved scale. Attention records its backward to the six factors;
// decode records none (but for Composed's primitive ops) and returns (B, 1, H, E).
Tensor run_reference_attention(const Factors& f, double scale, const Visibility& vis, const char* op);
Tensor run_reference_decode(const Factors& f, double scale, const Visibility& vis, const char* op);
Tensor run_composed(const Factors& f, double scale, const Visibility& vis);

#if LINTAPE_WITH_CUDA
// fused.cpp. fused_attention_unsupported: the fused attention's limits, "" when these factors are within them.
// The fused paths take CUDA factors other than f64; attention's within those limits.
std::string fused_attention_unsupported(const Factors& f);
Tensor run_fused_decode(const Factors& f, double scale, const std::vector<int64_t>& lengths);
Tensor run_fused_attention(const Factors& f, double scale, bool causal, const Tensor& starts);  // starts: documents
#else
// Without CUDA the fused kernels take no call.
inline std::string fused_attention_unsupported(const Factors&) { return "a CUDA build"; }
#endif

}  // namespace lintape::tpa_paths
