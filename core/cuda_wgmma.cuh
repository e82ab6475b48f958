// Warpgroup matrix products (wgmma, sm_90a): D (64 x N, f32 in registers) += A B with A (64 x 16) and B
// (16 x N) in shared memory, issued by the 128 threads of a warpgroup (4 consecutive warps from a multiple of
// 4) and run asynchronously until wgmma_wait. Only for code compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL).
//
// Operands use the canonical layouts without swizzle: 8 x 8 "core matrices" of 16-byte rows (128 contiguous
// bytes); descriptor fields give the byte distances between core matrices along K (leading, LBO) and along M
// or N (stride, SBO). K-major: a core matrix's rows run along M (N), its 8 elements along K; MN-major
// (transposed): its rows run along K, its 8 elements along M (N).
//
// A thread's accumulator d[N / 2]: warp w of the warpgroup holds rows 16 w + lane / 4 (d[4 j], d[4 j + 1]) and
// 16 w + lane / 4 + 8 (d[4 j + 2], d[4 j + 3]), columns 8 j + 2 (lane % 4) and the next one.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <string>
#include <type_traits>
#include "core/config.h"
#include "core/cuda.h"
#include "core/cuda_async.cuh"

namespace lintape::cuda {

// Whether this build holds the sm_90a kernels (wgmma, setmaxnreg), and whether a device is compute capability
// 9.0: the warpgroup kernels need both.
inline bool wgmma_compiled() {
  static const bool compiled = std::string(LINTAPE_CUDA_ARCHITECTURES).find("90a") != std::string::npos;
  return compiled;
}

inline bool is_hopper(int device) {
  int major = 0, minor = 0;
  LT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  LT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}
// Both: the warpgroup kernels may run on this device.
inline bool wgmma_runs(int device) { return wgmma_compiled() && is_hopper(device); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LINTAPE_WGMMA 1
#endif

// The thread's warpgroup, threadIdx.x / 128, broadcast from lane 0: the compiler then knows the value is the same
// across the warp and keeps the shared-memory addresses and descriptors made from it in uniform registers (made
// once a warp, not moved into them before every product). In kernels at the 128-register edge the different
// allocation can also add spills: measure before using it (bench/notes/fal-hopper.md, session 13).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) >> 7, 0); }

// The shared-memory descriptor of an operand starting at p (16-byte aligned), no swizzle.
__device__ __forceinline__ uint64_t wgmma_desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_addr(p) & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) | (uint64_t(sbo_bytes >> 4) << 32);
}
// The same with the 128-byte swizzle (the pattern of TMA's CU_TENSOR_MAP_SWIZZLE_128B: in each 1024-byte
// block of 8 rows of 128 bytes, row r's 16-byte chunk c stored at chunk c ^ r). The blocks start on
// 1024-byte boundaries; p may point into one (a k-step's columns). K-major: SBO the distance between blocks of 8
// rows (LBO unused); MN-major: LBO the distance between 64-element column blocks, SBO between blocks of 8 rows.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return wgmma_desc(p, lbo_bytes, sbo_bytes) | (uint64_t(1) << 62);
}

#ifdef LINTAPE_WGMMA
// Before the first wgmma that reads accumulators written by other instructions.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most Pending committed groups of the warpgroup are in flight.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
#endif
// Shared memory written by ordinary stores that wgmma reads next: in each writing thread, before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef LINTAPE_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous products.
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#ifdef LINTAPE_WGMMA

// One wgmma instruction: TY the operands' type, REGS the accumulators' operand list, A, B, SCALE, TA, TB the
// operand numbers of the descriptors, of scale-d (always 1: accumulate) and of the transposes; then the outputs.
#define LINTAPE_WGMMA_ASM(N, TY, REGS, A, B, SCALE, TA, TB, ...)                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N   \
               "k16.f32." TY "." TY " " REGS ", %" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"     \
               : __VA_ARGS__                                                                          \
               : "l"(a), "l"(b), "r"(1), "n"(TransA), "n"(TransB))
