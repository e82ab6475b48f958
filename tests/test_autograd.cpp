// The tape: recording, the reverse pass, gradient accumulation, NoGradGuard, retain_graph, release,
// non-differentiable inputs, ops without a backward, and gradcheck itself (it must be able to fail).
// Most cases use small ops defined here with record(), so they test the tape and nothing else.
#include <map>
#include "helpers.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "core/kernels.h"
#include "ops/shape.h"

using namespace lintape;
using autograd::Grads;
using autograd::record;
using lintape::test::check_throws_containing;
using lintape::test::gpu;
using lintape::test::leaf;

namespace {

Tensor host_map(const Tensor& x, const std::function<double(double)>& f) {
  std::vector<double> v = x.to_vector<double>();
  for (double& e : v) e = f(e);
  return from_vector(v, x.shape(), x.dtype());
}

// y = a * x. Its backward claims dy/dx = grad_factor: `a` when correct, anything else to test gradcheck.
Tensor scale(const Tensor& x, double a, double grad_factor) {
  Tensor y = host_map(x, [a](double e) { return a * e; });
  record("scale", {x}, {y}, [grad_factor](const Grads& g) -> Grads {
    return {host_map(g[0], [grad_factor](double e) { return grad_factor * e; })};
  });
  return y;
}
Tensor scale(const Tensor& x, double a) { return scale(x, a, a); }

// x * y, elementwise, same shapes; saves both inputs (detached) for backward.
Tensor times(const Tensor& x, const Tensor& y) {
  std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>();
  for (size_t i = 0; i < xv.size(); ++i) xv[i] *= yv[i];
  Tensor out = from_vector(xv, x.shape(), x.dtype());
  Tensor xs = x.detach(), ys = y.detach();
  record("times", {x, y}, {out}, [xs, ys](const Grads& g) -> Grads {
    std::vector<double> gv = g[0].to_vector<double>(), a = ys.to_vector<double>(), b = xs.to_vector<double>();
    for (size_t i = 0; i < gv.size(); ++i) {
      a[i] *= gv[i];
      b[i] *= gv[i];
    }
    return {from_vector(a, xs.shape(), xs.dtype()), from_vector(b, ys.shape(), ys.dtype())};
  });
  return out;
}

// The sum of all elements, as a 0-d tensor.
Tensor total(const Tensor& x) {
  double s = 0;
  for (double e : x.to_vector<double>()) s += e;
  Tensor out = full({}, s, x.dtype());
  Shape shape = x.shape();
  DType dtype = x.dtype();
  record("total", {x}, {out}, [shape, dtype](const Grads& g) -> Grads { return {full(shape, g[0].item(), dtype)}; });
  return out;
}

// Two outputs: (2x, 3x).
std::pair<Tensor, Tensor> split2(const Tensor& x) {
  Tensor a = host_map(x, [](double e) { return 2 * e; }), b = host_map(x, [](double e) { return 3 * e; });
  record("split2", {x}, {a, b}, [](const Grads& g) -> Grads {
    Shape shape = g[0].defined() ? g[0].shape() : g[1].shape();
    std::vector<double> dx(size_t(shape_numel(shape)), 0.0);
    for (int k = 0; k < 2; ++k) {
      if (!g[size_t(k)].defined()) continue;
      std::vector<double> gk = g[size_t(k)].to_vector<double>();
      for (size_t i = 0; i < dx.size(); ++i) dx[i] += (k + 2) * gk[i];
    }
    return {from_vector(dx, shape, DType::F64)};
  });
  return {a, b};
}

// Passes its input on, but its backward gives the input no gradient.
Tensor blocked(const Tensor& x) {
  Tensor out;
  {
    NoGradGuard no_record;  // clone would record itself; this op stands alone
    out = x.clone();
  }
  record("blocked", {x}, {out}, [](const Grads&) -> Grads { return {Tensor()}; });
  return out;
}

std::vector<double> filled(size_t n, double v) { return std::vector<double>(n, v); }

}  // namespace

TEST_CASE("autograd chain rule") {
  Tensor x = leaf({2, 3}, 1);
  Tensor h = scale(x, 2.0);
  CHECK(h.requires_grad());
  CHECK(!h.is_leaf());
  REQUIRE(h.grad_fn());
  CHECK(h.grad_fn()->name == "scale");
  Tensor y = total(scale(h, -3.0));
  backward(y);
  CHECK(x.grad().to_vector<double>() == filled(6, -6.0));
  CHECK(!h.grad().defined());  // only leaves keep gradients
}

