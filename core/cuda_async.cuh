// Asynchronous global-to-shared copies (cp.async, sm_80 and up) for the kernels that stage rows or tiles in
// shared memory while they compute.
#pragma once
#include <cstdint>

namespace lintape::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Dynamic shared memory `raw` from its first multiple of Align bytes. The offset is added to raw itself, so the
// compiler still knows the result is shared memory and accesses through it are ld.shared / st.shared; aligning
// the address through an integer would make each of them a generic access (slower, on the long scoreboard).
template <int Align>
__device__ __forceinline__ unsigned char* smem_aligned(unsigned char* raw) {
  return raw + (Align - smem_addr(raw) % Align) % Align;
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !valid (src is then not read). The first form takes the
// destination as a shared-space address (smem_addr), for loops that step it instead of converting a pointer a copy.
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// 16 bytes from src + SrcOffset to dst + DstOffset, both offsets folded into the instruction (unrolled copies of
// fixed shape: no address arithmetic a copy).
template <int DstOffset, int SrcOffset>
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%3], 16;\n" ::"r"(dst), "l"(src), "n"(DstOffset), "n"(SrcOffset)
               : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid = true) {
  cp_async16_at(smem_addr(dst), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most Pending of this thread's committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The 128-byte line holding p brought toward L2; nothing waits for it and no register receives it.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

}  // namespace lintape::cuda
