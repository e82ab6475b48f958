// tpa_attention with documents (packed rows, ops/documents.h): a packed row gives each document what it gets
// on its own (output and the six factor gradients; reference, composed and the fused kernels, causal and
// not), gradient checks across boundaries, the launchers on poisoned outputs, the backward's bits run to run,
// and the errors.
#include <cmath>
#include <vector>
#include "helpers.h"
#include "tpa_helpers.h"
#include "ops/tpa/launch.h"
#include "ops/tpa/tpa.h"

using namespace lintape;
using namespace lintape::test;

namespace {

struct Shape6 {
  int64_t B, N, H, Rq, Rk, Rv, D;
};

// The six factors (aq, bq, ak, bk, av, bv; N == M, E == D) in dt on dev.
std::vector<Tensor> factors(const Shape6& s, DType dt, Device dev, uint64_t seed) {
  const Shape shapes[] = {{s.B, s.N, s.H, s.Rq}, {s.B, s.N, s.Rq, s.D}, {s.B, s.N, s.H, s.Rk},
                          {s.B, s.N, s.Rk, s.D}, {s.B, s.N, s.H, s.Rv}, {s.B, s.N, s.Rv, s.D}};
  std::vector<Tensor> f;
  for (int i = 0; i < 6; ++i) f.push_back(randn(shapes[i], dt, dev, seed * 8 + uint64_t(i)));
  return f;
}

std::vector<Tensor> to_cpu_f64(const std::vector<Tensor>& f) {
  std::vector<Tensor> r;
  for (const Tensor& t : f) r.push_back(t.to(Device::cpu()).to(DType::F64));
  return r;
}

// impl on the packed factors cut by cu_seqlens, against `alone` (an impl, on f64 CPU copies when
// `alone_on_f64`) on each document by itself: every document's slice of the output and of each gradient.
void check_packed(const std::vector<Tensor>& f, const std::vector<int64_t>& cu, bool causal, Impl impl,
                  Impl alone, bool alone_on_f64, uint64_t seed) {
  const int64_t B = f[0].size(0), N = f[0].size(1), H = f[0].size(2), D = f[5].size(3);
  const DType dt = f[0].dtype();
  TpaOptions o;
  o.causal = causal;
  o.documents = Documents::from_cu_seqlens(cu, B, N, f[0].device());
  const Tensor w = randn({B, N, H, D}, DType::F64, Device::cpu(), seed).to(dt).to(DType::F64);
  const std::vector<Tensor> packed = attention_and_grads(f, o, impl, w);
  const std::vector<Tensor> base = alone_on_f64 ? to_cpu_f64(f) : f;
  TpaOptions plain;
  plain.causal = causal;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t b = cu[i] / N, s0 = cu[i] % N, len = cu[i + 1] - cu[i];
    CAPTURE(b);
    CAPTURE(s0);
    CAPTURE(len);
    auto part = [&](const Tensor& t) { return t.narrow(0, b, 1).narrow(1, s0, len).contiguous(); };
    std::vector<Tensor> doc;
    for (const Tensor& t : base) doc.push_back(part(t));
    const std::vector<Tensor> single = attention_and_grads(doc, plain, alone, part(w));
    for (size_t k = 0; k < 7; ++k) {
      CAPTURE(kAttentionNames[k]);
      CHECK_CLOSE_TENSOR(part(packed[k]), single[k], dt);
    }
  }
}

// Cuts of rows of 9 (CPU): [3 | 1 | 5] and one document.
const std::vector<int64_t> kShortCuts = {0, 3, 4, 9, 18};

// Rows of 300 for the kernels' tiles (64 and 128 keys, 256 queries): [1 | 63 | 66 | 130 | 40] (a one-token
// document, cuts at 64, across 128 and 256), one document, [128 | 172], [200 | 1 | 99].
std::vector<int64_t> long_cuts(int64_t B) {
  const std::vector<std::vector<int64_t>> rows = {{1, 63, 66, 130, 40}, {300}, {128, 172}, {200, 1, 99}};
  std::vector<int64_t> cu{0};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t len : rows[size_t(b % 4)]) cu.push_back(cu.back() + len);
  return cu;
}

}  // namespace