TEST_CASE("autograd fan-out accumulates the gradients of every use") {
  Tensor x = leaf({4}, 2);
  std::vector<double> xv = x.to_vector<double>();
  backward(total(times(x, x)));  // d/dx sum(x^2) = 2x: the two uses add up
  std::vector<double> g = x.grad().to_vector<double>();
  for (size_t i = 0; i < 4; ++i) CHECK(g[i] == doctest::Approx(2 * xv[i]));

  Tensor z = leaf({4}, 3);
  Tensor h = scale(z, 2.0);  // an intermediate used by three consumers
  backward(total(times(h, scale(h, 0.5))));  // sum(2z * z) -> 4z
  std::vector<double> zv = z.to_vector<double>(), gz = z.grad().to_vector<double>();
  for (size_t i = 0; i < 4; ++i) CHECK(gz[i] == doctest::Approx(4 * zv[i]));
}

TEST_CASE("autograd leaf grads accumulate across two backward calls") {
  Tensor x = leaf({3}, 4);
  backward(total(scale(x, 2.0)));
  Tensor first = x.grad();
  CHECK(first.to_vector<double>() == filled(3, 2.0));
  backward(total(scale(x, 5.0)));
  CHECK(x.grad().to_vector<double>() == filled(3, 7.0));
  x.set_grad(Tensor());  // zeroing is the caller's job
  backward(total(x));
  CHECK(x.grad().to_vector<double>() == filled(3, 1.0));
}

TEST_CASE("autograd a float32 leaf used in bf16 and f16 gets float32 gradients, accumulated in one pass") {
  for (DType half : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(half));
    Tensor x = randn({3}, DType::F32, Device::cpu(), 4).requires_grad_();
    backward(total(scale(x.to(half), 3.0)));
    CHECK(x.grad().dtype() == DType::F32);
    CHECK(x.grad().to_vector<double>() == filled(3, 3.0));
    backward(total(scale(x.to(half), 0.5)));  // f32 += the 16-bit gradient
    CHECK(x.grad().to_vector<double>() == filled(3, 3.5));
  }
  // accumulate_ takes f32 += bf16/f16 and equal dtypes only.
  const Tensor h = zeros({3}, DType::F16, Device::cpu()), f = ones({3}, DType::F32, Device::cpu());
  CHECK_THROWS_WITH(accumulate_(h, f), doctest::Contains("equal dtypes or f32 += bf16/f16"));
}

TEST_CASE("autograd leaf grads never alias a tensor the caller holds") {
  // clone's backward hands its incoming gradient on as is; the leaf must still get its own copy.
  Tensor x = leaf({3}, 5);
  Tensor go = full({3}, 2.0, DType::F64);
  backward(x.clone(), go);
  CHECK(x.grad().data() != go.data());
  backward(x.clone(), go);
  CHECK(x.grad().to_vector<double>() == filled(3, 4.0));
  CHECK(go.to_vector<double>() == filled(3, 2.0));  // accumulation did not write into grad_output
  // A leaf loss gets grad_output itself, copied.
  Tensor y = leaf({2}, 6);
  backward(y, full({2}, 3.0, DType::F64));
  backward(y, full({2}, 3.0, DType::F64));
  CHECK(y.grad().to_vector<double>() == filled(2, 6.0));
}

TEST_CASE("autograd ops with several outputs get the gradients of those used") {
  Tensor x = leaf({2}, 7);
  auto [a, b] = split2(x);
  CHECK(a.grad_fn() == b.grad_fn());
  backward(total(b));  // only the second output is used
  CHECK(x.grad().to_vector<double>() == filled(2, 3.0));
  x.set_grad(Tensor());
  auto [c, d] = split2(x);
  backward(total(times(c, full({2}, 1.0, DType::F64))));  // first output only
  CHECK(x.grad().to_vector<double>() == filled(2, 2.0));
  x.set_grad(Tensor());
  auto [e, f] = split2(x);
  backward(total(cat({e, f}, 0)));  // both
  CHECK(x.grad().to_vector<double>() == filled(2, 5.0));
}

