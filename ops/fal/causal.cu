// Fused FAL, causal with decay and state. bf16/f16 calls that ops/fal/chunk.cuh covers run its kernels (they
// read q, k, v, g in place when each token's heads are contiguous rows, e.g. slices of one projection); the
// others (f32, softmax over the feature dim, rotate, other head dims) run the chunk sweep
// of ops/fal/sweep.cuh (16-token chunks on the tensor cores, the f32 state in shared memory). Both cut the
// sequence into G segments when B x H alone leaves the GPU idle (G = 1 when it does not):
//   1. each segment's local state, from zero: sum over its tokens of lambda^(end - 1 - t) kb_t^T vb_t;
//   2. a scan over the segments turns them into the state entering each segment (from S0) and the final state;
//   3. each segment's outputs from its entering state, inside its chunks the masked, decayed product.
// Backward: the sweeps' query pass (dq, dg) reruns 1-3 forward; their key pass (dk, dv) runs them the other way on
// dS = sum lambda^(t - s) qb_t^T dy_t, from the final state's gradient, which gives dS0. The chunk kernels run 1-2
// before each of their two state passes, which then write every chunk's state from the segments' entering states;
// the forward pass is skipped when the forward saved the chunks' states (every chunk's, or the even chunks' that
// the gradient kernel advances across one chunk). The segment states, (B, H, G, D', E) or
// (B, H, G - 1, D', E) in f32, are the only extra memory beside the chunk kernels' per-chunk states. Documents
// (spec.starts) gate both kernels' chunks (chunk.cuh, sweep.cuh) and the scan, which passes no state across a
// segment that a document start cuts off.
// The Hopper forward cuts otherwise where that pays (balanced_blocks): one block an SM, each walking an equal run
// of the list of every (b, h)'s chunks, across (b, h)s as it needs; the local sums of the pieces before the runs'
// starts are many blocks' work (noncausal::reduce_pieces) and scan_pieces chains them within each (b, h).
#include <cstdlib>
#include "ops/fal/chunk.cuh"
#include "ops/fal/noncausal.cuh"
#include "ops/fal/sweep.cuh"

