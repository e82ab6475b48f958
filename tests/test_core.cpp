// The core: factories, dtypes and their conversions, views and copies (with their gradient checks),
// random numbers, device transfers, the caching allocator, and the errors of each.
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include "core/allocator.h"
#include "core/kernels.h"
#include "helpers.h"
#include "ops/shape.h"

using namespace lintape;
using lintape::test::check_throws_containing;
using lintape::test::gpu;
using lintape::test::leaf;

namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const std::vector<DType> kAllDTypes = {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64};

// Values that every dtype holds exactly (small integers), laid out in row-major order.
Tensor iota(const Shape& shape, DType dtype, Device device = Device::cpu()) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i) - 3.0;
  return from_vector(v, shape, dtype, device);
}

// The largest elementwise |a - b| / max(|b|, tiny).
double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]) / std::max(std::fabs(b[i]), 1e-30));
  return m;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// factories and printing

TEST_CASE("factories make contiguous tensors with the asked shape, dtype and values") {
  Tensor e = empty({2, 3, 4}, DType::BF16);
  CHECK(e.shape() == Shape{2, 3, 4});
  CHECK(e.strides() == Shape{12, 4, 1});
  CHECK(e.dtype() == DType::BF16);
  CHECK(e.device() == Device::cpu());
  CHECK(e.is_contiguous());
  CHECK(e.numel() == 24);
  CHECK(e.nbytes() == 48);
  CHECK(e.dim() == 3);
  CHECK(e.size(-1) == 4);
  CHECK(!e.requires_grad());
  CHECK(e.is_leaf());

  CHECK(zeros({3}, DType::I32).to_vector<double>() == std::vector<double>{0, 0, 0});
  CHECK(ones({2}, DType::F16).to_vector<double>() == std::vector<double>{1, 1});
  CHECK(full({2, 1}, -2.5, DType::F64).to_vector<double>() == std::vector<double>{-2.5, -2.5});
  CHECK(arange(-2, 3, DType::I64).to_vector<int64_t>() == std::vector<int64_t>{-2, -1, 0, 1, 2});
  CHECK(arange(5, 5).numel() == 0);
  CHECK(from_vector({1, 2, 3, 4}, {2, 2}, DType::BF16).to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  CHECK(from_vector_i64({7, -8}, {2}).dtype() == DType::I64);
  Tensor like = zeros_like(full({3, 2}, 4.0, DType::F16));
  CHECK(like.shape() == Shape{3, 2});
  CHECK(like.dtype() == DType::F16);
  CHECK(like.to_vector<double>() == std::vector<double>(6, 0.0));
  CHECK(empty_like(like).dtype() == DType::F16);

  Tensor s = full({}, 3.0);  // 0-d: one element, no dims
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.item() == 3.0);
  Tensor z = zeros({4, 0, 2});
  CHECK(z.numel() == 0);
  CHECK(z.to_vector<double>().empty());
}

TEST_CASE("poison_ fills floats with NaN and integers with a sentinel") {
  Tensor f = zeros({3}, DType::BF16);
  poison_(f);
  for (double v : f.to_vector<double>()) CHECK(std::isnan(v));
  Tensor i = zeros({2}, DType::I32);
  poison_(i);
  CHECK(i.to_vector<int32_t>()[0] == std::numeric_limits<int32_t>::min());
}

TEST_CASE("tensors print their shape, dtype, device and values") {
  std::string s = from_vector({1, 2.5, -3, 4}, {2, 2}).to_string();
  CHECK(s.find("tensor(2, 2) f32 cpu") != std::string::npos);
  CHECK(s.find("[[1, 2.5], [-3, 4]]") != std::string::npos);
  std::ostringstream os;
  os << arange(0, 100, DType::I64);
  CHECK(os.str().find("[0, 1, 2, ..., 97, 98, 99]") != std::string::npos);
  Tensor g = ones({2});
  g.requires_grad_();
  CHECK(g.to_string().find("requires_grad") != std::string::npos);
}

// ---------------------------------------------------------------------------------------------------
// dtypes