TEST_CASE("autograd reports each leaf once, after its last contribution") {
  Tensor w = leaf({3}, 21), a = leaf({3}, 22), c = leaf({3}, 23), unused = leaf({3}, 24), side = leaf({3}, 25);
  Tensor h = times(w, a);                  // the first use of w (its gradient arrives last)
  Tensor dead = scale(side, 2.0);          // recorded, but the loss does not depend on it
  Tensor stopped = blocked(scale(c, 3.0));  // reached from the loss, but no gradient comes through
  Tensor y = total(times(times(h, w), stopped));  // the second use of w
  struct Report {
    int count = 0;
    Tensor grad;  // the leaf's gradient when reported
  };
  std::map<const TensorImpl*, Report> reports;
  backward(y, {}, false, [&](const Tensor& leaf) {
    Report& r = reports[leaf.impl()];
    ++r.count;
    r.grad = leaf.grad().defined() ? leaf.grad().clone() : Tensor();
  });
  CHECK(reports.size() == 3);
  for (const Tensor* t : {&w, &a, &c}) {
    REQUIRE(reports.count(t->impl()));
    CHECK(reports[t->impl()].count == 1);
  }
  CHECK(!reports.count(unused.impl()));
  CHECK(!reports.count(side.impl()));
  // Reported after the last contribution: the gradient then is the final one (2 w a s for w).
  const std::vector<double> wv = w.to_vector<double>(), av = a.to_vector<double>(), sv = stopped.to_vector<double>();
  const std::vector<double> gw = reports[w.impl()].grad.to_vector<double>();
  for (size_t i = 0; i < 3; ++i) CHECK(gw[i] == doctest::Approx(2 * wv[i] * av[i] * sv[i]));
  CHECK(reports[w.impl()].grad.to_vector<double>() == w.grad().to_vector<double>());
  CHECK(reports[a.impl()].grad.to_vector<double>() == a.grad().to_vector<double>());
  CHECK(!reports[c.impl()].grad.defined());
  CHECK(!c.grad().defined());
  (void)dead;

  // A leaf loss is reported too; without a callback nothing changes.
  Tensor z = leaf({2}, 26);
  int z_reports = 0;
  backward(z, full({2}, 1.0, DType::F64), false, [&](const Tensor& leaf) { z_reports += leaf.impl() == z.impl(); });
  CHECK(z_reports == 1);
  backward(total(scale(w, 1.0)));
}

TEST_CASE("autograd records only when an input requires grad and grad mode is on") {
  size_t before = autograd::tape_size();
  Tensor c = from_vector({1, 2}, {2}, DType::F64);
  Tensor y = scale(c, 2.0);
  CHECK(!y.requires_grad());
  CHECK(y.is_leaf());
  CHECK(autograd::tape_size() == before);

  Tensor x = leaf({2}, 8);
  {
    NoGradGuard guard;
    CHECK(!autograd::grad_enabled());
    Tensor z = total(scale(x.view({2, 1}), 2.0));
    CHECK(!z.requires_grad());
    CHECK(autograd::tape_size() == before);
    {
      NoGradGuard nested;
    }
    CHECK(!autograd::grad_enabled());  // a nested guard restores the outer state
  }
  CHECK(autograd::grad_enabled());
  Tensor w = scale(x, 2.0);
  CHECK(w.requires_grad());
  CHECK(autograd::tape_size() == before + 1);
  Tensor d = w.detach();  // detach cuts the graph
  CHECK(!d.requires_grad());
  CHECK(!scale(d, 2.0).requires_grad());
}

TEST_CASE("autograd tape_size returns to 0 when tensors die") {
  size_t before = autograd::tape_size();
  Tensor x = leaf({3}, 9);
  {
    Tensor y = total(times(scale(x, 2.0), x.view({3})));
    CHECK(autograd::tape_size() == before + 4);
  }
  CHECK(autograd::tape_size() == before);  // nodes are owned by their outputs, and they are gone
  {
    Tensor y = total(scale(x, 2.0));
    backward(y, {}, /*retain_graph=*/true);
    CHECK(autograd::tape_size() == before + 2);  // retained
    backward(y);
    CHECK(autograd::tape_size() == before);  // released, though y still lives
  }
}

TEST_CASE("autograd retain_graph allows a second backward") {
  Tensor x = leaf({2}, 10);
  Tensor y = total(times(x, x));
  backward(y, {}, /*retain_graph=*/true);
  Tensor g1 = x.grad().clone();
  backward(y);
  std::vector<double> a = g1.to_vector<double>(), b = x.grad().to_vector<double>();
  for (size_t i = 0; i < 2; ++i) CHECK(b[i] == doctest::Approx(2 * a[i]));
}

