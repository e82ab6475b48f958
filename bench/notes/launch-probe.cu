// Launch-cost probe for the TPA decode's short-cache floor (bench/notes/tpa-decode.md, session 10): the decode kernel
// takes ~13 us at M = 1 replayed from a CUDA graph (eager calls are host-bound at about as long). This times kernels
// that do nothing, one attribute of the decode's launch added at a time, with the bench's event pattern (an event
// pair around each launch, back to back, median), eager and as one-node CUDA graphs: what the launch itself costs.
//   nvcc -O2 -arch=sm_90a -std=c++17 bench/notes/launch-probe.cu -o /tmp/launch-probe && /tmp/launch-probe
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe-check.h"

struct Lengths {  // the decode's inline per-sequence lengths: 1 KB of parameters
  const long long* device;
  int values[256];
};

__global__ void empty_kernel(int* flag) {
  if (threadIdx.x == 9999) *flag = 1;
}
__global__ void empty_with_params(int* flag, const Lengths lengths) {
  if (threadIdx.x == 9999) *flag = lengths.values[blockIdx.x];
}
__global__ void __launch_bounds__(128, 2) empty_with_smem(int* flag) {
  extern __shared__ int smem[];
  if (threadIdx.x == 9999) *flag = smem[1];
}

// Median of `reps` event-pair times of launch(), back to back, after a warm-up.
double median_us(cudaStream_t s, const std::function<void()>& launch, int reps = 300) {
  for (int i = 0; i < 20; ++i) launch();
  CHECK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(ev[2 * r], s));
    launch();
    CHECK(cudaEventRecord(ev[2 * r + 1], s));
  }
  CHECK(cudaStreamSynchronize(s));
  std::vector<double> t(reps);
  for (int r = 0; r < reps; ++r) {
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
    t[r] = 1e3 * ms;
  }
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

// The same launch captured once as a graph, its replays timed.
double graph_us(cudaStream_t s, const std::function<void()>& launch) {
  cudaGraph_t g;
  cudaGraphExec_t x;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  launch();
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&x, g, 0));
  const double us = median_us(s, [&] { CHECK(cudaGraphLaunch(x, s)); });
  CHECK(cudaGraphExecDestroy(x));
  CHECK(cudaGraphDestroy(g));
  return us;
}

int main() {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* flag;
  CHECK(cudaMalloc(&flag, sizeof(int)));
  const int smem = 90 * 1024;  // the decode's dynamic shared memory at the bench's shape (two blocks an SM)
  CHECK(cudaFuncSetAttribute(empty_with_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(empty_with_smem, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  Lengths lengths{};
  auto clustered = [&](int cluster, int blocks, size_t bytes) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(cluster);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = bytes;
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, empty_with_smem, flag));
  };
  struct Case {
    const char* what;
    std::function<void()> launch;
  };
  const std::vector<Case> cases = {
      {"empty, 8 blocks of 128", [&] { empty_kernel<<<8, 128, 0, s>>>(flag); }},
      {"empty, 1 KB of parameters", [&] { empty_with_params<<<8, 128, 0, s>>>(flag, lengths); }},
      {"empty, 90 KB dynamic shared memory", [&] { empty_with_smem<<<8, 128, smem, s>>>(flag); }},
      {"empty, 90 KB, clusters of 1", [&] { clustered(1, 8, smem); }},
      {"empty, 90 KB, clusters of 2", [&] { clustered(2, 16, smem); }},
      {"empty, 90 KB, clusters of 16 (non-portable)", [&] { clustered(16, 128, smem); }},
      {"empty, no shared memory, clusters of 1", [&] { clustered(1, 8, 0); }},
  };
  int device = 0;
  cudaDeviceProp p{};
  CHECK(cudaGetDevice(&device));
  CHECK(cudaGetDeviceProperties(&p, device));
  std::printf("%s: median us of an event pair around one launch (eager / one-node graph replay)\n", p.name);
  for (const Case& c : cases) std::printf("  %-46s %7.2f / %7.2f\n", c.what, median_us(s, c.launch), graph_us(s, c.launch));
  return 0;
}