TEST_CASE("dtype names and sizes") {
  for (DType t : kAllDTypes) CHECK(dtype_from_name(dtype_name(t)) == t);
  CHECK(dtype_size(DType::BF16) == 2);
  CHECK(dtype_size(DType::I64) == 8);
  CHECK(is_floating(DType::F16));
  CHECK(!is_floating(DType::I32));
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN, inf and subnormals") {
  auto rt = [](float f) { return float(bf16(f)); };
  CHECK(rt(1.0f) == 1.0f);
  CHECK(rt(1.0f + 0x1p-8f) == 1.0f);                   // halfway, even below
  CHECK(rt(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);     // halfway, even above
  CHECK(rt(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);  // just above halfway
  CHECK(rt(-1.0f - 0x1p-8f) == -1.0f);
  CHECK(rt(std::numeric_limits<float>::max()) == INFINITY);  // rounds past the largest bf16
  CHECK(rt(INFINITY) == INFINITY);
  CHECK(rt(-INFINITY) == -INFINITY);
  CHECK(std::isnan(rt(NAN)));
  CHECK(std::isnan(rt(bits_to_float(0x7f800001u))));  // a NaN whose payload is only in the low bits
  CHECK(std::signbit(rt(-0.0f)));
  CHECK(rt(0x1p-133f) == 0x1p-133f);  // the smallest bf16 subnormal
  CHECK(rt(0x1p-134f) == 0.0f);       // half of it: ties to even (zero)
  CHECK(rt(0x1p-134f + 0x1p-140f) == 0x1p-133f);
  // Every bf16 survives a round trip through float unchanged.
  for (uint32_t b = 0; b < 65536; ++b) {
    bf16 h;
    h.bits = uint16_t(b);
    float f = float(h);
    if (std::isnan(f)) continue;
    if (bf16(f).bits != b) {
      FAIL_CHECK("bf16 bits " << b << " do not round-trip");
      break;
    }
  }
}

TEST_CASE("f16 conversion rounds to nearest even and keeps NaN, inf and subnormals") {
  auto rt = [](float f) { return float(f16(f)); };
  CHECK(rt(1.0f + 0x1p-11f) == 1.0f);                // halfway, even below
  CHECK(rt(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);  // halfway, even above
  CHECK(rt(1.0f + 0x1p-11f + 0x1p-20f) == 1.0f + 0x1p-10f);
  CHECK(rt(65504.0f) == 65504.0f);  // the largest half
  CHECK(rt(65519.0f) == 65504.0f);
  CHECK(rt(65520.0f) == INFINITY);  // halfway to the next binade: rounds to inf
  CHECK(rt(-1e6f) == -INFINITY);
  CHECK(std::isnan(rt(NAN)));
  CHECK(std::isnan(rt(bits_to_float(0xff800001u))));
  CHECK(f16(0x1p-24f).bits == 0x0001);  // the smallest subnormal
  CHECK(f16(0x1p-25f).bits == 0x0000);  // half of it: ties to even
  CHECK(f16(3 * 0x1p-25f).bits == 0x0002);
  CHECK(f16(1023.5f * 0x1p-24f).bits == 0x0400);  // the largest subnormal rounds up into the normals
  CHECK(f16(-0x1p-14f).bits == 0x8400);
  CHECK(f16(-0.0f).bits == 0x8000);
  for (uint32_t b = 0; b < 65536; ++b) {
    f16 h;
    h.bits = uint16_t(b);
    float f = float(h);
    if (std::isnan(f)) continue;
    if (f16(f).bits != b) {
      FAIL_CHECK("f16 bits " << b << " do not round-trip");
      break;
    }
  }
}

TEST_CASE("copy_ converts across dtypes and strides") {
  // Every pair of dtypes, on small integers that all of them hold exactly.
  for (DType a : kAllDTypes)
    for (DType b : kAllDTypes) {
      INFO(dtype_name(a) << " -> " << dtype_name(b));
      Tensor src = iota({2, 3}, a);
      Tensor dst = empty({2, 3}, b);
      dst.copy_(src);
      CHECK(dst.to_vector<double>() == src.to_vector<double>());
    }
  // Strided source and destination.
  Tensor src = iota({3, 4}, DType::F32).transpose(0, 1);  // (4, 3)
  Tensor base = zeros({4, 6}, DType::BF16);
  Tensor dst = base.narrow(1, 2, 3);  // (4, 3), non-contiguous
  dst.copy_(src);
  CHECK(dst.to_vector<double>() == src.to_vector<double>());
  CHECK(base.narrow(1, 0, 2).to_vector<double>() == std::vector<double>(8, 0.0));  // untouched
  // Float to integer truncates toward zero; rounding to bf16 is to nearest even.
  Tensor i = empty({3}, DType::I32);
  i.copy_(from_vector({2.7, -2.7, 0.5}, {3}, DType::F64));
  CHECK(i.to_vector<int32_t>() == std::vector<int32_t>{2, -2, 0});
  Tensor h = empty({1}, DType::BF16);
  h.copy_(from_vector({1.0 + 1.0 / 256}, {1}, DType::F64));
  CHECK(h.item() == 1.0);
  // fill_ on a strided view writes only the view.
  Tensor m = zeros({3, 3});
  m.transpose(0, 1).narrow(0, 1, 1).fill_(5.0);
  CHECK(m.to_vector<double>() == std::vector<double>{0, 5, 0, 0, 5, 0, 0, 5, 0});
}

// ---------------------------------------------------------------------------------------------------
// random numbers

TEST_CASE("randn and rand are deterministic per seed and have the right distribution") {
  Tensor a = randn({1000}, DType::F64, Device::cpu(), 42);
  Tensor b = randn({1000}, DType::F64, Device::cpu(), 42);
  Tensor c = randn({1000}, DType::F64, Device::cpu(), 43);
  CHECK(a.to_vector<double>() == b.to_vector<double>());
  CHECK(a.to_vector<double>() != c.to_vector<double>());
  // Values depend on (seed, index) only: a longer tensor starts with the same numbers, and a lower
  // precision holds the rounded f64 values.
  std::vector<double> longer = randn({1500}, DType::F64, Device::cpu(), 42).to_vector<double>();
  CHECK(std::vector<double>(longer.begin(), longer.begin() + 1000) == a.to_vector<double>());
  CHECK(randn({1000}, DType::F32, Device::cpu(), 42).to_vector<double>() == a.to(DType::F32).to_vector<double>());
  CHECK(randn({10, 100}, DType::F64, Device::cpu(), 42).view({1000}).to_vector<double>() == a.to_vector<double>());

  std::vector<double> v = randn({20000}, DType::F64, Device::cpu(), 1).to_vector<double>();
  double mean = 0, sq = 0;
  for (double x : v) mean += x / double(v.size());
  for (double x : v) sq += (x - mean) * (x - mean) / double(v.size());
  CHECK(std::fabs(mean) < 0.03);
  CHECK(std::fabs(std::sqrt(sq) - 1.0) < 0.03);

  std::vector<double> u = rand({20000}, DType::F64, Device::cpu(), 1).to_vector<double>();
  double umean = 0;
  for (double x : u) {
    CHECK_MESSAGE((x > 0 && x < 1), "rand gave " << x);
    umean += x / double(u.size());
  }
  CHECK(std::fabs(umean - 0.5) < 0.02);
}

// ---------------------------------------------------------------------------------------------------
// views and copies

TEST_CASE("view, reshape, permute, transpose and narrow share storage, copies do not") {
  Tensor x = iota({2, 3, 4}, DType::F32);
  Tensor v = x.view({6, -1});
  CHECK(v.shape() == Shape{6, 4});
  CHECK(v.data() == x.data());
  CHECK(v.to_vector<double>() == x.to_vector<double>());

  Tensor p = x.permute({2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p.strides() == Shape{1, 12, 4});
  CHECK(!p.is_contiguous());
  CHECK(p.data() == x.data());
  std::vector<double> xv = x.to_vector<double>(), pv = p.to_vector<double>();
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t k = 0; k < 3; ++k) CHECK(pv[size_t(i * 6 + j * 3 + k)] == xv[size_t(j * 12 + k * 4 + i)]);

  Tensor t = x.transpose(0, -1);
  CHECK(t.shape() == Shape{4, 3, 2});
  CHECK(t.to_vector<double>()[1] == xv[12]);

  Tensor n = x.narrow(1, 1, 2);
  CHECK(n.shape() == Shape{2, 2, 4});
  CHECK(n.offset() == 4);
  CHECK(n.to_vector<double>()[0] == xv[4]);
  CHECK(n.to_vector<double>()[8] == xv[16]);
  CHECK(x.narrow(0, 1, 1).view({3, 4}).to_vector<double>()[0] == xv[12]);  // a contiguous slice can be viewed

  Tensor c = p.contiguous();
  CHECK(c.is_contiguous());
  CHECK(c.data() != x.data());
  CHECK(c.to_vector<double>() == pv);
  CHECK(x.contiguous().data() == x.data());  // already contiguous: the same tensor

  Tensor r = p.reshape({8, 3});  // not viewable: copies
  CHECK(r.data() != x.data());
  CHECK(r.to_vector<double>() == pv);
  CHECK(x.reshape({24}).data() == x.data());  // viewable: no copy

  Tensor k = x.clone();
  CHECK(k.data() != x.data());
  k.fill_(0.0);
  CHECK(x.to_vector<double>() == xv);

  Tensor h = x.to(DType::BF16);
  CHECK(h.dtype() == DType::BF16);
  CHECK(h.to_vector<double>() == xv);
  CHECK(x.to(DType::F32).data() == x.data());  // same dtype: no copy
  CHECK(x.to(Device::cpu()).data() == x.data());

  Tensor d = x.detach();
  CHECK(d.data() == x.data());
  CHECK(!d.requires_grad());
}

TEST_CASE("cat joins along any dim") {
  Tensor a = iota({2, 3}, DType::F64), b = full({2, 1}, 9.0, DType::F64), e = empty({2, 0}, DType::F64);
  Tensor c = cat({a, b, e}, 1);
  CHECK(c.shape() == Shape{2, 4});
  CHECK(c.to_vector<double>() == std::vector<double>{-3, -2, -1, 9, 0, 1, 2, 9});
  Tensor r = cat({a, a.narrow(0, 0, 1)}, -2);
  CHECK(r.shape() == Shape{3, 3});
  CHECK(r.to_vector<double>() == std::vector<double>{-3, -2, -1, 0, 1, 2, -3, -2, -1});
  CHECK(cat({a}, 0).to_vector<double>() == a.to_vector<double>());
}

TEST_CASE("gradcheck view") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].view({3, -1}); }, {leaf({2, 3, 2}, 1)});
}

