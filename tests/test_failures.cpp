// What a user meets when something goes wrong: absurd sizes, edited or corrupt checkpoints, bad data
// files, a diverging run, SIGTERM and SIGINT; and a seeded fuzz of the loaders (state.json, safetensors,
// llm.c .bin) that must refuse every mutation with a lintape::Error, never crash, and stay within a time bound.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include "core/safetensors.h"
#include "helpers.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/progress.h"
#include "train/trainer.h"
#include "train_helpers.h"

using namespace lintape;
using namespace lintape::test;
namespace fs = std::filesystem;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// An llm.c token file: the 256-int32 header, then `count` uint16 tokens 0, 1, 2, ... modulo 256.
std::string llmc_bytes(int32_t count) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  for (int32_t i = 0; i < count; ++i) {
    const uint16_t t = uint16_t(i % 256);
    bytes.append(reinterpret_cast<const char*>(&t), 2);
  }
  return bytes;
}

// A checkpoint of the micro model after 2 steps on mqar; returns its step directory.
std::string micro_checkpoint(const TempDir& dir) {
  TrainConfig c = micro_train_config("mqar");
  c.steps = 2;
  Trainer(c, {Device::cpu(), "", dir.file("ckpt")}).run();
  return dir.file("ckpt/step_00000002");
}

}  // namespace

TEST_CASE("failures: sizes are checked against overflow and memory before anything is built") {
  TrainConfig c = micro_train_config("mqar");
  c.batch = int64_t(1) << 60;
  check_throws_containing([&] { validate_with_sizes(c); }, {"batch x seq_len overflows", "beyond 2^63"});
  c.batch = 1000000000;
  check_throws_containing([&] { validate_with_sizes(c); }, {"batch 1000000000", "at least", "bytes of activations"});
  c = micro_train_config("mqar");
  c.model.layers = int64_t(1) << 40;
  check_throws_containing([&] { validate_with_sizes(c); }, {"bytes for its weights"});
  c.model.width = int64_t(1) << 62;
  check_throws_containing([&] { validate_with_sizes(c); }, {"overflows"});
  // A config file: the error names the file and what it would need.
  check_throws_containing([] { train_config_from_json(R"({"model": {"width": 1000000}})", "big.json"); },
                          {"big.json", "would need", "bytes"});
  check_throws_containing([] { train_config_from_json(R"({"batch": 4611686018427387904})", "b.json"); },
                          {"b.json", "overflows"});
  // The presets pass, with estimates in a sane range.
  for (const char* name : {"tiny", "small"}) {
    const TrainConfig p = TrainConfig::preset(name);
    CHECK_NOTHROW(validate_with_sizes(p));
    const SizeEstimate e = estimate_sizes(p.model, p.batch);
    CHECK(e.tokens == p.batch * p.model.seq_len);
    CHECK(e.parameter_bytes > 0);
    CHECK(e.activation_bytes > 0);
  }
  // The mqar source checks its own product too.
  check_throws_containing([] { MqarData(int64_t(1) << 60, 256, 0); }, {"[mqar] batch x seq overflows"});
}

TEST_CASE("failures: an edited state.json is refused naming it before anything is allocated, and old ones load") {
  TempDir dir("failures_state");
  const std::string step = micro_checkpoint(dir);
  const std::string state_path = step + "/state.json";
  const std::string original = read_all(state_path);
  nlohmann::json doc = nlohmann::json::parse(original);
  REQUIRE(doc.contains("state_sha256"));

  // Edited with the checksum left: the checksum refuses it.
  doc["config"]["model"]["layers"] = int64_t(1) << 40;
  write_all(state_path, doc.dump(2));
  check_throws_containing([&] { load_checkpoint(dir.file("ckpt")); }, {"state.json", "edited or corrupted"});
  // Edited and the checksum removed: the validation refuses it, naming state.json and the bytes.
  doc.erase("state_sha256");
  write_all(state_path, doc.dump(2));
  check_throws_containing([&] { load_checkpoint(dir.file("ckpt")); }, {"state.json", "would need", "bytes"});
  doc["config"]["model"]["layers"] = 2;
  doc["config"]["model"]["width"] = 100000000;
  write_all(state_path, doc.dump(2));
  check_throws_containing([&] { load_checkpoint_state(dir.file("ckpt")); }, {"state.json", "would need"});
  doc["config"]["model"]["width"] = 32;
  doc["train"]["data_position"] = -5;
  write_all(state_path, doc.dump(2));
  check_throws_containing([&] { load_checkpoint(dir.file("ckpt")); }, {"state.json", "data_position"});

  // A checkpoint written before the checksum (no state_sha256) still loads; so does the original.
  nlohmann::json old = nlohmann::json::parse(original);
  old.erase("state_sha256");
  write_all(state_path, old.dump(2));
  CHECK(load_checkpoint(dir.file("ckpt")).state.step == 2);
  write_all(state_path, original);
  const Checkpoint ok = load_checkpoint(dir.file("ckpt"));
  CHECK(ok.state.step == 2);
  CHECK(!ok.model.empty());
}

