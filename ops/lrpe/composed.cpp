// The LRPE family's composed path: the angles' cos and sin as constants, the act and the rotation through
// primitive ops, differentiated by the tape. Any float dtype, either device.
#include "autograd/tape.h"
#include "ops/documents.h"
#include "ops/elementwise.h"
#include "ops/lrpe/paths.h"
#include "ops/shape.h"

namespace lintape::lrpe_paths {

namespace {

// act(x); softmax over the sequence with documents normalises each document of a row on its own.
Tensor act_per_document(const Tensor& x, const LrpeSpec& spec) {
  if (!(spec.seq_softmax() && spec.starts.defined())) return apply_act(x, spec.act, spec.dim);
  const int64_t N = x.size(1);
  const std::vector<int64_t> cu = documents_cu_seqlens(Documents::from_starts(spec.starts), x.size(0), N);
  std::vector<Tensor> rows, docs;  // each row's documents, cat along the sequence when the row is complete
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t b = cu[i] / N, s0 = cu[i] % N;
    docs.push_back(apply_act(x.narrow(0, b, 1).narrow(1, s0, cu[i + 1] - cu[i]), spec.act, spec.dim));
    if (cu[i + 1] % N == 0) {
      rows.push_back(cat(docs, 1));
      docs.clear();
    }
  }
  return cat(rows, 0);
}

}  // namespace

Tensor run_composed(const Tensor& x, const LrpeSpec& spec) {
  const int64_t N = x.size(1), D = x.size(3), A = spec.rotate() ? D / 2 : D;
  const DType ct = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  const Device dev = x.device();
  Tensor c, s;  // (N, 1 or H, A or 1), or (B, N, 1 or H, A or 1) with documents, in x's dtype
  {
    NoGradGuard no_grad;  // theta gets no gradient
    Tensor th = spec.theta.detach().to(ct);
    const int64_t R = th.size(0), E = th.size(1);
    th = th.view({1, R, E});
    Tensor angle;
    if (spec.kind == LrpeSpec::MdCosine) {
      const int64_t L = spec.extra_tokens, P = N - L, k = int64_t(spec.grid.size());
      std::vector<Tensor> axes;
      int64_t inner = P;
      for (int64_t a = 0; a < k; ++a) {
        const int64_t n = spec.grid[size_t(a)];
        inner /= n;
        std::vector<double> coord(static_cast<size_t>(P));
        for (int64_t p = 0; p < P; ++p) coord[size_t(p)] = double((p / inner) % n);
        axes.push_back(from_vector(coord, {P, 1, 1}, ct, dev) * th);
      }
      angle = cat(axes, 2).narrow(2, 0, D);
      if (L > 0) angle = cat({zeros({L, R, D}, ct, dev), angle}, 0);
    } else if (spec.starts.defined()) {  // each token's position in its document
      const int64_t B = x.size(0);
      const std::vector<int32_t> starts = spec.starts.to_vector<int32_t>();
      std::vector<double> pos(starts.size());
      for (size_t i = 0; i < pos.size(); ++i) pos[i] = double(spec.offset + int64_t(i) % N - starts[i]);
      angle = from_vector(pos, {B, N, 1, 1}, ct, dev) * th.view({1, 1, R, E});
      if (!spec.rate_per_head() && E < A) angle = cat({angle, zeros({B, N, R, A - E}, ct, dev)}, 3);
    } else {
      angle = arange(spec.offset, spec.offset + N, ct, dev).view({N, 1, 1}) * th;
      if (!spec.rate_per_head() && E < A) angle = cat({angle, zeros({N, R, A - E}, ct, dev)}, 2);
    }
    c = cos(angle).to(x.dtype());
    s = sin(angle).to(x.dtype());
  }
  Tensor xb = act_per_document(x, spec);
  if (spec.rotate()) {
    Tensor x1 = xb.narrow(3, 0, A), x2 = xb.narrow(3, A, A);
    return cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3);
  }
  return cat({xb * c, xb * s}, 3);
}

}  // namespace lintape::lrpe_paths
