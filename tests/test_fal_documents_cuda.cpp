// FAL causal with packed documents on CUDA: the launchers of the chunk kernels and of the chunk sweep (on
// poisoned outputs, at given segment cuts; the chunk kernels with and without the forward's saved chunk states)
// and Impl::Fused / Auto / Composed against each document run on its own through the f64 reference (values and
// every gradient), bf16, f16 and f32.
#include <vector>
#include "fal_documents.h"
#include "ops/fal/launch.h"
#include "ops/fal/paths.h"

using namespace lintape;
using namespace lintape::test;

namespace {

const ActSpec kSilu{Act::Silu, ActDim::None}, kSigmoid{Act::Sigmoid, ActDim::None},
    kSoftmax{Act::Softmax, ActDim::Feature};

FalOptions options(FalLrpe lrpe, bool decay, int64_t H, int64_t D) {
  FalOptions o;
  o.causal = true;
  o.q = kSilu;
  o.k = kSigmoid;
  o.g = kSilu;
  o.lrpe = lrpe;
  o.offset = 3;
  if (lrpe != FalLrpe::None) o.theta = rates({H, lrpe == FalLrpe::Rotate ? D / 2 : D});
  if (decay) {
    std::vector<double> lam;
    for (int64_t h = 0; h < H; ++h) lam.push_back(0.97 - 0.05 * double(h % 3));
    o.decay = from_vector(lam, {H}, DType::F32);
  }
  return o;
}

// Rows of 2 x 64 + 33 tokens: one-token documents, documents crossing the 64-token chunks, a chunk that holds
// several, and different cuts per row.
const std::vector<int64_t> kChunkCu{0, 1, 2, 70, 128, 129, 150, 161, 161 + 64, 161 + 65, 322, 322 + 30, 483};

// The chunk kernels' cases: kChunkCu, and rows that are one document each.
std::vector<FalDocCase> chunk_cases() {
  const int64_t N = 161;
  const std::vector<int64_t>& cu = kChunkCu;
  const std::vector<int64_t> whole{0, 161, 322, 483};
  std::vector<FalDocCase> c;
  c.push_back({"cosine D 128 E 128 decay", options(FalLrpe::Cosine, true, 3, 128), 3, N, 3, 128, 128, cu});
  c.push_back({"cosine D 64 E 64 no decay", options(FalLrpe::Cosine, false, 3, 64), 3, N, 3, 64, 64, cu});
  c.push_back({"none D 64 E 80 decay, no S0", options(FalLrpe::None, true, 3, 64), 3, N, 3, 64, 80, cu, false});
  c.push_back({"none D 128 E 32 decay, rows of one document", options(FalLrpe::None, true, 3, 128), 3, N, 3, 128,
               32, whole});
  return c;
}

// The calls that run the chunk sweep (16-token chunks): rows of 75 tokens, cut into segments of 32 at 3; one-token
// documents (at a row start, inside, at a chunk start), documents crossing chunks (16, 64) and the segment cut
// (32), one starting at the cut, and a row that is one document. dt: the inputs' dtype.
std::vector<std::pair<FalDocCase, DType>> sweep_cases() {
  const int64_t N = 75;
  const std::vector<int64_t> cu{0, 1, 2, 20, 33, 34, 47, 75, 75 + 16, 75 + 17, 75 + 32, 150, 225};
  const std::vector<int64_t> whole{0, 75, 150, 225};
  FalOptions soft = options(FalLrpe::None, true, 2, 64);
  soft.q = soft.k = kSoftmax;
  std::vector<std::pair<FalDocCase, DType>> c;
  c.push_back({{"f32 cosine D 64 E 64 decay", options(FalLrpe::Cosine, true, 2, 64), 3, N, 2, 64, 64, cu},
               DType::F32});
  c.push_back({{"f32 none D 64 E 64 decay, rows of one document", options(FalLrpe::None, true, 2, 64), 3, N, 2, 64,
                64, whole},
               DType::F32});
  c.push_back({{"bf16 rotate D 64 E 48 decay", options(FalLrpe::Rotate, true, 2, 64), 3, N, 2, 64, 48, cu},
               DType::BF16});
  c.push_back({{"bf16 softmax over the features D 64 E 32 decay", soft, 3, N, 2, 64, 32, cu}, DType::BF16});
  c.push_back({{"f32 none D 48 E 40 no decay, no S0", options(FalLrpe::None, false, 2, 48), 3, N, 2, 48, 40, cu,
                false},
               DType::F32});
  return c;
}

#if LINTAPE_WITH_CUDA
FalStepSpec doc_spec(const FalDocCase& c, const Documents& docs) {
  auto code = [](const ActSpec& a) {
    return a.act == Act::Silu      ? FalStepSpec::kSilu
           : a.act == Act::Sigmoid ? FalStepSpec::kSigmoid
           : a.act == Act::Softmax ? FalStepSpec::kSoftmaxFeature
                                   : FalStepSpec::kNone;
  };
  FalStepSpec spec;
  spec.act_q = code(c.o.q);
  spec.act_k = code(c.o.k);
  spec.act_v = code(c.o.v);
  spec.act_g = code(c.o.g);
  spec.lrpe = c.o.lrpe == FalLrpe::Cosine   ? FalStepSpec::kCosine
              : c.o.lrpe == FalLrpe::Rotate ? FalStepSpec::kRotate
                                            : FalStepSpec::kNoLrpe;
  if (c.o.theta.defined()) spec.theta = c.o.theta.to(gpu());
  spec.position = c.o.offset;
  if (c.o.decay.defined()) spec.decay = c.o.decay.to(gpu());
  spec.starts = docs.starts();
  return spec;
}

Tensor poisoned(const Shape& shape, DType type) {
  Tensor t = empty(shape, type, gpu());
  poison_(t);
  return t;
}

// The launchers at a segment cut (0: as the shapes want) against the documents alone; on the chunk kernels
// (chunks) again with the forward saving every chunk's entering state for the backward, and the even chunks'
// only (the backward advancing the odd chunks' across the chunk before), else on the sweep.
void check_doc_launchers(const FalDocCase& c, DType dt, int64_t segments, uint64_t seed, bool chunks = true) {
  CAPTURE(c.name);
  CAPTURE(segments);
  const std::vector<Tensor> values = fal_doc_rounded(fal_doc_values(c, seed), dt);
  const FalDocRun ref = fal_doc_run(c, values, DType::F64, Device::cpu(), Impl::Reference, true, dt);
  const Documents docs = Documents::from_cu_seqlens(c.cu, c.B, c.N, gpu());
  const FalStepSpec spec = doc_spec(c, docs);
  REQUIRE(fal_cuda::causal_chunked(dt, c.D, c.E, spec) == chunks);
  std::vector<Tensor> in;
  for (size_t i = 0; i < 4; ++i) in.push_back(values[i].to(dt).to(gpu()));
  const Tensor S0 = c.with_s0 ? values[4].to(DType::F32).to(gpu()) : Tensor();
  const Tensor dout = ref.w.to(dt).to(gpu()), dS = ref.ws.to(DType::F32).to(gpu());
  const int64_t P = fal_state_rows(c.o.lrpe, c.D), nC = (c.N + 63) / 64;
  for (int save : {0, 1, 2}) {  // none, every chunk's, the even chunks'
    if (save > 0 && !chunks) break;
    CAPTURE(save);
    const Tensor saved = save > 0 ? poisoned({c.B, c.H, save == 1 ? nC : (nC + 1) / 2, P, c.E}, dt) : Tensor();
    const Tensor out = poisoned({c.B, c.N, c.H, c.E}, dt), state = poisoned({c.B, c.H, P, c.E}, DType::F32);
    fal_cuda::causal_forward(in[0], in[1], in[2], in[3], spec, S0, out, state, segments, saved);
    std::vector<Tensor> grads;
    for (const Tensor& t : in) grads.push_back(poisoned(t.shape(), dt));
    if (c.with_s0) grads.push_back(poisoned(S0.shape(), DType::F32));
    fal_cuda::causal_backward(in[0], in[1], in[2], in[3], spec, S0, dout, dS, grads[0], grads[1], grads[2],
                              grads[3], c.with_s0 ? grads[4] : Tensor(), segments, saved);
    check_fal_doc_results(out, state, grads, ref, tolerance(dt));
  }
}
#endif

}  // namespace