namespace lintape::fal_cuda {

namespace {

constexpr int64_t kMinSegmentTokens = 64;
constexpr int kMaxSegments = 32;
constexpr int64_t kMaxChunkSegments = 64;

// The scan over segments, in place over cells (BH, slots, n), each holding a segment's local sum: segment
// slot + shift (shift 0, or 1 for the reverse boundaries). Forward it runs from start (S0, or zeros when null)
// through the slots in order, reverse from start (dS_final) the other way; each cell receives the state
// before its segment (after false: the sweeps' entering states) or past it (after true: the chunk kernels'
// boundaries), and last (BH, n) or null the state past the final slot. len(seg) is the segment's token count
// (only the last may be short). starts: the documents' starts (B, tokens) or null; a segment whose last token's
// document began inside it (and is not the row's first) passes nothing of the state before it on.
__global__ void scan_segments(float* __restrict__ cells, const float* __restrict__ start, float* __restrict__ last,
                              const float* __restrict__ decay, const int32_t* __restrict__ starts, int H,
                              int64_t slots, int shift, bool after, int64_t n, int64_t total, int64_t tokens,
                              int64_t per, bool reverse) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t bh = i / n, j = i % n;
  const float lam = decay ? decay[bh % H] : 1.0f;
  float s = start ? start[i] : 0.0f;
  for (int64_t step = 0; step < slots; ++step) {
    const int64_t slot = reverse ? slots - 1 - step : step, first = (slot + shift) * per,
                  len = min(per, tokens - first);
    float* cell = cells + (bh * slots + slot) * n + j;
    float carry = lam == 1.0f ? 1.0f : powf(lam, float(len));
    if (starts) {
      const int st = starts[(bh / H) * tokens + first + len - 1];
      if (st >= first && st != 0) carry = 0.0f;
    }
    const float next = carry * s + *cell;
    *cell = after ? next : s;
    s = next;
  }
  if (last) last[i] = s;
}

// The balanced cut's boundaries (chunk::Args::piece): for cut x (1 ... cuts) at item p = x piece, chunk c of
// (b, h) = bh, c > 0, the state entering chunk c. A thread per value of each cut that starts a chain (its piece
// begins at the (b, h)'s first chunk) walks the (b, h)'s cuts in order: the state so far (from S0, or zeros)
// decayed across the piece, plus the piece's runs' sums (partial, runs of run_chunks chunks each, weighted from
// their ends to the cut), into boundary slot x - 1.
__global__ void scan_pieces(const float* __restrict__ partial, float* __restrict__ boundary,
                            const float* __restrict__ S0, const float* __restrict__ decay, int H, int64_t nC,
                            int64_t piece, int64_t cuts, int64_t runs, int64_t run_chunks, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= cuts * n) return;
  const int64_t x0 = i / n + 1, j = i % n, bh = x0 * piece / nC;
  int64_t c = x0 * piece - bh * nC;
  if (c == 0 || c > piece) return;  // not a chain's first cut
  const float log2_lam = decay ? __log2f(decay[bh % H]) : 0.0f;
  float s = S0 ? S0[bh * n + j] : 0.0f;
  for (int64_t x = x0, lo = 0; x <= cuts && x * piece / nC == bh; ++x) {
    c = x * piece - bh * nC;
    s *= chunk::decay_pow(log2_lam, int((c - lo) * chunk::kC));
    for (int64_t r = 0; r * run_chunks < c - lo; ++r) {
      const int64_t end = min(lo + (r + 1) * run_chunks, c);
      s += chunk::decay_pow(log2_lam, int((c - end) * chunk::kC)) * partial[((x - 1) * runs + r) * n + j];
    }
    boundary[(x - 1) * n + j] = s;
    lo = c;
  }
}

// One causal sweep (rows pass `pass`) over the whole sequence, or over G segments with their entering states
// computed first (reduce pass `reduce`, then the scan). start/last as in scan_segments.
void causal_sweep(SweepArgs a, int pass, int reduce, bool reverse, const float* start, float* last, int64_t BH,
                  int64_t G, DType dtype, cudaStream_t st, Device dev) {
  a.causal = true;
  if (G == 1) {
    a.pass = pass;
    a.tokens_per_block = a.N;
    a.block_states = false;
    a.state_in = start;
    a.state_out = last;
    launch_sweep(a, dtype, dim3(unsigned(BH), 1), st, "fal");
    return;
  }
  const int64_t per = causal_segment_tokens(a.N, G), n = int64_t(a.P) * a.E;
  Tensor states = empty({BH, G, a.P, a.E}, DType::F32, dev);
  a.tokens_per_block = per;
  a.pass = reduce;
  a.block_states = false;
  a.state_in = nullptr;
  a.state_out = states.data_ptr<float>();
  launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(G)), st, "fal");
  const int64_t total = BH * n;
  scan_segments<<<unsigned((total + 255) / 256), 256, 0, st>>>(states.data_ptr<float>(), start, last, a.decay,
                                                               a.starts, a.H, G, 0, false, n, total, a.N, per,
                                                               reverse);
  LT_CUDA_CHECK_LAUNCH();
  a.pass = pass;
  a.block_states = true;
  a.state_in = states.data_ptr<float>();
  a.state_out = nullptr;
  launch_sweep(a, dtype, dim3(unsigned(BH), unsigned(G)), st, "fal");
}

// The sweeps' arguments of a causal call, with the documents' starts.
SweepArgs causal_sweep_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const FalStepSpec& spec) {
  SweepArgs a = sweep_args(q, k, v, g, spec);
  a.starts = spec.starts.defined() ? spec.starts.data_ptr<int32_t>() : nullptr;
  return a;
}

