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

template <class T> constexpr int kVec = 16 / int(sizeof(T));


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

namespace {
// SwiGLU, V outputs (F % V == 0, 16-byte rows) or one per thread: element i of out is row i / F, column
// i % F of u = h[:, :F] and gate = h[:, F:]; the backward writes du and dgate at the same places of dh.
template <class T, int V>
__global__ void swiglu_kernel(const T* h, const T* dy, T* out, T* recomputed, int64_t n, int64_t F) {
  using P = Pack<T, V>;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n / V; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p * V, r = i / F, j = i - r * F;
    const P u = *reinterpret_cast<const P*>(h + r * 2 * F + j), g = *reinterpret_cast<const P*>(h + r * 2 * F + F + j);
    if (!dy) {
      P o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_acc<T>(Silu{}(to_acc(g.v[k])) * to_acc(u.v[k]));
      *reinterpret_cast<P*>(out + i) = o;
    } else {
      const P d = *reinterpret_cast<const P*>(dy + i);
      P du, dg, o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const auto gk = to_acc(g.v[k]), dk = to_acc(d.v[k]), sk = Silu{}(gk);
        du.v[k] = from_acc<T>(dk * sk);
        dg.v[k] = from_acc<T>(SiluBackward{}(gk, dk * to_acc(u.v[k])));
        o.v[k] = from_acc<T>(sk * to_acc(u.v[k]));
      }
      *reinterpret_cast<P*>(out + r * 2 * F + j) = du;
      *reinterpret_cast<P*>(out + r * 2 * F + F + j) = dg;
      if (recomputed) *reinterpret_cast<P*>(recomputed + i) = o;
    }
  }
}

template <class T>
void launch_swiglu(const T* h, const T* dy, T* out, T* recomputed, int64_t n, int64_t F, cudaStream_t s) {
  constexpr int V = kVec<T>;
  const bool vec = F % V == 0 && aligned16(h) && aligned16(out) && (!dy || aligned16(dy)) &&
                   (!recomputed || aligned16(recomputed));
  if (vec)
    swiglu_kernel<T, V><<<blocks_for(n / V), kThreads, 0, s>>>(h, dy, out, recomputed, n, F);
  else
    swiglu_kernel<T, 1><<<blocks_for(n), kThreads, 0, s>>>(h, dy, out, recomputed, n, F);
  LT_CUDA_CHECK_LAUNCH();
}
}  // namespace

void swiglu_forward_cuda(const Tensor& h, const Tensor& out) {
  const int64_t F = out.size(-1);
  LT_DISPATCH_FLOAT_CUDA(out.dtype(), "swiglu", T, {
    launch_swiglu(static_cast<const T*>(h.data()), static_cast<const T*>(nullptr), static_cast<T*>(out.data()),
                  static_cast<T*>(nullptr), out.numel(), F, stream(out.device().index));
  });
}

void swiglu_backward_cuda(const Tensor& h, const Tensor& dy, const Tensor& dh, const Tensor& recomputed) {
  const int64_t F = dy.size(-1);
  LT_DISPATCH_FLOAT_CUDA(dh.dtype(), "swiglu", T, {
    launch_swiglu(static_cast<const T*>(h.data()), static_cast<const T*>(dy.data()), static_cast<T*>(dh.data()),
                  recomputed.defined() ? static_cast<T*>(recomputed.data()) : nullptr, dy.numel(), F,
                  stream(dh.device().index));
  });
}

}  // namespace lintape::elementwise
