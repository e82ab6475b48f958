// Data-parallel gradient averaging in buckets, overlapped with backward. The module's flat gradient
// buffer is cut into buckets: contiguous ranges of whole parameters of about `bucket_mib` MiB each,
// taken from the END of the buffer towards its start, because backward completes the parameters in
// about the reverse of their registration (forward) order: the last block's first, the embedding last.
// Bucket 0 is the buffer's tail (with any padding), the last bucket its head.
//
// Backward reports each parameter whose gradient is final (autograd::LeafReadyFn); when every
// parameter of the next bucket has been reported, that bucket's sum over the ranks is started
// (Communicator::all_reduce_sum_start: MPI_Iallreduce on the CPU, NCCL on the communicator's own stream
// on CUDA) while backward goes on. Buckets start strictly in order 0, 1, 2, ..., so every rank issues
// the same collectives in the same order whatever the order of the reports. finish() starts what is
// left (parameters backward never reached), waits for all of them, and divides the buffer by the
// number of ranks once: each element is the same sum as one all-reduce of the whole buffer would give.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>
#include "../autograd/tape.h"
#include "../core/tensor.h"
#include "../layers/module.h"

namespace lintape {

class Communicator;

class GradReducer {
 public:
  // `module` must be flattened (Module::flatten_parameters) and stay so. bucket_mib <= 0: one bucket.
  GradReducer(Module& module, Communicator& comm, double bucket_mib = 25.0);

  // To pass to the backward that completes the gradients (with accumulation, the last micro-batch's).
  autograd::LeafReadyFn on_leaf_ready();
  // Starts the buckets not started yet, waits for every one, and divides by the number of ranks: the
  // flat gradients are then the mean over the ranks. Ready for the next step.
  void finish();
  // The whole buffer's mean over the ranks queued on the device with no wait on the host
  // (Communicator::all_reduce_sum_queued): one sum after backward, what a captured step holds. Not mixed
  // with on_leaf_ready in one step.
  void mean_queued();
  // finish() queued with no wait on the host (Communicator::join_started): the buckets started during
  // backward (on_leaf_ready) and joined back into the device stream, so a captured step holds them too.
  void finish_queued();
  bool bucketed() const { return buckets_.size() > 1; }

  // The buckets as (offset, length) in the flat buffer, in the order they start.
  const std::vector<std::pair<int64_t, int64_t>>& buckets() const { return buckets_; }
  size_t started() const { return started_; }  // buckets started since the last finish()

 private:
  void reported(const Tensor& leaf);
  void start_ready();
  void finish_with(void (Communicator::*complete)());
  Module& module_;
  Communicator& comm_;
  Tensor flat_;  // the module's flat gradient buffer
  std::vector<std::pair<int64_t, int64_t>> buckets_;
  std::unordered_map<const TensorImpl*, size_t> parameter_index_;
  std::vector<size_t> bucket_of_;       // per parameter
  std::vector<int64_t> parameters_of_;  // per bucket: how many parameters it holds
  std::vector<int64_t> waiting_;        // per bucket: parameters not reported yet this step
  std::vector<char> reported_;          // per parameter, this step
  size_t started_ = 0;
};

}  // namespace lintape