TEST_CASE("cuda fal documents chunk kernels equal each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  uint64_t seed = 100;
  for (const FalDocCase& c : chunk_cases())
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t segments : {1, 2, 3, 0}) {
        CAPTURE(dtype_name(dt));
        check_doc_launchers(c, dt, segments, seed += 10);
      }
#endif
}

// B x H = 2: the shapes cut the 1000 tokens into many segments, and documents cross their cuts.
TEST_CASE("cuda fal documents chunk kernels long rows equal each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  FalDocCase c{"none D 64 E 64 decay, long", options(FalLrpe::None, true, 2, 64), 1, 1000, 2, 64, 64,
               {0, 63, 64, 300, 301, 640, 1000}};
  for (int64_t segments : {0, 5, 16}) check_doc_launchers(c, DType::BF16, segments, 200);
  c = {"cosine D 128 E 128 no decay, long", options(FalLrpe::Cosine, false, 2, 128), 1, 1000, 2, 128, 128,
       {0, 500, 513, 1000}};
  for (int64_t segments : {0, 7}) check_doc_launchers(c, DType::BF16, segments, 210);
#endif
}

// Fused with the forward saving every chunk's state, then the even chunks' only (the default), then Auto.
TEST_CASE("cuda fal documents fused and auto equal each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  struct Restore {
    ~Restore() { fal_paths::set_saved_states(fal_paths::SavedStates::Auto); }
  } restore;
  uint64_t seed = 300;
  for (const FalDocCase& c : chunk_cases())
    for (int run = 0; run < 3; ++run) {  // Fused with every state, Fused with half the states, Auto
      const Impl impl = run < 2 ? Impl::Fused : Impl::Auto;
      CAPTURE(run);
      fal_paths::set_saved_states(run == 0   ? fal_paths::SavedStates::All
                                  : run == 1 ? fal_paths::SavedStates::Half
                                             : fal_paths::SavedStates::Auto);
      check_fal_documents(c, DType::BF16, gpu(), impl, tolerance(DType::BF16), seed += 10);
    }
