// The MLP's SwiGLU gradient in one kernel (sm_90a): ds = dy w on the tensor cores, and in the epilogue the
// SwiGLU backward of swiglu_kernel (ops/elementwise.cu) from the product, so ds never goes to memory. swiglu_linear
// (ops/elementwise.cpp) calls it for dh and the recomputed s = silu(g) u, then dw = dy^T s through cuBLASLt.
//
// One block an SM walks 128 x 128 tiles of ds (rows of dy, columns of w), the tile index advancing by the grid.
// Warpgroups 0 and 1 are the consumers, 64 rows each (wgmma m64n128k16, f32 accumulators); warpgroup 2's first
// thread copies, by TMA, each k-step's boxes (dy: 64 columns x 128 rows, K-major; w: two boxes of 64 columns x 64
// rows, MN-major) into a ring of kStages slots on full / empty mbarriers, stored with the 128-byte swizzle, running
// on into the next tile's k-steps while the consumers finish a tile. Rows past the end read as zeros and are never
// stored. The column tiles run fastest, so the blocks running at once share their rows of dy in L2.
// Each consumer thread loads its u and gate values before a tile's products, so that their latency runs under
// them. The epilogue rounds ds to T (as the unfused path stores it) into shared memory, a warp's own 16 rows, and
// reads it back along the rows, so that h, dh and s move in 16-byte accesses.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "core/cuda_mma.cuh"
#include "core/cuda_tma.cuh"
#include "core/cuda_types.cuh"
#include "core/cuda_wgmma.cuh"
#include "ops/elementwise_cuda.h"

namespace lintape::elementwise {
using namespace lintape::cuda;
using cuda_device::pack2;

namespace {
constexpr int kRows = 128, kCols = 128;  // a block's tile of ds
constexpr int kBox = 64;                 // columns a box (128 bytes, the swizzle's width), also the k-step
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kConsumerRegs = 232, kProducerRegs = 40;
constexpr uint32_t kSlotBytes = kRows * kBox * 2, kStageBytes = 2 * kSlotBytes;  // dy's box, then w's two
// A warp's 16 staged rows of ds, padded so that the 8 rows of one store fall in different banks.
constexpr int kStagedLd = kCols + 8;
// The ring, then the staged rows of the 8 consumer warps; 1024 bytes of slack to find the 1024-byte start.
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 8 * 16 * kStagedLd * 2 + 1024;

struct Ring {
  uint64_t full[kStages], empty[kStages];
};

// Eight floats rounded to T (as from_acc) into 16 bytes of global memory, one store: written as a uint4
// assignment, the compiler split it into four here.
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&f)[8]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(pack2<T>(f[0], f[1])),
               "r"(pack2<T>(f[2], f[3])), "r"(pack2<T>(f[4], f[5])), "r"(pack2<T>(f[6], f[7]))
               : "memory");
}

// Tile t: row tile t / col_tiles, column tile t % col_tiles; a block takes blockIdx.x, + gridDim.x, ... h, dh
// (rows, 2F), s (rows, F) or null.
template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    grad_product(const __grid_constant__ CUtensorMap tdy, const __grid_constant__ CUtensorMap tw, const T* h, T* dh,
                 T* s, int rows, int F, int ksteps, int col_tiles, int tiles) {
#ifndef LINTAPE_WGMMA
  __trap();  // swiglu_grad_product_cuda runs this kernel only where wgmma was compiled
#else
  using P = Pack<T, 8>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ Ring ring;
  unsigned char* slots = smem_aligned<1024>(smem_raw);  // per stage: dy's box, then w's two boxes
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbarrier_init(&ring.full[st], 1);
      mbarrier_init(&ring.empty[st], 2 * 128);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (wg == 2) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 8 && lane == 0) {
      for (int tile = blockIdx.x, n = 0; tile < tiles; tile += gridDim.x) {
        const int row0 = tile / col_tiles * kRows, col0 = tile % col_tiles * kCols;
        for (int k = 0; k < ksteps; ++k, ++n) {  // n: the ring's k-steps so far
          const int st = n % kStages;
          unsigned char* slot = slots + st * kStageBytes;
          mbarrier_wait(&ring.empty[st], ((n / kStages) & 1) ^ 1);
          mbarrier_arrive_expect_tx(&ring.full[st], kStageBytes);
          tma_load_2d(slot, &tdy, &ring.full[st], k * kBox, row0);
          tma_load_2d(slot + kSlotBytes, &tw, &ring.full[st], col0, k * kBox);
          tma_load_2d(slot + kSlotBytes + kSlotBytes / 2, &tw, &ring.full[st], col0 + kBox, k * kBox);
        }
      }
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  T* staged = reinterpret_cast<T*>(slots + kStages * kStageBytes) + warp * 16 * kStagedLd;
  const int col = 8 * (lane & 15);
  for (int tile = blockIdx.x, n = 0; tile < tiles; tile += gridDim.x) {
    const int row0 = tile / col_tiles * kRows, col0 = tile % col_tiles * kCols;
    const int row_w = row0 + wg * 64 + (warp & 3) * 16;
    // This thread's u and gate packs of the epilogue (two rows of 128 columns a step), loaded now. Rows past the
    // end read the last row (never stored): loads under a condition were merged with the unloaded registers
    // right away, so the warps waited for them here.
    P u[8], g[8];
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int64_t r = min(row_w + 2 * it + lane / 16, rows - 1);
      u[it] = *reinterpret_cast<const P*>(h + r * 2 * F + col0 + col);
      g[it] = *reinterpret_cast<const P*>(h + r * 2 * F + F + col0 + col);
    }
    float acc[kCols / 2];
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) acc[i] = 0.f;
    for (int k = 0; k < ksteps; ++k, ++n) {
      const int st = n % kStages;
      const T* a = reinterpret_cast<const T*>(slots + st * kStageBytes) + wg * 64 * kBox;  // this warpgroup's rows
      const T* b = reinterpret_cast<const T*>(slots + st * kStageBytes + kSlotBytes);
      mbarrier_wait(&ring.full[st], (n / kStages) & 1);
      wgmma_fence_operand(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBox / 16; ++kk)  // a k-step of 16: A 32 bytes along its rows, B 16 rows down
        wgmma_mma<T, kCols, 0, 1>(acc, wgmma_desc_sw128(a + kk * 16, 16, 1024),
                                  wgmma_desc_sw128(b + kk * 16 * kBox, kSlotBytes / 2, 1024));
      wgmma_commit();
      wgmma_wait<1>();  // the previous k-step's products are done: its slot goes back
      wgmma_fence_operand(acc);
      if (k > 0) mbarrier_arrive(&ring.empty[(n - 1) % kStages]);
    }
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    mbarrier_arrive(&ring.empty[(n - 1) % kStages]);  // the tile's last slot, for the next tile's k-steps

    // ds rounded to T through this warp's 16 rows of shared memory (accumulator 4 j + 2 rr + e: row lane / 4 +
    // 8 rr, column 8 j + 2 (lane % 4) + e), read back along the rows: 16-byte accesses of dh and s.
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        *reinterpret_cast<uint32_t*>(staged + (lane / 4 + 8 * rr) * kStagedLd + 8 * j + 2 * (lane & 3)) =
            pack2<T>(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int i = 2 * it + lane / 16;
      if (row_w + i >= rows) continue;
      const int64_t r = row_w + i;
      const P d = *reinterpret_cast<const P*>(staged + i * kStagedLd + col);
      float fdu[8], fdg[8], fo[8];  // as swiglu_kernel
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float dk = to_acc(d.v[e]), gk = to_acc(g[it].v[e]), sk = Silu{}(gk);
        fdu[e] = dk * sk;
        fdg[e] = SiluBackward{}(gk, dk * to_acc(u[it].v[e]));
        fo[e] = sk * to_acc(u[it].v[e]);
      }
      store8(dh + r * 2 * F + col0 + col, fdu);
      store8(dh + r * 2 * F + F + col0 + col, fdg);
      if (s) store8(s + r * F + col0 + col, fo);
    }
    __syncwarp();  // the staged rows read before the next tile writes them
  }
