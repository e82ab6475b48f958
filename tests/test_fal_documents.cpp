// FAL causal with packed documents on the CPU: the reference and the composed path against each document run
// on its own (values and every gradient), gradient checks with boundaries, fal_step ignoring them, and the
// errors.
#include <vector>
#include "fal_documents.h"

using namespace lintape;
using namespace lintape::test;

namespace {

const ActSpec kSilu{Act::Silu, ActDim::None}, kSoftFeature{Act::Softmax, ActDim::Feature};

FalOptions options(FalLrpe lrpe, bool decay, int64_t H = 2) {
  FalOptions o;
  o.causal = true;
  o.q = kSilu;
  o.k = kSoftFeature;
  o.g = kSilu;
  o.lrpe = lrpe;
  if (lrpe == FalLrpe::Cosine) o.theta = rates({H, 4});
  if (lrpe == FalLrpe::Rotate) o.theta = rates({H, 2});
  if (decay) {
    std::vector<double> lam;
    for (int64_t h = 0; h < H; ++h) lam.push_back(0.9 - 0.2 * double(h % 3));
    o.decay = from_vector(lam, {H}, DType::F64);
  }
  return o;
}

// Small rows: one-token documents, a row that is one document, different cuts per row.
std::vector<FalDocCase> small_cases() {
  std::vector<FalDocCase> c;
  c.push_back({"none, no decay", options(FalLrpe::None, false), 2, 9, 2, 4, 3, {0, 3, 4, 9, 18}});
  c.push_back({"none, decay, one-token documents", options(FalLrpe::None, true), 2, 9, 2, 4, 3,
               {0, 1, 2, 5, 9, 10, 11, 17, 18}});
  c.push_back({"none, decay, no S0", options(FalLrpe::None, true), 3, 6, 2, 4, 3, {0, 6, 8, 12, 13, 18}, false});
  c.push_back({"cosine, decay, offset 3", options(FalLrpe::Cosine, true), 2, 9, 2, 4, 3, {0, 4, 9, 12, 18}});
  c.back().o.offset = 3;
  c.push_back({"rotate, no decay", options(FalLrpe::Rotate, false), 2, 9, 2, 4, 3, {0, 2, 7, 9, 10, 18}});
  return c;
}

// Documents crossing the composed path's 128-token chunks and the kernels' 64-token ones.
std::vector<FalDocCase> long_cases() {
  std::vector<FalDocCase> c;
  c.push_back({"none, decay, long", options(FalLrpe::None, true), 2, 300, 2, 4, 3, {0, 1, 63, 64, 65, 200, 300,
                                                                                      429, 430, 600}});
  c.push_back({"none, no decay, long", options(FalLrpe::None, false), 2, 300, 2, 4, 3, {0, 127, 129, 256,
                                                                                      300, 600}});
  c.push_back({"cosine, no decay, long", options(FalLrpe::Cosine, false), 2, 300, 2, 4, 3, {0, 127, 129, 256,
                                                                                          300, 600}});
  c.push_back({"none, no decay, rows of one document", options(FalLrpe::None, false), 2, 140, 2, 4, 3, {0, 140,
                                                                                                       280}});
  return c;
}

}  // namespace

TEST_CASE("fal documents reference equals each document alone") {
  uint64_t seed = 1;
  for (const FalDocCase& c : small_cases()) check_fal_documents(c, DType::F64, Device::cpu(), Impl::Reference,
                                                                1e-10, seed += 10);
}

TEST_CASE("fal documents composed equals each document alone") {
  uint64_t seed = 3;
  for (const FalDocCase& c : small_cases()) check_fal_documents(c, DType::F64, Device::cpu(), Impl::Composed,
                                                                1e-10, seed += 10);
  for (const FalDocCase& c : long_cases()) check_fal_documents(c, DType::F64, Device::cpu(), Impl::Composed,
                                                               1e-10, seed += 10);
}

TEST_CASE("fal documents reference long rows equal each document alone") {
  uint64_t seed = 5;
  for (const FalDocCase& c : long_cases()) check_fal_documents(c, DType::F64, Device::cpu(), Impl::Reference,
                                                               1e-10, seed += 10);
}

