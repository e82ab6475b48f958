#include "train/grad_reducer.h"

#include <algorithm>
#include "core/error.h"
#include "train/comm.h"

namespace lintape {

GradReducer::GradReducer(Module& module, Communicator& comm, double bucket_mib) : module_(module), comm_(comm) {
  LT_CHECK(module.flattened(), "[GradReducer] the module must be flattened first (Module::flatten_parameters)");
  flat_ = module.flat_gradients();
  const NamedTensors params = module.named_parameters();
  const auto ranges = module.flat_ranges();
  const double bytes = bucket_mib * 1024.0 * 1024.0;
  const int64_t cap = bucket_mib > 0 ? std::max<int64_t>(1, int64_t(bytes / double(dtype_size(flat_.dtype()))))
                                     : flat_.numel();
  bucket_of_.resize(params.size());
  // From the last parameter to the first; the first bucket also takes the padding after the last one.
  int64_t end = flat_.numel(), count = 0;
  for (size_t i = params.size(); i-- > 0;) {
    parameter_index_[params[i].second->impl()] = i;
    bucket_of_[i] = buckets_.size();
    ++count;
    const int64_t start = ranges[i].first;
    if (end - start >= cap || i == 0) {
      buckets_.emplace_back(start, end - start);
      parameters_of_.push_back(count);
      end = start;
      count = 0;
    }
  }
  waiting_ = parameters_of_;
  reported_.assign(params.size(), 0);
}

autograd::LeafReadyFn GradReducer::on_leaf_ready() {
  LT_CHECK(module_.flat_gradients().data() == flat_.data(),
           "[GradReducer] the module was flattened again after the reducer was made; make a new one");
  return [this](const Tensor& leaf) { reported(leaf); };
}

void GradReducer::reported(const Tensor& leaf) {
  const auto it = parameter_index_.find(leaf.impl());
  if (it == parameter_index_.end() || reported_[it->second]) return;  // not a parameter of the module
  reported_[it->second] = 1;
  --waiting_[bucket_of_[it->second]];
  start_ready();
}

void GradReducer::start_ready() {
  while (started_ < buckets_.size() && waiting_[started_] == 0) {
    Tensor bucket = flat_.narrow(0, buckets_[started_].first, buckets_[started_].second);
    comm_.all_reduce_sum_start(bucket);
    ++started_;
  }
}

void GradReducer::mean_queued() {
  comm_.all_reduce_sum_queued(flat_);
  comm_.divide_by_size(flat_);
}

void GradReducer::finish() { finish_with(&Communicator::wait_started); }

void GradReducer::finish_queued() { finish_with(&Communicator::join_started); }

void GradReducer::finish_with(void (Communicator::*complete)()) {
  LT_CHECK(module_.flat_gradients().data() == flat_.data(),
           "[GradReducer] the module was flattened again after the reducer was made; make a new one");
  std::fill(waiting_.begin(), waiting_.end(), 0);
  start_ready();
  (comm_.*complete)();
  comm_.divide_by_size(flat_);
  waiting_ = parameters_of_;
  std::fill(reported_.begin(), reported_.end(), 0);
  started_ = 0;
}

}  // namespace lintape
