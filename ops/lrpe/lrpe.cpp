// The LRPE family's entry points: the input checks, the Impl choice (ops/impl.h's rule) and the dispatch to
// the three paths of ops/lrpe/paths.h.
#include "ops/lrpe/lrpe.h"
#include <cmath>
#include "ops/lrpe/paths.h"

namespace lintape {

namespace {
using lrpe_paths::grid_tokens;

void check_inputs(const Tensor& x, const LrpeSpec& spec) {
  const char* op = spec.name();
  const Tensor& theta = spec.theta;
  LT_CHECK(x.defined() && theta.defined(), "[", op, "] x and theta must be defined tensors");
  LT_CHECK(x.dim() == 4, "[", op, "] x must be (B, N, H, D); got ", shape_str(x.shape()));
  LT_CHECK(is_floating(x.dtype()), "[", op, "] x must be a float tensor (f32, f64, bf16, f16); got ",
           dtype_name(x.dtype()));
  LT_CHECK(theta.device() == x.device(), "[", op, "] x and theta must be on the same device; got x on ",
           x.device().name(), " and theta on ", theta.device().name());
  LT_CHECK(theta.dim() == 2 && is_floating(theta.dtype()), "[", op, "] theta must be a 2-D float tensor; got ",
           shape_str(theta.shape()), " ", dtype_name(theta.dtype()));
  check_act(spec.act, spec.dim, op);
  const int64_t N = x.size(1), H = x.size(2), D = x.size(3), rows = theta.size(0), E = theta.size(1);
  const bool heads_ok = rows == H || rows == 1;
  switch (spec.kind) {
    case LrpeSpec::Cosine:
      LT_CHECK(heads_ok && E >= 1 && (E == 1 || E <= D), "[", op,
               "] theta must be (H, E), (1, E) or (H, 1) with H = ", H, " and E <= D = ", D, "; got ",
               shape_str(theta.shape()));
      break;
    case LrpeSpec::Rotate:
      LT_CHECK(D % 2 == 0, "[", op, "] D must be even (x is split in halves); got D = ", D);
      LT_CHECK(heads_ok && E >= 1 && (E == 1 || E <= D / 2), "[", op,
               "] theta must be (H, E), (1, E) or (H, 1) with H = ", H, " and E <= D/2 = ", D / 2, "; got ",
               shape_str(theta.shape()));
      break;
    case LrpeSpec::MdCosine: {
      const int64_t k = int64_t(spec.grid.size());
      LT_CHECK(k >= 1 && k <= 4, "[", op, "] shape must have 1 to 4 dims; got ", k, " dims ", shape_str(spec.grid));
      for (int64_t n : spec.grid)
        LT_CHECK(n >= 1, "[", op, "] shape sizes must be >= 1; got ", shape_str(spec.grid));
      LT_CHECK(spec.extra_tokens >= 0, "[", op, "] extra_tokens must be >= 0; got ", spec.extra_tokens);
      LT_CHECK(grid_tokens(spec.grid) == N - spec.extra_tokens, "[", op, "] shape ", shape_str(spec.grid), " has ",
               grid_tokens(spec.grid), " tokens but x has N - L = ", N, " - ", spec.extra_tokens, " = ",
               N - spec.extra_tokens);
      LT_CHECK(heads_ok && k * E >= D, "[", op, "] theta must be (H, E) or (1, E) with H = ", H,
               " and k * E >= D = ", D, " for a grid of k = ", k, " dims; got ", shape_str(theta.shape()));
      break;
    }
  }
  LT_CHECK(spec.offset >= 0, "[", op, "] offset must be >= 0; got ", spec.offset);
}

// The documents' checks; their starts go into the spec.
void check_documents(const Tensor& x, const Documents& docs, LrpeSpec& spec) {
  const char* op = spec.name();
  docs.check(op, x.size(0), x.size(1), x.device());
  if (!docs.defined()) return;
  spec.starts = docs.starts().contiguous();
}

// Impl::Fused: the fused path's own checks, then the kernels.
Tensor fused_path(const Tensor& x, const LrpeSpec& spec, bool cache_angles) {
  const char* op = spec.name();
  LT_CHECK(x.is_cuda(), "[", op, "] Impl::Fused needs x on a CUDA device; got x on ", x.device().name());
  LT_CHECK(x.dtype() != DType::F64, "[", op, "] Impl::Fused supports f32, bf16 and f16; got f64");
#if LINTAPE_WITH_CUDA
  return lrpe_paths::run_fused(x, spec, spec.theta, cache_angles);
#else
  (void)cache_angles;
  fail(str("[", op, "] lintape was built without CUDA"));
#endif
}

Tensor run(const Tensor& x_in, LrpeSpec spec, Impl impl, const Documents& docs = {}, bool cache_angles = false) {
  check_inputs(x_in, spec);
  check_documents(x_in, docs, spec);
  const char* op = spec.name();
  // ops/impl.h's rule: the fused kernels take every f32/bf16/f16 CUDA call.
  if (impl == Impl::Auto)
    impl = !x_in.is_cuda() ? Impl::Reference : x_in.dtype() == DType::F64 ? Impl::Composed : Impl::Fused;
  if (impl == Impl::Composed) return lrpe_paths::run_composed(x_in, spec);
  if (impl == Impl::Fused) return fused_path(x_in, spec, cache_angles);
  const Tensor x = x_in.contiguous();
  LT_CHECK(!x.is_cuda(), "[", op, "] Impl::Reference runs on the CPU; got x on ", x.device().name());
  return lrpe_paths::run_reference(x, spec, spec.theta);
}

LrpeSpec spec_1d(LrpeSpec::Kind kind, const Tensor& theta, const LrpeOptions& options) {
  LrpeSpec spec;
  spec.kind = kind;
  spec.theta = theta;
  spec.offset = options.offset;
  spec.act = options.act;
  spec.dim = options.dim;
  return spec;
}

}  // namespace

Tensor lrpe_cosine(const Tensor& x, const Tensor& theta, const LrpeOptions& options, Impl impl) {
  return run(x, spec_1d(LrpeSpec::Cosine, theta, options), impl, options.documents);
}

Tensor lrpe_rotate(const Tensor& x, const Tensor& theta, const LrpeOptions& options, Impl impl) {
  return run(x, spec_1d(LrpeSpec::Rotate, theta, options), impl, options.documents);
}

Tensor md_lrpe_cosine(const Tensor& x, const Tensor& theta, const MdLrpeOptions& options, Impl impl) {
  LrpeSpec spec;
  spec.kind = LrpeSpec::MdCosine;
  spec.theta = theta;
  spec.grid = options.shape;
  spec.extra_tokens = options.extra_tokens;
  spec.act = options.act;
  spec.dim = options.dim;
  return run(x, spec, impl, {}, options.cache_angles);
}

Tensor lrpe_theta(int64_t H, int64_t E, double base, Device device) {
  LT_CHECK(H >= 1 && E >= 1, "[lrpe_theta] H and E must be >= 1; got H = ", H, ", E = ", E);
  LT_CHECK(base > 1, "[lrpe_theta] base must be > 1; got ", base);
  std::vector<double> values(static_cast<size_t>(H * E));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < E; ++k) values[h * E + k] = std::pow(base, -static_cast<double>(k) / E);
  return from_vector(values, {H, E}, DType::F32, device);
}

}  // namespace lintape
