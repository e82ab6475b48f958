// Benchmarks of the FAL family. `fal`: the seeds' noncausal configuration (B = H = 12, D = E = 128, cosine
// LRPE; q, k, g silu, and q softmax over the feature dim with k, g silu), floor and % copy. `fal-causal`:
// causal with cosine LRPE, silu acts and a per-head decay (B = H = 12, D = E = 128, the language model's
// B = 16, H = 6, N = 2048, and B = 1, H = 8 at N = 8192 and 32768; the model's shape again with rotate LRPE,
// which runs the chunk kernels behind the LRPE family's rotate kernels), TFLOP/s of the chunked algorithm and
// % copy, with packed documents under --documents L (the title says docs<L>); and the decoding step (B = 8,
// H = 12, D = E = 128). "fused" is Impl::Fused on CUDA (the op's CPU reference on the CPU); "composed" is
// Impl::Composed.
#include <cmath>
#include "bench/harness.h"
#include "ops/fal/fal.h"

namespace lintape::bench {
namespace {

struct Dims {
  int64_t B, H, D;
};
Dims dims(const RunOptions& o) { return o.device.is_cuda() ? Dims{12, 12, 128} : Dims{1, 2, 64}; }
std::string dims_tag(const Dims& d) { return str("batch", d.B, "-head", d.H, "-dim", d.D, "-dim", d.D); }

// theta (H, D): rates 10000^(-k/D), the same for every head.
Tensor make_theta(int64_t H, int64_t D, Device device) {
  std::vector<double> v;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < D; ++k) v.push_back(std::pow(10000.0, -double(k) / double(D)));
  return from_vector(v, {H, D}, DType::F32, device);
}

// Per-head decay 1 - 2^-(5 + h / 2), between 0.97 and 0.998.
Tensor make_decay(int64_t H, Device device) {
  std::vector<double> v;
  for (int64_t h = 0; h < H; ++h) v.push_back(1.0 - std::pow(2.0, -(5.0 + double(h) / 2)));
  return from_vector(v, {H}, DType::F32, device);
}

Impl impl_of(const Case& c) {
  if (c.provider == "composed") return Impl::Composed;
  return c.device.is_cuda() ? Impl::Fused : Impl::Reference;
}

Call fal_call(const Case& k, const Dims& d, const FalOptions& opts) {
  std::vector<Tensor> in;
  for (int i = 0; i < 4; ++i)
    in.push_back(randn({d.B, k.n, d.H, d.D}, k.dtype, k.device, k.seed + uint64_t(i)).requires_grad_());
  const Impl impl = impl_of(k);
  Forward f = [opts, impl](const std::vector<Tensor>& v) { return fal(v[0], v[1], v[2], v[3], opts, impl); };
  return op_call(k.mode, in, f, k.seed);
}

FalOptions cosine_options(const Dims& d, Device device, ActSpec q) {
  FalOptions o;
  o.q = q;
  o.k = o.g = {Act::Silu, ActDim::None};
  o.lrpe = FalLrpe::Cosine;
  o.theta = make_theta(d.H, d.D, device);
  return o;
}

// Floors (PERFORMANCE.md): forward reads q, k, v, g and writes o (5 tensors); backward reads q, k, v, g, do and
// writes 4 gradients (9).
std::function<double(int64_t, Mode)> floor_of(const Dims& d, DType dt) {
  const double elem = double(dtype_size(dt));
  return [d, elem](int64_t n, Mode m) { return (m == Mode::Fwd ? 5 : 9) * elem * double(d.B * n * d.H * d.D); };
}

std::vector<Config> noncausal_configs(const RunOptions& o) {
  const Dims d = dims(o);
  struct QAct {
    const char* tag;
    ActSpec q;
  };
  const QAct acts[] = {{"act_silu", {Act::Silu, ActDim::None}},
                       {"act_q_softmax-dim_-1", {Act::Softmax, ActDim::Feature}}};
  std::vector<Config> out;
  for (const QAct& a : acts) {
    Config c;
    c.stem = str("fal-{metric}-{mode}-", dims_tag(d), "-", a.tag, "-", dtype_name(o.dtype));
    c.ns = pick_sizes(o, powers_of_two(256, 32768), {256, 1024, 4096, 8192}, powers_of_two(128, 512));
    const ActSpec q = a.q;
    c.make = [d, q](const Case& k) { return fal_call(k, d, cosine_options(d, k.device, q)); };
    c.floor_bytes = floor_of(d, o.dtype);
    out.push_back(c);
  }
  return out;
}

Config causal_config(const RunOptions& o, const Dims& d, std::vector<int64_t> ns, bool rotate = false) {
  Config c;
  c.stem = str("fal_causal-{metric}-{mode}-", dims_tag(d), rotate ? "-rotate" : "-cosine", "-act_silu-decay",
               documents_tag(o.document_length), "-", dtype_name(o.dtype));
  c.ns = std::move(ns);
  const int64_t doc_len = o.document_length;
  c.make = [d, doc_len, rotate](const Case& k) {
    FalOptions opts = cosine_options(d, k.device, {Act::Silu, ActDim::None});
    if (rotate) {
      opts.lrpe = FalLrpe::Rotate;
      opts.theta = make_theta(d.H, d.D / 2, k.device);
    }
    opts.causal = true;
    opts.decay = make_decay(d.H, k.device);
    opts.documents = bench_documents(d.B, k.n, doc_len, k.device);
    return fal_call(k, d, opts);
  };
  c.floor_bytes = floor_of(d, o.dtype);
  // The chunked algorithm with chunks of C = 64 and D' = 2D (rotate: D): per token and head, scores and their
  // product with v inside the chunk (2 C D' + 2 C E) and the state's read and update (4 D' E); backward counted
  // as twice the forward.
  c.flops = [d, rotate](int64_t n, Mode m) {
    const double C = 64, P = (rotate ? 1.0 : 2.0) * double(d.D), E = double(d.D);
    const double fwd = double(d.B * d.H * n) * (2 * C * P + 2 * C * E + 4 * P * E);
    return m == Mode::Fwd ? fwd : 2 * fwd;
  };
  return c;
}

std::vector<Config> causal_configs(const RunOptions& o) {
  const Dims d = dims(o);
  std::vector<Config> out;
  out.push_back(causal_config(o, d, pick_sizes(o, powers_of_two(1024, 16384), {1024, 4096, 8192}, {128, 256})));
  // The language model's mixer: B = 16, H = 6, N = 2048 (D = E = 128); and one long sequence over few heads,
  // where B x H alone would leave most SMs idle and the kernels cut the sequence.
  if (o.device.is_cuda()) {
    out.push_back(causal_config(o, Dims{16, 6, 128}, {2048}));
    out.push_back(causal_config(o, Dims{1, 8, 128}, pick_sizes(o, {8192, 32768}, {8192}, {8192})));
    out.push_back(causal_config(o, Dims{16, 6, 128}, {2048}, true));
  }

  // One decoding step (B = 8 on CUDA), x = batch.
  Config s;
  const int64_t B = o.device.is_cuda() ? 8 : 1;
  s.stem = str("fal_step-{metric}-{mode}-head", d.H, "-dim", d.D, "-dim", d.D, "-cosine-act_silu-decay-",
               dtype_name(o.dtype));
  s.ns = {B};
  s.x_name = "batch";
  s.modes = {Mode::Fwd};
  s.make = [d](const Case& k) -> Call {
    if (k.provider == "composed") unsupported("fal_step has one implementation per device");
    FalOptions opts = cosine_options(d, k.device, {Act::Silu, ActDim::None});
    opts.causal = true;
    opts.decay = make_decay(d.H, k.device);
    opts.offset = 1000;
    std::vector<Tensor> in;
    for (int i = 0; i < 4; ++i) in.push_back(randn({k.n, 1, d.H, d.D}, k.dtype, k.device, k.seed + uint64_t(i)));
    auto state = std::make_shared<Tensor>(randn({k.n, d.H, 2 * d.D, d.D}, DType::F32, k.device, k.seed + 9));
    return [in, opts, state] { fal_step(*state, in[0], in[1], in[2], in[3], opts); };
  };
  // Reads and writes the f32 state; the token's rows are negligible.
  s.floor_bytes = [d](int64_t b, Mode) { return 2.0 * 4 * double(b * d.H * 2 * d.D * d.D); };
  out.push_back(s);
  return out;
}

const Registration fal_bench({"fal",
                              "FAL noncausal (act + cosine LRPE + linear "
                              "attention + gate), the seeds' table",
                              {"fused", "composed"},
                              noncausal_configs});
const Registration fal_causal_bench(
    {"fal-causal", "FAL causal with decay (chunked), and the decoding step", {"fused", "composed"}, causal_configs});

}  // namespace
}  // namespace lintape::bench
