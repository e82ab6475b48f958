// tpa_factors' backward (ops/tpa/factors.cpp): the per-head rank gradients daq, dak and dav gathered into their
// columns of the projection's gradient, and its padding zeroed, in one launch (a thread per token and head;
// the general strided copies took about 10x longer for these 4- to 12-byte pieces).
#include <cstdint>
#include "core/cuda.h"
#include "core/cuda_types.cuh"
#include "ops/tpa/launch.h"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads) scatter_ranks_kernel(T* __restrict__ dy, int64_t W, int64_t a_at,
                                                                 int64_t used, int64_t tokens, int H, RankGrads<T> g) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * H) return;
  const int64_t t = i / H;
  const int h = int(i % H), R = g.rq + g.rk + g.rv;
  T* out = dy + t * W + a_at + int64_t(h) * R;
  const T zero = from_acc<T>(0.f);
  const T* src[3] = {g.aq, g.ak, g.av};
  const int ranks[3] = {g.rq, g.rk, g.rv};
  for (int f = 0, at = 0; f < 3; at += ranks[f], ++f) {
    const T* p = src[f] ? src[f] + i * ranks[f] : nullptr;  // (tokens, H, rank) contiguous
    for (int r = 0; r < ranks[f]; ++r) out[at + r] = p ? p[r] : zero;
  }
  if (h == 0)
    for (int64_t c = used; c < W; ++c) dy[t * W + c] = zero;
}

}  // namespace

void scatter_rank_grads(const Tensor& dy, int64_t a_at, int64_t used, int64_t heads, int64_t rq, int64_t rk,
                        int64_t rv, const Tensor& daq, const Tensor& dak, const Tensor& dav) {
  const int64_t W = dy.size(-1), tokens = dy.numel() / W;
  if (tokens == 0) return;
  LT_DISPATCH_FLOAT_CUDA(dy.dtype(), "tpa_factors", T, {
    auto ptr = [](const Tensor& g) { return g.defined() ? static_cast<const T*>(g.data()) : nullptr; };
    const RankGrads<T> g{ptr(daq), ptr(dak), ptr(dav), int(rq), int(rk), int(rv)};
    scatter_ranks_kernel<T><<<grid_for(tokens * heads, kThreads), kThreads, 0, stream(dy.device().index)>>>(
        static_cast<T*>(dy.data()), W, a_at, used, tokens, int(heads), g);
    LT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace lintape::tpa_cuda