bool use_chunks(const Tensor& q, const Tensor& v, const FalStepSpec& spec) {
  return causal_chunked(q.dtype(), q.size(3), v.size(3), spec);
}

// The sweeps' segments: `requested` (0 picks from the shapes) as whole 16-token chunks, none empty.
int64_t sweep_segments(int64_t BH, int64_t N, int64_t requested, Device dev) {
  if (requested <= 0) return causal_segments(BH, N, cuda::sm_count(dev.index));
  if (N == 0) return 1;
  const int64_t per = causal_segment_tokens(N, std::max<int64_t>(1, std::min(requested, N)));
  return (N + per - 1) / per;
}

// Cuts each (b, h)'s chunks into G segments (requested: 0 picks from the shapes; at most one a chunk) and
// allocates the boundary states when G > 1.
Tensor cut_chunks(chunk::Args& a, int64_t BH, int64_t requested, bool fused, Device dev) {
  const int64_t wanted =
      requested > 0 ? requested : chunk_segments({BH, a.nC, a.D, a.P, a.E}, cuda::sm_count(dev.index), fused);
  const int64_t G = std::max<int64_t>(1, std::min(wanted, a.nC));  // an empty sequence (nC = 0): one walk
  a.seg_chunks = (a.nC + G - 1) / G;
  a.G = a.seg_chunks == 0 ? 1 : (a.nC + a.seg_chunks - 1) / a.seg_chunks;
  if (a.G == 1) return Tensor();
  Tensor boundary = empty({BH, a.G - 1, a.P, a.E}, DType::F32, dev);
  a.boundary = boundary.data_ptr<float>();
  return boundary;
}

// The states at the segments' inner boundaries for a pass in direction `reverse`: each segment's local sum
// (a local state pass), then the scan from S0 (forward) or dS_final (reverse).
void fill_boundaries(const chunk::Args& a, int64_t BH, bool reverse, DType dtype, cudaStream_t st) {
  chunk::Args local = a;
  local.local = true;
  if (reverse)
    chunk::state_pass(local, dtype, BH, true, st);
  else  // the fused forward's local pass: one block per walk, its rows staged ahead (faster than the state pass)
    chunk::forward(local, dtype, BH, st);
  const int64_t n = int64_t(a.P) * a.E, total = BH * n;
  // Boundary j: forward the state past segment j, reverse the state entering segment j + 1 from its right.
  scan_segments<<<unsigned((total + 255) / 256), 256, 0, st>>>(a.boundary, reverse ? a.dS_final : a.S0, nullptr,
                                                               a.decay, a.starts, a.H, a.G - 1, reverse ? 1 : 0, true,
                                                               n, total, a.N, a.seg_chunks * chunk::kC, reverse);
  LT_CUDA_CHECK_LAUNCH();
}

// The balanced cut's boundary states (a.piece > 0, a.boundary): the pieces' sums in runs over the GPU, then the
// scan along each (b, h).
void piece_boundaries(const chunk::Args& a, DType dtype, cudaStream_t st, Device dev) {
  const int64_t cuts = (a.list_end + a.piece - 1) / a.piece - 1, n = int64_t(a.P) * a.E;
  if (cuts <= 0) return;
  // Runs of about a third of the pieces' chunks an SM, so that the GPU has about three runs an SM to share.
  int64_t local = 0;
  for (int64_t x = 1; x <= cuts; ++x) {
    const int64_t c = x * a.piece % a.nC;
    local += c == 0 ? 0 : std::min(c, a.piece);
  }
  const int64_t sms = cuda::sm_count(dev.index);
  const int64_t run_chunks = std::max<int64_t>(1, (local + 3 * sms - 1) / (3 * sms));
  const int64_t runs = (a.piece + run_chunks - 1) / run_chunks;
  Tensor partial = empty({cuts, runs, n}, DType::F32, dev);
  noncausal::reduce_pieces(a, dtype, cuts, runs, run_chunks, partial.data_ptr<float>(), st);
  scan_pieces<<<unsigned((cuts * n + 255) / 256), 256, 0, st>>>(partial.data_ptr<float>(), a.boundary, a.S0, a.decay,
                                                                a.H, a.nC, a.piece, cuts, runs, run_chunks, n);
  LT_CUDA_CHECK_LAUNCH();
}

