// The LRPE family: lrpe_cosine, lrpe_rotate (1-D positions) and md_lrpe_cosine (2-D/3-D/4-D token
// grids with extra unencoded tokens in front). Math, shapes and backward: see docs/ARCHITECTURE.md and
// the op comments below. x is (B, N, H, D), any layout: the fused path reads a view such as a narrow
// over heads in place (packed features, data pointer and strides multiples of 16 bytes) and copies other
// layouts. theta is a fixed buffer: no gradient flows to it.
//
// A theta of one column ((H, 1) or (1, 1)) gives each head one rate for all features in the 1-D ops.
// theta may have any float dtype; the fused kernels use an f32 copy and compute each angle's product and
// reduction in double, so cos/sin are f32-accurate even at positions in the tens of thousands (the
// sequence-softmax backward statistics advance angles by rotation between exact recomputes every 8
// tokens: within about 1e-6). Impl::Auto (the rule in ops/impl.h): the fused kernels take every
// f32/bf16/f16 CUDA call and beat Composed both ways, so Auto runs them for all of those.
#pragma once
#include <cstdint>
#include <vector>
#include "../../core/tensor.h"
#include "../activation.h"
#include "../documents.h"
#include "../impl.h"

namespace lintape {

struct LrpeOptions {
  int64_t offset = 0;  // token s sits at position offset + s (decoding a new chunk)
  Act act = Act::None;
  ActDim dim = ActDim::None;
  // Packed rows (ops/documents.h), for x's (B, N) on x's device: positions restart at each document start,
  // token s of row b sits at offset + s - starts[b, s]; softmax over the sequence normalises each document
  // on its own (every path).
  Documents documents;
};

// out (B, N, H, 2D) = [act(x) * cos(angle), act(x) * sin(angle)], angle[s, h, k] = (offset + s) * theta[h, k]
// (offset + s - starts[b, s] with documents),
// theta (H, E), (1, E) or (H, 1) with E <= D; features k >= E have angle 0.
Tensor lrpe_cosine(const Tensor& x, const Tensor& theta, const LrpeOptions& options = {}, Impl impl = Impl::Auto);

// Rotary, half-split: out (B, N, H, D) = [x1 cos - x2 sin, x1 sin + x2 cos] with [x1, x2] = act(x) split
// in halves of D/2; theta (H, E), (1, E) or (H, 1) with E <= D/2. D must be even.
Tensor lrpe_rotate(const Tensor& x, const Tensor& theta, const LrpeOptions& options = {}, Impl impl = Impl::Auto);

struct MdLrpeOptions {
  std::vector<int64_t> shape;  // the token grid (n_1, ..., n_k), 1 <= k <= 4, row-major
  int64_t extra_tokens = 0;    // L tokens in front with angle 0
  Act act = Act::None;
  ActDim dim = ActDim::None;
  // Fused only: keep the (2, P, H, D) f32 cos/sin table in a process-wide cache and reuse it across
  // calls with the same (shape, L, H, D, theta storage, offset and version, device); the table stays
  // allocated while cached (8 entries at most).
  bool cache_angles = false;
};

// x (B, L + P, H, D) with P = prod(shape); theta (H, E) or (1, E) with k * E >= D. Token t >= L has grid
// coordinates c = unflatten(t - L); its angle vector is the first D entries of [c_1 theta[h], ..., c_k theta[h]].
Tensor md_lrpe_cosine(const Tensor& x, const Tensor& theta, const MdLrpeOptions& options, Impl impl = Impl::Auto);

// The usual rates: theta[h, k] = base^(-k / E) for every head h, an (H, E) f32 tensor on `device`
// (with E = D/2 for lrpe_rotate this is the rotary embedding's table). H, E >= 1 and base > 1.
Tensor lrpe_theta(int64_t H, int64_t E, double base = 10000.0, Device device = Device::cpu());

}  // namespace lintape
