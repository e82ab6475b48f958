#include "train/data.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "core/error.h"

namespace lintape {

namespace {
constexpr int32_t kLlmcMagic = 20240520;
constexpr int64_t kLlmcHeaderInts = 256;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "[data] cannot read the data file '", path, "': ", std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
}  // namespace

bool is_llmc_bin(const std::string& path) {
  if (path.size() <= 4) return false;
  std::string ext = path.substr(path.size() - 4);
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return ext == ".bin";  // any case: .BIN too
}

namespace {

// A token at or above the model's vocabulary would index past the embedding: refused with the file named.
void check_vocab(const std::vector<int32_t>& tokens, int64_t vocab, const std::string& path) {
  if (vocab <= 0) return;
  const auto bad = std::find_if(tokens.begin(), tokens.end(), [&](int32_t t) { return int64_t(t) >= vocab; });
  LT_CHECK(bad == tokens.end(), "[data] '", path, "' holds token ", bad == tokens.end() ? 0 : *bad, " at position ",
           bad - tokens.begin(), "; the model's vocabulary has ", vocab, " tokens (0..", vocab - 1, ")");
}

}  // namespace

std::vector<std::string> data_files(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return {path};
  // A corpus directory (the fortunes package): its plain files in name order, skipping strfile's
  // .dat indexes and the links it installs.
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    const std::string name = entry.path().string();
    if (entry.is_regular_file() && !entry.is_symlink() && entry.path().extension() != ".dat" &&
        entry.path().extension() != ".u8")
      files.push_back(name);
  }
  std::sort(files.begin(), files.end());
  LT_CHECK(!files.empty(), "[data] the data directory '", path, "' holds no text files");
  return files;
}

std::vector<int32_t> load_tokens(const std::string& path, int64_t vocab) {
  if (std::filesystem::is_directory(path)) {
    std::vector<int32_t> tokens;
    for (const std::string& f : data_files(path)) {
      const std::vector<int32_t> part = load_tokens(f, vocab);
      tokens.insert(tokens.end(), part.begin(), part.end());
    }
    return tokens;
  }
  const std::string bytes = read_file(path);
  std::vector<int32_t> tokens;
  if (!is_llmc_bin(path)) {
    tokens.reserve(bytes.size());
    for (char c : bytes) tokens.push_back(int32_t(static_cast<unsigned char>(c)));
    check_vocab(tokens, vocab, path);
    return tokens;
  }
  const size_t header_bytes = kLlmcHeaderInts * sizeof(int32_t);
  LT_CHECK(bytes.size() >= header_bytes, "[data] '", path, "' is truncated: ", bytes.size(),
           " bytes, shorter than the llm.c header of ", header_bytes);
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  LT_CHECK(header[0] == kLlmcMagic, "[data] '", path, "' is not an llm.c token file: magic ", header[0],
           "; expected ", kLlmcMagic);
  LT_CHECK(header[1] == 1, "[data] '", path, "': llm.c version ", header[1], "; expected 1");
  const size_t count = size_t(uint32_t(header[2]));
  LT_CHECK(bytes.size() >= header_bytes + 2 * count, "[data] '", path, "' is truncated: the header promises ",
           count, " tokens, the file holds ", (bytes.size() - header_bytes) / 2);
  tokens.resize(count);
  for (size_t i = 0; i < count; ++i) {
    uint16_t t;
    std::memcpy(&t, bytes.data() + header_bytes + 2 * i, 2);
    tokens[i] = int32_t(t);
  }
  check_vocab(tokens, vocab, path);
  return tokens;
}

TokenData::TokenData(std::vector<int32_t> train, std::vector<int32_t> val, int64_t batch, int64_t seq_len,
                     int64_t max_val_batches, const std::string& source, uint64_t seed)
    : TokenData(TokenText{std::move(train), {}}, TokenText{std::move(val), {}}, batch, seq_len, max_val_batches,
                source, seed, "") {}

