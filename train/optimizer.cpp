#include "train/optimizer.h"

#include <cmath>
#include <vector>

#include "autograd/tape.h"
#include "ops/elementwise.h"
#include "ops/reduce.h"
#include "train/comm.h"
#if LINTAPE_WITH_CUDA
#include "train/optimizer_cuda.h"
#endif

namespace lintape {

namespace {
float* cpu_f32(const Tensor& t, const char* what) {
  LT_CHECK(!t.is_cuda() && t.dtype() == DType::F32, "[AdamW] ", what, " must be float32; got ",
           dtype_name(t.dtype()), " on ", t.device().name());
  return t.data_ptr<float>();
}
}  // namespace

AdamW::AdamW(Module& module, const AdamWOptions& options) : module_(module), options_(options) {
  LT_CHECK(module.flattened(), "[AdamW] the module's parameters must be flattened first (flatten_parameters)");
  const Tensor& flat = module.flat_parameters();
  m_ = zeros(flat.shape(), flat.dtype(), flat.device());
  v_ = zeros(flat.shape(), flat.dtype(), flat.device());
  std::vector<double> mask(size_t(flat.numel()), 0.0);
  const auto ranges = module.flat_ranges();
  const NamedTensors params = module.named_parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].second->dim() >= 2)
      for (int64_t j = 0; j < ranges[i].second; ++j) mask[size_t(ranges[i].first + j)] = 1.0;
  decay_mask_ = from_vector(mask, flat.shape(), flat.dtype(), flat.device());
}

Tensor AdamW::slice(const Tensor& flat) const {
  if (!comm_) return flat;
  const int64_t n = flat.numel() / comm_->size();
  return flat.narrow(0, n * comm_->rank(), n);
}

void AdamW::keep_compute_copy(DType dtype) {
  Storage& storage = module_.flat_parameters().storage();
  if (!is_float16(dtype) || comm_) {
    compute_copy_ = Tensor();
    if (storage.copy) storage.copy.reset();
    return;
  }
  const Tensor& flat = module_.flat_parameters();
  compute_copy_ = empty(flat.shape(), dtype, flat.device());
  compute_copy_.copy_(flat);
  attach_compute_copy();
}

// Hands the flat parameters' storage the copy written with their current values.
void AdamW::attach_compute_copy() {
  Storage& storage = module_.flat_parameters().storage();
  storage.copy = compute_copy_.impl()->storage;
  storage.copy_dtype = compute_copy_.dtype();
  storage.copy_version = storage.version;
}

void AdamW::shard(Communicator& comm) {
  const int64_t total = module_.flat_parameters().numel();
  LT_CHECK(total % comm.size() == 0, "[AdamW] ZeRO-1: the flat buffers' ", total, " elements do not split into ",
           comm.size(), " equal slices; flatten the parameters with multiple_of = ", comm.size());
  comm_ = &comm;
  keep_compute_copy(DType::F32);  // an update writes this rank's slice only: the model converts its weights
  m_ = slice(m_).clone();  // the full moments are freed here: only this rank's slice stays
  v_ = slice(v_).clone();
  decay_mask_ = slice(decay_mask_).clone();
}

double AdamW::reduce_and_clip_gradients(double max_norm) {
  LT_CHECK(comm_, "[AdamW] reduce_and_clip_gradients is for a sharded optimizer (AdamW::shard)");
  Tensor grads = module_.flat_gradients();
  comm_->reduce_scatter_sum_in_place(grads);
  Tensor mine = slice(grads);
  NoGradGuard no_grad;
  mine.copy_(mul(mine, 1.0 / double(comm_->size())));
  const double local = sum(mul(mine, mine)).to(DType::F64).item();
  const double norm = std::sqrt(comm_->all_reduce_sum(local));
  if (norm > max_norm && std::isfinite(norm)) mine.copy_(mul(mine, max_norm / (norm + 1e-6)));
  return norm;
}

void AdamW::step(double lr) {
  ++steps_;
  const float bias1 = float(1.0 - std::pow(options_.beta1, double(steps_)));
  const float bias2 = float(1.0 - std::pow(options_.beta2, double(steps_)));
  Tensor all_params = module_.flat_parameters();
  const Tensor params = slice(all_params), grads = slice(module_.flat_gradients());
#if LINTAPE_WITH_CUDA
  if (params.is_cuda()) {
    train_cuda::adamw_step_cuda(params, grads, m_, v_, decay_mask_,
                                {float(lr), float(lr * options_.weight_decay), float(options_.beta1),
                                 float(options_.beta2), float(options_.eps), bias1, bias2},
                                compute_copy_);
    if (comm_) comm_->all_gather_in_place(all_params);
    if (compute_copy_.defined()) attach_compute_copy();
    return;
  }
#endif
  float* p = cpu_f32(params, "parameters");
  const float* g = cpu_f32(grads, "gradients");
  float* m = cpu_f32(m_, "first moment");
  float* v = cpu_f32(v_, "second moment");
  const float* decay = cpu_f32(decay_mask_, "decay mask");
  const float b1 = float(options_.beta1), b2 = float(options_.beta2), eps = float(options_.eps);
  const float step_lr = float(lr), shrink = float(lr * options_.weight_decay);
  const int64_t n = m_.numel();
  for (int64_t i = 0; i < n; ++i) {
    p[i] -= shrink * decay[i] * p[i];
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= step_lr * (m[i] / bias1) / (std::sqrt(v[i] / bias2) + eps);
  }
  params.storage().version++;
  if (comm_) comm_->all_gather_in_place(all_params);
  if (compute_copy_.defined()) {
    compute_copy_.copy_(all_params);
    attach_compute_copy();
  }
}