int64_t g_forward_blocks = 0;  // set_forward_blocks

// The blocks of the balanced cut asked for: set_forward_blocks, else LINTAPE_FAL_FORWARD_BLOCKS (a count; -1 for
// none), else 0 (as the shapes want).
int64_t forward_blocks_asked() {
  if (g_forward_blocks != 0) return g_forward_blocks;
  static const int64_t env = [] {
    const char* v = std::getenv("LINTAPE_FAL_FORWARD_BLOCKS");
    return v ? int64_t(std::atoll(v)) : int64_t(0);
  }();
  return env;
}

// The Hopper forward's balanced cut where it runs and pays (or as asked): a.piece, a.list_end and the boundary
// states' memory (blocks - 1 of them); undefined and a.piece = 0 otherwise.
Tensor cut_pieces(chunk::Args& a, int64_t BH, int64_t segments, Device dev) {
  const int64_t asked = forward_blocks_asked();
  if (segments != 0 || a.nC == 0 || asked < 0 || !chunk::hopper_forward_runs(a)) return Tensor();
  const int64_t blocks = asked > 0 ? asked : balanced_blocks({BH, a.nC, a.D, a.P, a.E}, cuda::sm_count(dev.index));
  if (blocks <= 0) return Tensor();
  a.list_end = BH * a.nC;
  a.piece = (a.list_end + blocks - 1) / blocks;
  const int64_t used = (a.list_end + a.piece - 1) / a.piece;
  if (used == 1) return Tensor();  // one block walks every chunk: no cut
  Tensor boundary = empty({used - 1, a.P, a.E}, DType::F32, dev);
  a.boundary = boundary.data_ptr<float>();
  return boundary;
}

}  // namespace

void set_forward_blocks(int64_t blocks) { g_forward_blocks = blocks; }

bool causal_chunked(DType dtype, int64_t D, int64_t E, const FalStepSpec& spec) {
  return chunk::supported(dtype, D, E, spec);
}

int64_t causal_segment_tokens(int64_t N, int64_t G) {
  return ((N + G - 1) / G + kSweepChunk - 1) / kSweepChunk * kSweepChunk;  // whole chunks
}

// The chunk kernels' cut, from their times per chunk on an H100 (docs/BENCHMARKS.md): the fused forward about
// 14 us a chunk for a wave of one block per SM, its local pass (K and V only) 5 us; a state pass about 6 us a
// chunk for a wave of three blocks per SM (D / 64 x E / 64 blocks per (b, h)), its reverse local pass 5.5 us. A
// cut adds the local passes over all segments but one (forward: the fused one; backward: one before each
// state pass), a start-up of about a third of a chunk to every walk, and the boundary states' traffic (each
// written, scanned and read: four crossings at 2.5 TB/s). The cost of segments of `per` chunks, in microseconds.
static double segments_cost(const ChunkShape& s, int sms, bool fused, int64_t per) {
  const int64_t tiles = s.D / 64 * ((s.E + 63) / 64);
  const double boundary_us = 4.0 * double(s.P * s.E * 4) / 2.5e6;
  auto waves = [&](int64_t blocks, int64_t per_sm) { return double((blocks + per_sm * sms - 1) / (per_sm * sms)); };
  const int64_t G = (s.nC + per - 1) / per, cuts = s.BH * (G - 1);
  const double steps = double(per) + (G > 1 ? 0.3 : 0.0);
  if (fused) {
    const double cut = G > 1 ? waves(cuts, 1) * steps * 5.0 + double(cuts) * boundary_us : 0.0;
    return cut + waves(s.BH * G, 1) * steps * 14.0;
  }
  const double cut = G > 1 ? waves(cuts, 1) * steps * 5.0 + waves(cuts * tiles, 3) * steps * 5.5 +
                                 2.0 * double(cuts) * boundary_us
                           : 0.0;
  return cut + 2.0 * waves(s.BH * G * tiles, 3) * steps * 6.0;
}

