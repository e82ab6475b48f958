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

// A part of the model as a function of earlier values (by index); value 0 is the token ids. A part makes
// `outputs` values, numbered after those of the parts before it.
struct Part {
  std::string name, kind;
  std::vector<size_t> inputs;
  size_t outputs;
  std::function<std::vector<Tensor>(const std::vector<Tensor>&)> run;
};

// The parts in the order LanguageModel runs them (language_model.cpp): each residual add inside the norm
// after it.
std::vector<Part> model_parts(const LanguageModel& m, const Tensor& targets, const Documents& docs,
                              size_t* loss_value) {
  std::vector<Part> parts;
  size_t next = 1;  // the next value's index
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  auto add_part = [&](std::string name, std::string kind, std::vector<size_t> in, size_t outputs, Fn fn) {
    parts.push_back({std::move(name), std::move(kind), std::move(in), outputs, std::move(fn)});
    next += outputs;
    return next - outputs;
  };
  auto one = [](std::function<Tensor(const std::vector<Tensor>&)> fn) -> Fn {
    return [fn](const std::vector<Tensor>& v) { return std::vector<Tensor>{fn(v)}; };
  };
  auto pair = [](std::pair<Tensor, Tensor> p) { return std::vector<Tensor>{p.first, p.second}; };
  // As LanguageModel::forward: wte cast to the compute dtype feeds the embedding and the tied head (the
  // head casts its own copy here, so that the parts stay apart), the loss in float32.
  size_t x = add_part("embedding", "embedding", {0}, 1, one([&m](const std::vector<Tensor>& v) {
    return embedding(m.wte.to(m.compute_dtype()), v[0]);
  }));
  const Block& first = *m.blocks.front();
  size_t h = add_part("blocks.0.norm1", "norm", {x}, 1, one([&first](const std::vector<Tensor>& v) {
    return first.norm1.forward(v[0]);
  }));
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const Block& b = *m.blocks[i];
    const std::string p = "blocks." + std::to_string(i) + ".";
    const bool last = i + 1 == m.blocks.size();
    const RMSNorm& next_norm = last ? m.norm : m.blocks[i + 1]->norm1;
    const std::string next_name = last ? "norm" : "blocks." + std::to_string(i + 1) + ".norm1";
    const std::string kind = m.config().mixer(int64_t(i));
    size_t mixed = add_part(p + kind, kind, {h}, 1,
                            one([&b, docs](const std::vector<Tensor>& v) { return b.mix(v[0], docs); }));
    // As Block::finish: the residual, norm2 and the MLP in one part (its norm and up projection are one op).
    size_t y = add_part(p + "residual1 + norm2 + mlp", "residual + norm + mlp", {x, mixed}, 2,
                        [&b, pair](const std::vector<Tensor>& v) {
                          return pair(b.mlp.forward_after(b.norm2, v[0], v[1]));
                        });
    size_t mlp = y + 1;
    x = add_part(p + "residual2 + " + next_name, last ? "residual + final norm" : "residual + norm", {y, mlp}, 2,
                 [&next_norm, pair](const std::vector<Tensor>& v) { return pair(next_norm.forward_sum(v[0], v[1])); });
    h = x + 1;
  }
  *loss_value = add_part("head and loss", "head and loss", {h}, 1, one([&m, targets](const std::vector<Tensor>& v) {
    return m.head_loss(v[0], m.wte.to(m.compute_dtype()), targets);
  }));
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
  SessionOptions session;
  session.device = o.device;
  session.compute_dtype = o.compute_dtype;
  s.session = TrainSession::build(c, 0, session);
  s.model = s.session.model.get();
  s.params = s.model->parameter_count();
  s.session.optimizer->keep_compute_copy(s.model->compute_dtype());
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<int64_t> token(0, c.vocab_size - 1);
  s.documents = bench_documents(o.batch, c.seq_len, o.document_length, o.device);
  const std::vector<int32_t> starts = s.documents.host_starts();
  for (int i = 0; i < 2; ++i) {
    std::vector<int64_t> ids(size_t(o.batch * (c.seq_len + 1)));
    for (int64_t& t : ids) t = token(rng);
    Tensor all = from_vector_i64(ids, {o.batch, c.seq_len + 1});
    Tensor targets = all.narrow(1, 1, c.seq_len).contiguous();
    if (!starts.empty()) {  // no target crosses a document's end
      int64_t* target = targets.data_ptr<int64_t>();
      for (int64_t r = 0; r < o.batch; ++r)
        for (int64_t t = 0; t + 1 < c.seq_len; ++t)
          if (starts[size_t(r * c.seq_len + t + 1)] == t + 1) target[r * c.seq_len + t] = -1;
    }
    s.batches.emplace_back(all.narrow(1, 0, c.seq_len).contiguous().to(o.device), targets.to(o.device));
  }
  return s;
}

