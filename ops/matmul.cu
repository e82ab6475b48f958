// cuBLASLt GEMM. Row-major C = op(A) op(B) is computed as column-major C^T = op(B)^T op(A)^T: the
// row-major buffers are read as their column-major transposes, so no data moves and the user's
// transposes become cuBLASLt's op flags. Plans (descriptors and the heuristic's algorithms) are cached
// per (device, dtypes, shapes, transposes, sharing, alignment); the 32 MiB workspace is kept per device.
// The output may be f32 under 16-bit inputs, and may be accumulated into (beta = 1).
// Both caches live for the whole process.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>
#include "core/cuda.h"
#include "ops/matmul_cuda.h"

namespace lintape::ops_cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kMaxAlgos = 16;

struct Types {
  cudaDataType_t data, scale;
  cublasComputeType_t compute;
};

Types types_of(DType t) {
  switch (t) {
    case DType::F32: return {CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F};  // no TF32
    case DType::BF16: return {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::F16: return {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::F64: return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    default: fail(str("[matmul] expected a float dtype (f32, f64, bf16, f16); got ", dtype_name(t)));
  }
}

// The largest power of two (at most 256) dividing the address and, for a batch, the batch stride.
uint32_t alignment(const void* p, int64_t batch_stride_bytes) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p) | uintptr_t(256) | uintptr_t(batch_stride_bytes);
  return uint32_t(v & (~v + 1));
}

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLAS's A (our b), B (our a), C
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (op) cublasLtMatmulDescDestroy(op);
    for (cublasLtMatrixLayout_t l : {la, lb, lc})
      if (l) cublasLtMatrixLayoutDestroy(l);
  }
};

// A row-major (rows, cols) matrix is a column-major (cols, rows) one with leading dimension cols.
void make_layout(cublasLtMatrixLayout_t& l, cudaDataType_t type, int64_t rows, int64_t cols, int64_t batch,
                 int64_t stride) {
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, uint64_t(cols), uint64_t(rows), cols));
  if (batch == 1) return;
  int32_t count = int32_t(batch);
  LT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  LT_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
}

struct Problem {
  int device;
  DType dtype, out_dtype;
  int64_t batch, m, n, k, stride_a, stride_b;  // strides 0 for a shared operand
  bool ta, tb;
  uint32_t align_a, align_b, align_c;

  auto key() const {
    return std::make_tuple(device, int(dtype), int(out_dtype), batch, m, n, k, stride_a, stride_b, ta, tb, align_a, align_b, align_c);
  }
};

// align_c: the output's alignment (see alignment()).
Problem problem_of(const Tensor& a, const Tensor& b, DType out_dtype, uint32_t align_c, int64_t batch, int64_t m,
                   int64_t n, int64_t k, bool ta, bool tb) {
  LT_CHECK(batch <= INT32_MAX, "[matmul] at most ", INT32_MAX, " matrices in a batch; got ", batch);
  Problem p;
  p.device = a.device().index;
  p.dtype = a.dtype();
  p.out_dtype = out_dtype;
  p.batch = batch;
  p.m = m;
  p.n = n;
  p.k = k;
  p.stride_a = (a.dim() == 2 || batch == 1) ? 0 : m * k;
  p.stride_b = (b.dim() == 2 || batch == 1) ? 0 : k * n;
  p.ta = ta;
  p.tb = tb;
  int64_t es = int64_t(dtype_size(a.dtype()));
  p.align_a = alignment(a.data(), p.stride_a * es);
  p.align_b = alignment(b.data(), p.stride_b * es);
  p.align_c = align_c;
  return p;
}