TEST_CASE("failures: data files: .BIN is llm.c's format, a short --val-data is refused naming it") {
  TempDir dir("failures_data");
  write_all(dir.file("upper.BIN"), llmc_bytes(300));
  CHECK(is_llmc_bin(dir.file("upper.BIN")));
  CHECK(load_tokens(dir.file("upper.BIN")).size() == 300);
  CHECK(!is_llmc_bin(dir.file("bin")));
  const std::string corpus = write_text_corpus(dir);
  write_all(dir.file("val.txt"), "too short");
  check_throws_containing([&] { open_data(corpus, dir.file("val.txt"), 2, 32, 0); },
                          {"validation file", "val.txt", "--seq 32"});
  check_throws_containing([&] { open_data(corpus, dir.file("none.txt"), 2, 32, 0); }, {"none.txt"});
}

// Each mutation runs the loader; it must return or throw lintape::Error, within the time bound. The seed
// of each is printed on failure (rerun one with LINTAPE_FUZZ_SEED=<seed>).
TEST_CASE("failures: loader fuzz over checkpoint files and llm.c token files") {
  TempDir dir("failures_fuzz");
  const std::string step = micro_checkpoint(dir);
  const std::string state_path = step + "/state.json", model_path = step + "/model.safetensors";
  const std::string state = read_all(state_path), model = read_all(model_path);
  nlohmann::json unsummed = nlohmann::json::parse(state);
  unsummed.erase("state_sha256");  // reaches the config's validation instead of stopping at the checksum
  const std::string state_unsummed = unsummed.dump(2);
  const std::string bin = llmc_bytes(200);
  const std::string bin_path = dir.file("fuzz.bin");

  const char* only = std::getenv("LINTAPE_FUZZ_SEED");
  const uint64_t first = only ? std::stoull(only) : 1, last = only ? first : 300;
  const auto bound = std::chrono::seconds(5);  // a healthy load takes milliseconds, even under the sanitizers
  for (uint64_t seed = first; seed <= last; ++seed) {
    std::mt19937_64 rng(seed);
    const int target = int(seed % 4);  // state.json, state.json without checksum, safetensors, .bin
    std::string bytes = target == 0 ? state : target == 1 ? state_unsummed : target == 2 ? model : bin;
    const int kind = int(rng() % 4);
    const size_t at = size_t(rng() % bytes.size());
    if (kind == 0) {  // flip a few bytes
      for (int i = 0; i < 1 + int(rng() % 4); ++i) bytes[size_t(rng() % bytes.size())] ^= char(1 << (rng() % 8));
    } else if (kind == 1) {  // truncate
      bytes.resize(at);
    } else if (kind == 2) {  // a digit run spliced in: huge numbers in JSON and headers
      bytes.insert(at, std::string(1 + rng() % 24, char('0' + rng() % 10)));
    } else {  // a number overwritten with an extreme value
      const char* values[] = {"-1", "0", "9223372036854775807", "1e308", "-9223372036854775808", "4294967295"};
      const std::string v = values[rng() % 6];
      bytes.replace(at, std::min(v.size(), bytes.size() - at), v);
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      if (target <= 1) {
        write_all(state_path, bytes);
        load_checkpoint(dir.file("ckpt"));
      } else if (target == 2) {
        write_all(model_path, bytes);
        load_safetensors(model_path);
      } else {
        write_all(bin_path, bytes);
        load_tokens(bin_path);
      }
    } catch (const Error&) {  // refused: what a loader should do with a corrupt file
    }
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK_MESSAGE(took < bound, "loader fuzz seed " << seed << " (target " << target << ", mutation " << kind
                                                    << ") took over " << bound.count() << " s");
    write_all(state_path, state);
    write_all(model_path, model);
  }
  CHECK(load_checkpoint(dir.file("ckpt")).state.step == 2);  // the restored checkpoint still loads
}

