// TPA fused CUDA decode: the launcher on poisoned outputs vs the f64 CPU reference at several shapes,
// split counts, dtypes and cache lengths, for the general and the tensor-core kernel; a TpaCache read in
// place; peak memory.
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>
#include "core/allocator.h"
#include "helpers.h"
#include "tpa_helpers.h"
#include "ops/lrpe/lrpe.h"
#include "ops/shape.h"
#include "ops/tpa/tpa.h"
#include "ops/tpa/launch.h"

using namespace lintape;
using namespace lintape::test;

namespace {

// Runs the launcher on a poisoned output and compares with the reference; cluster as DecodeArgs::cluster.
void check_decode(const DecodeShape& s, DType dt, const std::vector<int64_t>& lengths, int64_t split_rows,
                  bool tensor_cores, uint64_t seed, int cluster = -1) {
  const FactorInputs in = decode_inputs(s, dt, seed, gpu());
#if LINTAPE_WITH_CUDA
  tpa_cuda::DecodeArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], lengths};
  a.scale = 1.0 / std::sqrt(double(s.D));
  a.split_rows = split_rows;
  a.allow_tensor_cores = tensor_cores;
  a.cluster = cluster;
  CHECK(tpa_cuda::decode_uses_tensor_cores(a) == tensor_cores);
  Tensor out = empty({s.B, 1, s.H, s.E}, dt, gpu());
  poison_(out);
  tpa_cuda::decode(a, out);
  CHECK_CLOSE_TENSOR(out.to(Device::cpu()), cpu_decode(in, lengths), dt);
#else
  (void)in;
  (void)lengths;
  (void)split_rows;
  (void)tensor_cores;
  (void)cluster;
#endif
}

std::vector<int64_t> mixed_lengths(const DecodeShape& s) {
  std::vector<int64_t> lengths(size_t(s.B), s.M);
  if (s.B > 1) lengths[1] = (s.M + 1) / 2;
  if (s.B > 2) lengths[2] = 1;
  return lengths;
}

}  // namespace

TEST_CASE("cuda tpa decode general kernel matches the CPU reference" * LT_CUDA_CASE) {
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
        check_decode(s, dt, mixed_lengths(s), split_rows, false, uint64_t(s.M));
      }
}

TEST_CASE("cuda tpa decode tensor-core kernel matches the CPU reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Head counts for each m-tile count (12, 32, 64), E = 64 and 128, ranks up to (16, 4, 4), caches
  // shorter than a tile, not a multiple of it, and a batch past the inline lengths (300).
  const DecodeShape shapes[] = {{2, 1000, 32, 16, 1, 1, 128, 128}, {1, 4097, 8, 6, 2, 2, 128, 128},
                                {3, 77, 12, 6, 2, 2, 64, 64},      {2, 300, 64, 16, 1, 1, 64, 128},
                                {3, 5, 16, 4, 4, 4, 32, 64},       {300, 40, 8, 2, 1, 1, 64, 64},
                                {1, 1, 32, 16, 1, 1, 128, 128}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t split_rows : {int64_t(0), int64_t(32), int64_t(100)}) {
        CAPTURE(s.B);
        CAPTURE(s.M);
        CAPTURE(s.H);
        CAPTURE(dtype_name(dt));
        CAPTURE(split_rows);
        check_decode(s, dt, mixed_lengths(s), split_rows, true, uint64_t(s.M + s.B));
      }
}

TEST_CASE("cuda tpa decode tensor-core kernel error at the seeds' shape" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // B = 8, H = 32, R_q = 16, D = E = 128, bf16, a long cache: relative error vs f64 within 5e-3.
  const DecodeShape s{8, 8192, 32, 16, 1, 1, 128, 128};
  const FactorInputs in = decode_inputs(s, DType::BF16, 11, gpu());
  const std::vector<int64_t> lengths(size_t(s.B), s.M);
  const Tensor out = tpa_decode(in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5]);
  const double err = rel_error(out.to(Device::cpu()), cpu_decode(in, lengths));
  CHECK(err <= 5e-3);
  // The same call again: the split counters were reset by the first.
  const Tensor again = tpa_decode(in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5]);
  CHECK(rel_error(again.to(Device::cpu()), out.to(Device::cpu())) == 0.0);
}

TEST_CASE("cuda tpa decode over a TpaCache reads it in place" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const DecodeShape s{4, 300, 8, 16, 1, 1, 128, 128};
  const FactorInputs in = decode_inputs(s, DType::BF16, 3, gpu());
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
  // The output and the splits' partial sums (up to 64 splits x H x E f32 per sequence) only: no copy
  // of the cache, no k or v (over 4x the cache here).
  const size_t extra = memory_stats(gpu()).peak - before;
  CHECK(extra < size_t(cache.bytes()) / 2);
  CHECK_CLOSE_TENSOR(out.to(Device::cpu()), ref, DType::BF16);
}

