#include "core/cuda.h"
#if LINTAPE_WITH_CUDA
#include <cudaTypedefs.h>
#endif
#include "core/error.h"
#include "core/device.h"
#include <mutex>
#include <vector>

namespace lintape {

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  std::string index = s.rfind("cuda:", 0) == 0 ? s.substr(5) : "";
  if (!index.empty() && index.size() <= 4 && index.find_first_not_of("0123456789") == std::string::npos)
    return Device::cuda(std::stoi(index));
  fail(str("[device] unknown device '", s, "'; expected cpu, cuda or cuda:N"));
}

#if LINTAPE_WITH_CUDA
int cuda_device_count() {
  static int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return 0;
    }
    return n;
  }();
  return count;
}
#else
int cuda_device_count() { return 0; }
#endif
bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace lintape

#if LINTAPE_WITH_CUDA
namespace lintape::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(str("CUDA error: ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ") in ", call, " at ",
                  file, ":", line));
}

void throw_cublas_error(cublasStatus_t st, const char* call, const char* file, int line) {
  throw Error(str("cuBLAS error: status ", int(st), " in ", call, " at ", file, ":", line));
}

namespace {
struct PerDevice {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  int sms = 0;
};
std::mutex mu;
std::vector<PerDevice>& devices() {
  static std::vector<PerDevice> d(size_t(std::max(cuda_device_count(), 1)));
  return d;
}
}  // namespace

int current_device() {
  int d = 0;
  LT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int device) {
  LT_CHECK(device >= 0 && device < cuda_device_count(), "[device] cuda:", device, " does not exist; this machine has ",
           cuda_device_count(), " CUDA device(s)");
  LT_CUDA_CHECK(cudaSetDevice(device));
}

cudaStream_t stream(int device) {
  if (device < 0) device = current_device();
  std::lock_guard<std::mutex> lock(mu);
  PerDevice& pd = devices().at(size_t(device));
  if (!pd.stream) {
    int prev = current_device();
    LT_CUDA_CHECK(cudaSetDevice(device));
    LT_CUDA_CHECK(cudaStreamCreateWithFlags(&pd.stream, cudaStreamNonBlocking));
    LT_CUDA_CHECK(cudaSetDevice(prev));
  }
  return pd.stream;
}

cublasLtHandle_t cublaslt_handle() {
  int device = current_device();
  std::lock_guard<std::mutex> lock(mu);
  PerDevice& pd = devices().at(size_t(device));
  if (!pd.lt) LT_CUBLAS_CHECK(cublasLtCreate(&pd.lt));
  return pd.lt;
}

int sm_count(int device) {
  if (device < 0) device = current_device();
  std::lock_guard<std::mutex> lock(mu);
  PerDevice& pd = devices().at(size_t(device));
  if (!pd.sms) LT_CUDA_CHECK(cudaDeviceGetAttribute(&pd.sms, cudaDevAttrMultiProcessorCount, device));
  return pd.sms;
}

void synchronize(int device) { LT_CUDA_CHECK(cudaStreamSynchronize(stream(device))); }

bool capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LT_CUDA_CHECK(cudaStreamIsCapturing(stream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

namespace {
CUtensorMap encode_tensor_map(const void* x, CUtensorMapDataType type, int rank, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle,
                              const char* op) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    LT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    LT_CHECK(fn && found == cudaDriverEntryPointSuccess, "[cuda] the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const cuuint32_t steps[5] = {1, 1, 1, 1, 1};
  LT_CHECK(rank >= 1 && rank <= 5, "[", op, "] a tensor map of ", rank, " dims (1 to 5)");
  CUtensorMap map;
  const CUresult r = encode(&map, type, cuuint32_t(rank), const_cast<void*>(x), dims, strides, box, steps,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  LT_CHECK(r == CUDA_SUCCESS, "[", op, "] cuTensorMapEncodeTiled failed: ", int(r));
  return map;
}
}  // namespace

CUtensorMap swizzled_tensor_map(const void* x, CUtensorMapDataType type, int rank, const cuuint64_t* dims,
                                const cuuint64_t* strides, const cuuint32_t* box, const char* op) {
  return encode_tensor_map(x, type, rank, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, op);
}

CUtensorMap plain_tensor_map(const void* x, CUtensorMapDataType type, int rank, const cuuint64_t* dims,
                             const cuuint64_t* strides, const cuuint32_t* box, const char* op) {
  return encode_tensor_map(x, type, rank, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, op);
}

}  // namespace lintape::cuda
#endif