std::unique_ptr<Plan> make_plan(const Problem& pr) {
  Types t = types_of(pr.dtype);
  auto plan = std::make_unique<Plan>();
  LT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, t.compute, t.scale));
  cublasOperation_t op_a = pr.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = pr.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  LT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  make_layout(plan->la, t.data, pr.tb ? pr.n : pr.k, pr.tb ? pr.k : pr.n, pr.batch, pr.stride_b);
  make_layout(plan->lb, t.data, pr.ta ? pr.k : pr.m, pr.ta ? pr.m : pr.k, pr.batch, pr.stride_a);
  make_layout(plan->lc, types_of(pr.out_dtype).data, pr.m, pr.n, pr.batch, pr.m * pr.n);

  cublasLtMatmulPreference_t pref = nullptr;
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, decltype(&cublasLtMatmulPreferenceDestroy)> pref_owner(
      pref, cublasLtMatmulPreferenceDestroy);
  uint64_t ws = kWorkspaceBytes;
  LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, pr.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, pr.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, pr.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, pr.align_c}};
  for (const auto& [attr, value] : aligns)
    LT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));

  plan->algos.resize(kMaxAlgos);
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cuda::cublaslt_handle(), plan->op, plan->la, plan->lb, plan->lc,
                                                     plan->lc, pref, kMaxAlgos, plan->algos.data(), &found);
  LT_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0, "[matmul] cuBLASLt offers no algorithm for ", pr.batch,
           " x (", pr.m, ", ", pr.k, ") @ (", pr.k, ", ", pr.n, ") in ", dtype_name(pr.dtype), " (status ", int(st),
           ")");
  plan->algos.resize(size_t(found));
  return plan;
}

const Plan& plan_for(const Problem& pr) {
  static std::mutex mu;
  static auto* cache = new std::map<decltype(pr.key()), std::unique_ptr<Plan>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<Plan>& slot = (*cache)[pr.key()];
  if (!slot) slot = make_plan(pr);
  return *slot;
}

void* workspace(int device) {
  static std::mutex mu;
  static auto* blocks = new std::map<int, std::shared_ptr<Storage>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<Storage>& s = (*blocks)[device];
  if (!s) s = std::make_shared<Storage>(kWorkspaceBytes, Device::cuda(device));
  return s->data;
}

}  // namespace

void gemm_cuda(const Tensor& a, const Tensor& b, const Tensor& c, int64_t batch, int64_t m, int64_t n, int64_t k,
               bool ta, bool tb, int heuristic_rank, bool accumulate) {
  if (c.numel() == 0) return;
  if (k == 0) {
    if (!accumulate) Tensor(c).zero_();
    return;
  }
  int64_t c_stride_bytes = batch == 1 ? 0 : m * n * int64_t(dtype_size(c.dtype()));
  Problem pr = problem_of(a, b, c.dtype(), alignment(c.data(), c_stride_bytes), batch, m, n, k, ta, tb);
  const Plan& plan = plan_for(pr);
  LT_CHECK(heuristic_rank >= 0 && size_t(heuristic_rank) < plan.algos.size(), "[matmul] heuristic_rank must be in [0, ",
           plan.algos.size(), "); got ", heuristic_rank);
  const float one_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  const double one_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  bool f64 = c.dtype() == DType::F64;
  int dev = c.device().index;
  LT_CUBLAS_CHECK(cublasLtMatmul(cuda::cublaslt_handle(), plan.op, f64 ? static_cast<const void*>(&one_d) : &one_f,
                                 b.data(), plan.la, a.data(), plan.lb, f64 ? static_cast<const void*>(&beta_d) : &beta_f,
                                 c.data(), plan.lc, c.data(), plan.lc, &plan.algos[size_t(heuristic_rank)].algo,
                                 workspace(dev), kWorkspaceBytes, cuda::stream(dev)));
}

int gemm_cuda_heuristic_count(const Tensor& a, const Tensor& b, int64_t batch, int64_t m, int64_t n, int64_t k,
                              bool ta, bool tb) {
  if (batch * m * n == 0 || k == 0) return 1;  // handled without cuBLASLt
  return int(plan_for(problem_of(a, b, a.dtype(), 256, batch, m, n, k, ta, tb)).algos.size());
}

}  // namespace lintape::ops_cuda
