// The TPA decode's synccheck finding in a few lines (bench/notes/tpa-decode.md, session 25): compute-sanitizer
// synccheck reports "divergent thread(s) in warp" at the decode's __syncthreads only with several clusters of more than
// nine blocks a sequence at B 8. This kernel keeps the decode's pattern and nothing else: blocks of 128 threads, two an
// SM by their shared memory, clusters along x, a loop of __syncthreads over shared memory, then each cluster's rank 0
// counts the cluster on a per-sequence counter, tells the cluster's blocks through distributed shared memory, and the
// last cluster of each sequence runs two more __syncthreads. If synccheck reports this too, the report is the tool's:
// on an H200 it does (B 8 x 32 in clusters of 16; B 16 x 32 even with BARRIERS_ONLY), and not at B 4 or clusters of 8.
//   nvcc -O2 -arch=sm_90a -std=c++17 -lineinfo bench/notes/cluster-sync-probe.cu -o /tmp/cluster-sync-probe
//   compute-sanitizer --tool synccheck /tmp/cluster-sync-probe B SPLITS CLUSTER [REPS [BARRIERS_ONLY]]
//   (e.g. 8 32 16; 4 32 16; 8 32 8; 8 32 16 3 1: the tile loop and one cluster barrier, nothing else)
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#include "probe-check.h"

constexpr int kThreads = 128, kSmem = 110 * 1024, kTiles = 4;

__global__ void __launch_bounds__(kThreads, 2) probe(float* out, int* counters, int clusters_per_seq, bool barriers_only) {
  namespace cg = cooperative_groups;
  extern __shared__ float smem[];
  __shared__ int is_last;
  const int tid = threadIdx.x, b = blockIdx.y;
  float acc = 0.f;
  for (int t = 0; t < kTiles; ++t) {  // the tile loop: shared memory written, a barrier, read back
    for (int i = tid; i < 4096; i += kThreads) smem[i] = float(i * (t + 1) + blockIdx.x);
    __syncthreads();
    acc += smem[(tid * 33 + t) % 4096];
    __syncthreads();
  }
  smem[tid] = acc;
  __syncthreads();  // the row groups' merge
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), C = int(cluster.num_blocks());
  __threadfence();
  cluster.sync();
  if (barriers_only) {  // no counter, no remote store, no early exit: the loop's barriers and this cluster barrier
    out[(int64_t(b) * gridDim.x + blockIdx.x) * kThreads + tid] = acc;
    return;
  }
  if (rank == 0 && tid == 0) {
    const int last = atomicAdd(counters + b, 1) == clusters_per_seq - 1;
    for (int c = 0; c < C; ++c) *cluster.map_shared_rank(&is_last, c) = last;
  }
  cluster.sync();
  if (!is_last) return;
  smem[4096 + tid] = acc * 2.f;  // the last cluster's combine
  __syncthreads();
  acc += smem[4096 + (tid + 1) % kThreads];
  __syncthreads();
  out[(int64_t(b) * gridDim.x + blockIdx.x) * kThreads + tid] = acc;
  if (tid == 0 && rank == 0) counters[b] = 0;
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? std::atoi(argv[1]) : 8, splits = argc > 2 ? std::atoi(argv[2]) : 32,
            C = argc > 3 ? std::atoi(argv[3]) : 16, reps = argc > 4 ? std::atoi(argv[4]) : 3;
  const bool barriers_only = argc > 5 && std::atoi(argv[5]) != 0;
  if (splits % C != 0) {
    std::fprintf(stderr, "SPLITS must be a multiple of CLUSTER\n");
    return 2;
  }
  float* out = nullptr;
  int* counters = nullptr;
  CHECK(cudaMalloc(&out, size_t(B) * splits * kThreads * sizeof(float)));
  CHECK(cudaMalloc(&counters, size_t(B) * sizeof(int)));
  CHECK(cudaMemset(counters, 0, size_t(B) * sizeof(int)));
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  if (C > 8) CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(C);
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(splits), unsigned(B));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&resident, probe, &cfg));
  for (int r = 0; r < reps; ++r) CHECK(cudaLaunchKernelEx(&cfg, probe, out, counters, splits / C, barriers_only));
  CHECK(cudaDeviceSynchronize());
  std::printf("B %d splits %d cluster %d%s: %d clusters launched, %d resident at once; ok\n", B, splits, C,
              barriers_only ? " (barriers only)" : "", B * splits / C, resident);
  return 0;
}