TEST_CASE("autograd non-scalar loss with grad_output") {
  Tensor x = leaf({2, 2}, 11);
  Tensor y = scale(x, 3.0);
  backward(y, from_vector({1, 0, 2, -1}, {2, 2}, DType::F64));
  CHECK(x.grad().to_vector<double>() == std::vector<double>{3, 0, 6, -3});
}

TEST_CASE("autograd with primitive ops add mul sum") {
  Tensor a = leaf({2, 3}, 12), b = leaf({3}, 13);
  Tensor y = sum(mul(add(a, b), a));  // sum((a + b) * a), b broadcast over rows
  backward(y);
  std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
  for (size_t i = 0; i < 2; ++i)
    for (size_t j = 0; j < 3; ++j) CHECK(ga[i * 3 + j] == doctest::Approx(2 * av[i * 3 + j] + bv[j]));
  for (size_t j = 0; j < 3; ++j) CHECK(gb[j] == doctest::Approx(av[j] + av[3 + j]));
}

TEST_CASE("cuda autograd accumulates leaf grads on the device" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  Tensor x = randn({37, 5}, DType::F32, gpu(), 1);
  x.requires_grad_();
  Tensor go = randn({5, 37}, DType::F32, gpu(), 2);
  backward(x.transpose(0, 1).contiguous(), go);
  REQUIRE(x.grad().defined());
  CHECK(x.grad().is_cuda());
  CHECK(x.grad().to_vector<double>() == go.transpose(0, 1).to_vector<double>());
  backward(x.transpose(0, 1).contiguous(), go);  // accumulates on the GPU
  std::vector<double> twice = go.transpose(0, 1).to_vector<double>();
  for (double& v : twice) v *= 2;
  CHECK(x.grad().to_vector<double>() == twice);
}

// ---------------------------------------------------------------------------------------------------
// gradcheck

TEST_CASE("gradcheck passes a correct backward and fails a wrong one") {
  auto good = [](const std::vector<Tensor>& in) { return times(scale(in[0], 2.0), in[1]); };
  CHECK_GRADCHECK(good, (std::vector<Tensor>{leaf({3}, 14), leaf({3}, 15)}));

  // A deliberately wrong backward: d(2x)/dx claimed to be 3.
  GradcheckResult r =
      gradcheck([](const std::vector<Tensor>& in) { return scale(in[0], 2.0, 3.0); }, {leaf({2, 2}, 16)});
  CHECK(!r.ok);
  CHECK(r.max_abs_error == doctest::Approx(1.0));
  INFO(r.message);
  CHECK(r.message.find("tape gives 3") != std::string::npos);
  CHECK(r.message.find("finite differences give 2") != std::string::npos);

  // Inputs that do not require grad are passed through and not checked.
  Tensor fixed = from_vector({1, 2, 3}, {3}, DType::F64);
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return times(in[0], in[1]); },
                  (std::vector<Tensor>{leaf({3}, 17), fixed}));
  // An input the output does not depend on has a zero Jacobian on both sides.
  CHECK_GRADCHECK([](const std::vector<Tensor>& in) { return scale(in[0], 2.0); },
                  (std::vector<Tensor>{leaf({2}, 18), leaf({2}, 19)}));
}

TEST_CASE("bad input gradcheck needs f64 CPU leaves") {
  Tensor x = randn({2}, DType::F32);
  x.requires_grad_();
  check_throws_containing([&] { gradcheck([](const std::vector<Tensor>& in) { return in[0]; }, {x}); },
                          {"[gradcheck]", "input 0 must be a contiguous f64 CPU leaf", "got f32"});
  check_throws_containing(
      [&] { gradcheck([](const std::vector<Tensor>& in) { return in[0]; }, {zeros({2}, DType::F64)}); },
      {"[gradcheck]", "no input requires grad"});
}

// ---------------------------------------------------------------------------------------------------
// bad input: each error names the op and what it expected

TEST_CASE("bad input backward twice without retain_graph") {
  Tensor x = leaf({2}, 20);
  Tensor y = total(scale(x, 2.0));
  backward(y);
  check_throws_containing([&] { backward(y); }, {"[backward]", "'total' a second time", "retain_graph=true"});
  // Reaching a released node from a new loss fails the same way, naming that node.
  Tensor h = scale(x, 2.0);
  backward(total(h));
  check_throws_containing([&] { backward(total(times(h, h))); }, {"[backward]", "'scale' a second time"});
}

