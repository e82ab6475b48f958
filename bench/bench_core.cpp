// Benchmarks of the core and the primitive ops: copy (the bandwidth reference), matmul, rms-norm,
// softmax and cross-entropy. The memory-bound ones compare the fused op ("fused") with the same math
// through primitive ops and the tape ("composed").
#include <algorithm>
#include <cmath>
#include "bench/harness.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/reduce.h"
#include "ops/rms_norm.h"
#if LINTAPE_WITH_CUDA
#include "ops/matmul_cuda.h"
#endif

namespace lintape::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double elem(DType t) { return double(dtype_size(t)); }

Tensor input(const Shape& shape, const Case& c, uint64_t which) {
  return randn(shape, c.dtype, c.device, c.seed * 16 + which).requires_grad_();
}

const Registration copy_bench({
    "copy", "Tensor::copy_ of n MiB between two contiguous tensors on one device", {"copy"},
    [](const RunOptions& o) {
      Config c;
      c.stem = str("copy-{metric}-{mode}-", dtype_name(o.dtype));
      c.x_name = "mib";
      // On the CPU only the size the floors use: a smaller copy stays in the caches and would show
      // more than 100% of copy.
      c.ns = pick_sizes(o, {16, 64, 256, 1024, 4096}, {64, 1024}, {copy_reference_mib(o.device)});
      c.modes = {Mode::Fwd};
      c.measures_copy_bandwidth = true;
      c.make = [](const Case& k) -> Call {
        Tensor src = empty({int64_t(double(k.n) * kMiB / elem(k.dtype))}, k.dtype, k.device);
        src.fill_(1.0);
        Tensor dst = empty_like(src);
        return [src, dst]() mutable { dst.copy_(src); };
      };
      c.floor_bytes = [](int64_t n, Mode) { return 2.0 * double(n) * kMiB; };
      return std::vector<Config>{c};
    }});

// matmul: "lintape" is matmul() (cuBLASLt's first heuristic); "cuBLASLt best" times every algorithm the
// heuristic offers for the shape and keeps the fastest.
Call matmul_call(const Case& k, int64_t m, int64_t kdim, int64_t n) {
  Tensor a = randn({m, kdim}, k.dtype, k.device, k.seed * 16);
  Tensor b = randn({kdim, n}, k.dtype, k.device, k.seed * 16 + 1);
  if (k.provider == "lintape") return [a, b] { matmul(a, b); };
#if LINTAPE_WITH_CUDA
  if (k.device.is_cuda()) {
    Tensor c = empty({m, n}, k.dtype, k.device);
    int best = -1;
    double best_ms = INFINITY;
    const int count = matmul_heuristic_count(a, b, false, false);
    for (int rank = 0; rank < count; ++rank) {
      try {
        double ms = median_ms({[=]() mutable { matmul_into(a, b, c, false, false, rank); }}, k.device, 20, 20);
        if (ms < best_ms) best = rank, best_ms = ms;
      } catch (const Error&) {  // an algorithm that cannot run this shape is skipped
      }
    }
    LT_CHECK(best >= 0, "[bench] no cuBLASLt algorithm ran (", m, " x ", kdim, ") @ (", kdim, " x ", n, ")");
    return [=]() mutable { matmul_into(a, b, c, false, false, best); };
  }
#endif
  unsupported("cuBLASLt best needs a CUDA device");
}

const Registration matmul_bench({
    "matmul", "GEMMs: square n x n x n, and tokens x 768 x 3072 / tokens x 3072 x 768 (LM MLP)",
    {"lintape", "cuBLASLt best"},
    [](const RunOptions& o) {
      struct Shape3 {
        const char* name;
        const char* x_name;
        int64_t k, n;  // 0: n (square)
        std::vector<int64_t> cuda, quick, cpu;
      };
      const std::vector<Shape3> shapes = {
          {"square", "n", 0, 0, {1024, 2048, 4096, 8192}, {1024, 4096, 8192}, {64, 128, 256}},
          {"k768-n3072", "tokens", 768, 3072, {1024, 4096, 16384, 65536}, {4096, 16384}, {16, 64}},
          {"k3072-n768", "tokens", 3072, 768, {1024, 4096, 16384, 65536}, {4096, 16384}, {16, 64}},
      };
      std::vector<Config> out;
      for (const Shape3& s : shapes) {
        Config c;
        c.stem = str("matmul-{metric}-{mode}-", s.name, "-", dtype_name(o.dtype));
        c.x_name = s.x_name;
        c.ns = pick_sizes(o, s.cuda, s.quick, s.cpu);
        c.modes = {Mode::Fwd};
        int64_t kk = s.k, nn = s.n;
        c.make = [kk, nn](const Case& k) { return matmul_call(k, k.n, kk ? kk : k.n, nn ? nn : k.n); };
        c.flops = [kk, nn](int64_t m, Mode) { return 2.0 * double(m) * double(kk ? kk : m) * double(nn ? nn : m); };
        out.push_back(c);
      }
      return out;
    }});

