// TPA family: decode vs the naive formula, decode vs attention, the cache vs whole factors, gradient
// checks of the reference and the composed path, the CUDA paths vs the CPU reference, and input errors.
#include <cmath>
#include <string>
#include <vector>
#include "core/allocator.h"
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/lrpe/lrpe.h"
#include "ops/reduce.h"
#include "ops/shape.h"
#include "ops/tpa/tpa.h"

using namespace lintape;
using namespace lintape::test;

namespace {

struct Dims {
  int64_t B, N, M, H, Rq, Rk, Rv, D, E;
};

// The six factors, f64 CPU; a rank of 1 for k or v drops its rank axis when `rankless` is set.
struct Six {
  Tensor aq, bq, ak, bk, av, bv;
  std::vector<Tensor> list() const { return {aq, bq, ak, bk, av, bv}; }
};

Six make_factors(const Dims& d, uint64_t seed, bool rankless = false, DType dt = DType::F64) {
  auto r = [&](const Shape& s, uint64_t k) { return randn(s, dt, Device::cpu(), seed * 16 + k); };
  Six f{r({d.B, d.N, d.H, d.Rq}, 1), r({d.B, d.N, d.Rq, d.D}, 2), r({d.B, d.M, d.H, d.Rk}, 3),
        r({d.B, d.M, d.Rk, d.D}, 4),  r({d.B, d.M, d.H, d.Rv}, 5),  r({d.B, d.M, d.Rv, d.E}, 6)};
  if (rankless && d.Rk == 1) {
    f.ak = f.ak.reshape({d.B, d.M, d.H});
    f.bk = f.bk.reshape({d.B, d.M, d.D});
  }
  if (rankless && d.Rv == 1) {
    f.av = f.av.reshape({d.B, d.M, d.H});
    f.bv = f.bv.reshape({d.B, d.M, d.E});
  }
  return f;
}

// The formula written out for one query token per sequence: aq (B, 1, H, Rq), out (B, 1, H, E).
Tensor naive_decode(const Dims& d, const Six& f, const std::vector<int64_t>& lengths) {
  const Tensor ak = f.ak.reshape({d.B, d.M, d.H, d.Rk}), bk = f.bk.reshape({d.B, d.M, d.Rk, d.D});
  const Tensor av = f.av.reshape({d.B, d.M, d.H, d.Rv}), bv = f.bv.reshape({d.B, d.M, d.Rv, d.E});
  auto A = [](const Tensor& t) { return t.to_vector<double>(); };
  const std::vector<double> aq = A(f.aq), bq = A(f.bq), akv = A(ak), bkv = A(bk), avv = A(av), bvv = A(bv);
  std::vector<double> out(size_t(d.B * d.H * d.E), 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      std::vector<double> s;
      for (int64_t m = 0; m < lengths[size_t(b)]; ++m) {
        double dot = 0;
        for (int64_t x = 0; x < d.D; ++x) {
          double q = 0, k = 0;
          for (int64_t r = 0; r < d.Rq; ++r) q += aq[size_t((b * d.H + h) * d.Rq + r)] * bq[size_t((b * d.Rq + r) * d.D + x)];
          for (int64_t r = 0; r < d.Rk; ++r)
            k += akv[size_t(((b * d.M + m) * d.H + h) * d.Rk + r)] * bkv[size_t(((b * d.M + m) * d.Rk + r) * d.D + x)];
          dot += q / double(d.Rq) * k / double(d.Rk);
        }
        s.push_back(dot / std::sqrt(double(d.D)));
      }
      double mx = -INFINITY, sum = 0;
      for (double v : s) mx = std::max(mx, v);
      for (double v : s) sum += std::exp(v - mx);
      for (int64_t m = 0; m < lengths[size_t(b)]; ++m)
        for (int64_t e = 0; e < d.E; ++e) {
          double v = 0;
          for (int64_t r = 0; r < d.Rv; ++r)
            v += avv[size_t(((b * d.M + m) * d.H + h) * d.Rv + r)] * bvv[size_t(((b * d.M + m) * d.Rv + r) * d.E + e)];
          out[size_t((b * d.H + h) * d.E + e)] += std::exp(s[size_t(m)] - mx) / sum * v / double(d.Rv);
        }
    }
  return from_vector(out, {d.B, 1, d.H, d.E}, DType::F64);
}

std::vector<Tensor> attention_grads(const Six& f, const TpaOptions& o, Impl impl) {
  Six g = f;
  for (Tensor* t : {&g.aq, &g.bq, &g.ak, &g.bk, &g.av, &g.bv}) *t = t->detach().requires_grad_();
  Tensor out = tpa_attention(g.aq, g.bq, g.ak, g.bk, g.av, g.bv, o, impl);
  Tensor w = randn(out.shape(), out.dtype(), out.device(), 99);
  backward(out, w);
  std::vector<Tensor> grads{out.detach()};
  for (const Tensor& t : g.list()) grads.push_back(t.grad());
  return grads;
}

}  // namespace

