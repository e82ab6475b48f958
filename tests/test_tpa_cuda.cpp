// TPA fused CUDA decode: the launcher on poisoned outputs vs the f64 CPU reference at several shapes,
// split counts, dtypes and cache lengths; a TpaCache read in place; peak memory.
#include <cmath>
#include <vector>
#include "core/allocator.h"
#include "helpers.h"
#include "ops/tpa.h"
#include "ops/tpa_cuda.h"

using namespace lintape;
using namespace lintape::test;

namespace {

struct DecodeShape {
  int64_t B, M, H, Rq, Rk, Rv, D, E;
};

struct Inputs {
  std::vector<Tensor> cpu;  // f64, rounded through the tested dtype
  std::vector<Tensor> gpu;  // the tested dtype
};

Inputs decode_inputs(const DecodeShape& s, DType dt, uint64_t seed) {
  const Shape shapes[] = {{s.B, 1, s.H, s.Rq},  {s.B, 1, s.Rq, s.D}, {s.B, s.M, s.H, s.Rk},
                          {s.B, s.M, s.Rk, s.D}, {s.B, s.M, s.H, s.Rv}, {s.B, s.M, s.Rv, s.E}};
  Inputs in;
  for (int i = 0; i < 6; ++i) {
    Tensor g = randn(shapes[i], dt, gpu(), seed * 8 + uint64_t(i));
    in.gpu.push_back(g);
    in.cpu.push_back(g.to(Device::cpu()).to(DType::F64));
  }
  return in;
}

Tensor cpu_decode(const Inputs& in, const std::vector<int64_t>& lengths) {
  TpaOptions o;
  o.cache_lengths = lengths;
  const std::vector<Tensor>& c = in.cpu;
  return tpa_decode(c[0], c[1], c[2], c[3], c[4], c[5], o, Impl::Reference);
}

}  // namespace

TEST_CASE("cuda tpa decode fused matches the CPU reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const DecodeShape shapes[] = {{2, 37, 3, 2, 1, 1, 8, 8},      {1, 1, 2, 3, 2, 2, 64, 64},
                                {3, 301, 4, 4, 3, 2, 64, 48},   {2, 1000, 32, 16, 1, 1, 128, 128},
                                {1, 4097, 8, 6, 2, 2, 128, 128}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::F32, DType::BF16, DType::F16})
      for (int64_t split_rows : {int64_t(0), int64_t(16), int64_t(100)}) {
        CAPTURE(s.M);
        CAPTURE(s.H);
        CAPTURE(dtype_name(dt));
        CAPTURE(split_rows);
        const Inputs in = decode_inputs(s, dt, uint64_t(s.M));
        std::vector<int64_t> lengths(size_t(s.B), s.M);
        if (s.B > 1) lengths[1] = (s.M + 1) / 2;
#if LINTAPE_WITH_CUDA
        tpa_cuda::DecodeArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5],
                               from_vector_i64(lengths, {s.B}, gpu())};
        a.scale = 1.0 / std::sqrt(double(s.D));
        a.split_rows = split_rows;
        Tensor out = empty({s.B, 1, s.H, s.E}, dt, gpu());
        poison_(out);
        tpa_cuda::decode(a, out);
        CHECK_CLOSE_TENSOR(out.to(Device::cpu()), cpu_decode(in, lengths), dt);
#endif
      }
}

TEST_CASE("cuda tpa decode over a TpaCache reads it in place" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const DecodeShape s{4, 300, 8, 16, 1, 1, 128, 128};
  const Inputs in = decode_inputs(s, DType::BF16, 3);
  TpaCache cache(s.B, s.H, s.Rk, s.Rv, s.D, s.E, DType::BF16, gpu(), Tensor(), 64);
  for (int64_t t = 0; t < s.M; ++t)
    cache.append(in.gpu[2].narrow(1, t, 1), in.gpu[3].narrow(1, t, 1), in.gpu[4].narrow(1, t, 1),
                 in.gpu[5].narrow(1, t, 1), {true, t < 200, true, t < 1});
  const std::vector<int64_t> lengths{300, 200, 300, 1};
  REQUIRE(cache.lengths() == lengths);
  const Tensor ref = cpu_decode(in, lengths);
  reset_peak_memory(gpu());
  const size_t before = memory_stats(gpu()).in_use;
  const Tensor out = tpa_decode(in.gpu[0], in.gpu[1], cache);
  // The output, the lengths and the splits' partial sums only: no copy of the cache, no k or v.
  const size_t extra = memory_stats(gpu()).peak - before;
  CHECK(extra < size_t(cache.bytes()) / 8);
  CHECK_CLOSE_TENSOR(out.to(Device::cpu()), ref, DType::BF16);
}