TEST_CASE("tpa documents: packed equals each document alone, reference and composed") {
  const Shape6 shapes[] = {{2, 9, 2, 3, 2, 2, 4}, {2, 9, 3, 1, 1, 1, 6}};
  uint64_t seed = 1;
  for (const Shape6& s : shapes)
    for (bool causal : {true, false})
      for (Impl impl : {Impl::Reference, Impl::Composed}) {
        CAPTURE(s.Rq);
        CAPTURE(causal);
        CAPTURE(impl == Impl::Reference);
        check_packed(factors(s, DType::F64, Device::cpu(), seed), kShortCuts, causal, impl, Impl::Reference, true,
                     seed + 1);
        seed += 2;
      }
}

TEST_CASE("tpa documents: one document a row is attention without documents") {
  const std::vector<Tensor> f = factors({2, 9, 2, 3, 2, 2, 4}, DType::F64, Device::cpu(), 5);
  const Tensor w = randn({2, 9, 2, 4}, DType::F64, Device::cpu(), 6);
  for (bool causal : {true, false}) {
    TpaOptions with, without;
    with.causal = without.causal = causal;
    with.documents = Documents::from_cu_seqlens({0, 9, 18}, 2, 9);
    const std::vector<Tensor> a = attention_and_grads(f, with, Impl::Reference, w);
    const std::vector<Tensor> b = attention_and_grads(f, without, Impl::Reference, w);
    for (size_t k = 0; k < 7; ++k) CHECK(a[k].to_vector<double>() == b[k].to_vector<double>());
  }
}

TEST_CASE("gradcheck tpa_attention with documents") {
  const Shape6 s{2, 9, 2, 3, 2, 2, 4};
  for (bool causal : {true, false})
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      CAPTURE(causal);
      CAPTURE(impl == Impl::Reference);
      TpaOptions o;
      o.causal = causal;
      o.scale = 0.7;
      o.documents = Documents::from_cu_seqlens(kShortCuts, 2, 9);
      std::vector<Tensor> in = factors(s, DType::F64, Device::cpu(), 11);
      for (Tensor& t : in) t.requires_grad_();
      auto fn = [o, impl](const std::vector<Tensor>& x) {
        return tpa_attention(x[0], x[1], x[2], x[3], x[4], x[5], o, impl);
      };
      CHECK_GRADCHECK(fn, in);
    }
}

TEST_CASE("bad input tpa documents") {
  const std::vector<Tensor> f = factors({2, 9, 2, 3, 2, 2, 4}, DType::F32, Device::cpu(), 1);
  TpaOptions o;
  o.documents = Documents::from_cu_seqlens({0, 4, 8}, 2, 4);
  check_throws_containing([&] { tpa_attention(f[0], f[1], f[2], f[3], f[4], f[5], o); },
                          {"[tpa_attention]", "documents are for (2, 4) tokens", "(2, 9)"});
  // Fewer queries than keys.
  o.causal = false;
  o.documents = Documents::from_cu_seqlens({0, 2, 5, 10}, 2, 5);
  const std::vector<Tensor> q = factors({2, 5, 2, 3, 2, 2, 4}, DType::F32, Device::cpu(), 2);
  check_throws_containing([&] { tpa_attention(q[0], q[1], f[2], f[3], f[4], f[5], o); },
                          {"[tpa_attention]", "documents need N == M", "N = 5", "M = 9"});
}

TEST_CASE("bad input tpa documents on another device" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const std::vector<Tensor> f = factors({2, 9, 2, 3, 2, 2, 64}, DType::BF16, gpu(), 1);
  TpaOptions o;
  o.documents = Documents::from_cu_seqlens(kShortCuts, 2, 9);  // on the CPU
  check_throws_containing([&] { tpa_attention(f[0], f[1], f[2], f[3], f[4], f[5], o); },
                          {"[tpa_attention]", "documents are on cpu", "cuda:0"});
}

