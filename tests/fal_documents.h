// FAL with packed documents, shared by the CPU and CUDA tests: a packed call against each document run on its
// own (values, every input's gradient, S0's and the final state's).
#pragma once
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include "helpers.h"
#include "ops/documents.h"
#include "ops/elementwise.h"
#include "ops/fal/fal.h"
#include "ops/reduce.h"
#include "ops/shape.h"

namespace lintape::test {

struct FalDocCase {
  std::string name;
  FalOptions o;  // causal; documents set by the check from cu
  int64_t B = 2, N = 9, H = 2, D = 4, E = 3;
  std::vector<int64_t> cu;  // cu_seqlens over the B x N tokens
  bool with_s0 = true;
};

// The f64 CPU values of a case's q, k, v, g and S0 (seeded).
inline std::vector<Tensor> fal_doc_values(const FalDocCase& c, uint64_t seed) {
  const int64_t P = fal_state_rows(c.o.lrpe, c.D);
  std::vector<Tensor> t;
  for (const Shape& s : {Shape{c.B, c.N, c.H, c.D}, Shape{c.B, c.N, c.H, c.D}, Shape{c.B, c.N, c.H, c.E},
                         Shape{c.B, c.N, c.H, c.E}, Shape{c.B, c.H, P, c.E}})
    t.push_back(randn(s, DType::F64, Device::cpu(), seed++) * 0.5);
  return t;
}

// The values rounded to dt (S0 to f32), back in f64: what a run in dt sees.
inline std::vector<Tensor> fal_doc_rounded(const std::vector<Tensor>& values, DType dt) {
  std::vector<Tensor> r;
  for (size_t i = 0; i < values.size(); ++i)
    r.push_back(values[i].to(i == 4 && dt != DType::F64 ? DType::F32 : dt).to(DType::F64));
  return r;
}

struct FalDocRun {
  Tensor out, state;
  std::vector<Tensor> grads;  // q, k, v, g, S0 (when used)
  Tensor w, ws;               // the loss weights (f64 on the CPU)
};

// The loss weights of o and of the final state: f64 values rounded to dt (ws to f32).
inline std::pair<Tensor, Tensor> fal_doc_weights(const Shape& out, const Shape& state, DType dt) {
  const DType sdt = dt == DType::F64 ? DType::F64 : DType::F32;
  return {randn(out, DType::F64, Device::cpu(), 1001).to(dt).to(DType::F64),
          randn(state, DType::F64, Device::cpu(), 1002).to(sdt).to(DType::F64)};
}

// Leaves of dtype dt on dev from the values, then o and the final state and the gradients of
// sum(o * w) + sum(S * ws), the weights rounded to wdt. alone: each document of each row is its own call (S0
// into each row's first).
inline FalDocRun fal_doc_run(const FalDocCase& c, const std::vector<Tensor>& values, DType dt, Device dev,
                             Impl impl, bool alone, DType wdt) {
  std::vector<Tensor> x;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i == 4 && !c.with_s0) break;
    const DType type = i == 4 && dt != DType::F64 ? DType::F32 : dt;
    x.push_back(values[i].to(type).to(dev).detach().requires_grad_());
  }
  const Tensor S0 = c.with_s0 ? x[4] : Tensor();
  FalOptions o = c.o;
  o.causal = true;
  if (o.decay.defined()) o.decay = o.decay.to(dev);
  if (o.theta.defined()) o.theta = o.theta.to(dev);
  FalDocRun r;
  if (!alone) {
    o.documents = Documents::from_cu_seqlens(c.cu, c.B, c.N, dev);
    std::tie(r.out, r.state) = fal_with_state(x[0], x[1], x[2], x[3], S0, o, impl);
  } else {
    std::vector<Tensor> rows_out, rows_state;
    for (int64_t b = 0; b < c.B; ++b) {
      std::vector<Tensor> outs;
      Tensor state;
      for (size_t i = 1; i < c.cu.size(); ++i) {
        const int64_t lo = c.cu[i - 1], hi = c.cu[i];
        if (lo < b * c.N || hi > (b + 1) * c.N) continue;
        auto part = [&](size_t j) { return x[j].narrow(0, b, 1).narrow(1, lo - b * c.N, hi - lo); };
        const Tensor s0 = lo == b * c.N && S0.defined() ? S0.narrow(0, b, 1) : Tensor();
        auto [y, S] = fal_with_state(part(0), part(1), part(2), part(3), s0, o, impl);
        outs.push_back(y);
        state = S;
      }
      rows_out.push_back(cat(outs, 1));
      rows_state.push_back(state);
    }
    r.out = cat(rows_out, 0);
    r.state = cat(rows_state, 0);
  }
  std::tie(r.w, r.ws) = fal_doc_weights(r.out.shape(), r.state.shape(), wdt);
  const DType sdt = r.state.dtype();
  backward(sum(r.out * r.w.to(dt).to(dev)).to(sdt) + sum(r.state * r.ws.to(sdt).to(dev)));
  for (const Tensor& t : x) r.grads.push_back(t.grad());
  return r;
}

// o, the final state and the gradients (q, k, v, g and S0 when used) against the reference's, within tol.
inline void check_fal_doc_results(const Tensor& out, const Tensor& state, const std::vector<Tensor>& grads,
                                  const FalDocRun& ref, double tol) {
  const std::string names[] = {"o", "S_final", "dq", "dk", "dv", "dg", "dS0"};
  std::vector<std::pair<Tensor, Tensor>> pairs{{out, ref.out}, {state, ref.state}};
  REQUIRE(grads.size() == ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) pairs.emplace_back(grads[i], ref.grads[i]);
  for (size_t i = 0; i < pairs.size(); ++i) {
    const double err = rel_error(pairs[i].first.to(Device::cpu()), pairs[i].second);
    INFO(names[i] << ": relative error " << err << " (tolerance " << tol << ")");
    CHECK(err <= tol);
  }
}

// The packed call of `impl` against the documents alone through the reference (f64 on the CPU, on the values
// rounded to dt), within tol.
inline void check_fal_documents(const FalDocCase& c, DType dt, Device dev, Impl impl, double tol, uint64_t seed) {
  CAPTURE(c.name);
  const std::vector<Tensor> values = fal_doc_rounded(fal_doc_values(c, seed), dt);
  const FalDocRun ref = fal_doc_run(c, values, DType::F64, Device::cpu(), Impl::Reference, true, dt);
  const FalDocRun got = fal_doc_run(c, values, dt, dev, impl, false, dt);
  check_fal_doc_results(got.out, got.state, got.grads, ref, tol);
}

}  // namespace lintape::test
