// Helpers of the training tests (CPU and CUDA): scratch directories, a micro config, small text corpora.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include "train/config.h"

namespace lintape::test {

// A fresh empty directory under the system's temp dir, removed at scope exit.
struct TempDir {
  explicit TempDir(const std::string& tag)
      : path(std::filesystem::temp_directory_path() / ("lintape_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::filesystem::path path;
};

inline TrainConfig micro_train_config(const std::string& data) {
  TrainConfig c;
  c.model.width = 32;
  c.model.layers = 2;
  c.model.mixers = {"fal", "tpa"};
  c.model.heads = 2;
  c.model.head_dim = 16;
  c.model.mlp_hidden = 64;
  c.model.tpa_ranks = {2, 1, 1};
  c.model.seq_len = 32;
  c.data = data;
  c.batch = 4;
  c.steps = 12;
  c.warmup = 2;
  c.lr = 3e-3;
  c.log_every = 1000;
  c.val_every = 1000;
  c.val_batches = 1;
  return c;
}

inline std::string write_text_corpus(const TempDir& dir) {
  const std::string path = dir.file("corpus.txt");
  std::ofstream out(path);
  const char* lines[] = {"the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine. ",
                         "all that glitters is not gold. ", "where there is smoke there is fire. "};
  for (int i = 0; i < 300; ++i) out << lines[(i * 7 + i / 3) % 4];
  return path;
}

// A fortunes-like corpus of documents of several lengths, between `%` lines.
inline std::string write_document_corpus(const TempDir& dir) {
  const std::string path = dir.file("fortunes");
  std::ofstream out(path);
  const char* sayings[] = {"the quick brown fox jumps over the lazy dog.\n", "a stitch in time saves nine.\n",
                           "all that glitters\nis not gold.\n", "where there is smoke there is fire.\n", "!\n"};
  for (int i = 0; i < 200; ++i) out << sayings[(i * 7 + i / 3) % 5] << "%\n";
  return path;
}

}  // namespace lintape::test
