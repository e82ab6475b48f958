// CUDA context: one stream per device that all lintape work runs on, the cuBLASLt handle, and the
// checking macros. Every CUDA and cuBLAS(Lt) call goes through LT_CUDA_CHECK / LT_CUBLAS_CHECK, which
// throw a lintape::Error naming the call, the file and the line.
#pragma once
#if LINTAPE_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cublasLt.h>
#include <cstdint>
#include "core/error.h"

namespace lintape::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* call, const char* file, int line);

cudaStream_t stream(int device = -1);  // the lintape stream of a device (-1: the current device)
void set_device(int device);
int current_device();
cublasLtHandle_t cublaslt_handle();     // of the current device
int sm_count(int device = -1);          // the SMs of a device (-1: the current device), read once
void synchronize(int device = -1);
// Whether the device's lintape stream is being captured into a CUDA graph (train/step_graph.h): nothing
// runs then, so checks that read a device value back on the host skip it.
bool capturing(int device = -1);

// A tiled tensor map (the tensor copy engine's view of a row-major array) with the 128-byte swizzle: `rank` dims
// and their box sizes innermost first, the byte strides of the rank - 1 outer dims; box coordinates past the
// array read as zeros and are skipped by bulk writes. `op` names the caller in errors.
CUtensorMap swizzled_tensor_map(const void* x, CUtensorMapDataType type, int rank, const cuuint64_t* dims,
                                const cuuint64_t* strides, const cuuint32_t* box, const char* op);
// The same without a swizzle: the box lands in shared memory as a dense array, innermost dim first.
CUtensorMap plain_tensor_map(const void* x, CUtensorMapDataType type, int rank, const cuuint64_t* dims,
                             const cuuint64_t* strides, const cuuint32_t* box, const char* op);

// Grid size for a 1-D launch of n work items with `threads` threads each handling `per_thread` items.
inline unsigned grid_for(int64_t n, int threads, int64_t per_thread = 1) {
  int64_t blocks = (n + int64_t(threads) * per_thread - 1) / (int64_t(threads) * per_thread);
  return unsigned(blocks < 1 ? 1 : blocks);
}

}  // namespace lintape::cuda

#define LT_CUDA_CHECK(call)                                                               \
  do {                                                                                    \
    cudaError_t lt_err_ = (call);                                                         \
    if (lt_err_ != cudaSuccess) ::lintape::cuda::throw_cuda_error(lt_err_, #call, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: reports launch-configuration errors at once.
#define LT_CUDA_CHECK_LAUNCH() LT_CUDA_CHECK(cudaGetLastError())
#define LT_CUBLAS_CHECK(call)                                                                   \
  do {                                                                                          \
    cublasStatus_t lt_st_ = (call);                                                             \
    if (lt_st_ != CUBLAS_STATUS_SUCCESS) ::lintape::cuda::throw_cublas_error(lt_st_, #call, __FILE__, __LINE__); \
  } while (0)
#endif
