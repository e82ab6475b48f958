// CUDA elementwise kernels: one binary kernel over broadcast operands (StridedIndex, dims coalesced),
// in packs of 16 bytes where every operand allows it, else element by element; unary ops run through
// it with x as both operands. Templated on the functors of ops/elementwise_cuda.h; grid-stride loops;
// compute in float (double for double). sin/cos keep a small stack frame: the slow path of the
// argument reduction for huge inputs.
#include <algorithm>
#include "core/cuda_types.cuh"
#include "ops/elementwise_cuda.h"

namespace lintape::elementwise {
using namespace lintape::cuda;

namespace {
constexpr int kThreads = 256;

template <class T, int V> struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <class T> constexpr int kVec = 16 / int(sizeof(T));

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Enough blocks for `work` threads, capped at a few waves of resident blocks (grid-stride beyond).
unsigned blocks_for(int64_t work) { return std::min(grid_for(work, kThreads), 132u * 8 * 4); }

// Dims merged where every operand is laid out contiguously across them: fewer divisions per element.
void coalesce(StridedIndex& a, StridedIndex& b) {
  int n = 0;
  for (int d = 0; d < a.ndim; ++d) {
    if (a.shape[d] == 1) continue;
    bool merge = n > 0 && a.stride[n - 1] == a.stride[d] * a.shape[d] && b.stride[n - 1] == b.stride[d] * a.shape[d];
    if (merge) {
      a.shape[n - 1] *= a.shape[d];
      b.shape[n - 1] = a.shape[n - 1];
      a.stride[n - 1] = a.stride[d];
      b.stride[n - 1] = b.stride[d];
      continue;
    }
    a.shape[n] = b.shape[n] = a.shape[d];
    a.stride[n] = a.stride[d];
    b.stride[n] = b.stride[d];
    ++n;
  }
  a.ndim = b.ndim = n;
}

// Offsets of output element i in a and b, from one decomposition of i (both share the output's shape).
__device__ __forceinline__ void offsets(int64_t i, const StridedIndex& a, const StridedIndex& b, int64_t& oa,
                                        int64_t& ob) {
  oa = ob = 0;
  for (int d = a.ndim - 1; d > 0; --d) {
    int64_t k = i % a.shape[d];
    i /= a.shape[d];
    oa += k * a.stride[d];
    ob += k * b.stride[d];
  }
  if (a.ndim > 0) oa += i * a.stride[0], ob += i * b.stride[0];
}

// One operand's pack of V consecutive outputs: V consecutive elements (inner stride 1) or one element
// repeated (inner stride 0, a broadcast).
template <class T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, bool repeat) {
  if (!repeat) return *reinterpret_cast<const Pack<T, V>*>(p);
  Pack<T, V> r;
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = *p;
  return r;
}

// Packs of V outputs with 16-byte loads and stores and one index decomposition per pack; the last
// n % V outputs one by one.
template <class T, class F>
__global__ void binary_vec_kernel(T* out, const T* a, const T* b, int64_t n, StridedIndex ai, StridedIndex bi,
                                  bool a_repeat, bool b_repeat, F f) {
  constexpr int V = kVec<T>;
  using P = Pack<T, V>;
  int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = tid; p < n / V; p += step) {
    int64_t oa, ob;
    offsets(p * V, ai, bi, oa, ob);
    P pa = load_pack<T, V>(a + oa, a_repeat), pb = load_pack<T, V>(b + ob, b_repeat), po;
#pragma unroll
    for (int k = 0; k < V; ++k) po.v[k] = from_acc<T>(f(to_acc(pa.v[k]), to_acc(pb.v[k])));
    reinterpret_cast<P*>(out)[p] = po;
  }
  for (int64_t i = n / V * V + tid; i < n; i += step) {
    int64_t oa, ob;
    offsets(i, ai, bi, oa, ob);
    out[i] = from_acc<T>(f(to_acc(a[oa]), to_acc(b[ob])));
  }
}

template <class T, class F>
__global__ void binary_strided_kernel(T* out, const T* a, const T* b, int64_t n, StridedIndex ai, StridedIndex bi,
                                      F f) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t oa, ob;
    offsets(i, ai, bi, oa, ob);
    out[i] = from_acc<T>(f(to_acc(a[oa]), to_acc(b[ob])));
  }
}

// Unary kernels: the binary ones with x as both operands and a functor that ignores the second.
template <class F> struct First {
  F f;
  template <class C> __device__ __forceinline__ C operator()(C x, C) const { return f(x); }
};

// Whether packs of V outputs can be read from an operand (coalesced to `s`, at `base`): its inner stride
// is 0, or 1 with every pack 16-byte aligned. Packs must not cross the inner dim (unless it is the only one).
bool packable(const StridedIndex& s, const void* base, int V) {
  if (s.ndim > 1 && s.shape[s.ndim - 1] % V != 0) return false;
  int64_t inner = s.ndim > 0 ? s.stride[s.ndim - 1] : 0;
  if (inner == 0) return true;
  bool ok = inner == 1 && aligned16(base);
  for (int d = 0; d + 1 < s.ndim; ++d) ok = ok && s.stride[d] % V == 0;
  return ok;
}
bool repeats(const StridedIndex& s) { return s.ndim == 0 || s.stride[s.ndim - 1] == 0; }

template <class T, class F>
void launch_binary(T* out, const T* a, const T* b, int64_t n, StridedIndex ai, StridedIndex bi, F f, cudaStream_t s) {
  coalesce(ai, bi);
  constexpr int V = kVec<T>;
  if (aligned16(out) && packable(ai, a, V) && packable(bi, b, V))
    binary_vec_kernel<<<blocks_for(n / V + 1), kThreads, 0, s>>>(out, a, b, n, ai, bi, repeats(ai), repeats(bi), f);
  else
    binary_strided_kernel<<<blocks_for(n), kThreads, 0, s>>>(out, a, b, n, ai, bi, f);
  LT_CUDA_CHECK_LAUNCH();
}
}  // namespace

void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  int64_t n = out.numel();
  if (n == 0) return;
  LT_DISPATCH_FLOAT_CUDA(out.dtype(), "elementwise", T, {
    visit(op, [&](auto f) {
      launch_binary(static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(b.data()), n,
                    StridedIndex(a, out.shape()), StridedIndex(b, out.shape()), f, stream(out.device().index));
    });
  });
}

void unary_cuda(UnaryOp op, double scalar, const Tensor& out, const Tensor& x) {
  int64_t n = out.numel();
  if (n == 0) return;
  LT_DISPATCH_FLOAT_CUDA(out.dtype(), "elementwise", T, {
    const T* px = static_cast<const T*>(x.data());
    visit<acc_t<T>>(op, scalar, [&](auto f) {
      launch_binary(static_cast<T*>(out.data()), px, px, n, StridedIndex(x), StridedIndex(x), First<decltype(f)>{f},
                    stream(out.device().index));
    });
  });
}

}  // namespace lintape::elementwise
