// A training step captured once as a CUDA graph and replayed: the step's hundreds of launches become one,
// which is what small models are bound by. The step must queue its work on the device's lintape stream
// without waiting for it on the host (the loss and the gradient norm are read after it), and use the same
// shapes and the same input buffers every time (copy each batch into them before run()). Its memory comes
// from a graph pool of the caching allocator (core/allocator.h), so replays find their addresses unchanged.
#pragma once
#include <functional>
#include <string>
#include "../core/device.h"

namespace lintape {

class StepGraph {
 public:
  // `enabled`: capture where valid (a CUDA device); else run() just runs the step.
  StepGraph(Device device, bool enabled);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // The first call runs `step` eagerly (its lazily built state, such as the gradients' buffers and the
  // matrix products' plans, is made outside the graph), the second captures it and replays it, later
  // calls replay it. A capture that fails (the step waits on the host, say) runs the step eagerly and
  // turns the graph off for good; why() says so.
  void run(const std::function<void()>& step);
  bool replaying() const;  // a graph was captured and is replayed
  // "on", "off (--no-cuda-graph)", "off (not a CUDA device)", "off (capture failed: ...)"; "on" before the
  // capture when it is to come.
  const std::string& why() const { return why_; }

 private:
  Device device_;
  int calls_ = 0;
  int pool_ = 0;            // the allocator's graph pool, 0 before the capture
  size_t replay_bytes_ = 0;  // what a replay holds at its peak beyond what is in use outside it
  void* exec_ = nullptr;    // cudaGraphExec_t
  std::string why_;
};

}  // namespace lintape