TokenData::TokenData(TokenText train, TokenText val, int64_t batch, int64_t seq_len, int64_t max_val_batches,
                     const std::string& source, uint64_t seed, const std::string& documents)
    : train_(std::move(train)), val_(std::move(val)), batch_(batch), seq_len_(seq_len), seed_(seed) {
  LT_CHECK(batch > 0 && seq_len > 0, "[data] batch and seq must be positive; got batch ", batch, ", seq ", seq_len);
  LT_CHECK(int64_t(train_.tokens.size()) >= seq_len + 1, "[data] --seq ", seq_len, " is longer than the data: '",
           source, "' has ", train_.tokens.size(), " training tokens, and a sequence needs seq + 1");
  for (int32_t t : train_.tokens) vocab_ = std::max<int64_t>(vocab_, int64_t(t) + 1);
  windows_ = (int64_t(train_.tokens.size()) - 1) / seq_len;
  const int64_t windows = int64_t(val_.tokens.size()) / (seq_len + 1);
  val_batches_ = std::min(max_val_batches, windows / batch);
  if (val_batches_ == 0 && windows > 0) val_batches_ = 1;
  if (!documents.empty()) {
    const int64_t count = train_.documents();
    documents_ = str(documents, ": ", count, " documents of ", train_.tokens.size() / size_t(count),
                     " tokens on average");
  }
}

Batch TokenData::rows(const TokenText& text, const std::vector<int64_t>& starts) const {
  const int64_t N = seq_len_, B = int64_t(starts.size());
  const bool docs = !text.first.empty();
  std::vector<int64_t> in(size_t(B * N)), out(size_t(B * N));
  Tensor doc_starts = docs ? empty({B, N}, DType::I32) : Tensor();
  int32_t* row_starts = docs ? doc_starts.data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const size_t c = size_t(starts[size_t(b)]);
    int32_t start = 0;
    for (int64_t j = 0; j < N; ++j) {
      const size_t t = c + size_t(j);
      in[size_t(b * N + j)] = text.tokens[t];
      out[size_t(b * N + j)] = text.tokens[t + 1];
      if (!docs) continue;
      if (j > 0 && text.first[t]) start = int32_t(j);
      row_starts[b * N + j] = start;
      if (text.first[t + 1]) out[size_t(b * N + j)] = -1;  // the document ends at t: nothing of it to predict
    }
  }
  return {from_vector_i64(in, {B, N}), from_vector_i64(out, {B, N}),
          docs ? Documents::from_starts(doc_starts) : Documents()};
}

int64_t TokenData::window(int64_t drawn) const {
  // Epoch e visits every window once in the order i -> (a i + b) mod W, with a coprime to W and a, b drawn
  // from (seed, e): no state beyond the count of windows drawn, which the checkpoint saves.
  const uint64_t W = uint64_t(windows_), epoch = uint64_t(drawn) / W, i = uint64_t(drawn) % W;
  if (W == 1) return 0;
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + epoch);
  uint64_t a = 1 + rng() % (W - 1);
  while (std::gcd(a, W) != 1) a = a % (W - 1) + 1;
  const uint64_t b = rng() % W;
  return int64_t((static_cast<unsigned __int128>(a) * i + b) % W);
}

Batch TokenData::next_train() {
  std::vector<int64_t> starts(static_cast<size_t>(batch_));
  for (int64_t b = 0; b < batch_; ++b) starts[size_t(b)] = window(position_++) * seq_len_;
  return rows(train_, starts);
}

Batch TokenData::validation(int64_t index) const {
  LT_CHECK(index >= 0 && index < val_batches_, "[data] validation batch ", index, " out of range [0, ", val_batches_,
           ")");
  // Consecutive windows from index x B x N on, back to the start where one would pass the end.
  const int64_t N = seq_len_, total = int64_t(val_.tokens.size());
  int64_t cursor = index * batch_ * N;
  std::vector<int64_t> starts(static_cast<size_t>(batch_));
  for (int64_t b = 0; b < batch_; ++b) {
    if (cursor + N + 1 > total) cursor = 0;
    starts[size_t(b)] = cursor;
    cursor += N;
  }
  return rows(val_, starts);
}