namespace {

struct AttnShape {
  int64_t B, N, M, H, Rq, Rk, Rv, D;
  bool causal;
};

bool all_finite(const Tensor& t) {
  for (double v : t.to(Device::cpu()).to_vector<double>())
    if (!std::isfinite(v)) return false;
  return true;
}

// The six factors on the GPU in dt and their f64 CPU copies (rounded through dt).
FactorInputs attention_inputs(const AttnShape& s, DType dt, uint64_t seed) {
  const Shape shapes[] = {{s.B, s.N, s.H, s.Rq}, {s.B, s.N, s.Rq, s.D}, {s.B, s.M, s.H, s.Rk},
                          {s.B, s.M, s.Rk, s.D}, {s.B, s.M, s.H, s.Rv}, {s.B, s.M, s.Rv, s.D}};
  FactorInputs in;
  for (int i = 0; i < 6; ++i) {
    Tensor g = randn(shapes[i], dt, gpu(), seed * 8 + uint64_t(i));
    in.gpu.push_back(g);
    in.cpu.push_back(g.to(Device::cpu()).to(DType::F64));
  }
  return in;
}

}  // namespace

TEST_CASE("cuda tpa attention fused forward and six gradients match the CPU reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Odd N, causal and not, N != M (more keys than a tile), ranks (6, 2, 2), (1, 1, 1) and up to 16,
  // D = 64 and 128, several query and key tiles; the last two run the producer's ring of two slots around
  // three times (six key tiles of 128, the last one partial) over several heads and batch entries.
  const AttnShape shapes[] = {{2, 77, 77, 3, 6, 2, 2, 64, true},     {2, 77, 77, 3, 6, 2, 2, 64, false},
                              {1, 130, 130, 2, 1, 1, 1, 128, true},  {1, 45, 70, 2, 3, 2, 4, 128, false},
                              {1, 201, 201, 2, 16, 16, 16, 64, true}, {1, 300, 300, 2, 6, 2, 2, 128, true},
                              {1, 130, 300, 3, 6, 2, 2, 64, false},  {1, 150, 150, 2, 16, 4, 2, 128, false},
                              {2, 257, 257, 2, 2, 8, 8, 128, true},  {2, 700, 700, 3, 6, 2, 2, 128, true},
                              {2, 390, 650, 2, 1, 16, 1, 64, false}};
  for (const AttnShape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16}) {
      CAPTURE(s.N);
      CAPTURE(s.M);
      CAPTURE(s.D);
      CAPTURE(s.causal);
      CAPTURE(dtype_name(dt));
      const FactorInputs in = attention_inputs(s, dt, uint64_t(s.N + s.Rq));
      TpaOptions o;
      o.causal = s.causal;
      const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), 5).to(dt).to(DType::F64);
      const std::vector<Tensor> ref = attention_and_grads(in.cpu, o, Impl::Reference, w);
      const std::vector<Tensor> got = attention_and_grads(in.gpu, o, Impl::Fused, w);
      for (size_t i = 0; i < ref.size(); ++i) {
        CAPTURE(kAttentionNames[i]);
        CHECK_CLOSE_TENSOR(got[i], ref[i], dt);
      }
#if LINTAPE_WITH_CUDA
      // The launchers on poisoned outputs: every element written.
      check_attention_launchers({in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], s.causal,
                                 1.0 / std::sqrt(double(s.D))},
                                dt, w, ref);
#endif
    }
}

TEST_CASE("cuda tpa attention fused reads views of wider projections in place" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // The TPA mixer's factors: splits of its two projections, (B, N, H, 10) and (B, N, 10, D).
  const int64_t B = 2, N = 150, H = 3, D = 128;
  const Tensor fa = randn({B, N, H, 10}, DType::BF16, gpu(), 31), fb = randn({B, N, 10, D}, DType::BF16, gpu(), 32);
  const std::vector<Tensor> as = split(fa, {6, 2, 2}, 3), bs = split(fb, {6, 2, 2}, 2);
  const std::vector<Tensor> views{as[0], bs[0], as[1], bs[1], as[2], bs[2]};
  std::vector<Tensor> copies;
  for (const Tensor& v : views) copies.push_back(v.contiguous());
  TpaOptions o;
  o.causal = true;
  const Tensor w = randn({B, N, H, D}, DType::F32, Device::cpu(), 33);
  const std::vector<Tensor> from_views = attention_and_grads(views, o, Impl::Fused, w);
  const std::vector<Tensor> from_copies = attention_and_grads(copies, o, Impl::Fused, w);
  // The same arithmetic, summed in the same order: the output and the gradients to the bit.
  for (size_t i = 0; i < 7; ++i) {
    CAPTURE(i);
    CHECK(from_views[i].to_vector<double>() == from_copies[i].to_vector<double>());
  }
  // Read in place: a copy of bq alone would add twice the output.
  reset_peak_memory(gpu());
  const size_t before = memory_stats(gpu()).in_use;
  const Tensor out = tpa_attention(views[0], views[1], views[2], views[3], views[4], views[5], o, Impl::Fused);
  CHECK(memory_stats(gpu()).peak - before <= 3 * out.nbytes() + size_t(B * N * H) * 4 + 4096);
}

