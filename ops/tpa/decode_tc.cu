// TPA decode on tensor cores: one query token per sequence over a cache of factor rows, reading each
// row's (ak, bk, av, bv) once, never building k or v. The kernel is in ops/tpa/decode_tc_kernel.cuh; this file
// picks its tiles, splits and clusters, and launches it.
//
// A block (4 warps) takes one sequence b and one split of its cache, in tiles streamed into shared memory
// by cp.async (2 to 4 stages, one barrier per tile). Warp w owns 16 heads (head group w % HG) and one or
// two 16-row chunks of each tile (row group w / HG; two where that still fits two blocks an SM, so that
// the chunks' chains interleave), so a tile has 16 * chunks * 4 / HG rows. Per chunk and warp, all in
// registers (mma m16n8k16, f32 accumulation):
//   C   = bk[rows, rk] bq^T                    (16 rows x 16 ranks of q; R_q padded to 16)
//   S^T = aq C^T scaled by ak[rows, heads, rk], summed over rk   (16 heads x 16 rows); C's accumulators
//         are the B operand directly, as a bf16/f16 high part and the rounding rest (f32-accurate scores)
//   online softmax per head in base 2; W = p av[rows, heads, rv]: S^T's accumulators are W's A operand
//   acc = alpha acc + W bv[rows, rv]           (16 heads x E)
// The row groups of a head group merge their (max, sum, acc) through shared memory at the end. The
// arithmetic per row is R_k (16 D + 2 * 16 * 16) + R_v 16 E multiply-adds per head group, all of it on
// tensor cores, so the kernel is bound by the cache's bytes. With several splits (flash-decoding), each
// block writes its unnormalised accumulator and (max, sum) per head; the last block of a sequence to
// finish (a counter per sequence, reset by that block) combines them, so a call is always one launch.
//
// The cluster schedule (the default; LINTAPE_TPA_DECODE_CLUSTER=0 or DecodeArgs::cluster = 0 runs the one above,
// 1..7 caps the cluster size; it needs two chunks a warp and bq 16-byte aligned, else the one above runs): bq by
// cp.async with the first tile, aq's loads together; the splits of a sequence as thread-block clusters of the
// size that keeps the most blocks resident with every cluster resident. Each block leaves its merged (acc, max,
// sum) in its shared memory; block r of a cluster combines the r-th slice of the (h, e) values across the cluster
// through distributed shared memory. One cluster a sequence writes the output; with several, each writes a partial
// and the sequence's last cluster to finish combines those, each of its blocks a slice of the output. Above the
// portable 8 (9..16), one cluster a sequence wherever the splits fit one and every sequence's cluster stays
// resident. At the seeds' shape, short caches at small batches split each sequence's heads into two slices of 16
// (a grid's z; runs_head_slices): each slice's blocks are a sequence of their own, with 128-row tiles (four row groups
// of 16 heads), so twice the blocks share the cache with half the products each. docs/ops/tpa.md says more.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>
#include "core/cuda.h"
#include "ops/tpa/decode_tc_kernel.cuh"
#include "ops/tpa/launch.h"

