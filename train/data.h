// Training data of docs/MODEL.md: the in-process mqar task, a text file as bytes, an llm.c .bin token file.
// Batches are (B, N) int64 tokens and targets (targets = tokens shifted by one; -1 is ignored), and with
// --documents the documents packed in the rows (train/documents.h). A source's order depends only on its
// seed and a position that the checkpoint saves, so a resumed run sees the same batches.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "../core/tensor.h"
#include "../ops/documents.h"
#include "documents.h"

namespace lintape {

struct Batch {
  Tensor tokens;        // (B, N) int64, CPU
  Tensor targets;       // (B, N) int64, CPU; -1 where there is nothing to predict
  Documents documents;  // starts (B, N) int32, CPU; undefined when the data has no documents
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual Batch next_train() = 0;
  // The i-th validation batch (the same ones every time).
  virtual Batch validation(int64_t index) const = 0;
  virtual int64_t validation_batches() const = 0;
  virtual int64_t position() const = 0;
  virtual void seek(int64_t position) = 0;
  virtual int64_t vocab_size() const = 0;
  virtual bool reports_accuracy() const { return false; }
  // How the data is cut into documents ("the fortunes' % lines: 4321 documents"); empty without documents.
  virtual std::string documents() const { return ""; }
};

// Tokens of a file: bytes for a text file; the uint16 tokens of an llm.c .bin (or .BIN) file (header of 256 int32:
// magic 20240520, version 1, token count). Errors name the file: unreadable, wrong magic or version,
// truncated. A directory gives the bytes of its plain files (not *.dat, *.u8 or links) in name order.
// vocab > 0: a token at or above it is refused, naming the file, the token, its position and the vocabulary.
std::vector<int32_t> load_tokens(const std::string& path, int64_t vocab = 0);
bool is_llmc_bin(const std::string& path);  // by the .bin extension
// The files load_tokens reads for `path`, in order: the path itself, or a directory's plain files.
std::vector<std::string> data_files(const std::string& path);

// Windows of N + 1 tokens over a token array (starting at multiples of N), drawn in a seeded shuffled order:
// each epoch visits every window once, in an order that depends only on (seed, epoch); the position is the
// count of windows drawn. The validation part is a separate array, or else the last val_fraction of the
// training tokens (never trained on), read in order.
// With documents (TokenText::first), a row holds the pieces of the documents its window covers: the batch's
// Documents start one where a document starts inside the row (the row's first token starts one too), and
// a document's last token has target -1 (its next token is another document's).
class TokenData : public DataSource {
 public:
  TokenData(std::vector<int32_t> train, std::vector<int32_t> val, int64_t batch, int64_t seq_len,
            int64_t max_val_batches, const std::string& source, uint64_t seed = 0);
  // `documents`: how they were cut, for documents() (empty: none).
  TokenData(TokenText train, TokenText val, int64_t batch, int64_t seq_len, int64_t max_val_batches,
            const std::string& source, uint64_t seed, const std::string& documents);
  Batch next_train() override;
  Batch validation(int64_t index) const override;
  int64_t validation_batches() const override { return val_batches_; }
  int64_t position() const override { return position_; }
  void seek(int64_t position) override;
  int64_t vocab_size() const override { return vocab_; }
  std::string documents() const override { return documents_; }

 private:
  // The rows starting at these token indices of `text`.
  Batch rows(const TokenText& text, const std::vector<int64_t>& starts) const;
  int64_t window(int64_t drawn) const;  // the index of the drawn-th training window
  TokenText train_, val_;
  int64_t batch_, seq_len_, val_batches_, vocab_ = 256, position_ = 0, windows_ = 0;
  uint64_t seed_;
  std::string documents_;
};

// mqar: P key-value pairs (keys in [0, 128), values in [128, 256)), then queries of those keys, each
// followed by its value; only the answer positions are targets. Batch i depends only on (seed, i).
class MqarData : public DataSource {
 public:
  MqarData(int64_t batch, int64_t seq_len, uint64_t seed, int64_t val_batches = 4);
  Batch next_train() override { return make(position_++, false); }
  Batch validation(int64_t index) const override { return make(index, true); }
  int64_t validation_batches() const override { return val_batches_; }
  int64_t position() const override { return position_; }
  void seek(int64_t position) override { position_ = position; }
  int64_t vocab_size() const override { return 256; }
  bool reports_accuracy() const override { return true; }

 private:
  Batch make(int64_t index, bool validation) const;
  int64_t batch_, seq_len_, val_batches_, position_ = 0;
  uint64_t seed_;
};

// "mqar" or a file path (text or .bin); val_path may be empty (then the held-out tail of the file). vocab > 0:
// the files' tokens are checked against it (load_tokens). `split` on: both files are cut into documents
// (load_documents); refused for mqar.
std::unique_ptr<DataSource> open_data(const std::string& data, const std::string& val_path, int64_t batch,
                                      int64_t seq_len, uint64_t seed, int64_t val_batches = 4, int64_t vocab = 0,
                                      double val_fraction = 0.05, const DocumentSplit& split = {});

}  // namespace lintape