namespace {
// tpa_factors' six outputs (on the CPU) and y's gradient for upstream gradients ws on the outputs in `used`
// (the others get none); `old_path`: the mixer's former split, views and lrpe_rotate (its fused kernel) instead.
std::vector<Tensor> factors_and_grad(const Tensor& y0, const Tensor& theta, int64_t offset, const Documents& docs,
                                     const std::vector<Tensor>& ws, const std::vector<size_t>& used, bool old_path) {
  const int64_t B = y0.size(0), N = y0.size(1), H = 3, Rq = 6, Rk = 2, Rv = 2, D = 64, R = Rq + Rk + Rv;
  const Tensor y = y0.detach().requires_grad_();
  std::array<Tensor, 6> f;
  if (old_path) {
    const std::vector<Tensor> parts = split(y, {Rq * D, Rk * D, Rv * D, H * R, y.size(2) - R * D - H * R}, -1);
    const std::vector<Tensor> as = split(parts[3].view({B, N, H, R}), {Rq, Rk, Rv}, 3);
    LrpeOptions at;
    at.offset = offset;
    at.documents = docs;
    f = {as[0], lrpe_rotate(parts[0].view({B, N, Rq, D}), theta, at), as[1],
         lrpe_rotate(parts[1].view({B, N, Rk, D}), theta, at), as[2], parts[2].view({B, N, Rv, D})};
  } else {
    f = tpa_factors(y, H, Rq, Rk, Rv, D, D, theta, offset, docs, Impl::Fused);
  }
  std::vector<Tensor> outs, grads, r;
  for (size_t i : used) {
    outs.push_back(f[i]);
    grads.push_back(ws[i].to(y.device()).to(y.dtype()));
  }
  backward(outs, grads);
  for (const Tensor& t : f) r.push_back(t.detach().to(Device::cpu()));
  r.push_back(y.grad().to(Device::cpu()));
  return r;
}
}  // namespace

// The TPA mixer's factors: one rotate launch for bq and bk and y's gradient written in one buffer give the
// bits of split, views and lrpe_rotate (offset, documents, padding, factors without a gradient).
TEST_CASE("cuda tpa factors of one projection equal split and lrpe_rotate" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const int64_t B = 2, N = 77, H = 3, D = 64, W = 10 * D + H * 10 + 2;  // 2 columns of padding
  uint64_t seed = 700;
  const Tensor theta = lrpe_theta(1, D / 2, 10000.0, gpu());
  const Documents docs = Documents::from_cu_seqlens({0, 30, 77, 154}, B, N, gpu());
  const Shape shapes[] = {{B, N, H, 6}, {B, N, 6, D}, {B, N, H, 2}, {B, N, 2, D}, {B, N, H, 2}, {B, N, 2, D}};
  for (DType dt : {DType::BF16, DType::F32})
    for (int run = 0; run < 3; ++run) {
      CAPTURE(dtype_name(dt));
      CAPTURE(run);
      const Tensor y = randn({B, N, W}, dt, gpu(), seed++);
      std::vector<Tensor> ws;
      for (const Shape& sh : shapes) ws.push_back(randn(sh, DType::F32, Device::cpu(), seed++));
      const int64_t offset = run == 1 ? 5 : 0;
      const Documents d = run == 2 ? docs : Documents();
      const std::vector<size_t> used = run == 1 ? std::vector<size_t>{0, 3, 5} : std::vector<size_t>{0, 1, 2, 3, 4, 5};
      const std::vector<Tensor> want = factors_and_grad(y, theta, offset, d, ws, used, true);
      const std::vector<Tensor> got = factors_and_grad(y, theta, offset, d, ws, used, false);
      for (size_t i = 0; i < want.size(); ++i) {
        CAPTURE(i);
        CHECK(got[i].shape() == want[i].shape());
        CHECK(got[i].to_vector<double>() == want[i].to_vector<double>());
      }
      // The padding's gradient is zero, and so are the columns of a factor without a gradient.
      const std::vector<double> pad = got[6].narrow(2, W - 2, 2).contiguous().to_vector<double>();
      CHECK(std::all_of(pad.begin(), pad.end(), [](double v) { return v == 0.0; }));
    }
}