TEST_CASE("tpa decode matches the naive formula") {
  struct Case {
    Dims d;
    std::vector<int64_t> lengths;
  };
  const std::vector<Case> cases = {
      {{2, 1, 37, 3, 2, 1, 1, 8, 8}, {}},           // M not a multiple of any block, rank-less k and v
      {{1, 1, 1, 2, 3, 2, 2, 4, 6}, {}},            // a one-row cache
      {{3, 1, 50, 2, 4, 3, 2, 8, 5}, {50, 1, 23}},  // mixed cache lengths, general ranks
      {{2, 1, 70, 4, 16, 1, 1, 16, 16}, {64, 70}},  // the seeds' ranks
  };
  for (const Case& c : cases) {
    const Dims& d = c.d;
    CAPTURE(d.M);
    CAPTURE(d.Rq);
    const Six f = make_factors(d, uint64_t(d.M), true);
    const std::vector<int64_t> lengths = c.lengths.empty() ? std::vector<int64_t>(size_t(d.B), d.M) : c.lengths;
    const Tensor ref = naive_decode(d, f, lengths);
    TpaOptions o;
    o.cache_lengths = c.lengths;
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      const Tensor out = tpa_decode(f.aq, f.bq, f.ak, f.bk, f.av, f.bv, o, impl);
      CHECK_CLOSE_TENSOR(out, ref, DType::F64);
    }
    // Without the token axis the output has none either.
    const Tensor out3 = tpa_decode(f.aq.reshape({d.B, d.H, d.Rq}), f.bq.reshape({d.B, d.Rq, d.D}), f.ak, f.bk, f.av,
                                   f.bv, o);
    CHECK(out3.shape() == Shape{d.B, d.H, d.E});
    CHECK_CLOSE_TENSOR(out3.reshape({d.B, 1, d.H, d.E}), ref, DType::F64);
  }
}

TEST_CASE("tpa decode of the last token equals the last row of tpa_attention") {
  const Dims d{2, 9, 9, 3, 6, 2, 2, 8, 4};
  const Six f = make_factors(d, 7);
  const Tensor full = tpa_attention(f.aq, f.bq, f.ak, f.bk, f.av, f.bv);  // causal
  const Tensor last = tpa_decode(f.aq.narrow(1, d.N - 1, 1), f.bq.narrow(1, d.N - 1, 1), f.ak, f.bk, f.av, f.bv);
  CHECK_CLOSE_TENSOR(last, full.narrow(1, d.N - 1, 1), DType::F64);
  // A shorter cache length is the causal row of that token.
  TpaOptions o;
  o.cache_lengths = {4, 6};
  const Tensor row = tpa_decode(f.aq.narrow(1, 3, 1), f.bq.narrow(1, 3, 1), f.ak, f.bk, f.av, f.bv, o);
  CHECK_CLOSE_TENSOR(row.narrow(0, 0, 1), full.narrow(0, 0, 1).narrow(1, 3, 1), DType::F64);
}

