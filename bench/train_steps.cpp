#include "bench/train_steps.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <random>

#include "autograd/tape.h"
#include "bench/harness.h"
#include "core/allocator.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "train/trainer.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape::bench {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Points in time on the device's queue: CUDA events on the lintape stream, or the host clock on the CPU.
// Elapsed times are read after one synchronisation at the end, so timing does not stall the queue.
class Stamps {
 public:
  explicit Stamps(Device d) : device_(d) {}
  Stamps(const Stamps&) = delete;
  Stamps& operator=(const Stamps&) = delete;
  ~Stamps() {
#if LINTAPE_WITH_CUDA
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
#endif
  }
  size_t mark() {
#if LINTAPE_WITH_CUDA
    if (device_.is_cuda()) {
      cudaEvent_t e;
      LT_CUDA_CHECK(cudaEventCreate(&e));
      LT_CUDA_CHECK(cudaEventRecord(e, cuda::stream(device_.index)));
      events_.push_back(e);
      return events_.size() - 1;
    }
#endif
    times_.push_back(std::chrono::steady_clock::now());
    return times_.size() - 1;
  }
  // Milliseconds between two marks; call after synchronize(device).
  double ms(size_t from, size_t to) const {
#if LINTAPE_WITH_CUDA
    if (device_.is_cuda()) {
      float out = 0;
      LT_CUDA_CHECK(cudaEventElapsedTime(&out, events_[from], events_[to]));
      return double(out);
    }
#endif
    return std::chrono::duration<double, std::milli>(times_[to] - times_[from]).count();
  }

 private:
  Device device_;
#if LINTAPE_WITH_CUDA
  std::vector<cudaEvent_t> events_;
#endif
  std::vector<std::chrono::steady_clock::time_point> times_;
};

// A part of the model as a function of earlier values (by index); value 0 is the token ids.
struct Part {
  std::string name, kind;
  std::vector<size_t> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> run;
};

std::vector<Part> model_parts(const LanguageModel& m, const Tensor& targets, size_t* loss_value) {
  std::vector<Part> parts;
  size_t next = 1;  // the next value's index
  auto add_part = [&](std::string name, std::string kind, std::vector<size_t> in,
                      std::function<Tensor(const std::vector<Tensor>&)> fn) {
    parts.push_back({std::move(name), std::move(kind), std::move(in), std::move(fn)});
    return next++;
  };
  // As LanguageModel::forward: wte cast to the compute dtype feeds the embedding and the tied head (the
  // head casts its own copy here, so that the parts stay apart), the loss in float32.
  size_t x = add_part("embedding", "embedding", {0}, [&m](const std::vector<Tensor>& v) {
    return embedding(m.wte.to(m.compute_dtype()), v[0]);
  });
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const Block& b = *m.blocks[i];
    const std::string p = "blocks." + std::to_string(i) + ".";
    const std::string mixer = b.fal ? "fal" : "tpa";
    size_t h = add_part(p + "norm1", "norm", {x}, [&b](const std::vector<Tensor>& v) { return b.norm1.forward(v[0]); });
    size_t mixed = add_part(p + mixer, mixer, {h}, [&b](const std::vector<Tensor>& v) {
      return b.fal ? b.fal->forward(v[0]) : b.tpa->forward(v[0]);
    });
    size_t y = add_part(p + "residual1", "residual", {x, mixed}, [](const std::vector<Tensor>& v) { return add(v[0], v[1]); });
    size_t h2 = add_part(p + "norm2", "norm", {y}, [&b](const std::vector<Tensor>& v) { return b.norm2.forward(v[0]); });
    size_t mlp = add_part(p + "mlp", "mlp", {h2}, [&b](const std::vector<Tensor>& v) { return b.mlp.forward(v[0]); });
    x = add_part(p + "residual2", "residual", {y, mlp}, [](const std::vector<Tensor>& v) { return add(v[0], v[1]); });
  }
  size_t normed = add_part("norm", "final norm", {x}, [&m](const std::vector<Tensor>& v) { return m.norm.forward(v[0]); });
  *loss_value = add_part("head and loss", "head and loss", {normed}, [&m, targets](const std::vector<Tensor>& v) {
    return m.head_loss(v[0], m.wte.to(m.compute_dtype()), targets);
  });
  return parts;
}

}  // namespace