void TokenData::seek(int64_t position) {
  LT_CHECK(position >= 0, "[data] position ", position, " must not be negative");
  position_ = position;
}

MqarData::MqarData(int64_t batch, int64_t seq_len, uint64_t seed, int64_t val_batches)
    : batch_(batch), seq_len_(seq_len), val_batches_(val_batches), seed_(seed) {
  LT_CHECK(batch > 0, "[mqar] batch must be positive; got ", batch);
  LT_CHECK(seq_len >= 8, "[mqar] seq must be at least 8; got ", seq_len);
  int64_t tokens = 0;
  LT_CHECK(!__builtin_mul_overflow(batch, seq_len, &tokens), "[mqar] batch x seq overflows: ", batch, " x ", seq_len);
}

Batch MqarData::make(int64_t index, bool validation) const {
  // Validation batches come from a stream of their own, never trained on.
  std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + uint64_t(index) * 2 + (validation ? 1 : 0));
  const int64_t N = seq_len_, pairs = std::min<int64_t>(N / 4, 64);
  std::vector<int64_t> in(size_t(batch_ * N)), out(size_t(batch_ * N), -1);
  std::vector<int64_t> keys(128);
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t k = 0; k < 128; ++k) keys[size_t(k)] = k;
    std::shuffle(keys.begin(), keys.end(), rng);
    std::vector<int64_t> values(static_cast<size_t>(pairs));
    int64_t* row = &in[size_t(b * N)];
    int64_t* target = &out[size_t(b * N)];
    for (int64_t p = 0; p < pairs; ++p) {
      values[size_t(p)] = 128 + int64_t(rng() % 128);
      row[2 * p] = keys[size_t(p)];
      row[2 * p + 1] = values[size_t(p)];
    }
    for (int64_t j = 2 * pairs; j + 1 < N; j += 2) {
      const int64_t p = int64_t(rng() % uint64_t(pairs));
      row[j] = keys[size_t(p)];
      row[j + 1] = values[size_t(p)];
      target[j] = values[size_t(p)];
    }
    if (N % 2 == 1) row[N - 1] = 0;
  }
  return {from_vector_i64(in, {batch_, N}), from_vector_i64(out, {batch_, N}), Documents()};
}

std::unique_ptr<DataSource> open_data(const std::string& data, const std::string& val_path, int64_t batch,
                                      int64_t seq_len, uint64_t seed, int64_t val_batches, int64_t vocab,
                                      double val_fraction, const DocumentSplit& split) {
  if (data == "mqar") {
    LT_CHECK(!split.on(), "[data] --documents does not apply to mqar: its rows are generated, each one sequence");
    return std::make_unique<MqarData>(batch, seq_len, seed, val_batches);
  }
  auto load = [&](const std::string& path, std::string* how) {
    return split.on() ? load_documents(path, split, vocab, how) : TokenText{load_tokens(path, vocab), {}};
  };
  std::string documents;
  TokenText train = load(data, &documents), val;
  if (!val_path.empty()) {
    val = load(val_path, nullptr);
    LT_CHECK(int64_t(val.tokens.size()) >= seq_len + 1, "[data] the validation file '", val_path, "' has ",
             val.tokens.size(), " tokens; a sequence of --seq ", seq_len, " needs ", seq_len + 1);
  } else {
    const size_t held_out = size_t(double(train.tokens.size()) * val_fraction), keep = train.tokens.size() - held_out;
    val = tail(train, keep);
    train.tokens.resize(keep);
    if (!train.first.empty()) train.first.resize(keep);
  }
  return std::make_unique<TokenData>(std::move(train), std::move(val), batch, seq_len, val_batches, data, seed,
                                     documents);
}

}  // namespace lintape