TEST_CASE("gradcheck reshape") {
  // Through a permuted (non-viewable) input, so reshape copies.
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].permute({1, 0}).reshape({6}); },
                  {leaf({2, 3}, 2)});
}

TEST_CASE("gradcheck permute") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].permute({2, 0, 1}); }, {leaf({2, 3, 4}, 3)});
}

TEST_CASE("gradcheck transpose") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].transpose(0, 2); }, {leaf({2, 1, 3}, 4)});
}

TEST_CASE("gradcheck narrow") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].narrow(1, 1, 2); }, {leaf({2, 4}, 5)});
}

TEST_CASE("gradcheck contiguous") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].transpose(0, 1).contiguous(); },
                  {leaf({3, 2}, 6)});
}

TEST_CASE("gradcheck clone") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].clone(); }, {leaf({5}, 7)});
}

TEST_CASE("gradcheck cat") {
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return cat({in[0], in[1], in[0]}, 1); },
                  (std::vector<Tensor>{leaf({2, 2}, 8), leaf({2, 3}, 9)}));
}

TEST_CASE("split gives views of consecutive ranges") {
  Tensor x = iota({2, 7}, DType::F32);
  std::vector<Tensor> parts = split(x, {3, 0, 4}, -1);
  REQUIRE(parts.size() == 3);
  CHECK(parts[0].shape() == Shape{2, 3});
  CHECK(parts[1].numel() == 0);
  CHECK(parts[2].to_vector<double>() == x.narrow(1, 3, 4).to_vector<double>());
  CHECK(parts[2].data() == x.narrow(1, 3, 4).data());  // a view, not a copy
  check_throws_containing([&] { split(x, {3, 3}, 1); }, {"[split]", "add up to dim 1", "(2, 7)", "add up to 6"});
}