TEST_CASE("cuda tpa attention fused backward gives the same bits run to run" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // dq rows summed over up to 5 key tiles and basis rows over up to 8 heads, causal (the diagonal tiles,
  // N a multiple of no tile) and not (N != M, ranks 16 and 1), D = 128 and 64.
  const AttnShape shapes[] = {{2, 600, 600, 8, 6, 2, 2, 128, true}, {1, 200, 523, 5, 16, 16, 1, 64, false}};
  for (const AttnShape& s : shapes) {
    CAPTURE(s.N);
    const FactorInputs in = attention_inputs(s, DType::BF16, uint64_t(s.N));
    TpaOptions o;
    o.causal = s.causal;
    const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), 9).to(DType::BF16).to(DType::F64);
    const std::vector<Tensor> ref = attention_and_grads(in.cpu, o, Impl::Reference, w);
    const std::vector<Tensor> first = attention_and_grads(in.gpu, o, Impl::Fused, w);
    for (int run = 0; run < 3; ++run) {
      const std::vector<Tensor> again = attention_and_grads(in.gpu, o, Impl::Fused, w);
      for (size_t i = 0; i < ref.size(); ++i) {
        CAPTURE(kAttentionNames[i]);
        CHECK(again[i].to_vector<double>() == first[i].to_vector<double>());
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(kAttentionNames[i]);
      CHECK_CLOSE_TENSOR(first[i], ref[i], DType::BF16);
    }
  }
}

// Every forward kernel the device runs (the persistent ones on five blocks) with the wide row kernels and with
// those of before (AttentionArgs::old_rows): the same output and log-sum-exp, bit for bit, both written whole.
TEST_CASE("cuda tpa attention forward: the wide row kernels give the bits of build_rows" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const AttnShape shapes[] = {{2, 333, 333, 3, 16, 16, 16, 128, true}, {2, 256, 256, 6, 6, 2, 2, 128, true},
                              {1, 200, 523, 4, 1, 1, 1, 128, false}, {1, 129, 129, 2, 2, 1, 3, 64, true}};
  for (const AttnShape& s : shapes)
    for (tpa_cuda::ForwardKernel k : tpa_cuda::forward_kernels(gpu().index)) {
      CAPTURE(s.N);
      CAPTURE(s.Rq);
      CAPTURE(int(k));
      const FactorInputs in = attention_inputs(s, DType::BF16, uint64_t(s.N + 5));
      tpa_cuda::AttentionArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], s.causal,
                                1.0 / std::sqrt(double(s.D))};
      a.forward_kernel = k;
      a.persistent_blocks = 5;
      std::vector<double> outs[2], lses[2];
      for (int r = 0; r < 2; ++r) {
        a.old_rows = r == 1;
        Tensor out = empty({s.B, s.N, s.H, s.D}, DType::BF16, gpu()), lse = empty({s.B, s.N, s.H}, DType::F32, gpu());
        poison_(out);
        poison_(lse);
        tpa_cuda::attention_forward(a, out, lse);
        CHECK(all_finite(out));
        CHECK(all_finite(lse));
        outs[r] = out.to(Device::cpu()).to_vector<double>();
        lses[r] = lse.to(Device::cpu()).to_vector<double>();
      }
      CHECK(outs[0] == outs[1]);
      CHECK(lses[0] == lses[1]);
    }
#endif
}

