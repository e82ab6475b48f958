#include "layers/module.h"

#include <set>

namespace lintape {

void Module::register_parameter(const std::string& name, Tensor& slot) {
  slot.requires_grad_();
  parameters_.emplace_back(name, &slot);
}

void Module::register_buffer(const std::string& name, Tensor& slot) { buffers_.emplace_back(name, &slot); }

void Module::register_module(const std::string& name, Module& child) { children_.emplace_back(name, &child); }

void Module::collect(const std::string& prefix, bool parameters, NamedTensors& out) {
  for (auto& [name, slot] : parameters ? parameters_ : buffers_) out.emplace_back(prefix + name, slot);
  for (auto& [name, child] : children_) child->collect(prefix + name + ".", parameters, out);
}

NamedTensors Module::named_parameters() {
  NamedTensors out;
  collect("", true, out);
  return out;
}

NamedTensors Module::named_buffers() {
  NamedTensors out;
  collect("", false, out);
  return out;
}

int64_t Module::parameter_count() {
  int64_t n = 0;
  for (auto& [name, p] : named_parameters()) n += p->numel();
  return n;
}

void Module::to(Device device) {
  const bool was_flat = flattened();
  for (auto& [name, p] : named_parameters()) *p = p->detach().to(device).contiguous().requires_grad_();
  for (auto& [name, b] : named_buffers()) *b = b->to(device);
  flat_params_ = flat_grads_ = Tensor();
  if (was_flat) flatten_parameters(flat_multiple_);
}

void Module::to(DType dtype) {
  const bool was_flat = flattened();
  for (auto& [name, p] : named_parameters()) *p = p->detach().to(dtype).contiguous().requires_grad_();
  for (auto& [name, b] : named_buffers())
    if (is_floating(b->dtype())) *b = b->to(dtype);
  flat_params_ = flat_grads_ = Tensor();
  if (was_flat) flatten_parameters(flat_multiple_);
}

std::map<std::string, Tensor> Module::state_dict(DType dtype) {
  std::map<std::string, Tensor> out;
  for (auto& [name, p] : named_parameters()) out[name] = p->detach().to(Device::cpu()).to(dtype).clone();
  return out;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& state, const std::string& source) {
  std::set<std::string> known;
  for (auto& [name, p] : named_parameters()) {
    known.insert(name);
    auto it = state.find(name);
    LT_CHECK(it != state.end(), "[load_state_dict] ", source, " has no parameter '", name, "' (expected shape ",
             shape_str(p->shape()), ")");
    LT_CHECK(it->second.shape() == p->shape(), "[load_state_dict] ", source, ": parameter '", name,
             "' has shape ", shape_str(it->second.shape()), "; expected ", shape_str(p->shape()));
    p->detach().copy_(it->second);
  }
  for (const auto& [name, t] : state)
    LT_CHECK(known.count(name), "[load_state_dict] ", source, " has a parameter '", name,
             "' that the model does not have");
}

std::vector<std::pair<int64_t, int64_t>> Module::flat_ranges() {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t offset = 0;
  for (auto& [name, p] : named_parameters()) {
    ranges.emplace_back(offset, p->numel());
    offset += p->numel();
  }
  return ranges;
}

void Module::flatten_parameters(int64_t multiple_of) {
  NamedTensors params = named_parameters();
  LT_CHECK(!params.empty(), "[flatten_parameters] the module has no parameters");
  LT_CHECK(multiple_of >= 1, "[flatten_parameters] multiple_of must be >= 1; got ", multiple_of);
  flat_multiple_ = multiple_of;
  const DType dtype = params[0].second->dtype();
  const Device device = params[0].second->device();
  for (auto& [name, p] : params)
    LT_CHECK(p->dtype() == dtype && p->device() == device, "[flatten_parameters] parameter '", name, "' is ",
             dtype_name(p->dtype()), " on ", p->device().name(), "; expected ", dtype_name(dtype), " on ",
             device.name(), " like the first");
  const auto ranges = flat_ranges();
  const int64_t used = ranges.back().first + ranges.back().second;
  const int64_t total = (used + multiple_of - 1) / multiple_of * multiple_of;
  Tensor flat = zeros({total}, dtype, device), grads = zeros({total}, dtype, device);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor& p = *params[i].second;
    const Shape shape = p.shape();
    Tensor view = flat.narrow(0, ranges[i].first, ranges[i].second).view(shape);
    view.copy_(p);
    view.requires_grad_();
    view.set_grad(grads.narrow(0, ranges[i].first, ranges[i].second).view(shape));
    p = view;
  }
  flat_params_ = flat;
  flat_grads_ = grads;
}

void Module::zero_grad() {
  if (flattened()) {
    flat_grads_.zero_();
    return;
  }
  for (auto& [name, p] : named_parameters()) p->set_grad(Tensor());
}

}  // namespace lintape