TEST_CASE("gradcheck split, with a piece left unused and a piece used twice") {
  CHECK_GRADCHECK(
      [](const std::vector<Tensor>& in) {
        std::vector<Tensor> p = split(in[0], {2, 1, 3}, 1);
        return cat({p[0], p[2], p[0]}, 1);
      },
      {leaf({2, 6}, 11)});
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return split(in[0].transpose(0, 1), {1, 3}, 0)[1]; },
                  {leaf({2, 4}, 12)});
}

TEST_CASE("split's backward takes the pieces' gradients uncopied when they lie side by side, else copies") {
  // cat's backward hands each input a view of its one gradient: in split's order they are x's gradient
  // as it is; in another order, or with a gap, they must be copied into place.
  Tensor x = leaf({3, 10}, 13);
  Tensor dy = randn({3, 10}, DType::F64, Device::cpu(), 14);
  std::vector<Tensor> p = split(x, {4, 2, 4}, 1);
  backward(cat({p[0], p[1], p[2]}, 1), dy);
  CHECK(x.grad().to_vector<double>() == dy.to_vector<double>());
  x = leaf({3, 10}, 13);
  p = split(x, {4, 2, 4}, 1);
  backward(cat({p[2], p[0], p[1]}, 1), dy);
  CHECK(x.grad().to_vector<double>() == cat({dy.narrow(1, 4, 4), dy.narrow(1, 8, 2), dy.narrow(1, 0, 4)}, 1)
                                            .to_vector<double>());
  x = leaf({3, 10}, 13);
  p = split(x, {4, 2, 4}, 1);
  Tensor gap = randn({3, 11}, DType::F64, Device::cpu(), 15);  // the pieces at 0, 5 and 7 of 11 columns
  backward(cat({p[0], zeros({3, 1}, DType::F64), p[1], p[2]}, 1), gap);
  CHECK(x.grad().to_vector<double>() ==
        cat({gap.narrow(1, 0, 4), gap.narrow(1, 5, 6)}, 1).to_vector<double>());
}

TEST_CASE("gradcheck to dtype") {
  // x -> f32 -> f64 is the identity up to f32 rounding: a wide step keeps the rounding out of the
  // finite differences.
  GradcheckOptions opt;
  opt.eps = 0.25;
  GradcheckResult r = gradcheck([](const std::vector<Tensor>& in) { return in[0].to(DType::F32).to(DType::F64); },
                                {leaf({4}, 10)}, opt);
  INFO(r.message);
  CHECK(r.ok);
}

// ---------------------------------------------------------------------------------------------------
// the caching allocator

TEST_CASE("allocator graph pools: a captured block is kept for its pool until the pool is released") {
  Device cpu = Device::cpu();
  empty_cache(cpu);
  void* captured = nullptr;
  graph_pool_begin(cpu, 7);
  { captured = empty({3000}, DType::F32).data(); }  // allocated and freed "during a capture"
  graph_pool_end(cpu);
  // A block made before the capture and freed during it joins the pool as well.
  Tensor before_capture = empty({5000}, DType::F32);
  void* older = before_capture.data();
  graph_pool_begin(cpu, 7);
  before_capture = Tensor();
  graph_pool_end(cpu);
  CHECK(empty({5000}, DType::F32).data() != older);
  // Outside the capture the block is not handed out, though it is free and of the right size.
  {
    Tensor outside = empty({3000}, DType::F32);
    CHECK(outside.data() != captured);
  }
  // A later capture into the same pool takes it again.
  graph_pool_begin(cpu, 7);
  {
    Tensor again = empty({3000}, DType::F32);
    CHECK(again.data() == captured);
  }
  graph_pool_end(cpu);
  // Released, it is the cache's again: one of the two free blocks of that size serves without an allocation.
  graph_pool_release(cpu, 7);
  const size_t before = memory_stats(cpu).device_allocs;
  Tensor a = empty({3000}, DType::F32), b = empty({3000}, DType::F32);
  CHECK((a.data() == captured || b.data() == captured));
  CHECK(memory_stats(cpu).device_allocs == before);
  CHECK_THROWS_AS(graph_pool_begin(cpu, 0), Error);
  // A capture's rise in bytes in use, and a replay counted into the peak.
  graph_pool_begin(cpu, 8);
  { Tensor c = empty({2048}, DType::F32); }
  CHECK(graph_pool_end(cpu) == 8192);
  graph_pool_release(cpu, 8);
  reset_peak_memory(cpu);
  count_replay(cpu, 1 << 20);
  CHECK(memory_stats(cpu).peak == memory_stats(cpu).in_use + (1 << 20));
}