namespace lintape::tpa_cuda {
using namespace lintape::cuda;
using namespace lintape::cuda_device;

namespace {
using namespace decode_tc_kernel;

// Splits: one wave of resident blocks over the batch (the kernel is bound by the bytes its blocks keep
// in flight, so every resident slot should stream), each split at least two tiles long (the pipeline's
// depth), at most kMaxSplits. tiles: the cache's tiles of g.rows.
int choose_splits(int64_t B, int64_t tiles, int64_t resident) {
  const int64_t wave = std::max<int64_t>(1, resident / B);
  return int(std::max<int64_t>(1, std::min<int64_t>({wave, (tiles + 1) / 2, kMaxSplits})));
}

// Zeroed counters (one per sequence) that the last cluster (or block) of each sequence resets: kept
// for the life of the process, outside the tensor allocator (a few KiB), grown when a larger batch comes.
int* split_counters(int device, int64_t B) {
  static std::mutex mu;
  static int* ptr[kMaxDevices] = {};
  static int64_t cap[kMaxDevices] = {};
  LT_CHECK(device < kMaxDevices, "[tpa_decode] devices 0..", kMaxDevices - 1, " are supported; got ", device);
  std::lock_guard<std::mutex> lock(mu);
  if (cap[device] < B) {
    const int previous = current_device();
    set_device(device);
    if (ptr[device]) LT_CUDA_CHECK(cudaFree(ptr[device]));
    const int64_t n = std::max<int64_t>(B, 1024);
    LT_CUDA_CHECK(cudaMalloc(&ptr[device], size_t(n) * sizeof(int)));
    LT_CUDA_CHECK(cudaMemsetAsync(ptr[device], 0, size_t(n) * sizeof(int), stream(device)));
    cap[device] = n;
    set_device(previous);
  }
  return ptr[device];
}

// The blocks a cluster asked for: DecodeArgs::cluster, else LINTAPE_TPA_DECODE_CLUSTER, else kMaxWhole
// (one cluster a sequence where the splits fit, else the cluster schedule; 0 is the last-block combine).
int cluster_request(const DecodeArgs& a) {
  static const int env = [] {
    const char* v = std::getenv("LINTAPE_TPA_DECODE_CLUSTER");
    return v ? std::atoi(v) : kMaxWhole;
  }();
  return std::min(a.cluster >= 0 ? a.cluster : env, kMaxWhole);
}

// Whether the cluster schedule runs: asked for (cluster_request >= 1), two chunks a warp, bq 16-byte aligned.
bool cluster_schedule_runs(const DecodeArgs& a, int chunks) {
  return chunks == 2 && cluster_request(a) >= 1 && reinterpret_cast<uintptr_t>(a.bq.data()) % 16 == 0;
}

// A launch of clusters of `cluster` blocks of kThreads with `smem` bytes of dynamic shared memory, for the
// occupancy query and the launch alike (the attribute lives beside the configuration that points at it).
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  ClusterLaunch(dim3 grid, int cluster, int smem, cudaStream_t st) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(cluster);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = st;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// The kernel's limits, worked out once per device and shared-memory size: its dynamic shared memory
// allowed, and the blocks resident at once (with clusters of `cluster` blocks when cluster > 0; 0 when
// not one cluster of that size fits).
template <class T, int HG, int NT, int CH, bool CL, bool SEEDS = false, int HS = 1>
int64_t prepare(int device, const Geo& g, int cluster) {
  auto kernel = decode_tc<T, HG, NT, CH, CL, SEEDS, HS>;
  static int allowed[kMaxDevices] = {};  // raised only when a call needs more, not on every launch
  static bool non_portable[kMaxDevices] = {};
  static int seen_total[kMaxDevices][kMaxWhole + 1] = {};
  static int64_t resident[kMaxDevices][kMaxWhole + 1] = {};
  if (allowed[device] < g.total) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, g.total));
    allowed[device] = g.total;
  }
  if (cluster > kMaxCluster && !non_portable[device]) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    non_portable[device] = true;
  }
  if (seen_total[device][cluster] != g.total) {
    if (cluster == 0) {
      int blocks = 0;
      LT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, size_t(g.total)));
      resident[device][cluster] = int64_t(std::max(1, blocks)) * sm_count(device);
    } else {
      const ClusterLaunch c(dim3(unsigned(cluster)), cluster, g.total, nullptr);
      int clusters = 0;
      LT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &c.cfg));
      resident[device][cluster] = int64_t(clusters) * cluster;
    }
    seen_total[device][cluster] = g.total;
  }
  return resident[device][cluster];
}