TEST_CASE("cuda tpa attention backward kernels at the tiles' edges, ranks 1 and 16, same bits" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // Each backward kernel the device runs, named through the launcher: one query tile inside one key tile;
  // N a multiple of no tile (the causal diagonal key tiles of 128 over query tiles of 64, the last of each
  // partial), ranks 16; N != M not causal, ranks 1 and 16; whole tiles; D = 64, which the warpgroup kernel
  // leaves to mma.sync. Two backward runs on the same inputs give the same bits; the row kernels of before
  // (AttentionArgs::old_rows) give the same bits as the wide ones.
  const AttnShape shapes[] = {{1, 64, 64, 2, 1, 1, 1, 128, true},      {2, 333, 333, 3, 16, 16, 16, 128, true},
                              {1, 200, 523, 4, 1, 16, 1, 128, false},  {2, 256, 256, 2, 6, 2, 2, 128, true},
                              {1, 129, 129, 2, 2, 1, 3, 64, true}};
  for (const AttnShape& s : shapes)
    for (tpa_cuda::BackwardKernel k : tpa_cuda::backward_kernels(gpu().index)) {
      CAPTURE(s.N);
      CAPTURE(s.M);
      CAPTURE(s.D);
      CAPTURE(int(k));
      const DType dt = s.Rk == 16 ? DType::F16 : DType::BF16;
      const FactorInputs in = attention_inputs(s, dt, uint64_t(s.N + 3));
      TpaOptions o;
      o.causal = s.causal;
      const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), 11).to(dt).to(DType::F64);
      const std::vector<Tensor> ref = attention_and_grads(in.cpu, o, Impl::Reference, w);
      tpa_cuda::AttentionArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], s.causal,
                                1.0 / std::sqrt(double(s.D))};
      a.backward_kernel = k;
      Tensor out = empty({s.B, s.N, s.H, s.D}, dt, gpu()), lse = empty({s.B, s.N, s.H}, DType::F32, gpu());
      tpa_cuda::attention_forward(a, out, lse);
      const Tensor dout = w.to(dt).to(gpu());
      std::vector<std::vector<double>> runs[3];  // twice the wide row kernels, then the old ones
      for (int r = 0; r < 3; ++r) {
        std::vector<std::vector<double>>& run = runs[r];
        a.old_rows = r == 2;
        CAPTURE(a.old_rows);
        tpa_cuda::FactorGrads fg{empty(in.gpu[0].shape(), dt, gpu()), empty(in.gpu[1].shape(), dt, gpu()),
                                 empty(in.gpu[2].shape(), dt, gpu()), empty(in.gpu[3].shape(), dt, gpu()),
                                 empty(in.gpu[4].shape(), dt, gpu()), empty(in.gpu[5].shape(), dt, gpu())};
        Tensor* grads[] = {&fg.aq, &fg.bq, &fg.ak, &fg.bk, &fg.av, &fg.bv};
        for (Tensor* t : grads) poison_(*t);
        tpa_cuda::attention_backward(a, out, lse, dout, fg);
        for (size_t i = 0; i < 6; ++i) {
          CAPTURE(kAttentionNames[i + 1]);
          const Tensor got = grads[i]->to(Device::cpu());
          CHECK_CLOSE_TENSOR(got, ref[i + 1], dt);
          run.push_back(got.to_vector<double>());
        }
      }
      CHECK(runs[0] == runs[1]);
      CHECK(runs[0] == runs[2]);
    }
#endif
}

// The batch split over launches (one entry a launch, then two: a short last launch) gives the bits of one launch,
// forward (every forward kernel the device runs) and backward (every backward kernel), outputs poisoned first.
TEST_CASE("cuda tpa attention: the batch in several launches gives the bits of one" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const AttnShape s{3, 200, 200, 3, 6, 2, 2, 128, true};
  const FactorInputs in = attention_inputs(s, DType::BF16, 31);
  tpa_cuda::AttentionArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], s.causal,
                            1.0 / std::sqrt(double(s.D))};
  auto forward = [&](int per_launch) {
    a.batch_per_launch = per_launch;
    Tensor out = empty({s.B, s.N, s.H, s.D}, DType::BF16, gpu()), lse = empty({s.B, s.N, s.H}, DType::F32, gpu());
    poison_(out);
    poison_(lse);
    tpa_cuda::attention_forward(a, out, lse);
    return std::make_pair(out, lse);
  };
  for (tpa_cuda::ForwardKernel k : tpa_cuda::forward_kernels(gpu().index)) {
    CAPTURE(int(k));
    a.forward_kernel = k;
    const auto [out, lse] = forward(0);
    CHECK(all_finite(out));
    for (int per_launch : {1, 2}) {
      CAPTURE(per_launch);
      const auto [o, l] = forward(per_launch);
      CHECK(o.to(Device::cpu()).to_vector<double>() == out.to(Device::cpu()).to_vector<double>());
      CHECK(l.to(Device::cpu()).to_vector<double>() == lse.to(Device::cpu()).to_vector<double>());
    }
  }
  a.forward_kernel = tpa_cuda::ForwardKernel::Auto;
  const auto [out, lse] = forward(0);
  const Tensor dout = randn(out.shape(), DType::BF16, gpu(), 33);
  for (tpa_cuda::BackwardKernel k : tpa_cuda::backward_kernels(gpu().index)) {
    CAPTURE(int(k));
    a.backward_kernel = k;
    std::vector<std::vector<double>> runs[3];
    for (int per_launch : {0, 1, 2}) {
      a.batch_per_launch = per_launch;
      tpa_cuda::FactorGrads fg;
      Tensor* grads[] = {&fg.aq, &fg.bq, &fg.ak, &fg.bk, &fg.av, &fg.bv};
      for (size_t i = 0; i < 6; ++i) {
        *grads[i] = empty(in.gpu[i].shape(), DType::BF16, gpu());
        poison_(*grads[i]);
      }
      tpa_cuda::attention_backward(a, out, lse, dout, fg);
      for (Tensor* t : grads) {
        CHECK(all_finite(*t));
        runs[per_launch].push_back(t->to(Device::cpu()).to_vector<double>());
      }
    }
    CHECK(runs[1] == runs[0]);
    CHECK(runs[2] == runs[0]);
  }