TEST_CASE("allocator stats: in use, peak, reserved and allocations move as expected") {
  Device cpu = Device::cpu();
  empty_cache(cpu);
  MemoryStats s0 = memory_stats(cpu);
  CHECK(s0.peak >= s0.in_use);
  CHECK(s0.reserved >= s0.in_use);
  {
    Tensor a = empty({1000}, DType::F32);  // 4000 bytes: a 4096-byte block
    MemoryStats s1 = memory_stats(cpu);
    CHECK(s1.in_use == s0.in_use + 4096);
    CHECK(s1.reserved == s0.reserved + 4096);
    CHECK(s1.device_allocs == s0.device_allocs + 1);
    CHECK(s1.peak >= s1.in_use);
    CHECK(a.view({10, 100}).numel() == 1000);  // views take no memory
    CHECK(memory_stats(cpu).in_use == s1.in_use);
  }
  MemoryStats s2 = memory_stats(cpu);
  CHECK(s2.in_use == s0.in_use);
  CHECK(s2.reserved == s0.reserved + 4096);  // cached, not returned

  // A freed block is reused: no new allocation, nothing more reserved.
  { Tensor b = empty({900}, DType::F32); }
  MemoryStats s3 = memory_stats(cpu);
  CHECK(s3.device_allocs == s2.device_allocs);
  CHECK(s3.reserved == s2.reserved);

  // In use counts the bytes asked for (rounded up to 512); blocks above 1 MiB are 2 MiB multiples.
  reset_peak_memory(cpu);
  CHECK(memory_stats(cpu).peak == memory_stats(cpu).in_use);
  { Tensor big = empty({3 << 20}, DType::I32); }  // 12 MiB
  MemoryStats s4 = memory_stats(cpu);
  CHECK(s4.peak == s4.in_use + (12u << 20));
  { Tensor odd = empty({(3 << 20) + 1}, DType::I32); }  // 12 MiB + 4 bytes: counts 12 MiB + 512, in a 14 MiB block
  MemoryStats s5 = memory_stats(cpu);
  CHECK(s5.peak == s4.in_use + (12u << 20) + 512);
  CHECK(s5.reserved == s4.reserved + (14u << 20));
  {
    Tensor t = empty({13 << 18}, DType::I32);  // 13 MiB: served by the cached 14 MiB block, counted as 13 MiB
    MemoryStats s6 = memory_stats(cpu);
    CHECK(s6.device_allocs == s5.device_allocs);
    CHECK(s6.reserved == s5.reserved);
    CHECK(s6.in_use == s5.in_use + (13u << 20));
  }
  reset_peak_memory(cpu);
  CHECK(memory_stats(cpu).peak == s4.in_use);

  empty_cache(cpu);
  CHECK(memory_stats(cpu).reserved == s0.reserved);  // the cache is empty again
}

TEST_CASE("cuda allocator stats" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  empty_cache(gpu());
  MemoryStats s0 = memory_stats(gpu());
  {
    Tensor a = empty({1000}, DType::F32, gpu());
    MemoryStats s1 = memory_stats(gpu());
    CHECK(s1.in_use == s0.in_use + 4096);
    CHECK(s1.device_allocs == s0.device_allocs + 1);
  }
  MemoryStats s2 = memory_stats(gpu());
  CHECK(s2.in_use == s0.in_use);
  { Tensor b = empty({1000}, DType::F32, gpu()); }
  CHECK(memory_stats(gpu()).device_allocs == s2.device_allocs);
  reset_peak_memory(gpu());
  CHECK(memory_stats(gpu()).peak == memory_stats(gpu()).in_use);
  empty_cache(gpu());
  CHECK(memory_stats(gpu()).reserved == memory_stats(gpu()).in_use);
}

// ---------------------------------------------------------------------------------------------------
// CUDA: transfers, copies and random numbers against the CPU

TEST_CASE("cuda to device round trips of every dtype and layout" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType t : kAllDTypes) {
    INFO(dtype_name(t));
    Tensor x = iota({37, 5}, t);
    Tensor g = x.to(gpu());
    CHECK(g.is_cuda());
    CHECK(g.dtype() == t);
    CHECK(g.to(Device::cpu()).to_vector<double>() == x.to_vector<double>());
    CHECK(g.to_vector<double>() == x.to_vector<double>());
    Tensor gt = x.transpose(0, 1).to(gpu());  // a strided source
    CHECK(gt.to_vector<double>() == x.transpose(0, 1).to_vector<double>());
    Tensor strided_back = g.transpose(0, 1).narrow(0, 1, 3).to(Device::cpu());  // strided on the GPU
    CHECK(strided_back.to_vector<double>() == x.transpose(0, 1).narrow(0, 1, 3).to_vector<double>());
  }
  // Across devices and dtypes at once, into strided destinations.
  Tensor h = randn({33, 7}, DType::F32, Device::cpu(), 5);
  Tensor d = empty({7, 33}, DType::BF16, gpu());
  poison_(d);
  d.transpose(0, 1).copy_(h);
  CHECK(d.transpose(0, 1).to_vector<double>() == h.to(DType::BF16).to_vector<double>());
  Tensor back = zeros({33, 14}, DType::F64);
  back.narrow(1, 7, 7).copy_(d.transpose(0, 1).narrow(1, 0, 7));
  CHECK(back.narrow(1, 7, 7).to_vector<double>() == h.narrow(1, 0, 7).to(DType::BF16).to_vector<double>());
}

