#include "train/step_graph.h"

#include <atomic>
#include <exception>
#include "core/allocator.h"
#include "core/error.h"
#if LINTAPE_WITH_CUDA
#include "core/cuda.h"
#endif

namespace lintape {

StepGraph::StepGraph(Device device, bool enabled)
    : device_(device), why_(!enabled ? "off (--no-cuda-graph)" : device.is_cuda() ? "on" : "off (not a CUDA device)") {}

bool StepGraph::replaying() const { return exec_ != nullptr; }

#if LINTAPE_WITH_CUDA
StepGraph::~StepGraph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));  // no throw from a destructor
  if (pool_ > 0) graph_pool_release(device_, pool_);
}

void StepGraph::run(const std::function<void()>& step) {
  ++calls_;
  if (why_ != "on" || calls_ == 1) return step();
  const int dev = device_.index;
  cudaStream_t s = cuda::stream(dev);
  if (!exec_) {
    static std::atomic<int> pools{0};
    pool_ = ++pools;
    std::string failure;
    graph_pool_begin(device_, pool_);
    cudaGraph_t graph = nullptr;
    LT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      step();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    const cudaError_t ended = cudaStreamEndCapture(s, &graph);
    replay_bytes_ = graph_pool_end(device_);
    if (failure.empty() && ended != cudaSuccess) failure = cudaGetErrorString(ended);
    cudaGraphExec_t exec = nullptr;
    if (failure.empty()) {
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      if (made != cudaSuccess) failure = cudaGetErrorString(made);
    }
    if (graph) cudaGraphDestroy(graph);
    if (!failure.empty()) {
      cudaGetLastError();  // a failed capture's error is not sticky: clear it and go on eagerly
      graph_pool_release(device_, pool_);
      pool_ = 0;
      why_ = "off (capture failed: " + failure + ")";
      return step();  // nothing of the captured step ran
    }
    exec_ = exec;
  }
  LT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), s));
  count_replay(device_, replay_bytes_);  // the step's memory, as its allocations would have counted it
}
#else
StepGraph::~StepGraph() = default;

void StepGraph::run(const std::function<void()>& step) {
  ++calls_;
  step();
}
#endif

}  // namespace lintape