#endif
}

// A row-major (outer, inner) 16-bit matrix as a 2-D tensor map read in boxes of kBox columns x box_rows rows,
// stored with the 128-byte swizzle; rows past `outer` read as zeros.
CUtensorMap tiled_map(const void* x, int64_t outer, int64_t inner, int box_rows, bool bf16) {
  const cuuint64_t dims[2] = {cuuint64_t(inner), cuuint64_t(outer)}, strides[1] = {cuuint64_t(inner) * 2};
  const cuuint32_t box[2] = {kBox, cuuint32_t(box_rows)};
  return swizzled_tensor_map(x, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, dims,
                             strides, box, "swiglu_linear");
}

template <class T>
void launch(const Tensor& dy, const Tensor& w, const Tensor& h, const Tensor& dh, const Tensor& s) {
  const int64_t rows = dy.size(0), C = dy.size(1), F = w.size(1);
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  const CUtensorMap tdy = tiled_map(dy.data(), rows, C, kRows, bf16), tw = tiled_map(w.data(), C, F, kBox, bf16);
  static bool configured = false;
  if (!configured) {
    LT_CUDA_CHECK(cudaFuncSetAttribute(grad_product<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
    configured = true;
  }
  const int col_tiles = int(F / kCols), tiles = int((rows + kRows - 1) / kRows) * col_tiles;
  const int grid = std::min(tiles, sm_count(dh.device().index));
  grad_product<T><<<unsigned(grid), kThreads, kSmemBytes, stream(dh.device().index)>>>(
      tdy, tw, static_cast<const T*>(h.data()), static_cast<T*>(dh.data()),
      s.defined() ? static_cast<T*>(s.data()) : nullptr, int(rows), int(F), int(C / kBox), col_tiles, tiles);
  LT_CUDA_CHECK_LAUNCH();
}
}  // namespace

bool swiglu_grad_product_cuda(const Tensor& dy, const Tensor& w, const Tensor& h, const Tensor& dh, const Tensor& s) {
  const DType dt = dh.dtype();
  if (dt != DType::BF16 && dt != DType::F16) return false;
  if (dy.dim() != 2 || w.dim() != 2 || h.dim() != 2 || dh.shape() != h.shape()) return false;
  const int64_t rows = dy.size(0), C = dy.size(1), F = w.size(1);
  if (rows < 1 || (rows + kRows - 1) / kRows * (F / kCols) > INT32_MAX || C % 64 != 0 || F % 128 != 0 ||
      w.size(0) != C || h.size(0) != rows ||
      h.size(1) != 2 * F || (s.defined() && s.shape() != Shape{rows, F}))
    return false;
  for (const Tensor* t : {&dy, &w, &h, &dh, &s}) {
    if (!t->defined()) continue;
    if (t->dtype() != dt || !t->is_cuda() || t->device() != dh.device() || !t->is_contiguous() || !aligned16(t->data()))
      return false;
  }
  if (!wgmma_runs(dh.device().index)) return false;
  if (dt == DType::BF16)
    launch<__nv_bfloat16>(dy, w, h, dh, s);
  else
    launch<__half>(dy, w, h, dh, s);
  return true;
}

}  // namespace lintape::elementwise