int64_t TrainSetup::tokens_per_step() const { return options.batch * model->config().seq_len; }

TrainSetup make_train_setup(const TrainBenchOptions& o) {
  TrainSetup s;
  s.options = o;
  ModelConfig c = ModelConfig::preset(o.preset);
  if (!o.mixers.empty()) c.mixers = ModelConfig::mixers_from_list(o.mixers);
  if (o.seq > 0) c.seq_len = o.seq;
  if (o.vocab > 0) c.vocab_size = o.vocab;
  LT_CHECK(o.batch > 0 && o.steps > 0 && o.warmup >= 0, "[bench train] batch and steps must be positive; got batch ",
           o.batch, ", steps ", o.steps);
  s.model = std::make_unique<LanguageModel>(c, 0);
  s.model->to(o.device);
  s.model->flatten_parameters();
  s.model->set_compute_dtype(o.compute_dtype.value_or(default_compute_dtype(o.device)));
  s.params = s.model->parameter_count();
  s.optimizer = std::make_unique<AdamW>(*s.model);
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<int64_t> token(0, c.vocab_size - 1);
  for (int i = 0; i < 2; ++i) {
    std::vector<int64_t> ids(size_t(o.batch * (c.seq_len + 1)));
    for (int64_t& t : ids) t = token(rng);
    const Tensor all = from_vector_i64(ids, {o.batch, c.seq_len + 1});
    s.batches.emplace_back(all.narrow(1, 0, c.seq_len).contiguous().to(o.device),
                           all.narrow(1, 1, c.seq_len).contiguous().to(o.device));
  }
  return s;
}

double train_step(TrainSetup& s, size_t i) {
  const auto& [tokens, targets] = s.batches[i % s.batches.size()];
  s.model->zero_grad();
  const Tensor loss = s.model->loss(tokens, targets);
  backward(loss);
  clip_grad_norm(*s.model, 1.0);
  s.optimizer->step(3e-4);
  return loss.item();
}

