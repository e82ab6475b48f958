// Internal to the TPA family: the fused CUDA launchers, decode (ops/tpa/decode.cu, with its tensor-core
// kernel in ops/tpa/decode_tc.cu) and attention (ops/tpa/attention.cu). ops/tpa/tpa.cpp checks the inputs
// and calls them; tests call them directly on poisoned outputs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/tensor.h"

namespace lintape::tpa_cuda {

// One decode call, already checked: aq (B, 1, H, Rq) and bq (B, 1, Rq, D) contiguous; ak (B, M, H, Rk),
// bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E) with each batch entry's rows contiguous and any
// batch stride (a TpaCache's buffers are read in place); lengths: B entries, each in 1..M (passed to the
// kernel by value up to 256 sequences); all factors of one float dtype other than f64.
struct DecodeArgs {
  Tensor aq, bq, ak, bk, av, bv;
  std::vector<int64_t> lengths;
  double scale = 0;
  int64_t split_rows = 0;          // cache rows per split; 0 lets the launcher choose from the shapes
  bool allow_tensor_cores = true;  // false forces the general kernel (tests)
  // Tensor-core kernel: 1..8 runs the cluster schedule (splits combined by thread-block clusters of up
  // to this many blocks through distributed shared memory), 9..16 the same with one cluster a sequence
  // of up to this many blocks where the splits fit one and combines that load several partial results
  // at once, 0 the last-block combine, -1 what LINTAPE_TPA_DECODE_CLUSTER says (unset: 16, faster than 8
  // at every measured shape on an H100, bench/notes/tpa-decode.md).
  int cluster = -1;
  // Tensor-core kernel at the seeds' shape (H 32, R_k = R_v 1, D = E 128) under the cluster schedule: 2 splits each
  // sequence's heads into two slices of 16, each with blocks of its own (twice the blocks, each with half the
  // products, for short caches at small batches); 1 keeps the heads together; -1 lets the launcher choose
  // (LINTAPE_TPA_DECODE_HEADS=1 or 2 overrides it). Elsewhere the heads stay together.
  int head_slices = -1;
};

// out (B, 1, H, E) contiguous, in the factors' dtype. The tensor-core kernel is one launch (with a split
// over the cache, the last block of each sequence to finish combines the splits); the general kernel
// adds a combine launch when it splits.
void decode(const DecodeArgs& args, Tensor& out);

// Whether decode runs the tensor-core kernel for these arguments: bf16/f16, R_q <= 16, R_k, R_v <= 4,
// H <= 64, D a multiple of 16 up to 256, E 64 or 128, 16-byte aligned rows.
bool decode_uses_tensor_cores(const DecodeArgs& args);

// The tensor-core kernel's launcher (ops/tpa/decode_tc.cu), for arguments it accepts.
void decode_tensor_cores(const DecodeArgs& args, Tensor& out);

}  // namespace lintape::tpa_cuda