#define LINTAPE_D8(i)                                                                                        \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])

// The accumulators' operand lists (asm text and outputs) of each width.
#define LINTAPE_REGS_N16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define LINTAPE_OUTS_N16 LINTAPE_D8(0)
#define LINTAPE_REGS_N32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define LINTAPE_OUTS_N32 LINTAPE_D8(0), LINTAPE_D8(8)
#define LINTAPE_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define LINTAPE_OUTS_N64 LINTAPE_D8(0), LINTAPE_D8(8), LINTAPE_D8(16), LINTAPE_D8(24)
#define LINTAPE_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define LINTAPE_OUTS_N128 \
  LINTAPE_D8(0), LINTAPE_D8(8), LINTAPE_D8(16), LINTAPE_D8(24), \
      LINTAPE_D8(32), LINTAPE_D8(40), LINTAPE_D8(48), LINTAPE_D8(56)

// D (64 x 16) += A B.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wgmma_n16(float (&d)[8], uint64_t a, uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_ASM(16, "bf16", LINTAPE_REGS_N16, 8, 9, 10, 11, 12, LINTAPE_OUTS_N16);
  else
    LINTAPE_WGMMA_ASM(16, "f16", LINTAPE_REGS_N16, 8, 9, 10, 11, 12, LINTAPE_OUTS_N16);
}

// D (64 x 32) += A B.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wgmma_n32(float (&d)[16], uint64_t a, uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_ASM(32, "bf16", LINTAPE_REGS_N32, 16, 17, 18, 19, 20, LINTAPE_OUTS_N32);
  else
    LINTAPE_WGMMA_ASM(32, "f16", LINTAPE_REGS_N32, 16, 17, 18, 19, 20, LINTAPE_OUTS_N32);
}

// D (64 x 64) += A B.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wgmma_n64(float (&d)[32], uint64_t a, uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_ASM(64, "bf16", LINTAPE_REGS_N64, 32, 33, 34, 35, 36, LINTAPE_OUTS_N64);
  else
    LINTAPE_WGMMA_ASM(64, "f16", LINTAPE_REGS_N64, 32, 33, 34, 35, 36, LINTAPE_OUTS_N64);
}

// D (64 x 128) += A B.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint64_t a, uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    LINTAPE_WGMMA_ASM(128, "bf16", LINTAPE_REGS_N128, 64, 65, 66, 67, 68, LINTAPE_OUTS_N128);
  else
    LINTAPE_WGMMA_ASM(128, "f16", LINTAPE_REGS_N128, 64, 65, 66, 67, 68, LINTAPE_OUTS_N128);
}

#undef LINTAPE_REGS_N16
#undef LINTAPE_OUTS_N16
#undef LINTAPE_REGS_N32
#undef LINTAPE_OUTS_N32
#undef LINTAPE_REGS_N64
#undef LINTAPE_OUTS_N64
#undef LINTAPE_REGS_N128
#undef LINTAPE_OUTS_N128
#undef LINTAPE_D8
#undef LINTAPE_WGMMA_ASM

// D += A B for one k-step of 16; TransA / TransB 1: A (B) MN-major, else K-major.
template <class T, int N, int TransA, int TransB>
__device__ __forceinline__ void wgmma_mma(float (&d)[N / 2], uint64_t a, uint64_t b) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "wgmma widths built here");
  if constexpr (N == 16)
    wgmma_n16<T, TransA, TransB>(d, a, b);
  else if constexpr (N == 32)
    wgmma_n32<T, TransA, TransB>(d, a, b);
  else if constexpr (N == 64)
    wgmma_n64<T, TransA, TransB>(d, a, b);
  else
    wgmma_n128<T, TransA, TransB>(d, a, b);
}
#endif  // LINTAPE_WGMMA

}  // namespace lintape::cuda
