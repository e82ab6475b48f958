// Internal to the FAL family: the chunk sweep kernel that the sequence launchers (ops/fal_noncausal.cu,
// ops/fal_causal.cu) share, with the per-row act, LRPE and their backward.
//
// A block owns one (b, h) and a range of tokens, and keeps a (D', E) f32 state S in shared memory. It walks
// its range in chunks of C tokens; each chunk's rows are loaded, put through the acts and the LRPE by one warp
// per row (never written to memory), and then, depending on the pass:
//   forward      y_i = a_i (x_i S) + sum_j w_ij (x_i . y_j) v_j,  o_i = gb_i * y_i
//   query grad   the same y_i gives dgb_i = do_i * y_i; dqb_i = a_i (S dy_i) + sum_j w_ij (dy_i . v_j) y_j
//   key grad     (reverse sweep, x = kb, y = qb, v = dy, u = vb) dvb_i and dkb_i by the same two formulas
//   reduce       S += sum_j c_j y_j^T v_j only (noncausal kv = kb^T vb or dkv = qb^T dy over a token range)
// Causal passes add the intra-chunk terms (w_ij = lambda^|i - j| on the causal side of the diagonal) and
// carry S from chunk to chunk: S <- lambda^C S + sum_j c_j y_j^T v_j. Noncausal row passes read a fixed S
// (kv or dkv) and have a_i = 1, no intra-chunk terms. Everything accumulates in f32.
#pragma once
#include <cmath>
#include "core/cuda_types.cuh"
#include "ops/fal_cuda.h"