namespace lintape::tpa_cuda {

// Fused attention (ops/tpa/attention.cu), already checked: the six factors 4-D (aq (B, N, H, Rq),
// bq (B, N, Rq, D), ak (B, M, H, Rk), bk (B, M, Rk, D), av (B, M, H, Rv), bv (B, M, Rv, E)), bf16 or
// f16, D == E in {64, 128}, ranks 1..16, causal only with N == M. Read through their token strides:
// each factor's batch and token dims merge, a's rank stride is 1, b's rows of D are packed at stride D
// and 16-byte aligned (ops/tpa/tpa.cpp copies a factor that is not).
// The forward's kernels (ops/tpa/attention.cu): mma.sync (any tensor-core GPU, documents); on Hopper
// (sm_90a builds) warpgroup products with all-thread copies (Warpgroup) or fed by a producer warp through TMA
// (WarpgroupTma), that one with the two consumer warpgroups taking turns (WarpgroupPingPong), and both
// persistent with Q copied too (WarpgroupPersistent, WarpgroupPersistentPingPong). Auto: the one
// LINTAPE_TPA_FWD names (mma, wgmma, tma, pingpong, persist, persist-pingpong), else the fastest measured that
// the call can run (on Hopper: WarpgroupPingPong up to N = 2048 queries, WarpgroupTma above).
enum class ForwardKernel {
  Auto,
  MmaSync,
  Warpgroup,
  WarpgroupTma,
  WarpgroupPingPong,
  WarpgroupPersistent,
  WarpgroupPersistentPingPong
};

// The kernels attention_forward can run on this device for a call without documents (MmaSync first).
std::vector<ForwardKernel> forward_kernels(int device);

// The backward's kernels (ops/tpa/attention_bwd.cu): mma.sync (any tensor-core GPU, every call) and, on Hopper
// in sm_90a builds, warpgroup products (Warpgroup: D = 128 without documents; other calls run mma.sync), and
// their split form (WarpgroupSplit: dK and dV through f32 workspaces, contracted per token by a second kernel),
// and that form fed by a TMA producer warp (WarpgroupTma). Auto: the one LINTAPE_TPA_BWD names (mma, wgmma,
// wgmma-split, tma), else WarpgroupTma where the call and the device run it (WarpgroupSplit where dO's rows are
// not 16-byte aligned): the fastest at every shape measured (bench/notes/tpa-hopper.md, sections 4 to 6).
enum class BackwardKernel { Auto, MmaSync, Warpgroup, WarpgroupSplit, WarpgroupTma };

// The kernels attention_backward can run on this device for a call without documents at D = 128 (MmaSync
// first).
std::vector<BackwardKernel> backward_kernels(int device);

struct AttentionArgs {
  Tensor aq, bq, ak, bk, av, bv;
  bool causal = true;
  double scale = 0;
  ForwardKernel forward_kernel = ForwardKernel::Auto;
  BackwardKernel backward_kernel = BackwardKernel::Auto;
  int persistent_blocks = 0;  // > 0: the persistent kernels' grid at most this (tests: several items a block)
  // The row kernels of before (a build_rows launch a factor; in the backward a rows_factor_grads a pair) instead of
  // the wide ones (ops/tpa/attention_rows.cuh); the same bits. LINTAPE_TPA_FWD_ROWS=old / LINTAPE_TPA_BWD_ROWS=old
  // set it for every forward / backward call.
  bool old_rows = false;
  int batch_per_launch = 0;  // > 0: at most this many batch entries a launch (tests: several launches)
  // Documents (N == M): starts (B, N) int32 contiguous on the factors' device (ops/documents.h); query n sees
  // key m iff starts[n] <= m <= n (causal) or starts[m] == starts[n]. Undefined: no boundaries. The forward
  // then runs the mma.sync kernel (the warpgroup kernel takes no documents).
  Tensor starts;
};

// Why the fused attention cannot run these factors, or "" when it can.
std::string attention_unsupported(DType dtype, int64_t D, int64_t E, int64_t Rq, int64_t Rk, int64_t Rv);

// out (B, N, H, E) in the factors' dtype and lse (B, N, H) f32 (base-2 log-sum-exp of the scaled scores),
// both contiguous and fully written.
void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse);

// The six factor gradients, shaped like the factors, contiguous, in the factors' dtype.
struct FactorGrads {
  Tensor aq, bq, ak, bk, av, bv;
};

// Fills g (every element written) from dout (B, N, H, E) contiguous, the forward's out and lse. k, v never
// reach global memory, nor (but with WarpgroupSplit and WarpgroupTma) dk, dv: the kernel contracts its f32 dk and
// dv tiles to the factors (the basis gradients summed over heads in f32); dq is summed over key tiles in f32 and
// contracted by a second kernel. The sums run in a fixed order: the same inputs give the same bits. Their
// workspace, (N H + M R_k + M R_v) D floats a batch entry ((N H + 2 M H) D with the split forms, whose dk and dv
// rows take dq's way), covers the batch entries of one launch. The forward's workspace is K and V (2 M H D
// values a batch entry) of a launch.
void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse, const Tensor& dout,
                        FactorGrads& g);

// tpa_factors' backward (ops/tpa/factors.cu): for each token (dy's rows, (..., W) contiguous) and head h, the rank
// gradients daq, dak, dav ((tokens, H, rank) contiguous each; an undefined one gives zeros) into columns
// a_at + h R ... a_at + (h + 1) R - 1 of dy, R = rq + rk + rv, and zeros into the columns after them (to W - 1).
template <class T>
struct RankGrads {
  const T *aq, *ak, *av;
  int rq, rk, rv;
};
void scatter_rank_grads(const Tensor& dy, int64_t a_at, int64_t heads, int64_t rq, int64_t rk,
                        int64_t rv, const Tensor& daq, const Tensor& dak, const Tensor& dav);

}  // namespace lintape::tpa_cuda
