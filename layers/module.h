// Module: the base of the layers. A module names its parameters (trained) and buffers (fixed tables,
// never trained nor saved) and its child modules; names join with '.', as in MODEL.md
// ("blocks.0.fal.qkvg.weight").
//
// flatten_parameters() moves every parameter into ONE contiguous float buffer and their gradients into
// a second one of the same layout: each parameter becomes a view of the first and its .grad a view of
// the second, preset before backward, so the tape's leaf accumulation (+=) writes the gradients straight
// into the flat gradient buffer. Clipping, the optimizer and a later all-reduce then work on one tensor.
// zero_grad() zeroes that buffer and keeps the views.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>
#include "../core/tensor.h"

namespace lintape {

using NamedTensors = std::vector<std::pair<std::string, Tensor*>>;

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  // Children register their address: a module neither copies nor moves.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  NamedTensors named_parameters();  // recursive, in registration order
  NamedTensors named_buffers();
  int64_t parameter_count();

  // Moves parameters and buffers (re-flattening when flattened). Buffers keep their dtype on to(dtype)
  // unless they are floating point.
  void to(Device device);
  void to(DType dtype);

  // Parameters by name (copies on the CPU, as float32 unless asked otherwise).
  std::map<std::string, Tensor> state_dict(DType dtype = DType::F32);
  // Copies values in by name; every parameter must be present with its shape, and no unknown names.
  // Errors name `source` (a file, for checkpoints) and the parameter.
  void load_state_dict(const std::map<std::string, Tensor>& state, const std::string& source = "state");

  // `multiple_of`: the buffers' length is padded (with zeros that no parameter sees) to a multiple of
  // it, so that they split into equal shards (ZeRO-1 over that many ranks); to() keeps the padding.
  void flatten_parameters(int64_t multiple_of = 1);
  bool flattened() const { return flat_params_.defined(); }
  const Tensor& flat_parameters() const { return flat_params_; }
  const Tensor& flat_gradients() const { return flat_grads_; }
  // Offset and length of each parameter inside the flat buffers, in named_parameters() order.
  std::vector<std::pair<int64_t, int64_t>> flat_ranges();
  void zero_grad();

 protected:
  void register_parameter(const std::string& name, Tensor& slot);
  void register_buffer(const std::string& name, Tensor& slot);
  void register_module(const std::string& name, Module& child);

 private:
  void collect(const std::string& prefix, bool parameters, NamedTensors& out);
  std::vector<std::pair<std::string, Tensor*>> parameters_, buffers_;
  int64_t flat_multiple_ = 1;
  std::vector<std::pair<std::string, Module*>> children_;
  Tensor flat_params_, flat_grads_;
};

}  // namespace lintape
