// tpa_factors' backward (ops/tpa/factors.cpp): the per-head rank gradients daq, dak and dav gathered into their
// columns of the projection's gradient, and its padding zeroed, in one launch (the general strided copies took
// about 10x longer for these 4- to 12-byte pieces).
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
                                                                 int64_t tokens, int H, RankGrads<T> g) {
  // A thread per element of the columns a_at..W - 1 (the ranks, head by head, then the padding): coalesced
  // stores; the rank gradients' reads are (tokens, H, rank) rows of a few bytes.
  const int span = int(W - a_at), R = g.rq + g.rk + g.rv;
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= tokens * span) return;
  // 32-bit division where the index fits (a 64-bit one is a long instruction sequence a thread)
  const int64_t t = i < (int64_t(1) << 31) ? int64_t(uint32_t(i) / uint32_t(span)) : i / span;
  const int c = int(i - t * span);
  T v = from_acc<T>(0.f);
  if (c < H * R) {
    const int h = c / R, r = c - h * R;
    const int64_t th = t * H + h;
    if (r < g.rq) {
      if (g.aq) v = g.aq[th * g.rq + r];
    } else if (r < g.rq + g.rk) {
      if (g.ak) v = g.ak[th * g.rk + r - g.rq];
    } else if (g.av) {
      v = g.av[th * g.rv + r - g.rq - g.rk];
    }
  }
  dy[t * W + a_at + c] = v;
}

}  // namespace

void scatter_rank_grads(const Tensor& dy, int64_t a_at, int64_t heads, int64_t rq, int64_t rk,
                        int64_t rv, const Tensor& daq, const Tensor& dak, const Tensor& dav) {
  const int64_t W = dy.size(-1), tokens = dy.numel() / W;
  if (tokens == 0) return;
  LT_DISPATCH_FLOAT_CUDA(dy.dtype(), "tpa_factors", T, {
    auto ptr = [](const Tensor& g) { return g.defined() ? static_cast<const T*>(g.data()) : nullptr; };
    const RankGrads<T> g{ptr(daq), ptr(dak), ptr(dav), int(rq), int(rk), int(rv)};
    scatter_ranks_kernel<T><<<grid_for(tokens * (W - a_at), kThreads), kThreads, 0, stream(dy.device().index)>>>(
        static_cast<T*>(dy.data()), W, a_at, tokens, int(heads), g);
    LT_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace lintape::tpa_cuda