#endif
}

// The chunk sweep's launchers with documents: f32, rotate, softmax over the features, a D the chunk kernels do
// not take; whole rows and cuts of 2 and 3 segments (32 tokens each at 3).
TEST_CASE("cuda fal documents sweep equals each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  uint64_t seed = 500;
  for (const auto& [c, dt] : sweep_cases())
    for (int64_t segments : {1, 2, 3, 0}) {
      CAPTURE(dtype_name(dt));
      check_doc_launchers(c, dt, segments, seed += 10, false);
    }
#endif
}

// B x H = 2: the shapes cut the 1000 tokens into 8 segments of 128 (at 5: of 208; at 16: of 64), and documents
// cross the cuts or start at one.
TEST_CASE("cuda fal documents sweep long rows equal each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
#if LINTAPE_WITH_CUDA
  FalDocCase c{"f32 cosine D 64 E 64 decay, long", options(FalLrpe::Cosine, true, 2, 64), 1, 1000, 2, 64, 64,
               {0, 63, 64, 300, 301, 640, 1000}};
  for (int64_t segments : {0, 5, 16}) check_doc_launchers(c, DType::F32, segments, 600, false);
  c = {"bf16 rotate D 128 E 64 no decay, long", options(FalLrpe::Rotate, false, 2, 128), 1, 1000, 2, 128, 64,
       {0, 500, 513, 1000}};
  for (int64_t segments : {0, 7}) check_doc_launchers(c, DType::BF16, segments, 610, false);
#endif
}

// Rotate with documents on the chunk kernels (bf16/f16) behind the LRPE family's rotate kernels, whose positions
// restart at each document start: Impl::Fused and Auto against each document alone.
TEST_CASE("cuda fal documents rotate on the chunk kernels equals each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  FalOptions soft = options(FalLrpe::Rotate, false, 3, 64);
  soft.q = kSoftmax;
  const FalDocCase cases[] = {
      {"rotate D 128 E 64 decay", options(FalLrpe::Rotate, true, 3, 128), 3, 161, 3, 128, 64, kChunkCu},
      {"rotate D 64 E 48 softmax q, no decay, no S0", soft, 3, 161, 3, 64, 48, kChunkCu, false},
  };
  uint64_t seed = 900;
  for (const FalDocCase& c : cases)
    for (DType dt : {DType::BF16, DType::F16}) {
      const Tensor q = empty({c.B, c.N, c.H, c.D}, dt, gpu()), v = empty({c.B, c.N, c.H, c.E}, dt, gpu());
      FalOptions o = c.o;
      o.theta = o.theta.to(gpu());
      REQUIRE(fal_paths::rotates_first(q, v, o));
      for (Impl impl : {Impl::Fused, Impl::Auto}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(int(impl));
        check_fal_documents(c, dt, gpu(), impl, tolerance(dt), seed += 10);
      }
    }
}

// Impl::Fused runs the sweep's calls with documents (bf16 rotate: the chunk kernels behind the rotation, as above;
// the launchers run it on the sweep); for f32 also Auto and Composed (Auto runs Composed for calls
// that record gradients on the sweep).
TEST_CASE("cuda fal documents sweep fused, auto and composed equal each document alone" * LT_CUDA_CASE) {
  LT_REQUIRE_CUDA();
  uint64_t seed = 700;
  for (const auto& [c, dt] : sweep_cases())
    for (Impl impl : {Impl::Fused, Impl::Auto, Impl::Composed}) {
      if (impl != Impl::Fused && dt != DType::F32) continue;
      CAPTURE(int(impl));
      CAPTURE(dtype_name(dt));
      check_fal_documents(c, dt, gpu(), impl, tolerance(dt), seed += 10);
    }
  const FalDocCase c = chunk_cases()[2];  // f32: the sweep
  for (Impl impl : {Impl::Fused, Impl::Auto, Impl::Composed})
    check_fal_documents(c, DType::F32, gpu(), impl, 1e-5, 400);
  const std::vector<Tensor> v = fal_doc_values(c, 410);
  FalOptions o = c.o;
  o.decay = o.decay.to(gpu());
  o.documents = Documents::from_cu_seqlens(c.cu, c.B, c.N);
  std::vector<Tensor> x;
  for (size_t i = 0; i < 4; ++i) x.push_back(v[i].to(DType::F32).to(gpu()));
  check_throws_containing([&] { fal(x[0], x[1], x[2], x[3], o); }, {"[fal]", "documents are on cpu", "cuda"});
}
