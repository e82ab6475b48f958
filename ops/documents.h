// Documents: boundaries inside packed rows, the one form that every sequence op (lrpe_*, fal, tpa_attention)
// and the trainer take. A batch of B rows of N tokens may hold several documents per row; a document never
// crosses a row. Inside an op, a token sees only its own document: LRPE positions restart at each document
// start (token s of a row sits at position offset + s - start(s)), FAL's state is reset there (S0 enters each
// row's first document; S_final is the state after each row's last one) and TPA attends no key before it.
//
// The users' form is flash-attention's cumulative sequence lengths over the flattened (B x N) tokens:
// cu_seqlens = [0, l_0, l_0 + l_1, ..., B x N], which must hold every row start b x N. Kernels read the
// per-token form it is turned into: starts (B, N) int32, the index in its row where each token's document
// begins; so for j <= s, token j is in s's document iff j >= starts[b, s]. A fixed-shape tensor, so a
// captured CUDA graph can replay with new boundaries written into the same buffer.
//
// An undefined Documents (the default) means one document per row, and costs the ops nothing.
#pragma once
#include <cstdint>
#include <vector>
#include "../core/tensor.h"

namespace lintape {

class Documents {
 public:
  Documents() = default;

  // Throws, naming the entry, when cu_seqlens does not start at 0, end at batch x seq_len, increase strictly
  // or hold every row start. The starts are built on the CPU and copied to `device`.
  static Documents from_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t batch, int64_t seq_len,
                                   Device device = Device::cpu());
  // starts (B, N) int32 as above. Checked when on the CPU (starts[b, 0] == 0 and each starts[b, s] is
  // starts[b, s - 1] or s); a device tensor is taken as it is (checking it would wait for the device).
  static Documents from_starts(const Tensor& starts);

  bool defined() const { return starts_.defined(); }
  const Tensor& starts() const { return starts_; }  // (B, N) int32
  int64_t batch() const { return starts_.size(0); }
  int64_t seq_len() const { return starts_.size(1); }
  // The same boundaries with the starts on `device` (this object when they already are).
  Documents to(Device device) const;
  // The starts as a host vector (B x N, row-major); copies from the device when needed.
  std::vector<int32_t> host_starts() const;
  // Throws, naming `op`, unless defined() implies starts (batch, seq_len) int32 on `device`.
  void check(const char* op, int64_t batch, int64_t seq_len, Device device) const;

 private:
  Tensor starts_;
};

// The documents of each row as cumulative lengths over the flattened tokens (the inverse of from_cu_seqlens);
// [0, N, 2N, ..., B x N] for an undefined Documents of B rows.
std::vector<int64_t> documents_cu_seqlens(const Documents& docs, int64_t batch, int64_t seq_len);

// The mean causal context of a token: s - start(s) + 1/2 averaged over the rows' tokens, that is seq_len / 2
// for rows of one document (an undefined Documents) and about L / 2 for documents of L tokens. Causal
// attention's work per token is proportional to it (the MFU count).
double mean_causal_context(const Documents& docs, int64_t seq_len);

}  // namespace lintape
