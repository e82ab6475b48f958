// For CUDA kernels: bulk copies from shared to global memory by the copy engine (cp.async.bulk, sm_90). The issuing
// thread spends one instruction a copy and no registers on the data; the copy reads shared memory asynchronously,
// so the source stays unchanged until bulk_wait<true> (the read done) and the kernel ends after bulk_wait<false>.
// Built for an older GPU, LINTAPE_BULK_COPY is undefined and callers copy with ordinary loads and stores.
#pragma once
#include <cstdint>
#include "core/cuda_async.cuh"

namespace lintape::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LINTAPE_BULK_COPY 1
#endif

#ifdef LINTAPE_BULK_COPY
// Shared memory written by ordinary stores that a bulk copy reads next: in each writing thread, before the barrier.
__device__ __forceinline__ void bulk_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// bytes (a multiple of 16; both addresses 16-byte aligned) from src (shared) to dst (global), in the thread's
// current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until every bulk group the thread committed has read its source (Read) or is complete.
template <bool Read>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (Read)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
#endif

}  // namespace lintape::cuda