#endif
}

TEST_CASE("cuda tpa attention fused keeps no q, k, v or scores" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const AttnShape s{2, 512, 512, 4, 6, 2, 2, 64, true};
  const FactorInputs in = attention_inputs(s, DType::BF16, 21);
  const std::vector<Tensor>& g = in.gpu;
  reset_peak_memory(gpu());
  const size_t before = memory_stats(gpu()).in_use;
  const Tensor out = tpa_attention(g[0], g[1], g[2], g[3], g[4], g[5], {}, Impl::Fused);
  const size_t lse = size_t(s.B * s.N * s.H) * 4;
  // Kept: the output and the f32 log-sum-exp. While it runs, K and V (twice the output here, where the
  // whole batch fits one launch); the scores would be 32x the output.
  CHECK(memory_stats(gpu()).in_use - before <= out.nbytes() + lse + 4096);
  CHECK(memory_stats(gpu()).peak - before <= 3 * out.nbytes() + lse + 4096);
}

TEST_CASE("cuda tpa attention fused backward keeps no dq, dk or dv" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const AttnShape s{1, 512, 512, 8, 6, 2, 2, 64, true};
  const FactorInputs in = attention_inputs(s, DType::BF16, 23);
  std::vector<Tensor> leaves;
  size_t grad_bytes = 0;
  for (const Tensor& t : in.gpu) {
    leaves.push_back(t.detach().requires_grad_());
    grad_bytes += t.nbytes();
  }
  const Tensor out = tpa_attention(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], {},
                                   Impl::Fused);
  const Tensor w = randn(out.shape(), DType::BF16, gpu(), 7);
  reset_peak_memory(gpu());
  const size_t before = memory_stats(gpu()).in_use;
  backward(out, w);
  // The six gradients, the f32 workspace (dq summed over key tiles; the k and v basis gradients summed
  // over heads; the turns' counters, within the slack), the bf16 q the backward builds once, Delta and
  // slack of one output; dq, dk and dv in bf16 would add 3x the output (1.5 MiB here) on top.
  const size_t ws = size_t(s.B * (s.N * s.H + s.M * (s.Rk + s.Rv)) * s.D) * 4 + out.nbytes();
  const size_t extra = memory_stats(gpu()).peak - before;
  CHECK(extra <= grad_bytes + ws + size_t(s.B * s.N * s.H) * 4 + out.nbytes());
  for (const Tensor& t : leaves) CHECK(all_finite(t.grad()));
}

TEST_CASE("cuda tpa attention split backward: dk and dv through 16-bit workspaces within their bound" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // Both split forms (the second fed by a TMA producer warp), where the device runs them.
  const std::vector<tpa_cuda::BackwardKernel> ks = tpa_cuda::backward_kernels(gpu().index);
  if (std::find(ks.begin(), ks.end(), tpa_cuda::BackwardKernel::WarpgroupSplit) == ks.end()) return;
  const AttnShape s{2, 320, 320, 4, 6, 2, 2, 128, true};  // the last key tile half full
  const FactorInputs in = attention_inputs(s, DType::BF16, 25);
  tpa_cuda::AttentionArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], true,
                            1.0 / std::sqrt(double(s.D))};
  Tensor out = empty({s.B, s.N, s.H, s.D}, DType::BF16, gpu()), lse = empty({s.B, s.N, s.H}, DType::F32, gpu());
  tpa_cuda::attention_forward(a, out, lse);
  const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), 8).to(DType::BF16).to(DType::F64);
  TpaOptions o;
  o.causal = true;
  const std::vector<Tensor> ref = attention_and_grads(in.cpu, o, Impl::Reference, w);
  const Tensor dout = w.to(DType::BF16).to(gpu());
  using tpa_cuda::BackwardKernel;
  for (BackwardKernel k : {BackwardKernel::WarpgroupSplit, BackwardKernel::WarpgroupTma})
    for (bool old_rows : {false, true}) {  // the wide row kernels, then those of before
      if (std::find(ks.begin(), ks.end(), k) == ks.end()) continue;
      CAPTURE(int(k));
      CAPTURE(old_rows);
      a.backward_kernel = k;
      a.old_rows = old_rows;
      tpa_cuda::FactorGrads fg;
      Tensor* grads[] = {&fg.aq, &fg.bq, &fg.ak, &fg.bk, &fg.av, &fg.bv};
      for (size_t i = 0; i < 6; ++i) *grads[i] = empty(in.gpu[i].shape(), DType::BF16, gpu());
      reset_peak_memory(gpu());
      const size_t before = memory_stats(gpu()).in_use;
      tpa_cuda::attention_backward(a, out, lse, dout, fg);
      // Beside the gradients: dq in f32 (N H D floats a batch entry; here the whole batch in one launch), the bf16
      // q, and either dk and dv in bf16 (2 M H D) or, with the producer warp, the bf16 k and v rows that dk and dv
      // then overwrite; Delta, and the turns' counters within 4 KiB; no basis workspaces.
      const size_t kv_or_dkv = size_t(2 * s.B * s.M * s.H * s.D) * 2;
      const size_t ws = size_t(s.B * s.N * s.H * s.D) * 4 + out.nbytes() + kv_or_dkv;
      CHECK(memory_stats(gpu()).peak - before <= ws + size_t(s.B * s.N * s.H) * 4 + 4096);
      for (size_t i = 0; i < 6; ++i) {
        CAPTURE(kAttentionNames[i + 1]);
        CHECK_CLOSE_TENSOR(grads[i]->to(Device::cpu()), ref[i + 1], DType::BF16);
      }
    }
