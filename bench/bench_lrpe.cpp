// Benchmarks of the LRPE family at the seeds' configurations: lrpe-cosine and lrpe-rotate (acts none,
// silu, softmax over the feature dim and over the sequence) and md-lrpe-cosine (1d, 2d and 3d grids
// with 0 or 10 extra tokens). "fused" is Impl::Fused on CUDA and the op's CPU reference on the CPU;
// "fused cache" adds MdLrpeOptions::cache_angles; "composed" is Impl::Composed. With --documents L the 1d
// tables cut every row into documents of L tokens.
#include <cmath>
#include "bench/harness.h"
#include "ops/lrpe/lrpe.h"

namespace lintape::bench {
namespace {

// The seeds' batch, heads and head dim on CUDA; fewer on the CPU so that a CPU run takes seconds.
struct Dims {
  int64_t B, H, D;
};
Dims dims(const RunOptions& o) { return o.device.is_cuda() ? Dims{12, 12, 128} : Dims{2, 2, 128}; }
std::string dims_tag(const Dims& d) { return str("batch", d.B, "-head", d.H, "-dim", d.D); }

// theta (H, E): rates 10000^(-k/E), the same for every head.
Tensor make_theta(int64_t H, int64_t E, Device device) {
  std::vector<double> v;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < E; ++k) v.push_back(std::pow(10000.0, -double(k) / double(E)));
  return from_vector(v, {H, E}, DType::F32, device);
}

Impl impl_of(const Case& c) {
  if (c.provider == "composed") return Impl::Composed;
  return c.device.is_cuda() ? Impl::Fused : Impl::Auto;
}

struct ActCase {
  const char* tag;
  Act act;
  ActDim dim;
};
const ActCase kActs[] = {{"act_none", Act::None, ActDim::None},
                         {"act_silu", Act::Silu, ActDim::None},
                         {"act_softmax-dim_-1", Act::Softmax, ActDim::Feature},
                         {"act_softmax-dim_-2", Act::Softmax, ActDim::Sequence}};

// Floors, in elements of x's dtype moved per element of x: cosine reads x and writes 2x (3); its
// backward reads dout (2) and writes dx (1), and also reads x behind an act (4). Rotate: 2, 2, 3.
std::vector<Config> lrpe_configs(const RunOptions& o, bool rotate) {
  const Dims d = dims(o);
  const double elem = double(dtype_size(o.dtype));
  std::vector<Config> out;
  const int64_t doc_len = o.document_length;
  for (const ActCase& a : kActs) {
    Config c;
    c.stem = str(rotate ? "lrpe_rotate" : "lrpe_cosine", "-{metric}-{mode}-", dims_tag(d), "-", a.tag, "-",
                 dtype_name(o.dtype), documents_tag(doc_len));
    c.ns = pick_sizes(o, powers_of_two(256, 32768), {256, 1024, 4096, 8192}, powers_of_two(128, 1024));
    const LrpeOptions opts{0, a.act, a.dim};
    c.make = [d, opts, rotate, doc_len](const Case& k) {
      Tensor x = randn({d.B, k.n, d.H, d.D}, k.dtype, k.device, k.seed).requires_grad_();
      Tensor theta = make_theta(d.H, rotate ? d.D / 2 : d.D, k.device);
      Impl impl = impl_of(k);
      LrpeOptions with_docs = opts;
      with_docs.documents = bench_documents(d.B, k.n, doc_len, k.device);
      Forward f = [theta, opts = with_docs, rotate, impl](const std::vector<Tensor>& v) {
        return rotate ? lrpe_rotate(v[0], theta, opts, impl) : lrpe_cosine(v[0], theta, opts, impl);
      };
      return op_call(k.mode, {x}, f, k.seed);
    };
    const double fwd = rotate ? 2 : 3, bwd = fwd + (a.act == Act::None ? 0 : 1);
    c.floor_bytes = [=](int64_t n, Mode m) {
      return (m == Mode::Fwd ? fwd : bwd) * elem * double(d.B * n * d.H * d.D);
    };
    out.push_back(c);
  }
  return out;
}

// n is the sequence length for 1d grids and the side for 2d and 3d (n^k tokens), as in the seeds.
// Floor: as LRPE cosine, 3 elements per element of x both ways.
std::vector<Config> md_configs(const RunOptions& o) {
  const Dims d = dims(o);
  const double elem = double(dtype_size(o.dtype));
  struct Grid {
    int k;
    std::vector<int64_t> cuda, quick, cpu;
  };
  const Grid grids[] = {{1, powers_of_two(256, 32768), {256, 1024, 4096, 8192}, powers_of_two(128, 1024)},
                        {2, powers_of_two(16, 128), {16, 64}, {8, 16, 32}},
                        {3, powers_of_two(4, 32), {4, 16}, {2, 4, 8}}};
  std::vector<Config> out;
  for (const Grid& g : grids) {
    for (int64_t L : {0, 10}) {
      Config c;
      c.stem = str("md_lrpe_cosine-{metric}-{mode}-", dims_tag(d), "-", dtype_name(o.dtype), "-", g.k, "d-l", L);
      c.ns = pick_sizes(o, g.cuda, g.quick, g.cpu);
      const int axes = g.k;
      auto tokens = [axes, L](int64_t n) { return L + int64_t(std::llround(std::pow(double(n), axes))); };
      c.make = [d, axes, L, tokens](const Case& k) {
        MdLrpeOptions opts;
        opts.shape.assign(size_t(axes), k.n);
        opts.extra_tokens = L;
        opts.cache_angles = k.provider == "fused cache";
        Tensor x = randn({d.B, tokens(k.n), d.H, d.D}, k.dtype, k.device, k.seed).requires_grad_();
        Tensor theta = make_theta(d.H, (d.D + axes - 1) / axes, k.device);
        Impl impl = impl_of(k);
        Forward f = [theta, opts, impl](const std::vector<Tensor>& v) {
          return md_lrpe_cosine(v[0], theta, opts, impl);
        };
        return op_call(k.mode, {x}, f, k.seed);
      };
      c.floor_bytes = [=](int64_t n, Mode) { return 3 * elem * double(d.B * tokens(n) * d.H * d.D); };
      out.push_back(c);
    }
  }
  return out;
}

const Registration cosine_bench({"lrpe-cosine", "LRPE cosine 1d (x -> [x cos, x sin]) with each act",
                                 {"fused", "composed"},
                                 [](const RunOptions& o) { return lrpe_configs(o, false); }});
const Registration rotate_bench({"lrpe-rotate", "LRPE rotate 1d (half-split rotary) with each act",
                                 {"fused", "composed"},
                                 [](const RunOptions& o) { return lrpe_configs(o, true); }});
const Registration md_bench({"md-lrpe-cosine", "md-LRPE cosine over 1d, 2d and 3d token grids, 0 or 10 extra tokens",
                             {"fused", "fused cache", "composed"}, md_configs});

}  // namespace
}  // namespace lintape::bench