namespace lintape::fal_cuda {

enum SweepPass : int { kForward, kQueryGrad, kKeyGrad, kReduceKV, kReduceDKV };

constexpr int kSweepWarps = 8;
constexpr int kSweepThreads = 32 * kSweepWarps;
constexpr int kMaxSharedBytes = 227 * 1024;  // sm_90 opt-in limit per block
constexpr int kMaxHeadDim = 256;

struct SweepArgs {
  const void *q, *k, *v, *g, *dout;
  void *dq, *dk, *dv, *dg, *out;
  const float* state_in;  // (B H, P, E): S0, kv, dkv or dS_final; null: zeros
  float* state_out;       // (B H [, splits], P, E): S_final, dS0 or a reduction's partial; null: not written
  const float* theta;
  int theta_rows, theta_cols;
  const float* decay;
  int H, D, E, P;
  int64_t N, M;            // query and key tokens
  int64_t position;        // token 0's position
  int act_q, act_k, act_v, act_g, lrpe;
  int pass;
  bool causal;
  int chunk;               // C
  int64_t tokens_per_block;  // noncausal: the token range of grid.y's blocks
};

// Shared memory floats of one block.
inline size_t sweep_smem_floats(int64_t D, int64_t P, int64_t E, int64_t C) {
  const int64_t wide = D > E ? D : E;
  return size_t(P * (E + 1) + 3 * C * P + 5 * C * E + 2 * C * C + 2 * C + kSweepWarps * wide);
}

__device__ __forceinline__ float fal_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float fal_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float fal_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// row (len floats in shared memory) <- act(row); one warp.
__device__ __forceinline__ void warp_act(float* row, int len, int act) {
  const int lane = threadIdx.x & 31;
  if (act == FalStepSpec::kSoftmaxFeature) {
    float m = -INFINITY;
    for (int i = lane; i < len; i += 32) m = fmaxf(m, row[i]);
    m = fal_warp_max(m);
    float s = 0;
    for (int i = lane; i < len; i += 32) s += __expf(row[i] - m);
    const float inv = 1.0f / fal_warp_sum(s);
    for (int i = lane; i < len; i += 32) row[i] = __expf(row[i] - m) * inv;
  } else if (act != FalStepSpec::kNone) {
    for (int i = lane; i < len; i += 32) {
      const float x = row[i];
      row[i] = act == FalStepSpec::kRelu ? fmaxf(x, 0.0f) : act == FalStepSpec::kSigmoid ? fal_sigmoid(x)
                                                                                         : x * fal_sigmoid(x);
    }
  }
  __syncwarp();
}

// cos and sin of angle index j of head h at position pos; the angle is reduced modulo 2 pi in double.
__device__ __forceinline__ void lrpe_angle(const SweepArgs& a, int h, int j, int64_t pos, float& c, float& s) {
  const float* rate = a.theta + (a.theta_rows == 1 ? 0 : h * a.theta_cols);
  const double r = a.theta_cols == 1 ? rate[0] : (j < a.theta_cols ? rate[j] : 0.0);
  const double ang = double(pos) * r;
  sincosf(float(ang - 6.283185307179586 * rint(ang * 0.15915494309189535)), &s, &c);
}

template <class T>
__device__ __forceinline__ void warp_load(const T* src, float* dst, int len) {
  for (int i = threadIdx.x & 31; i < len; i += 32) dst[i] = cuda::to_acc(src[i]);
  __syncwarp();
}

// dst (P) <- lrpe(act(x)) of one row x (D); one warp.
template <class T>
__device__ void prep_row(const T* x, float* dst, int act, const SweepArgs& a, int h, int64_t pos) {
  const int D = a.D, lane = threadIdx.x & 31;
  warp_load(x, dst, D);
  warp_act(dst, D, act);
  if (a.lrpe == FalStepSpec::kNoLrpe) return;
  const int A = a.lrpe == FalStepSpec::kRotate ? D / 2 : D;
  for (int j = lane; j < A; j += 32) {
    float c, s;
    lrpe_angle(a, h, j, pos, c, s);
    if (a.lrpe == FalStepSpec::kCosine) {
      const float xv = dst[j];
      dst[j] = xv * c;
      dst[D + j] = xv * s;
    } else {
      const float x1 = dst[j], x2 = dst[A + j];
      dst[j] = x1 * c - x2 * s;
      dst[A + j] = x1 * s + x2 * c;
    }
  }
  __syncwarp();
}

// dx (len, global) from grad (len, shared) for y = act(x); act_out holds act(x). One warp.
template <class T>
__device__ void warp_act_backward(const T* x, const float* act_out, const float* grad, T* dx, int len, int act) {
  const int lane = threadIdx.x & 31;
  float dot = 0;
  if (act == FalStepSpec::kSoftmaxFeature) {
    for (int i = lane; i < len; i += 32) dot += act_out[i] * grad[i];
    dot = fal_warp_sum(dot);
  }
  for (int i = lane; i < len; i += 32) {
    const float gi = grad[i], y = act_out[i];
    float d = gi;
    switch (act) {
      case FalStepSpec::kRelu: d = y > 0.0f ? gi : 0.0f; break;
      case FalStepSpec::kSigmoid: d = gi * y * (1.0f - y); break;
      case FalStepSpec::kSilu: {
        const float xv = cuda::to_acc(x[i]), sg = fal_sigmoid(xv);
        d = gi * sg * (1.0f + xv * (1.0f - sg));
        break;
      }
      case FalStepSpec::kSoftmaxFeature: d = y * (gi - dot); break;
      default: break;
    }
    dx[i] = cuda::from_acc<T>(d);
  }
  __syncwarp();
}

// dx (D, global) from grad (P, shared, overwritten) for qb = lrpe(act(x)); scratch holds D floats. One warp.
template <class T>
__device__ void row_backward(const T* x, float* grad, float* scratch, T* dx, int act, const SweepArgs& a, int h,
                             int64_t pos) {
  const int D = a.D, lane = threadIdx.x & 31;
  warp_load(x, scratch, D);
  warp_act(scratch, D, act);
  if (a.lrpe != FalStepSpec::kNoLrpe) {
    const int A = a.lrpe == FalStepSpec::kRotate ? D / 2 : D;
    for (int j = lane; j < A; j += 32) {
      float c, s;
      lrpe_angle(a, h, j, pos, c, s);
      if (a.lrpe == FalStepSpec::kCosine) {
        grad[j] = c * grad[j] + s * grad[D + j];
      } else {
        const float d1 = grad[j], d2 = grad[A + j];
        grad[j] = c * d1 + s * d2;
        grad[A + j] = c * d2 - s * d1;
      }
    }
    __syncwarp();
  }
  warp_act_backward(x, scratch, grad, dx, D, act);
}

template <class T>
__global__ void __launch_bounds__(kSweepThreads) sweep_kernel(SweepArgs a) {
  extern __shared__ float smem[];
  const int P = a.P, E = a.E, D = a.D, C = a.chunk, ldS = E + 1;
  const int wide = D > E ? D : E;
  float* S = smem;                   // P x (E + 1)
  float* Qs = S + P * ldS;           // C x P: qb
  float* Ks = Qs + C * P;            // C x P: kb
  float* OP = Ks + C * P;            // C x P: dqb or dkb
  float* Vs = OP + C * P;            // C x E: vb
  float* Gs = Vs + C * E;            // C x E: gb
  float* Ds = Gs + C * E;            // C x E: do
  float* Ys = Ds + C * E;            // C x E: dy = do * gb
  float* OE = Ys + C * E;            // C x E: y or dvb
  float* Aw = OE + C * E;            // C x C: w_ij (x_i . y_j)
  float* Bw = Aw + C * C;            // C x C: w_ij (u_i . v_j)
  float* row_decay = Bw + C * C;     // C: lambda^(i + 1) (reverse: lambda^(cl - 1 - i)), the state term's
  float* update_decay = row_decay + C;  // C: lambda^(cl - 1 - j) (reverse: lambda^(j + 1)), the update's weights
  float* scratch = update_decay + C;  // warps x max(D, E)

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t bh = blockIdx.x, b = bh / a.H;
  const int h = int(bh % a.H);
  const bool causal = a.causal, pass_rows = a.pass <= kKeyGrad;
  const bool reverse = causal && a.pass == kKeyGrad;
  const bool update = causal || !pass_rows;
  const bool need_q = a.pass != kReduceKV && (causal || a.pass != kKeyGrad);
  const bool need_k = causal || a.pass == kReduceKV || a.pass == kKeyGrad;
  const bool need_g = a.pass == kForward || a.pass == kQueryGrad || a.pass == kReduceDKV || reverse;
  const bool need_do = a.pass == kQueryGrad || a.pass == kReduceDKV || reverse;
  const float lam = causal && a.decay ? a.decay[h] : 1.0f;

  // Token range: causal blocks take the whole sequence; noncausal ones a slice of the queries or keys.
  const bool over_keys = a.pass == kReduceKV || (!causal && a.pass == kKeyGrad);
  const int64_t len = over_keys ? a.M : a.N;
  const int64_t t0 = causal ? 0 : blockIdx.y * a.tokens_per_block;
  const int64_t t1 = causal ? len : min(len, t0 + a.tokens_per_block);
  if (t0 >= t1 && pass_rows) return;

  const float* S_src = a.state_in ? a.state_in + bh * P * E : nullptr;
  for (int i = tid; i < P * E; i += kSweepThreads) S[(i / E) * ldS + i % E] = S_src ? S_src[i] : 0.0f;

  // Roles of the chunk arrays in the formulas above.
  const bool keys_first = a.pass == kKeyGrad || a.pass == kReduceKV;
  const float* X = keys_first ? Ks : Qs;
  const float* Y = keys_first ? Qs : Ks;
  const float* V = a.pass == kKeyGrad ? Ys : Vs;
  const float* U = a.pass == kKeyGrad ? Vs : Ys;
  const float* Yup = a.pass == kReduceKV ? Ks : a.pass == kReduceDKV ? Qs : Y;  // the state update's rows
  const float* Vup = a.pass == kReduceKV ? Vs : a.pass == kReduceDKV ? Ys : V;

  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* g = static_cast<const T*>(a.g);
  const T* dout = static_cast<const T*>(a.dout);
  auto qrow = [&](int64_t t) { return ((b * a.N + t) * a.H + h) * int64_t(D); };
  auto krow = [&](int64_t t) { return ((b * a.M + t) * a.H + h) * int64_t(D); };
  auto vrow = [&](int64_t t) { return ((b * a.M + t) * a.H + h) * int64_t(E); };
  auto grow = [&](int64_t t) { return ((b * a.N + t) * a.H + h) * int64_t(E); };

  const int64_t chunks = (t1 - t0 + C - 1) / C;
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t c = reverse ? chunks - 1 - ci : ci;
    const int64_t cs = t0 + c * C;
    const int cl = int(min(int64_t(C), t1 - cs));
    __syncthreads();  // the previous chunk's rows and S are no longer read
    for (int r = warp; r < cl; r += kSweepWarps) {
      const int64_t t = cs + r, pos = a.position + t;
      if (need_q) prep_row(q + qrow(t), Qs + r * P, a.act_q, a, h, pos);
      if (need_k) {
        prep_row(k + krow(t), Ks + r * P, a.act_k, a, h, pos);
        warp_load(v + vrow(t), Vs + r * E, E);
        warp_act(Vs + r * E, E, a.act_v);
      }
      if (need_g) {
        warp_load(g + grow(t), Gs + r * E, E);
        warp_act(Gs + r * E, E, a.act_g);
      }
      if (need_do) {
        warp_load(dout + grow(t), Ds + r * E, E);
        for (int e = tid & 31; e < E; e += 32) Ys[r * E + e] = Ds[r * E + e] * Gs[r * E + e];
      }
    }
    for (int i = tid; i < cl; i += kSweepThreads) {
      const bool decays = causal && lam != 1.0f;
      row_decay[i] = decays ? powf(lam, float(reverse ? cl - 1 - i : i + 1)) : 1.0f;
      update_decay[i] = decays ? powf(lam, float(reverse ? i + 1 : cl - 1 - i)) : 1.0f;
    }
    __syncthreads();

    if (pass_rows) {
      const bool need_P = a.pass != kForward;
      if (causal) {
        // Intra-chunk weights on the causal side: j <= i forward, j >= i in the reverse sweep.
        for (int idx = tid; idx < C * C; idx += kSweepThreads) {
          const int i = idx / C, j = idx % C;
          const bool live = i < cl && j < cl && (reverse ? j >= i : j <= i);
          float wa = 0, wb = 0;
          if (live) {
            const float w = lam == 1.0f ? 1.0f : powf(lam, float(reverse ? j - i : i - j));
            for (int p = 0; p < P; ++p) wa += X[i * P + p] * Y[j * P + p];
            if (need_P)
              for (int e = 0; e < E; ++e) wb += U[i * E + e] * V[j * E + e];
            wa *= w;
            wb *= w;
          }
          Aw[idx] = wa;
          Bw[idx] = wb;
        }
        __syncthreads();
      }
      for (int idx = tid; idx < cl * E; idx += kSweepThreads) {
        const int i = idx / E, e = idx % E;
        float s = 0;
        for (int p = 0; p < P; ++p) s += X[i * P + p] * S[p * ldS + e];
        if (causal) {
          s *= row_decay[i];
          for (int j = 0; j < cl; ++j) s += Aw[i * C + j] * V[j * E + e];
        }
        OE[idx] = s;
      }
      if (need_P)
        for (int idx = tid; idx < cl * P; idx += kSweepThreads) {
          const int i = idx / P, p = idx % P;
          float s = 0;
          for (int e = 0; e < E; ++e) s += S[p * ldS + e] * U[i * E + e];
          if (causal) {
            s *= row_decay[i];
            for (int j = 0; j < cl; ++j) s += Bw[i * C + j] * Y[j * P + p];
          }
          OP[idx] = s;
        }
      __syncthreads();
      float* scr = scratch + warp * wide;
      for (int r = warp; r < cl; r += kSweepWarps) {
        const int64_t t = cs + r, pos = a.position + t;
        float* oe = OE + r * E;
        if (a.pass == kForward) {
          T* out = static_cast<T*>(a.out) + grow(t);
          for (int e = tid & 31; e < E; e += 32) out[e] = cuda::from_acc<T>(Gs[r * E + e] * oe[e]);
        } else if (a.pass == kQueryGrad) {
          for (int e = tid & 31; e < E; e += 32) oe[e] *= Ds[r * E + e];
          __syncwarp();
          warp_load(g + grow(t), scr, E);
          warp_act(scr, E, a.act_g);
          warp_act_backward(g + grow(t), scr, oe, static_cast<T*>(a.dg) + grow(t), E, a.act_g);
          row_backward(q + qrow(t), OP + r * P, scr, static_cast<T*>(a.dq) + qrow(t), a.act_q, a, h, pos);
        } else {
          warp_act_backward(v + vrow(t), Vs + r * E, oe, static_cast<T*>(a.dv) + vrow(t), E, a.act_v);
          row_backward(k + krow(t), OP + r * P, scr, static_cast<T*>(a.dk) + krow(t), a.act_k, a, h, pos);
        }
      }
    }

    if (update) {
      __syncthreads();  // the outputs above read S before it moves on
      const float carry = causal && lam != 1.0f ? powf(lam, float(cl)) : 1.0f;
      for (int idx = tid; idx < P * E; idx += kSweepThreads) {
        const int p = idx / E, e = idx % E;
        float s = S[p * ldS + e] * carry;
        for (int j = 0; j < cl; ++j) s += update_decay[j] * Yup[j * P + p] * Vup[j * E + e];
        S[p * ldS + e] = s;
      }
    }
  }
  if (a.state_out && update) {
    __syncthreads();
    float* dst = a.state_out + (bh * gridDim.y + blockIdx.y) * int64_t(P) * E;
    for (int i = tid; i < P * E; i += kSweepThreads) dst[i] = S[(i / E) * ldS + i % E];
  }
}