TEST_CASE("failures: helpers for the run: a checkpoint directory checked before training, ETA in words") {
  TempDir dir("failures_helpers");
  CHECK_NOTHROW(check_checkpoint_dir_writable(dir.file("new/ckpt")));
  CHECK(fs::is_directory(dir.file("new/ckpt")));
  CHECK(fs::is_empty(dir.file("new/ckpt")));  // the probe is gone
  write_all(dir.file("a_file"), "x");
  check_throws_containing([&] { check_checkpoint_dir_writable(dir.file("a_file/ckpt")); },
                          {"cannot create the checkpoint directory", "a_file/ckpt"});
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir.file("ro"));
    fs::permissions(dir.file("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    check_throws_containing([&] { check_checkpoint_dir_writable(dir.file("ro")); },
                            {"cannot write in the checkpoint directory", "ro"});
    fs::permissions(dir.file("ro"), fs::perms::owner_all);
  }
  CHECK(format_duration(0) == "0 s");
  CHECK(format_duration(45.4) == "45 s");
  CHECK(format_duration(185) == "3 min 05 s");
  CHECK(format_duration(14597) == "4 h 03 min");
  CHECK(format_duration(2 * 86400 + 5 * 3600 + 10) == "2 d 05 h");
  CHECK(format_duration(-1) == "?");
  CHECK(format_duration(std::nan("")) == "?");
  CHECK(format_duration(1e300) == "1157407 d 09 h");
}

TEST_CASE("failures: a failed checkpoint write removes its temporary folder and keeps the last good one") {
  TempDir dir("failures_save");
  micro_checkpoint(dir);
  TrainConfig c = micro_train_config("mqar");
  LanguageModel model(c.model, 0);
  const std::string before = read_all(dir.file("ckpt/latest"));
  // An optimizer state holding an undefined tensor cannot be written: the save fails midway.
  CHECK_THROWS(save_checkpoint(dir.file("ckpt"), model, {{"m.x", Tensor()}}, c, {3, 0}, 3));
  CHECK(!fs::exists(dir.file("ckpt/.tmp_step_00000003")));
  CHECK(read_all(dir.file("ckpt/latest")) == before);
  CHECK(load_checkpoint(dir.file("ckpt")).state.step == 2);
}

TEST_CASE("failures: file windows come in a seeded shuffled order that a position replays") {
  std::vector<int32_t> tokens(1 + 8 * 50);  // 50 windows of 8 (+1) tokens; window w starts with token w
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i / 8);
  auto starts = [&](uint64_t seed, int64_t from, int64_t count) {
    TokenData d(tokens, {}, 1, 8, 0, "t", seed);
    d.seek(from);
    std::vector<int64_t> out;
    for (int64_t i = 0; i < count; ++i) {
      out.push_back(d.next_train().tokens.to_vector<int64_t>()[0]);
    }
    return out;
  };
  const std::vector<int64_t> epoch = starts(7, 0, 50);
  std::vector<int64_t> sorted = epoch;
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());  // every window once an epoch
  CHECK(sorted.size() == 50);
  CHECK(sorted.back() == 49);
  CHECK(epoch != sorted);  // not the file's order
  CHECK(starts(7, 0, 50) == epoch);  // the same seed, the same order
  CHECK(starts(8, 0, 50) != epoch);  // another seed, another order
  const std::vector<int64_t> run = starts(7, 0, 130);
  CHECK(starts(7, 37, 93) == std::vector<int64_t>(run.begin() + 37, run.end()));  // a resumed position replays
}

TEST_CASE("failures: an older checkpoint of a file run resumes at the window its token offset had reached") {
  TempDir dir("failures_oldpos");
  TrainConfig c = micro_train_config(write_text_corpus(dir));
  c.steps = 1;
  Trainer(c, {Device::cpu(), "", dir.file("ckpt")}).run();
  const std::string state_path = dir.file("ckpt/step_00000001/state.json");
  nlohmann::json doc = nlohmann::json::parse(read_all(state_path));
  CHECK(load_checkpoint_state(dir.file("ckpt")).state.data_position == c.batch);  // windows drawn
  doc.erase("state_sha256");  // written before the checksum and the shuffled order
  doc["train"]["rng"]["kind"] = "data batches depend only on (seed, position)";
  doc["train"]["data_position"] = 10 * c.model.seq_len;
  write_all(state_path, doc.dump(2));
  CHECK(load_checkpoint_state(dir.file("ckpt")).state.data_position == 10);
}