// A memory-bound op over a (rows, cols) input, n = rows. Its floor: `fwd_moves` (`bwd_moves`) elements of
// the dtype read or written per input element.
Config rowwise(const RunOptions& o, const std::string& name, int64_t cols, std::vector<int64_t> ns,
               double fwd_moves, double bwd_moves, std::function<Forward(const std::string& provider)> forward,
               std::function<std::vector<Tensor>(const Case&, int64_t cols)> inputs) {
  Config c;
  c.stem = str(name, "-{metric}-{mode}-dim", cols, "-", dtype_name(o.dtype));
  c.ns = std::move(ns);
  c.make = [cols, forward, inputs](const Case& k) {
    return op_call(k.mode, inputs(k, cols), forward(k.provider), k.seed);
  };
  DType dt = o.dtype;
  c.floor_bytes = [=](int64_t rows, Mode m) {
    return (m == Mode::Fwd ? fwd_moves : bwd_moves) * double(rows) * double(cols) * elem(dt);
  };
  return c;
}

std::vector<Tensor> one_input(const Case& k, int64_t cols) { return {input({k.n, cols}, k, 0)}; }

const Registration rms_norm_bench({
    "rms-norm", "rms_norm over rows of 768, and of 128 (a head's norm, as the FAL mixer's)", {"fused", "composed"},
    [](const RunOptions& o) {
      auto forward = [](const std::string& provider) -> Forward {
        if (provider == "fused") return [](const std::vector<Tensor>& v) { return rms_norm(v[0], v[1]); };
        return [](const std::vector<Tensor>& v) {
          const Tensor& x = v[0];
          return x * rsqrt(mean(x * x, {-1}, true) + 1e-6) * v[1];
        };
      };
      auto inputs = [](const Case& k, int64_t cols) {
        return std::vector<Tensor>{input({k.n, cols}, k, 0), input({cols}, k, 1)};
      };
      // fwd reads x, writes y; bwd reads x and dy, writes dx (the weight and the per-row rms are small)
      return std::vector<Config>{
          rowwise(o, "rms_norm", 768, pick_sizes(o, {1024, 4096, 16384, 65536}, {1024, 16384}, {64, 256, 1024}), 2,
                  3, forward, inputs),
          rowwise(o, "rms_norm", 128, pick_sizes(o, {6144, 49152, 196608}, {6144, 196608}, {64, 1024}), 2, 3, forward,
                  inputs)};
    }});

const Registration softmax_bench({
    "softmax", "softmax over the last dim of rows of 8192 (a vocabulary)", {"fused", "composed"},
    [](const RunOptions& o) {
      auto forward = [](const std::string& provider) -> Forward {
        if (provider == "fused") return [](const std::vector<Tensor>& v) { return softmax(v[0], -1); };
        return [](const std::vector<Tensor>& v) {
          Tensor e = exp(v[0] - max(v[0], -1, true).values);
          return e / sum(e, {-1}, true);
        };
      };
      // fwd reads x, writes y; bwd reads y and dy, writes dx
      return std::vector<Config>{rowwise(o, "softmax", 8192,
                                         pick_sizes(o, {1024, 4096, 16384, 65536}, {1024, 16384}, {16, 64, 256}), 2,
                                         3, forward, one_input)};
    }});

// Composed cross-entropy picks each token's log-probability with an embedding lookup into the
// flattened log-softmax (row t * V + target): a gather whose backward is a scatter, as in the fused op.
const Registration cross_entropy_bench({
    "cross-entropy", "mean cross-entropy of tokens x vocabulary 32768 logits", {"fused", "composed"},
    [](const RunOptions& o) {
      const int64_t vocab = 32768;
      auto forward = [vocab](const std::string& provider) -> Forward {
        if (provider == "fused") return [](const std::vector<Tensor>& v) { return cross_entropy(v[0], v[1]); };
        return [vocab](const std::vector<Tensor>& v) {
          int64_t tokens = v[0].size(0);
          Tensor logp = log_softmax(v[0], -1).view({tokens * vocab, 1});
          return neg(mean(embedding(logp, v[2])));
        };
      };
      auto inputs = [](const Case& k, int64_t cols) {
        std::vector<double> u = rand({k.n}, DType::F64, Device::cpu(), k.seed * 16 + 1).to_vector<double>();
        std::vector<int64_t> targets, flat;
        for (int64_t t = 0; t < k.n; ++t) {
          targets.push_back(std::min(cols - 1, int64_t(u[size_t(t)] * double(cols))));
          flat.push_back(t * cols + targets.back());
        }
        return std::vector<Tensor>{input({k.n, cols}, k, 0), from_vector_i64(targets, {k.n}, k.device),
                                   from_vector_i64(flat, {k.n}, k.device)};
      };
      // fwd reads the logits; bwd reads them and writes their gradient
      return std::vector<Config>{rowwise(o, "cross_entropy", vocab,
                                         pick_sizes(o, {1024, 4096, 16384}, {1024, 4096}, {16, 64}), 1, 2, forward,
                                         inputs)};
    }});

}  // namespace
}  // namespace lintape::bench
