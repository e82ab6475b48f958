#include "train/session.h"
#include <cmath>
#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "train/comm.h"

namespace lintape {

DType default_compute_dtype(Device device) { return device.is_cuda() ? DType::BF16 : DType::F32; }

TrainSession TrainSession::build(const ModelConfig& config, uint64_t seed, const SessionOptions& o,
                                 const std::map<std::string, Tensor>* weights, const std::string& source) {
  TrainSession s;
  s.model = std::make_unique<LanguageModel>(config, seed);
  if (weights) s.model->load_state_dict(*weights, source);
  s.model->to(o.device);
  s.model->flatten_parameters(o.shards);  // shards of equal length for ZeRO-1
  s.model->set_compute_dtype(o.compute_dtype.value_or(default_compute_dtype(o.device)));
  s.optimizer = std::make_unique<AdamW>(*s.model, o.adamw);
  return s;
}

double TrainSession::update(double lr, double clip) {
  // Sharded moments: each rank clips and updates its shard; else the gradients are the mean over the
  // ranks already (reducer).
  const double grad_norm = optimizer->sharded() ? optimizer->reduce_and_clip_gradients(clip)
                                                : clip_grad_norm(*model, clip);
  if (std::isfinite(grad_norm)) optimizer->step(lr);
  return grad_norm;
}

void StepInputs::write(const Tensor& t, const Tensor& y, const Documents& docs, double w, Device device) {
  if (!tokens.defined()) {
    tokens = empty(t.shape(), t.dtype(), device);
    targets = empty(y.shape(), y.dtype(), device);
    weight = empty({}, DType::F32, device);
    // Zeros, one document a row, until the copy below: valid starts (a CPU buffer is checked).
    if (docs.defined()) documents = Documents::from_starts(zeros(docs.starts().shape(), DType::I32, device));
  }
  LT_CHECK(tokens.shape() == t.shape() && documents.defined() == docs.defined(),
           "[train] a queued step needs batches of one shape; got ", shape_str(t.shape()), " after ",
           shape_str(tokens.shape()), docs.defined() == documents.defined() ? "" : " (documents on and off)");
  tokens.copy_(t);  // on the device: queued, no wait
  targets.copy_(y);
  weight.copy_(full({}, w, DType::F32));
  if (documents.defined()) {
    Tensor starts = documents.starts();
    starts.copy_(docs.starts());
  }
}

void TrainSession::queue_step(const std::vector<StepInputs>& micro, double clip) {
  model->zero_grad();
  Tensor total;
  // Buckets: the last micro-batch's backward completes the gradients and starts their sums.
  const bool buckets = reducer && reducer->bucketed();
  for (size_t m = 0; m < micro.size(); ++m) {
    const StepInputs& in = micro[m];
    const Tensor l = mul(model->loss(in.tokens, in.targets, in.documents), in.weight);
    if (buckets && m + 1 == micro.size())
      backward(l, {}, false, reducer->on_leaf_ready());
    else
      backward(l);
    NoGradGuard no_grad;
    total = total.defined() ? add(total, l.detach()) : l.detach();
  }
  Tensor loss = total.to(DType::F32);
  if (reducer) {  // every rank then has the same loss and gradients: the same skip, the same update
    if (buckets)
      reducer->finish_queued();
    else
      reducer->mean_queued();
    Communicator& comm = Communicator::world();
    comm.all_reduce_sum_queued(loss);
    comm.divide_by_size(loss);
  }
  optimizer->queue_step(loss, clip);
}

}  // namespace lintape
