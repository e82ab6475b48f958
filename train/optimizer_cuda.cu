// Fused AdamW and the global gradient-norm clip over flat float32 buffers. The norm is a two-pass
// reduction (per-block float64 partial sums of squares, then one block over the partials) whose block
// count depends on n only, so it gives the same bits every run; the clip scale is read on the device.
#include <algorithm>
#include "core/cuda_types.cuh"
#include "core/cuda_reduce.cuh"
#include "train/optimizer_cuda.h"

namespace lintape::train_cuda {
using namespace lintape::cuda;

namespace {

constexpr int kThreads = 256;
constexpr int kMaxNormBlocks = 1024;

// copy (or null): the updated parameters rounded to C as well.
// step (or null): the scalars and the clip's factor come from it, and nothing is updated when it says skip.
template <class C>
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, const float* __restrict__ decay, C* __restrict__ copy, int64_t n,
                             AdamWScalars s, const DeviceStep* __restrict__ step) {
  float scale = 1.f;
  if (step) {
    if (step->skip) return;
    s = step->scalars;
    scale = step->grad_scale;
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float pi = p[i];
    const float gi = g[i] * scale;  // x 1 is exact: unclipped gradients keep their bits
    pi -= s.shrink * decay[i] * pi;
    const float mi = s.beta1 * m[i] + (1 - s.beta1) * gi;
    const float vi = s.beta2 * v[i] + (1 - s.beta2) * gi * gi;
    pi -= s.lr * (mi / s.bias1) / (sqrtf(vi / s.bias2) + s.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if (copy) copy[i] = from_acc<C>(pi);
  }
}

__device__ __forceinline__ double block_sum(double x) {
  __shared__ double warp_sums[kThreads / 32];
  x = cuda_device::warp_sum(x);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;  // valid in thread 0
}

__global__ void sum_squares_kernel(const float* __restrict__ g, int64_t n, double* __restrict__ partials) {
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = g[i];
    acc += x * x;
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: norm = sqrt(sum of the partials), written after them.
__global__ void finish_norm_kernel(double* partials, int count) {
  double acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[count] = sqrt(total);
}

// The clip's factor for a gradient norm (1: no clip), as clip_kernel applies it.
__device__ __forceinline__ float clip_scale(double norm, double max_norm) {
  return norm > max_norm && isfinite(norm) ? float(max_norm / (norm + 1e-6)) : 1.f;
}

// One thread: the step's scalars, its clip factor and its report (see DeviceStep).
__global__ void prepare_step_kernel(DeviceStep* st, const float* loss, const double* norm, double max_norm,
                                    double beta1, double beta2, double eps, double weight_decay) {
  st->loss = *loss;
  st->grad_norm = *norm;
  st->grad_scale = clip_scale(st->grad_norm, max_norm);
  st->skip = isfinite(st->loss) && isfinite(st->grad_norm) ? 0 : 1;
  st->scalars = AdamWScalars{float(st->lr), float(st->lr * weight_decay), float(beta1), float(beta2), float(eps),
                             float(1.0 - pow(beta1, st->step)), float(1.0 - pow(beta2, st->step))};
}

__global__ void clip_kernel(float* __restrict__ g, int64_t n, const double* __restrict__ norm_at, double max_norm) {
  const float scale = clip_scale(*norm_at, max_norm);
  if (scale == 1.f) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    g[i] *= scale;
}

void check_flat(const Tensor& t, const Tensor& like, const char* what) {
  LT_CHECK(t.is_cuda() && t.dtype() == DType::F32 && t.is_contiguous() && t.numel() == like.numel() &&
               t.device() == like.device(),
           "[AdamW] ", what, " must be a contiguous float32 CUDA buffer of ", like.numel(), " elements on ",
           like.device().name(), "; got ", dtype_name(t.dtype()), " ", shape_str(t.shape()), " on ", t.device().name());
}

unsigned elementwise_blocks(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 132 * 16)); }

void launch_adamw(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                  const Tensor& decay_mask, const AdamWScalars& s, const Tensor& copy, const DeviceStep* step) {
  check_flat(params, params, "parameters");
  check_flat(grads, params, "gradients");
  check_flat(m, params, "first moment");
  check_flat(v, params, "second moment");
  check_flat(decay_mask, params, "decay mask");
  const int64_t n = params.numel();
  LT_CHECK(!copy.defined() || (copy.is_contiguous() && copy.numel() == n && copy.device() == params.device() &&
                               is_float16(copy.dtype())),
           "[AdamW] the compute copy must be a contiguous bf16/f16 buffer like the parameters");
  const unsigned blocks = elementwise_blocks(n);
  cudaStream_t st = stream(params.device().index);
  float* p = params.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  if (copy.defined() && copy.dtype() == DType::F16)
    adamw_kernel<<<blocks, kThreads, 0, st>>>(p, g, m.data_ptr<float>(), v.data_ptr<float>(),
                                              decay_mask.data_ptr<float>(), static_cast<__half*>(copy.data()), n, s,
                                              step);
  else
    adamw_kernel<<<blocks, kThreads, 0, st>>>(p, g, m.data_ptr<float>(), v.data_ptr<float>(),
                                              decay_mask.data_ptr<float>(),
                                              copy.defined() ? static_cast<__nv_bfloat16*>(copy.data()) : nullptr,
                                              n, s, step);
  LT_CUDA_CHECK_LAUNCH();
  params.storage().version++;
}

// The norm of grads into a new device scalar (float64).
Tensor grad_norm(const Tensor& grads) {
  check_flat(grads, grads, "gradients");
  const int64_t n = grads.numel();
  const int blocks = int(std::clamp<int64_t>((n + kThreads * 8 - 1) / (kThreads * 8), 1, kMaxNormBlocks));
  Tensor partials = empty({blocks + 1}, DType::F64, grads.device());
  cudaStream_t st = stream(grads.device().index);
  double* part = partials.data_ptr<double>();
  sum_squares_kernel<<<blocks, kThreads, 0, st>>>(grads.data_ptr<float>(), n, part);
  LT_CUDA_CHECK_LAUNCH();
  finish_norm_kernel<<<1, kThreads, 0, st>>>(part, blocks);
  LT_CUDA_CHECK_LAUNCH();
  return partials.narrow(0, blocks, 1);
}

void clip(const Tensor& grads, const Tensor& norm, double max_norm) {
  const int64_t n = grads.numel();
  clip_kernel<<<elementwise_blocks(n), kThreads, 0, stream(grads.device().index)>>>(
      grads.data_ptr<float>(), n, static_cast<const double*>(norm.data()), max_norm);
  LT_CUDA_CHECK_LAUNCH();
  grads.storage().version++;
}

}  // namespace