TrainBenchResult bench_train(TrainSetup& s) {
  const Device d = s.options.device;
  TrainBenchResult r;
  for (int64_t i = 0; i < s.options.warmup; ++i) train_step(s, size_t(i));
  synchronize(d);
  reset_peak_memory(d);
  std::vector<double> times;
  for (int64_t i = 0; i < s.options.steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    r.last_loss = train_step(s, size_t(i));  // item() waits for the step's work
    synchronize(d);
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  r.params = s.params;
  r.tokens_per_step = s.tokens_per_step();
  r.step_ms = median(times);
  r.tokens_per_s = double(r.tokens_per_step) / (r.step_ms / 1e3);
  r.peak_mib = double(memory_stats(d).peak) / kMiB;
  const auto [peak, source] = peak_bf16_flops(d);
  r.peak_source = source;
  if (peak > 0) r.mfu = r.tokens_per_s * train_flops_per_token(s.model->config(), s.params) / peak;
  return r;
}

ProfileResult profile_train_step(TrainSetup& s) {
  const Device d = s.options.device;
  ProfileResult result;
  result.step_ms = bench_train(s).step_ms;  // whole steps first (the warm-up included), then the parts

  const auto& [tokens, targets] = s.batches[0];
  size_t loss_value = 0;
  const std::vector<Part> parts = model_parts(*s.model, targets, &loss_value);
  std::vector<std::vector<double>> fwd(parts.size() + 1), bwd(parts.size() + 1), act(parts.size());
  std::map<std::pair<std::string, std::string>, ProfileOpRow> ops;  // by (kind, op)
  reset_peak_memory(d);
  for (int64_t step = 0; step < s.options.steps; ++step) {
    Stamps stamps(d);
    // Every op's forward (since the previous record in its part) and every node's backward between two
    // stamps, under the kind of the part that runs.
    struct OpSpan {
      const std::string* kind;
      std::string op;
      size_t begin, end;
    };
    std::vector<OpSpan> fwd_spans, bwd_spans;
    const std::string* kind_now = nullptr;
    size_t last_record = 0;
    autograd::set_forward_observer([&](const char* op) {
      const size_t now = stamps.mark();
      fwd_spans.push_back({kind_now, op, last_record, now});
      last_record = now;
    });
    autograd::set_backward_observer([&](const char* op, bool begin) {
      if (begin)
        bwd_spans.push_back({kind_now, op, stamps.mark(), 0});
      else
        bwd_spans.back().end = stamps.mark();
    });
    s.model->zero_grad();
    std::vector<Tensor> values(parts.size() + 1), outputs(parts.size());
    std::vector<std::vector<Tensor>> leaves(parts.size());
    std::vector<std::pair<size_t, size_t>> fwd_marks(parts.size()), bwd_marks(parts.size());
    values[0] = tokens;
    for (size_t p = 0; p < parts.size(); ++p) {
      // Each part sees detached copies of its inputs, so that its backward stops at its own boundary.
      for (size_t in : parts[p].inputs) {
        Tensor leaf = values[in].detach();
        if (in != 0) leaf.requires_grad_(true);
        leaves[p].push_back(leaf);
      }
      const int64_t before = int64_t(memory_stats(d).in_use);
      kind_now = &parts[p].kind;
      fwd_marks[p].first = last_record = stamps.mark();
      outputs[p] = parts[p].run(leaves[p]);
      fwd_marks[p].second = stamps.mark();
      act[p].push_back(double(int64_t(memory_stats(d).in_use) - before) / kMiB);
      values[p + 1] = outputs[p];
    }
    std::vector<Tensor> grads(parts.size() + 1);
    for (size_t p = parts.size(); p-- > 0;) {
      const size_t out = p + 1;
      if (out != loss_value && !grads[out].defined()) continue;
      kind_now = &parts[p].kind;
      bwd_marks[p].first = stamps.mark();
      if (out == loss_value)
        backward(outputs[p]);
      else
        backward(outputs[p], grads[out]);
      bwd_marks[p].second = stamps.mark();
      outputs[p] = Tensor();
      for (size_t j = 0; j < parts[p].inputs.size(); ++j) {
        const size_t in = parts[p].inputs[j];
        if (in == 0 || !leaves[p][j].grad().defined()) continue;
        grads[in] = grads[in].defined() ? add(grads[in], leaves[p][j].grad()) : leaves[p][j].grad();
      }
      leaves[p].clear();
      grads[out] = Tensor();
    }
    autograd::set_forward_observer(nullptr);
    autograd::set_backward_observer(nullptr);
    const size_t opt_begin = stamps.mark();
    clip_grad_norm(*s.model, 1.0);
    s.optimizer->step(3e-4);
    const size_t opt_end = stamps.mark();
    synchronize(d);
    auto add_span = [&](const OpSpan& span, bool forward) {
      ProfileOpRow& row = ops[{*span.kind, span.op}];
      row.kind = *span.kind;
      row.op = span.op;
      (forward ? row.fwd_ms : row.bwd_ms) += stamps.ms(span.begin, span.end) / double(s.options.steps);
      if (forward) row.calls += 1;
    };
    for (const OpSpan& span : fwd_spans) add_span(span, true);
    for (const OpSpan& span : bwd_spans) add_span(span, false);
    for (size_t p = 0; p < parts.size(); ++p) {
      fwd[p].push_back(stamps.ms(fwd_marks[p].first, fwd_marks[p].second));
      bwd[p].push_back(bwd_marks[p] == std::pair<size_t, size_t>{} ? 0.0
                                                                   : stamps.ms(bwd_marks[p].first, bwd_marks[p].second));
    }
    fwd[parts.size()].push_back(stamps.ms(opt_begin, opt_end));
    bwd[parts.size()].push_back(0.0);
  }
  for (size_t p = 0; p < parts.size(); ++p)
    result.rows.push_back({parts[p].name, parts[p].kind, median(fwd[p]), median(bwd[p]), median(act[p])});
  result.rows.push_back({"optimizer", "optimizer (clip + AdamW)", median(fwd[parts.size()]), 0.0, 0.0});
  for (const ProfileRow& r : result.rows) result.parts_ms += r.fwd_ms + r.bwd_ms;
  for (auto& [key, row] : ops) {
    row.calls /= s.options.steps;
    result.ops.push_back(row);
  }
  std::sort(result.ops.begin(), result.ops.end(), [](const ProfileOpRow& a, const ProfileOpRow& b) {
    return a.fwd_ms + a.bwd_ms > b.fwd_ms + b.bwd_ms;
  });
  result.peak_mib = double(memory_stats(d).peak) / kMiB;
  return result;
}

}  // namespace lintape::bench