// SEEDS: the clustered kernel with the seeds' dims as constants (launch_for_shape picks it at those dims; without
// the cluster schedule the general non-cluster kernel runs).
// HS: the heads in HS slices, a grid's z (the seeds' instance only): each sequence's slices are treated as
// sequences of their own (B HS of them) for the splits and clusters.
template <class T, int HG, int NT, int CH, bool SEEDS = false, int HS = 1>
void launch(const DecodeArgs& a, Geo g, Tensor& out) {
  const Device dev = a.aq.device();
  const int device = dev.index;
  // The cluster schedule where it was asked for and applies (two chunks a warp, bq 16-byte aligned).
  const int request = cluster_request(a), cluster_cap = std::min(request, kMaxCluster);
  int cluster = cluster_schedule_runs(a, CH) ? cluster_cap : 0;
  LT_CHECK(HS == 1 || cluster, "[tpa_decode] head slices need the cluster schedule");
  auto kernel = decode_tc<T, HG, NT, CH, false>;
  auto clustered = decode_tc<T, HG, NT, CH, CH == 2, SEEDS, HS>;
  auto resident_with = [&](int c) { return prepare<T, HG, NT, CH, CH == 2, SEEDS, HS>(device, g, c); };
  const int64_t B = a.aq.size(0) * HS, M = a.ak.size(1);  // B: sequences times head slices
  int64_t resident = 0;
  if (cluster) {
    // Each size up to the one asked for runs some blocks at once with every cluster of the grid resident (past
    // that, a second wave); the largest within a tenth of the most wins, as each cluster leaves one partial for
    // the last cluster to read (H100, B 8 M 8192: clusters of 1, 32 partials, 43.6 us; of 4, 8 partials, 37.0).
    int64_t blocks[kMaxCluster + 1] = {}, most = 0;
    for (int c = cluster; c >= 1; --c) {
      blocks[c] = resident_with(c) / c / B * c;
      most = std::max(most, blocks[c]);
    }
    int best = cluster;
    while (best > 1 && 10 * blocks[best] < 9 * most) --best;
    cluster = best;
    resident = std::max<int64_t>(blocks[best], 1) * B;
  } else {
    resident = prepare<T, HG, NT, CH, false>(device, g, 0);
  }
  int64_t rows = a.split_rows;
  if (rows > 0) {
    rows = (rows + g.rows - 1) / g.rows * g.rows;
    rows = std::max(rows, (M + kMaxSplits - 1) / kMaxSplits);
    // The size asked for (tests: many clusters a sequence), where one cluster of it fits the GPU.
    if (cluster) cluster = request > kMaxCluster && resident_with(request) > 0 ? request : cluster_cap;
  } else {
    const int64_t tiles = (M + g.rows - 1) / g.rows;
    int s = choose_splits(B, tiles, resident);
    // Short caches: one tile a split where the splits make one portable cluster a sequence and every block has an SM
    // of its own, so each block's chain is a tile shorter (a tile's chain costs more than the cluster's combine; H200,
    // B 8, M 192-512: 11.5-12.8 us against 14.3-15.1). Past that (more blocks than SMs, or clusters past 8) two
    // tiles a split measured as fast or faster (B 32 M 384: 15.3 against 15.7 us; B 8 M 1024: 14.6 against 14.9),
    // and at two tiles one block without the cluster's combine (B 32 M 128: 12.4 against 12.7 us).
    if (cluster && request > kMaxCluster && tiles >= 3 && tiles > s && tiles <= kMaxCluster &&
        B * tiles <= sm_count(device) &&
        resident_with(int(tiles)) / tiles >= B)
      s = int(tiles);
    // Past the portable size (request 9..16): one cluster a sequence whenever the splits fit one and a
    // cluster for every sequence stays resident, so that no last block combines partial results.
    if (cluster && request > kMaxCluster && s > cluster && s <= request && resident_with(s) / s >= B) cluster = s;
    // Several clusters a sequence pay the last cluster's combine (partials through global memory, a counter, two
    // more cluster barriers), and a cluster past the portable 8 is placed two blocks an SM on fewer SMs. Where a
    // cluster of 8, 4, 2 or 1 blocks (else of up to `request`, in place of several) covers the sequence in at most four
    // tiles a split with every sequence's cluster resident, it runs instead (H200, the seeds' shape: B 8 M 2048 16.0 ->
    // 15.5 us with one cluster of 8 for one of 16, M 4096 23.5 -> 21.5 with one of 16 for four of 8; B 32 M 1024
    // 22.0 -> 19.9 with one of 4 for two). Past four tiles a split the blocks' chains cost more than the combine
    // (B 8 M 8192: 42 against 29 us).
    if (cluster && (s > cluster || cluster > kMaxCluster)) {
      auto fits = [&](int c) { return c <= tiles && (tiles + c - 1) / c <= 4 && resident_with(c) / c >= B; };
      int pick = 0;
      // Head slices: any size (a cluster of 8 a slice at one block an SM does not fit 16 slices on an H200).
      for (int c = kMaxCluster; c >= 1 && !pick; c = HS > 1 ? c - 1 : c / 2)
        if (c <= request && fits(c)) pick = c;
      if (!pick && s > cluster && request >= kMaxWhole && fits(kMaxWhole)) pick = kMaxWhole;
      if (pick) s = cluster = pick;
    }
    rows = ((M + s - 1) / s + g.rows - 1) / g.rows * g.rows;
  }
  g.split_rows = int(rows);
  g.splits = int((M + rows - 1) / rows);
  // A cluster of at most the splits; trailing splits past M (no rows) round the grid up to whole clusters
  // (with the cluster size chosen above, still within the resident clusters).
  cluster = std::min(cluster, g.splits);
  g.cluster = cluster;
  g.gather = request > kMaxCluster;
  if (cluster) g.splits = (g.splits + cluster - 1) / cluster * cluster;
  const int slots = cluster ? g.splits / cluster : g.splits;  // partial results a sequence
  Tensor length_storage, part_acc, part_stat;
  const DecodeLengths lengths = make_decode_lengths(a.lengths, dev, length_storage);
  float* pa = nullptr;
  float* ps = nullptr;
  int* counters = nullptr;
  if (slots > 1) {
    part_acc = empty({B, slots, g.H, g.E}, DType::F32, dev);
    part_stat = empty({B, slots, g.H, 2}, DType::F32, dev);
    pa = part_acc.data_ptr<float>();
    ps = part_stat.data_ptr<float>();
    counters = split_counters(device, B);
  }
  const T* f[6];
  const Tensor* factors[6] = {&a.aq, &a.bq, &a.ak, &a.bk, &a.av, &a.bv};
  for (int i = 0; i < 6; ++i) f[i] = static_cast<const T*>(factors[i]->data());
  T* o = static_cast<T*>(out.data());
  const dim3 grid(unsigned(g.splits), unsigned(B / HS), unsigned(HS));
  if (!cluster) {
    kernel<<<grid, kThreads, size_t(g.total), stream(device)>>>(f[0], f[1], f[2], f[3], f[4], f[5], lengths, o, pa,
                                                                ps, counters, g);
    LT_CUDA_CHECK_LAUNCH();
    return;
  }
  const ClusterLaunch c(grid, cluster, g.total, stream(device));
  LT_CUDA_CHECK(cudaLaunchKernelEx(&c.cfg, clustered, f[0], f[1], f[2], f[3], f[4], f[5], lengths, o, pa, ps,
                                   counters, g));
  LT_CUDA_CHECK_LAUNCH();
}

