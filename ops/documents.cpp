#include "documents.h"
#include <string>

namespace lintape {

Documents Documents::from_cu_seqlens(const std::vector<int64_t>& cu, int64_t batch, int64_t seq_len, Device device) {
  LT_CHECK(batch >= 0 && seq_len >= 0, "[documents] batch and seq_len must be >= 0; got ", batch, " and ", seq_len);
  const int64_t total = batch * seq_len;
  LT_CHECK(!cu.empty() && cu.front() == 0, "[documents] cu_seqlens must start at 0");
  LT_CHECK(cu.back() == total, "[documents] cu_seqlens must end at batch x seq_len = ", total, "; it ends at ",
           cu.back());
  LT_CHECK(seq_len < (int64_t(1) << 31), "[documents] seq_len ", seq_len, " does not fit the int32 starts");
  for (size_t i = 1; i < cu.size(); ++i)
    LT_CHECK(cu[i] > cu[i - 1], "[documents] cu_seqlens must increase strictly; entry ", i, " is ", cu[i],
             " after ", cu[i - 1]);
  Tensor starts = empty({batch, seq_len}, DType::I32);
  int32_t* out = starts.data_ptr<int32_t>();
  size_t next = 1;  // the entry of cu_seqlens that ends the current document
  int64_t doc_start = 0;
  for (int64_t t = 0; t < total; ++t) {
    if (t == cu[next]) doc_start = cu[next++];
    if (t % seq_len == 0)
      LT_CHECK(doc_start == t, "[documents] a document must not cross a row: cu_seqlens lacks the row start ", t,
               " (row ", t / seq_len, ")");
    out[t] = int32_t(doc_start % seq_len);
  }
  Documents docs;
  docs.starts_ = device == Device::cpu() ? starts : starts.to(device);
  return docs;
}

Documents Documents::from_starts(const Tensor& starts) {
  LT_CHECK(starts.defined() && starts.dim() == 2 && starts.dtype() == DType::I32,
           "[documents] starts must be a (B, N) int32 tensor");
  if (!starts.is_cuda()) {
    Tensor s = starts.contiguous();
    const int32_t* p = s.data_ptr<int32_t>();
    const int64_t B = s.size(0), N = s.size(1);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < N; ++t) {
        const int32_t v = p[b * N + t];
        const bool ok = t == 0 ? v == 0 : (v == p[b * N + t - 1] || v == t);
        LT_CHECK(ok, "[documents] starts[", b, ", ", t, "] = ", v, ": it must be ",
                 t == 0 ? std::string("0") : "starts[" + std::to_string(b) + ", " + std::to_string(t - 1) +
                                                 "] or " + std::to_string(t));
      }
  }
  Documents docs;
  docs.starts_ = starts;
  return docs;
}

Documents Documents::to(Device device) const {
  if (!defined() || starts_.device() == device) return *this;
  Documents docs;
  docs.starts_ = starts_.to(device);
  return docs;
}

std::vector<int32_t> Documents::host_starts() const {
  if (!defined()) return {};
  Tensor s = starts_.to(Device::cpu()).contiguous();
  const int32_t* p = s.data_ptr<int32_t>();
  return std::vector<int32_t>(p, p + s.numel());
}

void Documents::check(const char* op, int64_t batch, int64_t seq_len, Device device) const {
  if (!defined()) return;
  LT_CHECK(starts_.size(0) == batch && starts_.size(1) == seq_len, "[", op, "] documents are for ",
           shape_str(starts_.shape()), " tokens; the input has (", batch, ", ", seq_len, ")");
  LT_CHECK(starts_.device() == device, "[", op, "] documents are on ", starts_.device().name(), "; the input on ",
           device.name());
}

std::vector<int64_t> documents_cu_seqlens(const Documents& docs, int64_t batch, int64_t seq_len) {
  std::vector<int64_t> cu{0};
  const std::vector<int32_t> starts = docs.host_starts();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 1; t <= seq_len; ++t)
      if (t == seq_len || (!starts.empty() && starts[size_t(b * seq_len + t)] == t)) cu.push_back(b * seq_len + t);
  return cu;
}

double mean_causal_context(const Documents& docs, int64_t seq_len) {
  if (!docs.defined()) return 0.5 * double(seq_len);
  const std::vector<int32_t> starts = docs.host_starts();
  if (starts.empty()) return 0.0;
  double sum = 0;
  for (size_t i = 0; i < starts.size(); ++i) sum += double(int64_t(i) % seq_len - starts[i]) + 0.5;
  return sum / double(starts.size());
}

}  // namespace lintape