TEST_CASE("cuda copy, fill, arange and cat match cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  for (DType a : kAllDTypes)
    for (DType b : kAllDTypes) {
      INFO(dtype_name(a) << " -> " << dtype_name(b));
      Tensor src = iota({5, 7}, a).to(gpu()).transpose(0, 1);
      Tensor dst = empty({7, 5}, b, gpu());
      poison_(dst);
      dst.copy_(src);
      CHECK(dst.to_vector<double>() == iota({5, 7}, b).transpose(0, 1).to_vector<double>());
    }
  Tensor f = zeros({5, 3}, DType::F16, gpu());
  f.transpose(0, 1).narrow(0, 2, 1).fill_(-1.5);
  CHECK(f.to_vector<double>() == std::vector<double>{0, 0, -1.5, 0, 0, -1.5, 0, 0, -1.5, 0, 0, -1.5, 0, 0, -1.5});
  CHECK(arange(-3, 1000, DType::I32, gpu()).to_vector<double>() == arange(-3, 1000, DType::I32).to_vector<double>());
  Tensor a = randn({3, 129}, DType::F32, gpu(), 1), b = randn({3, 2}, DType::F32, gpu(), 2);
  CHECK(cat({a, b}, 1).to_vector<double>() == cat({a.to(Device::cpu()), b.to(Device::cpu())}, 1).to_vector<double>());
  // split's backward: the pieces' gradients in one tensor, zeros where a piece got none
  Tensor c = randn({4, 10}, DType::BF16, gpu(), 3).requires_grad_();
  std::vector<Tensor> p = split(c, {4, 2, 4}, 1);
  backward(cat({p[0], p[2]}, 1), full({4, 8}, 2.0, DType::BF16, gpu()));
  std::vector<double> expect(40, 2.0);
  for (int r = 0; r < 4; ++r) expect[size_t(r * 10 + 4)] = expect[size_t(r * 10 + 5)] = 0.0;
  CHECK(c.grad().to_vector<double>() == expect);
}

TEST_CASE("cuda accumulate_ matches cpu: packs, odd lengths, misaligned and strided views" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  struct Pair {
    DType dst, src;
  };
  for (Pair p : {Pair{DType::F32, DType::BF16}, Pair{DType::F32, DType::F16}, Pair{DType::BF16, DType::BF16},
                 Pair{DType::F16, DType::F16}, Pair{DType::F32, DType::F32}})
    for (int64_t n : {int64_t(8), int64_t(4096), int64_t(4104), int64_t(13), int64_t(1)})
      for (int64_t at : {int64_t(0), int64_t(1)}) {  // at 1: not 16-byte aligned, the scalar kernel
        INFO(dtype_name(p.dst) << " += " << dtype_name(p.src) << ", n " << n << ", at " << at);
        const Tensor d_cpu = randn({n + at}, p.dst, Device::cpu(), 5).narrow(0, at, n).clone();
        const Tensor s_cpu = randn({n + at}, p.src, Device::cpu(), 6).narrow(0, at, n).clone();
        Tensor d = randn({n + at}, p.dst, gpu(), 5).narrow(0, at, n);
        const Tensor s = randn({n + at}, p.src, gpu(), 6).narrow(0, at, n);
        accumulate_(d, s);
        accumulate_(d_cpu, s_cpu);
        CHECK(d.to_vector<double>() == d_cpu.to_vector<double>());
      }
  // A transposed view takes the strided kernel.
  Tensor d = randn({16, 24}, DType::F32, gpu(), 7).transpose(0, 1);
  const Tensor s = randn({24, 16}, DType::BF16, gpu(), 8);
  Tensor d_cpu = d.to(Device::cpu());
  accumulate_(d, s);
  accumulate_(d_cpu, s.to(Device::cpu()));
  CHECK(d.to_vector<double>() == d_cpu.to_vector<double>());
}