// The seeds' shape (H 32, R_k = R_v 1, D = E 128): where the cluster schedule runs (launch decides), the kernel with
// those dims as constants and a whole tile's copies unrolled (175 registers against 232; H200, B 8: M 128 8.7 us against
// 11.9, M 32768 61 against 70; B 32 M 32768 86% of copy against 74%). LINTAPE_TPA_DECODE_SEEDS=0 runs the general
// kernel there, to compare.
bool seeds_shape(const Geo& g) {
  static const bool off = [] {
    const char* v = std::getenv("LINTAPE_TPA_DECODE_SEEDS");
    return v && std::string(v) == "0";
  }();
  return !off && g.H == 32 && g.Rk == 1 && g.Rv == 1 && g.D == 128 && g.E == 128;
}

// Whether a call runs two head slices (DecodeArgs::head_slices): only the seeds' instance under the cluster schedule,
// where asked for, or by the launcher's rule: past one 64-row tile (below it a block is
// its prologue and epilogue, which the slices do not shorten), where one block a 128-row tile of each slice fits the
// SMs. A slice's block reads the tile's bk and bv rows whole for half the heads, so where blocks hold several tiles
// the slices lose (H200, B 8 M 2048: 14.7 us against 14.1-14.4; B 32 M 1024 19.7 against 19.4); at one or two tiles a
// block they win (B 8: M 128 7.3-7.4 against 8.7, M 384 9.7-9.9 against 10.8-10.9, M 1024 11.1-11.2 against 11.3-11.4;
// B 32 M 256 9.8 against 11.8-11.9).
// `sliced`: the geometry of a slice's blocks (128-row tiles: four row groups of two 16-row chunks).
bool runs_head_slices(const DecodeArgs& a, const Geo& g, const Geo& sliced) {
  static const int env = [] {
    const char* v = std::getenv("LINTAPE_TPA_DECODE_HEADS");
    return v ? std::atoi(v) : -1;
  }();
  const int asked = a.head_slices >= 0 ? a.head_slices : env;
  if (asked == 1 || !seeds_shape(g) || !cluster_schedule_runs(a, g.chunks)) return false;
  if (asked == 2) return true;
  const int64_t B = a.aq.size(0), M = a.ak.size(1), tile = sliced.rows;
  return M > 64 && B * 2 * ((M + tile - 1) / tile) <= sm_count(a.aq.device().index);
}

