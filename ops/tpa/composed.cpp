// The TPA family's composed path: q, k and v materialised from the factors with primitive ops, then the
// attention through primitive ops, differentiated by the tape. Any float dtype, either device.
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/tpa/paths.h"

namespace lintape::tpa_paths {

namespace {

// (B, L, H, R) x (B, L, R, D) -> (B, H, L, D): one small matmul per token, then heads first.
Tensor expand_composed(const Tensor& a, const Tensor& b) {
  return (matmul(a, b) * (1.0 / double(a.size(3)))).permute({0, 2, 1, 3});
}

// An additive mask (B or 1, 1, N, M): 0 where a key is visible, a large negative number elsewhere (-inf
// once rounded to f16); undefined if every key is visible and there are no documents. Without documents it
// is built on the factors' device from aranges: key m is hidden when m > n (causal) or m >= length[b], i.e.
// when relu(m - n) + relu(m - length + 1) >= 1.
Tensor visibility_mask(const Factors& f, const Visibility& vis) {
  if (!vis.starts.empty()) {  // documents: the mask (B, 1, N, M) built on the host
    std::vector<double> mask(size_t(f.B * f.N * f.M), 0.0);
    for (int64_t b = 0; b < f.B; ++b)
      for (int64_t n = 0; n < f.N; ++n)
        for (int64_t m = 0; m < f.M; ++m)
          if (m < vis.first(b, n) || m >= vis.limit(b, n)) mask[size_t((b * f.N + n) * f.M + m)] = -1e30;
    return from_vector(mask, {f.B, 1, f.N, f.M}, f.aq.dtype(), f.aq.device());
  }
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

}  // namespace

Tensor run_composed(const Factors& f, double scale, const Visibility& vis) {
  Tensor q = expand_composed(f.aq, f.bq), k = expand_composed(f.ak, f.bk), v = expand_composed(f.av, f.bv);
  Tensor s = matmul(q, k, false, true) * scale;  // (B, H, N, M)
  Tensor mask = visibility_mask(f, vis);
  if (mask.defined()) s = s + mask;
  return matmul(softmax(s, 3), v).permute({0, 2, 1, 3}).contiguous();  // (B, N, H, E)
}

}  // namespace lintape::tpa_paths
