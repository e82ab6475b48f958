// Benchmarks of the TPA family. tpa-decode: the seeds' table (batch 8 and 32, head 32, rank 16 for q and
// 1 for k and v, dim 128, cache m = 256 ... 32768), one query token per sequence; "fused" is Impl::Fused
// on CUDA and the CPU reference on the CPU, "composed" materialises q, k and v and attends through
// primitive ops. tpa-attention: causal training at batch 8, head 16 and, on CUDA, at the small model's
// batch 16, head 6 (dim 128, ranks (6, 2, 2)): "fused"
// is the tensor-core flash-style kernel pair (Impl::Fused on CUDA, the CPU reference on the CPU),
// "composed" the same math through primitive ops (up to N = 4096: it holds the N x N scores). With
// --documents L every row is cut into documents of L tokens (TpaOptions::documents).
#include "bench/harness.h"
#include "ops/tpa/tpa.h"

namespace lintape::bench {
namespace {

Impl impl_of(const Case& c) {
  if (c.provider == "composed") return Impl::Composed;
  return c.device.is_cuda() ? Impl::Fused : Impl::Reference;
}

struct DecodeDims {
  int64_t B, H, Rq, D;
};

std::vector<Config> decode_configs(const RunOptions& o) {
  const bool cuda = o.device.is_cuda();
  const double elem = double(dtype_size(o.dtype));
  std::vector<Config> out;
  for (int64_t batch : {8, 32}) {
    const DecodeDims d = cuda ? DecodeDims{batch, 32, 16, 128} : DecodeDims{batch / 8, 4, 16, 128};
    Config c;
    c.stem = str("tpa_decode-{metric}-{mode}-batch", d.B, "-head", d.H, "-rank", d.Rq, "-dim", d.D, "-",
                 dtype_name(o.dtype));
    c.modes = {Mode::Fwd};
    c.x_name = "m";
    c.ns = pick_sizes(o, powers_of_two(256, 32768), {256, 2048, 8192}, {64, 256});
    c.make = [d](const Case& k) {
      auto r = [&](const Shape& s, uint64_t i) { return randn(s, k.dtype, k.device, k.seed * 8 + i); };
      const int64_t M = k.n;
      std::vector<Tensor> in = {r({d.B, 1, d.H, d.Rq}, 0), r({d.B, 1, d.Rq, d.D}, 1), r({d.B, M, d.H}, 2),
                                r({d.B, M, d.D}, 3),        r({d.B, M, d.H}, 4),        r({d.B, M, d.D}, 5)};
      const Impl impl = impl_of(k);
      Forward f = [impl](const std::vector<Tensor>& v) {
        return tpa_decode(v[0], v[1], v[2], v[3], v[4], v[5], {}, impl);
      };
      return op_call(k.mode, in, f, k.seed);
    };
    // The cache rows (ak, bk, av, bv) are read once; the query factors and the output are negligible.
    c.floor_bytes = [=](int64_t m, Mode) { return elem * double(d.B * m * (2 * d.H + 2 * d.D)); };
    out.push_back(c);
  }
  return out;
}

// One causal table at batch B, head H, dim 128, ranks (6, 2, 2).
Config attention_config(const RunOptions& o, int64_t B, int64_t H, const std::vector<int64_t>& cuda_ns) {
  const int64_t D = 128, Rq = 6, Rk = 2, Rv = 2;
  Config c;
  const int64_t doc_len = o.document_length;
  c.stem = str("tpa_attention-{metric}-{mode}-batch", B, "-head", H, "-dim", D, "-rank6_2_2-causal-",
               dtype_name(o.dtype), documents_tag(doc_len));
  c.ns = pick_sizes(o, cuda_ns, {cuda_ns.front(), cuda_ns[1]}, {64, 128});
  c.make = [=](const Case& k) {
    auto r = [&](const Shape& s, uint64_t i) {
      return randn(s, k.dtype, k.device, k.seed * 8 + i).requires_grad_();
    };
    const int64_t N = k.n;
    // The composed path holds (B, H, N, N) scores: 4096 is the largest N that fits beside its backward.
    LT_CHECK(k.provider != "composed" || N <= 4096 || !k.device.is_cuda(),
             "[tpa-attention] composed is not run past N = 4096 (its N x N scores); got N = ", N);
    std::vector<Tensor> in = {r({B, N, H, Rq}, 0), r({B, N, Rq, D}, 1), r({B, N, H, Rk}, 2),
                              r({B, N, Rk, D}, 3), r({B, N, H, Rv}, 4), r({B, N, Rv, D}, 5)};
    const Impl impl = impl_of(k);
    TpaOptions opts;
    opts.documents = bench_documents(B, N, doc_len, k.device);
    Forward f = [impl, opts](const std::vector<Tensor>& v) {
      return tpa_attention(v[0], v[1], v[2], v[3], v[4], v[5], opts, impl);
    };
    return op_call(k.mode, in, f, k.seed);
  };
  // Causal attention: half of the 4 B H N^2 D multiply-adds of QK^T and PV; backward 2.5x. Counted the
  // same with documents (which skip most of them), so that the rates compare at the same token count.
  c.flops = [=](int64_t n, Mode m) {
    const double fwd = 2.0 * double(B * H * D) * double(n) * double(n);
    return m == Mode::Fwd ? fwd : 2.5 * fwd;
  };
  return c;
}

// The seeds' shape (batch 8, head 16) and, on CUDA, the small language model's (batch 16, head 6).
std::vector<Config> attention_configs(const RunOptions& o) {
  if (!o.device.is_cuda()) return {attention_config(o, 1, 2, {1024, 2048})};
  return {attention_config(o, 8, 16, powers_of_two(1024, 8192)), attention_config(o, 16, 6, {1024, 2048, 4096})};
}

const Registration decode_bench({"tpa-decode", "TPA decode: one query token over a cache of factor rows",
                                 {"fused", "composed"}, decode_configs});
const Registration attention_bench({"tpa-attention", "TPA causal attention for training (forward, backward)",
                                    {"fused", "composed"}, attention_configs});

}  // namespace
}  // namespace lintape::bench