// ---------------------------------------------------------------------------------------------------
// CUDA: the composed path in f32 and the fused kernels with documents.

TEST_CASE("cuda tpa documents: composed f32 packed equals each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    check_packed(factors({2, 300, 2, 3, 2, 2, 64}, DType::F32, gpu(), 3), long_cuts(2), causal, Impl::Composed,
                 Impl::Reference, true, 4);
  }
}

TEST_CASE("cuda tpa documents: fused packed equals each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Against the f64 reference on each document, and against the fused kernels on each document.
  const Shape6 shapes[] = {{4, 300, 2, 6, 2, 2, 64}, {2, 300, 3, 1, 1, 1, 128}};
  uint64_t seed = 20;
  for (const Shape6& s : shapes)
    for (bool causal : {true, false})
      for (DType dt : {DType::BF16, DType::F16}) {
        CAPTURE(s.D);
        CAPTURE(causal);
        CAPTURE(dtype_name(dt));
        const std::vector<Tensor> f = factors(s, dt, gpu(), seed);
        check_packed(f, long_cuts(s.B), causal, Impl::Fused, Impl::Reference, true, seed + 1);
        check_packed(f, long_cuts(s.B), causal, Impl::Fused, Impl::Fused, false, seed + 2);
        seed += 3;
      }
}

TEST_CASE("cuda tpa documents: fused launchers write every element" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  const Shape6 shapes[] = {{4, 300, 2, 6, 2, 2, 128}, {4, 300, 3, 16, 4, 2, 64}};
  uint64_t seed = 40;
  for (const Shape6& s : shapes)
    for (bool causal : {true, false}) {
      CAPTURE(s.D);
      CAPTURE(causal);
      const DType dt = DType::BF16;
      const std::vector<Tensor> f = factors(s, dt, gpu(), seed++);
      TpaOptions o;
      o.causal = causal;
      o.documents = Documents::from_cu_seqlens(long_cuts(s.B), s.B, s.N, gpu());
      const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), seed++).to(dt).to(DType::F64);
      const std::vector<Tensor> ref = attention_and_grads(to_cpu_f64(f), [&] {
        TpaOptions r = o;
        r.documents = o.documents.to(Device::cpu());
        return r;
      }(), Impl::Reference, w);
      tpa_cuda::AttentionArgs a{f[0], f[1], f[2], f[3], f[4], f[5], causal, 1.0 / std::sqrt(double(s.D))};
      a.starts = o.documents.starts();
      check_attention_launchers(a, dt, w, ref);  // the warpgroup kernel takes no documents: mma.sync runs
    }
#endif
}

TEST_CASE("cuda tpa documents: fused backward gives the same bits run to run" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Key tiles that skip query tiles (their turns counted from the document's first key tile), several heads.
  const Shape6 s{4, 600, 6, 6, 2, 2, 128};
  const std::vector<std::vector<int64_t>> rows = {{130, 270, 200}, {600}, {1, 299, 300}, {64, 64, 472}};
  std::vector<int64_t> cu{0};
  for (const std::vector<int64_t>& row : rows)
    for (int64_t len : row) cu.push_back(cu.back() + len);
  const std::vector<Tensor> f = factors(s, DType::BF16, gpu(), 60);
  const Tensor w = randn({s.B, s.N, s.H, s.D}, DType::F64, Device::cpu(), 61).to(DType::BF16).to(DType::F64);
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    TpaOptions o;
    o.causal = causal;
    o.documents = Documents::from_cu_seqlens(cu, s.B, s.N, gpu());
    const std::vector<Tensor> first = attention_and_grads(f, o, Impl::Fused, w);
    for (int run = 0; run < 3; ++run) {
      const std::vector<Tensor> again = attention_and_grads(f, o, Impl::Fused, w);
      for (size_t k = 0; k < 7; ++k) {
        CAPTURE(kAttentionNames[k]);
        CHECK(again[k].to_vector<double>() == first[k].to_vector<double>());
      }
    }
  }
}
