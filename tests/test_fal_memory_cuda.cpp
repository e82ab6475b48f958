// FAL on CUDA: the fused sequence kernels' memory budget (forward and backward peaks over what the outputs and
// the per-chunk or per-segment states need), causal and noncausal, chunk kernels and sweeps.
#include <vector>
#include "core/allocator.h"
#include "core/cuda.h"
#include "fal_cuda_helpers.h"
#include "helpers.h"
#include "ops/fal/fal.h"
#include "ops/fal/launch.h"

using namespace lintape;
using namespace lintape::test;
using namespace lintape::test::fal_cuda_cases;

TEST_CASE("cuda fal fused peak memory" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const int64_t B = 2, N = 300, H = 3, slack = 8 * 512;
  const StepConfig& c = kSequenceConfigs[0];
  const int64_t P = fal_state_rows(c.lrpe, c.D);
  for (int kind = 0; kind < 4; ++kind) {
    const bool causal = kind == 1 || kind == 2;
    const DType dt = kind == 1 || kind == 3 ? DType::F32 : DType::BF16;
    CAPTURE(causal);
    CAPTURE(dtype_name(dt));
    std::vector<Tensor> in;
    uint64_t seed = 500;
    for (const Shape& s : {Shape{B, N, H, c.D}, Shape{B, N, H, c.D}, Shape{B, N, H, c.E}, Shape{B, N, H, c.E}})
      in.push_back(randn(s, dt, gpu(), seed++));
    const Tensor S0 = causal ? randn({B, H, P, c.E}, DType::F32, gpu(), seed++) : Tensor();
    FalOptions o = step_options(c, H, gpu());
    o.causal = causal;
    if (!causal) o.decay = Tensor();
    const FalStepSpec spec = kernel_spec(c, o);
    const bool chunked = causal && fal_cuda::causal_chunked(dt, c.D, c.E, spec);
    const bool nc_chunked = !causal && fal_cuda::noncausal_chunked(dt, c.D, c.E, spec);
    CHECK(chunked == (kind == 2));
    CHECK(nc_chunked == (kind == 0));
    const Tensor dout = randn({B, N, H, c.E}, dt, gpu(), seed++);
    const int64_t state_bytes = B * H * P * c.E * 4, out_bytes = B * N * H * c.E * int64_t(dtype_size(dt));
    // Noncausal sweep reductions keep one partial state per slice of the sequence (64 tokens or more each); the
    // noncausal chunk reductions one (b, h) state per (b, h) and per run of 8 or more chunks; causal sweeps one
    // state per segment when they cut the sequence (B x H = 6 is far below the SMs: they do); the causal chunk
    // kernels one state per inner segment boundary (they cut too), in the backward with two states per 64-token
    // chunk in the inputs' dtype (S_c and R_(c+1)).
    const int sms = cuda::sm_count(gpu().index);
    const int64_t segments = fal_cuda::causal_segments(B * H, N, sms), nC = (N + 63) / 64;
    if (causal) CHECK(segments > 1);
    const fal_cuda::ChunkShape shape{B * H, nC, c.D, P, c.E};
    const int64_t fwd_cut = fal_cuda::chunk_segments(shape, sms, true);
    const int64_t bwd_cut = fal_cuda::chunk_segments(shape, sms, false);
    if (chunked) CHECK(fwd_cut > 1);
    if (chunked) CHECK(bwd_cut > 1);
    const int64_t partials = causal ? (segments > 1 ? segments : 0) : (N + 63) / 64;
    const int64_t chunk_states = B * H * nC * P * c.E * int64_t(dtype_size(dt));
    const int64_t nc_partials = ((B * H * ((N + 63) / 64) + 7) / 8 + B * H) * P * c.E * 4;
    const int64_t fwd_extra = chunked      ? (fwd_cut - 1) * state_bytes
                              : nc_chunked ? nc_partials
                                           : partials * state_bytes;

    int64_t base = int64_t(memory_stats(gpu()).in_use);
    reset_peak_memory(gpu());
    Tensor out = causal ? fal_with_state(in[0], in[1], in[2], in[3], S0, o, Impl::Fused).first
                        : fal(in[0], in[1], in[2], in[3], o, Impl::Fused);
    CHECK(int64_t(memory_stats(gpu()).peak) - base <= out_bytes + state_bytes + fwd_extra + slack);

    Tensor state = empty({B, H, P, c.E}, DType::F32, gpu());
    std::vector<Tensor> grads;
    for (const Tensor& t : in) grads.push_back(empty(t.shape(), dt, gpu()));
    Tensor dS0 = causal ? empty(S0.shape(), DType::F32, gpu()) : Tensor();
    if (!causal) fal_cuda::noncausal_forward(in[0], in[1], in[2], in[3], spec, state, out);
    base = int64_t(memory_stats(gpu()).in_use);
    reset_peak_memory(gpu());
    if (causal)
      fal_cuda::causal_backward(in[0], in[1], in[2], in[3], spec, S0, dout, Tensor(), grads[0], grads[1], grads[2],
                                grads[3], dS0);
    else
      fal_cuda::noncausal_backward(in[0], in[1], in[2], in[3], spec, state, dout, grads[0], grads[1], grads[2],
                                   grads[3]);
    const int64_t bwd_extra = chunked      ? 2 * chunk_states + (bwd_cut - 1) * state_bytes
                              : causal     ? partials * state_bytes
                              : nc_chunked ? state_bytes + nc_partials  // dkv, partials
                                           : (1 + partials) * state_bytes;
    CHECK(int64_t(memory_stats(gpu()).peak) - base <= bwd_extra + slack);
  }
#endif
}