TEST_CASE("failures: a diverging run writes no checkpoint from weights that give NaN, and the last good one loads") {
  TempDir dir("failures_nan");
  micro_checkpoint(dir);
  TrainConfig c = micro_train_config("mqar");
  c.steps = 3;
  c.lr = 1e30;  // one finite step leaves weights of about 1e29: the next forward is NaN
  c.checkpoint_every = 1;
  const TrainResult r = Trainer(c, {Device::cpu(), "", dir.file("ckpt")}).run();
  CHECK(r.stopped_nonfinite);
  CHECK(r.message.find("the weights after step 1 give a loss of") != std::string::npos);
  CHECK(r.message.find("is the last good one") != std::string::npos);
  CHECK(read_all(dir.file("ckpt/latest")).find("step_00000002") == 0);
  const Checkpoint good = load_checkpoint(dir.file("ckpt"));
  CHECK(good.state.step == 2);
  // Weights that are not finite (written before this check existed) are refused naming the tensor.
  LanguageModel model(c.model, 0);
  model.norm.weight.detach().fill_(std::nan(""));
  save_checkpoint(dir.file("bad"), model, good.optim, c, {2, 0}, 3);
  check_throws_containing([&] { load_checkpoint(dir.file("bad")); },
                          {"bad/step_00000002/model.safetensors", "norm.weight", "nan", "diverged"});
}

TEST_CASE("failures: SIGTERM and SIGINT write a checkpoint and return the signal") {
  for (const int signal : {SIGTERM, SIGINT}) {
    CAPTURE(signal);
    TempDir dir("failures_signal");
    TrainConfig c = micro_train_config("mqar");
    c.steps = 100000;
    Trainer trainer(c, {Device::cpu(), "", dir.file("ckpt")});
    std::thread sender([signal] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ::kill(::getpid(), signal);
    });
    const TrainResult r = trainer.run();
    sender.join();
    CHECK(r.interrupted);
    CHECK(r.signal == signal);
    CHECK(r.message.find(signal == SIGTERM ? "SIGTERM at step" : "SIGINT at step") != std::string::npos);
    CHECK(r.last_step < c.steps);
    CHECK(load_checkpoint(dir.file("ckpt")).state.step == r.last_step);
  }
}

TEST_CASE("failures: without validation data no val_loss is logged, and a smaller total on resume is refused") {
  TempDir dir("failures_noval");
  write_all(dir.file("short.txt"), std::string(200, 'a'));
  TrainConfig c = micro_train_config(dir.file("short.txt"));
  c.steps = 2;
  c.batch = 4;
  std::ostringstream progress;
  const TrainResult r = Trainer(c, {Device::cpu(), dir.file("log.jsonl"), dir.file("ckpt"), false, &progress}).run();
  CHECK(r.val_loss < 0);
  CHECK(progress.str().find("no validation data") != std::string::npos);
  CHECK(progress.str().find("val_loss") == std::string::npos);
  CHECK(read_all(dir.file("log.jsonl")).find("val_loss") == std::string::npos);
  CHECK(nlohmann::json::parse(read_all(dir.file("log.summary.json"))).at("val_loss").is_null());
  c.steps = 1;
  check_throws_containing([&] { Trainer(c, {Device::cpu(), "", dir.file("ckpt"), true}); },
                          {"1 steps is below the checkpoint's total of 2", "ckpt/step_00000002"});
}

TEST_CASE("failures: a token beyond the vocabulary is refused naming the file, the token and the vocabulary") {
  TempDir dir("failures_vocab");
  std::string bytes = llmc_bytes(100);
  const uint16_t big = 300;
  std::memcpy(&bytes[256 * 4 + 2 * 7], &big, 2);
  write_all(dir.file("big.bin"), bytes);
  check_throws_containing([&] { load_tokens(dir.file("big.bin"), 256); },
                          {"big.bin", "token 300 at position 7", "256 tokens"});
  CHECK(load_tokens(dir.file("big.bin")).size() == 100);  // no vocabulary: no check
  check_throws_containing([&] { open_data(dir.file("big.bin"), "", 1, 16, 0, 4, 256); }, {"big.bin", "token 300"});
}