TEST_CASE("cuda copies of slices of a wider tensor match cpu, at every word width" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Rows of 1, 3, 8, 64 and 67 elements at offsets 0 and 1 of a (2, 5, 70) tensor: 16-, 8-, 4- and 2-byte
  // words (and the general kernel where no row layout exists).
  for (DType t : {DType::BF16, DType::F32, DType::F64}) {
    for (int64_t width : {1, 3, 8, 64, 67})
      for (int64_t at : {0, 1}) {
        INFO(dtype_name(t) << " width " << width << " at " << at);
        const Tensor wide = iota({2, 5, 70}, t);
        const Tensor expect = wide.narrow(2, at, width).contiguous();
        Tensor gathered = empty({2, 5, width}, t, gpu());
        poison_(gathered);
        gathered.copy_(wide.to(gpu()).narrow(2, at, width));
        CHECK(gathered.to_vector<double>() == expect.to_vector<double>());
        Tensor scattered = zeros({2, 5, 70}, t, gpu());
        scattered.narrow(2, at, width).copy_(expect.to(gpu()));
        Tensor cpu_scattered = zeros({2, 5, 70}, t);
        cpu_scattered.narrow(2, at, width).copy_(expect);
        CHECK(scattered.to_vector<double>() == cpu_scattered.to_vector<double>());
      }
    Tensor cols = empty({1, 70, 5}, t, gpu());  // no row layout: the general kernel, dims merged
    poison_(cols);
    cols.copy_(iota({2, 5, 70}, t).to(gpu()).narrow(0, 1, 1).transpose(1, 2));
    CHECK(cols.to_vector<double>() ==
          iota({2, 5, 70}, t).narrow(0, 1, 1).transpose(1, 2).contiguous().to_vector<double>());
  }
}

TEST_CASE("cuda randn matches cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  // Box-Muller in double on both sides; the device's log/cos may differ in the last bit, so a value
  // may round the other way in its dtype: at most one unit in its last place.
  for (DType t : {DType::F64, DType::F32, DType::BF16, DType::F16}) {
    INFO(dtype_name(t));
    double ulp = t == DType::F64 ? 1e-14 : t == DType::F32 ? 1.2e-7 : t == DType::F16 ? 1e-3 : 8e-3;
    for (bool normal : {true, false}) {
      Tensor g = normal ? randn({1000003}, t, gpu(), 1234) : rand({1000003}, t, gpu(), 1234);
      Tensor c = normal ? randn({1000003}, t, Device::cpu(), 1234) : rand({1000003}, t, Device::cpu(), 1234);
      CHECK(max_rel_diff(g.to_vector<double>(), c.to_vector<double>()) <= ulp);
    }
  }
}

TEST_CASE("cuda bf16 and f16 conversions match cpu" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  std::vector<double> v = {1.0 + 0x1p-8, 1.0 + 3 * 0x1p-8, 1.0 + 0x1p-11, 1.0 + 3 * 0x1p-11, 65504, 65519, 65520,
                           0x1p-24, 0x1p-25, 3 * 0x1p-25, 1023.5 * 0x1p-24, 0x1p-133, 0x1p-134, -0.0, 1e30, -1e30,
                           INFINITY, -INFINITY};
  Tensor host = from_vector(v, {int64_t(v.size())}, DType::F32);
  for (DType t : {DType::BF16, DType::F16}) {
    INFO(dtype_name(t));
    CHECK(host.to(gpu()).to(t).to_vector<double>() == host.to(t).to_vector<double>());
  }
  Tensor nan = full({3}, NAN, DType::F32, gpu());
  for (double x : nan.to(DType::BF16).to_vector<double>()) CHECK(std::isnan(x));
  for (double x : nan.to(DType::F16).to_vector<double>()) CHECK(std::isnan(x));
}

TEST_CASE("cuda gradcheck to_device" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].to(gpu()).transpose(0, 1).to(Device::cpu()); },
                  {leaf({3, 2}, 11)});
}

// ---------------------------------------------------------------------------------------------------
// bad input: each error names the op and what it expected

TEST_CASE("bad input copy_ with a shape mismatch") {
  Tensor d = empty({2, 3});
  check_throws_containing([&] { d.copy_(empty({3, 2})); }, {"[copy_]", "expected a source of", "(2, 3)", "got (3, 2)"});
}

TEST_CASE("bad input view of a non-contiguous tensor") {
  Tensor t = empty({2, 3}).transpose(0, 1);
  check_throws_containing([&] { t.view({6}); }, {"[view]", "cannot be viewed as (6)", "reshape()"});
  // A slice of the last dim merges no dims across the slice: (2, 3) of (2, 5) cannot become (6).
  Tensor s = empty({2, 5}).narrow(1, 1, 3);
  check_throws_containing([&] { s.view({6}); }, {"[view]", "strides (5, 1)", "cannot be viewed as (6)"});
}

TEST_CASE("view and reshape of strided tensors share storage where the layout allows") {
  // One projection split four ways: (B, N, 4 W) sliced to (B, N, W), viewed as (B, N, H, D).
  Tensor x = iota({2, 3, 24}, DType::F32);
  Tensor piece = x.narrow(2, 6, 6);
  Tensor heads = piece.view({2, 3, 2, 3});
  CHECK(heads.strides() == Shape{72, 24, 3, 1});
  CHECK(heads.data() == piece.data());
  CHECK(heads.to_vector<double>() == piece.contiguous().view({2, 3, 2, 3}).to_vector<double>());
  CHECK(heads.view({6, 6}).data() == piece.data());  // (B, N) merge: batch stride = N x token stride
  Tensor ones = heads.view({2, 1, 3, 1, 6});  // size-1 dims anywhere
  CHECK(ones.data() == piece.data());
  CHECK(ones.to_vector<double>() == piece.contiguous().to_vector<double>());
  // Merging across the slice needs a copy; reshape makes one.
  Tensor flat = piece.reshape({2, 18});
  CHECK(flat.data() != piece.data());
  CHECK(flat.to_vector<double>() == piece.contiguous().to_vector<double>());
  // A transposed tensor splits and merges dims within its runs.
  Tensor t = iota({4, 6}, DType::F32).transpose(0, 1);  // (6, 4), strides (1, 6)
  CHECK(t.view({2, 3, 4}).strides() == Shape{3, 1, 6});
  CHECK(t.view({2, 3, 4}).to_vector<double>() == t.contiguous().view({2, 3, 4}).to_vector<double>());
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return in[0].narrow(1, 2, 4).reshape({2, 2, 2}); },
                  {leaf({2, 7}, 3)});
}

