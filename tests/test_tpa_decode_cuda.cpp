// TPA fused CUDA decode, the tensor-core kernel's schedules side by side: the last-block combine (cluster 0),
// clusters of up to 8 (the portable size) and one cluster a sequence of up to 16 blocks where the splits fit
// (DecodeArgs::cluster 16), each on a poisoned output against the f64 CPU reference.
#include <cmath>
#include <vector>
#include "helpers.h"
#include "tpa_helpers.h"
#include "ops/tpa/launch.h"
#include "ops/tpa/tpa.h"

using namespace lintape;
using namespace lintape::test;

#if LINTAPE_WITH_CUDA
namespace {

// Mixed cache lengths: the full M, 1, and values spread over 1..M.
std::vector<int64_t> mixed(const DecodeShape& s) {
  std::vector<int64_t> lengths(size_t(s.B), s.M);
  for (int64_t b = 1; b < s.B; ++b) lengths[size_t(b)] = b == 1 ? 1 : 1 + (b * 4421) % s.M;
  return lengths;
}

Tensor run(const FactorInputs& f, const std::vector<int64_t>& lengths, int cluster, int64_t split_rows,
           int head_slices = -1) {
  tpa_cuda::DecodeArgs a{f.gpu[0], f.gpu[1], f.gpu[2], f.gpu[3], f.gpu[4], f.gpu[5], lengths};
  a.scale = 1.0 / std::sqrt(double(f.gpu[1].size(3)));
  a.cluster = cluster;
  a.split_rows = split_rows;
  a.head_slices = head_slices;
  REQUIRE(tpa_cuda::decode_uses_tensor_cores(a));
  Tensor out = empty({f.gpu[0].size(0), 1, f.gpu[0].size(2), f.gpu[5].size(3)}, f.gpu[0].dtype(), gpu());
  poison_(out);
  tpa_cuda::decode(a, out);
  return out.to(Device::cpu());
}

}  // namespace
#endif

TEST_CASE("cuda tpa decode schedules: one cluster a sequence against the others" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // Shapes where the launcher's splits fit one cluster of 2..16 blocks a sequence (B = 8 at M 1024 and 2048,
  // the bench's short caches), M = 1, M not a multiple of the 64-row tile (or the 32-row one of H = 64),
  // ranks 1 and 16 for q, D and E 64 and 128, ranks 2 for k and v (one 16-row chunk a warp: the last-block
  // schedule under every cluster value, with its gathering combine under 16); split_rows 64 gives several
  // clusters a sequence, combined by the last block (clusters of 16 with cluster 16).
  const DecodeShape shapes[] = {{8, 2048, 32, 16, 1, 1, 128, 128}, {8, 1000, 32, 1, 1, 1, 64, 64},
                           {3, 1, 32, 16, 1, 1, 128, 128},    {2, 1999, 32, 16, 2, 2, 128, 128},
                           {5, 777, 16, 16, 1, 1, 64, 128},   {4, 1201, 64, 16, 1, 1, 128, 128},
                           {2, 4097, 32, 6, 1, 1, 128, 64}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16}) {
      const FactorInputs f = decode_inputs(s, dt, uint64_t(s.M * 3 + s.B), gpu());
      const std::vector<int64_t> lengths = mixed(s);
      const Tensor ref = cpu_decode(f, lengths);
      for (int cluster : {0, 8, 16})
        for (int64_t split_rows : {int64_t(0), int64_t(64)}) {
          CAPTURE(s.B);
          CAPTURE(s.M);
          CAPTURE(s.H);
          CAPTURE(s.Rq);
          CAPTURE(s.D);
          CAPTURE(dtype_name(dt));
          CAPTURE(cluster);
          CAPTURE(split_rows);
          CHECK_CLOSE_TENSOR(run(f, lengths, cluster, split_rows), ref, dt);
        }
    }
#endif
}

TEST_CASE("cuda tpa decode schedules: the seeds' shape, twice, within 5e-3 of f64" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // B = 8, H = 32, R_q = 16, D = E = 128 (the bench's table) at a short cache, where cluster 16 takes one
  // cluster of 8 a sequence (four tiles a split), and a long one, where it takes the clusters of 8 and the last
  // cluster's combine: the error against
  // f64 and the same bits on a second call (no state left behind).
  for (int64_t M : {int64_t(2048), int64_t(8192)}) {
    const DecodeShape s{8, M, 32, 16, 1, 1, 128, 128};
    const FactorInputs f = decode_inputs(s, DType::BF16, uint64_t(M), gpu());
    const std::vector<int64_t> lengths = mixed(s);
    const Tensor ref = cpu_decode(f, lengths);
    for (int cluster : {0, 8, 16}) {
      CAPTURE(M);
      CAPTURE(cluster);
      const Tensor out = run(f, lengths, cluster, 0);
      CHECK(rel_error(out, ref) <= 5e-3);
      CHECK(rel_error(run(f, lengths, cluster, 0), out) == 0.0);
    }
  }
#endif
}

TEST_CASE("cuda tpa decode schedules: two head slices of 16 at H 32" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // Each sequence's 32 heads as two slices of 16 with blocks of their own (128-row tiles): M = 1, M not a multiple
  // of the tile, one cluster a slice (split_rows 0 at B 8, M <= 4096), several clusters a slice combined by the
  // last cluster (split_rows 128, B 1 at M 8192), clusters of 1, 2, 8 and 16; against f64, against the whole heads'
  // schedule, and the same bits on a second call.
  const DecodeShape shapes[] = {{8, 2048, 32, 16, 1, 1, 128, 128}, {3, 1, 32, 16, 1, 1, 128, 128},
                                {8, 4096, 32, 16, 1, 1, 128, 128}, {5, 1000, 32, 16, 1, 1, 128, 128},
                                {1, 8192, 32, 16, 1, 1, 128, 128}, {8, 333, 32, 16, 1, 1, 128, 128}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16}) {
      const FactorInputs f = decode_inputs(s, dt, uint64_t(s.M * 5 + s.B), gpu());
      const std::vector<int64_t> lengths = mixed(s);
      const Tensor ref = cpu_decode(f, lengths);
      for (int cluster : {1, 2, 8, 16})
        for (int64_t split_rows : {int64_t(0), int64_t(128)}) {
          CAPTURE(s.B);
          CAPTURE(s.M);
          CAPTURE(dtype_name(dt));
          CAPTURE(cluster);
          CAPTURE(split_rows);
          const Tensor out = run(f, lengths, cluster, split_rows, 2);
          CHECK_CLOSE_TENSOR(out, ref, dt);
          CHECK_CLOSE_TENSOR(out, run(f, lengths, cluster, split_rows, 1), dt);
          CHECK(rel_error(run(f, lengths, cluster, split_rows, 2), out) == 0.0);
        }
    }
#endif
}