TEST_CASE("fal documents f32 composed equals each document alone") {
  check_fal_documents(long_cases()[0], DType::F32, Device::cpu(), Impl::Composed, 1e-5, 9);
}

TEST_CASE("gradcheck fal documents") {
  for (Impl impl : {Impl::Reference, Impl::Composed}) {
    CAPTURE(int(impl));
    for (const FalDocCase& c : small_cases()) {
      CAPTURE(c.name);
      FalOptions o = c.o;
      o.documents = Documents::from_cu_seqlens(c.cu, c.B, c.N);
      std::vector<Tensor> in = fal_doc_values(c, 40);
      if (!c.with_s0) in.pop_back();
      for (Tensor& t : in) t.requires_grad_();
      auto f = [&](const std::vector<Tensor>& x) {
        auto [y, S] = fal_with_state(x[0], x[1], x[2], x[3], c.with_s0 ? x[4] : Tensor(), o, impl);
        return cat({y.reshape({-1}), S.reshape({-1})}, 0);
      };
      CHECK_GRADCHECK(f, in);
    }
  }
}

TEST_CASE("fal documents packed rows differ from one document per row") {
  // The boundaries take effect: a cut changes the tokens after it (and only those).
  FalDocCase c{"", options(FalLrpe::Cosine, true), 1, 8, 2, 4, 3, {0, 5, 8}};
  const std::vector<Tensor> v = fal_doc_values(c, 70);
  FalOptions o = c.o;
  auto [whole, S_whole] = fal_with_state(v[0], v[1], v[2], v[3], v[4], o, Impl::Reference);
  o.documents = Documents::from_cu_seqlens(c.cu, 1, 8);
  auto [cut, S_cut] = fal_with_state(v[0], v[1], v[2], v[3], v[4], o, Impl::Reference);
  CHECK(rel_error(cut.narrow(1, 0, 5), whole.narrow(1, 0, 5)) == 0);
  CHECK(rel_error(cut.narrow(1, 5, 3), whole.narrow(1, 5, 3)) > 1e-3);
  CHECK(rel_error(S_cut, S_whole) > 1e-3);
}

TEST_CASE("fal step ignores documents") {
  FalDocCase c{"", options(FalLrpe::Cosine, true), 2, 1, 2, 4, 3, {0, 1, 2}};
  const std::vector<Tensor> v = fal_doc_values(c, 80);
  FalOptions o = c.o;
  Tensor plain = v[4], with_docs = v[4];
  const Tensor y = fal_step(plain, v[0], v[1], v[2], v[3], o);
  o.documents = Documents::from_cu_seqlens({0, 5, 8, 16}, 2, 8);
  const Tensor y_docs = fal_step(with_docs, v[0], v[1], v[2], v[3], o);
  CHECK(rel_error(y_docs, y) == 0);
  CHECK(rel_error(with_docs, plain) == 0);
}

TEST_CASE("bad input fal documents") {
  auto t = [](const Shape& s) { return randn(s, DType::F32, Device::cpu(), 1); };
  Tensor q = t({2, 5, 3, 4}), k = t({2, 5, 3, 4}), v = t({2, 5, 3, 8}), g = t({2, 5, 3, 8});
  FalOptions o;
  o.causal = true;
  o.documents = Documents::from_cu_seqlens({0, 2, 4, 8}, 2, 4);
  check_throws_containing([&] { fal(q, k, v, g, o); }, {"[fal]", "documents are for (2, 4)", "(2, 5)"});
  o.documents = Documents::from_cu_seqlens({0, 2, 5, 10}, 2, 5);
  FalOptions nc = o;
  nc.causal = false;
  check_throws_containing([&] { fal(q, k, v, g, nc); }, {"[fal]", "documents", "causal mode only", "noncausal"});
  FalOptions md = o;
  md.lrpe = FalLrpe::MdCosine;
  md.theta = rates({3, 2});
  md.md_shape = {5};
  check_throws_containing([&] { fal(q, k, v, g, md); }, {"[fal]", "md_cosine", "does not take documents"});
  check_throws_containing([&] { fal_with_state(q, k, v, g, Tensor(), md); },
                          {"[fal_with_state]", "md_cosine", "does not take documents"});
}
