#include "train/session.h"
#include <cmath>

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

}  // namespace lintape
