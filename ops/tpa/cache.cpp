// TpaCache: per-sequence factor rows for decoding, in buffers that grow by whole blocks of rows.
#include <algorithm>
#include "autograd/tape.h"
#include "ops/lrpe/lrpe.h"
#include "ops/tpa/tpa.h"

namespace lintape {

namespace {

const char* const kOp = "TpaCache";

// The token of every sequence as (B, 1, rows, cols): accepts any shape of B * rows * cols elements led by
// B, so (B, rows, cols), (B, 1, rows, cols) and, for a rank of 1, (B, cols) all fit.
Tensor token_rows(const Tensor& t, const char* name, int64_t B, int64_t rows, int64_t cols, DType dtype,
                  Device device) {
  LT_CHECK(t.defined(), "[", kOp, "] ", name, " must be a defined tensor");
  LT_CHECK(t.dim() >= 2 && t.size(0) == B && t.numel() == B * rows * cols, "[", kOp, "] ", name, " must be (B, ",
           rows, ", ", cols, ") with B = ", B, " (a token axis of 1 after B is allowed); got ", shape_str(t.shape()));
  LT_CHECK(t.device() == device, "[", kOp, "] ", name, " must be on the cache's device ", device.name(), "; got ",
           t.device().name());
  LT_CHECK(is_floating(t.dtype()), "[", kOp, "] ", name, " must be a float tensor; got ", dtype_name(t.dtype()));
  return t.detach().reshape({B, 1, rows, cols}).to(dtype);
}

}  // namespace

TpaCache::TpaCache(int64_t batch, int64_t heads, int64_t rank_k, int64_t rank_v, int64_t head_dim, int64_t value_dim,
                   DType dtype, Device device, Tensor theta, int64_t block_rows)
    : batch_(batch),
      heads_(heads),
      rank_k_(rank_k),
      rank_v_(rank_v),
      head_dim_(head_dim),
      value_dim_(value_dim),
      block_rows_(block_rows),
      dtype_(dtype),
      device_(device),
      theta_(theta.defined() ? theta.detach() : Tensor()),
      lengths_(size_t(std::max<int64_t>(batch, 0)), 0) {
  const int64_t sizes[] = {batch, heads, rank_k, rank_v, head_dim, value_dim, block_rows};
  for (int64_t s : sizes)
    LT_CHECK(s >= 1, "[", kOp, "] batch, heads, ranks, dims and block_rows must be >= 1; got (", batch, ", ", heads,
             ", ", rank_k, ", ", rank_v, ", ", head_dim, ", ", value_dim, ", ", block_rows, ")");
  LT_CHECK(is_floating(dtype), "[", kOp, "] dtype must be a float type; got ", dtype_name(dtype));
  if (theta_.defined()) {
    LT_CHECK(theta_.dim() == 2 && theta_.size(0) == 1 && head_dim % 2 == 0 && theta_.size(1) <= head_dim / 2, "[",
             kOp, "] theta must be (1, E) with E <= D/2 = ", head_dim / 2, " and D even; got ",
             shape_str(theta_.shape()), " with D = ", head_dim);
    LT_CHECK(theta_.device() == device, "[", kOp, "] theta must be on the cache's device ", device.name(), "; got ",
             theta_.device().name());
  }
}

int64_t TpaCache::max_length() const { return *std::max_element(lengths_.begin(), lengths_.end()); }

int64_t TpaCache::bytes() const {
  if (capacity_ == 0) return 0;
  const int64_t per_row = heads_ * rank_k_ + rank_k_ * head_dim_ + heads_ * rank_v_ + rank_v_ * value_dim_;
  return batch_ * capacity_ * per_row * int64_t(dtype_size(dtype_));
}

void TpaCache::clear() { std::fill(lengths_.begin(), lengths_.end(), 0); }

void TpaCache::grow(int64_t rows) {
  int64_t cap = std::max(rows, 2 * capacity_);
  cap = (cap + block_rows_ - 1) / block_rows_ * block_rows_;
  Tensor* bufs[] = {&ak_, &bk_, &av_, &bv_};
  const Shape shapes[] = {{batch_, cap, heads_, rank_k_},
                          {batch_, cap, rank_k_, head_dim_},
                          {batch_, cap, heads_, rank_v_},
                          {batch_, cap, rank_v_, value_dim_}};
  for (int i = 0; i < 4; ++i) {
    Tensor next = zeros(shapes[i], dtype_, device_);
    if (capacity_ > 0) next.narrow(1, 0, capacity_).copy_(*bufs[i]);
    *bufs[i] = next;
  }
  capacity_ = cap;
}

void TpaCache::append(const Tensor& ak, const Tensor& bk, const Tensor& av, const Tensor& bv,
                      const std::vector<bool>& active) {
  const int64_t B = batch_;
  LT_CHECK(active.empty() || int64_t(active.size()) == B, "[", kOp, "] active must be empty or have B = ", B,
           " entries; got ", active.size());
  autograd::NoGradGuard no_grad;
  Tensor tok[] = {token_rows(ak, "ak", B, heads_, rank_k_, dtype_, device_),
                  token_rows(bk, "bk", B, rank_k_, head_dim_, dtype_, device_),
                  token_rows(av, "av", B, heads_, rank_v_, dtype_, device_),
                  token_rows(bv, "bv", B, rank_v_, value_dim_, dtype_, device_)};
  auto is_active = [&](int64_t b) { return active.empty() || active[size_t(b)]; };
  int64_t needed = 0;
  bool same_position = true;  // every sequence appends at one row: one copy per buffer
  for (int64_t b = 0; b < B; ++b) {
    if (is_active(b)) needed = std::max(needed, lengths_[size_t(b)] + 1);
    same_position = same_position && is_active(b) && lengths_[size_t(b)] == lengths_[0];
  }
  if (needed == 0) return;
  if (needed > capacity_) grow(needed);

  Tensor* bufs[] = {&ak_, &bk_, &av_, &bv_};
  auto store = [&](int64_t b0, int64_t count, int64_t pos) {
    for (int i = 0; i < 4; ++i) {
      Tensor src = tok[i].narrow(0, b0, count);
      // bk is rotated at the token's position; its R_k rows share the one-row theta.
      if (i == 1 && theta_.defined()) {
        LrpeOptions at;
        at.offset = pos;
        src = lrpe_rotate(src, theta_, at);
      }
      bufs[i]->narrow(0, b0, count).narrow(1, pos, 1).copy_(src);
    }
  };
  if (same_position) {
    store(0, B, lengths_[0]);
  } else {
    for (int64_t b = 0; b < B; ++b)
      if (is_active(b)) store(b, 1, lengths_[size_t(b)]);
  }
  for (int64_t b = 0; b < B; ++b)
    if (is_active(b)) ++lengths_[size_t(b)];
}

}  // namespace lintape