// A cut must gain 10%.
int64_t chunk_segments(const ChunkShape& s, int sms, bool fused) {
  if (s.nC <= 1 || s.BH <= 0 || sms <= 0) return 1;
  auto cost = [&](int64_t per) { return segments_cost(s, sms, fused, per); };
  int64_t best = s.nC;  // chunks per segment
  const double whole = cost(s.nC);
  double best_cost = whole;
  for (int64_t per = s.nC - 1; per >= 1 && (s.nC + per - 1) / per <= kMaxChunkSegments; --per) {
    const double c = cost(per);
    if (c < best_cost) best = per, best_cost = c;
  }
  return best_cost < 0.9 * whole ? (s.nC + best - 1) / best : 1;
}

// The balanced cut against the uniform one (chunk_segments' choice and its cost, with its local pass), in the
// fused forward's chunk times, from the first measurement (bench/notes/fal-hopper.md, session 19, an H200): a
// balanced block's chunk costs about 1.3 of the uniform walk's (its kernel walks several (b, h)s and spills more
// at the 128-register cap), the pieces' sums, their scan and the extra walk's start about 15 chunk times. Taken
// where it gains 5%: B x H a little over the SMs (one wave and a small second), not at B x H under the SMs.
int64_t balanced_blocks(const ChunkShape& s, int sms) {
  if (s.nC <= 0 || s.BH <= 0 || sms <= 0) return 0;
  const int64_t total = s.BH * s.nC, piece = (total + sms - 1) / sms, blocks = (total + piece - 1) / piece;
  const double balanced = 1.3 * double(piece) + 15.0;
  const int64_t G = chunk_segments(s, sms, true);
  const double uniform = segments_cost(s, sms, true, (s.nC + G - 1) / G) / 14.0;
  return balanced < 0.95 * uniform ? blocks : 0;
}

// One block per SM (the state fills shared memory): the time goes as the waves of blocks times the tokens a
// block walks, and a split adds the local-state pass (about half a sweep) to each segment. A split must gain
// 20% to be taken (each segment's state is memory).
int64_t causal_segments(int64_t BH, int64_t N, int sms) {
  int64_t best = 1;
  double best_cost = double((BH + sms - 1) / sms) * double(N);
  for (int64_t G = 2; G <= kMaxSegments && N / G >= kMinSegmentTokens; G *= 2) {
    const int64_t per = causal_segment_tokens(N, G), used = (N + per - 1) / per;
    const double cost = double((BH * used + sms - 1) / sms) * double(per) * 1.5;
    if (cost < 0.8 * best_cost) best = used, best_cost = cost;
  }
  return best;
}

void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                    const Tensor& S0, const Tensor& out, const Tensor& S_final, int64_t segments,
                    const Tensor& states) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0 || v.size(3) == 0) return;
  const Device dev = q.device();
  if (use_chunks(q, v, spec)) {
    const Tensor qr = chunk_input(q), kr = chunk_input(k), vr = chunk_input(v), gr = chunk_input(g);
    chunk::Args a = over_tokens(chunk_args(qr, kr, vr, gr, spec), q.size(1));
    a.out = out.data();  // the state stays in registers: no memory beside the output, S_final and the boundaries
    a.S0 = S0.defined() ? S0.data_ptr<float>() : nullptr;
    a.S_final = S_final.data_ptr<float>();
    if (states.defined()) {
      LT_CHECK(states.size(2) == a.nC || states.size(2) == (a.nC + 1) / 2,
               "[fal] internal: saved chunk states for ", states.size(2), " of ", a.nC, " chunks");
      a.states = states.data();
      a.half_states = states.size(2) < a.nC;
    }
    cudaStream_t st = cuda::stream(dev.index);
    Tensor boundary = cut_pieces(a, BH, segments, dev);
    if (a.piece > 0) {
      piece_boundaries(a, q.dtype(), st, dev);
    } else {
      boundary = cut_chunks(a, BH, segments, true, dev);
      if (a.G > 1) fill_boundaries(a, BH, false, q.dtype(), st);
    }
    chunk::forward(a, q.dtype(), BH, st);
    return;
  }
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  SweepArgs a = causal_sweep_args(qc, kc, vc, gc, spec);
  a.out = out.data();
  const int64_t G = sweep_segments(BH, q.size(1), segments, dev);
  causal_sweep(a, kForward, kReduceKV, false, S0.defined() ? S0.data_ptr<float>() : nullptr,
               S_final.data_ptr<float>(), BH, G, q.dtype(), cuda::stream(dev.index), dev);
}