bool AdamW::can_queue() const { return module_.flat_parameters().is_cuda() && !comm_; }

#if LINTAPE_WITH_CUDA
void AdamW::set_learning_rate(double lr) {
  LT_CHECK(can_queue(), "[AdamW] a queued step needs CUDA parameters and no sharding");
  if (!device_step_.defined())
    device_step_ = zeros({train_cuda::kDeviceStepDoubles}, DType::F64, module_.flat_parameters().device());
  train_cuda::set_step_inputs_cuda(device_step_, lr, steps_ + 1);
}

void AdamW::queue_step(const Tensor& loss, double max_norm) {
  LT_CHECK(device_step_.defined(), "[AdamW] queue_step before set_learning_rate");
  train_cuda::queue_step_cuda(module_.flat_parameters(), module_.flat_gradients(), m_, v_, decay_mask_, compute_copy_,
                              loss, device_step_, max_norm, options_.beta1, options_.beta2, options_.eps,
                              options_.weight_decay);
}

std::pair<double, double> AdamW::read_step() const {
  LT_CHECK(device_step_.defined(), "[AdamW] read_step before set_learning_rate");
  return train_cuda::read_step_cuda(device_step_);
}
#else
void AdamW::set_learning_rate(double) { fail("[AdamW] a queued step needs CUDA; lintape was built without it"); }
void AdamW::queue_step(const Tensor&, double) { fail("[AdamW] a queued step needs CUDA"); }
std::pair<double, double> AdamW::read_step() const { fail("[AdamW] a queued step needs CUDA"); }
#endif

void AdamW::commit_step() {
  ++steps_;
  // What step() does on the host: a replayed graph leaves the versions as its capture left them.
  module_.flat_parameters().storage().version++;
  if (compute_copy_.defined()) attach_compute_copy();
}

std::map<std::string, Tensor> AdamW::state_dict() const {
  Tensor m = m_, v = v_;
  if (comm_) {  // the full moments for a moment: gathered from every rank's slice
    const Tensor& flat = module_.flat_parameters();
    m = zeros(flat.shape(), flat.dtype(), flat.device());
    v = zeros(flat.shape(), flat.dtype(), flat.device());
    slice(m).copy_(m_);
    slice(v).copy_(v_);
    comm_->all_gather_in_place(m);
    comm_->all_gather_in_place(v);
  }
  std::map<std::string, Tensor> out;
  const auto ranges = module_.flat_ranges();
  const NamedTensors params = module_.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Shape& shape = params[i].second->shape();
    out["m." + params[i].first] = m.narrow(0, ranges[i].first, ranges[i].second).view(shape).to(Device::cpu()).clone();
    out["v." + params[i].first] = v.narrow(0, ranges[i].first, ranges[i].second).view(shape).to(Device::cpu()).clone();
  }
  return out;
}

void AdamW::load_state_dict(const std::map<std::string, Tensor>& state, int64_t steps_taken,
                            const std::string& source) {
  LT_CHECK(!comm_, "[AdamW] load the state before sharding (AdamW::shard)");
  const auto ranges = module_.flat_ranges();
  const NamedTensors params = module_.named_parameters();
  LT_CHECK(state.size() == 2 * params.size(), "[AdamW] ", source, " holds ", state.size(), " tensors; expected ",
           2 * params.size(), " (m. and v. for each parameter)");
  for (size_t i = 0; i < params.size(); ++i) {
    const Shape& shape = params[i].second->shape();
    for (const char* prefix : {"m.", "v."}) {
      const std::string name = prefix + params[i].first;
      auto it = state.find(name);
      LT_CHECK(it != state.end(), "[AdamW] ", source, " has no '", name, "'");
      LT_CHECK(it->second.shape() == shape, "[AdamW] ", source, ": '", name, "' has shape ",
               shape_str(it->second.shape()), "; expected ", shape_str(shape));
      Tensor& flat = prefix[0] == 'm' ? m_ : v_;
      flat.narrow(0, ranges[i].first, ranges[i].second).view(shape).copy_(it->second);
    }
  }
  steps_ = steps_taken;
}

double learning_rate(int64_t step, int64_t total_steps, int64_t warmup, double peak, double min_ratio) {
  if (warmup > 0 && step < warmup) return peak * double(step + 1) / double(warmup);
  const double span = double(std::max<int64_t>(1, total_steps - warmup));
  const double progress = std::min(1.0, double(step - warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return peak * (min_ratio + (1.0 - min_ratio) * cosine);
}

double clip_grad_norm(Module& module, double max_norm) {
  LT_CHECK(module.flattened(), "[clip_grad_norm] the module's parameters must be flattened first");
  const Tensor& grads = module.flat_gradients();
#if LINTAPE_WITH_CUDA
  if (grads.is_cuda()) return train_cuda::clip_grad_norm_cuda(grads, max_norm);
#endif
  float* g = cpu_f32(grads, "gradients");
  double sum_sq = 0;
  for (int64_t i = 0; i < grads.numel(); ++i) sum_sq += double(g[i]) * double(g[i]);
  const double norm = std::sqrt(sum_sq);
  if (norm > max_norm && std::isfinite(norm)) {
    const float scale = float(max_norm / (norm + 1e-6));
    for (int64_t i = 0; i < grads.numel(); ++i) g[i] *= scale;
  }
  return norm;
}

}  // namespace lintape