TEST_CASE("tpa cache append + decode equals decode over whole factors") {
  const Dims d{3, 1, 21, 2, 3, 2, 1, 8, 6};
  const Six f = make_factors(d, 11);
  const Tensor theta = lrpe_theta(1, d.D / 2, 10000.0);
  TpaCache cache(d.B, d.H, d.Rk, d.Rv, d.D, d.E, DType::F64, Device::cpu(), theta, 8);
  // Sequence 2 skips every third step, so lengths differ.
  std::vector<int64_t> rows_of_2;
  for (int64_t t = 0; t < d.M; ++t) {
    const bool take2 = t % 3 != 0;
    if (take2) rows_of_2.push_back(t);
    cache.append(f.ak.narrow(1, t, 1), f.bk.narrow(1, t, 1), f.av.narrow(1, t, 1).reshape({d.B, d.H}),
                 f.bv.narrow(1, t, 1), {true, true, take2});
  }
  REQUIRE(cache.lengths() == std::vector<int64_t>{d.M, d.M, int64_t(rows_of_2.size())});
  CHECK(cache.capacity() % 8 == 0);
  CHECK(cache.capacity() >= d.M);
  CHECK(cache.bytes() == d.B * cache.capacity() * (d.H * d.Rk + d.Rk * d.D + d.H * d.Rv + d.Rv * d.E) * 8);
  const Tensor out = tpa_decode(f.aq, f.bq, cache);

  // The same decode over whole factors, bk rotated at each row's position.
  for (int64_t b = 0; b < d.B; ++b) {
    CAPTURE(b);
    std::vector<Tensor> sel[4];
    const Tensor* src[] = {&f.ak, &f.bk, &f.av, &f.bv};
    for (int64_t i = 0; i < (b == 2 ? int64_t(rows_of_2.size()) : d.M); ++i) {
      const int64_t t = b == 2 ? rows_of_2[size_t(i)] : i;
      for (int k = 0; k < 4; ++k) sel[k].push_back(src[k]->narrow(0, b, 1).narrow(1, t, 1));
    }
    auto whole = [&](int k) { return cat(sel[k], 1); };
    const Tensor bk_rot = lrpe_rotate(whole(1), theta);
    const Tensor ref = tpa_decode(f.aq.narrow(0, b, 1), f.bq.narrow(0, b, 1), whole(0), bk_rot, whole(2), whole(3));
    CHECK_CLOSE_TENSOR(out.narrow(0, b, 1), ref, DType::F64);
  }
  cache.clear();
  CHECK(cache.max_length() == 0);
  check_throws_containing([&] { tpa_decode(f.aq, f.bq, cache); }, {"[tpa_decode]", "empty"});
}

TEST_CASE("gradcheck tpa_attention reference") {
  struct Case {
    const char* name;
    Dims d;
    bool causal;
    bool rankless;
  };
  const Case cases[] = {{"causal ranks (1, 1, 1)", {1, 5, 5, 2, 1, 1, 1, 4, 3}, true, true},
                        {"causal ranks (6, 2, 2)", {2, 4, 4, 2, 6, 2, 2, 4, 3}, true, false},
                        {"non-causal ranks (1, 1, 1)", {1, 3, 5, 2, 1, 1, 1, 4, 3}, false, false},
                        {"non-causal ranks (6, 2, 2)", {1, 4, 3, 2, 6, 2, 2, 4, 3}, false, false}};
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const Six f = make_factors(c.d, 3, c.rankless);
    TpaOptions o;
    o.causal = c.causal;
    o.scale = 0.7;
    std::vector<Tensor> in = f.list();
    for (Tensor& t : in) t.requires_grad_();
    for (Impl impl : {Impl::Reference, Impl::Composed}) {
      auto fn = [o, impl](const std::vector<Tensor>& x) {
        return tpa_attention(x[0], x[1], x[2], x[3], x[4], x[5], o, impl);
      };
      CHECK_GRADCHECK(fn, in);
    }
  }
}