TEST_CASE("bad input view to a wrong number of elements") {
  check_throws_containing([] { empty({2, 3}).view({4, 2}); }, {"[view]", "(4, 2) has 8 elements", "has 6"});
  check_throws_containing([] { empty({2, 3}).reshape({-1, -1}); }, {"[reshape]", "only one dim may be -1"});
}

TEST_CASE("bad input permute with a repeated dim") {
  check_throws_containing([] { empty({2, 3, 4}).permute({0, 2, 0}); }, {"[permute]", "dim 0 appears twice"});
  check_throws_containing([] { empty({2, 3, 4}).permute({0, 1}); }, {"[permute]", "expected 3 dims; got 2"});
}

TEST_CASE("bad input transpose with a dim out of range") {
  check_throws_containing([] { empty({2, 3}).transpose(0, 2); }, {"[transpose]", "dim 2 is out of range", "2 dims"});
}

TEST_CASE("bad input narrow out of range") {
  check_throws_containing([] { empty({2, 5}).narrow(1, 3, 3); }, {"[narrow]", "[3, 6)", "dim 1 of size 5"});
  check_throws_containing([] { empty({2, 5}).narrow(-3, 0, 1); }, {"[narrow]", "dim -3 is out of range"});
}

TEST_CASE("bad input cat with mismatched shapes or dtypes") {
  check_throws_containing([] { cat({empty({2, 3}), empty({3, 3})}, 1); },
                          {"[cat]", "tensor 1 has shape (3, 3)", "all dims but 1 must match (2, 3)"});
  check_throws_containing([] { cat({empty({2, 3}), empty({2, 3}, DType::BF16)}, 0); },
                          {"[cat]", "tensor 1 is (2, 3) bf16", "expected rank 2 f32"});
  check_throws_containing([] { cat({}, 0); }, {"[cat]", "expected at least one tensor"});
}

TEST_CASE("bad input item on many elements") {
  check_throws_containing([] { zeros({2, 2}).item(); }, {"[item]", "expected a tensor with one element", "(2, 2)"});
}

TEST_CASE("bad input data_ptr of the wrong type") {
  check_throws_containing([] { zeros({2}, DType::BF16).data_ptr<float>(); }, {"[data_ptr]", "bf16", "asked for f32"});
}

TEST_CASE("bad input unknown dtype name") {
  check_throws_containing([] { dtype_from_name("float32"); }, {"[dtype]", "'float32'", "expected one of f32, bf16"});
}

TEST_CASE("bad input unknown device") {
  CHECK(parse_device("cpu") == Device::cpu());
  CHECK(parse_device("cuda") == Device::cuda(0));
  CHECK(parse_device("cuda:3") == Device::cuda(3));
  for (const char* s : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "CPU"})
    check_throws_containing([&] { parse_device(s); }, {"[device]", str("'", s, "'"), "expected cpu, cuda or cuda:N"});
}

TEST_CASE("bad input CUDA device that does not exist") {
  check_throws_containing([] { empty({2}, DType::F32, Device::cuda(7)); }, {"[device]", "cuda:7 does not exist"});
  check_throws_containing([] { ones({2}).to(Device::cuda(7)); }, {"[device]", "cuda:7 does not exist"});
}

TEST_CASE("bad input requires_grad on an int tensor") {
  check_throws_containing([] { zeros({2}, DType::I64).requires_grad_(); },
                          {"[requires_grad_]", "only float tensors", "i64"});
}

TEST_CASE("bad input factories with bad shapes or dtypes") {
  check_throws_containing([] { empty({1, 1, 1, 1, 1, 1, 1, 1, 1}); }, {"[empty]", "at most 8 dims"});
  check_throws_containing([] { empty({2, -1}); }, {"[empty]", "sizes must be >= 0", "(2, -1)"});
  check_throws_containing([] { empty({int64_t(1) << 40, int64_t(1) << 40}); }, {"[empty]", "too many elements"});
  check_throws_containing([] { randn({2}, DType::I32); }, {"[randn]", "expected a float dtype", "i32"});
  check_throws_containing([] { arange(3, 1); }, {"[arange]", "expected end >= start"});
  check_throws_containing([] { from_vector({1, 2, 3}, {2, 2}); }, {"[from_vector]", "expected 4 values", "got 3"});
}

TEST_CASE("bad input out of memory reports the request and the allocator's stats") {
  // 4 PiB: more than any machine has, so the allocator gives its cache back, retries and reports.
  check_throws_containing([] { empty({int64_t(1) << 50}, DType::F32); },
                          {"[allocator] out of memory on cpu", "asked for 4503599627370496 bytes", "in use", "peak",
                           "reserved"});
}
