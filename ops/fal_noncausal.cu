// Fused FAL, noncausal: kv = kb^T vb per (b, h), reduced over slices of the keys by separate blocks and summed
// in a fixed order (deterministic), then o = gb * (qb kv) per query token. Backward reduces dkv = qb^T dy the
// same way, then the query rows give dq and dg (from kv) and the key rows dk and dv (from dkv). The acts and
// the LRPE are applied to each row in shared memory (ops/fal_sweep.cuh), never written to memory.
#include <algorithm>
#include "ops/fal_sweep.cuh"

namespace lintape::fal_cuda {

namespace {

constexpr int64_t kRowTokens = 256;      // query or key tokens per block of a row pass
constexpr int64_t kMinSliceTokens = 64;  // the fewest tokens per slice of a reduction
constexpr int64_t kTargetBlocks = 264;   // two blocks per SM on an H100/H200

// sum over the slices: out (BH, n) = sum_s part (BH, slices, n), in slice order.
__global__ void sum_slices(const float* __restrict__ part, float* __restrict__ out, int64_t slices, int64_t n,
                           int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t bh = i / n, j = i % n;
  const float* src = part + bh * slices * n + j;
  float s = 0;
  for (int64_t r = 0; r < slices; ++r) s += src[r * n];
  out[i] = s;
}

// dst (BH, P, E) = sum over tokens of the pass's rows, split into slices of the sequence.
void reduce(SweepArgs a, int pass, int64_t tokens, int64_t BH, const Tensor& dst, DType dtype, cudaStream_t st,
            Device dev) {
  const int64_t max_slices = std::max<int64_t>(1, (tokens + kMinSliceTokens - 1) / kMinSliceTokens);
  const int64_t slices = std::min(max_slices, std::max<int64_t>(1, (kTargetBlocks + BH - 1) / BH));
  a.pass = pass;
  a.causal = false;
  a.tokens_per_block = (tokens + slices - 1) / slices;
  const int64_t n = int64_t(a.P) * a.E;
  if (slices == 1) {
    a.state_out = dst.data_ptr<float>();
    launch_sweep(a, dtype, dim3(unsigned(BH), 1), st, "fal");
    return;
  }
  Tensor part = empty({BH, slices, a.P, a.E}, DType::F32, dev);
  a.state_out = part.data_ptr<float>();
  launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(slices)), st, "fal");
  const int64_t total = BH * n;
  sum_slices<<<unsigned((total + 255) / 256), 256, 0, st>>>(part.data_ptr<float>(), dst.data_ptr<float>(), slices,
                                                            n, total);
  LT_CUDA_CHECK_LAUNCH();
}

void rows(SweepArgs a, int pass, int64_t tokens, int64_t BH, DType dtype, cudaStream_t st) {
  a.pass = pass;
  a.causal = false;
  a.tokens_per_block = kRowTokens;
  const int64_t blocks = (tokens + kRowTokens - 1) / kRowTokens;
  if (blocks > 0) launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(blocks)), st, "fal");
}

}  // namespace

bool sequence_supported(int64_t D, int64_t P, int64_t E) {
  return D <= kMaxHeadDim && E <= kMaxHeadDim && sweep_smem_floats(D, P, E) * sizeof(float) <= kMaxSharedBytes;
}

void noncausal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                       const Tensor& kv, const Tensor& out) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0 || v.size(3) == 0) return;
  cudaStream_t st = cuda::stream(q.device().index);
  SweepArgs a = sweep_args(q, k, v, g, spec);
  reduce(a, kReduceKV, k.size(1), BH, kv, q.dtype(), st, q.device());
  a.state_in = kv.data_ptr<float>();
  a.out = out.data();
  rows(a, kForward, q.size(1), BH, q.dtype(), st);
}

void noncausal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                        const Tensor& kv, const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dg) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0) return;
  cudaStream_t st = cuda::stream(q.device().index);
  SweepArgs a = sweep_args(q, k, v, g, spec);
  a.dout = dout.data();
  a.dq = dq.data();
  a.dk = dk.data();
  a.dv = dv.data();
  a.dg = dg.data();
  Tensor dkv = empty(kv.shape(), DType::F32, q.device());
  reduce(a, kReduceDKV, q.size(1), BH, dkv, q.dtype(), st, q.device());
  a.state_in = kv.data_ptr<float>();
  rows(a, kQueryGrad, q.size(1), BH, q.dtype(), st);
  a.state_in = dkv.data_ptr<float>();
  rows(a, kKeyGrad, k.size(1), BH, q.dtype(), st);
}

}  // namespace lintape::fal_cuda