TEST_CASE("tpa_factors reads the projection's layout and passes gradients back to it") {
  // W = (3 + 2) 4 + 2 4 + 2 (3 + 2 + 2) + 1 padding column; theta (1, 2).
  const int64_t B = 2, N = 5, H = 2, D = 4, W = 5 * D + 2 * D + H * 7 + 1;
  const Tensor y = randn({B, N, W}, DType::F64, Device::cpu(), 3).requires_grad_();
  const Tensor theta = lrpe_theta(1, D / 2);
  const auto f = tpa_factors(y, H, 3, 2, 2, D, D, theta, 7);
  const Tensor yd = y.detach();
  auto values = [](const Tensor& t) { return t.contiguous().to_vector<double>(); };
  auto same = [&](const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && values(a) == values(b); };
  LrpeOptions at;
  at.offset = 7;
  const Tensor a = yd.narrow(2, 7 * D, H * 7).reshape({B, N, H, 7});
  CHECK(same(f[0], a.narrow(3, 0, 3)));
  CHECK(same(f[1], lrpe_rotate(yd.narrow(2, 0, 3 * D).reshape({B, N, 3, D}), theta, at)));
  CHECK(same(f[2], a.narrow(3, 3, 2)));
  CHECK(same(f[3], lrpe_rotate(yd.narrow(2, 3 * D, 2 * D).reshape({B, N, 2, D}), theta, at)));
  CHECK(same(f[4], a.narrow(3, 5, 2)));
  CHECK(same(f[5], yd.narrow(2, 5 * D, 2 * D).reshape({B, N, 2, D})));
  // Every factor's gradient lands in its own columns; the padding's is zero.
  backward(sum(f[0]) + sum(f[1]) + sum(f[2]) + sum(f[3]) + sum(f[4]) + sum(f[5]));
  const Tensor g = y.grad();
  CHECK(same(g.narrow(2, 5 * D, 2 * D + H * 7), ones({B, N, 2 * D + H * 7}, DType::F64)));
  CHECK(same(g.narrow(2, W - 1, 1), zeros({B, N, 1}, DType::F64)));
  CHECK(!same(g.narrow(2, 0, 5 * D), zeros({B, N, 5 * D}, DType::F64)));
  auto fn = [&](const std::vector<Tensor>& in) {
    const auto h = tpa_factors(in[0], H, 3, 2, 2, D, D, theta, 7);
    return sum(h[1] * h[1]) + sum(h[3] * sum(h[0].narrow(3, 0, 2), {3}, true)) + sum(h[5] * h[5]);
  };
  CHECK_GRADCHECK(fn, std::vector<Tensor>{randn({1, 3, W}, DType::F64, Device::cpu(), 4).requires_grad_()});

  check_throws_containing([&] { tpa_factors(y.detach().narrow(2, 0, W - 2), H, 3, 2, 2, D, D, theta); },
                          {"[tpa_factors]", "hold 41 values", "= 42"});
  check_throws_containing([&] { tpa_factors(y.detach(), H, 3, 2, 2, D, D, lrpe_theta(2, D / 2)); },
                          {"[tpa_factors]", "theta must be (1, head_dim / 2)"});
  check_throws_containing([&] { tpa_factors(y.detach(), H, 0, 2, 2, D, D, theta); }, {"[tpa_factors]", "positive"});
  check_throws_containing([&] { tpa_factors(y.detach().reshape({B * N, W}), H, 3, 2, 2, D, D, theta); },
                          {"[tpa_factors]", "(B, N, W)"});
  check_throws_containing([&] { tpa_factors(y.detach(), H, 3, 2, 2, D, D, theta, 0, {}, Impl::Fused); },
                          {"[tpa_factors]", "Impl::Fused"});
}

TEST_CASE("bad input tpa") {
  const Dims d{2, 4, 4, 3, 2, 2, 2, 8, 8};
  const Six f = make_factors(d, 1);
  auto attn = [](const Six& s, TpaOptions o = {}) { return tpa_attention(s.aq, s.bq, s.ak, s.bk, s.av, s.bv, o); };
  auto dec = [](const Six& s, TpaOptions o = {}) {
    return tpa_decode(s.aq.narrow(1, 0, 1), s.bq.narrow(1, 0, 1), s.ak, s.bk, s.av, s.bv, o);
  };
  Six bad = f;
  bad.aq = randn({2, 4, 3, 3}, DType::F64);
  check_throws_containing([&] { attn(bad); }, {"[tpa_attention]", "rank mismatch", "aq", "bq", "has rank 3"});
  bad = f;
  bad.bk = randn({2, 4, 1, 8}, DType::F64);
  check_throws_containing([&] { dec(bad); }, {"[tpa_decode]", "rank mismatch", "ak", "bk"});
  bad = f;
  bad.bv = randn({2, 4, 3, 8}, DType::F64);
  check_throws_containing([&] { attn(bad); }, {"rank mismatch", "av", "bv"});
  bad = f;
  bad.bk = randn({2, 4, 2, 6}, DType::F64);
  check_throws_containing([&] { attn(bad); }, {"[tpa_attention]", "head dim mismatch", "D = 8", "D = 6"});
  bad = f;
  bad.av = randn({3, 4, 3, 2}, DType::F64);
  check_throws_containing([&] { attn(bad); }, {"batch mismatch", "av", "B = 3"});
  bad = f;
  bad.ak = randn({2, 4, 2, 2}, DType::F64);
  check_throws_containing([&] { dec(bad); }, {"head count mismatch"});
  bad = f;
  bad.bq = f.bq.to(DType::F32);
  check_throws_containing([&] { attn(bad); }, {"[tpa_attention]", "dtype", "f32"});
  bad = f;
  bad.aq = zeros({2, 4, 3, 2}, DType::I64);
  check_throws_containing([&] { attn(bad); }, {"float tensors"});
  if (cuda_available()) {
    bad = f;
    bad.av = f.av.to(Device::cuda(0));
    check_throws_containing([&] { attn(bad); }, {"[tpa_attention]", "device", "av"});
  }
  bad = f;
  bad.ak = randn({2, 5, 3, 2}, DType::F64);
  bad.bk = randn({2, 5, 2, 8}, DType::F64);
  bad.av = randn({2, 5, 3, 2}, DType::F64);
  bad.bv = randn({2, 5, 2, 8}, DType::F64);
  check_throws_containing([&] { attn(bad); }, {"[tpa_attention]", "causal", "N = 4", "M = 5"});
  TpaOptions o;
  o.causal = false;
  CHECK(attn(bad, o).shape() == Shape{2, 4, 3, 8});
  o.cache_lengths = {4, 5};
  check_throws_containing([&] { dec(f, o); }, {"[tpa_decode]", "cache_lengths[1]", "1..M = 4", "got 5"});
  o.cache_lengths = {0, 2};
  check_throws_containing([&] { dec(f, o); }, {"cache_lengths[0]", "got 0"});
  o.cache_lengths = {2};
  check_throws_containing([&] { dec(f, o); }, {"B = 2 entries"});
  check_throws_containing([&] { tpa_decode(f.aq, f.bq, f.ak, f.bk, f.av, f.bv); }, {"[tpa_decode]", "aq must be"});
  check_throws_containing([&] { tpa_attention(f.aq, f.bq, f.ak, f.bk, f.av, f.bv, {}, Impl::Fused); },
                          {"[tpa_attention]", "Impl::Fused"});

  TpaCache cache(2, 3, 2, 2, 8, 8, DType::F32, Device::cpu());
  check_throws_containing([&] { cache.append(f.ak, f.bk, f.av, f.bv); }, {"[TpaCache]", "ak must be (B, 3, 2)"});
  check_throws_containing([&] { TpaCache(2, 3, 2, 2, 8, 8, DType::F32, Device::cpu(), lrpe_theta(3, 4)); },
                          {"[TpaCache]", "theta must be (1, E)"});
  check_throws_containing([&] { TpaCache(0, 3, 2, 2, 8, 8, DType::F32, Device::cpu()); }, {"[TpaCache]", ">= 1"});
}