#endif
}

TEST_CASE("cuda tpa decode of the last token equals the last row of the fused attention" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const AttnShape s{2, 100, 100, 8, 4, 2, 2, 64, true};
  const FactorInputs in = attention_inputs(s, DType::BF16, 33);
  const std::vector<Tensor>& g = in.gpu;
  const Tensor full = tpa_attention(g[0], g[1], g[2], g[3], g[4], g[5], {}, Impl::Fused);
  const Tensor last = tpa_decode(g[0].narrow(1, s.N - 1, 1), g[1].narrow(1, s.N - 1, 1), g[2], g[3], g[4], g[5]);
  const Tensor ref = tpa_decode(in.cpu[0].narrow(1, s.N - 1, 1), in.cpu[1].narrow(1, s.N - 1, 1), in.cpu[2],
                                in.cpu[3], in.cpu[4], in.cpu[5]);
  CHECK_CLOSE_TENSOR(full.narrow(1, s.N - 1, 1).contiguous().to(Device::cpu()), ref, DType::BF16);
  CHECK_CLOSE_TENSOR(last.to(Device::cpu()), ref, DType::BF16);
}

// Decode schedules: the tensor-core kernel's cluster schedule (a cluster of 1: its prologue with the
// last-block combine), the general kernel at the rank extremes.
namespace {

// Several sequences of mixed cache length: the full M, length 1, and spread values in between.
std::vector<int64_t> spread_lengths(const DecodeShape& s) {
  std::vector<int64_t> lengths(size_t(s.B), s.M);
  for (int64_t b = 1; b < s.B; ++b) lengths[size_t(b)] = b == 2 ? 1 : 1 + (b * 7919) % s.M;
  return lengths;
}

}  // namespace

TEST_CASE("cuda tpa decode cluster schedule matches the CPU reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Clusters of up to 1, 2, 8 and 16 blocks, and 0: the last-block schedule (LINTAPE_TPA_DECODE_CLUSTER=0).
  // M = 1, M not a multiple of any tile (the 64-row tiles of H <= 32, the 32-row ones of H = 64), ranks 1
  // and 16 for q, up to 4 for k and v, D 64 and 128, E 64 and 128, a batch past the inline lengths (300);
  // split_rows 0 (the launcher's choice: one cluster a sequence, e.g. B = 5, M = 1000; one of 8 at four tiles a
  // split in place of two of 8 or one of 16, B = 8, M = 2048; one of 16 in place of four of 8, B = 8, M = 4096; or
  // several, e.g. B = 2, M = 4097) and 32 (many splits: several clusters a sequence, combined by the last cluster;
  // with 0, by the last block).
  const DecodeShape shapes[] = {{3, 1, 32, 16, 1, 1, 128, 128},    {5, 1000, 32, 1, 1, 1, 128, 128},
                                {4, 777, 16, 16, 4, 4, 64, 64},    {2, 4097, 64, 16, 1, 1, 128, 128},
                                {8, 2048, 32, 16, 1, 1, 128, 128}, {8, 4096, 32, 16, 1, 1, 128, 128},
                                {300, 40, 8, 2, 1, 1, 64, 64},     {3, 301, 12, 6, 2, 2, 64, 128}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::BF16, DType::F16})
      for (int cluster : {0, 1, 2, 8, 16})
        for (int64_t split_rows : {int64_t(0), int64_t(32)}) {
          CAPTURE(s.B);
          CAPTURE(s.M);
          CAPTURE(s.H);
          CAPTURE(dtype_name(dt));
          CAPTURE(cluster);
          CAPTURE(split_rows);
          check_decode(s, dt, spread_lengths(s), split_rows, true, uint64_t(s.M + 3 * s.B), cluster);
        }
}