template <class T, int CH>
void launch_for_shape(const DecodeArgs& a, const Geo& g, Tensor& out) {
  const int hg = head_groups(g.H);
  const bool wide = g.E == 128;
  if constexpr (CH == 2)
    if (seeds_shape(g)) {
      const Geo sliced = make_geo(a, 2, 2);
      if (runs_head_slices(a, g, sliced)) return launch<T, 1, 16, 2, true, 2>(a, sliced, out);
      return launch<T, 2, 16, 2, true>(a, g, out);
    }
  if (hg == 1) wide ? launch<T, 1, 16, CH>(a, g, out) : launch<T, 1, 8, CH>(a, g, out);
  else if (hg == 2) wide ? launch<T, 2, 16, CH>(a, g, out) : launch<T, 2, 8, CH>(a, g, out);
  else wide ? launch<T, 4, 16, CH>(a, g, out) : launch<T, 4, 8, CH>(a, g, out);
}

// Two 16-row chunks a warp (their chains interleave) where that keeps two blocks an SM, else one.
Geo pick_geo(const DecodeArgs& a) {
  const Geo two = make_geo(a, 2);
  return two.total <= kTwoBlocksBytes ? two : make_geo(a, 1);
}

}  // namespace

bool decode_uses_tensor_cores(const DecodeArgs& a) {
  if (!a.allow_tensor_cores) return false;
  const DType dt = a.aq.dtype();
  if (dt != DType::BF16 && dt != DType::F16) return false;
  const int64_t H = a.aq.size(2), Rq = a.aq.size(3), Rk = a.ak.size(3), Rv = a.av.size(3), D = a.bq.size(3),
                E = a.bv.size(3);
  if (Rq > 16 || Rk > 4 || Rv > 4 || H > 64 || D % 16 != 0 || D > 256 || (E != 64 && E != 128)) return false;
  if ((H * Rk) % 8 != 0 || (H * Rv) % 8 != 0) return false;
  for (const Tensor* t : {&a.ak, &a.bk, &a.av, &a.bv})
    if (t->strides()[0] % 8 != 0 || reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) return false;
  return pick_geo(a).total <= kMaxSharedBytes;
}

void decode_tensor_cores(const DecodeArgs& a, Tensor& out) {
  const Geo g = pick_geo(a);
  const int ch = g.chunks;
  if (a.aq.dtype() == DType::BF16)
    ch == 2 ? launch_for_shape<__nv_bfloat16, 2>(a, g, out) : launch_for_shape<__nv_bfloat16, 1>(a, g, out);
  else
    ch == 2 ? launch_for_shape<__half, 2>(a, g, out) : launch_for_shape<__half, 1>(a, g, out);
}

}  // namespace lintape::tpa_cuda