TEST_CASE("bad input non-differentiable input that requires grad") {
  auto op = [](const Tensor& x, const Tensor& theta) {
    Tensor y = x.detach().clone();
    record("rotate_by", {x, autograd::nondiff(theta, "theta")}, {y},
           [](const Grads& g) -> Grads { return {g[0], Tensor()}; });
    return y;
  };
  Tensor x = leaf({2}, 21);
  backward(total(op(x, from_vector({1, 2}, {2}, DType::F64))));  // theta without grad: fine
  CHECK(x.grad().to_vector<double>() == filled(2, 1.0));
  Tensor theta = leaf({2}, 22);
  Tensor y = total(op(x, theta));
  check_throws_containing([&] { backward(y); },
                          {"[rotate_by]", "no gradient for its input 'theta'", "requires grad"});
}

TEST_CASE("bad input backward through an op recorded without backward") {
  Tensor x = leaf({2}, 23);
  Tensor y = x.detach().clone();
  record("argsort_like", {x}, {y}, nullptr);
  CHECK(y.requires_grad());
  check_throws_containing([&] { backward(total(y)); }, {"[argsort_like] has no backward"});
}

TEST_CASE("bad input backward on a non-scalar without grad_output") {
  Tensor y = scale(leaf({2, 3}, 24), 2.0);
  check_throws_containing([&] { backward(y); }, {"[backward]", "loss of shape (2, 3)", "explicit grad_output"});
}

TEST_CASE("bad input backward with a grad_output unlike the loss") {
  Tensor y = scale(leaf({2, 3}, 25), 2.0);
  check_throws_containing([&] { backward(y, ones({3, 2}, DType::F64)); },
                          {"[backward]", "expected grad_output like the loss: (2, 3) f64", "got (3, 2) f64"});
  check_throws_containing([&] { backward(y, ones({2, 3}, DType::F32)); }, {"[backward]", "got (2, 3) f32"});
}

TEST_CASE("bad input backward on a tensor that does not require grad") {
  check_throws_containing([] { backward(full({}, 1.0)); }, {"[backward]", "expected a loss that requires grad"});
  check_throws_containing([] { backward(Tensor()); }, {"[backward]", "undefined"});
}

TEST_CASE("bad input backward function returning the wrong gradients") {
  Tensor x = leaf({2}, 26);
  Tensor y = x.detach().clone();
  record("bad_shape", {x}, {y}, [](const Grads&) -> Grads { return {zeros({3}, DType::F64)}; });
  check_throws_containing([&] { backward(total(y)); },
                          {"[bad_shape] backward returned a gradient of shape (3)", "input 0 of shape (2)"});
  Tensor z = x.detach().clone();
  record("bad_count", {x}, {z}, [](const Grads& g) -> Grads { return {g[0], g[0]}; });
  check_throws_containing([&] { backward(total(z)); }, {"[bad_count] backward returned 2 gradients for 1 inputs"});
}

TEST_CASE("a backward observer sees each node's backward begin and end, by op name") {
  Tensor x = leaf({3}, 31);
  Tensor y = sum(mul(exp(x), x));
  std::vector<std::string> seen;
  autograd::set_backward_observer([&](const char* op, bool begin) { seen.push_back(std::string(begin ? "+" : "-") + op); });
  backward(y);
  autograd::set_backward_observer(nullptr);
  CHECK(seen == std::vector<std::string>{"+sum", "-sum", "+mul", "-mul", "+exp", "-exp"});
  Tensor z = sum(x);  // removed: no more calls
  backward(z);
  CHECK(seen.size() == 6);
}

TEST_CASE("a forward observer sees each op as it records itself, and nothing under no_grad") {
  Tensor x = leaf({3}, 32);
  std::vector<std::string> seen;
  autograd::set_forward_observer([&](const char* op) { seen.push_back(op); });
  Tensor y = sum(mul(exp(x), x));
  {
    NoGradGuard no_grad;
    Tensor unseen = exp(x);
  }
  Tensor constant = exp(x.detach());  // records nothing: needs no gradient
  autograd::set_forward_observer(nullptr);
  CHECK(seen == std::vector<std::string>{"exp", "mul", "sum"});
  Tensor z = sum(x);  // removed: no more calls
  CHECK(seen.size() == 3);
}