TEST_CASE("cuda tpa decode general kernel at ranks 1 and 16" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const DecodeShape shapes[] = {{3, 129, 4, 1, 1, 1, 64, 64}, {2, 77, 2, 16, 16, 16, 128, 128},
                                {4, 1, 3, 16, 16, 16, 64, 128}};
  for (const DecodeShape& s : shapes)
    for (DType dt : {DType::F32, DType::BF16, DType::F16})
      for (int64_t split_rows : {int64_t(0), int64_t(16)}) {
        CAPTURE(s.M);
        CAPTURE(s.Rk);
        CAPTURE(dtype_name(dt));
        CAPTURE(split_rows);
        check_decode(s, dt, spread_lengths(s), split_rows, false, uint64_t(s.M + s.Rk));
      }
}

TEST_CASE("cuda tpa decode cluster schedule: seeds' shape, repeated calls, a TpaCache in place" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  // B = 2 at M = 8192 takes several clusters a sequence (the last cluster combines them, then resets the
  // counter), or with 0 one partial a split (the last block combines them): the error vs f64 within 5e-3 and the
  // same bits on a second call.
  for (int cluster : {0, 4, 8}) {
    CAPTURE(cluster);
    const DecodeShape s{2, 8192, 32, 16, 1, 1, 128, 128};
    const FactorInputs in = decode_inputs(s, DType::BF16, 17, gpu());
    const std::vector<int64_t> lengths{8192, 5000};
    tpa_cuda::DecodeArgs a{in.gpu[0], in.gpu[1], in.gpu[2], in.gpu[3], in.gpu[4], in.gpu[5], lengths};
    a.scale = 1.0 / std::sqrt(double(s.D));
    a.cluster = cluster;
    Tensor out = empty({s.B, 1, s.H, s.E}, DType::BF16, gpu());
    poison_(out);
    tpa_cuda::decode(a, out);
    CHECK(rel_error(out.to(Device::cpu()), cpu_decode(in, lengths)) <= 5e-3);
    Tensor again = empty({s.B, 1, s.H, s.E}, DType::BF16, gpu());
    poison_(again);
    tpa_cuda::decode(a, again);
    CHECK(rel_error(again.to(Device::cpu()), out.to(Device::cpu())) == 0.0);
  }
  // The cache's buffers narrowed to the used rows: batch strides of the whole capacity.
  const DecodeShape s{4, 300, 32, 16, 1, 1, 128, 128};
  const FactorInputs in = decode_inputs(s, DType::BF16, 5, gpu());
  TpaCache cache(s.B, s.H, s.Rk, s.Rv, s.D, s.E, DType::BF16, gpu(), Tensor(), 64);
  for (int64_t t = 0; t < s.M; ++t)
    cache.append(in.gpu[2].narrow(1, t, 1), in.gpu[3].narrow(1, t, 1), in.gpu[4].narrow(1, t, 1),
                 in.gpu[5].narrow(1, t, 1), {true, t < 200, t < 1, true});
  const std::vector<int64_t> lengths{300, 200, 1, 300};
  REQUIRE(cache.lengths() == lengths);
  const int64_t M = cache.max_length();
  tpa_cuda::DecodeArgs a{in.gpu[0],
                         in.gpu[1],
                         cache.ak().narrow(1, 0, M),
                         cache.bk().narrow(1, 0, M),
                         cache.av().narrow(1, 0, M),
                         cache.bv().narrow(1, 0, M),
                         lengths};
  REQUIRE(a.ak.strides()[0] != a.ak.size(1) * a.ak.size(2) * a.ak.size(3));  // not contiguous: in place
  a.scale = 1.0 / std::sqrt(double(s.D));
  for (int cluster : {2, 8})
    for (int64_t split_rows : {int64_t(0), int64_t(64)}) {
      CAPTURE(cluster);
      CAPTURE(split_rows);
      a.cluster = cluster;
      a.split_rows = split_rows;
      Tensor out = empty({s.B, 1, s.H, s.E}, DType::BF16, gpu());
      poison_(out);
      tpa_cuda::decode(a, out);
      CHECK_CLOSE_TENSOR(out.to(Device::cpu()), cpu_decode(in, lengths), DType::BF16);
    }
#endif
}