double clip_grad_norm_cuda(const Tensor& grads, double max_norm) {
  const Tensor norm = grad_norm(grads);
  clip(grads, norm, max_norm);
  return norm.item();
}

void set_step_inputs_cuda(const Tensor& state, double lr, int64_t step) {
  const double in[2] = {lr, double(step)};
  // A pageable source: the copy has taken the values when it returns.
  LT_CUDA_CHECK(cudaMemcpyAsync(state.data(), in, sizeof(in), cudaMemcpyHostToDevice, stream(state.device().index)));
}

void queue_step_cuda(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                     const Tensor& decay_mask, const Tensor& copy, const Tensor& loss, const Tensor& state,
                     double max_norm, double beta1, double beta2, double eps, double weight_decay) {
  LT_CHECK(loss.is_cuda() && loss.dtype() == DType::F32 && loss.numel() == 1 && loss.device() == params.device(),
           "[AdamW] the queued step's loss must be a float32 scalar on ", params.device().name());
  LT_CHECK(state.is_cuda() && state.dtype() == DType::F64 && state.numel() == kDeviceStepDoubles,
           "[AdamW] the queued step's state must be ", kDeviceStepDoubles, " float64 values on the device");
  const Tensor norm = grad_norm(grads);
  auto* st = static_cast<DeviceStep*>(state.data());
  prepare_step_kernel<<<1, 1, 0, stream(params.device().index)>>>(
      st, static_cast<const float*>(loss.data()), static_cast<const double*>(norm.data()), max_norm, beta1, beta2,
      eps, weight_decay);
  LT_CUDA_CHECK_LAUNCH();
  launch_adamw(params, grads, m, v, decay_mask, AdamWScalars{}, copy, st);
}

void adamw_step_cuda(const Tensor& params, const Tensor& grads, const Tensor& m, const Tensor& v,
                     const Tensor& decay_mask, const AdamWScalars& s, const Tensor& copy) {
  launch_adamw(params, grads, m, v, decay_mask, s, copy, nullptr);
}

std::pair<double, double> read_step_cuda(const Tensor& state) {
  DeviceStep out{};
  const int dev = state.device().index;
  LT_CUDA_CHECK(cudaMemcpyAsync(&out, state.data(), sizeof(out), cudaMemcpyDeviceToHost, stream(dev)));
  synchronize(dev);
  return {out.loss, out.grad_norm};
}

}  // namespace lintape::train_cuda