double train_step(TrainSetup& s, size_t i) {
  const auto& [tokens, targets] = s.batches[i % s.batches.size()];
  AdamW& optimizer = *s.session.optimizer;
  if (!optimizer.can_queue()) {
    s.model->zero_grad();
    const Tensor loss = s.model->loss(tokens, targets, s.documents);
    backward(loss);
    s.session.update(3e-4, 1.0);
    return loss.item();
  }
  if (!s.graph) s.graph = std::make_unique<StepGraph>(s.options.device, s.options.cuda_graph);
  // Written every step, as the trainer writes each batch (the boundaries too).
  s.inputs[0].write(tokens, targets, s.documents, 1.0, s.options.device);
  optimizer.set_learning_rate(3e-4);
  s.graph->run([&s] { s.session.queue_step(s.inputs, 1.0); });
  const double loss = optimizer.read_step().first;
  optimizer.commit_step();
  return loss;
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
  if (s.graph) r.cuda_graph = s.graph->why();
  const auto [peak, source] = peak_bf16_flops(d);
  r.peak_source = source;
  const double context = mean_causal_context(s.documents, s.model->config().seq_len);
  if (peak > 0) r.mfu = r.tokens_per_s * train_flops_per_token(s.model->config(), s.params, context) / peak;
  return r;
}

ProfileResult profile_train_step(TrainSetup& s) {
  const Device d = s.options.device;
  ProfileResult result;
  result.step_ms = bench_train(s).step_ms;  // whole steps first (the warm-up included), then the parts

  const auto& [tokens, targets] = s.batches[0];
  size_t loss_value = 0;
  const std::vector<Part> parts = model_parts(*s.model, targets, s.documents, &loss_value);
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
    std::vector<Tensor> values{tokens};
    std::vector<std::vector<Tensor>> outputs(parts.size()), leaves(parts.size());
    std::vector<size_t> first_output(parts.size());
    std::vector<std::pair<size_t, size_t>> fwd_marks(parts.size()), bwd_marks(parts.size());
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
      first_output[p] = values.size();
      values.insert(values.end(), outputs[p].begin(), outputs[p].end());
    }
    std::vector<Tensor> grads(values.size());
    for (size_t p = parts.size(); p-- > 0;) {
      std::vector<Tensor> outs, seeds;  // the part's outputs that later parts sent a gradient
      for (size_t k = 0; k < parts[p].outputs; ++k) {
        const size_t out = first_output[p] + k;
        if (out == loss_value || grads[out].defined()) {
          outs.push_back(outputs[p][k]);
          const Tensor& o = outputs[p][k];
          seeds.push_back(out == loss_value ? ones(o.shape(), o.dtype(), o.device()) : grads[out]);
          grads[out] = Tensor();
        }
      }
      if (outs.empty()) continue;
      kind_now = &parts[p].kind;
      bwd_marks[p].first = stamps.mark();
      backward(outs, seeds);
      bwd_marks[p].second = stamps.mark();
      outputs[p].clear();
      for (size_t j = 0; j < parts[p].inputs.size(); ++j) {
        const size_t in = parts[p].inputs[j];
        if (in == 0 || !leaves[p][j].grad().defined()) continue;
        grads[in] = grads[in].defined() ? add(grads[in], leaves[p][j].grad()) : leaves[p][j].grad();
      }
      leaves[p].clear();
    }
    autograd::set_forward_observer(nullptr);
    autograd::set_backward_observer(nullptr);
    const size_t opt_begin = stamps.mark();
    s.session.update(3e-4, 1.0);
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