TEST_CASE("cuda tpa composed paths match the CPU reference" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  const Dims d{2, 33, 33, 4, 6, 2, 2, 64, 64};  // odd N
  const Six f = make_factors(d, 21);
  for (DType dt : {DType::F32, DType::BF16}) {
    CAPTURE(dtype_name(dt));
    Six g;
    Tensor* dst[] = {&g.aq, &g.bq, &g.ak, &g.bk, &g.av, &g.bv};
    const std::vector<Tensor> src = f.list();
    for (size_t i = 0; i < 6; ++i) *dst[i] = src[i].to(dt).to(gpu());
    // The reference sees the same rounded inputs.
    Six r;
    Tensor* rdst[] = {&r.aq, &r.bq, &r.ak, &r.bk, &r.av, &r.bv};
    for (size_t i = 0; i < 6; ++i) *rdst[i] = dst[i]->to(Device::cpu()).to(DType::F64);
    const std::vector<Tensor> ref = attention_grads(r, {}, Impl::Reference);
    const std::vector<Tensor> got = attention_grads(g, {}, Impl::Composed);
    for (size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].is_cuda());
      CHECK_CLOSE_TENSOR(got[i].to(Device::cpu()), ref[i], dt);
    }
    TpaOptions o;
    o.cache_lengths = {33, 17};
    const Tensor dec = tpa_decode(g.aq.narrow(1, 0, 1), g.bq.narrow(1, 0, 1), g.ak, g.bk, g.av, g.bv, o);
    const Tensor dref = tpa_decode(r.aq.narrow(1, 0, 1), r.bq.narrow(1, 0, 1), r.ak, r.bk, r.av, r.bv, o);
    CHECK_CLOSE_TENSOR(dec.to(Device::cpu()), dref, dt);

    TpaCache cache(d.B, d.H, d.Rk, d.Rv, d.D, d.E, dt, gpu(), Tensor(), 16);
    for (int64_t t = 0; t < d.M; ++t)
      cache.append(g.ak.narrow(1, t, 1), g.bk.narrow(1, t, 1), g.av.narrow(1, t, 1), g.bv.narrow(1, t, 1));
    const Tensor cdec = tpa_decode(g.aq.narrow(1, 0, 1), g.bq.narrow(1, 0, 1), cache);
    o.cache_lengths = {};
    const Tensor cref = tpa_decode(r.aq.narrow(1, 0, 1), r.bq.narrow(1, 0, 1), r.ak, r.bk, r.av, r.bv, o);
    CHECK_CLOSE_TENSOR(cdec.to(Device::cpu()), cref, dt);
  }
}