void causal_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const FalStepSpec& spec,
                     const Tensor& S0, const Tensor& dout, const Tensor& dS_final, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dS0, int64_t segments,
                     const Tensor& fwd_states) {
  const int64_t BH = q.size(0) * q.size(2);
  if (BH == 0) return;
  const Device dev = q.device();
  cudaStream_t st = cuda::stream(dev.index);
  if (use_chunks(q, v, spec)) {
    const Tensor qr = chunk_input(q), kr = chunk_input(k), vr = chunk_input(v), gr = chunk_input(g);
    chunk::Args a = over_tokens(chunk_args(qr, kr, vr, gr, spec), q.size(1));
    // S_c and R_(c+1) per chunk in the inputs' dtype: the only memory beside the gradients. S_c comes from the
    // forward when it saved them (then its state pass is skipped); when it saved the even chunks' only, the
    // gradient kernel advances each odd chunk's from the one before.
    const bool saved = fwd_states.defined();
    Tensor states = saved ? fwd_states : empty({BH, a.nC, a.P, a.E}, q.dtype(), dev);
    Tensor rstates = empty({BH, a.nC, a.P, a.E}, q.dtype(), dev);
    if (saved)
      LT_CHECK(states.size(2) == a.nC || states.size(2) == (a.nC + 1) / 2,
               "[fal] internal: saved chunk states for ", states.size(2), " of ", a.nC, " chunks");
    a.states = states.data();
    a.half_states = states.size(2) < a.nC;
    a.rstates = rstates.data();
    set_gradients(a, dout, dq, dk, dv, dg);
    a.S0 = S0.defined() ? S0.data_ptr<float>() : nullptr;
    a.dS_final = dS_final.defined() ? dS_final.data_ptr<float>() : nullptr;
    a.dS0 = dS0.defined() ? dS0.data_ptr<float>() : nullptr;
    const Tensor boundary = cut_chunks(a, BH, segments, false, dev);  // one buffer for both directions
    for (bool reverse : {false, true}) {
      if (!reverse && saved) continue;
      if (a.G > 1) fill_boundaries(a, BH, reverse, q.dtype(), st);
      chunk::state_pass(a, q.dtype(), BH, reverse, st);
    }
    chunk::gradients(a, q.dtype(), BH, st);
    return;
  }
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  SweepArgs a = causal_sweep_args(qc, kc, vc, gc, spec);
  set_gradient_pointers(a, dout, dq, dk, dv, dg);
  const int64_t G = sweep_segments(BH, q.size(1), segments, dev);
  causal_sweep(a, kQueryGrad, kReduceKV, false, S0.defined() ? S0.data_ptr<float>() : nullptr, nullptr, BH, G,
               q.dtype(), st, dev);
  causal_sweep(a, kKeyGrad, kReduceDKV, true, dS_final.defined() ? dS_final.data_ptr<float>() : nullptr,
               dS0.defined() ? dS0.data_ptr<float>() : nullptr, BH, G, q.dtype(), st, dev);
}

}  // namespace lintape::fal_cuda