// Launches sweep_kernel<T> for a's dtype with the largest chunk whose shared memory fits.
inline void launch_sweep(SweepArgs a, DType dtype, dim3 grid, cudaStream_t st, const char* op) {
  int C = 16;
  while (C > 1 && sweep_smem_floats(a.D, a.P, a.E, C) * sizeof(float) > size_t(kMaxSharedBytes)) C /= 2;
  a.chunk = C;
  const size_t smem = sweep_smem_floats(a.D, a.P, a.E, C) * sizeof(float);
  LT_CHECK(smem <= size_t(kMaxSharedBytes), "[", op, "] the fused kernel's state of D' = ", a.P, ", E = ", a.E,
           " does not fit in shared memory");
  auto go = [&](auto tag) {
    using T = decltype(tag);
    LT_CUDA_CHECK(cudaFuncSetAttribute(sweep_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    sweep_kernel<T><<<grid, kSweepThreads, smem, st>>>(a);
    LT_CUDA_CHECK_LAUNCH();
  };
  switch (dtype) {
    case DType::F32: go(float()); break;
    case DType::BF16: go(__nv_bfloat16()); break;
    case DType::F16: go(__half()); break;
    default: fail(str("[", op, "] the fused kernels support f32, bf16 and f16; got ", dtype_name(dtype)));
  }
}

// The fields of SweepArgs that come from the inputs and the spec.
inline SweepArgs sweep_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const FalStepSpec& spec) {
  SweepArgs a{};
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.g = g.data();
  a.theta = spec.theta.defined() ? spec.theta.data_ptr<float>() : nullptr;
  a.theta_rows = spec.theta.defined() ? int(spec.theta.size(0)) : 0;
  a.theta_cols = spec.theta.defined() ? int(spec.theta.size(1)) : 0;
  a.decay = spec.decay.defined() ? spec.decay.data_ptr<float>() : nullptr;
  a.H = int(q.size(2));
  a.D = int(q.size(3));
  a.E = int(v.size(3));
  a.P = spec.lrpe == FalStepSpec::kCosine ? 2 * a.D : a.D;
  a.N = q.size(1);
  a.M = k.size(1);
  a.position = spec.position;
  a.act_q = spec.act_q;
  a.act_k = spec.act_k;
  a.act_v = spec.act_v;
  a.act_g = spec.act_g;
  a.lrpe = spec.lrpe;
  return a;
}

}  // namespace lintape::fal_cuda
